"""Real-model proof: a transformer's prefix KV stored at tp=2 and loaded at tp=4.

Synthetic bytes prove fstier's plumbing; this example proves that the bytes
mean the right thing to an attention implementation nobody on this team
wrote (Hugging Face ``transformers``' Llama). It builds a small Llama model
from a config with random weights and a fixed seed (no download), then:

1. **tp=2 deployment** prefills prompt A with ``use_cache=True`` and lays the
   per-layer K/V out the way a paged engine does: per layer a tensor
   ``(num_blocks, 2, block_size, kv_heads_local, head_size)`` (NHD), the KV
   heads split over 2 simulated ranks, blocks at the ids of a shuffled block
   table. Each rank's :class:`~fstier.RankStager` stages its heads of the full
   blocks into shared :class:`~fstier.HostBlockPool` slots and one
   :class:`~fstier.FsTier` stores them under ``chain_hashes`` keys.
2. **tp=4 deployment** (a new ``FsTier`` on the same root, ``tp_size=4``)
   receives prompt B = A + a follow-up: it looks up B's block keys, loads the
   hit, stages it into 4 rank caches, reassembles the heads into a
   ``DynamicCache``, computes only the uncached tail and greedy-generates.
3. It compares with generating B from scratch: token ids must be identical
   and the last step's logits allclose. A direct path (rank caches
   reassembled without fstier) is checked first, as a control.
4. It repeats the tp=2 -> tp=4 attempt with a model declared as two KV groups,
   which is not parallel-agnostic: the tp=4 lookup misses (its namespace
   digests tp_size), the prefix is recomputed, and the output is again
   identical.
5. It times the first token with the cache hit (lookup + load + stage_in +
   reassemble + tail forward) against recomputing the prefix.

Run ``python examples/prefix_reuse_hf.py --fast`` (the CI configuration) or
without ``--fast`` for the long-prompt timing; ``--json`` prints one JSON
object. Exit status 0 means every check passed, 1 that one failed.
docs/real-model.md walks through it with measured timings.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

try:
    from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM
except ImportError as exc:  # pragma: no cover - exercised only without the extra
    raise SystemExit(
        f"this example needs transformers >= 4.56 ({exc}); "
        "install the extra: pip install -e '.[examples]' in a checkout of fstier"
    ) from None

from fstier import (
    BlockKey,
    CanonicalKVCaches,
    FileMapper,
    FsTier,
    HostBlockPool,
    JobResult,
    LoadStoreSpec,
    RankStager,
    chain_hashes,
    is_parallel_agnostic,
    parse_config,
    rank_page_mapping,
)
from fstier.config import FstierConfig

BLOCK_SIZE = 16


# --------------------------------------------------------------------------
# The model
# --------------------------------------------------------------------------
@dataclass(frozen=True)
class ModelShape:
    """A Llama-architecture shape with grouped-query attention."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int


#: CI: 4 layers, 16 query heads over 8 KV heads, ~4M parameters.
FAST_SHAPE = ModelShape(
    vocab_size=1024, hidden_size=512, intermediate_size=1024, num_layers=4,
    num_heads=16, num_kv_heads=8, head_dim=32,
)
#: Timing: 8 layers, hidden 1024, ~100M parameters; its prefill is real work.
FULL_SHAPE = ModelShape(
    vocab_size=8192, hidden_size=1024, intermediate_size=2816, num_layers=8,
    num_heads=16, num_kv_heads=8, head_dim=64,
)


#: PyTorch's scaled_dot_product_attention: what engines' reference paths use.
_SDPA: dict[str, Any] = {"attn_implementation": "sdpa"}


