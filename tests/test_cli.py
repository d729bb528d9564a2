"""The ``fstier`` command: every command through click's CliRunner and as a
real subprocess of the installed entry point, on real files under tmp_path."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import yaml
from click.testing import CliRunner
from conftest import make_config

from fstier.cli import main
from fstier.config import FstierConfig, load_config
from fstier.file_mapper import FileMapper
from fstier.io._blockio import store_block
from fstier.io.blockfile import HEADER_SIZE, header_for_payload
from fstier.io.blockstore import NamespaceDirs
from fstier.io.fsops import aligned_buffer
from fstier.io.iotypes import IOOptions, StoreRequest
from fstier.io.manifest import ensure_manifest
from fstier.keys import BlockKey, prefix_keys

REPO = Path(__file__).resolve().parents[1]
FSTIER_BIN = Path(sys.executable).parent / "fstier"
EXAMPLE = REPO / "examples" / "fstier.yaml"


def run_cli(*args: str) -> Any:
    return CliRunner().invoke(main, list(args), catch_exceptions=False)


def run_bin(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(FSTIER_BIN), *args], capture_output=True, text=True, timeout=timeout, cwd=REPO
    )


def write_yaml(path: Path, data: dict[str, Any]) -> Path:
    path.write_text(yaml.safe_dump(data), encoding="utf-8")
    return path


def store_blocks(cfg: FstierConfig, n: int, *, seed: int = 0) -> list[Path]:
    """Write ``n`` real block files of group 0 through the io layer."""
    mapper = FileMapper(cfg)
    ensure_manifest(mapper)
    nbytes = mapper.expected_payload_bytes(0)
    page = nbytes // cfg.tier.blocks_per_file
    buf = aligned_buffer(nbytes)
    paths = []
    for i, key in enumerate(prefix_keys(list(range(seed, seed + 16 * n)), 16)):
        buf[:nbytes] = bytes([(i + seed) % 256]) * nbytes
        header = header_for_payload(key, mapper.digest_bytes, buf[:nbytes], cfg.tier.blocks_per_file, page)
        path = mapper.path_for(key)
        NamespaceDirs(mapper).ensure(path)
        out = store_block(StoreRequest(path, header, buf), IOOptions())
        assert out.ok, out
        paths.append(path)
    return paths


SMALL_GROUP = [{"kind": "full_attention", "block_size": 16, "num_layers": 1, "num_kv_heads": 2, "head_size": 64}]


# -- import cost ---------------------------------------------------------------
#: What no help text and no config check may import: torch, numpy, the I/O
#: layer, the staging modules, and the demo (its engine imports torch).
HEAVY = (
    "torch",
    "numpy",
    "fstier.io",
    "fstier.manager",
    "fstier.gpu_copy",
    "fstier.layout",
    "fstier.cross_layer",
    "fstier.slots.host_pool",
    "fstier.cli.demo",
    "fstier.demo",
)


@pytest.mark.parametrize(
    "argv",
    [
        ["--help"],
        ["config", "validate", str(EXAMPLE)],
        ["inspect", "--help"],
        ["gc", "--help"],
        ["config", "--help"],
        ["nope"],
    ],
)
def test_help_and_config_do_not_import_heavy_modules(argv: list[str]) -> None:
    code = (
        "import sys\n"
        "from fstier.cli import main\n"
        "try:\n"
        f"    main({argv!r}, prog_name='fstier')\n"
        "except SystemExit as e:\n"
        "    rc = e.code\n"
        f"heavy = sorted(m for m in sys.modules if m.split('.')[0] in {HEAVY!r} or m.startswith({HEAVY!r}))\n"
        "print('HEAVY=' + ','.join(heavy))\n"
        "sys.exit(rc)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=60)
    assert proc.returncode == (2 if argv == ["nope"] else 0), proc.stderr
    assert "HEAVY=\n" in proc.stdout, proc.stdout[-500:]


def test_lazy_command_help_matches_each_command() -> None:
    """``fstier --help`` lists commands from a static table (so that it imports
    none of them); each entry must say what the command's own docstring says."""
    import importlib

    from fstier.cli import COMMANDS

    for name, (module, attr, short) in COMMANDS.items():
        command = getattr(importlib.import_module(module), attr)
        assert command.name == name
        assert short == command.get_short_help_str(limit=10**6), name


