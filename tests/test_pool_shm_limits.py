"""HostBlockPool on a too-small /dev/shm: a clear PoolError, never SIGBUS.

Docker's default --shm-size is 64 MiB; FsTier.from_config's private pool is
larger. ftruncate alone makes a sparse tmpfs file, and prefaulting it would
kill the engine with SIGBUS and leave the segment behind. Runs in a child
process so a regression cannot take pytest down with it.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

CHILD = textwrap.dedent(
    """
    import os, sys
    from fstier.slots import host_pool as gpu_copy
    from fstier.errors import PoolError
    gpu_copy._SHM_DIR = sys.argv[1]
    try:
        gpu_copy.HostBlockPool(64, 1 << 20)
    except PoolError as exc:
        print("POOLERROR", exc)
    else:
        print("CREATED")
    print("LEFT", sorted(os.listdir(sys.argv[1])))
    """
)


def test_pool_larger_than_shm_is_a_pool_error(tmp_path: Path) -> None:
    mnt = tmp_path / "shm"
    mnt.mkdir()
    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs needs root")
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=16m", "tmpfs", str(mnt)], capture_output=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount tmpfs here: {mounted.stderr.decode().strip()}")
    try:
        out = subprocess.run([sys.executable, "-c", CHILD, str(mnt)], capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, f"child died (rc {out.returncode}): {out.stderr[-2000:]}"
        assert "POOLERROR" in out.stdout, out.stdout
        assert "shm-size" in out.stdout and "bytes free" in out.stdout
        assert "LEFT []" in out.stdout, "the failed segment must be unlinked"
    finally:
        subprocess.run(["umount", str(mnt)], check=False)
