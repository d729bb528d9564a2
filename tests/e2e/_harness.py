"""Start vLLM engines as child processes and always clean up after them.

* :func:`run_engine`: one ``engine_run.py`` child (``vllm.LLM``), waited for
  with a generous timeout; returns its JSON record.
* :class:`Engine`: the same child started in the background (two engines
  alive at once), :meth:`Engine.finish` waits for it.
* :func:`serve`: ``vllm serve`` as a context manager, ready when ``/health``
  answers 200.

Each child runs in its own process group. Whatever happens, the harness
sends the group SIGTERM, then SIGKILL, and removes the
``/dev/shm/vllm_offload_<engine id>*`` files of every engine id the child's
log names, and the ``/dev/shm/psm_*`` segments that appeared while the
child lived and that no live process maps (other processes' files in use
are never touched).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ENGINE_TIMEOUT_S = float(os.environ.get("FSTIER_E2E_ENGINE_TIMEOUT", "480"))
_ENGINE_ID = re.compile(r"engine_id[:=]\s*'?([0-9A-Za-z_.-]+)")
_DIST_ID = re.compile(r"vllm_dist_([0-9a-f]{32})")


def child_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    env = dict(os.environ)
    env.update(extra or {})
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    env.setdefault("OMP_NUM_THREADS", "2")
    env["PYTHONHASHSEED"] = "0"
    env["PYTHONUNBUFFERED"] = "1"
    return env


def shm_files_of(log_text: str) -> list[Path]:
    """The files a child left that its log names: the offloading region
    (per engine id) and, with tensor parallelism, the CPU communicator's
    shared memory and init file (per distributed-init id)."""
    out: list[Path] = []
    for eid in set(_ENGINE_ID.findall(log_text)):
        out.extend(Path("/dev/shm").glob(f"vllm_offload_{eid}*"))
    for did in set(_DIST_ID.findall(log_text)):
        out.extend(Path("/dev/shm").glob(f"vllm_dist_{did}*"))
        out.extend(Path("/tmp").glob(f"vllm_dist_{did}*"))
    return out


def _stop_group(proc: subprocess.Popen[Any]) -> None:
    # SIGTERM to the main process first, so vLLM shuts its children down and
    # their resource trackers clean up; then the whole group, then SIGKILL.
    for sig, target, wait_s in (
        (signal.SIGTERM, "main", 60.0), (signal.SIGTERM, "group", 15.0), (signal.SIGKILL, "group", 30.0)
    ):
        if proc.poll() is not None:
            break
        with contextlib.suppress(ProcessLookupError):
            if target == "main":
                proc.send_signal(sig)
            else:
                os.killpg(proc.pid, sig)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=wait_s)
    # Workers of a finished engine may linger in its group: never leave them.
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)


def shm_segments() -> set[Path]:
    """Python ``multiprocessing.shared_memory`` segments (``/dev/shm/psm_*``):
    vLLM's multi-process engine and ``vllm serve`` pass messages through
    them. Their resource tracker unlinks them at exit, unless the group's
    SIGKILL reaches it first (seen: 160-240 MiB segments left by mp engines
    and servers)."""
    return set(Path("/dev/shm").glob("psm_*"))


def _mapped(names: set[str]) -> set[str]:
    """Which of ``names`` a live process still maps."""
    found: set[str] = set()
    for maps in Path("/proc").glob("[0-9]*/maps"):
        with contextlib.suppress(OSError):
            text = maps.read_text(errors="replace")
            found.update(n for n in names if n in text)
    return found


def _cleanup(proc: subprocess.Popen[Any], log: Path, shm_before: set[Path] | None = None) -> None:
    _stop_group(proc)
    text = log.read_text(errors="replace") if log.exists() else ""
    for f in shm_files_of(text):
        with contextlib.suppress(FileNotFoundError):
            f.unlink()
    if shm_before is not None:
        # Segments that appeared while the child lived and that no live
        # process maps: the child's, orphaned (another process's segment
        # in use is mapped by its creator and is left alone).
        new = {f.name: f for f in shm_segments() - shm_before}
        for name in set(new) - _mapped(set(new)):
            with contextlib.suppress(FileNotFoundError):
                new[name].unlink()


def tail(log: Path, n: int = 60) -> str:
    lines = log.read_text(errors="replace").splitlines() if log.exists() else []
    return "\n".join(lines[-n:])


class Engine:
    """One ``engine_run.py`` child; ``spec`` as that script documents."""

    def __init__(self, spec: dict[str, Any], workdir: Path, name: str) -> None:
        workdir.mkdir(parents=True, exist_ok=True)
        self.name = name
        self.spec_path = workdir / f"{name}.spec.json"
        self.out_path = workdir / f"{name}.out.json"
        self.log = workdir / f"{name}.log"
        self.spec_path.write_text(json.dumps(spec))
        self.shm_before = shm_segments()
        with self.log.open("wb") as logf:
            self.proc = subprocess.Popen(
                [sys.executable, str(HERE / "engine_run.py"), str(self.spec_path), str(self.out_path)],
                stdout=logf,
                stderr=subprocess.STDOUT,
                env=child_env(spec.get("env")),
                start_new_session=True,
            )
        self.started = time.monotonic()

    def finish(self, timeout: float = ENGINE_TIMEOUT_S) -> dict[str, Any]:
        try:
            try:
                rc = self.proc.wait(timeout=max(1.0, timeout - (time.monotonic() - self.started)))
            except subprocess.TimeoutExpired:
                raise AssertionError(
                    f"engine {self.name} still running after {timeout:.0f} s; log tail:\n{tail(self.log)}"
                ) from None
            if rc != 0 or not self.out_path.exists():
                raise AssertionError(f"engine {self.name} exited {rc}; log tail:\n{tail(self.log)}")
            record: dict[str, Any] = json.loads(self.out_path.read_text())
            record["log"] = self.log.read_text(errors="replace")
            return record
        finally:
            _cleanup(self.proc, self.log, self.shm_before)

    def kill(self) -> None:
        _cleanup(self.proc, self.log, self.shm_before)


def run_engine(spec: dict[str, Any], workdir: Path, name: str) -> dict[str, Any]:
    return Engine(spec, workdir, name).finish()


def wait_for(path: Path, engine: Engine, timeout: float = ENGINE_TIMEOUT_S) -> None:
    """Wait until ``path`` exists; fail (with the log) if the engine exits first."""
    deadline = time.monotonic() + timeout
    while not path.exists():
        if engine.proc.poll() is not None:
            raise AssertionError(
                f"engine {engine.name} exited {engine.proc.returncode} before {path.name}; "
                f"log tail:\n{tail(engine.log)}"
            )
        if time.monotonic() > deadline:
            raise AssertionError(f"no {path.name} from {engine.name} after {timeout:.0f} s")
        time.sleep(0.5)


def transfer_config(tier: str, roots: dict[str, Any], cpu_bytes: int = 64 << 20) -> dict[str, Any] | None:
    """vLLM's ``kv_transfer_config`` offloading through our CPU worker
    (``FstierCpuOffloadingSpec``) to ``tier``'s secondary tiers: ``none``
    (no offloading: None), ``fs`` (vLLM's own), ``fstier`` or ``both`` (vLLM
    fs, then FstierTier; vLLM cascades each chunk into both). ``roots`` maps
    ``fs``/``fstier`` to their root directories. The one spelling the e2e
    tests and the engine benchmarks share."""
    if tier == "none":
        return None
    kinds = {"fs": {"type": "fs"}, "fstier": {"type": "FstierTier", "module_path": "fstier.integrations.vllm"}}
    names = {"fs": ["fs"], "fstier": ["fstier"], "both": ["fs", "fstier"]}.get(tier)
    if names is None:
        raise ValueError(f"unknown tier {tier!r}: none, fs, fstier or both")
    return {
        "kv_connector": "OffloadingConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {
            "spec_name": "FstierCpuOffloadingSpec",
            "spec_module_path": "fstier.integrations.vllm_cpu",
            "cpu_bytes_to_use": cpu_bytes,
            "secondary_tiers": [{**kinds[n], "root_dir": str(roots[n])} for n in names],
        },
    }


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def http(url: str, body: dict[str, Any] | None = None, timeout: float = 300) -> tuple[int, str]:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode(errors="replace")


@contextlib.contextmanager
def serve(args: list[str], workdir: Path, name: str, port: int | None = None) -> Iterator[str]:
    """``vllm serve`` with ``args`` on ``port`` (default: a free one); yields
    its base URL once /health is 200."""
    workdir.mkdir(parents=True, exist_ok=True)
    port = free_port() if port is None else port
    log = workdir / f"{name}.log"
    shm_before = shm_segments()
    with log.open("wb") as logf:
        proc = subprocess.Popen(
            # vLLM's CLI, through a shim for vllm-cpu 0.32's console script
            [sys.executable, str(HERE / "vllm_cli.py"), "serve", *args,
             "--host", "127.0.0.1", "--port", str(port)],
            stdout=logf,
            stderr=subprocess.STDOUT,
            env=child_env(),
            start_new_session=True,
        )
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + ENGINE_TIMEOUT_S
        while True:
            if proc.poll() is not None:
                raise AssertionError(f"vllm serve {name} exited {proc.returncode}; log tail:\n{tail(log)}")
            if time.monotonic() > deadline:
                raise AssertionError(f"vllm serve {name}: /health not 200 after {ENGINE_TIMEOUT_S:.0f} s")
            with contextlib.suppress(OSError):
                if http(base + "/health", timeout=5)[0] == 200:
                    break
            time.sleep(1)
        yield base
    finally:
        _cleanup(proc, log, shm_before)
