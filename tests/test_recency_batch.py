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
