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
import sys
from pathlib import Path
from types import ModuleType

import pytest

pytest.importorskip(
    "transformers",
    minversion="4.56",
    reason="the real-model example needs transformers (pip install -e '.[examples]')",
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


def test_cli_fast_json(example: ModuleType, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # In process: the argument parsing and --json output, without paying for
    # a second interpreter importing transformers.
    rc = example.main(["--fast", "--prompt-len", "100", "--new-tokens", "6", "--json", "--root", str(tmp_path)])
    out = json.loads(capsys.readouterr().out)
    assert rc == 0
    assert out["ok"] is True
    assert out["prompt_b_tokens"] == 124
    assert [c["tokens_identical"] for c in out["comparisons"]] == [True, True, True]
    assert out["comparisons"][1]["hit_tokens"] == 96
    assert out["two_group_tp4_lookup"] == 0
    assert out["timing"]["hit_first_token_s"] > 0 and out["timing"]["recompute_first_token_s"] > 0


def test_corrupt_block_mid_prefix_loads_good_prefix_and_recomputes_rest(
    example: ModuleType, tmp_path: Path
) -> None:
    """A flipped payload byte in block 6 of 12: lookup still sees 12 files,
    the load stops at block 6 (checksum), the 6 good blocks are used, the
    rest is recomputed, and generation is still identical to from-scratch."""
    from fstier import BlockKey, FileMapper, chain_hashes

    shape, bs, cpu = example.FAST_SHAPE, example.BLOCK_SIZE, torch.device("cpu")
    model = example.build_model(shape, 0, cpu)
    prompt = torch.randint(0, shape.vocab_size, (1, 12 * bs + 5), generator=torch.Generator().manual_seed(3))
    ref = example.generate_from_scratch(model, prompt, 8)
    hashes = chain_hashes(prompt[0].tolist(), bs)
    assert len(hashes) == 12

    tp2 = example.allocate_rank_caches(shape, 2, 12, 2, cpu)
    example.scatter_to_ranks(example.prefill(model, prompt), tp2, 12)
    dep = example.open_deployment(tmp_path, shape, tp2, two_groups=False, num_slots=12)
    try:
        example.store_prefix(dep, hashes)
        path = FileMapper(dep.config).path_for(BlockKey(hashes[6]))
    finally:
        dep.close()
    raw = bytearray(path.read_bytes())
    raw[4096 + 100] ^= 0x01  # one bit of the payload, past the 4096-byte header
    path.write_bytes(bytes(raw))

    tp4 = example.allocate_rank_caches(shape, 4, 12, 4, cpu)
    dep = example.open_deployment(tmp_path, shape, tp4, two_groups=False, num_slots=12)
    try:
        hit, cache = example.load_prefix(dep, hashes, model, example.LoadTiming())
        assert dep.tier.lookup([BlockKey(h) for h in hashes]) == 6  # corrupt file was removed
    finally:
        dep.close()
    assert hit == 6 and cache is not None
    assert not path.exists()
    got = example.greedy(model, cache, prompt[:, hit * bs :], 8)
    assert got.tokens == ref.tokens
    assert torch.allclose(got.step_logits[-1], ref.step_logits[-1], atol=1e-4)