def build_model(shape: ModelShape, seed: int, device: torch.device) -> LlamaForCausalLM:
    """Random weights from ``seed``; float32 so cached and recomputed runs compare tightly."""
    config = LlamaConfig(
        vocab_size=shape.vocab_size,
        hidden_size=shape.hidden_size,
        intermediate_size=shape.intermediate_size,
        num_hidden_layers=shape.num_layers,
        num_attention_heads=shape.num_heads,
        num_key_value_heads=shape.num_kv_heads,
        head_dim=shape.head_dim,
        max_position_embeddings=8192,
        # A wider init than the default 0.02 spreads the logits, so greedy
        # argmax is decided by real margins rather than float noise.
        initializer_range=0.05,
        **_SDPA,
    )
    torch.manual_seed(seed)
    with device:  # built in place, in the default dtype: float32
        model = LlamaForCausalLM(config)
    if next(model.parameters()).dtype != torch.float32:
        raise RuntimeError("the example needs float32 weights; torch's default dtype was changed")
    model.eval()
    return model


@dataclass
class Generation:
    """Greedy output: token ids and the logits of every step (step 0 = after the prompt)."""

    tokens: list[int]
    step_logits: list[torch.Tensor]
    first_token_s: float


@torch.inference_mode()
def greedy(
    model: LlamaForCausalLM,
    cache: DynamicCache,
    uncached: torch.Tensor,
    new_tokens: int,
    *,
    t0: float | None = None,
) -> Generation:
    """Forward the uncached tail of a prompt on top of ``cache``, then decode
    ``new_tokens`` greedily. ``first_token_s`` runs from ``t0`` (default: now)
    to the first token being known."""
    start = time.perf_counter() if t0 is None else t0
    logits = model(input_ids=uncached, past_key_values=cache, use_cache=True, logits_to_keep=1).logits[0, -1]
    tokens: list[int] = []
    step_logits: list[torch.Tensor] = []
    first_token_s = 0.0
    for step in range(new_tokens):
        token = int(logits.argmax())
        if step == 0:
            _sync(uncached.device)
            first_token_s = time.perf_counter() - start
        tokens.append(token)
        step_logits.append(logits.float().cpu())
        if step == new_tokens - 1:
            break
        nxt = torch.tensor([[token]], device=uncached.device)
        logits = model(input_ids=nxt, past_key_values=cache, use_cache=True, logits_to_keep=1).logits[0, -1]
    return Generation(tokens, step_logits, first_token_s)


def generate_from_scratch(model: LlamaForCausalLM, prompt: torch.Tensor, new_tokens: int) -> Generation:
    """The reference: prefill the whole prompt, then decode."""
    return greedy(model, DynamicCache(config=model.config), prompt, new_tokens)


def prefill(model: LlamaForCausalLM, prompt: torch.Tensor) -> DynamicCache:
    """Run the prompt once and keep its cache (what the tp=2 deployment computed)."""
    cache = DynamicCache(config=model.config)
    with torch.inference_mode():
        model(input_ids=prompt, past_key_values=cache, use_cache=True, logits_to_keep=1)
    return cache


def _layer_kv(cache: DynamicCache, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of one layer, ``(batch, kv_heads, seq, head_dim)``, post-RoPE like
    an engine's (transformers >= 4.56 keeps them in ``cache.layers[i]``)."""
    entry: Any = cache.layers[layer]
    return entry.keys, entry.values


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# --------------------------------------------------------------------------
# Paged, head-sharded rank caches (the engine side)
# --------------------------------------------------------------------------
@dataclass
class RankCaches:
    """The KV caches of one deployment: ``layers[rank][layer]`` is a tensor
    ``(num_blocks, 2, block_size, kv_heads // tp, head_dim)`` (NHD), and
    ``block_table[i]`` is the block id holding the prompt's i-th block (the
    same on every rank, as in vLLM)."""

    tp: int
    layers: list[list[torch.Tensor]]
    block_table: list[int]

    @property
    def heads_per_rank(self) -> int:
        return int(self.layers[0][0].shape[3])


def allocate_rank_caches(
    shape: ModelShape, tp: int, num_prompt_blocks: int, seed: int, device: torch.device
) -> RankCaches:
    """Zeroed caches with spare blocks and a shuffled block table, so that a
    copy which ignored the block ids would land in the wrong place."""
    if shape.num_kv_heads % tp:
        raise ValueError(f"num_kv_heads ({shape.num_kv_heads}) must be divisible by tp ({tp})")
    num_blocks = num_prompt_blocks + 7
    heads = shape.num_kv_heads // tp
    layers = [
        [
            torch.zeros(num_blocks, 2, BLOCK_SIZE, heads, shape.head_dim, dtype=torch.float32, device=device)
            for _ in range(shape.num_layers)
        ]
        for _ in range(tp)
    ]
    perm = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(seed)).tolist()
    return RankCaches(tp=tp, layers=layers, block_table=perm[:num_prompt_blocks])


