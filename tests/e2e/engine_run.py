"""One vLLM engine run for the end-to-end tests (a child process per engine).

Usage: python tests/e2e/engine_run.py SPEC_JSON OUT_JSON

SPEC_JSON: {"model": dir, "prompts": [[token ids], ...], "max_tokens": n,
"logprobs": k, "tier": "none" | "fstier" | "fs" | "both", "root": dir,
"roots": {"fs": dir, "fstier": dir} (for "both"),
"tp": 1, "env": {name: value}, "cpu_bytes": n, "max_model_len": n,
"warmup": bool, "wait_files": n, "hold_file": path, "ready_file": path,
"trace": dir (a timeline of the tiers' calls, tests/e2e/_trace.py),
"py_spy": {"bin": path, "out": file, "rate": Hz, "native": bool} (a py-spy
profile of the measured prompts, 0.3 s apart)}.
With "wait_files", the engine keeps stepping (one-token requests on an
unrelated prompt) until n block files exist under "root" (or each of
"roots"; at most "wait_files_s", default 120 s, else it fails): a tier
stores in the background, one scheduler step at a time, after the request.
With "hold_file", the engine writes "ready_file" after that and waits until
"hold_file" exists before it exits (two engines alive at once).

OUT_JSON gets, per prompt, the generated token ids, their logprobs (rounded
to 4 decimals), ``num_cached_tokens``; plus the engine id and the stats the
tier reported (FstierTier's metrics snapshot when "tier" is "fstier").
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _harness  # noqa: E402 - beside this file, run as a script

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")


def transfer_config(spec: dict) -> dict | None:
    tier = spec["tier"]
    roots = spec["roots"] if tier == "both" else {tier: spec.get("root")}
    try:
        return _harness.transfer_config(tier, roots, int(spec.get("cpu_bytes", 64 << 20)))
    except ValueError as exc:
        raise SystemExit(f"engine_run: {exc}") from None


def _install_trace():  # noqa: ANN202 - the _trace module or None
    """tests/e2e/_trace.py's wrappers in this process when FSTIER_E2E_TRACE
    names a directory: the driver, and vLLM's engine core, which (spawned)
    runs this file again as ``__mp_main__``."""
    where = os.environ.get("FSTIER_E2E_TRACE")
    if not where:
        return None
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import _trace

    _trace.install(where)
    return _trace


def start_py_spy(opts: dict | None) -> subprocess.Popen | None:
    """``py-spy record`` of this process from now on (every thread, idle
    ones too, in speedscope's format: samples in time order), for
    {"bin": py-spy, "out": file, "rate": Hz, "native": bool}; None without opts."""
    if not opts:
        return None
    cmd = [opts["bin"], "record", "--pid", str(os.getpid()), "--rate", str(opts.get("rate", 1000)),
           "--idle", "--threads", "--format", "speedscope", "-o", opts["out"]]
    cmd += ["--native"] if opts.get("native") else ["--nonblocking"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    time.sleep(2.0)  # attached and sampling
    return proc


def block_files(root: str) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in Path(root).rglob("*.bin"))


def main() -> None:
    import logging

    logging.basicConfig(level=logging.WARNING, format="%(name)s %(levelname)s %(message)s")
    logging.getLogger("fstier").setLevel(logging.INFO)
    spec = json.loads(Path(sys.argv[1]).read_text())
    out_path = Path(sys.argv[2])
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    if spec.get("trace"):  # a timeline of the tiers' calls (tests/e2e/_trace.py)
        os.environ["FSTIER_E2E_TRACE"] = spec["trace"]  # the engine core, spawned, too
    trace = _install_trace()
    kw: dict = {}
    ktc = transfer_config(spec)
    if ktc is not None:
        from vllm.config import KVTransferConfig

        kw["kv_transfer_config"] = KVTransferConfig(**ktc)
    t0 = time.perf_counter()
    llm = LLM(
        model=spec["model"],
        tokenizer=spec["model"],
        dtype="bfloat16",
        enforce_eager=True,
        max_model_len=int(spec.get("max_model_len", 4096)),
        gpu_memory_utilization=0.2,
        tensor_parallel_size=int(spec.get("tp", 1)),
        seed=0,
        **kw,
    )
    started = time.perf_counter() - t0
    params = SamplingParams(
        temperature=0.0, max_tokens=int(spec["max_tokens"]), logprobs=spec.get("logprobs"),
        ignore_eos=True,
    )
    if spec.get("warmup"):  # a first request outside the measurements
        llm.generate([TokensPrompt(prompt_token_ids=[9, 8, 7, 6])], params, use_tqdm=False)
    spy = start_py_spy(spec.get("py_spy"))
    results = []
    for i, ids in enumerate(spec["prompts"]):
        if spy is not None:
            time.sleep(0.3)  # an idle gap between prompts in the profile's timeline
        if trace is not None:
            trace.mark("prompt.start", [i, len(ids)])
        t1 = time.perf_counter()
        (out,) = llm.generate([TokensPrompt(prompt_token_ids=ids)], params, use_tqdm=False)
        if trace is not None:
            trace.mark("prompt.end", [i, len(ids)])
        comp = out.outputs[0]
        lps = None
        if comp.logprobs is not None:
            lps = [round(float(step[tok].logprob), 4) for tok, step in zip(comp.token_ids, comp.logprobs, strict=True)]
        results.append({
            "tokens": list(comp.token_ids),
            "logprobs": lps,
            "num_cached_tokens": out.num_cached_tokens,
            "seconds": time.perf_counter() - t1,
        })
    if spy is not None:
        time.sleep(0.3)
        spy.send_signal(signal.SIGINT)
        spy.wait(timeout=60)
    want = int(spec.get("wait_files", 0))
    if want:
        roots = list(spec["roots"].values()) if spec.get("roots") else [spec["root"]]
        poke = SamplingParams(temperature=0.0, max_tokens=1)
        deadline = time.monotonic() + float(spec.get("wait_files_s", 120))
        while min(len(block_files(r)) for r in roots) < want:
            if time.monotonic() > deadline:
                counts = {r: len(block_files(r)) for r in roots}
                raise SystemExit(f"engine_run: block files {counts} after the deadline, expected {want}")
            llm.generate([TokensPrompt(prompt_token_ids=[5, 6, 7])], poke, use_tqdm=False)
            time.sleep(0.2)
    if trace is not None:
        trace.dump("driver")
        trace.dump_children()
    record = {
        "results": results,
        "startup_s": started,
        "pid": os.getpid(),
        "files": block_files(spec["root"]) if spec.get("root") else [],
    }
    out_path.write_text(json.dumps(record))
    if spec.get("ready_file"):
        Path(spec["ready_file"]).write_text("ready")
    if spec.get("hold_file"):
        deadline = time.monotonic() + float(spec.get("hold_s", 600))
        while not Path(spec["hold_file"]).exists() and time.monotonic() < deadline:
            time.sleep(0.2)
    del llm


if __name__ == "__main__":
    main()
elif __name__ == "__mp_main__":  # vLLM's engine core, spawned from this file
    _install_trace()