def test_version_and_help_subprocess() -> None:
    proc = run_bin("--help")
    assert proc.returncode == 0
    for cmd in ("demo", "inspect", "verify", "gc", "bench", "config"):
        assert cmd in proc.stdout
    assert run_bin("--version").returncode == 0


def test_unknown_command_and_missing_option_exit_2(tmp_path: Path) -> None:
    assert run_cli("nope").exit_code == 2
    assert run_cli("gc", str(tmp_path)).exit_code == 2  # --max-bytes is required
    proc = run_bin("gc", str(tmp_path), "--max-bytes", "12 parsecs")
    assert proc.returncode == 2
    assert "--max-bytes" in proc.stderr and "unit" in proc.stderr


# -- config ------------------------------------------------------------------
def test_example_yaml_loads_everywhere(tmp_path: Path) -> None:
    cfg = load_config(EXAMPLE)
    assert cfg.model.groups[0].kind == "full_attention"
    res = run_cli("config", "validate", str(EXAMPLE))
    assert res.exit_code == 0 and "ok" in res.output
    res = run_cli("config", "show", str(EXAMPLE), "--json")
    assert res.exit_code == 0
    info = json.loads(res.output)
    assert info["namespace_dir"] == str(FileMapper(cfg).namespace_dir)
    assert info["config"]["tier"]["read_threads"] == cfg.tier.read_threads
    assert info["config"]["tier"]["file_mode"] == "0644"
    assert info["parallel_agnostic"] is True


def test_config_show_round_trips_and_names_namespace(tmp_path: Path) -> None:
    src = write_yaml(
        tmp_path / "c.yaml",
        {"tier": {"root_dir": str(tmp_path / "root")}, "model": {"name": "acme/m", "groups": SMALL_GROUP}},
    )
    res = run_cli("config", "show", str(src))
    assert res.exit_code == 0, res.output
    cfg = load_config(src)
    assert str(FileMapper(cfg).namespace_dir) in res.output
    assert "read_threads: 8" in res.output  # a default, filled in
    # The resolved config printed by --json is itself a valid config.
    resolved = json.loads(run_cli("config", "show", str(src), "--json").output)["config"]
    again = write_yaml(tmp_path / "again.yaml", resolved)
    assert FileMapper(load_config(again)).digest == FileMapper(cfg).digest


@pytest.mark.parametrize(
    ("data", "field"),
    [
        (
            {"tier": {"root_dir": "/tmp/x", "read_threads": 0}, "model": {"name": "m", "groups": SMALL_GROUP}},
            "tier.read_threads",
        ),
        (
            {"tier": {"root_dir": "/tmp/x", "max_bytes": "-5GB"}, "model": {"name": "m", "groups": SMALL_GROUP}},
            "tier.max_bytes",
        ),
        ({"tier": {"root_dir": "/tmp/x", "thredas": 3}, "model": {"name": "m", "groups": SMALL_GROUP}}, "tier.thredas"),
        (
            {
                "tier": {"root_dir": "/tmp/x"},
                "model": {"name": "m", "groups": [{"kind": "sliding_window", "head_size": 8}]},
            },
            "model.groups.0",
        ),
        # A model without a tier section (a tier-only file is valid: test_operator.py).
        ({"model": {"name": "m", "groups": SMALL_GROUP}}, "tier"),
        (
            {"tier": {"root_dir": "/tmp/x"}, "model": {"name": "m", "groups": [{"num_kv_heads": 8}]}},
            "head_size is required",
        ),
        (
            {"tier": {"root_dir": "/tmp/x", "max_bytes": 0}, "model": {"name": "m", "groups": SMALL_GROUP}},
            "tier.max_bytes: must be > 0",
        ),
    ],
)
def test_malformed_config_exits_2_naming_the_field(tmp_path: Path, data: dict[str, Any], field: str) -> None:
    path = write_yaml(tmp_path / "bad.yaml", data)
    for cmd in (["config", "validate"], ["config", "show"]):
        res = run_cli(*cmd, str(path))
        assert res.exit_code == 2
        lines = [ln for ln in res.output.splitlines() if ln.strip()]
        assert len(lines) == 1, res.output
        assert field in lines[0]
    res = run_cli("config", "validate", str(path), "--json")
    doc = json.loads(res.stdout)
    assert doc["ok"] is False and doc["exit_code"] == 2 and field in doc["error"]


