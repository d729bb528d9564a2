"""SGLang's host pool in fstier's terms: where a page's fragments lie and
what their files are called.

* :class:`PoolGeometry`: SGLang's ``get_page_buffer_meta`` describes a host
  page as pointers into the pool's one ``kv_buffer``; every fragment of every
  page has the same size, so the buffer is rows of that size and fragment
  ``g`` of page ``p`` is row ``g * page_num + p``. Checked once at attach
  (layout, a contiguous host buffer, equal fragments that tile it); per
  batch, :meth:`PoolGeometry.rows_of` maps SGLang's token indices to rows
  through SGLang's own call, one integer division per pointer. A page is two
  fragments (K, V) in the page-first layouts, one in an MLA pool, two per
  layer (``layer_first``: 2 x layers files per page).
* :func:`pool_mapper`: the namespace digest holds the model name, dtype,
  pool class, layout, page size, layer/head geometry, fragment count and
  size, storage format tag, tp/pp/attention-cp sizes, fstier's format
  version and the salt; the rank segment is the tp, attention-cp and pp rank
  together unless the KV is rank-replicated.
* :func:`page_hash`: SGLang's page key (exactly 64 lowercase hex digits;
  anything else is no page) as a :class:`~fstier.keys.BlockKey` hash.
* :func:`count_true_prefix`: the pages of a batch that count (a prefix).

Importing this module imports neither SGLang nor torch (torch is imported
when a pool is measured).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from fstier.errors import ConfigError
from fstier.file_mapper import FileMapper, parallel_identity
from fstier.io import FORMAT_VERSION
from fstier.slots.rows import RowSlots

if TYPE_CHECKING:  # pragma: no cover
    from fstier.config import TierConfig

__all__ = ["SUPPORTED_LAYOUTS", "PoolGeometry", "count_true_prefix", "page_hash", "pool_mapper"]

#: Host-pool layouts whose pages are fixed-size fragments of one buffer.
SUPPORTED_LAYOUTS = ("layer_first", "page_first", "page_first_direct", "page_head")


#: SGLang's page key: a SHA-256 as 64 lowercase hex digits, exactly.
_PAGE_KEY = re.compile(r"[0-9a-f]{64}")


def page_hash(key: object) -> bytes | None:
    """SGLang's page key as a BlockKey hash: the 32 bytes its 64 lowercase
    hex digits spell; None for anything else (a miss, never another page's
    file). Strict on purpose: ``bytes.fromhex`` also takes upper case and
    skips whitespace, so ``"AB.."`` or a key with a space in it named the
    file of another key and loaded that page's bytes as its own
    (tests/sglang/test_sglang_backend.py::test_keys_name_files_exactly)."""
    if isinstance(key, str) and _PAGE_KEY.fullmatch(key):
        return bytes.fromhex(key)
    return None


class PoolGeometry:
    """How one host pool's pages lie in its ``kv_buffer`` (checked at attach)."""

    def __init__(self, pool: Any) -> None:
        import torch

        self.pool = pool
        layout = getattr(pool, "layout", None)
        if layout not in SUPPORTED_LAYOUTS:
            raise ConfigError(
                f"FstierHiCacheStorage: host pool layout {layout!r} is not supported; use one "
                f"of {', '.join(SUPPORTED_LAYOUTS)} (--hicache-mem-layout)"
            )
        buf = getattr(pool, "kv_buffer", None)
        if not isinstance(buf, torch.Tensor):
            raise ConfigError(
                f"FstierHiCacheStorage: host pool {type(pool).__name__} has no single kv_buffer "
                "tensor; fstier stores MHA and MLA token pools"
            )
        if buf.device.type != "cpu" or not buf.is_contiguous():
            raise ConfigError(
                f"FstierHiCacheStorage: host pool {type(pool).__name__}'s kv_buffer must be a "
                f"contiguous host tensor, got device={buf.device}, contiguous={buf.is_contiguous()}"
            )
        self.page_size = int(pool.page_size)
        self.page_num = int(pool.page_num)
        self.base = int(buf.data_ptr())
        self.nbytes = int(buf.numel() * buf.element_size())
        first = torch.arange(self.page_size, dtype=torch.int64)
        ptrs, sizes = pool.get_page_buffer_meta(first)
        if not ptrs or len(ptrs) != len(sizes) or len(set(sizes)) != 1:
            raise ConfigError(
                f"FstierHiCacheStorage: {type(pool).__name__}.get_page_buffer_meta gave "
                f"{len(ptrs)} pointers of sizes {sorted(set(sizes))} for one page; fstier needs "
                "equal-sized fragments"
            )
        self.fragments = len(ptrs)
        self.fragment_bytes = int(sizes[0])
        if self.fragments * self.page_num * self.fragment_bytes != self.nbytes:
            raise ConfigError(
                f"FstierHiCacheStorage: {type(pool).__name__}'s kv_buffer holds {self.nbytes} "
                f"bytes, not {self.fragments} fragments x {self.page_num} pages x "
                f"{self.fragment_bytes} bytes; its layout is not one fstier can move in place"
            )
        self.buffer = buf
        rows = self.rows_of(first)
        if rows != [[g * self.page_num for g in range(self.fragments)]]:
            raise ConfigError(
                f"FstierHiCacheStorage: {type(pool).__name__}'s page fragments are not rows of "
                "its kv_buffer; its layout is not one fstier can move in place"
            )

    def host_rows(self) -> RowSlots:
        """The pool's ``kv_buffer`` as fragment rows, lent in place (row
        ``g * page_num + p`` is fragment ``g`` of page ``p``)."""
        flat = self.buffer.view(-1).view(dtype=_uint8()).numpy()
        return RowSlots(flat.data, self.fragments * self.page_num, self.fragment_bytes)

    def scratch_rows(self, pages: int) -> RowSlots:
        """fstier-owned rows for ``pages`` whole pages, of this pool's
        fragment size (untouched, so unbacked, until first used)."""
        import numpy as np

        n = pages * self.fragments
        return RowSlots(np.empty(n * self.fragment_bytes, dtype=np.uint8).data, n, self.fragment_bytes)

    def flat_page_bytes(self, t: Any) -> Any:
        """A writable uint8 numpy view of one flat page tensor (the legacy
        calls' page: every fragment in fragment order), or None if ``t`` is
        not a contiguous host tensor of exactly one page."""
        import torch

        if not isinstance(t, torch.Tensor) or t.device.type != "cpu" or not t.is_contiguous():
            return None
        if t.numel() * t.element_size() != self.fragments * self.fragment_bytes:
            return None
        return t.view(-1).view(dtype=_uint8()).numpy()

    def rows_of(self, host_indices: Any) -> list[list[int]] | None:
        """Per page of ``host_indices`` (token slots, ``page_size`` per page),
        the row of each fragment in fragment order, from SGLang's own
        ``get_page_buffer_meta``; None if the indices are not whole pages or a
        pointer is not a fragment row of this buffer."""
        ps, f, fb = self.page_size, self.fragments, self.fragment_bytes
        n = int(host_indices.numel())
        if n % ps:
            return None
        npages = n // ps
        ptrs, sizes = self.pool.get_page_buffer_meta(host_indices)
        if len(ptrs) != npages * f or any(s != fb for s in sizes):
            return None
        out: list[list[int]] = []
        base, limit, pn = self.base, self.nbytes, self.page_num
        for i in range(npages):
            page: int | None = None
            rows = [0] * f
            seen = 0
            for ptr in ptrs[i * f : (i + 1) * f]:
                off = int(ptr) - base
                if off < 0 or off + fb > limit or off % fb:
                    return None
                row = off // fb
                g, p = divmod(row, pn)
                if page is None:
                    page = p
                if p != page or seen & (1 << g):
                    return None
                seen |= 1 << g
                rows[g] = row
            out.append(rows)
        return out


