"""FstierTier driven by vLLM's real tiering manager (vLLM 0.33.x on CPU).

Every test builds ``OffloadingSpecFactory.create_spec(OffloadingConfig(...))``
with ``TieringOffloadingSpec`` and a ``secondary_tiers`` entry naming
FstierTier by module path, and drives vLLM's ``TieringOffloadingManager``:
the cascade of stored chunks into files, a restart's RETRY -> HIT_PENDING ->
HIT promotion, bytes in the rows, parallel layouts, bad files, disk full,
reset_cache and events.
"""

from __future__ import annotations

import errno
import os
import re
import subprocess
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from fstier.errors import ConfigError
from fstier.integrations import _vllm_keys as vk
from fstier.integrations import vllm as fv
from fstier.io import fsops
from fstier.manager import JobResult
from tests._vllm_helpers import (
    END,
    FSTIER_TIER,
    Locality,
    LookupResult,
    Medium,
    ReqContext,
    TransferJob,
    block_files,
    fstier_tier,
    keys_for,
    lookup_all,
    offloading_config,
    promote,
    read_rows,
    row_pattern,
    steps,
    store_request,
    tiering_manager,
)

H, HP, M, R = LookupResult.HIT, LookupResult.HIT_PENDING, LookupResult.MISS, LookupResult.RETRY


def tier_cfg(root: Path, **kw: object) -> dict[str, object]:
    return {**FSTIER_TIER, "root_dir": str(root), **kw}


# ------------------------------------------------------------------ the flow
def test_store_cascades_then_restart_promotes_and_serves_the_same_bytes(tmp_path: Path) -> None:
    root = tmp_path / "kv"
    keys = keys_for(1, 6)
    with tiering_manager(offloading_config([tier_cfg(root)], tp=2)) as m:
        tier = fstier_tier(m)
        assert isinstance(tier, fv.FstierTier) and tier.medium is Medium.STORAGE
        written = store_request(m, "store", keys)
        assert len(block_files(root)) == 6
        assert tier.fstier.metrics.stored_blocks.value == 6

    # A restart: a fresh manager and primary tier over the same root.
    with tiering_manager(offloading_config([tier_cfg(root)], tp=2)) as m:
        ctx = ReqContext(req_id="after-restart")
        with m.lock:
            m.on_new_request(ctx)
        history = promote(m, ctx, keys)
        assert history[0] == [R] * 6  # cold: existence checks go to the background
        assert any(row == [HP] * 6 for row in history)  # promotion submitted
        assert history[-1] == [H] * 6
        assert read_rows(m, ctx, keys) == [written[k] for k in keys]
        with m.lock:
            m.on_request_finished(ctx)
        assert fstier_tier(m).fstier.metrics.loaded_blocks.value == 6


def test_unknown_keys_miss_and_a_present_prefix_hits(tmp_path: Path) -> None:
    root = tmp_path / "kv"
    stored, absent = keys_for(2, 3), keys_for(3, 2)
    with tiering_manager(offloading_config([tier_cfg(root)])) as m:
        store_request(m, "s", stored)
    with tiering_manager(offloading_config([tier_cfg(root)])) as m:
        ctx = ReqContext(req_id="q")
        with m.lock:
            m.on_new_request(ctx)
        final = promote(m, ctx, stored + absent)[-1]
        assert final == [H, H, H, M, M]


