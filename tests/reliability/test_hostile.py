"""Rows 18-20 and 22 of the fault matrix: planted symlinks, hostile model
names, malformed configs, stale temp and ``.nfs*`` files.

Promise 5: nothing outside ``root`` is ever created, written or removed. Each
test keeps a sentinel tree beside the root and asserts it is byte-identical
afterwards.
"""

from __future__ import annotations

import contextlib
import os
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

from fstier.cli import main as cli_main
from fstier.config import load_config
from fstier.errors import ConfigError, PathSafetyError
from fstier.file_mapper import FileMapper
from fstier.io import fsops
from fstier.io.blockcheck import verify_file
from fstier.io.blockstore import NamespaceDirs
from fstier.io.manifest import ensure_manifest
from fstier.tier.gc import collect_garbage

from ._support import Tier, block_files, iter_files, key_for, payload_for, temp_files, tiny_config


def _snapshot(d: Path) -> dict[str, bytes]:
    return {str(p.relative_to(d)): p.read_bytes() for p in iter_files(d)}


@pytest.fixture
def outside(tmp_path: Path) -> Path:
    d = tmp_path / "outside"
    d.mkdir()
    (d / "precious.txt").write_bytes(b"do not touch")
    return d


# ------------------------------------------------------------------ row 18
def test_symlink_at_final_path_store_replaces_link_only(tmp_path: Path, outside: Path) -> None:
    tier = Tier.open(tmp_path / "root")
    before = _snapshot(outside)
    key = key_for(0)
    path = tier.path(key)
    NamespaceDirs(tier.mapper).ensure(path)
    path.symlink_to(outside / "precious.txt")
    assert tier.store(key).status == "STORED"
    assert not path.is_symlink() and verify_file(path).ok
    assert _snapshot(outside) == before


def test_symlink_at_final_path_load_refused(tmp_path: Path, outside: Path) -> None:
    tier = Tier.open(tmp_path / "root")
    src = Tier.open(tmp_path / "other")
    key = key_for(0)
    assert src.store(key).status == "STORED"
    # A link to a *valid* block file of the same key outside root: still refused.
    target = outside / "valid.bin"
    target.write_bytes(src.path(key).read_bytes())
    before = _snapshot(outside)
    path = tier.path(key)
    NamespaceDirs(tier.mapper).ensure(path)
    path.symlink_to(target)
    out, _ = tier.load(key)
    assert out.status != "LOADED" and out.cause == "symlink"
    assert not path.is_symlink() and _snapshot(outside) == before


