"""Canonical page identities that do not need torch.

The canonical format id names the byte encoding of a canonical page; it is
part of the namespace digest, so a change of encoding can never be read as the
old one. ``canonical_page_bytes`` is the payload length per GPU block that a
file of a group holds for a given parallel layout; loads check it exactly,
which is what makes rank-private files fail closed at another world size.
``fstier.layout`` builds the byte mappings and must agree with this module.
"""

from __future__ import annotations

from fstier.config import KVGroupSpec, ModelSpec, ParallelSpec

__all__ = [
    "CANONICAL_LAYOUT_VERSION",
    "canonical_format_id",
    "canonical_page_bytes",
    "cp_rank",
    "cp_world",
    "head_ranks",
    "cp_local_tokens",
    "is_certified",
    "local_heads",
    "local_layer_count",
    "local_page_bytes",
    "model_format_id",
    "pp_layer_range",
    "rank_private_slice_bytes",
]

CANONICAL_LAYOUT_VERSION = 1


def canonical_format_id(group: KVGroupSpec) -> str:
    """Encoding id of one group's canonical page, e.g. ``attn-NHD-v1``.

    Attention pages are ``[layer][k|v][token][head][dim]`` (NHD) or
    ``[layer][k|v][head][token][dim]`` (HND); MLA pages ``[layer][token][latent]``;
    mamba pages are opaque per-rank state.
    """
    v = CANONICAL_LAYOUT_VERSION
    if group.kind in ("full_attention", "sliding_window"):
        return f"attn-{group.kv_layout}-v{v}"
    if group.kind == "mla":
        return f"mla-v{v}"
    return f"opaque-v{v}"


def model_format_id(model: ModelSpec) -> str:
    """Format id of a whole model: the group ids joined by ``+``."""
    return "+".join(canonical_format_id(g) for g in model.groups)


def pp_layer_range(num_layers: int, pp_size: int, pp_rank: int) -> tuple[int, int]:
    """Layers ``[start, stop)`` of pipeline stage ``pp_rank``: an even split,
    the first ``num_layers % pp_size`` stages holding one extra layer."""
    base, extra = divmod(num_layers, pp_size)
    start = pp_rank * base + min(pp_rank, extra)
    stop = start + base + (1 if pp_rank < extra else 0)
    return start, stop


def local_layer_count(group: KVGroupSpec, parallel: ParallelSpec) -> int:
    """Layers of ``group`` this rank's pipeline stage holds (:func:`pp_layer_range`)."""
    start, stop = pp_layer_range(group.num_layers, parallel.pp_size, parallel.pp_rank)
    return stop - start


def cp_world(parallel: ParallelSpec) -> int:
    """Context-parallel ranks that split the tokens of a block (PCP x DCP)."""
    return parallel.pcp_size * parallel.dcp_size


def cp_rank(parallel: ParallelSpec) -> int:
    """This rank's index among the context-parallel ranks: ``pcp_rank * dcp_size + dcp_rank``."""
    return parallel.pcp_rank * parallel.dcp_size + parallel.dcp_rank


def cp_local_tokens(block_size: int, parallel: ParallelSpec) -> int:
    """Tokens one rank's local block holds: token ``t`` of a canonical block
    belongs to context-parallel rank ``(t // interleave) % cp_world``; every
    rank allocates the count of cp rank 0, which holds the most."""
    cp = cp_world(parallel)
    inter = parallel.cp_kv_cache_interleave_size
    cycles, rem = divmod(block_size, inter * cp)
    return cycles * inter + min(inter, rem)


def head_ranks(parallel: ParallelSpec) -> int:
    """Ranks over which KV heads are split: TP ranks not used for DCP."""
    return parallel.tp_size // parallel.dcp_size


def local_heads(group: KVGroupSpec, parallel: ParallelSpec) -> int:
    """KV heads one rank holds: an even share, one when heads are replicated,
    and (uncertified layouts only) the rounded-up share."""
    hr = head_ranks(parallel)
    return max(1, -(-group.num_kv_heads // hr))


def is_certified(group: KVGroupSpec, parallel: ParallelSpec) -> bool:
    """True when the group's rank pages map onto a parallel-independent canonical
    page: attention (full or sliding window) whose KV heads are either sharded
    evenly over the head-parallel ranks or replicated evenly across them, and
    whose block tokens split evenly over the context-parallel ranks (the block
    size is a multiple of ``cp_kv_cache_interleave_size * pcp * dcp``)."""
    if group.kind not in ("full_attention", "sliding_window"):
        return False
    hr = head_ranks(parallel)
    h = group.num_kv_heads
    if not (h % hr == 0 or hr % h == 0):
        return False
    cp = cp_world(parallel)
    return cp == 1 or group.block_size % (parallel.cp_kv_cache_interleave_size * cp) == 0


def local_page_bytes(group: KVGroupSpec, parallel: ParallelSpec) -> int:
    """Bytes of one rank's local page of this group (its layers, heads, tokens)."""
    num_local_layers = local_layer_count(group, parallel)
    if group.kind == "mamba":
        per_layer = int(group.page_size_bytes or 0)
    elif group.kind == "mla":
        # The latent is replicated on every TP rank; DCP/PCP split tokens.
        tokens = cp_local_tokens(group.block_size, parallel)
        per_layer = tokens * group.head_size * group.element_size
    else:
        tokens = cp_local_tokens(group.block_size, parallel)
        heads = local_heads(group, parallel)
        per_layer = 2 * tokens * heads * group.head_size * group.element_size
    return num_local_layers * per_layer


def rank_private_slice_bytes(group: KVGroupSpec, parallel: ParallelSpec) -> int:
    """Bytes of each rank's slice of a rank-private page: the largest local
    page over all ranks (uneven PP splits give stage 0 the most layers)."""
    return local_page_bytes(group, parallel.with_rank(0))


def canonical_page_bytes(group: KVGroupSpec, parallel: ParallelSpec) -> int:
    """Payload bytes per GPU block of this group under ``parallel``.

    Certified groups: the model-wide page (``group.page_bytes``), the same at
    every parallel layout. Everything else is rank-private: world_size x the
    largest local page, rank r owning slice r.
    """
    if is_certified(group, parallel):
        return group.page_bytes
    return parallel.world_size * rank_private_slice_bytes(group, parallel)