def test_malformed_config_subprocess(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("tier: {root_dir: /tmp/x, fsync: sometimes}\nmodel: {name: m, groups: [{head_size: 8}]}\n")
    proc = run_bin("config", "validate", str(bad))
    assert proc.returncode == 2
    assert proc.stderr.count("\n") == 1 and "tier.fsync" in proc.stderr and "sometimes" in proc.stderr
    proc = run_bin("demo", "--config", str(bad))
    assert proc.returncode == 2 and "tier.fsync" in proc.stderr
    notyaml = tmp_path / "broken.yaml"
    notyaml.write_text("tier: [unclosed\n")
    proc = run_bin("config", "show", str(notyaml))
    assert proc.returncode == 2 and "invalid YAML" in proc.stderr
    proc = run_bin("config", "show", str(tmp_path / "missing.yaml"))
    assert proc.returncode == 2 and "not found" in proc.stderr
    proc = run_bin("config", "validate", str(EXAMPLE))
    assert proc.returncode == 0


# -- inspect -------------------------------------------------------------------
def test_inspect_reports_each_namespace(tmp_path: Path) -> None:
    root = tmp_path / "root"
    agnostic = make_config(root, groups=SMALL_GROUP)
    paths = store_blocks(agnostic, 5)
    hybrid_groups = [
        *SMALL_GROUP,
        {
            "kind": "sliding_window",
            "sliding_window": 64,
            "block_size": 16,
            "num_layers": 1,
            "num_kv_heads": 2,
            "head_size": 64,
        },
    ]
    rank1 = make_config(root, groups=hybrid_groups, parallel={"tp_size": 2, "rank": 1})
    rank_paths = store_blocks(rank1, 3, seed=7)
    # A temp file left by a killed writer, and a stray top-level file.
    (paths[0].parent / f".{paths[0].name}.tmp.host.1.1.ab").write_bytes(b"x" * 10)
    (root / "README").write_text("not a namespace")
    res = run_cli("inspect", str(root), "--json")
    assert res.exit_code == 0, res.output
    doc = json.loads(res.output)
    by_ns = {ns["namespace"]: ns for ns in doc["namespaces"]}
    a = by_ns[FileMapper(agnostic).namespace]
    assert a["model"] == "acme/llama-tiny" and a["parallel_agnostic"] is True
    assert a["files"] == 5 and a["bytes"] == sum(p.stat().st_size for p in paths)
    assert a["temp_files"] == 1 and a["groups"] == 1
    assert a["oldest"] <= a["newest"]
    h = by_ns[FileMapper(rank1).namespace]
    assert h["parallel_agnostic"] is False and h["tp_size"] == 2 and h["ranks"] == [1]
    assert h["files"] == 3 and h["groups"] == 2 and h["bytes"] == sum(p.stat().st_size for p in rank_paths)
    assert doc["stray_entries"] == 1 and doc["total_files"] == 8
    table = run_cli("inspect", str(root))
    assert table.exit_code == 0
    assert "acme/llama-tiny" in table.output and "agnostic" in table.output and "tp=2 ranks=1" in table.output
    proc = run_bin("inspect", str(root), "--json")
    assert proc.returncode == 0 and json.loads(proc.stdout)["total_files"] == 8
    proc = run_bin("inspect", str(tmp_path / "nowhere"))
    assert proc.returncode == 2 and "no such directory" in proc.stderr


def test_inspect_unreadable_manifest_and_symlink(tmp_path: Path) -> None:
    root = tmp_path / "root"
    root.mkdir()
    (root / "junk-0123").mkdir()
    (root / "junk-0123" / "config.json").write_text("{not json")
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "a.bin").write_bytes(b"1")
    (root / "link").symlink_to(outside)
    doc = json.loads(run_cli("inspect", str(root), "--json").output)
    assert [ns["namespace"] for ns in doc["namespaces"]] == ["junk-0123"]
    assert "not valid JSON" in doc["namespaces"][0]["manifest_error"]
    assert doc["stray_entries"] == 1  # the symlink is not followed


