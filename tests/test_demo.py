"""``fstier demo``: the end-to-end run asserts every case, with real rank
processes, a real shared pool and real files; plus the synthetic content the
ranks check against and the demo's exit codes."""

from __future__ import annotations

import glob
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from _signals import AS_FROM_A_TERMINAL
from click.testing import CliRunner

import fstier.cli.demo as demo_mod
from fstier.cli import main
from fstier.config import ModelSpec, ParallelSpec
from fstier.demo.ranks import expected_blocks, layer_state_shape, model_seed

REPO = Path(__file__).resolve().parents[1]
FSTIER_BIN = Path(sys.executable).parent / "fstier"
EXAMPLE = REPO / "examples" / "fstier.yaml"

EXPECTED = {
    "share across tp (tp=2 -> tp=4)": "hit",
    "MLA (tp=2 -> tp=4)": "miss",
    "hybrid full+sliding (tp=2 -> tp=2)": "hit",
    "hybrid full+sliding (tp=2 -> tp=4)": "miss",
    "restart (new FsTier, same root)": "hit",
}


def _assert_every_case(doc: dict) -> None:
    assert doc["ok"] is True, json.dumps(doc, indent=1)
    cases = {c["name"]: c for c in doc["cases"]}
    for name, outcome in EXPECTED.items():
        assert cases[name]["expected"] == outcome
        assert cases[name]["outcome"] == outcome, cases[name]
        assert cases[name]["verified"] is True, cases[name]
    corrupt = cases["corruption (one file damaged)"]
    n = cases["share across tp (tp=2 -> tp=4)"]["stored_blocks"]
    assert corrupt["outcome"] == corrupt["expected"] == f"partial {n // 2}/{n}"
    assert corrupt["loaded_blocks"] == n // 2 and corrupt["verified"] is True
    assert "corrupt:payload_checksum" in corrupt["detail"]
    share = cases["share across tp (tp=2 -> tp=4)"]
    assert share["stored_blocks"] == share["loaded_blocks"] == n > 0
    assert cases["MLA (tp=2 -> tp=4)"]["loaded_blocks"] == 0
    assert cases["MLA (tp=2 -> tp=4)"]["stored_blocks"] == n
    assert doc["store_gbps"] > 0 and doc["load_gbps"] > 0


