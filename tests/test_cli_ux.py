"""What a new user meets when things go wrong: one-line errors (never a
traceback), a JSON document for every failure under ``--json``, Ctrl-C,
unreadable parts of a root, directories that are not an fstier root, names
that are rich markup or not UTF-8, progress and sizes. Real files, real
subprocesses; permission errors are injected (the tests may run as root,
which ignores permission bits) and, where possible, also made real by
dropping to ``nobody``."""

from __future__ import annotations

import errno
import glob
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import pytest
from _signals import AS_FROM_A_TERMINAL
from click.testing import CliRunner
from conftest import make_config
from test_cli import SMALL_GROUP, run_bin, store_blocks, write_yaml

from fstier.cli import main
from fstier.config import load_config, parse_config
from fstier.errors import ConfigError
from fstier.file_mapper import FileMapper
from fstier.units import format_size

REPO = Path(__file__).resolve().parents[1]


def run(*args: str) -> Any:
    # mix_stderr is gone in click 8.2+: result.stdout and result.stderr are apart.
    return CliRunner().invoke(main, list(args), catch_exceptions=False)


def one_line(text: str) -> str:
    lines = [ln for ln in text.splitlines() if ln.strip()]
    assert len(lines) == 1, text
    return lines[0]


def deny(monkeypatch: pytest.MonkeyPatch, func: str, victim: Path) -> None:
    """Make ``os.<func>`` raise EACCES for ``victim`` (and below it) only.
    A directory fd (the tree walk scans fds, fstier/io/tree.py) is matched by
    the path it was opened at."""
    real = getattr(os, func)
    prefix = os.fspath(victim)

    def fake(path: Any, *args: Any, **kwargs: Any) -> Any:
        p = os.fspath(path) if not isinstance(path, int) else os.readlink(f"/proc/self/fd/{path}")
        if p == prefix or p.startswith(prefix + os.sep):
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), p)
        return real(path, *args, **kwargs)

    monkeypatch.setattr(os, func, fake)