def scatter_to_ranks(cache: DynamicCache, ranks: RankCaches, num_blocks: int) -> None:
    """Write the first ``num_blocks`` blocks of ``cache`` into the paged rank caches."""
    tokens = num_blocks * BLOCK_SIZE
    heads = ranks.heads_per_rank
    ids = torch.tensor(ranks.block_table[:num_blocks], device=ranks.layers[0][0].device)
    for layer in range(len(ranks.layers[0])):
        k, v = _layer_kv(cache, layer)
        # (1, H, T, D) -> (num_blocks, block_size, H, D): NHD pages.
        kv = torch.stack([k[0, :, :tokens], v[0, :, :tokens]])  # (2, H, T, D)
        kv = kv.permute(0, 2, 1, 3).reshape(2, num_blocks, BLOCK_SIZE, -1, kv.shape[-1]).transpose(0, 1)
        for rank in range(ranks.tp):
            ranks.layers[rank][layer][ids] = kv[:, :, :, rank * heads : (rank + 1) * heads]


def gather_from_ranks(ranks: RankCaches, num_blocks: int, model: LlamaForCausalLM) -> DynamicCache:
    """Reassemble the heads of all ranks' first ``num_blocks`` blocks into a
    ``DynamicCache`` the model can continue from."""
    cache = DynamicCache(config=model.config)
    first = ranks.layers[0][0]
    ids = torch.tensor(ranks.block_table[:num_blocks], device=first.device)
    h, dim = ranks.heads_per_rank, int(first.shape[-1])
    for layer in range(len(ranks.layers[0])):
        kv = torch.empty(2, 1, h * ranks.tp, num_blocks * BLOCK_SIZE, dim, dtype=first.dtype, device=first.device)
        for rank in range(ranks.tp):
            pages = ranks.layers[rank][layer].index_select(0, ids)  # (num_blocks, 2, bs, h, D)
            # heads of this rank, (2, h, num_blocks, bs, D) <- NHD pages
            dst = kv[:, 0, rank * h : (rank + 1) * h].view(2, h, num_blocks, BLOCK_SIZE, dim)
            dst.copy_(pages.permute(1, 3, 0, 2, 4))
        cache.update(kv[0], kv[1], layer)
    return cache


def regroup_heads(src: RankCaches, dst: RankCaches, num_blocks: int) -> None:
    """The direct control path: move pages from one tp to another in memory,
    block table to block table, without fstier."""
    for layer in range(len(src.layers[0])):
        sid = torch.tensor(src.block_table[:num_blocks], device=src.layers[0][0].device)
        did = torch.tensor(dst.block_table[:num_blocks], device=dst.layers[0][0].device)
        full = torch.cat([src.layers[r][layer][sid] for r in range(src.tp)], dim=3)
        h = dst.heads_per_rank
        for r in range(dst.tp):
            dst.layers[r][layer][did] = full[:, :, :, r * h : (r + 1) * h]