def test_demo_json_subprocess_every_case(tmp_path: Path) -> None:
    """The CI check: zero-argument demo semantics, real processes, exit 0."""
    proc = subprocess.run(
        [str(FSTIER_BIN), "demo", "--json", "--root", str(tmp_path / "root")],
        capture_output=True, text=True, timeout=240, cwd=REPO,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    doc = json.loads(proc.stdout)
    _assert_every_case(doc)
    assert doc["cache_layout"] == "cross-layer"
    # The files are really there: inspect sees the demo's namespaces.
    inspect = subprocess.run(
        [str(FSTIER_BIN), "inspect", str(tmp_path / "root"), "--json"],
        capture_output=True, text=True, timeout=60, cwd=REPO,
    )
    spaces = json.loads(inspect.stdout)["namespaces"]
    agnostic = [ns for ns in spaces if ns["parallel_agnostic"]]
    assert len(agnostic) == 1 and agnostic[0]["files"] == 2 * 32 - 1  # the damaged file is gone
    assert {ns["tp_size"] for ns in spaces if not ns["parallel_agnostic"]} == {2, 4}
    assert all(ns["temp_files"] == 0 for ns in spaces)


def test_demo_cli_runner_per_layer_with_config(tmp_path: Path) -> None:
    """CliRunner, --per-layer, --config (the commented example, a Llama-8B
    sized page, so fewer blocks) and --root overriding the config's root."""
    res = CliRunner().invoke(
        main,
        ["demo", "--json", "--per-layer", "--config", str(EXAMPLE), "--root", str(tmp_path / "r")],
        catch_exceptions=False,
    )
    assert res.exit_code == 0, res.output[-3000:]
    doc = json.loads(res.output)
    _assert_every_case(doc)
    assert doc["cache_layout"] == "per-layer"
    assert any(p.name.startswith("meta-llama_Llama-3.1-8B-Instruct-") for p in (tmp_path / "r").iterdir())


def test_demo_config_needs_agnostic_model(tmp_path: Path) -> None:
    data = yaml.safe_load(EXAMPLE.read_text())
    data["model"]["groups"][0] = {"kind": "mla", "num_kv_heads": 1, "head_size": 576}
    bad = tmp_path / "mla.yaml"
    bad.write_text(yaml.safe_dump(data))
    res = CliRunner().invoke(main, ["demo", "--config", str(bad)])
    assert res.exit_code == 2
    assert "model.groups" in res.output and "parallel-agnostic" in res.output
    data["model"]["groups"][0] = {"kind": "full_attention", "num_kv_heads": 6, "head_size": 64}
    bad.write_text(yaml.safe_dump(data))
    res = CliRunner().invoke(main, ["demo", "--config", str(bad), "--json"])
    assert res.exit_code == 2 and "num_kv_heads" in json.loads(res.stdout)["error"]


def test_demo_exit_1_when_an_outcome_differs(monkeypatch: pytest.MonkeyPatch) -> None:
    report = demo_mod.DemoReport(root="/nowhere", layout="cross-layer")
    report.cases.append(demo_mod.CaseResult("share across tp (tp=2 -> tp=4)", "hit", "miss", 32, 0, True))
    report.cases.append(demo_mod.CaseResult("restart (new FsTier, same root)", "hit", "hit", 0, 32, False))
    monkeypatch.setattr(demo_mod, "run_demo", lambda opts: report)
    res = CliRunner().invoke(main, ["demo", "--json"])
    assert res.exit_code == 1
    doc = json.loads(res.output)
    assert doc["ok"] is False and [c["ok"] for c in doc["cases"]] == [False, False]
    res = CliRunner().invoke(main, ["demo"])
    assert res.exit_code == 1 and "MISMATCH" in res.output and "some outcomes differ" in res.output


# -- the synthetic content ranks check against ------------------------------------------
def _model(groups: list[dict]) -> ModelSpec:
    return ModelSpec.model_validate({"name": "t/m", "dtype": "bfloat16", "groups": groups})


@pytest.mark.parametrize("kv_layout", ["NHD", "HND"])
def test_expected_shards_tile_the_full_heads(kv_layout: str) -> None:
    model = _model(
        [{"kind": "full_attention", "num_layers": 2, "num_kv_heads": 8, "head_size": 16, "kv_layout": kv_layout}]
    )
    group = model.groups[0]
    seed = model_seed(model)
    blocks = [3, 0, 7]
    # heads axis of (block, 2, tokens, heads, dim) / (block, 2, heads, tokens, dim)
    head_dim = 3 if kv_layout == "NHD" else 2
    full = expected_blocks(seed, 0, group, 1, ParallelSpec(tp_size=1), blocks)
    for tp in (2, 4, 8):
        shards = [expected_blocks(seed, 0, group, 1, ParallelSpec(tp_size=tp, rank=r), blocks) for r in range(tp)]
        assert all(s.shape[1:] == layer_state_shape(group, ParallelSpec(tp_size=tp)) for s in shards)
        assert torch.equal(torch.cat(shards, dim=head_dim), full)
    # Deterministic, exact in bf16, and different per layer, block and model.
    again = expected_blocks(seed, 0, group, 1, ParallelSpec(tp_size=1), blocks)
    assert torch.equal(again.view(torch.int16), full.view(torch.int16))
    assert torch.equal(full.float() * 8, (full.float() * 8).round())
    assert not torch.equal(full, expected_blocks(seed, 0, group, 0, ParallelSpec(tp_size=1), blocks))
    assert not torch.equal(full[0], full[1])
    other = model_seed(
        _model([{"kind": "full_attention", "num_kv_heads": 8, "head_size": 16}]).model_copy(update={"name": "t/other"})
    )
    assert not torch.equal(full, expected_blocks(other, 0, group, 1, ParallelSpec(tp_size=1), blocks))


def test_expected_replicated_heads_and_mla() -> None:
    model = _model(
        [
            {"kind": "full_attention", "num_kv_heads": 2, "head_size": 8},
            {"kind": "mla", "num_kv_heads": 1, "head_size": 32},
        ]
    )
    attn, mla = model.groups
    seed = model_seed(model)
    full = expected_blocks(seed, 0, attn, 0, ParallelSpec(tp_size=1), [1])
    # tp=4 over 2 heads: ranks 0,1 hold head 0 and ranks 2,3 head 1.
    for r in range(4):
        shard = expected_blocks(seed, 0, attn, 0, ParallelSpec(tp_size=4, rank=r), [1])
        assert torch.equal(shard, full[:, :, :, r // 2 : r // 2 + 1])
    a = expected_blocks(seed, 1, mla, 0, ParallelSpec(tp_size=2, rank=0), [0, 1])
    b = expected_blocks(seed, 1, mla, 0, ParallelSpec(tp_size=2, rank=1), [0, 1])
    assert a.shape == (2, 16, 32) and torch.equal(a, b)  # the latent is replicated


#: Run in a fresh interpreter (a forkserver is one per process): start the
#: demo's forkserver, then Ctrl-C it at once, while it still imports torch.
_FORKSERVER_SCRIPT = """
import os, signal, time
from fstier.demo.processes import start_forkserver

def servers():
    children = set()
    for task in os.listdir("/proc/self/task"):
        children |= set(open(f"/proc/self/task/{task}/children").read().split())
    # The spawn returns before the server's exec: until then its cmdline is empty.
    return [p for p in children if b"multiprocessing.forkserver import main" in open(f"/proc/{p}/cmdline", "rb").read()]

ctx = start_forkserver()
deadline = time.monotonic() + 60
while not servers() and time.monotonic() < deadline:
    time.sleep(0.001)
server = servers()
assert len(server) == 1, server
status = open(f"/proc/{server[0]}/status").read()
ignored = int(next(ln for ln in status.splitlines() if ln.startswith("SigIgn:")).split()[1], 16)
print("sigint ignored:", bool(ignored >> (signal.SIGINT - 1) & 1))
os.kill(int(server[0]), signal.SIGINT)
proc = ctx.Process(target=os.getpid)
proc.start()
proc.join(120)
print("rank exit code:", proc.exitcode)
"""


def test_the_demo_forkserver_never_sees_ctrl_c() -> None:
    """The demo's forkserver is deaf to Ctrl-C from its first instruction:
    SIGINT is ignored when it starts (a blocked mask is not inherited by
    Python's spawn, an ignored disposition is), so a Ctrl-C while it imports
    torch neither kills it nor prints a traceback, and it still forks ranks.
    The parent's own Ctrl-C path is test_cli_ux's test_ctrl_c_during_demo_*."""
    # From a terminal's SIGINT (tests/_signals.py): inherited ignored, the check below could not fail.
    proc = subprocess.run([*AS_FROM_A_TERMINAL, "-c", _FORKSERVER_SCRIPT], capture_output=True, text=True,
                          timeout=300, cwd=REPO)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split("\n")[:2] == ["sigint ignored: True", "rank exit code: 0"], proc.stdout
    assert "Traceback" not in proc.stderr and "KeyboardInterrupt" not in proc.stderr, proc.stderr


#: Run ``fstier demo`` in a fresh interpreter, recording how many threads the
#: process has each time the demo's forkserver is asked for.
_THREADS_SCRIPT = """
import os, sys
import fstier.demo.processes as processes
import fstier.demo.scenario as scenario

real = processes.start_forkserver
def counted(*args, **kwargs):
    print("threads at start_forkserver:", len(os.listdir("/proc/self/task")), file=sys.stderr)
    return real(*args, **kwargs)
processes.start_forkserver = scenario.start_forkserver = counted
from fstier.cli import main
sys.argv = ["fstier", "demo", "--root", sys.argv[1]]
main()
"""


def test_the_demo_starts_its_forkserver_while_it_has_one_thread(tmp_path: Path) -> None:
    """start_forkserver ignores SIGINT for an instant with the signal blocked
    in the calling thread; a Ctrl-C that lands then is kept pending only if no
    other thread can take it (another thread would, and SIG_IGN discards it
    there: the demo then ran to completion and exited 0 under load). So the
    first call must come before anything starts a thread (importing torch,
    the progress display)."""
    proc = subprocess.run([sys.executable, "-c", _THREADS_SCRIPT, str(tmp_path / "root")],
                          capture_output=True, text=True, timeout=300, cwd=REPO)
    assert proc.returncode == 0, proc.stderr
    counts = [
        int(ln.rsplit(" ", 1)[1]) for ln in proc.stderr.splitlines() if ln.startswith("threads at start_forkserver:")
    ]
    assert counts and counts[0] == 1, proc.stderr


#: Run in a fresh interpreter: start the demo's forkserver with a Ctrl-C
#: landing while multiprocessing spawns its Nth helper process (1: the
#: resource tracker, 2: the server).
_FORKSERVER_INTERRUPT_SCRIPT = """
import os, signal, sys
import multiprocessing.util as util
from fstier.demo.processes import start_forkserver

which, calls = int(sys.argv[1]), []
real = util.spawnv_passfds
def spawn(*args, **kwargs):
    calls.append(args)
    if len(calls) == which:
        os.kill(os.getpid(), signal.SIGINT)
    return real(*args, **kwargs)
util.spawnv_passfds = spawn
try:
    start_forkserver()
except KeyboardInterrupt:
    print("interrupted after spawn", len(calls))
else:
    print("lost after spawn", len(calls))
"""


@pytest.mark.parametrize("which", [1, 2])
def test_ctrl_c_while_the_forkserver_starts_is_never_lost(which: int) -> None:
    """multiprocessing's resource tracker, started first, blocks SIGINT for
    its spawn and then unblocks it: while start_forkserver had SIGINT
    ignored, a Ctrl-C pending then (or arriving during the server's spawn)
    was discarded and the demo ran on (before the fix: "lost" both times).
    The child starts with a terminal's SIGINT: from a background job it
    inherited SIGINT ignored and the test's own Ctrl-C was discarded."""
    proc = subprocess.run([*AS_FROM_A_TERMINAL, "-c", _FORKSERVER_INTERRUPT_SCRIPT, str(which)],
                          capture_output=True, text=True, timeout=300, cwd=REPO)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "interrupted after spawn 2", proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr


#: Run ``fstier demo`` in a fresh interpreter with its cases replaced by a
#: Ctrl-C delivered at an awkward instant: inside a finalizer (Python prints
#: "Exception ignored" and goes on) or inside the cleanup.
_AWKWARD_CTRL_C_SCRIPT = """
import os, signal, sys
import fstier.demo.scenario as scenario
from fstier.demo.processes import RankProcesses

where = sys.argv[1]

def ctrl_c_here():
    os.kill(os.getpid(), signal.SIGINT)
    for _ in range(100000):  # the handler runs at the first check in here
        pass

class Victim:
    def __del__(self):
        ctrl_c_here()

def run(self, status=None):
    if where == "finalizer":
        Victim()

real_close = RankProcesses.close
def close(self):
    if where == "cleanup":
        ctrl_c_here()
    return real_close(self)

scenario.DemoScenario.run = run
RankProcesses.close = close
from fstier.cli import main
sys.argv = ["fstier", "demo"]
main()
"""


@pytest.mark.parametrize("where", ["finalizer", "cleanup"])
def test_ctrl_c_at_an_awkward_instant_still_exits_130(tmp_path: Path, where: str) -> None:
    """Every Ctrl-C is counted before it is raised, and the count is checked
    when the demo ends: one swallowed inside a finalizer, or one that landed
    while the cleanup held it (the cleanup used to ignore SIGINT), still ends
    the demo with exit 130, and the cleanup completes (before: exit 0)."""
    env = {**os.environ, "TMPDIR": str(tmp_path)}
    child = subprocess.Popen([*AS_FROM_A_TERMINAL, "-c", _AWKWARD_CTRL_C_SCRIPT, where], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True, cwd=REPO, env=env)
    _, err = child.communicate(timeout=300)
    assert child.returncode == 130, err
    assert err.rstrip().splitlines()[-1] == "interrupted (Ctrl-C)", err
    if where == "cleanup":
        assert [ln for ln in err.splitlines() if ln.strip()] == ["interrupted (Ctrl-C)"], err
    assert list(tmp_path.glob("fstier-demo-*")) == [], "the temporary root was left behind"
    assert glob.glob(f"/dev/shm/fstier-{child.pid}-*") == [], "the shared pool segment outlived the demo"


def test_an_inherited_sig_ign_is_kept() -> None:
    """A demo started with SIGINT ignored (``nohup``, a background job) keeps
    ignoring it: the recorder installs nothing and holds nothing."""
    import signal

    from fstier.demo import processes

    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        with processes.ctrl_c_recorded(), processes.sigint_deferred():
            assert signal.getsignal(signal.SIGINT) == signal.SIG_IGN
        assert signal.getsignal(signal.SIGINT) == signal.SIG_IGN
    finally:
        signal.signal(signal.SIGINT, previous)
