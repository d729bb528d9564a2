"""Rows 16 and 17 of the fault matrix, in child processes so the lowered fd
limit and the dropped privileges never leak into the test runner: EMFILE
gives failed stores/loads with that cause, no leaked fd or temp file, and
recovery; as ``nobody``, a read-only tree gives skipped stores, a 0000 file an
ERROR load that leaves it in place, and an unwritable root a clear startup error.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import pytest

from fstier.io.blockstore import NamespaceDirs

from ._support import Tier, key_for, temp_files

CHILD = Path(__file__).with_name("_child.py")


def _run(*args: str) -> dict[str, Any]:
    res = subprocess.run([sys.executable, str(CHILD), *args], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    data: dict[str, Any] = json.loads(res.stdout.strip().splitlines()[-1])
    assert "crash" not in data, data["crash"]
    return data


def test_emfile_under_lowered_rlimit(tmp_path: Path) -> None:
    r = _run("emfile", str(tmp_path / "root"))
    assert r["stores"] == [["FAILED", "EMFILE"]] * 5
    assert r["loads"] == [["ERROR", "EMFILE"]] * 5, "EMFILE is transient: ERROR, file kept"
    assert r["fds_after"] == r["fds_before"], "EMFILE handling leaked descriptors"
    assert r["temps"] == 0
    assert r["recovered"] == [["STORED", ""]] * 5
    assert r["reload"] == ["LOADED", "", True]


def test_permissions_as_nobody() -> None:
    if os.geteuid() != 0:
        pytest.skip("dropping to nobody needs root; as a normal user the bits already apply")
    # Not under tmp_path: pytest's base temp dir is 0700, so nobody could not reach it.
    base = Path(tempfile.mkdtemp(prefix="fstier-perm-", dir="/tmp"))
    try:
        base.chmod(0o755)
        root = base / "root"
        tier = Tier.open(root)
        for i in (1, 2):
            assert tier.store(key_for(i)).status == "STORED"
        NamespaceDirs(tier.mapper).ensure(tier.path(key_for(3)))  # the store itself must fail
        locked = tier.path(key_for(2))
        locked.chmod(0o000)
        r = _run("asuser", str(root), str(base / "other"))
        if "skip" in r:
            pytest.skip(r["skip"])
        assert r["uid"] == 65534
        assert r["store"] == ["FAILED", "EACCES"], "a store into a read-only tree is skipped"
        assert r["mkdir"].startswith("PermissionError") and "Permission denied" in r["mkdir"]
        assert r["load_readable"] == ["LOADED", "", True]
        assert r["load_locked"] == ["ERROR", "EACCES"], "EACCES is transient: ERROR, not CORRUPT"
        assert locked.exists(), "an unreadable block must not be removed"
        assert r["temps"] == 0 and temp_files(root) == []
        assert r["startup"].startswith("StorageError") and "Permission denied" in r["startup"], r["startup"]
        assert str(base / "other") in r["startup"], "the startup error must name the directory"
        assert not (base / "other").exists()
    finally:
        subprocess.run(["rm", "-rf", str(base)], check=False)
