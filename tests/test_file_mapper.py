"""FileMapper: the parallel-agnostic rule, namespace digests, safe paths, manifests."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
from conftest import make_config
from hypothesis import given
from hypothesis import strategies as st

from fstier.config import ModelSpec, ParallelSpec
from fstier.errors import NamespaceMismatchError, PathSafetyError
from fstier.file_mapper import (
    FileMapper,
    decode,
    encode,
    is_parallel_agnostic,
    parallel_identity,
    safe_model_name,
)
from fstier.io.blockstore import NamespaceDirs
from fstier.io.fsops import is_temp_name
from fstier.io.manifest import ensure_manifest
from fstier.keys import BlockKey

FULL = {"kind": "full_attention", "block_size": 16, "num_layers": 2, "num_kv_heads": 8, "head_size": 64}
SLIDING = {**FULL, "kind": "sliding_window", "sliding_window": 128}
MLA = {"kind": "mla", "block_size": 16, "num_layers": 2, "head_size": 576}
MAMBA = {"kind": "mamba", "block_size": 16, "num_layers": 2, "page_size_bytes": "64KiB"}
KEY = BlockKey(bytes(range(16)), 0)


def _model(*groups: dict[str, Any]) -> ModelSpec:
    return ModelSpec.model_validate({"name": "m", "dtype": "float16", "groups": list(groups)})


@pytest.mark.parametrize(
    ("groups", "runner", "expected"),
    [
        ([FULL], "v1", True),
        ([FULL, FULL], "v1", False),
        ([FULL, SLIDING], "v1", False),
        ([SLIDING], "v1", False),
        ([MLA], "v1", False),
        ([MAMBA], "v1", False),
        ([FULL, MAMBA], "v1", False),
        ([FULL], "v2", False),
    ],
    ids=["one-full", "two-groups", "full+sliding", "sliding-only", "mla", "mamba", "hybrid-mamba", "runner-v2"],
)
def test_parallel_agnostic_predicate(groups: list[dict[str, Any]], runner: str, expected: bool) -> None:
    par = ParallelSpec(tp_size=2, model_runner=runner)  # type: ignore[arg-type]
    assert is_parallel_agnostic(_model(*groups), par) is expected


def test_agnostic_paths_identical_across_tp_and_rank(tmp_path: Path) -> None:
    paths = set()
    for tp in (1, 2, 4, 8):
        for rank in range(tp):
            cfg = make_config(tmp_path, parallel={"tp_size": tp, "rank": rank})
            paths.add(FileMapper(cfg).path_for(KEY))
    assert len(paths) == 1
    (path,) = paths
    assert "/r0/" not in str(path)


def test_one_collapse_rule_for_configs_and_engines(tmp_path: Path) -> None:
    sizes = {"tp_size": 4, "pp_size": 2, "pcp_size": 1, "dcp_size": 2}
    assert parallel_identity(True, sizes) == dict.fromkeys(sizes, 1)
    assert parallel_identity(False, sizes) == sizes
    # An engine-defined namespace with the rule applied lands where any rank
    # of any layout does: no rank segment.
    mappers = [
        FileMapper.for_engine(
            tmp_path, "m", {"x": 1, **parallel_identity(True, {"tp_size": tp})},
            agnostic=True, rank=rank, payload_bytes=[4096],
        )
        for tp, rank in ((1, 0), (2, 1), (4, 3))
    ]
    assert len({m.path_for(KEY) for m in mappers}) == 1
    assert "/r" not in str(mappers[0].path_for(KEY).relative_to(tmp_path.resolve()))


@pytest.mark.parametrize("groups", [[MLA], [FULL, SLIDING], [SLIDING]])
def test_non_agnostic_paths_differ_per_tp_and_rank(tmp_path: Path, groups: list[dict[str, Any]]) -> None:
    seen: dict[Path, tuple[int, int]] = {}
    for tp in (1, 2, 4):
        for rank in range(tp):
            cfg = make_config(tmp_path, groups=groups, parallel={"tp_size": tp, "rank": rank})
            path = FileMapper(cfg).path_for(KEY)
            assert path not in seen, f"tp={tp} rank={rank} collides with {seen[path]}"
            seen[path] = (tp, rank)
            assert f"/r{rank}/" in str(path)


@pytest.mark.parametrize(
    ("heads", "block_size", "par", "expected"),
    [
        (3, 16, {"tp_size": 2}, False),  # 3 heads neither shard nor replicate over 2 ranks
        (3, 16, {"tp_size": 3}, True),
        (2, 16, {"tp_size": 4}, True),  # replicated heads are certified
        (8, 16, {"tp_size": 2, "pcp_size": 2}, True),
        (8, 6, {"tp_size": 2, "pcp_size": 4}, False),  # 6 tokens do not split over 4 cp ranks
    ],
)
def test_uncertified_layouts_are_not_agnostic(
    heads: int, block_size: int, par: dict[str, int], expected: bool
) -> None:
    model = _model({**FULL, "num_kv_heads": heads, "block_size": block_size})
    assert is_parallel_agnostic(model, ParallelSpec(**par)) is expected


def test_v2_runner_keeps_tp_in_namespace(tmp_path: Path) -> None:
    a = FileMapper(make_config(tmp_path, parallel={"tp_size": 2, "model_runner": "v2"}))
    b = FileMapper(make_config(tmp_path, parallel={"tp_size": 4, "model_runner": "v2"}))
    assert a.digest != b.digest


def _digest(tmp_path: Path, groups: list[dict[str, Any]] | None = None, **over: Any) -> str:
    return FileMapper(make_config(tmp_path, groups=groups, **over)).digest


@pytest.mark.parametrize(
    ("label", "groups", "over"),
    [
        ("dtype", None, {"model": {"dtype": "bfloat16"}}),
        ("block_size", [{**FULL, "block_size": 32}], {}),
        ("num_kv_heads", [{**FULL, "num_kv_heads": 4}], {}),
        ("head_size", [{**FULL, "head_size": 128}], {}),
        ("num_layers", [{**FULL, "num_layers": 3}], {}),
        ("kv_layout (canonical format id)", [{**FULL, "kv_layout": "HND"}], {}),
        ("blocks_per_file", None, {"tier": {"blocks_per_file": 4}}),
        ("revision", None, {"model": {"revision": "deadbeef"}}),
        ("salt", None, {"tier": {"namespace_salt": "tenant-b"}}),
        ("model name", None, {"model": {"name": "acme/other"}}),
    ],
)
def test_each_byte_changing_field_changes_the_namespace(
    tmp_path: Path, label: str, groups: list[dict[str, Any]] | None, over: dict[str, Any]
) -> None:
    assert _digest(tmp_path) != _digest(tmp_path, groups, **over), label


def test_canonical_format_version_changes_the_namespace(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import fstier.canonical as fmt

    before = _digest(tmp_path)
    monkeypatch.setattr(fmt, "CANONICAL_LAYOUT_VERSION", fmt.CANONICAL_LAYOUT_VERSION + 1)
    assert _digest(tmp_path) != before


def test_tier_knobs_that_do_not_change_bytes_keep_the_namespace(tmp_path: Path) -> None:
    base = _digest(tmp_path)
    assert base == _digest(tmp_path, tier={"read_threads": 3, "fsync": "file+dir", "o_direct": "off"})


def test_golden_namespace_and_path(tmp_path: Path) -> None:
    # Pins the on-disk layout: if this changes, every existing cache is orphaned.
    cfg = make_config(tmp_path)
    m = FileMapper(cfg)
    assert m.digest == GOLDEN_DIGEST
    rel = m.path_for(BlockKey(bytes(range(16)), 0)).relative_to(tmp_path)
    assert str(rel) == f"acme_llama-tiny-{GOLDEN_DIGEST}/000/000102030405060708090a0b0c0d0e0f-g0.bin"


HOSTILE = [
    "../../etc", "/abs/path", "a/b", "..", ".", "a\x00b", "x" * 500, "ｍｏｄｅｌ／..／..", "..\\..\\win",
    "~root", "$(rm -rf /)", "", " ", "\u202e", "a/../../b",
]


@pytest.mark.parametrize("name", HOSTILE)
def test_hostile_model_names_stay_under_root(tmp_path: Path, name: str) -> None:
    safe = safe_model_name(name)
    assert "/" not in safe and safe not in ("", ".", "..") and not safe.startswith(".")
    assert len(safe) <= 64
    if "\x00" in name or not name:
        return  # rejected by ModelSpec: NUL / empty names never reach the mapper
    cfg = make_config(tmp_path / "root", model={"name": name})
    m = FileMapper(cfg)
    root = (tmp_path / "root").resolve()
    for p in (m.namespace_dir, m.path_for(KEY)):
        assert Path(os.path.realpath(p)).is_relative_to(root)
    ensure_manifest(m)
    NamespaceDirs(m).ensure(m.path_for(KEY))
    assert list(tmp_path.iterdir()) == [tmp_path / "root"]


def test_nul_and_empty_names_rejected(tmp_path: Path) -> None:
    from fstier.errors import ConfigError

    for bad in ("a\x00b", ""):
        with pytest.raises(ConfigError, match="model.name"):
            make_config(tmp_path, model={"name": bad})


def test_manifest_written_once_atomically_and_mismatch_refused(tmp_path: Path) -> None:
    m = FileMapper(make_config(tmp_path))
    ensure_manifest(m)
    manifest = m.namespace_dir / "config.json"
    data = json.loads(manifest.read_text())
    assert data["digest"] == m.digest and data["fields"]["model"] == "acme/llama-tiny"
    assert data["parallel_agnostic"] is True
    mtime = manifest.stat().st_mtime_ns
    ensure_manifest(FileMapper(make_config(tmp_path, parallel={"tp_size": 4, "rank": 3})))
    assert manifest.stat().st_mtime_ns == mtime  # same namespace: left alone
    assert not [p for p in m.namespace_dir.iterdir() if is_temp_name(p.name)]
    data["fields"]["dtype"] = "float32"
    manifest.write_text(json.dumps(data))
    with pytest.raises(NamespaceMismatchError, match="differ"):
        ensure_manifest(m)
    manifest.write_text("{not json")
    with pytest.raises(NamespaceMismatchError, match="unreadable"):
        ensure_manifest(m)


def test_symlinked_subdirectory_is_refused(tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    m = FileMapper(make_config(tmp_path / "root"))
    ensure_manifest(m)
    path = m.path_for(KEY)
    path.parent.symlink_to(outside)  # the fan-out directory (format v2: one level)
    with pytest.raises(PathSafetyError, match="symlink"):
        NamespaceDirs(m).ensure(path)
    assert list(outside.iterdir()) == []


def test_key_group_out_of_range(tmp_path: Path) -> None:
    m = FileMapper(make_config(tmp_path))
    with pytest.raises(PathSafetyError, match="group 3"):
        m.path_for(BlockKey(bytes(16), 3))


def test_expected_payload_scales_for_rank_private_groups(tmp_path: Path) -> None:
    full2 = FileMapper(make_config(tmp_path, parallel={"tp_size": 2}))
    full4 = FileMapper(make_config(tmp_path, parallel={"tp_size": 4}))
    assert full2.expected_payload_bytes(0) == full4.expected_payload_bytes(0) == 2 * 2 * 16 * 8 * 64 * 2
    mla2 = FileMapper(make_config(tmp_path, groups=[MLA], parallel={"tp_size": 2}))
    mla4 = FileMapper(make_config(tmp_path, groups=[MLA], parallel={"tp_size": 4}))
    assert mla4.expected_payload_bytes(0) == 2 * mla2.expected_payload_bytes(0)


GOLDEN_DIGEST = "0f8e396dc6b76ea2"  # namespace version 2 (format v2)


def test_unwritable_root_is_a_storage_error_naming_it(tmp_path: Path) -> None:
    from fstier.errors import StorageError

    ro = tmp_path / "ro"
    ro.mkdir()
    (ro / "blocker").write_text("a file where the root's parent should be")
    m = FileMapper(make_config(ro / "blocker" / "root"))
    with pytest.raises(StorageError, match="tier.root_dir") as info:
        ensure_manifest(m)
    assert "blocker" in str(info.value) and "choose another root_dir" in str(info.value)
    assert isinstance(info.value, OSError)


def test_namespace_dirs_recreate_removed_fanout_levels(tmp_path: Path) -> None:
    """The block store's directory walk starts at the deepest directory it
    already made; when that one was removed too (gc of empty directories,
    rm -rf), it walks from the namespace again instead of failing the store
    with ENOENT."""
    import shutil

    mapper = FileMapper(make_config(tmp_path / "root"))
    ensure_manifest(mapper)
    dirs = NamespaceDirs(mapper)
    a = mapper.path_for(BlockKey(bytes.fromhex("abcdef") + bytes(29), 0))
    b = mapper.path_for(BlockKey(bytes.fromhex("abc001") + bytes(29), 0))
    dirs.ensure(a)
    assert a.parent.is_dir() and a.parent == b.parent
    shutil.rmtree(a.parent)  # the fan-out directory gone (format v2: one level)
    dirs.forget(a)
    dirs.ensure(b)  # another key of the removed directory
    assert b.parent.is_dir()
    dirs.ensure(mapper.namespace_dir / "x")  # the namespace itself: nothing to make
    with pytest.raises(ValueError, match="not under the namespace"):
        dirs.ensure(tmp_path / "elsewhere" / "x")


def test_file_mapper_is_pure_naming(tmp_path: Path) -> None:
    """Naming a block creates nothing and holds no file descriptor."""
    fds = len(os.listdir("/proc/self/fd"))
    m = FileMapper(make_config(tmp_path / "root"))
    m.path_for(KEY)
    m.manifest()
    assert not (tmp_path / "root").exists() and len(os.listdir("/proc/self/fd")) == fds


# -- the path codec: one place says key -> file and file -> key -------------
@given(h=st.binary(min_size=8, max_size=64), group=st.integers(0, 65535))
def test_codec_round_trips_every_key(h: bytes, group: int) -> None:
    key = BlockKey(h, group)
    rel = encode(key)
    assert decode(rel) == key  # the relative path, placement checked
    assert decode(rel.rpartition("/")[2]) == key  # the bare file name
    assert rel == f"{h.hex()[:3]}/{h.hex()}-g{group}.bin"  # format v2: one fan-out level


@pytest.mark.parametrize(
    "name",
    [
        "config.json",
        f"{KEY.hex}-g0.bin.tmp",
        f".{KEY.hex}-g0.bin.tmp.host.1.2.aa",  # a temp name
        f"{KEY.hex}0-g0.bin",  # odd number of hex digits
        f"{KEY.hex}-g65536.bin",  # no such group
        f"{KEY.hex[:14]}-g0.bin",  # a hash shorter than a BlockKey allows
        f"{KEY.hex.upper()}-g0.bin",
        f"abc/de/{KEY.hex}-g0.bin",  # misplaced: not under its own fan-out
        f"{KEY.hex[:3]}/{KEY.hex[3:5]}/{KEY.hex}-g0.bin",  # format v1's placement
        f"{KEY.hex[:2]}/{KEY.hex}-g0.bin",  # a fan-out directory of the wrong width
    ],
)
def test_codec_decodes_only_what_it_encodes(name: str) -> None:
    assert decode(name) is None


def test_path_for_is_the_codec_under_the_blocks_dir(tmp_path: Path) -> None:
    for groups, over in (([FULL], {}), ([MLA], {"parallel": {"tp_size": 2, "rank": 1}})):
        m = FileMapper(make_config(tmp_path, groups=groups, **over))
        assert m.path_for(KEY) == m.blocks_dir / encode(KEY)
        assert decode(m.path_for(KEY).relative_to(m.blocks_dir).as_posix()) == KEY


def test_one_namespace_directory_rule(tmp_path: Path) -> None:
    """FileMapper names its namespace so that the one rule
    (file_mapper.is_namespace_name) recognises it, whatever the model name;
    inspect, verify, gc and the CLI's ROOT check all ask that rule."""
    from fstier.file_mapper import is_namespace_name

    for name in ("acme/llama-tiny", "x" * 200, ".hidden", "ü/ñ"):
        cfg = make_config(tmp_path, model={"name": name, "dtype": "float16", "groups": [
            {"kind": "full_attention", "block_size": 16, "num_layers": 2, "num_kv_heads": 8, "head_size": 64}]})
        assert is_namespace_name(FileMapper(cfg).namespace_dir.name), name
    assert not is_namespace_name("lost+found")
    assert not is_namespace_name("model-0123456789abcdeg")  # not 16 hex digits
    assert not is_namespace_name("x" * 65 + "-0123456789abcdef")  # longer than FileMapper writes
