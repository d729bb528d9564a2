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
    "is_certified",
    "local_layer_count",
    "model_format_id",
    "pp_layer_range",
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
    start, stop = pp_layer_range(group.num_layers, parallel.pp_size, parallel.pp_rank)
    return stop - start


def is_certified(group: KVGroupSpec, parallel: ParallelSpec) -> bool:
    """True when the group's rank pages map onto a parallel-independent canonical
    page: attention (full or sliding window) whose KV heads are either sharded
    evenly over the head-parallel ranks or replicated evenly across them."""
    if group.kind not in ("full_attention", "sliding_window"):
        return False
    head_ranks = parallel.tp_size // parallel.dcp_size
    h = group.num_kv_heads
    return h % head_ranks == 0 or head_ranks % h == 0


def _max_local_page_bytes(group: KVGroupSpec, parallel: ParallelSpec) -> int:
    # The largest local page over all ranks: uneven PP splits give stage 0 the most layers.
    layers = pp_layer_range(group.num_layers, parallel.pp_size, 0)
    num_local_layers = layers[1] - layers[0]
    if group.kind == "mamba":
        per_layer = int(group.page_size_bytes or 0)
    elif group.kind == "mla":
        # The latent is replicated on every TP rank; DCP/PCP split tokens.
        cp = parallel.dcp_size * parallel.pcp_size
        tokens = -(-group.block_size // cp)
        per_layer = tokens * group.head_size * group.element_size
    else:
        head_ranks = parallel.tp_size // parallel.dcp_size
        heads = max(1, group.num_kv_heads // head_ranks)
        cp = parallel.dcp_size * parallel.pcp_size
        tokens = -(-group.block_size // cp)
        per_layer = 2 * tokens * heads * group.head_size * group.element_size
    return num_local_layers * per_layer


def canonical_page_bytes(group: KVGroupSpec, parallel: ParallelSpec) -> int:
    """Payload bytes per GPU block of this group under ``parallel``.

    Certified groups: the model-wide page (``group.page_bytes``), the same at
    every parallel layout. Everything else is rank-private: world_size x the
    largest local page, rank r owning slice r.
    """
    if is_certified(group, parallel):
        return group.page_bytes
    return parallel.world_size * _max_local_page_bytes(group, parallel)
