"""Recency writes (a flush of the hits' mtimes) on both I/O paths: every hit
file's mtime moves to now, in one native call per flush on the native path;
a file with a second link and a file behind a symlinked fan-out directory
are left alone."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
from manager_support import keys, load, open_tier, store


@pytest.mark.parametrize("native_io", ["auto", "off"])
def test_a_flush_touches_hit_files_and_nothing_else(tmp_path: Path, native_io: str) -> None:
    with open_tier(tmp_path / "root", native_io=native_io) as t:
        ks = keys(0, 6)
        assert store(t, "s", ks).success
        paths = [Path(t.blocks.path(k)) for k in ks]
        for p in paths:
            os.utime(p, (1_000_000, 1_000_000))
        # ks[4]: a second link (someone's backup of the inode): never touched
        os.link(paths[4], tmp_path / "backup")
        # ks[5]: its fan-out directory swapped for a symlink to a copy outside
        fan = paths[5].parent
        if fan != paths[0].parent:
            outside = tmp_path / "outside"
            shutil.copytree(fan, outside)
            shutil.rmtree(fan)
            fan.symlink_to(outside, target_is_directory=True)
        assert load(t, "l", ks[:4]).success  # hits noted by the load
        t.touch(ks[4:])  # and by the engine
        t.flush_recency()
        for p in paths[:4]:
            assert p.stat().st_mtime > 1_000_000, p
        assert (tmp_path / "backup").stat().st_mtime == 1_000_000
        if fan != paths[0].parent:
            assert (tmp_path / "outside" / paths[5].name).stat().st_mtime == 1_000_000


@pytest.mark.parametrize("native_io", ["auto", "off"])
def test_hits_noted_by_key_are_named_at_the_flush_as_the_files_are_then(tmp_path: Path, native_io: str) -> None:
    # A load's hits are noted by key and their paths named only at the flush: a file removed meanwhile is
    # not created again, a symlink planted at a block path meanwhile is not followed out of the root, a
    # key noted by a load and by touch() is touched once, and a later store of a removed key is its own.
    with open_tier(tmp_path / "root", native_io=native_io) as t:
        ks = keys(0, 4)
        assert store(t, "s", ks).success
        paths = [Path(t.blocks.path(k)) for k in ks]
        for p in paths:
            os.utime(p, (1_000_000, 1_000_000))
        t.flush_recency()  # nothing pending yet (the store wrote new files: no hit)
        assert load(t, "l", ks).success
        t.touch(ks[3:])
        assert sorted(t._recency.pending()) == sorted(map(str, paths))
        assert t.remove(ks[:1]) == [True]
        outside = tmp_path / "outside.bin"
        outside.write_bytes(b"x")
        os.utime(outside, (1_000_000, 1_000_000))
        paths[1].unlink()
        paths[1].symlink_to(outside)
        t.flush_recency()
        assert not paths[0].exists()
        assert outside.stat().st_mtime == 1_000_000 and paths[1].is_symlink()
        assert all(p.stat().st_mtime > 1_000_000 for p in paths[2:])
        assert t._recency.pending() == []
        paths[1].unlink()
        assert store(t, "s2", ks[:2]).success
        assert all(p.stat().st_mtime > 1_000_000 for p in paths)