def test_lookup_makes_no_filesystem_call_on_the_scheduler_thread(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    root = tmp_path / "kv"
    keys = keys_for(4, 64)
    with tiering_manager(offloading_config([tier_cfg(root)], num_chunks=80)) as m:
        store_request(m, "s", keys)
    with tiering_manager(offloading_config([tier_cfg(root)], num_chunks=80)) as m:
        me = threading.get_ident()
        calls: list[str] = []
        real_exists, real_stat = os.path.exists, os.stat

        def exists(p: object) -> bool:
            if threading.get_ident() == me:
                calls.append(f"exists {p}")
            return real_exists(p)  # type: ignore[arg-type]

        def stat(p: object, *a: object, **k: object) -> os.stat_result:
            if threading.get_ident() == me:
                calls.append(f"stat {p}")
            return real_stat(p, *a, **k)  # type: ignore[arg-type]

        monkeypatch.setattr(os.path, "exists", exists)
        monkeypatch.setattr(os, "stat", stat)
        ctx = ReqContext(req_id="q")
        with m.lock:
            m.on_new_request(ctx)
        assert lookup_all(m, ctx, keys) == [R] * 64
        with m.lock:
            m.on_schedule_end(END)
        assert calls == []
        monkeypatch.undo()
        assert promote(m, ctx, keys)[-1] == [H] * 64


def test_a_load_after_its_lookup_takes_the_block_keys_the_lookup_built(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The adapter keeps the BlockKeys its lookups built (bounded) and a load of those keys takes them, the same
    # objects, instead of building them again; a key no lookup saw (the stores here) is built as before.
    from fstier.manager import FsTier

    root = tmp_path / "kv"
    keys = keys_for(6, 5)
    got: list[list[object]] = []
    real = FsTier.submit_load

    def submit_load(self: FsTier, job_id: object, bkeys: list[object], *a: object, **k: object) -> None:
        got.append(list(bkeys))
        real(self, job_id, bkeys, *a, **k)  # type: ignore[arg-type]

    with tiering_manager(offloading_config([tier_cfg(root)])) as m:
        store_request(m, "s", keys)
    monkeypatch.setattr(vk, "_SEEN", {})
    monkeypatch.setattr(vk, "_SEEN_MAX", 8)
    monkeypatch.setattr(FsTier, "submit_load", submit_load)
    with tiering_manager(offloading_config([tier_cfg(root)])) as m:
        ctx = ReqContext(req_id="q")
        with m.lock:
            m.on_new_request(ctx)
        assert promote(m, ctx, keys)[-1] == [H] * 5
    seen = {id(b) for b in vk._SEEN.values()}
    assert got and all(id(b) in seen for b in got[-1]) and len(got[-1]) == 5
    assert len(vk._SEEN) <= 8 + 5  # bounded: cleared before it would pass _SEEN_MAX


# --------------------------------------------------------- parallel layouts
@pytest.mark.parametrize("agnostic", [True, False])
def test_tp2_files_serve_tp4_exactly_when_vllm_says_agnostic(tmp_path: Path, agnostic: bool) -> None:
    root = tmp_path / "kv"
    keys = keys_for(5, 4)
    # Same model and row bytes: tp=2 x 64 KiB per worker, tp=4 x 32 KiB.
    with tiering_manager(offloading_config([tier_cfg(root)], tp=2, agnostic=agnostic, worker_kv_bytes=65536)) as m:
        written = store_request(m, "s", keys)
        ns2 = fstier_tier(m).mapper.namespace
    with tiering_manager(offloading_config([tier_cfg(root)], tp=4, agnostic=agnostic, worker_kv_bytes=32768)) as m:
        tier = fstier_tier(m)
        assert (tier.mapper.namespace == ns2) is agnostic
        ctx = ReqContext(req_id="tp4")
        with m.lock:
            m.on_new_request(ctx)
        final = promote(m, ctx, keys)[-1]
        if agnostic:
            assert final == [H] * 4
            assert read_rows(m, ctx, keys) == [written[k] for k in keys]
        else:
            assert final == [M] * 4
            assert tier.fstier.metrics.corrupt.value == 0  # never even opened


def test_replicated_layout_is_agnostic_and_row_size_is_in_the_digest(tmp_path: Path) -> None:
    root = tmp_path / "kv"
    with tiering_manager(offloading_config([tier_cfg(root)], tp=2, agnostic=False, replicated=True)) as m:
        t = fstier_tier(m)
        assert t.mapper.agnostic and t.mapper.fields["replicated_layout"] is True
        a = t.mapper.namespace
    with tiering_manager(offloading_config([tier_cfg(root)], tp=4, agnostic=False, replicated=True)) as m:
        assert fstier_tier(m).mapper.namespace == a
    with tiering_manager(
        offloading_config([tier_cfg(root)], tp=4, agnostic=False, replicated=True, worker_kv_bytes=32768)
    ) as m:
        assert fstier_tier(m).mapper.namespace != a  # other row bytes


# ------------------------------------------------------------- bad files
@pytest.mark.parametrize("damage", ["flip", "truncate", "foreign", "delete"])
def test_bad_file_fails_promotion_and_the_chunk_is_not_served(tmp_path: Path, damage: str) -> None:
    root = tmp_path / "kv"
    keys = keys_for(6, 4)
    with tiering_manager(offloading_config([tier_cfg(root)])) as m:
        written = store_request(m, "s", keys)
    with tiering_manager(offloading_config([tier_cfg(root)])) as m:
        tier = fstier_tier(m)
        path = Path(tier.mapper.path_for(fv._block_key(keys[2])))
        ctx = ReqContext(req_id="q")
        with m.lock:
            m.on_new_request(ctx)
        # The existence check sees all four files, then one is damaged
        # before the promotion reads it.
        promote_until_present = lookup_all(m, ctx, keys)
        assert promote_until_present == [R] * 4
        steps(m, until=lambda: tier._lookup.lookup(keys[3], ctx) is not None)
        if damage == "flip":
            with open(path, "r+b") as f:
                f.seek(8192)
                b = f.read(1)
                f.seek(8192)
                f.write(bytes([b[0] ^ 0x40]))
        elif damage == "truncate":
            os.truncate(path, os.path.getsize(path) - 4096)
        elif damage == "foreign":
            other = Path(tier.mapper.path_for(fv._block_key(keys[0])))
            path.write_bytes(other.read_bytes())
        else:
            path.unlink()
        history = promote(m, ctx, keys)
        assert history[-1][:2] == [H, H]
        assert history[-1][2] == M  # never served, and not re-promoted
        # The manager keeps answering MISS for it (no promotion livelock).
        for _ in range(3):
            with m.lock:
                m.on_schedule_end(END)
            assert lookup_all(m, ctx, keys[2:3]) == [M]
        assert read_rows(m, ctx, keys[:2]) == [written[k] for k in keys[:2]]
        if damage != "delete":
            assert not path.exists()  # proven corrupt: removed
            assert tier.fstier.metrics.corrupt.value == 1
        with m.lock:
            m.on_request_finished(ctx)
    # A later run does not see the damaged key either.
    with tiering_manager(offloading_config([tier_cfg(root)])) as m:
        ctx = ReqContext(req_id="later")
        with m.lock:
            m.on_new_request(ctx)
        assert promote(m, ctx, keys[2:3])[-1] == [M]


def test_partial_load_reports_the_loaded_prefix_as_successful_keys(tmp_path: Path) -> None:
    root = tmp_path / "kv"
    keys = keys_for(7, 4)
    with tiering_manager(offloading_config([tier_cfg(root)])) as m:
        store_request(m, "s", keys)
        tier = fstier_tier(m)
        os.truncate(tier.mapper.path_for(fv._block_key(keys[2])), 100)
        job = TransferJob(job_id=10_000, keys=keys, chunk_ids=np.arange(20, 24),
                          is_promotion=True, req_context=ReqContext(req_id="x"))
        tier.submit_load(job)
        tier.drain_jobs()
        (res,) = list(tier.get_finished_jobs())
        assert res.job_id == 10_000 and res.success is False
        assert list(res.successful_keys) == keys[:2]
        assert res.transfer_bytes == 2 * tier.block_size_bytes
        assert res.transfer_time is not None and res.transfer_time >= 0


# ----------------------------------------------------------- disk full
def _small_tmpfs(path: Path, size: str) -> bool:
    path.mkdir()
    if os.geteuid() != 0:
        return False
    proc = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                          capture_output=True)
    return proc.returncode == 0


@pytest.mark.parametrize("full", ["tmpfs", "injected"])
def test_disk_full_during_cascade_fails_the_store_and_recovers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, full: str
) -> None:
    root = tmp_path / "small"
    mounted = _small_tmpfs(root, "512k") if full == "tmpfs" else (root.mkdir() or False)
    if full == "tmpfs" and not mounted:
        pytest.skip("cannot mount a tmpfs here (not root, or no CAP_SYS_ADMIN); 'injected' covers it")
    try:
        keys = keys_for(8, 12)  # 12 x (64 KiB + 4 KiB) = 816 KiB > 512 KiB of tmpfs
        if not mounted:
            real = fsops.FS.pwritev
            count = {"n": 0}

            def pwritev(fd: int, bufs: object, offset: int) -> int:
                count["n"] += 1
                if count["n"] > 6:
                    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
                return real(fd, bufs, offset)  # type: ignore[arg-type]

            monkeypatch.setattr(fsops.FS, "pwritev", pwritev)
        # the injected fault is in the Python path's syscall seam: run that backend
        io = {} if mounted else {"native_io": "off"}
        with tiering_manager(offloading_config([tier_cfg(root, breaker_failures=1000, **io)], num_chunks=16)) as m:
            tier = fstier_tier(m)
            failures = []
            real_finished = tier.get_finished_jobs

            def spy() -> list[object]:
                out = list(real_finished())
                failures.extend(r for r in out if not r.success)
                return out

            tier.get_finished_jobs = spy
            store_request(m, "s", keys)
            assert failures, "a store into a full filesystem must fail"
            assert tier.fstier.metrics.failures.values().get("ENOSPC", 0) >= 1
            stored = block_files(root)
            assert 0 < len(stored) < 12
            leftovers = [
                os.path.join(d, f) for d, _, fs in os.walk(root) for f in fs
                if not f.endswith(".bin") and f != "config.json"
            ]
            assert leftovers == []  # no temp file survives a failed store
            # Every file that exists verifies and serves.
            ctx = ReqContext(req_id="q")
            with m.lock:
                m.on_new_request(ctx)
            final = promote(m, ctx, keys)[-1]
            assert final.count(H) == 12  # still in the primary tier
        monkeypatch.undo()
        with tiering_manager(offloading_config([tier_cfg(root)], num_chunks=16)) as m:
            ctx = ReqContext(req_id="q2")
            with m.lock:
                m.on_new_request(ctx)
            final = promote(m, ctx, keys)[-1]
            assert final.count(H) == len(stored)
    finally:
        if mounted:
            subprocess.run(["umount", str(root)], check=False)