# -- verify ------------------------------------------------------------------
def test_verify_finds_and_fixes_bad_files(tmp_path: Path) -> None:
    root = tmp_path / "root"
    cfg = make_config(root, groups=SMALL_GROUP)
    paths = store_blocks(cfg, 6)
    assert run_cli("verify", str(root)).exit_code == 0
    # payload bit flip; header damage; a valid file under another key's name.
    with open(paths[1], "r+b") as f:
        f.seek(HEADER_SIZE + 100)
        b = f.read(1)
        f.seek(HEADER_SIZE + 100)
        f.write(bytes([b[0] ^ 0x01]))
    with open(paths[2], "r+b") as f:
        f.seek(3)
        f.write(b"\xff")
    foreign_key = BlockKey(b"\xab" * 16, 0)
    foreign = FileMapper(cfg).path_for(foreign_key)
    NamespaceDirs(FileMapper(cfg)).ensure(foreign)
    foreign.write_bytes(paths[3].read_bytes())

    res = run_cli("verify", str(root), "--json", "--headers-only")
    doc = json.loads(res.output)
    assert res.exit_code == 1
    reasons = {Path(b["path"]).name: b["reason"] for b in doc["bad"]}
    assert paths[1].name not in reasons  # the payload is not read with --headers-only
    assert reasons[foreign.name] == "wrong_key" and paths[2].name in reasons

    res = run_cli("verify", str(root), "--json")
    doc = json.loads(res.output)
    assert res.exit_code == 1 and doc["ok"] is False and doc["checked"] == 7
    reasons = {Path(b["path"]).name: b["reason"] for b in doc["bad"]}
    assert reasons[paths[1].name] == "payload_checksum"
    assert set(reasons) == {paths[1].name, paths[2].name, foreign.name}
    assert all(p.exists() for p in paths)  # without --fix nothing is removed

    proc = run_bin("verify", str(root), "--fix")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "3 bad, 3 removed" in proc.stdout
    assert not paths[1].exists() and not paths[2].exists() and not foreign.exists()
    assert paths[0].exists() and paths[3].exists()
    proc = run_bin("verify", str(root), "--json", "--namespace", FileMapper(cfg).namespace)
    assert proc.returncode == 0 and json.loads(proc.stdout)["checked"] == 4
    assert run_bin("verify", str(root), "--namespace", "nope").returncode == 2


def test_verify_truncated_file_and_wrong_namespace(tmp_path: Path) -> None:
    root = tmp_path / "root"
    a = make_config(root, groups=SMALL_GROUP)
    b = make_config(root, groups=SMALL_GROUP, tier={"namespace_salt": "tenant-b"})
    pa = store_blocks(a, 2)
    pb = store_blocks(b, 1, seed=99)
    with open(pa[0], "r+b") as f:
        f.truncate(HEADER_SIZE + 10)
    # b's file moved into a's namespace: its header names another digest.
    moved = FileMapper(a).blocks_dir / pb[0].relative_to(FileMapper(b).blocks_dir)
    NamespaceDirs(FileMapper(a)).ensure(moved)
    os.replace(pb[0], moved)
    doc = json.loads(run_cli("verify", str(root), "--json").output)
    reasons = sorted(bad["reason"] for bad in doc["bad"])
    assert reasons == ["bad_size", "wrong_namespace"]


