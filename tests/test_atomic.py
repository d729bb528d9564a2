"""The one atomic_write helper: complete file or old file, never a temp left."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest

from fstier.io.fsops import atomic_write, is_temp_name, temp_path_for


def test_atomic_write_replaces_and_leaves_no_temp(tmp_path: Path) -> None:
    p = tmp_path / "f.json"
    atomic_write(p, b"one", fsync="file+dir")
    atomic_write(p, b"two", mode=0o600, fsync="none")
    assert p.read_bytes() == b"two"
    assert oct(p.stat().st_mode & 0o777) == oct(0o600)
    assert [x.name for x in tmp_path.iterdir()] == ["f.json"]


def test_atomic_write_failure_keeps_old_file_and_removes_temp(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    p = tmp_path / "f.json"
    atomic_write(p, b"old")

    def enospc(fd: int, data: object) -> int:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "write", enospc)
    with pytest.raises(OSError) as info:
        atomic_write(p, b"new")
    assert info.value.errno == errno.ENOSPC
    monkeypatch.undo()
    assert p.read_bytes() == b"old"
    assert [x.name for x in tmp_path.iterdir()] == ["f.json"]


def test_atomic_write_handles_short_writes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    real = os.write
    monkeypatch.setattr(os, "write", lambda fd, data: real(fd, bytes(data)[:3]))
    p = tmp_path / "f"
    atomic_write(p, b"0123456789")
    monkeypatch.undo()
    assert p.read_bytes() == b"0123456789"


def test_temp_names_are_unique_and_recognised(tmp_path: Path) -> None:
    final = tmp_path / "abc-g0.bin"
    names = {temp_path_for(final).name for _ in range(100)}
    assert len(names) == 100
    assert all(is_temp_name(n) for n in names)
    assert not is_temp_name("abc-g0.bin") and not is_temp_name(".nfs000123")


def test_atomic_write_refuses_symlinked_temp(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    target = tmp_path / "outside"
    target.write_bytes(b"keep")
    planted = tmp_path / ".planted.tmp.x"
    planted.symlink_to(target)
    import fstier.io.fsops as atomic

    monkeypatch.setattr(atomic, "temp_path_for", lambda final: planted)
    with pytest.raises(FileExistsError):
        atomic.atomic_write(tmp_path / "f", b"evil")
    assert target.read_bytes() == b"keep"