# --------------------------------------------------- reset, events, options
def test_reset_cache_drains_jobs_in_flight(tmp_path: Path) -> None:
    root = tmp_path / "kv"
    keys = keys_for(9, 16)
    with tiering_manager(offloading_config([tier_cfg(root)])) as m:
        view = m.primary_tier.get_kv_memoryview()
        ctx = ReqContext(req_id="s")
        with m.lock:
            m.on_new_request(ctx)
            out = m.prepare_store(keys, ctx)
            flat, stride = view.cast("B"), view.strides[0]
            for k, c in zip(out.keys_to_store, out.store_spec.chunk_ids, strict=True):
                flat[int(c) * stride : (int(c) + 1) * stride] = row_pattern(k, stride)
            m.complete_store(keys, ctx)  # 16 stores now in flight in FstierTier
            m.on_request_finished(ctx)
            m.reset_cache()  # asserts vLLM has no job left after drain_jobs
            assert not m.has_pending_work()
        assert len(block_files(root)) == 16


def test_events_stored_and_removed_with_medium_storage(tmp_path: Path) -> None:
    root = tmp_path / "kv"
    keys = keys_for(10, 3)
    with tiering_manager(offloading_config([tier_cfg(root, locality="LOCAL")])) as m:
        tier = fstier_tier(m)
        store_request(m, "s", keys)
        evs = [e for e in m.take_events() if e.medium is Medium.STORAGE]
        assert [(sorted(e.keys), e.removed) for e in evs] == [(sorted(keys), False)]
        assert evs[0].locality is Locality.LOCAL
        os.truncate(tier.mapper.path_for(fv._block_key(keys[0])), 10)
        job = TransferJob(job_id=77, keys=keys[:1], chunk_ids=np.array([30]),
                          is_promotion=True, req_context=ReqContext(req_id="x"))
        tier.submit_load(job)
        tier.drain_jobs()
        assert [r.success for r in tier.get_finished_jobs()] == [False]
        evs = list(tier.take_events())
        assert [(e.keys, e.removed, e.medium) for e in evs] == [([keys[0]], True, Medium.STORAGE)]