def pool_mapper(cfg: Any, tier: TierConfig, pool: Any, geo: PoolGeometry) -> FileMapper:
    """The :class:`FileMapper` of one rank's host pool: SGLang's config
    (``HiCacheStorageConfig``) and the pool's geometry name the namespace;
    tp leaves it, and every tp rank shares the files, exactly when SGLang
    says the KV is rank-replicated (``is_mla_model``)."""
    shared = bool(cfg.is_mla_model)
    fields: dict[str, Any] = {
        "engine": "sglang",
        "model": cfg.model_name or "",
        "dtype": str(pool.dtype),
        "pool": type(pool).__name__,
        "layout": pool.layout,
        "page_size": geo.page_size,
        "layer_num": int(getattr(pool, "layer_num", 0)),
        "start_layer": getattr(pool, "start_layer", None),
        "end_layer": getattr(pool, "end_layer", None),
        "head_num": getattr(pool, "head_num", None),
        "head_dim": getattr(pool, "head_dim", None),
        "v_head_dim": getattr(pool, "v_head_dim", None),
        "kv_lora_rank": getattr(pool, "kv_lora_rank", None),
        "qk_rope_head_dim": getattr(pool, "qk_rope_head_dim", None),
        "storage_format_tag": getattr(pool, "storage_format_tag", None),
        "fragments_per_page": geo.fragments,
        "fragment_bytes": geo.fragment_bytes,
        "rank_replicated": shared,
        # THE collapse rule, for the one size SGLang's replicated KV drops:
        **parallel_identity(shared, {"tp_size": cfg.tp_size}),
        "pp_size": cfg.pp_size,
        "attn_cp_size": cfg.attn_cp_size,
        "format_version": FORMAT_VERSION,
        "namespace_salt": tier.namespace_salt,
    }
    # tp ranks share files exactly when SGLang says the KV is replicated;
    # pp stages and attention-cp ranks always hold different bytes.
    rank = cfg.attn_cp_rank + cfg.attn_cp_size * cfg.pp_rank
    if not shared:
        rank = cfg.tp_rank + cfg.tp_size * rank
    agnostic = shared and cfg.pp_size == 1 and cfg.attn_cp_size == 1
    return FileMapper.for_engine(
        tier.root_dir,
        cfg.model_name or "sglang",
        fields,
        agnostic=agnostic,
        rank=0 if agnostic else rank,
        payload_bytes=[geo.fragment_bytes] * geo.fragments,
    )


def _uint8() -> Any:
    """torch.uint8 (torch imported on first use)."""
    import torch

    return torch.uint8


def count_true_prefix(flags: Sequence[bool]) -> int:
    """How many leading pages of a batch succeeded (its results are a prefix)."""
    for i, f in enumerate(flags):
        if not f:
            return i
    return len(flags)
