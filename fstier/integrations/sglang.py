"""fstier as SGLang's HiCache storage backend: ``FstierHiCacheStorage``.

SGLang (0.5.x) offloads host-pool KV pages to a storage backend; a third-party
backend is loaded by SGLang's own ``dynamic`` factory path::

    --hicache-storage-backend dynamic
    --hicache-storage-backend-extra-config '{"backend_name": "fstier",
        "module_path": "fstier.integrations.sglang",
        "class_name": "FstierHiCacheStorage", "interface_v1": true,
        "root_dir": "/mnt/kv", "max_bytes": "2TiB"}'

The other keys of that JSON are fstier's options (docs/sglang.md):
``root_dir`` (required, here or in the YAML), ``config`` (an fstier YAML
whose ``tier:`` section gives defaults) and any ``tier`` field inline.
SGLang's own keys (``backend_name``, ``module_path``, ``class_name``,
``interface_v1``, the prefetch keys) are left to SGLang; anything else is a
:class:`~fstier.errors.ConfigError` naming the key.

How SGLang's world maps onto fstier
    * **A page is a few fragments, each one file, moved in place**
      (:mod:`fstier.integrations._sglang_pool`): two (K and V) per page in
      the page-first layouts, one for an MLA pool, two per layer in
      ``layer_first``. The pool's ``kv_buffer`` is rows of one fragment's
      size, lent to FsTier in place (:class:`~fstier.slots.RowSlots`, joined
      with the legacy calls' scratch rows in a
      :class:`~fstier.slots.JoinedSlots`); fragment ``g`` of the page
      with hash ``h`` is the file of ``BlockKey(h, g)``. The zero-copy v1
      calls are one FsTier job per batch (128 pages at most), one I/O op per
      fragment, with no copy in Python.
    * **Prefix semantics, fail closed.** A page counts only when every one of
      its fragments stored or loaded; FsTier's results are prefixes, so a
      missing, short, corrupt or foreign file makes its page and every page
      after it ``False`` (each load is checked: size, header, key, namespace,
      checksum), never wrong bytes reported loaded. ``exists`` /
      ``batch_exists`` count leading pages whose fragments are all present.
    * **Legacy calls** (``get``/``set``/``batch_get``/``batch_set``, used
      when ``interface_v1`` is off) move SGLang's flat page tensors through
      fstier-owned scratch rows (one copy each way, serialized): the files
      are the same as the v1 path's, so either path reads the other's pages.
    * **Namespace** (``pool_mapper``): SGLang's config and the pool's
      geometry. Files are rank-private unless SGLang says the KV is
      rank-replicated (``is_mla_model``): then every tp rank reads the same
      files and only ``is_storage_writer`` stores.
    * **Multi-pool (v2) models** (Mamba, SWA, DSA sidecars) are refused when
      the pools are registered: only the KV pool is stored. ``batch_*_v2``
      calls that name the KV pool alone are served by the v1 path.
    * **Waiting** (:func:`~fstier.integrations._blocking.run_job`):
      SGLang's storage calls are synchronous; each call is one FsTier job,
      tagged, that it waits for (:meth:`~fstier.manager.FsTier.wait`: the
      engine's completion wakes it; no table of results). FsTier holds back
      (``hold_fenced_results``) a job whose op timed out until the late call
      released its rows, so SGLang never reuses a row a late read may still
      fill.

Importing :mod:`fstier` never imports SGLang. Importing this module does;
without SGLang, or with a version outside :data:`SUPPORTED_SGLANG`,
constructing ``FstierHiCacheStorage`` raises
:class:`SglangUnavailableError` naming what is installed and what is
supported. No SGLang call ever receives an exception from a storage call:
failures are ``False`` pages (and log lines).
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from fstier.config_file import shown
from fstier.errors import ConfigError, KeyFormatError
from fstier.file_mapper import FileMapper
from fstier.integrations._blocking import run_job
from fstier.integrations._exporter import export_tier, serve_metrics
from fstier.integrations._sglang_compat import (
    SUPPORTED_SGLANG,
    SglangUnavailableError,
    check_supported,
    sglang_metrics_port,
    sglang_version,
    tier_config_from_extra_config,
)
from fstier.integrations._sglang_pool import (
    SUPPORTED_LAYOUTS,
    PoolGeometry,
    count_true_prefix,
    page_hash,
    pool_mapper,
)
from fstier.keys import BlockKey
from fstier.slots import JoinedSlots

if TYPE_CHECKING:  # pragma: no cover
    from fstier.manager import FsTier

__all__ = [
    "SUPPORTED_LAYOUTS",
    "SUPPORTED_SGLANG",
    "FstierHiCacheStorage",
    "SglangUnavailableError",
    "check_sglang",
    "sglang_version",
    "tier_config_from_extra_config",
]

log = logging.getLogger("fstier.sglang")

#: Pages the legacy (non-v1) calls stage at once through scratch rows.
_SCRATCH_PAGES = 16

_IMPORT_ERROR: BaseException | None = None


def check_sglang() -> str:
    """Return the installed SGLang version if FstierHiCacheStorage supports
    it, else raise :class:`SglangUnavailableError` naming what is installed
    and what is supported."""
    return check_supported(sglang_version(), _IMPORT_ERROR)


# ------------------------------------------------------------------ backend
try:
    from sglang.srt.mem_cache.hicache_storage import (
        HiCacheStorage,
        HiCacheStorageConfig,
        HiCacheStorageExtraInfo,
        PoolName,
        PoolTransfer,
        PoolTransferResult,
    )
except Exception as exc:  # SGLang missing or with another layout: fail at construction
    _IMPORT_ERROR = exc

    class FstierHiCacheStorage:  # type: ignore[no-redef,unused-ignore]
        """Placeholder: SGLang is missing or not importable; constructing says so."""

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            check_sglang()
            raise SglangUnavailableError(str(_IMPORT_ERROR))  # pragma: no cover

else:

    class FstierHiCacheStorage(HiCacheStorage):  # type: ignore[no-redef]
        """fstier as an SGLang HiCache storage backend (see the module docstring).

        Built by SGLang's ``StorageBackendFactory.create_backend("dynamic",
        storage_config, host_pool)`` as ``FstierHiCacheStorage(storage_config,
        kwargs)``; the tier opens when SGLang registers the host pool
        (``register_mem_pool_host``)."""

        def __init__(self, storage_config: HiCacheStorageConfig, kwargs: Any = None) -> None:
            check_sglang()
            if not isinstance(storage_config, HiCacheStorageConfig):
                raise ConfigError(
                    "FstierHiCacheStorage(storage_config, kwargs): expected SGLang's "
                    f"HiCacheStorageConfig, got {type(storage_config).__name__}"
                )
            if kwargs:
                raise ConfigError(
                    f"FstierHiCacheStorage: unexpected constructor arguments {sorted(kwargs)}; "
                    "give options in --hicache-storage-backend-extra-config"
                )
            self.storage_config = storage_config
            self.tier_config = tier_config_from_extra_config(storage_config.extra_config)
            if storage_config.dcp_size > 1:
                raise ConfigError(
                    "FstierHiCacheStorage: decode context parallelism (dcp_size "
                    f"{storage_config.dcp_size}) is not supported; SGLang allows it only "
                    "with its file or mooncake backends"
                )
            if storage_config.should_split_heads:
                raise ConfigError(
                    "FstierHiCacheStorage: heterogeneous-TP head splitting (tp_lcm_size) is "
                    "not supported; remove tp_lcm_size from the extra config"
                )
            self.mem_pool_host: Any = None
            self.fstier: FsTier | None = None
            self.mapper: FileMapper | None = None
            self._geometry: PoolGeometry | None = None
            self._rows: JoinedSlots | None = None
            self._scratch_base = 0
            self._scratch_lock = threading.Lock()
            self._tags = itertools.count()  # each call's job id: ("sglang", kind, n)
            self._unsupported_pools: list[str] = []
            self._metrics_port = serve_metrics(sglang_metrics_port(storage_config), "FstierHiCacheStorage")
            self._pools_registered = False
            self._closed = False
            self._stats_lock = threading.Lock()
            self._stats: dict[str, list[float]] = {
                "prefetch_pgs": [], "backup_pgs": [],
                "prefetch_bandwidth": [], "backup_bandwidth": [],
            }

        # -- attach ----------------------------------------------------------
        @property
        def is_writer(self) -> bool:
            """Whether this rank stores (SGLang's ``is_storage_writer``)."""
            return bool(self.storage_config.is_storage_writer)

        def register_mem_pool_host(self, mem_pool_host: Any) -> None:
            """Open the tier over ``mem_pool_host``'s pages (SGLang calls this
            right after the factory). Raises :class:`ConfigError` for a pool
            fstier cannot move in place; SGLang then fails the attach."""
            if self.fstier is not None:
                if mem_pool_host is self.mem_pool_host:
                    return
                raise ConfigError(
                    "FstierHiCacheStorage: a second host pool was registered; one backend "
                    "serves one KV host pool"
                )
            from fstier.manager import FsTier

            geo = PoolGeometry(mem_pool_host)
            cfg = self.storage_config
            mapper = pool_mapper(cfg, self.tier_config, mem_pool_host, geo)
            # The pool's rows in place, then scratch rows for the legacy calls.
            rows = JoinedSlots(geo.host_rows(), geo.scratch_rows(_SCRATCH_PAGES))
            try:
                # SGLang reuses a row as soon as its call returns: FsTier holds
                # back the result of a job whose row a timed-out call may still
                # write (load) or read (store), until that call returned.
                tier = FsTier(self.tier_config, rows, mapper, hold_fenced_results=True)
            except BaseException:
                rows.release()
                raise
            self.mem_pool_host = mem_pool_host
            self._geometry = geo
            self._rows = rows
            self._scratch_base = rows.start_of(1)
            self.mapper = mapper
            self.fstier = tier
            export_tier(tier, self._metrics_port)
            log.info(
                "fstier: SGLang HiCache storage at %s (namespace %s, %s, %s layout, %d "
                "fragment(s) of %d bytes per page, %s)",
                mapper.root, mapper.namespace,
                "shared by tp ranks" if cfg.is_mla_model else "rank-private",
                mem_pool_host.layout, geo.fragments, geo.fragment_bytes,
                "writer" if self.is_writer else "reader",
            )

        def register_mem_host_pool_v2(self, host_pool: Any, host_pool_name: Any) -> None:
            """Multi-pool models: the KV pool is served; any other pool
            (Mamba, SWA, indexer, ...) is recorded and refused when
            registration ends (or, for a pool added later, its pages miss)."""
            name = str(host_pool_name)
            if name == str(PoolName.KV) and (
                self.mem_pool_host is None or host_pool is self.mem_pool_host
            ):
                return
            if name not in self._unsupported_pools:
                self._unsupported_pools.append(name)
            if self.fstier is not None and self._pools_registered:
                log.error(
                    "fstier: SGLang registered host pool %r; FstierHiCacheStorage stores KV "
                    "pages only, so that pool's pages miss", name,
                )

        def on_host_pools_registered(self) -> None:
            self._pools_registered = True
            if self.fstier is None:
                raise ConfigError(
                    "FstierHiCacheStorage: no KV host pool was registered "
                    "(register_mem_pool_host) before registration ended"
                )
            if self._unsupported_pools:
                raise ConfigError(
                    "FstierHiCacheStorage stores KV pages only; this model also has host "
                    f"pool(s) {', '.join(self._unsupported_pools)} (a hybrid Mamba/SWA/sparse "
                    "model), which fstier does not support; use another HiCache storage backend "
                    "for it"
                )

        # -- jobs --------------------------------------------------------------
        def _ready(self) -> FsTier | None:
            if self._closed or self.fstier is None:
                return None
            return self.fstier

        def _keys_of(self, keys: Sequence[Any]) -> list[bytes]:
            """Page hashes of ``keys`` up to the first one that is not a page
            key (:func:`page_hash`): that page and the pages after it miss,
            the pages before it are served."""
            out: list[bytes] = []
            for k in keys:
                h = page_hash(k)
                if h is None:
                    log.warning(
                        "fstier: SGLang key %s is not a page key (64 lowercase hex digits); it "
                        "and the %d page(s) after it miss", shown(k), len(keys) - len(out) - 1,
                    )
                    break
                out.append(h)
            return out

        def _pages_job(
            self, kind: str, hashes: list[bytes], rows: list[list[int]]
        ) -> int:
            """Store or load whole pages (every fragment); the number of
            leading pages that completed."""
            tier = self._ready()
            if tier is None or not hashes:
                return 0
            f = len(rows[0])
            bkeys: list[BlockKey] = []
            slots: list[int] = []
            try:
                for h, page_rows in zip(hashes, rows, strict=False):
                    for g in range(f):
                        bkeys.append(BlockKey(h, g))
                        slots.append(page_rows[g])
            except KeyFormatError as exc:  # cannot happen for 32-byte hashes
                log.error("fstier: %s", exc)
                return 0
            result = run_job(tier, ("sglang", kind, next(self._tags)), kind, bkeys, slots, "SGLang")
            if result is None:
                return 0
            return result.keys_completed // f

        def _v1(
            self, kind: str, keys: list[str], host_indices: Any
        ) -> list[bool]:
            n = len(keys)
            try:
                geo = self._geometry
                if geo is None or self._ready() is None:
                    return [False] * n
                if kind == "store" and not self.is_writer:
                    # MLA: one writer per page; other ranks read its files
                    # and never store (SGLang skips their backups).
                    return [False] * n
                rows = geo.rows_of(host_indices)
                if rows is None or len(rows) != n:
                    log.error(
                        "fstier: SGLang %s of %d page(s) with %s host indices that are not "
                        "whole pages of the registered pool; the pages fail",
                        kind, n, getattr(host_indices, "numel", lambda: "?")(),
                    )
                    return [False] * n
                hashes = self._keys_of(keys)
                t0 = time.perf_counter()
                done = self._pages_job(kind, hashes, rows[: len(hashes)])
                self._note(kind, done, time.perf_counter() - t0)
                return [i < done for i in range(n)]
            except Exception:  # never into SGLang's I/O threads
                log.exception("fstier: SGLang %s of %d page(s) failed", kind, n)
                return [False] * n

        def _note(self, kind: str, pages: int, seconds: float) -> None:
            geo = self._geometry
            if not self.storage_config.enable_storage_metrics or geo is None or pages == 0:
                return
            nbytes = pages * geo.fragments * geo.fragment_bytes
            gbps = nbytes / max(seconds, 1e-9) / 1e9
            with self._stats_lock:
                pre = "prefetch" if kind == "load" else "backup"
                self._stats[f"{pre}_pgs"].append(pages)
                self._stats[f"{pre}_bandwidth"].append(gbps)

        # -- v1 (zero-copy) ----------------------------------------------------
        def batch_set_v1(
            self,
            keys: list[str],
            host_indices: Any,
            extra_info: HiCacheStorageExtraInfo | None = None,
        ) -> list[bool]:
            """Store each page's fragments from the host pool in place; per
            page, whether it (and every page before it) is on disk."""
            return self._v1("store", keys, host_indices)

        def batch_get_v1(
            self,
            keys: list[str],
            host_indices: Any,
            extra_info: HiCacheStorageExtraInfo | None = None,
        ) -> list[bool]:
            """Load each page's fragments into the host pool in place, every
            file verified; per page, whether it (and every page before it)
            loaded."""
            return self._v1("load", keys, host_indices)

        # -- lookups -----------------------------------------------------------
        def exists(self, key: str) -> bool:
            return self.batch_exists([key]) == 1

        def batch_exists(
            self, keys: list[str], extra_info: HiCacheStorageExtraInfo | None = None
        ) -> int:
            """Leading pages whose fragments are all present."""
            tier = self._ready()
            geo = self._geometry
            if tier is None or geo is None:
                return 0
            try:
                hashes = self._keys_of(keys)
                f = geo.fragments
                bkeys = [BlockKey(h, g) for h in hashes for g in range(f)]
                return tier.lookup(bkeys) // f
            except Exception:
                log.exception("fstier: SGLang lookup of %d page(s) failed", len(keys))
                return 0

        # -- legacy (flat page tensors, through scratch rows) ------------------
        def _legacy(self, kind: str, keys: Sequence[Any], tensors: Sequence[Any]) -> int:
            """Pages of ``keys`` moved to/from ``tensors`` through scratch
            rows, ``_SCRATCH_PAGES`` at a time; the leading count."""
            geo, rows = self._geometry, self._rows
            if geo is None or rows is None or self._ready() is None:
                return 0
            f, fb = geo.fragments, geo.fragment_bytes
            hashes = self._keys_of(keys)
            done = 0
            with self._scratch_lock:
                for start in range(0, len(hashes), _SCRATCH_PAGES):
                    chunk = hashes[start : start + _SCRATCH_PAGES]
                    views = [geo.flat_page_bytes(t) for t in tensors[start : start + len(chunk)]]
                    usable = count_true_prefix([v is not None for v in views])
                    if usable < len(chunk):
                        log.error(
                            "fstier: SGLang legacy %s: page %d is not a contiguous host tensor "
                            "of %d bytes; it and later pages fail", kind, start + usable, f * fb,
                        )
                    chunk = chunk[:usable]
                    if not chunk:
                        break
                    page_rows = [
                        [self._scratch_base + i * f + g for g in range(f)]
                        for i in range(len(chunk))
                    ]
                    if kind == "store":
                        for i, v in enumerate(views[: len(chunk)]):
                            for g in range(f):
                                rows.slot_view(page_rows[i][g])[:] = v[g * fb : (g + 1) * fb]
                    ok = self._pages_job(kind, chunk, page_rows)
                    if kind == "load":
                        for i in range(ok):
                            v = views[i]
                            for g in range(f):
                                v[g * fb : (g + 1) * fb] = rows.slot_view(page_rows[i][g])
                    done += ok
                    if ok < len(chunk) or usable < len(views):
                        break
            return done

        def get(
            self,
            key: str,
            target_location: Any = None,
            target_sizes: Any = None,
        ) -> Any:
            got = self.batch_get([key], [target_location])
            return got[0] if isinstance(got, list) and got else None

        def batch_get(
            self,
            keys: list[str],
            target_locations: Any = None,
            target_sizes: Any = None,
        ) -> list[Any]:
            """Load pages into SGLang's flat page tensors; a tensor per
            loaded page, None from the first page that did not load on."""
            n = len(keys)
            try:
                targets = list(target_locations or [])
                if len(targets) != n:
                    return [None] * n
                done = self._legacy("load", keys, targets)
                return [targets[i] if i < done else None for i in range(n)]
            except Exception:
                log.exception("fstier: SGLang batch_get of %d page(s) failed", n)
                return [None] * n

        def set(
            self,
            key: str,
            value: Any = None,
            target_location: Any = None,
            target_sizes: Any = None,
        ) -> bool:
            return self.batch_set([key], [value])

        def batch_set(
            self,
            keys: list[str],
            values: Any = None,
            target_locations: Any = None,
            target_sizes: Any = None,
        ) -> bool:
            """Store SGLang's flat page tensors; True if every page is on disk."""
            n = len(keys)
            try:
                vals = list(values or [])
                if len(vals) != n:
                    return False
                if not self.is_writer:
                    return False
                return self._legacy("store", keys, vals) == n
            except Exception:
                log.exception("fstier: SGLang batch_set of %d page(s) failed", n)
                return False

        # -- v2 (multi-pool): the KV pool only --------------------------------
        def _kv_only(self, transfers: Sequence[PoolTransfer] | None) -> bool:
            return all(str(t.name) == str(PoolName.KV) for t in transfers or [])

        def batch_exists_v2(
            self,
            keys: list[str],
            pool_transfers: list[PoolTransfer] | None = None,
            extra_info: HiCacheStorageExtraInfo | None = None,
        ) -> PoolTransferResult:
            if not self._kv_only(pool_transfers):
                return PoolTransferResult.empty()
            n = self.batch_exists(keys, extra_info)
            return PoolTransferResult(n, {str(PoolName.KV): n} if n else {}, list(range(1, n + 1)))

        def _batch_v2(
            self, kind: str, transfers: list[PoolTransfer]
        ) -> dict[str, list[bool]]:
            out: dict[str, list[bool]] = {}
            for t in transfers:
                keys = list(t.keys or [])
                if str(t.name) != str(PoolName.KV) or t.host_indices is None:
                    out[str(t.name)] = [False] * len(keys)
                    continue
                out[str(t.name)] = self._v1(kind, keys, t.host_indices)
            return out

        def batch_get_v2(
            self,
            transfers: list[PoolTransfer],
            extra_info: HiCacheStorageExtraInfo | None = None,
        ) -> dict[str, list[bool]]:
            return self._batch_v2("load", transfers)

        def batch_set_v2(
            self,
            transfers: list[PoolTransfer],
            extra_info: HiCacheStorageExtraInfo | None = None,
        ) -> dict[str, list[bool]]:
            return self._batch_v2("store", transfers)

        # -- stats, clear, close -----------------------------------------------
        def get_stats(self) -> Any:
            """SGLang's ``StorageMetrics`` since the last call (pages and GB/s
            per batch, with ``enable_storage_metrics``), plus ``fstier``:
            FsTier's metrics snapshot."""
            try:
                from sglang.srt.observability.metrics_collector import StorageMetrics
            except Exception:  # pragma: no cover - metrics module not importable
                return None
            with self._stats_lock:
                taken = self._stats
                self._stats = {k: [] for k in taken}
            m = StorageMetrics(
                prefetch_pgs=[int(x) for x in taken["prefetch_pgs"]],
                backup_pgs=[int(x) for x in taken["backup_pgs"]],
                prefetch_bandwidth=list(taken["prefetch_bandwidth"]),
                backup_bandwidth=list(taken["backup_bandwidth"]),
            )
            tier = self._ready()
            m.fstier = tier.metrics.snapshot() if tier is not None else {}  # type: ignore[attr-defined,unused-ignore]
            return m

        def clear(self) -> bool:
            """Remove this rank's block files (:meth:`FsTier.clear`; a shared
            MLA namespace: only the writer removes)."""
            tier = self._ready()
            if tier is None:
                return False
            if not self.is_writer:
                return True
            try:
                tier.clear()
            except Exception:
                log.exception("fstier: clear failed")
                return False
            return True

        @property
        def closed(self) -> bool:
            return self._closed

        def close(self) -> None:
            """Finish in-flight jobs and close the tier. Idempotent."""
            if self._closed:
                return
            self._closed = True
            tier, rows = self.fstier, self._rows
            try:
                if tier is not None:
                    tier.close()
            finally:
                if rows is not None:
                    rows.release()

