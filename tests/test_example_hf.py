"""The real-model proof (examples/prefix_reuse_hf.py) in its fast configuration.

A Hugging Face Llama with random weights prefills a prompt; its KV is stored
through fstier at tp=2 and loaded at tp=4; greedy generation from the loaded
cache must give the same tokens as generating from scratch. The two-group
(not parallel-agnostic) variant must miss at tp=4 and still match. A negative
control shows the comparison notices misplaced heads.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

pytest.importorskip(
    "transformers",
    minversion="4.56",
    reason="the real-model example needs transformers (pip install 'fstier[examples]')",
)
import torch  # noqa: E402  (after the skip: only meaningful with transformers)

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "prefix_reuse_hf.py"


@pytest.fixture(scope="module")
def example() -> ModuleType:
    spec = importlib.util.spec_from_file_location("prefix_reuse_hf", EXAMPLE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["prefix_reuse_hf"] = module
    spec.loader.exec_module(module)
    return module


def test_tp2_store_tp4_load_generates_identical_tokens(example: ModuleType, tmp_path: Path) -> None:
    # 300 tokens: 18 full blocks and a partial one; B adds 24 tokens.
    report = example.run(
        shape=example.FAST_SHAPE, prompt_len=300, suffix_len=24, new_tokens=16, root=tmp_path, repeats=1
    )
    by_name = {c.name.split(" (")[0]: c for c in report.comparisons}
    assert set(by_name) == {"direct tp2->tp4", "fstier tp2 -> tp4", "two groups tp2 -> tp4"}
    for c in report.comparisons:
        assert c.tokens == report.reference_tokens, c.name
        assert c.tokens_identical and c.logits_allclose, c
        assert c.max_abs_logit_diff_last < 1e-3, c
    assert len(report.reference_tokens) == 16

    fs = by_name["fstier tp2 -> tp4"]
    assert fs.hit_blocks == 18 and fs.hit_tokens == 288
    assert report.agnostic_tp2_lookup == 18
    # Two declared groups: present for tp=2, a miss at tp=4, recomputed.
    assert report.two_group_tp2_lookup == 18
    assert report.two_group_tp4_lookup == 0
    assert by_name["two groups tp2 -> tp4"].hit_blocks == 0
    assert report.ok

    # The agnostic namespace has no rank segment and holds one file per block;
    # the two-group namespaces (tp=2 stored, tp=4 empty) are separate.
    agnostic = [p for p in (tmp_path / "agnostic").iterdir() if p.is_dir()]
    assert len(agnostic) == 1
    assert len(list(agnostic[0].rglob("*.bin"))) == 18
    assert not any(p.name.startswith("r") and p.is_dir() for p in agnostic[0].iterdir() if len(p.name) <= 3)
    split_bins = list((tmp_path / "two-groups").rglob("*.bin"))
    assert len(split_bins) == 2 * 18
    shape = example.FAST_SHAPE
    kv_bytes = 2 * example.BLOCK_SIZE * shape.num_kv_heads * shape.head_dim * 4
    assert report.stored_bytes == 18 * shape.num_layers * kv_bytes


def test_misplaced_heads_change_the_generation(example: ModuleType) -> None:
    """Negative control: the token comparison is sensitive to which rank's
    heads go where, so identical tokens above are not an accident."""
    shape = example.FAST_SHAPE
    cpu = torch.device("cpu")
    model = example.build_model(shape, 0, cpu)
    prompt = torch.randint(0, shape.vocab_size, (1, 200), generator=torch.Generator().manual_seed(7))
    ref = example.generate_from_scratch(model, prompt, 8)
    n = (200 - 1) // example.BLOCK_SIZE
    ranks = example.allocate_rank_caches(shape, 4, n, 3, cpu)
    example.scatter_to_ranks(example.prefill(model, prompt), ranks, n)
    tail = prompt[:, n * example.BLOCK_SIZE :]

    good = example.greedy(model, example.gather_from_ranks(ranks, n, model), tail, 8)
    assert good.tokens == ref.tokens

    ranks.layers.reverse()  # rank 3's heads where rank 0's belong
    bad = example.greedy(model, example.gather_from_ranks(ranks, n, model), tail, 8)
    assert bad.tokens != ref.tokens
    assert not torch.allclose(bad.step_logits[0], ref.step_logits[0], atol=1e-4)


def test_cli_fast_json(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, str(EXAMPLE), "--fast", "--prompt-len", "100", "--new-tokens", "6",
         "--json", "--root", str(tmp_path)],
        capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout)
    assert out["ok"] is True
    assert out["prompt_b_tokens"] == 124
    assert [c["tokens_identical"] for c in out["comparisons"]] == [True, True, True]
    assert out["comparisons"][1]["hit_tokens"] == 96
    assert out["two_group_tp4_lookup"] == 0
    assert out["timing"]["hit_first_token_s"] > 0 and out["timing"]["recompute_first_token_s"] > 0