# -- 1. a root_dir under a directory the user cannot enter ----------------------------
def test_root_dir_permission_error_is_a_config_error(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    locked = tmp_path / "locked"
    locked.mkdir()
    deny(monkeypatch, "stat", locked)
    data = {"tier": {"root_dir": str(locked / "root")}, "model": {"name": "m", "groups": SMALL_GROUP}}
    with pytest.raises(ConfigError) as info:
        parse_config(data)
    msg = str(info.value)
    assert "tier.root_dir" in msg and "Permission denied" in msg and str(locked / "root") in msg
    path = write_yaml(tmp_path / "c.yaml", data)
    res = run("config", "validate", str(path))
    assert res.exit_code == 2
    line = one_line(res.stderr)
    assert line.startswith("config error:") and "tier.root_dir" in line
    doc = json.loads(run("config", "validate", str(path), "--json").stdout)
    assert doc["ok"] is False and doc["exit_code"] == 2 and "tier.root_dir" in doc["error"]


def test_root_dir_symlink_loop_is_named(tmp_path: Path) -> None:
    loop = tmp_path / "loop"
    loop.symlink_to(loop)
    with pytest.raises(ConfigError, match=r"tier\.root_dir.*symlink loop"):
        parse_config({"tier": {"root_dir": str(loop)}, "model": {"name": "m", "groups": SMALL_GROUP}})


def _nobody_can_run_python() -> bool:
    if os.geteuid() != 0:
        return False
    try:
        probe = subprocess.run(
            [sys.executable, "-c", "import fstier.cli"],
            preexec_fn=_become_nobody, capture_output=True, timeout=60, cwd="/",
            env={**os.environ, "PYTHONPATH": str(REPO)},
        )
    except PermissionError:  # the interpreter itself is out of nobody's reach
        return False
    return probe.returncode == 0


def _become_nobody() -> None:
    os.setgid(65534)
    os.setuid(65534)


def test_permissions_for_real_as_nobody() -> None:
    """The same checks with real permission bits, where the interpreter is
    reachable by ``nobody`` (CI's venv; not a root-owned pyenv)."""
    if not _nobody_can_run_python():
        pytest.skip("needs root, and an interpreter that user nobody can run")
    base = Path(tempfile.mkdtemp(prefix="fstier-ux-", dir="/tmp"))
    try:
        base.chmod(0o755)
        root = base / "root"
        cfg = make_config(root, groups=SMALL_GROUP)
        paths = store_blocks(cfg, 4)
        locked_dir = paths[0].parent
        locked_dir.chmod(0o000)
        (base / "locked").mkdir(mode=0o700)
        yaml_path = write_yaml(
            base / "c.yaml",
            {"tier": {"root_dir": str(base / "locked" / "root")}, "model": {"name": "m", "groups": SMALL_GROUP}},
        )
        yaml_path.chmod(0o644)
        env = {**os.environ, "PYTHONPATH": str(REPO)}

        def cli(*args: str) -> subprocess.CompletedProcess[str]:
            return subprocess.run(
                [sys.executable, "-m", "fstier.cli", *args], preexec_fn=_become_nobody,
                capture_output=True, text=True, timeout=120, cwd="/", env=env,
            )

        proc = cli("config", "validate", str(yaml_path))
        assert proc.returncode == 2 and "Traceback" not in proc.stderr
        assert "tier.root_dir" in one_line(proc.stderr)
        for cmd in (["inspect"], ["verify"], ["gc", "--max-bytes", "1TB"]):
            proc = cli(*cmd, str(root), "--json")
            assert proc.returncode == 1, (cmd, proc.stdout, proc.stderr)
            doc = json.loads(proc.stdout)
            assert doc["ok"] is False and doc["partial"] is True
            assert str(locked_dir) in proc.stdout
    finally:
        subprocess.run(["chmod", "-R", "u+rwx", str(base)], check=False)
        shutil.rmtree(base, ignore_errors=True)


# -- 2. Ctrl-C ----------------------------------------------------------------------------
# The demo is started as from a terminal (tests/_signals.py): from a background
# job it inherits SIGINT *ignored*, keeps it, and rightly never saw the Ctrl-C
# (it ran to the end and exited 0: both test_ctrl_c_during_demo_* cases failed so).


def _interrupt_demo(tmp_path: Path, ready: str) -> tuple[subprocess.CompletedProcess[str], int]:
    """Start ``fstier demo`` in its own process group as a terminal would
    run it, from a parent that ignores SIGINT as a background job does, wait
    for ``ready``, then Ctrl-C the whole group."""
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    env = {**os.environ, "TMPDIR": str(tmp)}
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        proc = subprocess.Popen(
            [*AS_FROM_A_TERMINAL, "-m", "fstier.cli", "demo"], stdout=subprocess.PIPE,
            stderr=subprocess.PIPE, text=True, start_new_session=True, env=env, cwd=REPO,
        )
    finally:
        signal.signal(signal.SIGINT, previous)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and proc.poll() is None:
        roots = list(tmp.glob("fstier-demo-*"))
        if ready == "started" and roots:
            break
        if ready == "storing" and roots and any(roots[0].rglob("*.bin")):
            break
        time.sleep(0.02)
    assert proc.poll() is None, "the demo ended before it could be interrupted"
    os.killpg(proc.pid, signal.SIGINT)
    out, err = proc.communicate(timeout=120)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err), proc.pid


@pytest.mark.parametrize("ready", ["started", "storing"])
def test_ctrl_c_during_demo_one_line_exit_130_nothing_left(tmp_path: Path, ready: str) -> None:
    done, pid = _interrupt_demo(tmp_path, ready)
    assert done.returncode == 130, done.stderr
    assert "Traceback" not in done.stderr and "KeyboardInterrupt" not in done.stderr, done.stderr
    assert one_line(done.stderr) == "interrupted (Ctrl-C)"
    assert glob.glob(f"/dev/shm/fstier-{pid}-*") == [], "the shared pool segment outlived the demo"
    assert list((tmp_path / "tmp").glob("fstier-demo-*")) == [], "the temporary root was left behind"
    leftovers = [p for p in (tmp_path / "tmp").rglob("*") if ".tmp." in p.name]
    assert leftovers == []