def test_symlink_planted_at_temp_path(tmp_path: Path, outside: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An attacker racing the writer links the temp name first: O_EXCL |
    O_NOFOLLOW refuses it, the target is untouched, nothing is published."""
    from ._support import FaultyOps

    tier = Tier.open(tmp_path / "root")
    before = _snapshot(outside)
    ops = FaultyOps()

    def openat(real, dir_fd, name, flags, mode=0o600):  # type: ignore[no-untyped-def]
        if ".tmp." in name:
            with contextlib.suppress(FileExistsError):
                os.symlink(outside / "precious.txt", name, dir_fd=dir_fd)
        return real(dir_fd, name, flags, mode)

    # Named temps are what can be raced (an O_TMPFILE inode has no name).
    tier.opts.capabilities.refuse_tmpfile()
    ops.hooks["openat"] = openat
    monkeypatch.setattr(fsops, "FS", ops)
    out = tier.store(key_for(0))
    assert out.status == "FAILED" and out.cause == "EEXIST"
    assert not tier.path(key_for(0)).exists()
    assert _snapshot(outside) == before


def test_symlink_at_subdirectory_refused(tmp_path: Path, outside: Path) -> None:
    tier = Tier.open(tmp_path / "root")
    before = _snapshot(outside)
    key = key_for(0)
    path = tier.path(key)
    fanout = path.parent  # <blocks>/abc (format v2: one fan-out level)
    fanout.symlink_to(outside, target_is_directory=True)
    with pytest.raises(PathSafetyError, match="symlink"):
        NamespaceDirs(tier.mapper).ensure(path)
    assert _snapshot(outside) == before and not (outside / path.name).exists()


def test_symlink_namespace_dir_refused(tmp_path: Path, outside: Path) -> None:
    cfg = tiny_config(tmp_path / "root")
    mapper = FileMapper(cfg)
    mapper.root.mkdir(parents=True)
    mapper.namespace_dir.symlink_to(outside, target_is_directory=True)
    with pytest.raises(PathSafetyError, match="symlink"):
        ensure_manifest(mapper)
    assert sorted(os.listdir(outside)) == ["precious.txt"]


def test_gc_never_follows_or_removes_through_links(tmp_path: Path, outside: Path) -> None:
    tier = Tier.open(tmp_path / "root")
    assert tier.store(key_for(0)).status == "STORED"
    old_temp_target = outside / ".x.bin.tmp.h.1.1.dead"
    old_temp_target.write_bytes(b"x")
    (outside / "0123456789abcdef0123456789abcdef-g0.bin").write_bytes(b"y")
    past = time.time() - 10 * 86400
    os.utime(old_temp_target, (past, past))
    before = _snapshot(outside)
    (tier.mapper.blocks_dir / "link-dir").symlink_to(outside, target_is_directory=True)
    (tier.mapper.blocks_dir / ".y.bin.tmp.h.1.1.beef").symlink_to(old_temp_target)
    report = collect_garbage(tier.mapper.root, 1, low_watermark=0.5, high_watermark=0.9, temp_max_age_s=1)
    assert report.removed_files == 1  # the one real block, above the 1-byte limit
    assert _snapshot(outside) == before


# ------------------------------------------------------------------ row 19
HOSTILE_NAMES = [
    "../../x",
    "/abs/path",
    "..",
    ".",
    "a/../../../etc/passwd",
    "x" * 500,
    "модель/名前/🦙",
    "-rf --no-preserve-root",
    "con:aux|nul?*<>",
    "\\..\\..\\windows",
]


@pytest.mark.parametrize("name", HOSTILE_NAMES)
def test_hostile_model_names_contained(tmp_path: Path, name: str) -> None:
    root = tmp_path / "root"
    tier = Tier.open(root, model={"name": name})
    ns = tier.mapper.namespace_dir
    assert ns.parent == root and "/" not in ns.name and not ns.name.startswith(".")
    assert len(ns.name) <= 64 + 1 + 16
    assert tier.store(key_for(0)).status == "STORED"
    out, got = tier.load(key_for(0))
    assert out.status == "LOADED" and got == payload_for(key_for(0), tier.payload_len)
    created = {p for p in tmp_path.rglob("*")}
    assert all(p == root or root in p.parents for p in created), "created outside root"


def test_nul_in_model_name_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="model.name"):
        tiny_config(tmp_path / "root", model={"name": "a\x00b"})


# ------------------------------------------------------------------ row 20
MALFORMED = {
    "bad_yaml": ("tier: [\n  root_dir: x\n", "invalid YAML"),
    "wrong_type": ("tier: {root_dir: ROOT, read_threads: many}\nmodel: MODEL\n", "tier.read_threads"),
    "unknown_key": ("tier: {root_dir: ROOT, colour: blue}\nmodel: MODEL\n", "tier.colour"),
    "negative_size": ("tier: {root_dir: ROOT, max_bytes: -5}\nmodel: MODEL\n", "tier.max_bytes"),
    "bad_unit": ("tier: {root_dir: ROOT, max_bytes: 12 parsecs}\nmodel: MODEL\n", "tier.max_bytes"),
    "zero_threads": ("tier: {root_dir: ROOT, write_threads: 0}\nmodel: MODEL\n", "tier.write_threads"),
    "root_is_file": ("tier: {root_dir: FILE}\nmodel: MODEL\n", "tier.root_dir"),
    "missing_model": ("tier: {root_dir: ROOT}\n", "model"),
    "top_level_list": ("- 1\n- 2\n", "top level must be a mapping"),
    "bad_watermarks": (
        "tier: {root_dir: ROOT, low_watermark: 0.9, high_watermark: 0.5}\nmodel: MODEL\n",
        "low_watermark",
    ),
    "bad_dtype": ("tier: {root_dir: ROOT}\nmodel: {name: m, dtype: float7, groups: [{head_size: 8}]}\n", "model.dtype"),
    "empty_groups": ("tier: {root_dir: ROOT}\nmodel: {name: m, groups: []}\n", "model.groups"),
}


@pytest.mark.parametrize("case", sorted(MALFORMED))
def test_malformed_config_one_line_naming_the_field(tmp_path: Path, case: str) -> None:
    text, field = MALFORMED[case]
    (tmp_path / "afile").write_text("not a dir")
    model = "{name: m, groups: [{head_size: 8}]}"
    text = text.replace("ROOT", str(tmp_path / "root")).replace("FILE", str(tmp_path / "afile"))
    text = text.replace("MODEL", model)
    cfg = tmp_path / "bad.yaml"
    cfg.write_text(text)
    with pytest.raises(ConfigError) as info:
        load_config(cfg)
    msg = str(info.value)
    assert "\n" not in msg and field in msg, msg
    result = CliRunner().invoke(cli_main, ["config", "validate", str(cfg)])
    if case == "missing_model":
        # The library needs a model; the CLI also validates tier-only files
        # (FstierTier's config option under vLLM, which supplies the model).
        assert result.exit_code == 0 and "tier-only" in result.output, result.output
    else:
        assert result.exit_code != 0 and field in result.output, result.output
    assert not (tmp_path / "root").exists(), "a bad config created the root"


# ------------------------------------------------------------------ row 22
def test_gc_sweeps_stale_temps_and_nfs_files_by_age(tmp_path: Path) -> None:
    tier = Tier.open(tmp_path / "root")
    for i in range(4):
        assert tier.store(key_for(i)).status == "STORED"
    d = tier.path(key_for(0)).parent
    old, fresh = [], []
    for j, name in enumerate([".a.bin.tmp.host.1.1.aaaa", ".nfs000000000123", ".b.bin.tmp.other.9.9.bbbb"]):
        (d / name).write_bytes(b"z" * (j + 1))
        old.append(d / name)
        (d / (name + "f")).write_bytes(b"z")
        fresh.append(d / (name + "f"))
    stranger = d / "notes.txt"  # not a name fstier writes: never removed
    stranger.write_text("keep")
    past = time.time() - 7200
    for p in [*old, stranger]:
        os.utime(p, (past, past))
    report = collect_garbage(tier.mapper.root, None, temp_max_age_s=3600)
    assert report.temp_removed == len(old)
    assert not any(p.exists() for p in old)
    assert all(p.exists() for p in fresh) and stranger.exists()
    assert len(block_files(tier.mapper.root)) == 4
    # The CLI does the same with the same code.
    for p in fresh:
        os.utime(p, (past, past))
    result = CliRunner().invoke(cli_main, ["gc", str(tier.mapper.root), "--max-bytes", "1GiB", "--temp-max-age", "60"])
    assert result.exit_code == 0, result.output
    assert temp_files(tier.mapper.root) == [] and not any(p.exists() for p in fresh)
    assert stranger.exists() and len(block_files(tier.mapper.root)) == 4