# -- gc ------------------------------------------------------------------------
def test_gc_evicts_oldest_and_sweeps_temp(tmp_path: Path) -> None:
    root = tmp_path / "root"
    cfg = make_config(root, groups=SMALL_GROUP)
    paths = store_blocks(cfg, 8)
    now = time.time()
    for i, p in enumerate(paths):  # block i was used i hours ago... reversed: 0 is oldest
        os.utime(p, (now - 1000 + i, now - 1000 + i))
    stale = paths[0].parent / f".{paths[0].name}.tmp.h.1.1.aa"
    stale.write_bytes(b"t" * 100)
    os.utime(stale, (now - 7200, now - 7200))
    fresh = paths[0].parent / f".{paths[0].name}.tmp.h.1.2.bb"
    fresh.write_bytes(b"t")
    size = paths[0].stat().st_size
    limit = 5 * size

    res = run_cli("gc", str(root), "--max-bytes", str(limit), "--dry-run", "--json")
    doc = json.loads(res.output)
    assert res.exit_code == 0 and doc["evicted_files"] == 3 and doc["dry_run"] is True
    assert all(p.exists() for p in paths) and stale.exists()

    proc = run_bin("gc", str(root), "--max-bytes", str(limit), "--json")
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    assert doc["evicted_files"] == 3 and doc["bytes_after"] <= limit and doc["temp_removed"] == 1
    assert [p.exists() for p in paths] == [False] * 3 + [True] * 5
    assert not stale.exists() and fresh.exists()
    res = run_cli("gc", str(root), "--max-bytes", "1GiB")
    assert res.exit_code == 0 and "removed 0 block file(s)" in res.output


# -- bench -----------------------------------------------------------------------
def test_bench_json_and_table(tmp_path: Path) -> None:
    res = run_cli(
        "bench", "--root", str(tmp_path), "--blocks", "8", "--block-size", "64KiB", "--threads", "2", "--json"
    )
    assert res.exit_code == 0, res.output
    doc = json.loads(res.output)
    assert [r["op"] for r in doc["rows"]] == ["store", "load"]
    for r in doc["rows"]:
        assert r["fstier_gbps"] > 0 and r["raw_gbps"] > 0
        # Every figure is rounded to 3 decimals: the ratio must lie within
        # what the rounded speeds allow (at ~0.05 GB/s on a loaded machine
        # a flat 1% is less than the rounding itself: 0.789 vs 0.798 seen).
        f, raw, half = r["fstier_gbps"], r["raw_gbps"], 0.0005
        assert (f - half) / (raw + half) - half <= r["ratio"] <= (f + half) / (raw - half) + half
    assert list(tmp_path.iterdir()) == []  # the benchmark cleans up after itself
    proc = run_bin("bench", "--root", str(tmp_path), "--blocks", "4", "--block-size", "16KiB")
    assert proc.returncode == 0, proc.stderr
    assert "raw O_DIRECT" in proc.stdout and "store" in proc.stdout
    assert run_bin("bench", "--block-size", "1000").returncode == 2


def test_inspect_memory_does_not_grow_with_file_count(tmp_path: Path) -> None:
    """The walk keeps counters, not file lists: peak memory for 4000 files
    is about that for 400 (tracemalloc measures Python allocations)."""
    import tracemalloc

    from fstier.tier.scan import inspect_root

    def tree(n: int) -> Path:
        root = tmp_path / f"root{n}"
        cfg = make_config(root, groups=SMALL_GROUP)
        mapper = FileMapper(cfg)
        ensure_manifest(mapper)
        for i in range(n):
            path = mapper.path_for(BlockKey(i.to_bytes(4, "big") * 4, 0))
            NamespaceDirs(mapper).ensure(path)
            path.touch()
        return root

    peaks = []
    for n in (400, 4000):
        root = tree(n)
        tracemalloc.start()
        report = inspect_root(root)
        peaks.append(tracemalloc.get_traced_memory()[1])
        tracemalloc.stop()
        assert report.namespaces[0].files == n
    assert peaks[1] < 2 * peaks[0] + 256 * 1024, peaks


