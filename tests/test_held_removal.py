"""Deletions hold the directory that was checked (fstier/io/heldtree.py):
``fstier gc --remove-foreign`` removes the foreign namespace it checked,
never a directory renamed into its name afterwards; ``--check-root``
removes only what it made. Real directories, real renames; the rename
lands exactly between the check and the removal (the check is wrapped)."""

from __future__ import annotations

import errno
import os
import socket
from pathlib import Path
from typing import Any

import pytest
from test_format_v2 import _v1_namespace

import fstier.tier.gc as gc_mod
from fstier.cli import rootcheck
from fstier.config import TierConfig
from fstier.io.heldtree import empty_held_dir, held_tree_size, open_held_dir, rmdir_if_same
from fstier.tier.gc import remove_foreign_namespaces


def _precious(d: Path) -> Path:
    d.mkdir()
    f = d / "thesis.tex"
    f.write_text("years of work")
    return f


def test_remove_foreign_never_deletes_a_directory_renamed_in_after_the_check(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    root = tmp_path / "root"
    ns, block = _v1_namespace(root)
    user = _precious(tmp_path / "mine")
    aside = root / "moved-aside"
    real = gc_mod.check_namespace

    def check_then_swap(*args: Any, **kwargs: Any) -> Any:
        found = real(*args, **kwargs)
        # The checked namespace leaves; a user's directory takes its name.
        os.rename(ns, aside)
        os.rename(user.parent, ns)
        return found

    monkeypatch.setattr(gc_mod, "check_namespace", check_then_swap)
    errors: list[OSError] = []
    found = remove_foreign_namespaces(root, on_error=errors.append)
    assert (ns / "thesis.tex").read_text() == "years of work", "a user's directory was deleted"
    assert [(f.version, f.removed) for f in found] == [(1, False)]
    assert [e.errno for e in errors] == [errno.ESTALE] and str(ns) in str(errors[0])
    # What was checked (and only that) was emptied, wherever it went.
    assert not (aside / block.relative_to(ns)).exists() and list(aside.iterdir()) == []


def test_remove_foreign_skips_a_name_swapped_for_a_symlink(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A namespace replaced by a link to a user's directory before it is
    opened: the link is not followed, nothing is removed."""
    root = tmp_path / "root"
    ns, _ = _v1_namespace(root)
    user = _precious(tmp_path / "mine")
    real = gc_mod.open_held_dir

    def swap_then_open(parent_fd: int, name: str) -> int:
        os.rename(ns, root / "aside")
        os.symlink(user.parent, ns)
        return real(parent_fd, name)

    monkeypatch.setattr(gc_mod, "open_held_dir", swap_then_open)
    errors: list[OSError] = []
    assert remove_foreign_namespaces(root, on_error=errors.append) == []
    assert user.read_text() == "years of work" and ns.is_symlink()
    assert [e.errno for e in errors] in ([errno.ELOOP], [errno.ENOTDIR])


def test_remove_foreign_still_removes_the_checked_namespace(tmp_path: Path) -> None:
    root = tmp_path / "root"
    ns, _ = _v1_namespace(root)
    user = _precious(root / "not-a-namespace")
    link = root / "linked-0123456789abcdef"
    link.symlink_to(user.parent)
    found = remove_foreign_namespaces(root)
    assert [(Path(f.path).name, f.version, f.files, f.removed) for f in found] == [(ns.name, 1, 2, True)]
    assert not ns.exists() and user.exists() and link.is_symlink()


def test_held_walk_unlinks_links_never_follows_them(tmp_path: Path) -> None:
    outside = _precious(tmp_path / "outside")
    top = tmp_path / "top"
    (top / "a" / "b").mkdir(parents=True)
    (top / "a" / "b" / "f").write_bytes(b"x" * 10)
    (top / "a" / "link").symlink_to(outside.parent)
    (top / "filelink").symlink_to(outside)
    parent = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        fd = open_held_dir(parent, "top")
        try:
            files, _ = held_tree_size(fd, str(top))
            assert files == 3  # f and the two links (as links)
            assert empty_held_dir(fd, str(top)) == 0
            assert rmdir_if_same(parent, "top", fd) == "removed"
        finally:
            os.close(fd)
    finally:
        os.close(parent)
    assert not top.exists() and outside.read_text() == "years of work"


def test_held_walk_is_bounded_in_depth(tmp_path: Path) -> None:
    deep = tmp_path / "top"
    p = deep
    for i in range(40):
        p = p / f"d{i}"
    p.mkdir(parents=True)
    errors: list[OSError] = []
    parent = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    fd = open_held_dir(parent, "top")
    try:
        assert empty_held_dir(fd, str(deep), errors.append) > 0
    finally:
        os.close(fd)
        os.close(parent)
    assert [e.errno for e in errors] == [errno.ELOOP]


# -- --check-root ---------------------------------------------------------------
def _tier(root: Path) -> TierConfig:
    return TierConfig.model_validate({"root_dir": root, "o_direct": "off"})


def test_check_root_leaves_an_existing_check_directory_alone(tmp_path: Path) -> None:
    """A directory already named like the check's scratch directory (this
    host and pid) is someone's: before, the check failed on EEXIST and
    then rmtree'd it."""
    root = tmp_path / "root"
    root.mkdir()
    theirs = _precious(root / f".fstier-check.{socket.gethostname()}.{os.getpid()}")
    checks = rootcheck.check_root(_tier(root))
    assert [c.status for c in checks if c.name == "write"] == ["ok"]
    assert theirs.read_text() == "years of work"
    assert sorted(p.name for p in root.iterdir()) == [theirs.parent.name]


def test_check_root_name_collision_fails_the_check_and_removes_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    root = tmp_path / "root"
    root.mkdir()
    theirs = _precious(root / ".fstier-check.same-name")
    monkeypatch.setattr(rootcheck, "_scratch_name", lambda: theirs.parent.name)
    checks = rootcheck.check_root(_tier(root))
    write = [c for c in checks if c.name == "write"]
    assert write and write[0].status == "fail" and "exists" in write[0].detail
    assert theirs.read_text() == "years of work"


def test_check_root_removes_only_the_files_it_made(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A file another process put into the scratch directory during the
    check survives it (and so does the directory that holds it)."""
    root = tmp_path / "root"
    root.mkdir()
    real = rootcheck._write_check

    def plant(root_: Path, held: int, tier: TierConfig, out: list[Any], scratch: Path) -> bool:
        fd = os.open("intruder", os.O_WRONLY | os.O_CREAT, 0o644, dir_fd=held)
        os.close(fd)
        return real(root_, held, tier, out, scratch)

    monkeypatch.setattr(rootcheck, "_write_check", plant)
    checks = rootcheck.check_root(_tier(root))
    assert all(c.status == "ok" for c in checks), checks
    left = [p for p in root.rglob("*")]
    assert [p.name for p in left if p.is_file()] == ["intruder"]


def test_check_root_leaves_nothing_behind(tmp_path: Path) -> None:
    root = tmp_path / "root"
    checks = rootcheck.check_root(_tier(root))
    assert [c.name for c in checks] == ["create", "write", "o_direct", "space", "owner"]
    assert list(root.iterdir()) == []