def test_events_off_when_vllm_events_are_off(tmp_path: Path) -> None:
    with tiering_manager(offloading_config([tier_cfg(tmp_path / "kv")], events=False)) as m:
        store_request(m, "s", keys_for(11, 2))
        assert list(fstier_tier(m).take_events()) == []


def test_max_bytes_evicts_least_recently_used_files(tmp_path: Path) -> None:
    root = tmp_path / "kv"
    per_file = 65536 + 4096
    with tiering_manager(offloading_config([tier_cfg(root, max_bytes=10 * per_file)], num_chunks=40)) as m:
        tier = fstier_tier(m)
        for i in range(3):
            store_request(m, f"s{i}", keys_for(100 + i, 6))
            tier.fstier.run_capacity_pass()
        assert len(block_files(root)) <= 10
        assert tier.fstier.metrics.evicted_blocks.value >= 8
        # The newest batch survives; evictions became STORAGE removal events.
        newest = {Path(tier.mapper.path_for(fv._block_key(k))) for k in keys_for(102, 6)}
        assert newest <= {Path(p) for p in block_files(root)}
        removed = [e for e in m.take_events() if e.medium is Medium.STORAGE and e.removed]
        assert sum(len(e.keys) for e in removed) >= 8


def test_backpressure_detector_from_vllm_config_sees_transfer_bytes(tmp_path: Path) -> None:
    bp = {"backpressure_cls": "EMABackpressureDetector"}
    with tiering_manager(offloading_config([tier_cfg(tmp_path / "kv", backpressure=bp)])) as m:
        tier = fstier_tier(m)
        assert tier.bp_detector is not None
        store_request(m, "s", keys_for(12, 4))
        assert len(block_files(tmp_path / "kv")) == 4
        assert tier.bp_detector.stats  # fed by completed stores, no error


def test_store_of_present_keys_is_skipped(tmp_path: Path) -> None:
    root = tmp_path / "kv"
    keys = keys_for(13, 3)
    with tiering_manager(offloading_config([tier_cfg(root)])) as m:
        store_request(m, "a", keys)
    with tiering_manager(offloading_config([tier_cfg(root)])) as m:
        store_request(m, "b", keys)
        assert fstier_tier(m).fstier.metrics.skipped_blocks.value == 3
        assert fstier_tier(m).fstier.metrics.stored_blocks.value == 0


def test_stats_reach_vllm_metrics(tmp_path: Path) -> None:
    with tiering_manager(offloading_config([tier_cfg(tmp_path / "kv")])) as m:
        tier = fstier_tier(m)
        names = set(type(tier).build_metric_definitions({}))
        stats = tier.get_stats()
        types, values = stats.metric_sections()
        assert set(types) <= names and "vllm:kv_offload_fstier_degraded" in values
        info = tier.config_info()
        assert info["fstier_namespace"] == tier.mapper.namespace
        assert set(info) == set(type(tier).config_info_keys({}))


def test_get_stats_reports_only_news(tmp_path: Path) -> None:
    """vLLM calls get_stats every scheduler step: with no metric moved and
    the breaker unchanged since the last report it answers None (no ~60 us
    snapshot per idle step); any change is reported at the next call."""
    with tiering_manager(offloading_config([tier_cfg(tmp_path / "kv")])) as m:
        tier = fstier_tier(m)
        assert tier.get_stats() is not None  # the first call reports the gauges
        assert tier.get_stats() is None
        tier.fstier.metrics.lookup_keys.inc(3)
        news = tier.get_stats()
        assert news is not None and not news.is_empty()
        assert tier.get_stats() is None
        tier.fstier.metrics.usage_bytes.set(tier.fstier.metrics.usage_bytes.value)  # same value: no news
        assert tier.get_stats() is None
        tier.fstier.metrics.usage_bytes.add(4096)
        assert tier.get_stats() is not None


def test_shutdown_is_idempotent(tmp_path: Path) -> None:
    with tiering_manager(offloading_config([tier_cfg(tmp_path / "kv")])) as m:
        tier = fstier_tier(m)
    tier.shutdown()
    assert list(tier.take_events()) == []