def test_verify_progress_bar_path(tmp_path: Path) -> None:
    from fstier.cli.verify import run_verify

    root = tmp_path / "root"
    store_blocks(make_config(root, groups=SMALL_GROUP), 3)
    report = run_verify(root, progress=True)
    assert report.ok and report.checked == 3


def test_verify_namespace_cannot_leave_root(tmp_path: Path) -> None:
    root = tmp_path / "root"
    cfg = make_config(tmp_path / "outside", groups=SMALL_GROUP)
    outside = store_blocks(cfg, 1)
    with open(outside[0], "r+b") as f:  # a bad file outside ROOT must never be touched
        f.truncate(HEADER_SIZE + 1)
    root.mkdir()
    (root / "link").symlink_to(FileMapper(cfg).namespace_dir)
    for ns in ("../outside/" + FileMapper(cfg).namespace, "..", "link"):
        res = run_cli("verify", str(root), "--namespace", ns, "--fix")
        assert res.exit_code == 2, (ns, res.output)
        assert "--namespace" in res.output
    assert outside[0].exists()


def test_example_yaml_with_fstier_from_config(tmp_path: Path) -> None:
    from fstier.manager import FsTier

    text = EXAMPLE.read_text().replace("root_dir: /tmp/fstier-example", f"root_dir: {tmp_path / 'root'}")
    assert str(tmp_path) in text
    path = tmp_path / "fstier.yaml"
    path.write_text(text)
    tier = FsTier.from_config(path)
    try:
        assert tier.mapper.namespace_dir.is_dir()
        assert tier.lookup(prefix_keys(list(range(64)), 16)) == 0
    finally:
        tier.close()
    doc = json.loads(run_cli("inspect", str(tmp_path / "root"), "--json").output)
    assert doc["namespaces"][0]["model"] == "meta-llama/Llama-3.1-8B-Instruct"


@pytest.mark.parametrize("value", ["nan", "inf", "1e400", "-inf", "0", "1e12"])
def test_gc_temp_max_age_must_be_finite_and_in_range(tmp_path: Path, value: str) -> None:
    """`fstier gc --temp-max-age nan` crashed with a traceback (issue 15 item 5)."""
    root = tmp_path / "root"
    store_blocks(make_config(root, groups=SMALL_GROUP), 1)
    res = CliRunner().invoke(main, ["gc", str(root), "--max-bytes", "1GiB", f"--temp-max-age={value}"])
    assert res.exit_code == 2, res.output
    assert "--temp-max-age: must be a finite number of seconds in (0, 31536000]" in res.output
    assert "Traceback" not in res.output


def test_root_reached_through_a_symlink_is_the_directory_it_names(tmp_path: Path) -> None:
    """``/mnt/kv -> /data/kv`` is a common root. The tier resolves it; the CLI
    saw nothing there and exited 0 for verify, inspect and gc (every symlink
    refused, the root's own included). A symlink below the root is still
    refused (test_inspect_unreadable_manifest_and_symlink)."""
    real = tmp_path / "data" / "kv"
    cfg = make_config(real, groups=SMALL_GROUP)
    paths = store_blocks(cfg, 4)
    link = tmp_path / "kv"
    link.symlink_to(real)
    verify = json.loads(run_cli("verify", str(link), "--json").output)
    assert verify["ok"] and verify["checked"] == 4, verify
    (ns,) = json.loads(run_cli("inspect", str(link), "--json").output)["namespaces"]
    assert ns["files"] == 4 and ns["manifest_error"] is None, ns
    size = paths[0].stat().st_size
    gc = json.loads(run_cli("gc", str(link), "--max-bytes", str(2 * size), "--json").output)
    assert gc["files_before"] == 4 and gc["evicted_files"] == 2, gc
    assert sum(p.exists() for p in paths) == 2
