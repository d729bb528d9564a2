"""The engine harness leaves no shared memory behind (runs without an engine).

vLLM's multi-process engine and ``vllm serve`` pass messages through
Python ``multiprocessing.shared_memory`` segments (``/dev/shm/psm_*``, 160-240
MiB each); a SIGKILL of the child's group that reaches their resource
tracker first leaves them behind. The harness removes the segments that
appeared while its child lived and that no live process maps.
"""

from __future__ import annotations

import subprocess
import sys
import time
from multiprocessing import shared_memory
from pathlib import Path

import pytest

from tests.e2e._harness import _cleanup, shm_segments

# The child makes a segment and, as if its resource tracker had been killed
# first, takes it off the tracker's list: only the harness can remove it.
CHILD = """
from multiprocessing import resource_tracker, shared_memory
import time
s = shared_memory.SharedMemory(create=True, size=4096)
resource_tracker.unregister(s._name, "shared_memory")
print(s.name, flush=True)
time.sleep(600)
"""


@pytest.mark.skipif(not Path("/dev/shm").is_dir(), reason="needs /dev/shm")
def test_cleanup_removes_the_childs_orphaned_segment_and_keeps_one_in_use(tmp_path: Path) -> None:
    before = shm_segments()
    log = tmp_path / "child.log"
    with log.open("wb") as out:
        proc = subprocess.Popen([sys.executable, "-c", CHILD], stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
    deadline = time.monotonic() + 60
    while not log.read_text().strip():
        assert proc.poll() is None and time.monotonic() < deadline, log.read_text()
        time.sleep(0.05)
    orphan = Path("/dev/shm") / log.read_text().split()[0].lstrip("/")
    # Another process's segment, made while the child lives and mapped by it
    # (this test process): it must survive the cleanup.
    mine = shared_memory.SharedMemory(create=True, size=4096)
    try:
        assert orphan.exists()
        _cleanup(proc, log, before)
        assert proc.poll() is not None
        assert not orphan.exists(), f"{orphan} left behind"
        assert (Path("/dev/shm") / mine.name.lstrip("/")).exists()
    finally:
        mine.close()
        mine.unlink()
        if orphan.exists():
            orphan.unlink()
