"""Fixtures for the tests on real shared filesystems (``make test-sharedfs``).

``tests/sharedfs/run.sh`` stands up GlusterFS, MooseFS and CephFS, each
mounted by two FUSE clients in two network namespaces ("host a" and "host
b"), and points ``FSTIER_SHAREDFS_ENV`` at a JSON file naming the mounts.
The env's ``filesystems`` is the one list: every test taking the ``sfs``
fixture runs once per filesystem in it, and a test taking ``sfs`` and
``fault`` once per (filesystem, fault) it names (``sfs.faults``: the data
servers on each, and CephFS's MDS). Without the env these tests are skipped
(``make test`` on a machine without the setup), unless
``FSTIER_REQUIRE_SHAREDFS=1`` (set by run.sh) turns that into a failure.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

ENV = os.environ.get("FSTIER_SHAREDFS_ENV")
REQUIRED = os.environ.get("FSTIER_REQUIRE_SHAREDFS") == "1"
#: what run.sh stands up; the env file's list decides what runs
FILESYSTEMS = ("glusterfs", "moosefs", "cephfs")
#: figures the tests measured, printed at the end of the run (docs cite them)
FIGURES: dict[str, dict[str, Any]] = {}


def pytest_terminal_summary(terminalreporter: Any) -> None:
    if not FIGURES:
        return
    terminalreporter.write_sep("-", "shared filesystem figures")
    for name in sorted(FIGURES):
        terminalreporter.write_line(f"{name}: {json.dumps(FIGURES[name])}")


def _env() -> dict[str, Any] | None:
    if not ENV:
        return None
    with open(ENV) as f:
        return json.load(f)


def pytest_collection_modifyitems(config: Any, items: list[Any]) -> None:
    if ENV or REQUIRED:
        return  # with REQUIRED the fixture fails instead of skipping
    here = Path(__file__).parent
    reason = "no shared filesystems: run `make test-sharedfs` (sets FSTIER_SHAREDFS_ENV)"
    for item in items:
        if here in Path(str(item.fspath)).parents:
            item.add_marker(pytest.mark.skip(reason=reason))


def wait_usable(path: Path, limit_s: float) -> bool:
    """Poll until a file can be created, read back and removed under ``path``."""
    deadline = time.monotonic() + limit_s
    probe = path / f".probe-{uuid.uuid4().hex[:8]}"
    while True:
        try:
            probe.write_bytes(b"x")
            ok = probe.read_bytes() == b"x"
            probe.unlink()
            if ok:
                return True
        except OSError:
            pass
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.5)


class Faulter:
    """Runs fault commands through ``sharedfs.sh serve``, a process started
    before any test opened a file on the mounts. Forking from the test
    process itself while a tier holds files open on a FUSE mount makes the
    child flush those inherited files when it closes them, which blocks
    while the servers are down: the fault could never be undone."""

    def __init__(self, script: str, state_dir: str) -> None:
        self.proc = subprocess.Popen(
            [script, "serve", state_dir], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )
        self.lock = threading.Lock()

    def run(self, what: str) -> None:
        with self.lock:
            assert self.proc.stdin is not None and self.proc.stdout is not None
            self.proc.stdin.write(what + "\n")
            self.proc.stdin.flush()
            answer = self.proc.stdout.readline().strip()
        if answer != "ok":
            raise RuntimeError(f"fault {what!r}: {answer or 'no answer'}")

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(30)


@pytest.fixture(scope="session", autouse=True)
def _faulter() -> Iterator[Faulter | None]:
    env = _env()
    if env is None:
        yield None
        return
    f = Faulter(env["script"], env["dir"])
    try:
        yield f
    finally:
        f.close()


@dataclass
class SharedFs:
    """One shared filesystem seen from two hosts: ``a`` and ``b`` are the same
    directory through host a's and host b's mount. ``faults`` maps a fault's
    name to its (inject, undo) commands; ``info`` is the env's entry (CephFS
    names its pool with a quota there)."""

    name: str
    a: Path
    b: Path
    kill_cmd: str
    start_cmd: str

    faulter: Faulter
    faults: dict[str, tuple[str, str]] = field(default_factory=dict)
    info: dict[str, Any] = field(default_factory=dict)
    servers_down: bool = False
    _undo: list[str] = field(default_factory=list)

    def fault(self, what: str) -> None:
        self.faulter.run(what)

    def kill_servers(self) -> None:
        """Kill the data servers (GlusterFS bricks, the MooseFS chunkserver,
        the Ceph OSD)."""
        self.inject(self.kill_cmd, self.start_cmd)

    def start_servers(self) -> None:
        self.undo()

    def inject(self, what: str, undo: str) -> None:
        """Run fault ``what``; ``undo`` runs at :meth:`undo` or, at the
        latest, when the test ends."""
        self._undo.append(undo)
        self.servers_down = True
        self.fault(what)

    def undo(self) -> None:
        while self._undo:
            self.fault(self._undo[-1])
            self._undo.pop()
        self.servers_down = False

    def link_down_a(self) -> None:
        self.fault("link-down-a")

    def link_up_a(self) -> None:
        self.fault("link-up-a")


def _listed() -> list[str]:
    env = _env()
    return list(env["filesystems"]) if env is not None else list(FILESYSTEMS)


def pytest_generate_tests(metafunc: Any) -> None:
    """``sfs`` runs on every filesystem the env lists; with ``fault`` too, on
    every (filesystem, fault) pair."""
    if "sfs" not in metafunc.fixturenames:
        return
    if "fault" in metafunc.fixturenames:
        env = _env()
        pairs = (
            [(fs, f) for fs, d in env["filesystems"].items() for f in d.get("faults", {"servers": None})]
            if env is not None
            else [(fs, "servers") for fs in FILESYSTEMS]
        )
        metafunc.parametrize(("sfs", "fault"), pairs, indirect=["sfs"], ids=[f"{a}-{b}" for a, b in pairs])
    else:
        metafunc.parametrize("sfs", _listed(), indirect=True)


@pytest.fixture
def sfs(request: Any, _faulter: Faulter | None) -> Iterator[SharedFs]:
    env = _env()
    if env is None:
        if REQUIRED:
            pytest.fail("FSTIER_REQUIRE_SHAREDFS=1 but FSTIER_SHAREDFS_ENV is not set")
        pytest.skip("no shared filesystems: run `make test-sharedfs`")
    fs = env["filesystems"][request.param]
    sub = f"{request.node.originalname}-{uuid.uuid4().hex[:8]}"
    a = Path(fs["a"]) / sub
    a.mkdir()
    assert _faulter is not None
    faults = {k: (v[0], v[1]) for k, v in fs.get("faults", {}).items()}
    shared = SharedFs(
        request.param, a, Path(fs["b"]) / sub, fs["kill"], fs["start"], _faulter, faults, dict(fs)
    )
    try:
        yield shared
    finally:
        # Whatever a fault test left: bring everything back for the next test.
        try:
            shared.link_up_a()
            shared.undo()
            wait_usable(a.parent, 60)
        finally:
            shutil.rmtree(a, ignore_errors=True)