# --------------------------------------------------------------------------
# fstier
# --------------------------------------------------------------------------
def fstier_config(
    root: Path, shape: ModelShape, *, tp: int, rank: int = 0, two_groups: bool = False
) -> FstierConfig:
    """One full-attention group over all layers (parallel-agnostic), or the
    layers split into two declared groups (not parallel-agnostic)."""
    def group(num_layers: int) -> dict[str, Any]:
        return {
            "kind": "full_attention",
            "block_size": BLOCK_SIZE,
            "num_layers": num_layers,
            "num_kv_heads": shape.num_kv_heads,
            "head_size": shape.head_dim,
            "kv_layout": "NHD",
        }

    half = shape.num_layers // 2
    groups = [group(half), group(shape.num_layers - half)] if two_groups else [group(shape.num_layers)]
    return parse_config(
        {
            "tier": {"root_dir": str(root), "read_threads": 8, "write_threads": 2},
            "model": {"name": "example/llama-random", "revision": "seed", "dtype": "float32", "groups": groups},
            "parallel": {"tp_size": tp, "rank": rank},
        },
        source="prefix_reuse_hf",
    )


def _group_layers(shape: ModelShape, two_groups: bool) -> list[list[int]]:
    if not two_groups:
        return [list(range(shape.num_layers))]
    half = shape.num_layers // 2
    return [list(range(half)), list(range(half, shape.num_layers))]


@dataclass
class Deployment:
    """One simulated deployment: an FsTier (scheduler side) and one RankStager
    per rank over that rank's registered caches, meeting in one host pool."""

    config: FstierConfig
    tier: FsTier
    pool: HostBlockPool
    stagers: list[RankStager]
    ranks: RankCaches
    two_groups: bool

    def close(self) -> None:
        self.tier.close()
        self.pool.close()


def open_deployment(
    root: Path, shape: ModelShape, ranks: RankCaches, *, two_groups: bool, num_slots: int
) -> Deployment:
    config = fstier_config(root, shape, tp=ranks.tp, two_groups=two_groups)
    mapper = FileMapper(config)
    slot_bytes = max(mapper.expected_payload_bytes(g) for g in range(len(config.model.groups)))
    pool = HostBlockPool(num_slots, slot_bytes)
    tier: FsTier | None = None
    try:
        tier = FsTier(config, pool)
        stagers = []
        for rank in range(ranks.tp):
            parallel = config.parallel.with_rank(rank)
            per_group = [[ranks.layers[rank][i] for i in layers] for layers in _group_layers(shape, two_groups)]
            caches = CanonicalKVCaches.register(per_group)
            # "packed": each layer is one (num_blocks, 2, block_size, heads, head_size) tensor.
            mappings = [rank_page_mapping(g, parallel, "packed") for g in config.model.groups]
            stagers.append(RankStager(caches, mappings, pool, config.tier.blocks_per_file))
    except BaseException:
        if tier is not None:
            tier.close()
        pool.close()  # the shared-memory segment must not outlive a failed start
        raise
    return Deployment(config, tier, pool, stagers, ranks, two_groups)


def _spec_and_keys(dep: Deployment, hashes: Sequence[bytes]) -> tuple[LoadStoreSpec, list[BlockKey]]:
    """Every group's blocks of the prefix: same block table per group here."""
    n = len(hashes)
    num_groups = len(dep.config.model.groups)
    block_ids = dep.ranks.block_table[:n] * num_groups
    keys = [BlockKey(h, g) for g in range(num_groups) for h in hashes]
    spec = LoadStoreSpec(block_ids=block_ids, group_sizes=[n] * num_groups, block_indices=[0] * num_groups)
    return spec, keys


def _wait(tier: FsTier, job_id: int, timeout_s: float = 120.0) -> JobResult:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for result in tier.get_finished():
            if result.job_id == job_id:
                return result
        time.sleep(0.0005)
    raise TimeoutError(f"fstier job {job_id} did not finish within {timeout_s}s")


def store_prefix(dep: Deployment, hashes: Sequence[bytes]) -> int:
    """Stage out every rank's heads of the full blocks and store them. Returns bytes stored."""
    spec, keys = _spec_and_keys(dep, hashes)
    slots = dep.pool.alloc(len(keys))
    try:
        for stager in dep.stagers:  # each rank fills its heads of every slot
            stager.wait(stager.stage_out(spec, slots))
        dep.tier.submit_store(1, keys, slots)
        result = _wait(dep.tier, 1)
        dep.tier.drain()
    finally:
        dep.pool.free(slots)
    if not result.success:
        raise RuntimeError(f"store failed: {result}")
    return int(result.nbytes)


