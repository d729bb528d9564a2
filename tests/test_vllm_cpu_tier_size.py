"""vLLM's host-centric limit (issue 43 item 4): a FstierTier hit is served only through vLLM's CPU tier.

In vLLM 0.33 a secondary-tier hit is promoted into the CPU tier before it is served; a stored prefix longer than
the CPU tier holds is not served from disk at all (benchmarks/bench_vllm_cpu_limit.py, docs/vllm.md "Sizing the
CPU tier"). Here, on vLLM's real TieringOffloadingManager: the limit itself (a prefix one chunk longer than the CPU
tier is served not at all, one that fits is served whole), FstierTier's warning logged once at start when
``max_model_len`` does not fit, and ``fstier config validate``'s warning for the same sizes.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import time
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from fstier.cli import main
from tests._vllm_helpers import (
    END,
    FSTIER_TIER,
    LookupResult,
    ReqContext,
    keys_for,
    offloading_config,
    store_request,
    tiering_manager,
)

CPU_CHUNKS = 16  # rows of vLLM's CPU tier in these tests: 16 chunks of one 16-token block = 256 tokens
WARNING = "is not served from disk at all"


def _config(root: Path, *, chunks: int = CPU_CHUNKS, max_model_len: int = 0) -> Any:
    cfg = offloading_config([{**FSTIER_TIER, "root_dir": str(root)}], num_chunks=chunks)
    return dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, max_model_len=max_model_len))


def _served(manager: Any, keys: list[Any], max_steps: int = 300) -> int | None:
    """What vLLM's scheduler serves of ``keys`` (its ``_maximal_prefix_lookup``: keys in order, stop at the first
    MISS, look again next step while any answer is RETRY or HIT_PENDING): the leading hits once the answers
    settle, or None while they still have not after ``max_steps`` scheduler steps (the request stays deferred)."""
    ctx = ReqContext(req_id="lookup")
    with manager.lock:
        manager.on_new_request(ctx)
    try:
        for _ in range(max_steps):
            hits, deferred = 0, False
            with manager.lock:
                for key in keys:
                    result = manager.lookup(key, ctx)
                    if result is LookupResult.MISS:
                        break
                    deferred |= result is not LookupResult.HIT
                    hits += result is not LookupResult.RETRY
                if not deferred:
                    return hits
                manager.on_schedule_end(END)
            time.sleep(0.005)
        return None
    finally:
        with manager.lock:
            manager.on_request_finished(ctx)


def test_a_prefix_longer_than_the_cpu_tier_is_not_served_from_disk(tmp_path: Path) -> None:
    """The limit the warnings below are about (twice the CPU tier here; the benchmark measures other lengths)."""
    keys = keys_for(43, 2 * CPU_CHUNKS)
    with tiering_manager(_config(tmp_path / "kv", chunks=64)) as m:
        store_request(m, "store", keys)
    with tiering_manager(_config(tmp_path / "kv")) as m:  # a restart with a 16-row CPU tier
        assert _served(m, keys[:CPU_CHUNKS]) == CPU_CHUNKS
    with tiering_manager(_config(tmp_path / "kv")) as m:
        # Longer than the CPU tier: promotions evict each other; the answers settle on a MISS at the first key,
        # or are still deferred after 300 steps. Either way nothing of the prefix is served from disk.
        assert _served(m, keys) in (0, None)


CPU_TOKENS = 16 * CPU_CHUNKS


@pytest.mark.parametrize(("max_model_len", "warned"), [(0, False), (CPU_TOKENS, False), (CPU_TOKENS + 1, True)])
def test_fstier_tier_warns_once_at_start_when_one_prompt_does_not_fit(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, max_model_len: int, warned: bool
) -> None:
    with caplog.at_level(logging.WARNING, logger="fstier"), tiering_manager(
        _config(tmp_path / "kv", max_model_len=max_model_len)
    ) as m:
        store_request(m, "store", keys_for(7, 4))  # running steps logs nothing more
        lines = [r.getMessage() for r in caplog.records if WARNING in r.getMessage()]
    assert len(lines) == (1 if warned else 0), lines
    if warned:
        assert f"max_model_len {max_model_len:,}" in lines[0] and "holds the KV of 256 tokens" in lines[0]
        assert "16 rows of" in lines[0] and "docs/vllm.md" in lines[0]


def _kv_json(tmp_path: Path, cpu_bytes: int) -> str:
    doc = {
        "kv_connector": "OffloadingConnector", "kv_role": "kv_both",
        "kv_connector_extra_config": {
            "spec_name": "TieringOffloadingSpec", "cpu_bytes_to_use": cpu_bytes,
            "secondary_tiers": [{**FSTIER_TIER, "root_dir": str(tmp_path / "kv")}],
        },
    }
    path = tmp_path / "kv.json"
    path.write_text(json.dumps(doc))
    return str(path)


@pytest.mark.parametrize(("max_model_len", "warned"), [(8192, False), (8193, True), (32768, True)])
def test_config_validate_warns_when_the_cpu_tier_cannot_hold_one_longest_prompt(
    tmp_path: Path, max_model_len: int, warned: bool
) -> None:
    path = _kv_json(tmp_path, 2**30)  # 1 GiB at 128 KiB per token: 8,192 tokens
    args = ["config", "validate", path, "--max-model-len", str(max_model_len), "--kv-bytes-per-token", "131072"]
    res = CliRunner().invoke(main, args)
    assert res.exit_code == 0, res.output
    assert (WARNING in res.output) is warned, res.output
    doc = json.loads(CliRunner().invoke(main, [*args, "--json"]).output)
    assert doc["ok"] is True and len(doc["warnings"]) == (1 if warned else 0)
    if warned:
        assert "holds the KV of 8,192 tokens" in doc["warnings"][0]


def test_config_validate_cpu_check_needs_both_numbers_and_cpu_bytes(tmp_path: Path) -> None:
    path = _kv_json(tmp_path, 2**30)
    res = CliRunner().invoke(main, ["config", "validate", path, "--max-model-len", "8192"])
    assert res.exit_code == 2 and "--kv-bytes-per-token" in res.output
    entry = tmp_path / "entry.json"
    entry.write_text(json.dumps({**FSTIER_TIER, "root_dir": str(tmp_path / "kv")}))
    res = CliRunner().invoke(
        main, ["config", "validate", str(entry), "--max-model-len", "8192", "--kv-bytes-per-token", "2"]
    )
    assert res.exit_code == 2 and "cpu_bytes_to_use" in res.output