# ------------------------------------------------------------------ options
def test_vllm_keys_accepted_unknown_keys_refused_by_name(tmp_path: Path) -> None:
    with tiering_manager(offloading_config([tier_cfg(tmp_path / "a", locality="REMOTE", enable_kv_events=True,
                                                     n_read_threads=2, n_write_threads=3)])) as m:
        t = fstier_tier(m)
        assert t.locality is Locality.REMOTE
        assert (t.fstier.tier_config.read_threads, t.fstier.tier_config.write_threads) == (2, 3)
    bad = offloading_config([tier_cfg(tmp_path / "b", max_byte="1GiB")])
    with pytest.raises(ConfigError, match="'max_byte': unknown"), tiering_manager(bad):
        pass


def test_config_yaml_tier_section_with_inline_override(tmp_path: Path) -> None:
    y = tmp_path / "fstier.yaml"
    y.write_text(f"tier:\n  root_dir: {tmp_path / 'yroot'}\n  max_bytes: 1GiB\n  checksum: none\n  read_threads: 3\n")
    tier = {**FSTIER_TIER, "config": str(y), "max_bytes": "2GiB"}
    with tiering_manager(offloading_config([tier])) as m:
        t = fstier_tier(m).fstier.tier_config
        assert t.root_dir == tmp_path / "yroot"
        assert (t.max_bytes, t.checksum, t.read_threads) == (2 << 30, "none", 3)


@pytest.mark.parametrize(
    ("options", "words"),
    [
        ({"root_dir": "/x", "read_threads": 0}, "tier.read_threads: must be >= 1, got 0"),
        ({"root_dir": "/x", "max_bytes": "lots"}, "tier.max_bytes"),
        ({"root_dir": "/x", "bogus": 1}, "'bogus': unknown"),
        ({}, "'root_dir': required"),
        ({"root_dir": "/x", "config": "/nonexistent/f.yaml"}, "not found"),
    ],
)
def test_bad_options_are_one_config_error(options: dict[str, object], words: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(words)):
        fv.tier_config_from_options(options)


def test_yaml_without_tier_section_or_with_unknown_section(tmp_path: Path) -> None:
    a = tmp_path / "a.yaml"
    a.write_text("model:\n  name: m\n")
    with pytest.raises(ConfigError, match="'tier:' mapping"):
        fv.tier_config_from_options({"config": str(a)})
    b = tmp_path / "b.yaml"
    b.write_text(f"tier:\n  root_dir: {tmp_path}\ntierr: {{}}\n")
    with pytest.raises(ConfigError, match="'tierr': unknown section"):
        fv.tier_config_from_options({"config": str(b)})
    c = tmp_path / "c.yaml"
    c.write_text(f"tier:\n  root_dir: {tmp_path}\nmodel:\n  name: ignored\n")
    assert fv.tier_config_from_options({"config": str(c)}).root_dir == tmp_path


def test_fstier_cli_inspects_verifies_and_collects_a_vllm_root(tmp_path: Path) -> None:
    import json

    from click.testing import CliRunner

    from fstier.cli import main

    root = tmp_path / "kv"
    with tiering_manager(offloading_config([tier_cfg(root)])) as m:
        store_request(m, "s", keys_for(14, 6))
        ns = fstier_tier(m).mapper.namespace
    runner = CliRunner()
    res = runner.invoke(main, ["inspect", str(root), "--json"], catch_exceptions=False)
    assert res.exit_code == 0, res.output
    (row,) = json.loads(res.output)["namespaces"]
    assert (row["namespace"], row["files"]) == (ns, 6)
    res = runner.invoke(main, ["verify", str(root), "--json"], catch_exceptions=False)
    assert res.exit_code == 0, res.output  # verify exits 1 when it finds a bad block
    res = runner.invoke(main, ["gc", str(root), "--max-bytes", "200KiB"], catch_exceptions=False)
    assert res.exit_code == 0, res.output
    assert len(block_files(root)) <= 2


def test_a_job_fstier_refuses_fails_as_a_job_not_an_exception(tmp_path: Path) -> None:
    with tiering_manager(offloading_config([tier_cfg(tmp_path / "kv")], num_chunks=8)) as m:
        tier = fstier_tier(m)
        keys = keys_for(15, 2)
        job = TransferJob(job_id=5, keys=keys, chunk_ids=np.array([1, 99]),  # row 99 does not exist
                          is_promotion=True, req_context=ReqContext(req_id="x"))
        tier.submit_load(job)
        assert tier.has_pending_work()
        (res,) = list(tier.get_finished_jobs())
        assert (res.job_id, res.success, res.successful_keys) == (5, False, None)
        assert not tier.has_pending_work()