@dataclass
class LoadTiming:
    lookup_s: float = 0.0
    load_s: float = 0.0
    stage_in_s: float = 0.0
    reassemble_s: float = 0.0


def load_prefix(
    dep: Deployment, hashes: Sequence[bytes], model: LlamaForCausalLM, timing: LoadTiming
) -> tuple[int, DynamicCache | None]:
    """Look up B's block keys, load the hit and stage it into every rank's
    cache, then reassemble. Returns (hit blocks, cache or None on a miss)."""
    num_groups = len(dep.config.model.groups)
    t = time.perf_counter()
    found = min(dep.tier.lookup([BlockKey(h, g) for h in hashes]) for g in range(num_groups))
    timing.lookup_s = time.perf_counter() - t
    if found == 0:
        return 0, None
    spec, keys = _spec_and_keys(dep, hashes[:found])
    slots = dep.pool.alloc(len(keys))  # group-major: group g's blocks at [g*found, (g+1)*found)
    try:
        t = time.perf_counter()
        dep.tier.submit_load(2, keys, slots)
        result = _wait(dep.tier, 2)
        timing.load_s = time.perf_counter() - t
        hit = found
        if not result.success:
            # A failed load keeps its good prefix: use the blocks that every
            # group loaded, recompute the rest (what an engine does).
            done = result.keys_completed
            hit = min(max(0, min(found, done - g * found)) for g in range(num_groups))
            if hit == 0:
                return 0, None
            spec, _ = _spec_and_keys(dep, hashes[:hit])
        use = [slots[g * found + i] for g in range(num_groups) for i in range(hit)]
        t = time.perf_counter()
        for stager in dep.stagers:
            stager.wait(stager.stage_in(use, spec))
        _sync(dep.ranks.layers[0][0].device)
        timing.stage_in_s = time.perf_counter() - t
    finally:
        dep.pool.free(slots)
    t = time.perf_counter()
    cache = gather_from_ranks(dep.ranks, hit, model)
    timing.reassemble_s = time.perf_counter() - t
    return hit, cache


# --------------------------------------------------------------------------
# The scenario
# --------------------------------------------------------------------------
@dataclass
class Comparison:
    """One attempt compared with generating B from scratch."""

    name: str
    hit_blocks: int
    hit_tokens: int
    tokens_identical: bool
    max_abs_logit_diff_last: float
    logits_allclose: bool
    tokens: list[int] = field(default_factory=list)


def compare(name: str, hit: int, got: Generation, ref: Generation, atol: float) -> Comparison:
    diff = float((got.step_logits[-1] - ref.step_logits[-1]).abs().max())
    return Comparison(
        name=name,
        hit_blocks=hit,
        hit_tokens=hit * BLOCK_SIZE,
        tokens_identical=got.tokens == ref.tokens,
        max_abs_logit_diff_last=diff,
        logits_allclose=bool(torch.allclose(got.step_logits[-1], ref.step_logits[-1], atol=atol, rtol=1e-4)),
        tokens=got.tokens,
    )


@dataclass
class Report:
    shape: dict[str, int]
    device: str
    prompt_a_tokens: int
    prompt_b_tokens: int
    new_tokens: int
    reference_tokens: list[int]
    comparisons: list[Comparison]
    agnostic_tp2_lookup: int
    two_group_tp2_lookup: int
    two_group_tp4_lookup: int
    stored_bytes: int
    o_direct: bool
    timing: dict[str, float]
    ok: bool