def test_ctrl_c_json_document() -> None:
    """KeyboardInterrupt anywhere in a command: exit 130 and, under --json, a document."""
    from fstier.cli import inspect as inspect_mod

    def boom(*_a: Any, **_k: Any) -> None:
        raise KeyboardInterrupt

    mp = pytest.MonkeyPatch()
    try:
        mp.setattr(inspect_mod, "fstier_root", boom)
        res = run("inspect", "/nonexistent", "--json")
    finally:
        mp.undo()
    assert res.exit_code == 130
    doc = json.loads(res.stdout)
    assert doc == {"ok": False, "exit_code": 130, "error": "interrupted (Ctrl-C)"}


# -- 3. --json for every failure, click's own included --------------------------------
def test_click_errors_are_one_line_and_json(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    a_file = tmp_path / "file"
    a_file.write_text("x")
    cases = [
        (["inspect", str(a_file)], "is a file"),
        (["verify", str(a_file)], "is a file"),
        (["gc", str(tmp_path)], "--max-bytes"),
        (["inspect", str(tmp_path), "--bogus"], "--bogus"),
        (["nope"], "nope"),
    ]
    for argv, words in cases:
        proc = run_bin(*argv, "--json")
        assert proc.returncode == 2, (argv, proc.stderr)
        doc = json.loads(proc.stdout)
        assert doc["ok"] is False and doc["exit_code"] == 2 and words in doc["error"], (argv, doc)
        assert words in one_line(proc.stderr)
        plain = run_bin(*argv)
        assert plain.returncode == 2 and plain.stdout == ""
        line = one_line(plain.stderr)
        assert line.startswith("usage error:") and "--help" in line and words in line
    # An unreadable ROOT: click checks readability with os.access (root passes
    # any access check, so deny it here).
    real_access = os.access
    monkeypatch.setattr(
        os, "access", lambda p, mode, **kw: False if os.fspath(p) == str(tmp_path) else real_access(p, mode, **kw)
    )
    res = run("inspect", str(tmp_path), "--json")
    assert res.exit_code == 2
    doc = json.loads(res.stdout)
    assert doc["ok"] is False and doc["exit_code"] == 2 and "not readable" in doc["error"]


# -- 4, 5. unreadable parts of a root ---------------------------------------------------
@pytest.fixture
def root_with_locked_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[Path, Path, list[Path]]:
    root = tmp_path / "root"
    paths = store_blocks(make_config(root, groups=SMALL_GROUP), 6)
    locked = paths[0].parent
    inside = [p for p in paths if p.parent == locked]
    deny(monkeypatch, "scandir", locked)
    return root, locked, inside


def test_inspect_reports_unreadable_dirs_and_goes_on(root_with_locked_dir: tuple[Path, Path, list[Path]]) -> None:
    root, locked, inside = root_with_locked_dir
    res = run("inspect", str(root), "--json")
    assert res.exit_code == 1
    doc = json.loads(res.stdout)
    assert doc["ok"] is False and doc["partial"] is True and doc["unreadable_count"] == 1
    assert doc["exit_code"] == 1 and "totals are partial" in doc["error"]
    assert doc["unreadable"] == [{"path": str(locked), "error": "Permission denied"}]
    assert doc["total_files"] == 6 - len(inside)  # the rest was still counted
    res = run("inspect", str(root))
    assert res.exit_code == 1
    assert f"unreadable: {locked}: Permission denied" in res.stdout
    assert "totals are partial" in one_line(res.stderr)


def test_verify_reports_unreadable_dirs_and_goes_on(root_with_locked_dir: tuple[Path, Path, list[Path]]) -> None:
    root, locked, inside = root_with_locked_dir
    res = run("verify", str(root), "--json")
    assert res.exit_code == 1
    doc = json.loads(res.stdout)
    assert doc["ok"] is False and doc["partial"] is True
    assert doc["exit_code"] == 1 and "PARTIAL" in doc["error"] and "--fix" not in doc["error"]
    assert doc["unreadable"] == [{"path": str(locked), "error": "Permission denied"}]
    assert doc["checked"] == 6 - len(inside) and doc["bad"] == []
    res = run("verify", str(root), "--fix")
    assert res.exit_code == 1
    assert f"unreadable: {locked}" in res.stdout
    assert "PARTIAL" in res.stdout and "--fix" not in res.stdout.splitlines()[-1]


def test_gc_names_what_it_could_not_read(root_with_locked_dir: tuple[Path, Path, list[Path]]) -> None:
    root, locked, _inside = root_with_locked_dir
    res = run("gc", str(root), "--max-bytes", "1TB")
    assert res.exit_code == 1
    assert f"unreadable: {locked}: Permission denied" in res.stderr
    assert "partial" in res.stderr and "listed above" in res.stderr
    doc = json.loads(run("gc", str(root), "--max-bytes", "1TB", "--json").stdout)
    assert doc["ok"] is False and doc["partial"] is True
    assert doc["exit_code"] == 1 and "partial" in doc["error"]
    assert doc["failed"] == [{"path": str(locked), "error": "Permission denied"}]


def test_verify_fix_on_unreadable_file_does_not_suggest_fix(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import fstier.io

    root = tmp_path / "root"
    paths = store_blocks(make_config(root, groups=SMALL_GROUP), 3)
    real = fstier.io.verify_file

    def locked(path: Any, *args: Any, **kwargs: Any) -> Any:
        if os.fspath(path) == str(paths[1]):
            raise PermissionError(errno.EACCES, "Permission denied", str(path))
        return real(path, *args, **kwargs)

    monkeypatch.setattr(fstier.io, "verify_file", locked)  # the name `fstier verify` takes from io's face
    res = run("verify", str(root), "--fix")
    assert res.exit_code == 1
    last = res.stdout.strip().splitlines()[-1]
    assert "--fix" not in last and "permissions" in last, last
    assert f"unreadable: {paths[1]}: Permission denied (kept)" in res.stdout
    assert paths[1].exists()


# -- 6. not an fstier root ------------------------------------------------------------------
def test_not_an_fstier_root(tmp_path: Path) -> None:
    etc = tmp_path / "etc"
    etc.mkdir()
    (etc / "passwd").write_text("root:x:0:0\n")
    (etc / "ssh").mkdir()
    for cmd in (["inspect"], ["verify"], ["gc", "--max-bytes", "1GB"]):
        res = run(*cmd, str(etc), "--json")
        assert res.exit_code == 2, cmd
        err = json.loads(res.stdout)["error"]
        assert "not an fstier root" in err and "root_dir" in err
    assert (etc / "passwd").exists()

    root = tmp_path / "root"
    cfg = make_config(root, groups=SMALL_GROUP)
    store_blocks(cfg, 2)
    ns_dir = FileMapper(cfg).namespace_dir
    for cmd in (["inspect"], ["verify"]):
        res = run(*cmd, str(ns_dir))
        assert res.exit_code == 2
        line = one_line(res.stderr)
        assert "namespace directory" in line and repr(str(root)) in line

    empty = tmp_path / "fresh"
    empty.mkdir()
    res = run("inspect", str(empty), "--json")
    assert res.exit_code == 0 and json.loads(res.stdout)["total_files"] == 0
    # A freshly formatted volume (a Kubernetes PVC) is an empty root too: a
    # gc CronJob must not fail on it before the first engine wrote anything.
    (empty / "lost+found").mkdir()
    (empty / ".snapshot").mkdir()
    for cmd in (["inspect"], ["verify"], ["gc", "--max-bytes", "1GB"]):
        res = run(*cmd, str(empty), "--json")
        assert res.exit_code == 0, (cmd, res.output)


def test_symlink_loop_as_root_is_named(tmp_path: Path) -> None:
    loop = tmp_path / "loop"
    loop.symlink_to(loop)
    for cmd in (["inspect"], ["verify"], ["gc", "--max-bytes", "1GB"]):
        res = run(*cmd, str(loop))
        assert res.exit_code == 2
        assert "symlink loop" in one_line(res.stderr)


# -- 7. names that are markup or not UTF-8 --------------------------------------------------
def test_markup_in_names_is_printed_literally(tmp_path: Path) -> None:
    root = tmp_path / "root"
    for i, name in enumerate(["team/llama[/]-ft", "[red]alarm"]):
        store_blocks(make_config(root, groups=SMALL_GROUP, model={"name": name}), 1, seed=i)
    res = run("inspect", str(root))
    assert res.exit_code == 0, res.output
    assert "team/llama[/]-ft" in res.stdout and "[red]alarm" in res.stdout


def test_undecodable_names_do_not_crash_strict_utf8(tmp_path: Path) -> None:
    root = tmp_path / "root"
    cfg = make_config(root, groups=SMALL_GROUP)
    store_blocks(cfg, 2)
    ns = FileMapper(cfg).namespace_dir
    odd = os.fsencode(root) + b"/caf\xe9-0123456789abcdef"
    os.mkdir(odd)
    shutil.copy(ns / "config.json", os.fsdecode(odd) + "/config.json")
    env = {**os.environ, "PYTHONIOENCODING": "utf-8:strict", "LC_ALL": "C.UTF-8"}
    for cmd in (["inspect"], ["verify"]):
        for extra in ([], ["--json"]):
            proc = subprocess.run(
                [sys.executable, "-m", "fstier.cli", *cmd, str(root), *extra],
                capture_output=True, text=True, env=env, timeout=120, cwd=REPO,
            )
            assert proc.returncode == 0, (cmd, extra, proc.stderr)
            assert "Traceback" not in proc.stderr
            if extra:
                names = [ns["namespace"] for ns in json.loads(proc.stdout)["namespaces"]]
                assert "caf\\xe9-0123456789abcdef" in names, names
            else:
                assert "caf\\xe9-0123456789abcdef" in proc.stdout, proc.stdout


# -- 8. progress, sizes, temporary roots -----------------------------------------------------
@pytest.mark.parametrize(
    ("n", "shown"),
    [
        (1024**3 - 1, "1.0 GiB"),
        (1024**2 - 1, "1.0 MiB"),
        (1023, "1023 B"),
        (1024, "1.0 KiB"),
        (int(1.5 * 1024**3), "1.5 GiB"),
    ],
)
def test_sizes_round_into_the_next_unit(n: int, shown: str) -> None:
    assert format_size(n) == shown


def test_inspect_and_gc_progress_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The progress display is on for a terminal; forced on here, the output
    and the numbers stay the same (the bar goes to stderr)."""
    import fstier.cli.gc as gc_mod
    import fstier.cli.inspect as inspect_mod

    root = tmp_path / "root"
    store_blocks(make_config(root, groups=SMALL_GROUP), 3)
    monkeypatch.setattr(inspect_mod, "show_progress", lambda as_json: True)
    monkeypatch.setattr(gc_mod, "show_progress", lambda as_json: True)
    counted: list[int] = []
    real = inspect_mod.progress_bar

    def spy(label: str, enabled: bool, total: int | None = None) -> Any:
        counted.append(enabled)
        return real(label, enabled, total)

    monkeypatch.setattr(inspect_mod, "progress_bar", spy)
    res = run("inspect", str(root))
    assert res.exit_code == 0 and "3 block file(s)" in res.stdout and counted == [True]
    res = run("gc", str(root), "--max-bytes", "1GiB")
    assert res.exit_code == 0 and "in 3 block file(s)" in res.stdout


def test_bench_says_its_root_was_temporary() -> None:
    res = run("bench", "--blocks", "4", "--block-size", "16KiB", "--threads", "1")
    assert res.exit_code == 0, res.output
    assert "(a temporary directory, now deleted)" in res.stdout
    doc = json.loads(run("bench", "--blocks", "4", "--block-size", "16KiB", "--threads", "1", "--json").stdout)
    assert doc["root_temporary"] is True and not Path(doc["root"]).exists()


def test_config_error_example_in_docs_is_what_the_cli_prints(tmp_path: Path) -> None:
    """docs/configuration.md shows the error line a user sees: with the
    ``config error:`` prefix the CLI prints."""
    text = (REPO / "docs" / "configuration.md").read_text()
    bad = write_yaml(
        tmp_path / "bad.yaml",
        {"tier": {"root_dir": "/tmp/x", "read_threads": 0}, "model": {"name": "m", "groups": SMALL_GROUP}},
    )
    line = one_line(run("config", "validate", str(bad)).stderr)
    assert line.startswith("config error: ")
    shown = line.replace(str(bad), "bad.yaml")
    assert shown in text, shown
    with pytest.raises(ConfigError):
        load_config(bad)


def test_demo_says_its_root_was_temporary(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """The demo's zero-argument root is deleted before the report is printed:
    the report must say so instead of showing a path that no longer exists."""
    import fstier.demo.scenario as demo_mod

    roots: list[Path] = []

    class FakeDemo:  # the real cases run in tests/test_demo.py; only the root matters here
        def __init__(self, opts: Any, root: Path, cleanup: list[Any]) -> None:
            cleanup.append(self.close)  # as DemoScenario registers itself
            roots.append(root)
            self.report = demo_mod.DemoReport(root=str(root), layout="cross-layer")
            self.report.cases.append(demo_mod.CaseResult("share", "hit", "hit", 1, 1, True))

        def run(self, status: Any = None) -> None:
            assert roots[-1].is_dir()

        def close(self) -> None:
            pass

    monkeypatch.setattr(demo_mod, "DemoScenario", FakeDemo)
    res = run("demo")
    assert res.exit_code == 0, res.output
    assert f"{roots[-1]} (temporary, now deleted)" in " ".join(res.stdout.split()) and not roots[-1].exists()
    doc = json.loads(run("demo", "--json").stdout)
    assert doc["root_temporary"] is True and not Path(doc["root"]).exists()
    kept = tmp_path / "kept"
    res = run("demo", "--root", str(kept))
    assert res.exit_code == 0 and "temporary" not in res.stdout and kept.is_dir()
    assert json.loads(run("demo", "--root", str(kept), "--json").stdout)["root_temporary"] is False


def test_every_json_document_says_ok_and_exit_code(tmp_path: Path) -> None:
    """Scripts read ``ok`` and ``exit_code`` from every document, success or
    failure, and ``error`` from every failure (exit 1 reports included)."""
    root = tmp_path / "root"
    cfg = make_config(root, groups=SMALL_GROUP)
    paths = store_blocks(cfg, 3)
    config = write_yaml(
        tmp_path / "c.yaml", {"tier": {"root_dir": str(root)}, "model": {"name": "m", "groups": SMALL_GROUP}}
    )
    for argv in (["inspect", str(root)], ["verify", str(root)], ["gc", str(root), "--max-bytes", "1GiB"],
                 ["config", "validate", str(config)], ["config", "show", str(config)]):
        res = run(*argv, "--json")
        doc = json.loads(res.stdout)
        assert res.exit_code == 0 and doc["ok"] is True and doc["exit_code"] == 0 and "error" not in doc, argv
    paths[0].write_bytes(b"\0" * 8192)  # a bad block: verify fails with exit 1
    res = run("verify", str(root), "--json")
    doc = json.loads(res.stdout)
    assert res.exit_code == 1 == doc["exit_code"] and doc["ok"] is False
    assert "BAD FILES REMAIN" in doc["error"]
