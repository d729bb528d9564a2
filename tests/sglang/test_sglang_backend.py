"""FstierHiCacheStorage built by SGLang's real ``StorageBackendFactory`` over
real CPU host pools, with SGLang's ``HiCacheFile`` as the control.

Without SGLang these tests skip, unless ``FSTIER_REQUIRE_SGLANG=1`` (set by
``make test-sglang``), where a missing SGLang fails them.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

if os.environ.get("FSTIER_REQUIRE_SGLANG") == "1":
    import sglang.srt.mem_cache.hicache_storage  # noqa: F401  (fail loudly in CI)
else:
    pytest.importorskip(
        "sglang.srt.mem_cache.hicache_storage",
        reason="SGLang not installed (make test-sglang builds .venv-sglang with it)",
    )

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import _sglang_cpu as sgl  # noqa: E402  (CPU seam helpers, shared with bench_sglang.py)
import torch  # noqa: E402

from fstier.errors import ConfigError  # noqa: E402
from fstier.integrations.sglang import FstierHiCacheStorage  # noqa: E402

SG = sgl.import_sglang()
LAYOUTS = ["layer_first", "page_first", "page_first_direct", "page_head"]
MLA_LAYOUTS = ["layer_first", "page_first", "page_first_direct"]
DTYPES = [torch.bfloat16, torch.float8_e4m3fn]
NOCACHE = {"lookup_cache_ttl_s": 0}


@pytest.fixture
def closing() -> Any:
    backends: list[Any] = []

    def track(b: Any) -> Any:
        backends.append(b)
        return b

    yield track
    for b in backends:
        if hasattr(b, "close"):
            b.close()


def _alloc(pool: Any, pages: int) -> Any:
    idx = pool.alloc(pages * pool.page_size)
    assert idx is not None
    return idx


def _files(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*.bin") if p.is_file())


def _page_files(backend: Any, key: str) -> list[Path]:
    """The block files of one page (one per fragment)."""
    from fstier.keys import BlockKey

    h = bytes.fromhex(key)
    return [backend.mapper.path_for(BlockKey(h, g)) for g in range(backend._geometry.fragments)]


def _generic_set(backend: Any, pool: Any, keys: list[str], idx: Any) -> bool:
    """SGLang's controller's legacy store (``_generic_page_set``)."""
    ps = pool.page_size
    data = [pool.get_data_page(idx[i * ps]) for i in range(len(keys))]
    return bool(backend.batch_set(keys, data))


def _generic_get(backend: Any, pool: Any, keys: list[str], idx: Any) -> int:
    """SGLang's controller's legacy load (``_generic_page_get``): pages loaded."""
    ps = pool.page_size
    got = backend.batch_get(keys, [pool.get_dummy_flat_data_page() for _ in keys])
    n = 0
    for i, page in enumerate(got):
        if page is None:
            break
        pool.set_from_flat_data_page(int(idx[i * ps]), page)
        n += 1
    return n


# ------------------------------------------------------------------ loading
def test_sglang_factory_builds_fstier_from_the_dynamic_config(tmp_path: Path, closing: Any) -> None:
    pool = sgl.mha_pool("page_first")
    b = closing(sgl.fstier_backend(tmp_path, pool))
    assert type(b) is FstierHiCacheStorage
    assert isinstance(b, SG.HiCacheStorage)
    assert b.mapper is not None and b.mapper.root == tmp_path.resolve()
    manifest = json.loads((b.mapper.namespace_dir / "config.json").read_text())
    fields = manifest.get("fields", manifest)
    assert "sglang" in json.dumps(fields) and "page_first" in json.dumps(fields)


def test_unknown_option_is_refused_by_name(tmp_path: Path) -> None:
    pool = sgl.mha_pool("page_first")
    with pytest.raises(ConfigError, match="'max_bites'.*unknown"):
        sgl.fstier_backend(tmp_path, pool, options={"max_bites": "1GiB"})
    extra = {**sgl.FSTIER_EXTRA}
    with pytest.raises(ConfigError, match="root_dir.*required"):
        sgl.attach("dynamic", sgl.storage_config(extra), pool)


def test_yaml_config_and_inline_tier_fields(tmp_path: Path, closing: Any) -> None:
    yml = tmp_path / "fstier.yaml"
    yml.write_text(f"tier:\n  root_dir: {tmp_path / 'kv'}\n  max_bytes: 1GiB\n  read_threads: 3\n")
    pool = sgl.mha_pool("page_first")
    extra = {**sgl.FSTIER_EXTRA, "config": str(yml), "read_threads": 5, "tier.checksum": "none"}
    b = closing(sgl.attach("dynamic", sgl.storage_config(extra), pool))
    t = b.fstier.tier_config
    assert (t.root_dir, t.max_bytes, t.read_threads, t.checksum) == (tmp_path / "kv", 1 << 30, 5, "none")
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: {}\n")
    with pytest.raises(ConfigError, match="tier:"):
        sgl.attach("dynamic", sgl.storage_config({**sgl.FSTIER_EXTRA, "config": str(bad)}), pool)


def test_unsupported_layout_is_refused(tmp_path: Path) -> None:
    pool = sgl.mha_pool("page_first")
    pool.layout = "page_unified"  # a layout fstier cannot move fragment by fragment
    with pytest.raises(ConfigError, match="page_unified.*not supported"):
        sgl.fstier_backend(tmp_path, pool)


# --------------------------------------------------------------- round trips
@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp8"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_zero_copy_round_trip_matches_hicachefile(
    layout: str, dtype: Any, tmp_path: Path, closing: Any
) -> None:
    pool = sgl.mha_pool(layout, dtype=dtype)
    fs = closing(sgl.fstier_backend(tmp_path / "fstier", pool))
    hf = closing(sgl.file_backend(tmp_path / "file", pool))
    idx = _alloc(pool, 5)
    sgl.fill_pages(pool, idx, seed=1)
    want = sgl.page_bytes(pool, idx)
    keys = sgl.page_keys(5, layout)

    assert fs.batch_set_v1(keys, idx) == [True] * 5
    assert _generic_set(hf, pool, keys, idx)
    frags = fs._geometry.fragments
    assert frags == (2 * pool.layer_num if layout == "layer_first" else 2)
    assert len(_files(tmp_path / "fstier")) == 5 * frags
    assert fs.batch_exists(keys) == 5 and hf.batch_exists(keys) == 5

    # Everything else in the pool is a sentinel that a load must not touch.
    pool.kv_buffer.view(-1).view(torch.uint8).fill_(0xA5)
    sentinel = pool.kv_buffer.clone()
    assert fs.batch_get_v1(keys, idx) == [True] * 5
    assert sgl.page_bytes(pool, idx) == want
    mask = torch.ones(pool.kv_buffer.numel() * pool.kv_buffer.element_size(), dtype=torch.bool)
    ptrs, sizes = pool.get_page_buffer_meta(idx)
    for p, s in zip(ptrs, sizes, strict=True):
        off = p - pool.kv_buffer.data_ptr()
        mask[off : off + s] = False
    flat, ref = pool.kv_buffer.view(-1).view(torch.uint8), sentinel.view(-1).view(torch.uint8)
    assert torch.equal(flat[mask], ref[mask])

    pool.kv_buffer.view(-1).view(torch.uint8).zero_()
    assert _generic_get(hf, pool, keys, idx) == 5
    assert sgl.page_bytes(pool, idx) == want


@pytest.mark.parametrize("layout", LAYOUTS)
def test_legacy_and_v1_calls_read_each_others_pages(layout: str, tmp_path: Path, closing: Any) -> None:
    pool = sgl.mha_pool(layout, device_pages=16)
    b = closing(sgl.fstier_backend(tmp_path, pool))
    idx = _alloc(pool, 20)  # more than the legacy calls' scratch pages
    sgl.fill_pages(pool, idx, seed=2)
    want = sgl.page_bytes(pool, idx)
    keys = sgl.page_keys(20, "legacy")
    assert _generic_set(b, pool, keys[:10], idx[: 10 * pool.page_size])
    assert b.batch_set_v1(keys[10:], idx[10 * pool.page_size :]) == [True] * 10
    pool.kv_buffer.view(-1).view(torch.uint8).zero_()
    assert b.batch_get_v1(keys, idx) == [True] * 20
    assert sgl.page_bytes(pool, idx) == want
    pool.kv_buffer.view(-1).view(torch.uint8).zero_()
    assert _generic_get(b, pool, keys, idx) == 20
    assert sgl.page_bytes(pool, idx) == want
    assert b.exists(keys[0]) and b.get(keys[0], pool.get_dummy_flat_data_page()) is not None
    assert not b.exists(sgl.page_keys(1, "absent")[0])


def test_restart_on_the_same_root_hits(tmp_path: Path, closing: Any) -> None:
    pool = sgl.mha_pool("page_first_direct")
    idx = _alloc(pool, 6)
    sgl.fill_pages(pool, idx, seed=3)
    want = sgl.page_bytes(pool, idx)
    keys = sgl.page_keys(6, "restart")
    first = sgl.fstier_backend(tmp_path, pool)
    assert first.batch_set_v1(keys, idx) == [True] * 6
    first.close()
    first.close()  # idempotent
    assert first.batch_get_v1(keys, idx) == [False] * 6  # closed: misses, no exception

    pool2 = sgl.mha_pool("page_first_direct")  # a new process's pool, other slots
    idx2 = _alloc(pool2, 8)[2 * pool2.page_size :]
    again = closing(sgl.fstier_backend(tmp_path, pool2))
    assert again.batch_exists(keys) == 6
    assert again.batch_get_v1(keys, idx2) == [True] * 6
    assert sgl.page_bytes(pool2, idx2) == want


# -------------------------------------------------------------- fail closed
def _corrupt(path: Path, how: str, other: Path) -> None:
    data = bytearray(path.read_bytes())
    if how == "flipped":
        data[-100] ^= 0xFF  # inside the payload (its checksum fails)
        path.write_bytes(bytes(data))
    elif how == "short":
        path.write_bytes(bytes(data[: len(data) - 4096]))
    elif how == "foreign":
        path.write_bytes(other.read_bytes())  # another page's intact file
    else:
        raise AssertionError(how)


@pytest.mark.parametrize("how", ["flipped", "short", "foreign"])
@pytest.mark.parametrize("layout", ["layer_first", "page_first"])
def test_a_bad_file_fails_its_page_and_every_later_page(
    layout: str, how: str, tmp_path: Path, closing: Any
) -> None:
    pool = sgl.mha_pool(layout, head_dim=64, page_size=16)  # fragments of whole 4 KiB pages
    b = closing(sgl.fstier_backend(tmp_path, pool, options=NOCACHE))
    idx = _alloc(pool, 6)
    sgl.fill_pages(pool, idx, seed=4)
    want = sgl.page_bytes(pool, idx)
    keys = sgl.page_keys(6, how)
    assert b.batch_set_v1(keys, idx) == [True] * 6
    victim = _page_files(b, keys[2])[-1]  # the last fragment of page 2
    _corrupt(victim, how, _page_files(b, keys[4])[-1])

    pool.kv_buffer.view(-1).view(torch.uint8).zero_()
    assert b.batch_get_v1(keys, idx) == [True, True, False, False, False, False]
    got = sgl.page_bytes(pool, idx)
    assert got[:2] == want[:2]
    # The bad file is gone (proven bad) and the page now misses.
    assert not victim.exists()
    assert b.batch_exists(keys) == 2

    # The control: HiCacheFile checks sizes only, so a flipped byte loads.
    if how == "flipped":
        hf = closing(sgl.file_backend(tmp_path / "file", pool))
        sgl.fill_pages(pool, idx, seed=4)
        assert _generic_set(hf, pool, keys, idx)
        name = next((tmp_path / "file").glob(f"{keys[2]}*.bin"))
        _corrupt(name, "flipped", name)
        pool.kv_buffer.view(-1).view(torch.uint8).zero_()
        assert _generic_get(hf, pool, keys, idx) == 6
        assert sgl.page_bytes(pool, idx)[2] != want[2]


def test_a_missing_fragment_fails_its_page(tmp_path: Path, closing: Any) -> None:
    pool = sgl.mha_pool("page_head")
    b = closing(sgl.fstier_backend(tmp_path, pool, options=NOCACHE))
    idx = _alloc(pool, 4)
    sgl.fill_pages(pool, idx, seed=5)
    keys = sgl.page_keys(4, "missing")
    assert b.batch_set_v1(keys, idx) == [True] * 4
    _page_files(b, keys[1])[0].unlink()  # K of page 1 gone, V still there
    assert b.batch_exists(keys) == 1
    assert b.batch_get_v1(keys, idx) == [True, False, False, False]


def test_keys_name_files_exactly(tmp_path: Path, closing: Any) -> None:
    """A page key is 64 lowercase hex digits, exactly. bytes.fromhex also
    took upper case and skipped whitespace: a page never stored, under a
    key that differs only so, loaded another page's bytes and reported
    success, and a key with spaces (31 bytes) failed the good pages before
    it. Now such a key misses, with the pages after it, and nothing more."""
    pool = sgl.mha_pool("page_first")
    b = closing(sgl.fstier_backend(tmp_path, pool, options=NOCACHE))
    idx = _alloc(pool, 3)
    sgl.fill_pages(pool, idx, seed=11)
    want = sgl.page_bytes(pool, idx)
    keys = sgl.page_keys(3, "exact")
    assert b.batch_set_v1(keys, idx) == [True] * 3
    ps = pool.page_size
    for variant in (keys[0].upper(), keys[0][:62] + "  ", keys[0][:30] + " " + keys[0][30:32] + " " + keys[0][32:62],
                    keys[0] + "\n", " " + keys[0], keys[0][:63] + "G"):
        pool.kv_buffer.view(-1).view(torch.uint8).zero_()
        assert b.batch_get_v1([variant], idx[:ps]) == [False], repr(variant)
        assert sgl.page_bytes(pool, idx[:ps]) == [bytes(len(want[0]))], "another page's bytes were loaded"
        assert b.batch_exists([variant]) == 0 and not b.exists(variant)
    bad = keys[1][:62] + "  "  # fromhex: 31 bytes
    pool.kv_buffer.view(-1).view(torch.uint8).zero_()
    assert b.batch_get_v1([keys[0], keys[2], bad, keys[1]], _pages(idx, ps, [0, 2, 1, 1])) == [True, True, False, False]
    assert sgl.page_bytes(pool, idx[:ps]) == want[:1] and sgl.page_bytes(pool, idx[2 * ps:]) == want[2:]
    assert b.batch_exists([keys[0], keys[2], bad, keys[1]]) == 2
    assert b.batch_exists([keys[0], None, keys[1]]) == 1  # type: ignore[list-item]
    assert b.batch_set_v1([keys[2], bad], _pages(idx, ps, [2, 1])) == [True, False]
    assert b.batch_set([keys[2], bad], [pool.get_data_page(idx[2 * ps]), pool.get_data_page(idx[ps])]) is False
    assert _files(tmp_path) and all(p.name[:64] in keys for p in _files(tmp_path))


def _pages(idx: Any, ps: int, order: list[int]) -> Any:
    return torch.cat([idx[i * ps : (i + 1) * ps] for i in order])


def test_bad_host_indices_fail_the_batch_not_sglang(tmp_path: Path, closing: Any) -> None:
    pool = sgl.mha_pool("page_first")
    b = closing(sgl.fstier_backend(tmp_path, pool))
    idx = _alloc(pool, 2)
    keys = sgl.page_keys(2, "bad")
    assert b.batch_set_v1(keys, idx[:-1]) == [False, False]  # not whole pages
    assert b.batch_set_v1(keys, idx[: pool.page_size]) == [False, False]  # one page for two keys
    assert b.batch_get_v1(keys, idx) == [False, False]


# -------------------------------------------------------------- ranks
def test_tp2_ranks_never_read_each_others_pages(tmp_path: Path, closing: Any) -> None:
    keys = sgl.page_keys(3, "tp2")
    pools, backends, want = [], [], []
    for rank in range(2):
        pool = sgl.mha_pool("page_first")
        b = closing(sgl.fstier_backend(tmp_path, pool, tp_rank=rank, tp_size=2, options=NOCACHE))
        idx = _alloc(pool, 3)
        sgl.fill_pages(pool, idx, seed=10 + rank)
        pools.append((pool, idx))
        backends.append(b)
        want.append(sgl.page_bytes(pool, idx))
    assert want[0] != want[1]
    assert backends[0].batch_set_v1(keys, pools[0][1]) == [True] * 3
    assert backends[1].batch_exists(keys) == 0  # rank 0's files are not rank 1's
    assert backends[1].batch_get_v1(keys, pools[1][1]) == [False] * 3
    assert backends[1].batch_set_v1(keys, pools[1][1]) == [True] * 3
    for rank in range(2):
        pool, idx = pools[rank]
        pool.kv_buffer.view(-1).view(torch.uint8).zero_()
        assert backends[rank].batch_get_v1(keys, idx) == [True] * 3
        assert sgl.page_bytes(pool, idx) == want[rank]
    assert backends[0].mapper.blocks_dir != backends[1].mapper.blocks_dir
    assert backends[0].mapper.namespace_dir == backends[1].mapper.namespace_dir
    # A tp=1 deployment of the same model has its own namespace.
    solo = closing(sgl.fstier_backend(tmp_path, sgl.mha_pool("page_first")))
    assert solo.mapper.namespace != backends[0].mapper.namespace
    assert solo.batch_exists(keys) == 0


@pytest.mark.parametrize("layout", MLA_LAYOUTS)
def test_an_mla_pool_is_shared_by_every_tp_rank(layout: str, tmp_path: Path, closing: Any) -> None:
    keys = sgl.page_keys(4, "mla")
    ranks = []
    for rank in range(2):
        pool = sgl.mla_pool(layout)
        b = closing(sgl.fstier_backend(tmp_path, pool, tp_rank=rank, tp_size=2, is_mla=True))
        ranks.append((pool, _alloc(pool, 4), b))
    (p0, i0, writer), (p1, i1, reader) = ranks
    assert writer.is_writer and not reader.is_writer
    sgl.fill_pages(p0, i0, seed=20)
    want = sgl.page_bytes(p0, i0)
    # The reader rank never writes (SGLang skips its backups anyway).
    sgl.fill_pages(p1, i1, seed=21)
    assert reader.batch_set_v1(keys, i1) == [False] * 4
    assert _files(tmp_path) == []
    assert writer.batch_set_v1(keys, i0) == [True] * 4
    assert reader.batch_exists(keys) == 4
    assert reader.batch_get_v1(keys, i1) == [True] * 4
    assert sgl.page_bytes(p1, i1) == want
    assert writer.mapper.blocks_dir == reader.mapper.blocks_dir
    # An MHA pool of the same model at tp=2 never shares (rank-private).
    mha = closing(sgl.fstier_backend(tmp_path, sgl.mha_pool("page_first"), tp_rank=1, tp_size=2))
    assert mha.mapper.namespace != reader.mapper.namespace


# ------------------------------------------------------------- v2, stats, clear, CLI
def test_multi_pool_models_are_refused_at_attach(tmp_path: Path, closing: Any) -> None:
    pool = sgl.mha_pool("page_first")
    cfg = sgl.storage_config({**sgl.FSTIER_EXTRA, "root_dir": str(tmp_path)})
    b = closing(SG.StorageBackendFactory.create_backend("dynamic", cfg, pool))
    b.register_mem_pool_host(pool)
    b.register_mem_host_pool_v2(pool, "kv")
    b.register_mem_host_pool_v2(sgl.mha_pool("page_first"), "mamba")
    with pytest.raises(ConfigError, match="mamba"):
        b.on_host_pools_registered()


def test_v2_calls_serve_the_kv_pool_only(tmp_path: Path, closing: Any) -> None:
    from sglang.srt.mem_cache.hicache_storage import PoolTransfer

    pool = sgl.mha_pool("page_first")
    b = closing(sgl.fstier_backend(tmp_path, pool))
    idx = _alloc(pool, 3)
    sgl.fill_pages(pool, idx, seed=30)
    want = sgl.page_bytes(pool, idx)
    keys = sgl.page_keys(3, "v2")
    kv = PoolTransfer(name="kv", host_indices=idx, keys=keys)
    assert b.batch_set_v2([kv]) == {"kv": [True] * 3}
    assert b.batch_exists_v2(keys).kv_hit_pages == 3
    pool.kv_buffer.view(-1).view(torch.uint8).zero_()
    assert b.batch_get_v2([kv]) == {"kv": [True] * 3}
    assert sgl.page_bytes(pool, idx) == want
    mamba = PoolTransfer(name="mamba", host_indices=idx, keys=keys)
    assert b.batch_get_v2([mamba]) == {"mamba": [False] * 3}
    assert b.batch_exists_v2(keys, [mamba]).kv_hit_pages == 0


def test_stats_clear_and_close(tmp_path: Path, closing: Any) -> None:
    from sglang.srt.observability.metrics_collector import StorageMetrics

    pool = sgl.mha_pool("page_first")
    b = closing(sgl.fstier_backend(tmp_path, pool, options=NOCACHE))
    idx = _alloc(pool, 4)
    sgl.fill_pages(pool, idx, seed=40)
    keys = sgl.page_keys(4, "stats")
    assert b.batch_set_v1(keys, idx) == [True] * 4
    assert b.batch_get_v1(keys, idx) == [True] * 4
    m = b.get_stats()
    assert isinstance(m, StorageMetrics)
    assert m.backup_pgs == [4] and m.prefetch_pgs == [4]
    assert len(m.prefetch_bandwidth) == 1 and m.prefetch_bandwidth[0] > 0
    assert m.fstier["fstier_stored_blocks_total"] == 8
    assert m.fstier["fstier_loaded_blocks_total"] == 8
    assert b.get_stats().backup_pgs == []  # since the last call

    other = closing(sgl.fstier_backend(tmp_path, sgl.mha_pool("page_first"), tp_rank=1, tp_size=2))
    ok = other.batch_set_v1(keys, _alloc(other.mem_pool_host, 4))
    assert ok == [True] * 4
    before = len(_files(tmp_path))
    assert b.clear() is True
    assert b.batch_exists(keys) == 0
    assert len(_files(tmp_path)) == before - 8  # the other namespace's files stay
    assert other.batch_exists(keys) == 4
    b.close()
    assert b.batch_set_v1(keys, idx) == [False] * 4 and b.batch_exists(keys) == 0


def test_fstier_cli_reads_an_sglang_root(tmp_path: Path, closing: Any) -> None:
    pool = sgl.mha_pool("page_first")
    b = closing(sgl.fstier_backend(tmp_path, pool))
    idx = _alloc(pool, 3)
    sgl.fill_pages(pool, idx, seed=50)
    assert b.batch_set_v1(sgl.page_keys(3, "cli"), idx) == [True] * 3
    b.close()
    run = [sys.executable, "-m", "fstier.cli"]
    out = subprocess.run([*run, "inspect", str(tmp_path), "--json"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert b.mapper.namespace in out.stdout
    out = subprocess.run([*run, "verify", str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    victim = _files(tmp_path)[0]
    data = bytearray(victim.read_bytes())
    data[4096 + 10] ^= 1  # a payload byte (the header is the first 4096)
    victim.write_bytes(bytes(data))
    out = subprocess.run([*run, "verify", str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert out.returncode != 0


def test_capacity_keeps_the_root_under_max_bytes_and_never_serves_half_a_page(
    tmp_path: Path, closing: Any
) -> None:
    pool = sgl.mha_pool("page_first", head_dim=64, page_size=16, device_pages=8)
    file_bytes = 4096 + pool.layer_num * 16 * 2 * 64 * 2  # header + one K (or V) fragment
    cap = 10 * file_bytes  # room for 5 of the 12 pages
    b = closing(sgl.fstier_backend(tmp_path, pool, options={"max_bytes": cap, **NOCACHE}))
    idx = _alloc(pool, 12)
    sgl.fill_pages(pool, idx, seed=60)
    want = sgl.page_bytes(pool, idx)
    keys = sgl.page_keys(12, "cap")
    for i in range(12):  # one batch per page, as requests arrive
        ok = b.batch_set_v1([keys[i]], idx[i * pool.page_size : (i + 1) * pool.page_size])
        # Below the cap every store lands; above it a store may be dropped
        # (cause "capacity") until eviction catches up: a future miss.
        assert ok == [True] or i >= 4
    b.fstier.run_capacity_pass()
    assert sum(p.stat().st_size for p in _files(tmp_path)) <= cap
    pool.kv_buffer.view(-1).view(torch.uint8).zero_()
    whole_pages = 0
    for i, key in enumerate(keys):
        page = idx[i * pool.page_size : (i + 1) * pool.page_size]
        whole = all(f.exists() for f in _page_files(b, key))
        whole_pages += whole
        assert b.batch_exists([key]) == int(whole)
        assert b.batch_get_v1([key], page) == [whole]
        if whole:
            assert sgl.page_bytes(pool, page) == [want[i]]
    assert 0 < whole_pages <= 5


def test_concurrent_prefetch_and_backup_threads_get_their_own_results(
    tmp_path: Path, closing: Any
) -> None:
    """SGLang's prefetch and backup threads call the backend at the same
    time; each call must get its own job's outcome."""
    import threading

    pool = sgl.mha_pool("page_first", device_pages=16)
    b = closing(sgl.fstier_backend(tmp_path, pool))
    ps = pool.page_size
    idx = _alloc(pool, 32)
    sgl.fill_pages(pool, idx, seed=70)
    want = sgl.page_bytes(pool, idx)
    keys = sgl.page_keys(32, "threads")
    assert b.batch_set_v1(keys[:16], idx[: 16 * ps]) == [True] * 16
    absent = sgl.page_keys(4, "never-stored")
    errors: list[str] = []

    def backup() -> None:
        for i in range(16, 32, 2):
            if b.batch_set_v1(keys[i : i + 2], idx[i * ps : (i + 2) * ps]) != [True, True]:
                errors.append(f"store {i}")

    def prefetch() -> None:
        for r in range(8):
            lo = (r % 4) * 4
            got = b.batch_get_v1([*keys[lo : lo + 2], absent[r % 4]], idx[lo * ps : (lo + 3) * ps])
            if got != [True, True, False]:
                errors.append(f"load {r}: {got}")

    threads = [threading.Thread(target=backup), threading.Thread(target=prefetch)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert errors == []
    pool.kv_buffer.view(-1).view(torch.uint8).zero_()
    assert b.batch_get_v1(keys, idx) == [True] * 32
    assert sgl.page_bytes(pool, idx) == want


def test_a_timed_out_load_returns_only_after_the_late_read_released_its_rows(
    tmp_path: Path, closing: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """SGLang reuses host rows as soon as a call returns: a load whose read
    timed out must not return while that read may still fill a row."""
    import threading
    import time

    from fstier.io.fsops import FS

    pool = sgl.mha_pool("page_first")
    idx = _alloc(pool, 2)
    sgl.fill_pages(pool, idx, seed=80)
    keys = sgl.page_keys(2, "late")
    assert closing(sgl.fstier_backend(tmp_path, pool)).batch_set_v1(keys, idx) == [True, True]

    python_path = {**NOCACHE, "io_timeout_s": 0.2, "native_io": "off"}  # the hang is in the Python seam
    b = closing(sgl.fstier_backend(tmp_path, pool, options=python_path))
    release = threading.Event()
    real = FS.preadv

    def hung_preadv(fd: int, bufs: Any, offset: int) -> int:
        release.wait(20)  # a hung NFS read, until the test lets it go
        return real(fd, bufs, offset)

    monkeypatch.setattr(FS, "preadv", hung_preadv)
    got: list[list[bool]] = []
    call = threading.Thread(target=lambda: got.append(b.batch_get_v1(keys, idx)))
    call.start()
    deadline = time.monotonic() + 20
    while not b.fstier.fenced_slots and time.monotonic() < deadline:
        time.sleep(0.02)
    assert b.fstier.fenced_slots  # the read timed out: its row is fenced
    call.join(0.5)
    assert call.is_alive() and got == []  # FsTier has the result; SGLang must not get it yet
    release.set()
    call.join(20)
    assert not call.is_alive() and not b.fstier.fenced_slots
    assert got == [[False, False]]
    monkeypatch.undo()
    assert b.batch_get_v1(keys, idx) == [True, True]  # the tier still serves the pages