def run(
    *,
    shape: ModelShape,
    prompt_len: int,
    suffix_len: int,
    new_tokens: int,
    root: Path,
    seed: int = 0,
    device: str = "cpu",
    repeats: int = 3,
    atol: float = 1e-4,
    log: Callable[[str], None] = lambda _msg: None,
) -> Report:
    """The whole proof; see the module docstring."""
    if prompt_len < BLOCK_SIZE:
        raise ValueError(f"--prompt-len must be >= {BLOCK_SIZE} (one full block), got {prompt_len}")
    if new_tokens < 1:
        raise ValueError(f"--new-tokens must be >= 1, got {new_tokens}")
    dev = torch.device(device)
    model = build_model(shape, seed, dev)
    gen = torch.Generator().manual_seed(seed + 1)
    prompt_b = torch.randint(0, shape.vocab_size, (1, prompt_len + suffix_len), generator=gen).to(dev)
    prompt_a = prompt_b[:, :prompt_len]
    hashes_a = chain_hashes(prompt_a[0].tolist(), BLOCK_SIZE)
    # At least one token of B must be computed to get logits (as in vLLM).
    lookup_blocks = (prompt_b.shape[1] - 1) // BLOCK_SIZE
    hashes_b = chain_hashes(prompt_b[0].tolist(), BLOCK_SIZE)[:lookup_blocks]
    n_a = len(hashes_a)
    log(f"model {asdict(shape)}; prompt A {prompt_len} tokens ({n_a} full blocks), "
        f"prompt B {prompt_b.shape[1]} tokens; {new_tokens} new tokens; device {dev}")

    ref = generate_from_scratch(model, prompt_b, new_tokens)
    log(f"reference (from scratch): {ref.tokens[:12]}{'...' if new_tokens > 12 else ''}")
    comparisons: list[Comparison] = []

    # tp=2 deployment: request A is computed once.
    cache_a = prefill(model, prompt_a)
    tp2 = allocate_rank_caches(shape, 2, n_a, seed + 2, dev)
    scatter_to_ranks(cache_a, tp2, n_a)

    # Control: the same pages moved to tp=4 in memory, no fstier.
    hit_direct = min(n_a, lookup_blocks)
    tp4_direct = allocate_rank_caches(shape, 4, hit_direct, seed + 3, dev)
    regroup_heads(tp2, tp4_direct, hit_direct)
    direct = greedy(model, gather_from_ranks(tp4_direct, hit_direct, model),
                    prompt_b[:, hit_direct * BLOCK_SIZE :], new_tokens)
    comparisons.append(compare("direct tp2->tp4 (no fstier)", hit_direct, direct, ref, atol))

    # Parallel-agnostic: one group. Store at tp=2, load at tp=4.
    agnostic_root = root / "agnostic"
    store_dep = open_deployment(agnostic_root, shape, tp2, two_groups=False, num_slots=n_a)
    try:
        if not is_parallel_agnostic(store_dep.config.model, store_dep.config.parallel):
            raise RuntimeError("the one-group config should be parallel-agnostic")
        stored_bytes = store_prefix(store_dep, hashes_a)
        o_direct = store_dep.tier.io_options.o_direct
        agnostic_tp2_lookup = store_dep.tier.lookup([BlockKey(h) for h in hashes_a])
    finally:
        store_dep.close()
    log(f"tp=2 stored {n_a} blocks, {stored_bytes / 2**20:.1f} MiB")

    def hit_attempt(tokens: int) -> tuple[int, Generation, LoadTiming]:
        # A fresh tp=4 deployment: empty caches and a cold lookup cache. Opening
        # it (pool, FsTier, stagers) is start-up work, outside the timed span.
        tp4 = allocate_rank_caches(shape, 4, lookup_blocks, seed + 4, dev)
        dep = open_deployment(agnostic_root, shape, tp4, two_groups=False, num_slots=lookup_blocks)
        try:
            timing = LoadTiming()
            t0 = time.perf_counter()
            hit, cache = load_prefix(dep, hashes_b, model, timing)
            if cache is None:
                raise RuntimeError("tp=4 lookup missed a parallel-agnostic prefix stored at tp=2")
            return hit, greedy(model, cache, prompt_b[:, hit * BLOCK_SIZE :], tokens, t0=t0), timing
        finally:
            dep.close()

    hit, fs_gen, _ = hit_attempt(new_tokens)
    comparisons.append(compare("fstier tp2 -> tp4 (one group, agnostic)", hit, fs_gen, ref, atol))
    log(f"tp=4 looked up {lookup_blocks} blocks of B, loaded {hit}")

    # Not parallel-agnostic: two declared groups. The tp=4 namespace differs.
    split_root = root / "two-groups"
    split_store = open_deployment(split_root, shape, tp2, two_groups=True, num_slots=2 * n_a)
    try:
        store_prefix(split_store, hashes_a)
        two_group_tp2_lookup = min(
            split_store.tier.lookup([BlockKey(h, g) for h in hashes_a]) for g in range(2)
        )
    finally:
        split_store.close()
    tp4_split = allocate_rank_caches(shape, 4, lookup_blocks, seed + 5, dev)
    split_load = open_deployment(split_root, shape, tp4_split, two_groups=True, num_slots=2 * lookup_blocks)
    try:
        two_group_tp4_lookup, cache = load_prefix(split_load, hashes_b, model, LoadTiming())
    finally:
        split_load.close()
    if cache is None:
        cache = DynamicCache(config=model.config)  # miss: recompute the prefix
    split_gen = greedy(model, cache, prompt_b[:, two_group_tp4_lookup * BLOCK_SIZE :], new_tokens)
    comparisons.append(compare("two groups tp2 -> tp4 (miss, recompute)", two_group_tp4_lookup, split_gen, ref, atol))

    # First-token latency, hit vs recompute, interleaved so drift hits both;
    # everything above was the warm-up. Medians of ``repeats`` runs each.
    hit_runs: list[float] = []
    recompute_runs: list[float] = []
    timing = LoadTiming()  # the breakdown of the best hit run
    for _ in range(max(1, repeats)):
        _, gen_1, run_timing = hit_attempt(1)
        if not hit_runs or gen_1.first_token_s < min(hit_runs):
            timing = run_timing
        hit_runs.append(gen_1.first_token_s)
        recompute_runs.append(generate_from_scratch(model, prompt_b, 1).first_token_s)
    # Headline: best of ``repeats`` for both (the least-disturbed run on a
    # shared machine); medians are reported too.
    timing_out = {
        "hit_first_token_s": min(hit_runs),
        "recompute_first_token_s": min(recompute_runs),
        "hit_first_token_median_s": statistics.median(hit_runs),
        "recompute_first_token_median_s": statistics.median(recompute_runs),
        "repeats": float(len(hit_runs)),
        "load_average_1m": os.getloadavg()[0],
        "torch_threads": float(torch.get_num_threads()),
        "hit_lookup_s": timing.lookup_s,
        "hit_load_s": timing.load_s,
        "hit_stage_in_s": timing.stage_in_s,
        "hit_reassemble_s": timing.reassemble_s,
        "hit_tail_tokens": float(prompt_b.shape[1] - hit * BLOCK_SIZE),
    }
    timing_out["speedup"] = timing_out["recompute_first_token_s"] / timing_out["hit_first_token_s"]

    ok = (
        all(c.tokens_identical and c.logits_allclose for c in comparisons)
        and comparisons[1].hit_blocks == min(n_a, lookup_blocks)
        and agnostic_tp2_lookup == n_a
        and two_group_tp2_lookup == n_a
        and two_group_tp4_lookup == 0
    )
    return Report(
        shape=asdict(shape),
        device=str(dev),
        prompt_a_tokens=prompt_len,
        prompt_b_tokens=int(prompt_b.shape[1]),
        new_tokens=new_tokens,
        reference_tokens=ref.tokens,
        comparisons=comparisons,
        agnostic_tp2_lookup=agnostic_tp2_lookup,
        two_group_tp2_lookup=two_group_tp2_lookup,
        two_group_tp4_lookup=two_group_tp4_lookup,
        stored_bytes=stored_bytes,
        o_direct=o_direct,
        timing=timing_out,
        ok=ok,
    )


