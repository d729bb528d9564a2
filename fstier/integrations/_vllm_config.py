"""vLLM's configuration in fstier's terms: FstierTier's options as a
:class:`~fstier.config.TierConfig`, vLLM's fields as a namespace.

* :func:`tier_config_from_options`: the ``secondary_tiers`` entry's keys
  (vLLM's own removed): ``config``'s ``tier:`` section, then inline tier
  fields over it, vLLM's thread-count spellings and size letters accepted,
  :data:`VLLM_READ_THREADS` read threads unless set;
  the first bad option is one :class:`~fstier.errors.ConfigError`.
* :func:`engine_mapper`: the :class:`~fstier.file_mapper.FileMapper` of a
  vLLM deployment: vLLM's fields that change a row's bytes, the row size,
  fstier's format version and the salt; parallel sizes and the rank leave
  the namespace through THE collapse rule
  (:func:`~fstier.file_mapper.parallel_identity`) exactly when vLLM calls
  the rows parallelism-agnostic.
* :func:`cpu_tier_shortfall` (:func:`small_cpu_tier` for a running
  deployment, what FstierTier logs once at start; ``fstier config validate
  --max-model-len`` for a config): why vLLM's CPU tier cannot serve one longest
  prompt from FstierTier (vLLM 0.33 serves a secondary-tier hit only once it
  is promoted into the CPU tier; a prefix longer than the CPU tier holds is
  not served from disk at all, docs/vllm.md "Sizing the CPU tier"), or None.

Importing this module never imports vLLM (``engine_mapper`` reads the
canonical format id from vLLM when the layout is canonical), so ``fstier
config validate`` checks FstierTier's options with
:func:`tier_config_from_options` from here without vLLM installed
(tests/test_torch_free.py pins it).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from fstier.config import TierConfig
from fstier.errors import ConfigError
from fstier.file_mapper import FileMapper, parallel_identity
from fstier.integrations._options import tier_config_from_engine_options
from fstier.integrations._vllm_compat import sliding_window_chunks
from fstier.io import FORMAT_VERSION
from fstier.units import parse_size

__all__ = ["cpu_rows_for_prompt", "cpu_tier_shortfall", "engine_mapper", "small_cpu_tier", "tier_config_from_options"]

#: Keys vLLM itself puts in (or leaves in) a tier's constructor arguments.
_VLLM_KEYS = frozenset({"locality", "enable_kv_events"})
#: vLLM fs-tier spellings accepted for the same fstier field.
_ALIASES = {"n_read_threads": "read_threads", "n_write_threads": "write_threads"}
#: Read threads under vLLM unless the options or the YAML set them: vLLM's
#: own fs tier runs 16 per queue, and with vLLM's many small load jobs the
#: reads in flight bound a cold load (64 KiB rows: 0.62x of vLLM's fs tier
#: with 8, 1.10x with 16; docs/performance.md "Reads in flight").
VLLM_READ_THREADS = 16


# ------------------------------------------------------------------ options
def tier_config_from_options(options: Mapping[str, Any]) -> TierConfig:
    """The :class:`TierConfig` of FstierTier's constructor options (the vLLM
    keys already removed): ``config``'s ``tier:`` section, then inline tier
    fields (``tier.<field>`` or ``<field>``, and vLLM's thread-count names)
    over it. Raises :class:`ConfigError` naming the first bad option."""
    opts: dict[str, Any] = dict(options)
    for key in ("max_bytes", "tier.max_bytes"):
        value = opts.get(key)
        if isinstance(value, str):
            # Inside vLLM's JSON a bare letter means what vLLM means: "2T" is
            # 2 TiB (vLLM's human_readable_int), "2t" 2 TB.
            try:
                opts[key] = parse_size(value, vllm_letters=True)
            except ValueError as exc:
                raise ConfigError(f"FstierTier options: tier.max_bytes: {exc}") from None
    tier = tier_config_from_engine_options(
        opts,
        who="FstierTier",
        engine="vLLM",
        engine_keys=_VLLM_KEYS,
        aliases=_ALIASES,
        doc="docs/vllm.md",
    )
    if "read_threads" not in tier.model_fields_set:
        tier = tier.model_copy(update={"read_threads": VLLM_READ_THREADS})
    return tier


# ---------------------------------------------------------------- namespace
def engine_mapper(offloading_spec: Any, row_bytes: int, tier: TierConfig) -> FileMapper:
    """The :class:`FileMapper` of a vLLM deployment: the digest holds vLLM's
    fields that change a row's bytes, fstier's format version, the row size
    and the salt; parallel sizes and the rank leave it exactly when vLLM calls
    the rows parallelism-agnostic (``is_parallelism_agnostic`` or
    ``replicated_layout``)."""
    cfg = offloading_spec.config
    par = cfg.parallel
    replicated = bool(getattr(offloading_spec, "replicated_layout", cfg.replicated_layout))
    agnostic = bool(par.is_parallelism_agnostic or replicated)
    canonical_format = None
    if cfg.canonical_layout and cfg.kv_cache_layout is not None:
        from vllm.distributed.kv_transfer.kv_connector.v1.offloading.canonical_mapping import (
            canonical_format_id,
        )

        canonical_format = canonical_format_id(cfg.kv_cache_layout)
    fields: dict[str, Any] = {
        "engine": "vllm",
        "model": cfg.model.name,
        "dtype": str(cfg.model.dtype),
        "tokens_per_hash": cfg.cache.tokens_per_hash,
        "blocks_per_chunk": cfg.cache.blocks_per_chunk,
        "groups": [
            {
                "group_id": g.group_id,
                "tokens_per_block": g.tokens_per_block,
                "layer_names": list(g.layer_names),
                "sliding_window_size_in_chunks": sliding_window_chunks(g),
            }
            for g in cfg.groups
        ],
        "row_bytes": row_bytes,
        "replicated_layout": replicated,
        "canonical_layout": bool(cfg.canonical_layout),
        "kv_cache_layout": cfg.kv_cache_layout,
        "canonical_format": canonical_format,
        "parallel_agnostic": agnostic,
        **parallel_identity(
            agnostic,
            {
                "tp_size": par.tp_size,
                "pp_size": par.pp_size,
                "pcp_size": par.pcp_size,
                "dcp_size": par.dcp_size,
            },
        ),
        "format_version": FORMAT_VERSION,
        "namespace_salt": tier.namespace_salt,
    }
    return FileMapper.for_engine(
        tier.root_dir,
        cfg.model.name,
        fields,
        agnostic=agnostic,
        rank=par.rank,
        payload_bytes=[row_bytes] * max(1, len(cfg.groups)),
    )


# ------------------------------------------------------------- CPU tier size
def cpu_rows_for_prompt(offloading_spec: Any, tokens: int) -> int:
    """CPU-tier rows one prompt of ``tokens`` tokens takes (a row is one chunk of one KV group; a
    sliding-window group keeps only its window)."""
    cfg = offloading_spec.config
    rows = 0
    for g in cfg.groups:
        chunk_tokens = g.tokens_per_block * cfg.cache.blocks_per_chunk
        need = -(-tokens // chunk_tokens)
        window = sliding_window_chunks(g)
        rows += need if window is None else min(need, window)
    return rows


def cpu_tier_shortfall(cpu_tokens: int, max_model_len: int, *, cpu_what: str) -> str | None:
    """One line saying that vLLM's CPU tier (``cpu_what``, holding ``cpu_tokens`` tokens of KV) cannot hold one
    prompt of ``max_model_len`` tokens, and what follows; None when it can."""
    if cpu_tokens >= max_model_len:
        return None
    return (
        f"vLLM's CPU tier ({cpu_what}) holds the KV of {cpu_tokens:,} tokens, less than one prompt of "
        f"max_model_len {max_model_len:,}: vLLM 0.33 serves a FstierTier hit only through the CPU tier, so a "
        f"stored prefix longer than {cpu_tokens:,} tokens is not served from disk at all (its promotions evict "
        "each other while the request waits, then it is recomputed); raise "
        "cpu_bytes_to_use to at least max_model_len x KV bytes per token (docs/vllm.md, \"Sizing the CPU tier\")"
    )


def small_cpu_tier(offloading_spec: Any, cpu_rows: int, row_bytes: int) -> str | None:
    """:func:`cpu_tier_shortfall` for a running deployment: its CPU tier of ``cpu_rows`` rows against one prompt
    of vLLM's ``max_model_len`` (None when vLLM did not say it, or when the tier holds one)."""
    max_len = int(getattr(offloading_spec.config.model, "max_model_len", 0) or 0)
    if max_len <= 0 or cpu_rows_for_prompt(offloading_spec, max_len) <= cpu_rows:
        return None
    lo, hi = 0, max_len  # the longest prompt the rows hold: rows_for(lo) <= cpu_rows < rows_for(hi)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if cpu_rows_for_prompt(offloading_spec, mid) <= cpu_rows else (lo, mid)
    return cpu_tier_shortfall(lo, max_len, cpu_what=f"cpu_bytes_to_use: {cpu_rows} rows of {row_bytes:,} bytes")
