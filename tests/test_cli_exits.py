"""The exit-code contract of the ``fstier`` command (docs/cli.md, the
conventions table): each typed failure of :mod:`fstier.cli.exits`, raised by
a real command on real files, ends with its code and one line on stderr and,
under ``--json``, one JSON document on stdout; a failed report (bad files
left, a failed root check) is the report itself with ``error``. Every code
the docs' table names is one of those failures' codes."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click
import pytest
from click.testing import CliRunner
from conftest import make_config
from test_cli import SMALL_GROUP, store_blocks, write_yaml

from fstier.cli import exits, main
from fstier.errors import ConfigError, FstierError

REPO = Path(__file__).resolve().parents[1]


def run(*args: str) -> Any:
    return CliRunner().invoke(main, list(args), catch_exceptions=False, prog_name="fstier")


def lines(text: str) -> list[str]:
    return [ln for ln in text.splitlines() if ln.strip()]


def _not_a_root(tmp: Path) -> list[str]:
    (tmp / "junk.txt").write_text("not fstier's")
    return ["inspect", str(tmp)]


def _bad_config(tmp: Path) -> list[str]:
    bad = write_yaml(tmp / "bad.yaml", {"tier": {"root_dir": str(tmp / "r"), "read_threads": 0},
                                        "model": {"name": "m", "groups": SMALL_GROUP}})
    return ["config", "validate", str(bad)]


def _unwritable_bench_root(tmp: Path) -> list[str]:
    (tmp / "a-file").write_text("x")
    return ["bench", "--root", str(tmp / "a-file" / "sub"), "--blocks", "1", "--block-size", "4KiB"]


#: (case, argv for a fresh directory, exit code, failure class, what the one line says)
FAILURES: list[tuple[str, Callable[[Path], list[str]], int, type[exits.CliFailure], str]] = [
    ("bad option value", lambda t: ["bench", "--blocks", "0"], 2, exits.UsageFailure,
     "--blocks: must be >= 1, got 0"),
    ("bad size", lambda t: ["gc", str(t), "--max-bytes", "lots"], 2, exits.UsageFailure, "--max-bytes: "),
    ("click usage error", lambda t: ["gc", str(t)], 2, exits.UsageFailure,
     "usage error: Missing option '--max-bytes'. (see 'fstier gc --help')"),
    ("ROOT missing", lambda t: ["verify", str(t / "nope")], 2, exits.RootRefused, "no such directory"),
    ("ROOT not fstier's", _not_a_root, 2, exits.RootRefused, "is not an fstier root"),
    ("bad config", _bad_config, 2, exits.ConfigFailure,
     "config error: bad.yaml: tier.read_threads: must be >= 1, got 0"),
    ("runtime OS error", _unwritable_bench_root, 1, exits.RuntimeFailure, "error: "),
]


@pytest.mark.parametrize(("case", "argv", "code", "kind", "says"), FAILURES, ids=[f[0] for f in FAILURES])
def test_each_failure_exits_with_its_code_one_line_and_a_json_document(
    tmp_path: Path, case: str, argv: Callable[[Path], list[str]], code: int, kind: type[exits.CliFailure],
    says: str,
) -> None:
    assert kind.exit_code == code
    args = argv(tmp_path)
    res = run(*args)
    assert res.exit_code == code, (case, res.stdout, res.stderr)
    [line] = lines(res.stderr)
    assert says in line.replace(str(tmp_path) + "/", ""), line
    assert "Traceback" not in res.stderr and res.stdout == ""
    doc = json.loads(run(*args, "--json").stdout)
    assert doc == {"ok": False, "exit_code": code, "error": line}


def test_bad_files_left_is_the_report_and_exit_1(tmp_path: Path) -> None:
    """verify: the table (or the document) says it; nothing more on stderr."""
    root = tmp_path / "root"
    path = store_blocks(make_config(root, groups=SMALL_GROUP), 3)[1]
    data = bytearray(path.read_bytes())
    data[4096 + 100] ^= 1
    path.write_bytes(bytes(data))
    res = run("verify", str(root))
    assert res.exit_code == exits.ReportFailed.exit_code == 1
    assert res.stderr == "" and "BAD FILES REMAIN (rerun with --fix to remove them)" in res.stdout
    res = run("verify", str(root), "--json")
    assert res.exit_code == 1 and res.stderr == ""
    doc = json.loads(res.stdout)
    assert (doc["ok"], doc["exit_code"]) == (False, 1)
    assert doc["error"] == "BAD FILES REMAIN (rerun with --fix to remove them)"
    assert [b["reason"] for b in doc["bad"]] == ["payload_checksum"]
    assert run("verify", str(root), "--fix").exit_code == 0
    assert run("verify", str(root)).exit_code == 0


def test_failed_root_check_is_the_report_and_one_line(tmp_path: Path) -> None:
    (tmp_path / "a-file").write_text("x")
    cfg = write_yaml(tmp_path / "c.yaml", {"tier": {"root_dir": str(tmp_path / "a-file" / "root")}})
    res = run("config", "validate", str(cfg), "--check-root")
    assert res.exit_code == 1, (res.stdout, res.stderr)
    [line] = lines(res.stderr)
    assert line.startswith("root check failed: ")
    assert "fail" in res.stdout  # the checks were printed first
    res = run("config", "validate", str(cfg), "--check-root", "--json")
    assert res.exit_code == 1 and res.stderr == ""
    doc = json.loads(res.stdout)
    assert (doc["ok"], doc["exit_code"]) == (False, 1)
    assert f"root check failed: {doc['error']}" == line
    assert any(c["status"] == "fail" for c in doc["root_checks"])


def test_ctrl_c_in_any_command_is_exit_130(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import fstier.cli.gc as gc_mod

    def interrupted(*_a: Any, **_k: Any) -> None:
        raise KeyboardInterrupt

    root = tmp_path / "root"
    store_blocks(make_config(root, groups=SMALL_GROUP), 1)
    monkeypatch.setattr(gc_mod, "run_gc", interrupted)
    res = run("gc", str(root), "--max-bytes", "1GiB")
    assert res.exit_code == exits.Interrupted.exit_code == 130
    assert lines(res.stderr) == ["interrupted (Ctrl-C)"]
    doc = json.loads(run("gc", str(root), "--max-bytes", "1GiB", "--json").stdout)
    assert doc == {"ok": False, "exit_code": 130, "error": "interrupted (Ctrl-C)"}


def test_ok_is_exit_0_with_ok_true(tmp_path: Path) -> None:
    root = tmp_path / "root"
    store_blocks(make_config(root, groups=SMALL_GROUP), 2)
    res = run("inspect", str(root), "--json")
    assert res.exit_code == exits.EXIT_OK == 0 and res.stderr == ""
    doc = json.loads(res.stdout)
    assert (doc["ok"], doc["exit_code"], doc["total_files"]) == (True, 0, 2)


@pytest.mark.parametrize(("exc", "kind", "line"), [
    (ConfigError("tier.x: bad"), exits.ConfigFailure, "config error: tier.x: bad"),
    (FstierError("rank process 1 exited"), exits.RuntimeFailure, "error: rank process 1 exited"),
    (FileNotFoundError(2, "No such file or directory", "/x"), exits.RuntimeFailure,
     "error: /x: No such file or directory"),
    (KeyboardInterrupt(), exits.Interrupted, "interrupted (Ctrl-C)"),
    (click.exceptions.Abort(), exits.RuntimeFailure, "aborted"),
    (click.UsageError("No such command 'nope'."), exits.UsageFailure,
     "usage error: No such command 'nope'. (see 'fstier --help')"),
    (click.ClickException("cannot open"), exits.RuntimeFailure, "error: cannot open"),
])
def test_library_and_click_errors_map_to_one_typed_failure(exc: BaseException, kind: type, line: str) -> None:
    failure = exits.failure_for(exc)
    assert type(failure) is kind and failure is not None
    assert failure.format_message() == line


def test_ctrl_c_inside_click_is_interrupted_and_a_bug_is_not_a_failure() -> None:
    abort = click.exceptions.Abort()
    abort.__cause__ = KeyboardInterrupt()
    assert isinstance(exits.failure_for(abort), exits.Interrupted)
    failure = exits.RootRefused("ROOT 'x': no such directory")
    assert exits.failure_for(failure) is failure
    assert exits.failure_for(ValueError("a bug")) is None  # keeps its traceback


def test_the_docs_exit_code_table_is_the_failures_codes() -> None:
    """docs/cli.md's conventions table names exactly the codes a command
    can end with: 0 and each typed failure's."""
    text = (REPO / "docs" / "cli.md").read_text()
    documented = {int(m) for m in re.findall(r"^\| exit (\d+) \|", text, re.M)}
    kinds = [getattr(exits, name) for name in exits.__all__ if isinstance(getattr(exits, name), type)]
    codes = {k.exit_code for k in kinds if issubclass(k, exits.CliFailure) and k is not exits.CliFailure}
    assert documented == codes | {exits.EXIT_OK} == {0, 1, 2, 130}


def test_a_closed_stdout_is_exit_1_and_quiet(tmp_path: Path) -> None:
    """``fstier inspect ROOT | head -1``: the reader went away. The command
    stops with exit 1 and no "Broken pipe" line (the reader's end is closed
    before the command starts, so its first write fails, every time)."""
    import os
    import subprocess
    import sys

    root = tmp_path / "root"
    store_blocks(make_config(root, groups=SMALL_GROUP), 2)
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        proc = subprocess.run([sys.executable, "-m", "fstier.cli", "inspect", str(root)], stdout=write_end,
                              stderr=subprocess.PIPE, text=True, timeout=120, cwd=REPO)
    finally:
        os.close(write_end)
    assert proc.returncode == exits.EXIT_FAILURE, proc.stderr
    assert proc.stderr == ""