def test_a_job_whose_chunk_ids_are_not_integers_fails_and_touches_no_row(tmp_path: Path) -> None:
    # A float chunk id used to be truncated (1.9 -> row 1): a load wrote another row than vLLM's. Now the job
    # fails as a refusal (never an exception into vLLM's scheduler), and neither row is written.
    root = tmp_path / "kv"
    keys = keys_for(17, 2)
    with tiering_manager(offloading_config([tier_cfg(root)], num_chunks=8)) as m:
        store_request(m, "s", keys)
    with tiering_manager(offloading_config([tier_cfg(root)], num_chunks=8)) as m:
        tier = fstier_tier(m)
        flat = m.primary_tier.get_kv_memoryview().cast("B")
        flat[:] = b"\x07" * len(flat)
        job = TransferJob(job_id=6, keys=keys, chunk_ids=np.array([1.9, 2.0]),
                          is_promotion=True, req_context=ReqContext(req_id="f"))
        tier.submit_load(job)
        (res,) = list(tier.get_finished_jobs())
        assert (res.job_id, res.success, res.successful_keys) == (6, False, None)
        assert not tier.has_pending_work() and flat.tobytes() == b"\x07" * len(flat)


def test_a_timed_out_load_is_held_back_until_the_late_call_returned(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import time

    root = tmp_path / "kv"
    keys = keys_for(16, 1)
    with tiering_manager(offloading_config([tier_cfg(root)])) as m:
        store_request(m, "s", keys)
    release = threading.Event()
    real = fsops.FS.preadv

    def hung_preadv(fd: int, bufs: object, offset: int) -> int:
        release.wait(10)  # a hung NFS read, until the test lets it go
        return real(fd, bufs, offset)  # type: ignore[arg-type]

    # The hung read is in the Python path's seam: this tier runs the Python backend.
    with tiering_manager(offloading_config([tier_cfg(root, io_timeout_s=0.2, native_io="off")])) as m:
        tier = fstier_tier(m)
        monkeypatch.setattr(fsops.FS, "preadv", hung_preadv)
        tier.submit_load(TransferJob(job_id=9, keys=keys, chunk_ids=np.array([3]),
                                     is_promotion=True, req_context=ReqContext(req_id="x")))
        deadline = time.monotonic() + 10
        while not tier.fstier.fenced_slots and time.monotonic() < deadline:
            time.sleep(0.02)
            assert list(tier.get_finished_jobs()) == []
        assert tier.fstier.fenced_slots == frozenset({3})  # the op timed out, row 3 fenced
        # FsTier has a result, but vLLM must not get the row back yet.
        assert list(tier.get_finished_jobs()) == [] and tier.has_pending_work()
        threading.Timer(0.3, release.set).start()
        tier.drain_jobs()  # returns only once the late call returned
        assert release.is_set() and not tier.fstier.fenced_slots
        (res,) = list(tier.get_finished_jobs())
        assert (res.job_id, res.success) == (9, False)
        monkeypatch.undo()


def test_touch_bumps_the_files_lru_recency(tmp_path: Path) -> None:
    root = tmp_path / "kv"
    keys = keys_for(17, 2)
    with tiering_manager(offloading_config([tier_cfg(root)])) as m:
        tier = fstier_tier(m)
        store_request(m, "s", keys)
        paths = [tier.mapper.path_for(fv._block_key(k)) for k in keys]
        for p in paths:
            os.utime(p, (1_000_000, 1_000_000))  # long ago
        with m.lock:
            m.touch(keys[:1], ReqContext(req_id="t"))  # vLLM's touch reaches every tier
        tier.fstier.flush_recency()
        assert os.stat(paths[0]).st_mtime > 1_000_000 + 3600
        assert os.stat(paths[1]).st_mtime == 1_000_000


def test_fstier_write_budget_drops_a_flood_as_failed_stores(tmp_path: Path) -> None:
    root = tmp_path / "kv"
    keys = keys_for(18, 24)
    opts = tier_cfg(root, max_write_queue_seconds=1e-9)  # room for one job at a time
    with tiering_manager(offloading_config([opts], num_chunks=32)) as m:
        tier = fstier_tier(m)
        view = m.primary_tier.get_kv_memoryview()
        flat, stride = view.cast("B"), view.strides[0]
        for i in range(3):  # three requests' cascades submitted in one step
            ctx = ReqContext(req_id=f"r{i}")
            with m.lock:
                m.on_new_request(ctx)
                out = m.prepare_store(keys[i * 8 : (i + 1) * 8], ctx)
                for k, c in zip(out.keys_to_store, out.store_spec.chunk_ids, strict=True):
                    flat[int(c) * stride : (int(c) + 1) * stride] = row_pattern(k, stride)
                m.complete_store(keys[i * 8 : (i + 1) * 8], ctx)
                m.on_request_finished(ctx)
        flat.release()
        steps(m)
        drops = tier.fstier.metrics.drops.values().get("backpressure", 0)
        assert drops >= 8  # at least one whole job dropped, reported as a failed cascade
        assert 8 <= len(block_files(root)) <= 24 - drops


# ------------------------------------------------------------------ issue 25
@pytest.mark.parametrize(
    ("options", "words"),
    [
        ({"blocks_per_file": 3}, "'blocks_per_file': 3 does not divide vLLM's row of 65536 bytes"),
        ({"enable_kv_events": 0}, "'enable_kv_events': expected true or false, got 0"),
        ({"enable_kv_events": "no"}, "'enable_kv_events': expected true or false, got 'no'"),
    ],
)
def test_options_that_cannot_work_are_config_errors_at_start(
    tmp_path: Path, options: dict[str, object], words: str
) -> None:
    """blocks_per_file=3 on a 64 KiB row was accepted, then every store
    failed in the log only; enable_kv_events: 0 left events on."""
    cfg = offloading_config([tier_cfg(tmp_path / "kv", **options)])
    with pytest.raises(ConfigError, match=re.escape(words)), tiering_manager(cfg):
        pass


def test_a_zero_row_primary_view_is_a_clear_error_not_a_type_error() -> None:
    view = memoryview(np.empty((0, 4096), dtype=np.uint8))
    with pytest.raises(ValueError, match="no rows"):
        fv.RowSlots.from_primary_view(view)


def test_shutdown_releases_the_rows_after_an_op_raised(tmp_path: Path, monkeypatch) -> None:
    """An I/O op that raised kept its traceback, whose frames held views of
    vLLM's rows (in a cycle through the pool frame that stored it): at
    shutdown vLLM could not unmap its region ("Keeping ... mapped: buffers
    are still exported to native users")."""
    import logging

    import fstier.io.blockstore

    seen: list[str] = []

    class Catch(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            seen.append(record.getMessage())

    # The bug is injected into the Python I/O path's store op (the native
    # path runs no Python per block), so this tier runs that path.
    monkeypatch.setenv("FSTIER_NATIVE", "0")
    region_log = logging.getLogger("vllm.v1.kv_offload.cpu.shared_offload_region")
    handler = Catch()
    region_log.addHandler(handler)
    try:
        with tiering_manager(offloading_config([tier_cfg(tmp_path / "kv")])) as m:
            tier = fstier_tier(m)

            def boom(*_a: object, **_k: object) -> int:
                raise RuntimeError("injected bug in a store op")

            monkeypatch.setattr(fstier.io.blockstore, "payload_checksum", boom)
            store_request(m, "s", keys_for(3, 4))
            assert tier.fstier.metrics.stored_blocks.value == 0
            monkeypatch.undo()
    finally:
        region_log.removeHandler(handler)
    assert not [msg for msg in seen if "still exported" in msg], seen


def test_no_exception_from_fstier_reaches_vllms_scheduler(tmp_path: Path, monkeypatch) -> None:
    """Whatever FsTier raises at submission or collection, vLLM gets a
    failed job (or the results next step), never an exception."""
    with tiering_manager(offloading_config([tier_cfg(tmp_path / "kv")])) as m:
        tier = fstier_tier(m)

        def boom(*_a: object, **_k: object) -> None:
            raise RuntimeError("injected")

        monkeypatch.setattr(tier.fstier, "submit_store", boom)
        job = TransferJob(
            job_id=7, keys=keys_for(4, 1), chunk_ids=[0], is_promotion=False,
            req_context=ReqContext(req_id="r"),
        )
        tier.submit_store(job)  # no exception: a failed job
        monkeypatch.setattr(tier.fstier, "get_finished", boom)
        assert list(tier.get_finished_jobs()) == []  # no exception, nothing lost
        monkeypatch.undo()
        (res,) = tier.get_finished_jobs()
        assert (res.job_id, res.success) == (7, False)


def test_read_threads_default_to_vllms_sixteen_unless_set(tmp_path: Path) -> None:
    """Under vLLM the reads in flight match vLLM's own fs tier (16 per
    queue) unless the options or the YAML's tier section set them."""
    from fstier.integrations._vllm_config import VLLM_READ_THREADS, tier_config_from_options

    assert VLLM_READ_THREADS == 16
    root = str(tmp_path)
    assert tier_config_from_options({"root_dir": root}).read_threads == 16
    assert tier_config_from_options({"root_dir": root, "read_threads": 4}).read_threads == 4
    assert tier_config_from_options({"root_dir": root, "n_read_threads": 5}).read_threads == 5
    yaml = tmp_path / "fstier.yaml"
    yaml.write_text(f"tier:\n  root_dir: {root}\n  read_threads: 3\n")
    assert tier_config_from_options({"config": str(yaml)}).read_threads == 3


def test_a_collect_of_done_jobs_builds_the_same_vllm_results_as_one_by_one(tmp_path: Path) -> None:
    # get_finished_jobs builds a collect of jobs every key of which was done with C-level loops
    # (fv._done_results); each result equals what _to_vllm builds with vLLM's constructor, a store
    # of present keys (no byte moved) included (transfer_bytes None), and a partial load falls back.
    keys = keys_for(11, 4)
    with tiering_manager(offloading_config([tier_cfg(tmp_path / "kv")])) as m:
        tier = fstier_tier(m)
        ctx = ReqContext(req_id="x")
        for job_id, is_load in ((20_000, False), (20_001, False), (20_002, True)):
            job = TransferJob(job_id=job_id, keys=keys, chunk_ids=np.arange(4, 8), is_promotion=is_load,
                              req_context=ctx)
            (tier.submit_load if is_load else tier.submit_store)(job)
            tier.drain_jobs()
        fresh = tier.fstier.get_finished()
        assert [r.job_id for r in fresh] == [20_000, 20_001, 20_002] and all(r.success for r in fresh)
        fast = fv._done_results(fv.VllmJobResult, fresh)
        assert fast is not None and fast == [tier._to_vllm(r) for r in fresh]
        assert [type(r) for r in fast] == [fv.VllmJobResult] * 3
        assert [r.transfer_bytes for r in fast] == [4 * tier.block_size_bytes, None, 4 * tier.block_size_bytes]
        partial = JobResult(7, "load", False, 2, 2, 10, 0.1, "miss", context=tuple(keys))
        assert fv._done_results(fv.VllmJobResult, [*fresh, partial]) is None  # one not done: one by one

        class Slotted:
            __slots__ = fv._VLLM_RESULT_FIELDS
            __dataclass_fields__ = dict.fromkeys(fv._VLLM_RESULT_FIELDS)

        assert fv._plain_dataclass(fv.VllmJobResult) and not fv._plain_dataclass(Slotted)


def test_one_collect_of_done_partial_and_refused_jobs_reports_each_as_its_own(tmp_path: Path) -> None:
    # One get_finished_jobs sees a store and a load every key of which was done, a load that stopped at a
    # corrupt file and a job fstier refused: the collect is not built wholesale as done (fv._done_results
    # declines it); each job gets its own result, the partial load its loaded prefix, the refused one a
    # failure, and the keys that failed answer MISS from then on.
    keys = keys_for(31, 4)
    with tiering_manager(offloading_config([tier_cfg(tmp_path / "kv")], num_chunks=16)) as m:
        store_request(m, "s", keys)
        tier = fstier_tier(m)
        os.truncate(tier.mapper.path_for(fv._block_key(keys[1])), 100)
        ctx = ReqContext(req_id="x")
        more = keys_for(32, 2)
        tier.submit_store(TransferJob(job_id=30_000, keys=more, chunk_ids=np.arange(8, 10), is_promotion=False,
                                      req_context=ctx))
        tier.submit_load(TransferJob(job_id=30_001, keys=keys[2:], chunk_ids=np.arange(0, 2), is_promotion=True,
                                     req_context=ctx))
        tier.submit_load(TransferJob(job_id=30_002, keys=keys[:2], chunk_ids=np.arange(2, 4), is_promotion=True,
                                     req_context=ctx))
        tier.submit_load(TransferJob(job_id=30_003, keys=keys[:1], chunk_ids=np.array([99]), is_promotion=True,
                                     req_context=ctx))
        tier.drain_jobs()
        got = {r.job_id: r for r in tier.get_finished_jobs()}
        assert sorted(got) == [30_000, 30_001, 30_002, 30_003]
        assert all(type(r) is fv.VllmJobResult for r in got.values())
        assert (got[30_000].success, got[30_000].successful_keys) == (True, None)
        assert got[30_000].transfer_bytes == 2 * tier.block_size_bytes
        assert (got[30_001].success, got[30_001].successful_keys) == (True, None)
        assert got[30_002].success is False and list(got[30_002].successful_keys) == keys[:1]
        assert got[30_002].transfer_bytes == tier.block_size_bytes
        assert (got[30_003].success, got[30_003].successful_keys) == (False, None)
        assert not tier.has_pending_work() and list(tier.get_finished_jobs()) == []
        answers = []
        for _ in range(500):  # the lookup is asynchronous: RETRY until it settles
            answers = [tier.lookup(k, ctx) for k in keys[:2]]
            if LookupResult.RETRY not in answers:
                break
            tier.on_schedule_end(None)  # type: ignore[arg-type]
            time.sleep(0.01)
        assert answers == [LookupResult.HIT, LookupResult.MISS]


def test_job_histograms_observe_each_job_once_refused_ones_included(tmp_path: Path) -> None:
    """vLLM's per-job histograms: one seconds observation per store or load
    job (FsTier's metrics count a finished job and tell vLLM's metrics, off
    the completion path; a job FsTier refused at submission is observed by
    the adapter), one bytes observation per job that moved bytes."""
    keys = keys_for(21, 4)
    p = fv.METRIC_PREFIX
    with tiering_manager(offloading_config([tier_cfg(tmp_path / "kv")])) as m:
        tier = fstier_tier(m)
        tier.get_stats()  # the first report: nothing observed yet
        row = tier.block_size_bytes

        def run(job_id: int, ks: list[object], promote: bool) -> None:
            job = TransferJob(job_id=job_id, keys=ks, chunk_ids=np.arange(len(ks)), is_promotion=promote,
                              req_context=ReqContext(req_id="h"))
            (tier.submit_load if promote else tier.submit_store)(job)
            tier.drain_jobs()
            assert [r.job_id for r in tier.get_finished_jobs()] == [job_id]

        run(1, keys[:2], False)
        run(2, keys[2:], False)
        run(3, keys[:2], False)  # skipped: present, no byte moved
        run(4, keys, True)
        tier.fstier._breaker.failure("EIO", 1000)  # open: the next store is refused at submission ("degraded")
        run(5, keys_for(22, 1), False)
        _, values = tier.get_stats().metric_sections()
        assert len(values[p + "store_job_seconds"][()]) == 4 and len(values[p + "load_job_seconds"][()]) == 1
        assert sorted(values[p + "store_job_bytes"][()]) == [2.0 * row, 2.0 * row]
        assert values[p + "load_job_bytes"][()] == [4.0 * row]
        assert tier.get_stats() is None  # each observed once