def _print_report(report: Report) -> None:
    print(f"\n{'attempt':<42} {'hit tokens':>10} {'tokens':>10} {'max|dlogit|':>12}")
    for c in report.comparisons:
        same = "identical" if c.tokens_identical else "DIFFER"
        print(f"{c.name:<42} {c.hit_tokens:>10} {same:>10} {c.max_abs_logit_diff_last:>12.2e}")
    print(f"\nlookups: one group tp=2 {report.agnostic_tp2_lookup}; two groups tp=2 "
          f"{report.two_group_tp2_lookup}, tp=4 {report.two_group_tp4_lookup} (expected 0)")
    t = report.timing
    print(f"\nfirst-token latency, prompt {report.prompt_b_tokens} tokens on {report.device}, "
          f"best (median) of {int(t['repeats'])}; load average {t['load_average_1m']:.1f}, "
          f"{int(t['torch_threads'])} torch threads, O_DIRECT {'on' if report.o_direct else 'off'}:")
    print(f"  cache hit  {t['hit_first_token_s'] * 1e3:9.1f} ms ({t['hit_first_token_median_s'] * 1e3:.1f})"
          f"  = lookup {t['hit_lookup_s'] * 1e3:.1f} + load {t['hit_load_s'] * 1e3:.1f}"
          f" + stage_in {t['hit_stage_in_s'] * 1e3:.1f} + reassemble {t['hit_reassemble_s'] * 1e3:.1f} ms"
          f" + forward of {int(t['hit_tail_tokens'])} tail tokens")
    print(f"  recompute  {t['recompute_first_token_s'] * 1e3:9.1f} ms ({t['recompute_first_token_median_s'] * 1e3:.1f})"
          f"  = forward of {report.prompt_b_tokens} tokens")
    print(f"  speedup    {t['speedup']:9.1f}x")
    print("\nOK" if report.ok else "\nFAILED")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--fast", action="store_true", help="small model and prompt (the CI configuration)")
    parser.add_argument("--prompt-len", type=int, default=None,
                        help="tokens of prompt A, stored at tp=2 (default 300 fast, 2048 otherwise)")
    parser.add_argument("--suffix-len", type=int, default=24, help="tokens B adds after A (default 24)")
    parser.add_argument("--new-tokens", type=int, default=None, help="tokens to generate (default 16 fast, 32)")
    parser.add_argument("--repeats", type=int, default=None, help="timing repeats, median (default 1 fast, 3)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="cpu", help="torch device, e.g. cpu or cuda")
    parser.add_argument("--root", type=Path, default=None, help="tier root (default: a temp dir, removed)")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of tables")
    args = parser.parse_args(argv)

    shape = FAST_SHAPE if args.fast else FULL_SHAPE
    prompt_len = args.prompt_len or (300 if args.fast else 2048)
    new_tokens = args.new_tokens or (16 if args.fast else 32)
    repeats = args.repeats or (1 if args.fast else 3)
    log: Callable[[str], None] = (lambda _m: None) if args.json else (lambda m: print(m, flush=True))
    if prompt_len < BLOCK_SIZE or new_tokens < 1 or args.suffix_len < 0:
        parser.error(f"need --prompt-len >= {BLOCK_SIZE}, --new-tokens >= 1 and --suffix-len >= 0")
    with tempfile.TemporaryDirectory(prefix="fstier-hf-") as tmp:
        root = args.root or Path(tmp)
        report = run(shape=shape, prompt_len=prompt_len, suffix_len=args.suffix_len, new_tokens=new_tokens,
                     root=root, seed=args.seed, device=args.device, repeats=repeats, log=log)
    if args.json:
        print(json.dumps(asdict(report), indent=2))
    else:
        _print_report(report)
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main())
