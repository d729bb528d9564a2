"""An operator's validation path (issue 22, points 2 and 3): sizes in every
spelling an operator writes (vLLM's JSON, Kubernetes quantities),
``fstier config validate`` for full, tier-only and vLLM JSON documents,
``--check-root`` on real directories, refusal of options that cannot work,
and ``config show`` saying why a namespace is not parallel-agnostic."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
import yaml
from click.testing import CliRunner

from fstier.cli import main
from fstier.config import parse_config
from fstier.errors import ConfigError
from fstier.units import parse_size

GROUP = [{"kind": "full_attention", "block_size": 16, "num_layers": 2, "num_kv_heads": 8, "head_size": 64}]
ENTRY = {"type": "FstierTier", "module_path": "fstier.integrations.vllm"}


def run(*args: str, stdin: str | None = None) -> Any:
    return CliRunner().invoke(main, list(args), input=stdin)


def write(path: Path, data: Any) -> Path:
    path.write_text(json.dumps(data) if path.suffix == ".json" else yaml.safe_dump(data))
    return path


# -- sizes ---------------------------------------------------------------------
@pytest.mark.parametrize(
    ("text", "vllm", "expected"),
    [
        ("870Gi", False, 870 * 2**30),
        ("2Ti", False, 2 * 2**40),
        ("512Mi", True, 512 * 2**20),
        ("2T", False, 2 * 10**12),  # fstier's YAML: a bare letter is decimal
        ("2T", True, 2 * 2**40),  # vLLM's JSON: upper case is binary, as vLLM reads it
        ("2t", True, 2 * 10**12),  # ... and lower case decimal
        ("1.5GiB", True, 3 * 2**29),
        ("2TB", True, 2 * 10**12),
    ],
)
def test_sizes_in_every_spelling(text: str, vllm: bool, expected: int) -> None:
    assert parse_size(text, vllm_letters=vllm) == expected


def test_unknown_unit_names_the_accepted_forms() -> None:
    with pytest.raises(ValueError, match="Gi, Ti"):
        parse_size("3 furlongs")


def test_vllm_json_and_yaml_read_a_bare_letter_as_their_tool_does(tmp_path: Path) -> None:
    from fstier.integrations.vllm import tier_config_from_options

    assert tier_config_from_options({"root_dir": str(tmp_path), "max_bytes": "2T"}).max_bytes == 2 * 2**40
    assert tier_config_from_options({"root_dir": str(tmp_path), "max_bytes": "870Gi"}).max_bytes == 870 * 2**30
    yaml_file = write(tmp_path / "t.yaml", {"tier": {"root_dir": str(tmp_path), "max_bytes": "2T"}})
    via_yaml = tier_config_from_options({"config": str(yaml_file)})
    assert via_yaml.max_bytes == 2 * 10**12


# -- refusals ------------------------------------------------------------------
def test_max_bytes_zero_is_refused_with_the_fix(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"tier\.max_bytes: must be > 0.*unset"):
        parse_config({"tier": {"root_dir": str(tmp_path), "max_bytes": 0}, "model": {"name": "m", "groups": GROUP}})
    from fstier.integrations.vllm import tier_config_from_options

    with pytest.raises(ConfigError, match=r"tier\.max_bytes: must be > 0"):
        tier_config_from_options({"root_dir": str(tmp_path), "max_bytes": "0Gi"})


def test_missing_head_size_says_required_not_got_zero(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as info:
        parse_config({"tier": {"root_dir": str(tmp_path)}, "model": {"name": "m", "groups": [{"num_kv_heads": 8}]}})
    assert "head_size is required" in str(info.value) and "got 0" not in str(info.value)
    with pytest.raises(ConfigError, match="head_size must be >= 1.*got 0"):
        parse_config({"tier": {"root_dir": str(tmp_path)}, "model": {"name": "m", "groups": [{"head_size": 0}]}})


def test_config_show_says_why_tp3_with_8_heads_is_not_agnostic(tmp_path: Path) -> None:
    cfg = write(
        tmp_path / "c.yaml",
        {
            "tier": {"root_dir": str(tmp_path / "r")},
            "model": {"name": "m", "groups": GROUP},
            "parallel": {"tp_size": 3},
        },
    )
    res = run("config", "show", str(cfg))
    assert res.exit_code == 0, res.output
    assert "parallel-agnostic: False" in res.output
    line = next(ln for ln in res.output.splitlines() if ln.startswith("not parallel-agnostic:"))
    assert "num_kv_heads 8" in line and "tp_size 3" in line
    doc = json.loads(run("config", "show", str(cfg), "--json").output)
    assert doc["parallel_agnostic"] is False and "tp_size 3" in doc["not_agnostic_because"]
    ok = write(
        tmp_path / "ok.yaml",
        {
            "tier": {"root_dir": str(tmp_path / "r")},
            "model": {"name": "m", "groups": GROUP},
            "parallel": {"tp_size": 4},
        },
    )
    doc = json.loads(run("config", "show", str(ok), "--json").output)
    assert doc["parallel_agnostic"] is True and doc["not_agnostic_because"] is None


# -- the three documents ---------------------------------------------------------
def test_tier_only_yaml_validates(tmp_path: Path) -> None:
    path = write(
        tmp_path / "vllm.yaml", {"tier": {"root_dir": str(tmp_path / "kv"), "max_bytes": "2TiB", "fsync": "file"}}
    )
    res = run("config", "validate", str(path))
    assert res.exit_code == 0, res.output
    assert "tier-only" in res.output and "2.0 TiB" in res.output
    doc = json.loads(run("config", "validate", str(path), "--json").output)
    assert doc["ok"] and doc["kind"] == "tier" and doc["tiers"][0]["fsync"] == "file"
    bad = write(tmp_path / "bad.yaml", {"tier": {"root_dir": str(tmp_path), "read_threads": 0}})
    res = run("config", "validate", str(bad))
    assert res.exit_code == 2 and "tier.read_threads: must be >= 1" in res.output
    show = run("config", "show", str(path))
    assert show.exit_code == 0 and "fsync: file" in show.output and "read_threads: 8" in show.output


@pytest.mark.parametrize("shape", ["entry", "list", "extra_config", "kv_transfer_config"])
def test_vllm_json_validates_in_every_shape(tmp_path: Path, shape: str) -> None:
    entry = {**ENTRY, "root_dir": str(tmp_path / "kv"), "max_bytes": "2T", "n_read_threads": 16}
    extra = {"spec_name": "TieringOffloadingSpec", "cpu_bytes_to_use": 2**35, "secondary_tiers": [entry]}
    doc = {
        "entry": entry,
        "list": [entry],
        "extra_config": extra,
        "kv_transfer_config": {
            "kv_connector": "OffloadingConnector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": extra,
        },
    }[shape]
    path = write(tmp_path / "kv.json", doc)
    res = run("config", "validate", str(path), "--json")
    assert res.exit_code == 0, res.output
    out = json.loads(res.output)
    assert out["kind"] == "vllm" and out["tiers"][0]["max_bytes"] == 2 * 2**40 and out["tiers"][0]["read_threads"] == 16
    # The same document on stdin, as `echo "$KV_TRANSFER_CONFIG" | fstier config validate -`.
    res = run("config", "validate", "-", stdin=json.dumps(doc))
    assert res.exit_code == 0 and "FstierTier root_dir" in res.output


@pytest.mark.parametrize(
    ("doc", "message"),
    [
        ({**ENTRY, "max_byte": "1Ti", "root_dir": "/tmp/kv"}, "'max_byte': unknown"),
        (
            {**ENTRY, "module_path": "fstier.vllm", "root_dir": "/tmp/kv"},
            "module_path: must be 'fstier.integrations.vllm'",
        ),
        ({**ENTRY}, "'root_dir': required"),
        ({**ENTRY, "root_dir": "/tmp/kv", "locality": "NEAR"}, "locality: expected LOCAL or REMOTE"),
        (
            {"spec_name": "TieringOffloadingSpec", "secondary_tiers": [{**ENTRY, "root_dir": "/tmp/kv"}]},
            "cpu_bytes_to_use: required",
        ),
        ({"kv_connector": "OffloadingConnector", "kv_connector_extra_config": {}}, "kv_role: required"),
        ({"type": "fs", "root_dir": "/tmp/kv"}, 'no entry with "type": "FstierTier"'),
    ],
)
def test_vllm_json_refusals_name_the_key(tmp_path: Path, doc: dict[str, Any], message: str) -> None:
    path = write(tmp_path / "kv.json", doc)
    res = run("config", "validate", str(path))
    assert res.exit_code == 2, res.output
    lines = [ln for ln in res.output.splitlines() if ln.strip()]
    assert len(lines) == 1 and message in lines[0], res.output


def test_bad_json_names_line_and_column(tmp_path: Path) -> None:
    path = tmp_path / "kv.json"
    path.write_text('{"type": "FstierTier",\n "root_dir": }')
    res = run("config", "validate", str(path))
    assert res.exit_code == 2 and "invalid JSON at line 2" in res.output


# -- --check-root ----------------------------------------------------------------
def test_check_root_on_a_real_directory(tmp_path: Path) -> None:
    root = tmp_path / "new" / "kv"
    path = write(tmp_path / "t.yaml", {"tier": {"root_dir": str(root), "max_bytes": "1MiB"}})
    res = run("config", "validate", str(path), "--check-root", "--json")
    assert res.exit_code == 0, res.output
    checks = {c["name"]: c for c in json.loads(res.output)["root_checks"]}
    assert list(checks) == ["create", "write", "o_direct", "space", "owner"]
    assert checks["create"]["status"] == "ok" and "created" in checks["create"]["detail"]
    assert checks["write"]["status"] == "ok"
    assert checks["o_direct"]["status"] in ("ok", "warn")  # tmpfs/overlay refuse it: a warning under auto
    assert f"uid {os.geteuid()}" in checks["owner"]["detail"] and "fstier gc" in checks["owner"]["detail"]
    assert root.is_dir() and os.listdir(root) == []  # nothing left behind


def test_check_root_o_direct_agrees_with_the_tiers_probe(tmp_path: Path) -> None:
    """The check says what the tier's own probe finds on that filesystem:
    ``ok`` where O_DIRECT works (a probe through a /proc/self/fd link failed
    with ELOOP and warned on every filesystem)."""
    from fstier.io import probe_o_direct

    root = tmp_path / "kv"
    root.mkdir()
    works = probe_o_direct(root, "auto").enabled
    path = write(tmp_path / "t.yaml", {"tier": {"root_dir": str(root)}})
    res = run("config", "validate", str(path), "--check-root", "--json")
    check = {c["name"]: c for c in json.loads(res.output)["root_checks"]}["o_direct"]
    assert check["status"] == ("ok" if works else "warn"), check
    assert "not creatable" not in check["detail"] and "ELOOP" not in check["detail"], check
    if works:
        assert "O_DIRECT works" in check["detail"], check


def test_check_root_fails_on_an_unusable_root(tmp_path: Path) -> None:
    afile = tmp_path / "afile"
    afile.write_text("x")
    for root, check in ((afile / "kv", "create"), (Path("/proc/fstier-kv"), "create")):
        path = write(tmp_path / "t.yaml", {"tier": {"root_dir": str(root)}})
        res = CliRunner().invoke(main, ["config", "validate", str(path), "--check-root"])
        assert res.exit_code == 1, res.output
        assert f"fail {check}" in res.stdout and "tier.root_dir" in res.stderr and str(root) in res.stderr


def test_check_root_refuses_max_bytes_beyond_the_filesystem(tmp_path: Path) -> None:
    total = os.statvfs(tmp_path).f_blocks * os.statvfs(tmp_path).f_frsize
    path = write(tmp_path / "t.yaml", {"tier": {"root_dir": str(tmp_path / "kv"), "max_bytes": total * 2}})
    res = run("config", "validate", str(path), "--check-root", "--json")
    doc = json.loads(res.output)
    assert res.exit_code == 1 and doc["ok"] is False and "exceeds the whole filesystem" in doc["error"]


def test_check_root_with_o_direct_on_fails_where_the_tier_would(tmp_path: Path) -> None:
    import shutil
    import tempfile

    from fstier.io import probe_o_direct

    shm = Path("/dev/shm")
    base = Path(tempfile.mkdtemp(dir=shm)) if shm.is_dir() and os.access(shm, os.W_OK) else tmp_path
    try:
        if probe_o_direct(base, "auto").enabled:
            pytest.skip("no filesystem here refuses O_DIRECT (tmpfs usually does)")
        path = write(tmp_path / "t.yaml", {"tier": {"root_dir": str(base / "kv"), "o_direct": "on"}})
        res = run("config", "validate", str(path), "--check-root")
        assert res.exit_code == 1 and "fail o_direct" in res.stdout and "o_direct: on" in res.stdout
    finally:
        if base != tmp_path:
            shutil.rmtree(base, ignore_errors=True)


# -- shell completion (docs/cli.md) -----------------------------------------------
def test_shell_completion_works_as_documented(tmp_path: Path) -> None:
    import re
    import subprocess
    import sys

    repo = Path(__file__).resolve().parents[1]
    text = (repo / "docs" / "cli.md").read_text()
    for shell in ("bash", "zsh", "fish"):
        assert f"_FSTIER_COMPLETE={shell}_source fstier" in text
    fstier = Path(sys.executable).with_name("fstier")
    env = {**os.environ, "_FSTIER_COMPLETE": "bash_source"}
    script = subprocess.run([str(fstier)], capture_output=True, text=True, env=env, timeout=60)
    assert script.returncode == 0 and "_fstier_completion" in script.stdout
    for words, cword, want in (("fstier in", 1, "inspect"), ("fstier config va", 2, "validate"),
                               ("fstier gc /tmp --ma", 3, "--max-bytes")):
        env = {**os.environ, "_FSTIER_COMPLETE": "bash_complete", "COMP_WORDS": words, "COMP_CWORD": str(cword)}
        out = subprocess.run([str(fstier)], capture_output=True, text=True, env=env, timeout=60)
        assert re.search(rf"^plain,{re.escape(want)}$", out.stdout, re.M), (words, out.stdout, out.stderr)


# -- bench progress -----------------------------------------------------------------
def test_bench_reports_progress_for_every_file_operation(monkeypatch: pytest.MonkeyPatch) -> None:
    """`fstier bench` writes GBs: on a terminal a bar counts every file
    operation, to exactly the total it announced."""
    import fstier.cli.bench as bench_mod

    bars: list[Any] = []
    real = bench_mod.progress_bar

    class Spy:
        def __init__(self, bar: Any, total: int | None) -> None:
            self.bar, self.total, self.done = bar, total, 0

        def advance(self, n: int = 1) -> None:
            self.done += n
            self.bar.advance(n)

    import contextlib

    @contextlib.contextmanager
    def spy(label: str, enabled: bool, total: int | None = None) -> Any:
        assert enabled
        with real(label, enabled, total) as bar:
            bars.append(Spy(bar, total))
            yield bars[-1]

    monkeypatch.setattr(bench_mod, "show_progress", lambda as_json: True)
    monkeypatch.setattr(bench_mod, "progress_bar", spy)
    res = run("bench", "--blocks", "3", "--block-size", "16KiB", "--threads", "1")
    assert res.exit_code == 0, res.output
    (bar,) = bars
    assert bar.total == bench_mod.bench_files(3) == 4 * 3 * 4 and bar.done == bar.total


# -- warnings name the file (issue 22 point 6) ------------------------------------
def test_warnings_name_the_block_file_path(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """An operator reading a warning can go to the file: a corrupt load and a
    failed store name the path, not a shortened key."""
    import logging

    from manager_support import keys, load, open_tier, store

    caplog.set_level(logging.WARNING, logger="fstier")
    root = tmp_path / "root"
    with open_tier(root) as tier:
        ks = keys(0, 2)
        assert store(tier, "s", ks).success
        bad = tier.mapper.path_for(ks[1])
        with open(bad, "r+b") as f:  # one payload byte flipped
            f.seek(4096)
            b = f.read(1)
            f.seek(4096)
            f.write(bytes([b[0] ^ 1]))
        assert load(tier, "l", ks).keys_completed == 1
        corrupt = [r.getMessage() for r in caplog.records if "corrupt block file" in r.getMessage()]
        assert len(corrupt) == 1 and str(bad) in corrupt[0] and "removed" in corrupt[0], corrupt
        assert "…" not in corrupt[0]
        # A store whose fan-out directory cannot be made: the path is named.
        caplog.clear()
        from fstier.keys import BlockKey

        k = BlockKey(b"\xab" * 16, 0)  # its own fan-out directory
        parent = Path(tier.mapper.path_for(k)).parent
        parent.parent.mkdir(parents=True, exist_ok=True)
        parent.write_text("a file where a directory belongs")
        res = store(tier, "s2", [k])
        assert not res.success
        failed = [r.getMessage() for r in caplog.records if "store of" in r.getMessage()]
        assert failed and str(tier.mapper.path_for(k)) in failed[0], [r.getMessage() for r in caplog.records]
