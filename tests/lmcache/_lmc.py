"""Helpers for the LMCache tests: the adapter spec, where a chunk's files
are (fstier's and LMCache's ``fs`` adapter's), and LMCache processes (the
StorageManager worker, ``lmcache server``, ``lmcache bench server``)."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

from _signals import as_from_a_terminal

REPO = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).with_name("sm_worker.py")
BIN = Path(sys.executable).parent


def env() -> dict[str, str]:
    e = dict(os.environ)
    e["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), e.get("PYTHONPATH", "")) if p)
    e.update(DO_NOT_TRACK="1", LMCACHE_DISABLE_BANNER="1", PYTHONUNBUFFERED="1")
    return e


def fstier_spec(root: Path, **params: Any) -> str:
    return json.dumps({
        "type": "plugin", "module_path": "fstier.integrations.lmcache",
        "class_name": "FstierL2Adapter", "adapter_params": {"root_dir": str(root), **params},
    })


def fs_spec(root: Path) -> str:
    return json.dumps({"type": "fs", "base_path": str(root)})


def chunk_hash(seed: int, i: int) -> str:
    """The worker's chunk hash of chunk ``i`` of request ``seed`` (hex)."""
    return hashlib.blake2b(f"{seed}:{i}".encode(), digest_size=32).hexdigest()


def fstier_file(root: Path, seed: int, i: int) -> Path:
    h = chunk_hash(seed, i)
    found = sorted(root.glob(f"*/r*/{h[:3]}/{h}-g0.bin"))
    assert len(found) == 1, f"fstier file of chunk {seed}:{i}: {found}"
    return found[0]


def fs_file(root: Path, seed: int, i: int) -> Path:
    found = sorted(root.glob(f"*@{chunk_hash(seed, i)}.data"))
    assert len(found) == 1, f"fs file of chunk {seed}:{i}: {found}"
    return found[0]


def run_worker(mode: str, adapters: list[str], *args: str, timeout: float = 240) -> dict[str, Any]:
    cmd = [sys.executable, str(WORKER), mode, *(x for a in adapters for x in ("--adapter", a)), *args]
    p = subprocess.run(cmd, capture_output=True, text=True, env=env(), timeout=timeout, cwd=REPO)
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")]
    output = f"{p.stdout[-3000:]}\n{p.stderr[-6000:]}"
    assert p.returncode == 0 and lines, f"worker {mode} failed ({p.returncode}):\n{output}"
    return dict(json.loads(lines[-1][len("RESULT "):]))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Server:
    """One ``lmcache server`` process (CPU, L1 as a write buffer: warm
    reads come from L2) with the given L2 adapter specs."""

    def __init__(self, adapters: list[str], log: Path) -> None:
        self.port, self.http = free_port(), free_port()
        self.log = log
        cmd = [
            str(BIN / "lmcache"), "server", "--host", "127.0.0.1", "--port", str(self.port),
            "--http-port", str(self.http), "--l1-size-gb", "0.25", "--eviction-policy", "LRU",
            "--supported-transfer-mode", "auto", "--l2-store-policy", "skip_l1",
            "--disable-metrics",
        ]
        for a in adapters:
            cmd += ["--l2-adapter", a]
        self._out = open(log, "ab")  # noqa: SIM115 (closed in stop)
        # stop() Ctrl-C's it: started with a terminal's SIGINT (tests/_signals.py), not a background job's SIG_IGN
        self.proc = subprocess.Popen(
            as_from_a_terminal(cmd), stdout=self._out, stderr=subprocess.STDOUT, env=env(), cwd=REPO,
            start_new_session=True,
        )

    def wait_ready(self, timeout: float = 120) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, f"lmcache server exited:\n{self.log.read_text()[-4000:]}"
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.http}/", timeout=1) as r:
                    if r.status == 200:
                        return
            except OSError:
                time.sleep(0.25)
        raise AssertionError(f"lmcache server not ready in {timeout}s:\n{self.log.read_text()[-4000:]}")

    def bench(self, start: int, end: int, *extra: str, timeout: float = 240) -> tuple[dict[str, Any], str]:
        """``lmcache bench server --mode cpu --transfer-mode engine_driven``:
        its JSON report and its terminal lines."""
        cmd = [
            str(BIN / "lmcache"), "bench", "server", "--mode", "cpu", "--transfer-mode", "engine_driven",
            "--rpc-url", f"tcp://127.0.0.1:{self.port}", "--url", f"http://127.0.0.1:{self.http}",
            "--kvcache-shape-spec", "(2,64,16,8,128):float16:4", "--start", str(start),
            "--end", str(end), "--interval", "0", "--format", "json", *extra,
        ]
        p = subprocess.run(cmd, capture_output=True, text=True, env=env(), timeout=timeout, cwd=REPO)
        out = p.stdout
        assert p.returncode == 0, f"bench failed ({p.returncode}):\n{out[-3000:]}\n{p.stderr[-3000:]}"
        report = json.loads(out[out.index("{\n") :].rsplit("}", 1)[0] + "}")
        return report, out

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGINT)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
        self._out.close()
