"""fstier as LMCache's L2 storage backend: ``FstierL2Adapter``.

LMCache (0.5.x) keeps chunks in an L1 arena of shared memory and pushes them
to L2 adapters; a third-party adapter is loaded by LMCache's own ``plugin``
type::

    lmcache server ... --l2-adapter '{"type": "plugin",
        "module_path": "fstier.integrations.lmcache",
        "class_name": "FstierL2Adapter",
        "adapter_params": {"root_dir": "/mnt/kv", "max_bytes": "2TiB"}}'

``adapter_params`` are fstier's options (docs/lmcache.md): ``root_dir``
(required, here or in the YAML), ``config`` (an fstier YAML whose ``tier:``
section gives defaults) and any ``tier`` field inline; anything else is a
:class:`~fstier.errors.ConfigError` naming the key, raised when LMCache
builds the adapter (``FstierL2AdapterConfig.from_dict``). ``o_direct``
left unset is :data:`DEFAULT_O_DIRECT` (buffered), not fstier's ``auto``.
``metrics_port`` (opt-in) serves every open namespace's ``fstier_*``
metrics over HTTP (:mod:`fstier.integrations._exporter`), since LMCache does
not put them on its own endpoint.

How LMCache's world maps onto fstier (:mod:`fstier.integrations.lmcache_space`)
    * One chunk is one block file, ``BlockKey(chunk_hash, group=object_group_id)``,
      in the namespace of its model, ``kv_rank`` (exactly, any int), ``cache_salt``,
      value layout and hash length (0..7 bytes: padded, the length in the
      namespace; over 64: a miss): one :class:`~fstier.manager.FsTier` per
      namespace, opened on first use, idle ones past :data:`MAX_SPACES`
      closed least recently used first
      (:mod:`~fstier.integrations.lmcache_spaces`). A file of another layout
      is never loaded; MLA files are shared across TP sizes because LMCache's
      MLA ``kv_rank`` is; other files are rank-private.
    * **Store / load**: the L1 objects are lent to FsTier in place
      (:class:`~fstier.integrations.lmcache_space.LentSlots`); an LMCache
      task is one FsTier job per namespace it touches, tagged with its
      :class:`~fstier.integrations.lmcache_tasks.Task` (no job table: the
      tier hands the tag back with the result). Each chunk of a load has its
      own result (``JobResult.loaded_after`` past the first miss): a
      missing, short, corrupt or foreign file fails its chunk only (each load
      is checked: size, header, key, namespace, checksum), never a wrong
      byte. A key LMCache's object does not describe (a narrowed object, an
      unknown dtype, a group >= ``MAX_GROUPS``) fails.
    * **Lookup and lock, delete, list, evictions, start-up**
      (:mod:`~fstier.integrations.lmcache_root`): one ``FsTier.present`` batch
      per namespace (the layout hint's, or without one every namespace of the
      key's owner on the root), answered at once; hits are touched (LRU
      recency), which is the lock: a file evicted before its load is a load
      miss. Unlock has nothing to release.
    * **Completion**: each namespace's tier is given LMCache's store and load
      eventfds (``FsTier(notify_fds=...)``): the engine writes the job's
      kind's fd when it finishes (the C engine in C, no Python at
      completion; the Python engine from its I/O thread). LMCache's
      ``pop_completed_store_tasks`` / ``query_load_result`` collect, on its
      own thread, each result returned once. No job table: a job's tag is
      its task (:mod:`~fstier.integrations.lmcache_tasks`). No thread polls.
    * **Capacity**: fstier's ``max_bytes`` and eviction; LMCache is told
      what was stored (files this process wrote, and at start what the root
      holds), accessed (loaded) and deleted (evicted, as each file goes;
      corrupt; or :meth:`~fstier.integrations.lmcache_root.RootOps.delete`)
      through its ``_notify_keys_*`` calls, each with its whole file's bytes
      (fstier's unit), and ``max_bytes`` is the adapter's
      ``max_capacity_bytes``.

Importing :mod:`fstier` never imports LMCache; importing this module does.
Without LMCache, or with a version outside :data:`SUPPORTED_LMCACHE`,
constructing ``FstierL2Adapter`` raises :class:`LmcacheUnavailableError`.
No LMCache call receives an exception from a task: failures are failed
tasks and cleared bits (and log lines).
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import threading
from typing import TYPE_CHECKING, Any

from fstier.integrations._exporter import export_tier, serve_metrics, unexport_tier
from fstier.integrations.lmcache_config import (
    DEFAULT_O_DIRECT,
    SUPPORTED_LMCACHE,
    LmcacheUnavailableError,
    lmcache_version,
    metrics_port_from_adapter_params,
    tier_config_from_adapter_params,
)
from fstier.integrations.lmcache_space import (
    MAX_GROUPS,
    L1Arena,
    Layout,
    LentSlots,
    SpaceId,
    block_keys_of,
    hash_form,
    one_signature,
    space_mapper,
)
from fstier.integrations.lmcache_spaces import DiskIndex, Spaces
from fstier.integrations.lmcache_tasks import Notes, Part, Space, StoreKeys, Task

if TYPE_CHECKING:  # pragma: no cover
    from collections.abc import Sequence

if TYPE_CHECKING:  # pragma: no cover
    from fstier.config import TierConfig

__all__ = [
    "DEFAULT_O_DIRECT",
    "MAX_SPACES",
    "SUPPORTED_LMCACHE",
    "FstierL2Adapter",
    "FstierL2AdapterConfig",
    "LmcacheUnavailableError",
    "check_lmcache",
    "tier_config_from_adapter_params",
]

log = logging.getLogger("fstier.lmcache")

#: Idle namespaces (model x kv_rank x cache_salt x layout) kept open by one
#: adapter; each is one FsTier with its own I/O threads. Beyond it the least
#: recently used idle ones are closed (a namespace with a job in flight,
#: a lookup or a delete is never closed; one found again is reopened).
MAX_SPACES = 64
_RESOLVED_MAX = 4096
_IMPORT_ERROR: BaseException | None = None


def check_lmcache() -> str:
    """The installed LMCache version if ``FstierL2Adapter`` supports it,
    else :class:`LmcacheUnavailableError` naming what is installed."""
    return lmcache_version(_IMPORT_ERROR)


# ------------------------------------------------------------------ adapter
try:
    from lmcache.lmcache_native import Bitmap
    from lmcache.v1.distributed.api import ObjectKey
    from lmcache.v1.distributed.internal_api import L2StoreResult
    from lmcache.v1.distributed.l2_adapters.base import L2AdapterInterface
    from lmcache.v1.distributed.l2_adapters.config import L2AdapterConfigBase
    from lmcache.v1.platform import create_event_notifier

    from fstier.integrations.lmcache_root import RootOps
except Exception as exc:  # LMCache missing or of another layout: fail at construction
    _IMPORT_ERROR = exc

    class FstierL2AdapterConfig:  # type: ignore[no-redef,unused-ignore]
        """Placeholder: LMCache is missing or not importable."""

        @classmethod
        def from_dict(cls, d: dict[str, Any]) -> Any:
            check_lmcache()
            raise LmcacheUnavailableError(str(_IMPORT_ERROR))  # pragma: no cover

    class FstierL2Adapter:  # type: ignore[no-redef,unused-ignore]
        """Placeholder: LMCache is missing or not importable; constructing says so."""

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            check_lmcache()
            raise LmcacheUnavailableError(str(_IMPORT_ERROR))  # pragma: no cover

else:

    class FstierL2AdapterConfig(L2AdapterConfigBase):  # type: ignore[no-redef,misc,unused-ignore]
        """``adapter_params`` parsed (LMCache's plugin loader finds this class
        by name and calls :meth:`from_dict`)."""

        def __init__(self, tier: TierConfig, metrics_port: int | None = None) -> None:
            self.tier = tier
            #: fstier's own Prometheus exporter's port (None: none started)
            self.metrics_port = metrics_port

        @classmethod
        def from_dict(cls, d: dict[str, Any]) -> FstierL2AdapterConfig:
            check_lmcache()
            return cls(tier_config_from_adapter_params(d), metrics_port_from_adapter_params(d))

        @classmethod
        def help(cls) -> str:
            return (
                "fstier L2 adapter (adapter_params): root_dir (required), config (an fstier "
                "YAML with a tier: section), any fstier tier field (max_bytes, checksum, "
                "read_threads, write_threads, ...), metrics_port (serve fstier's Prometheus "
                "metrics); see docs/lmcache.md"
            )

    class FstierL2Adapter(RootOps, L2AdapterInterface):  # type: ignore[no-redef,misc,unused-ignore]
        """fstier as an LMCache L2 adapter (see the module docstring)."""

        def __init__(self, config: Any, l1_memory_desc: Any = None) -> None:
            check_lmcache()
            if not isinstance(config, FstierL2AdapterConfig):
                config = FstierL2AdapterConfig.from_dict(config)
            self.tier_config: TierConfig = config.tier
            self._metrics_port = serve_metrics(config.metrics_port, "FstierL2Adapter")
            super().__init__(max_capacity_bytes=config.tier.max_bytes or 0)
            self._efd = {k: create_event_notifier() for k in ("store", "lookup", "load")}
            self._reg = Spaces(self._open_space, self._closed_space, MAX_SPACES)
            self._index = DiskIndex(self.tier_config)
            self._root = str(self.tier_config.root_dir)
            #: (model, kv_rank, salt, hash form, group ok, value signature) -> namespace:
            #: a task's keys resolve with one dict lookup each (see _resolve)
            self._resolved: dict[tuple[Any, ...], Space | None] = {}
            #: submits, collections and the results waiting for LMCache (no job table:
            #: a job's tag is its task, or a Part naming it)
            self._collect_lock = threading.Lock()
            self._ids = itertools.count()
            self._in_flight = 0  # tasks submitted, not yet complete
            self._store_keys = StoreKeys()  # a stored event's own LMCache keys
            self._done_store: dict[int, Any] = {}
            self._done_load: dict[int, Any] = {}
            self._lock = threading.Lock()  # lookup results (RootOps)
            self._done_lookup: dict[int, Any] = {}
            self._closed = False
            self._efd_closed = False
            self._arena = L1Arena.of(l1_memory_desc)
            #: what was on disk at start, told to each listener as it registers
            self._seed: tuple[list[Any], list[int]] = ([], [])
            self._seed_lock = threading.Lock()
            self._seed_from_disk()
            log.info(
                "fstier: LMCache L2 adapter at %s (%d chunk file(s) found, %d bytes)",
                self.tier_config.root_dir, len(self._seed[0]), sum(self._seed[1]),
            )

        # -- event fds ----------------------------------------------------
        def get_store_event_fd(self) -> int:
            return int(self._efd["store"].fileno())

        def get_lookup_and_lock_event_fd(self) -> int:
            return int(self._efd["lookup"].fileno())

        def get_load_event_fd(self) -> int:
            return int(self._efd["load"].fileno())

        def _signal(self, kind: str) -> None:
            """Wake LMCache's controller for a task no job of which ran (a job's
            completion writes the fd from the engine: ``FsTier(notify_fds=...)``).
            Never after close: the fd number may name another file by then."""
            if self._efd_closed:
                return
            with contextlib.suppress(OSError, ValueError):
                self._efd[kind].notify()

        # -- namespaces ---------------------------------------------------
        def _space(self, key: Any, layout: Layout | None) -> Space | None:
            """The open namespace of ``key`` under ``layout`` (opened on first use)."""
            if layout is None or not 0 <= int(key.object_group_id) < MAX_GROUPS:
                return None
            return self._reg.get(SpaceId.of(key, layout))

        def _open_space(self, sid: SpaceId) -> Space | None:
            """Open ``sid``'s namespace (:class:`Spaces` calls it under its lock)."""
            from fstier.manager import FsTier

            slots = LentSlots(sid.layout.nbytes)
            try:
                mapper = space_mapper(sid, self.tier_config)
                tier = FsTier(
                    self.tier_config, slots, mapper, hold_fenced_results=True, on_evicted=self._evicted,
                    notify_fds={k: self._efd[k].fileno() for k in ("store", "load")},
                )
            except Exception:
                log.exception("fstier: cannot open the LMCache namespace of %s", sid)
                return None
            log.info(
                "fstier: LMCache namespace %s (%s, kv_rank %#x, %s, %d bytes per chunk)",
                mapper.namespace, sid.model_name, sid.kv_rank,
                "MLA" if sid.layout.mla else "MHA", sid.layout.nbytes,
            )
            export_tier(tier, self._metrics_port)
            return Space(sid, tier, slots)

        def _closed_space(self, space: Space) -> None:
            """A namespace left the open set (:class:`Spaces`' closer thread):
            close its tier and tell LMCache what its last events say."""
            self._resolved.clear()
            unexport_tier(space.tier)
            space.tier.close()
            notes = Notes()
            for ev in space.tier.take_events():
                notes.add(space, ev, ObjectKey, StoreKeys())
            notes.tell(self)

        def _open_spaces(self) -> list[Space]:
            return self._reg.all()

        def _resolve(self, key: Any, obj: Any) -> Space | None:
            """:meth:`_space` of ``key`` under ``obj``'s layout, memoised by
            what decides it (the key's model, rank, salt and group range, and
            the object's shapes, dtypes and size): a mixed task's keys cost
            one dict lookup each, not a layout parse and a namespace hash
            (test_lmcache_adapter.py::
            test_a_task_of_mixed_layouts_and_ranks_splits_by_namespace); a
            uniform task asks once (:meth:`_task_space`)."""
            meta = obj.meta  # not the ``metadata`` property (its lock): see lmcache_space's _META
            shapes, dtypes = meta.shapes, meta.dtypes
            sig = (
                key.model_name, key.kv_rank, key.cache_salt, hash_form(len(key.chunk_hash)),
                0 <= key.object_group_id < MAX_GROUPS, meta.shape, meta.dtype,
                tuple(shapes) if shapes else None, tuple(dtypes) if dtypes else None, obj.get_size(),
            )
            try:
                return self._resolved[sig]
            except KeyError:
                pass
            space = self._space(key, Layout.of_object(obj))
            if space is not None or self._closed:
                # Not a namespace that failed to open for a moment: remember
                # it (the memo is cleared when it grows past a bound).
                if len(self._resolved) >= _RESOLVED_MAX:
                    self._resolved.clear()
                self._resolved[sig] = space
            return space

        def _task_space(self, keys: list[Any], objects: list[Any]) -> tuple[Space | None, Any] | None:
            """:meth:`_resolve`'s one answer for a task of one signature
            (:func:`one_signature`: every key's memo signature is the first
            key's), asked once, with the keys' hashes and groups as it read
            them (for :func:`block_keys_of`); None: resolve key by key
            (test_lmcache_fast_paths.py pins both against each other)."""
            read = one_signature(keys, objects)
            return None if read is None else (self._resolve(keys[0], objects[0]), read)

        # -- store / load ---------------------------------------------------
        def _submit(self, kind: str, keys: list[Any], objects: list[Any]) -> int:
            task = Task(next(self._ids), kind, len(keys))
            jobs: list[tuple[Space, Sequence[int], Any]] = []
            try:
                if len(keys) != len(objects):
                    raise ValueError(f"{len(keys)} keys but {len(objects)} objects")
                one = self._task_space(keys, objects)
                if one is not None:  # the common task: one namespace, decided once
                    if one[0] is None:
                        task.failed = True
                    else:
                        jobs.append((one[0], range(len(keys)), one[1]))
                else:
                    parts: dict[Space, list[int]] = {}
                    resolve = self._resolve
                    for i, (k, o) in enumerate(zip(keys, objects, strict=True)):
                        space = resolve(k, o)
                        if space is None:
                            task.failed = True
                        else:
                            parts.setdefault(space, []).append(i)
                    jobs = [(space, positions, None) for space, positions in parts.items()]
            except Exception:
                log.exception("fstier: LMCache %s task of %d key(s) refused", kind, len(keys))
                task.failed, jobs = True, []
            # FsTier reaps finished jobs on submit too: the tiers are submitted
            # to under the collect lock, so a reap and the publication of
            # what it took are never split by a collection (a caller woken by
            # a job's eventfd write then always finds its result:
            # test_lmcache_adapter.py::test_results_reaped_by_a_submit_are_found).
            with self._collect_lock:
                self._in_flight += 1
                task.pending = len(jobs)
                for space, positions, read in jobs:
                    self._submit_job(task, space, positions, keys, objects, read)
                done = task.pending == 0
                if done:  # no job of it ran: nothing else signals its result
                    self._publish(task, Notes())
            if done:
                self._signal(kind)
            return task.id

        def _submit_job(
            self, task: Task, space: Space, positions: Sequence[int], keys: list[Any], objects: list[Any], read: Any,
        ) -> None:
            """Submit ``task``'s job in ``space`` (collect lock held), tagged
            with the task or a :class:`Part` of it; a refusal fails the task.
            ``read``: the keys' hashes and groups (:func:`one_signature`), or None."""
            kind = task.kind
            slots: list[int] | None = None
            bkeys: list[Any] = []
            pinned = self._reg.acquire(space)  # released with the job's result
            if pinned is None:
                log.error("fstier: LMCache %s of %d chunk(s) refused: namespace not open", kind, len(positions))
                task.refused()
                return
            space = pinned
            try:
                # positions ascend: as many as the keys means all of them
                if len(positions) == len(keys):
                    pkeys, pobjs = list(keys), list(objects)
                else:
                    pkeys = list(map(keys.__getitem__, positions))
                    pobjs = list(map(objects.__getitem__, positions))
                # a load's chunks were mostly just looked up: their block keys are remembered
                bkeys = block_keys_of(pkeys, read) if kind == "store" else space.keys.block_keys(pkeys, read)
                # Every object of a job resolved to this namespace with its
                # layout's size (the memo signature holds get_size()).
                slots = self._arena.lend(space.slots, pobjs)
                if slots is None:
                    raise ValueError("an L1 object is not a writable buffer of its layout's size")
                tag = task.part(space, positions, slots, pkeys, bkeys)
                if kind == "store":
                    self._store_keys.add(bkeys, pkeys)
                    space.tier.submit_store(tag, bkeys, slots)
                else:
                    space.tier.submit_load(tag, bkeys, slots)
            except Exception as exc:
                log.error("fstier: LMCache %s of %d chunk(s) refused: %s", kind, len(positions), exc)
                self._store_keys.forget(bkeys)
                task.refused()
                if slots is not None:
                    space.slots.release(slots)
                self._reg.release(space)

        def _collect_locked(self) -> Notes:
            """Take every tier's finished jobs and events (collect lock held)
            and publish the tasks they complete; what LMCache is to be told
            is returned, to tell once the lock is released. No eventfd is
            written here: each job's completion was signalled already."""
            notes = Notes()
            for space in self._open_spaces():
                try:
                    results = space.tier.get_finished()
                    events = space.tier.take_events(reap=False)  # the jobs just reaped: no second poll
                except Exception:
                    log.exception("fstier: collecting LMCache results failed")
                    continue
                for ev in events:  # before the results: their jobs' keys are still known
                    notes.add(space, ev, ObjectKey, self._store_keys)
                for r in results:
                    part = r.job_id  # the job's tag: its task, or a Part of it
                    if not isinstance(part, Part):  # pragma: no cover - only the adapter submits here
                        continue
                    if r.kind == "store":  # a load's keys were never added
                        self._store_keys.forget(part.bkeys)
                    part.space.slots.release(part.slots)
                    self._reg.release(part.space)
                    if part.task.add(part, r):
                        self._publish(part.task, notes)
            return notes

        def _publish(self, task: Task, notes: Notes) -> None:
            """Make a complete task's result available, returned once (collect lock held)."""
            self._in_flight -= 1
            if task.kind == "store":
                self._done_store[task.id] = L2StoreResult(not task.failed, task.nbytes)
                return
            n, ok = task.n, task.ok
            # positions are distinct (each in one part, once): all n of them is every bit
            if len(ok) == n:
                bits = Bitmap(n, n)
            else:
                bits = Bitmap(n)
                bits.batched_set(ok)
            self._done_load[task.id] = bits
            notes.accessed += task.accessed

        def submit_store_task(self, keys: list[Any], objects: list[Any]) -> int:
            return self._submit("store", keys, objects)

        def pop_completed_store_tasks(self) -> dict[int, Any]:
            with self._collect_lock:
                notes = self._collect_locked()
                out, self._done_store = self._done_store, {}
            notes.tell(self)
            return out

        def submit_load_task(self, keys: list[Any], objects: list[Any]) -> int:
            return self._submit("load", keys, objects)

        def query_load_result(self, task_id: int) -> Any:
            with self._collect_lock:
                notes = self._collect_locked()
                out = self._done_load.pop(task_id, None)
            notes.tell(self)
            return out

        def report_status(self) -> dict[str, Any]:
            spaces = self._open_spaces()
            degraded = [s.tier.mapper.namespace for s in spaces if s.tier.degraded]
            usage = next((s.tier.usage_bytes for s in spaces if s.tier.usage_bytes is not None), None)
            return {
                "is_healthy": not self._closed and not degraded,
                "type": "FstierL2Adapter",
                "root_dir": str(self.tier_config.root_dir),
                "namespaces": [s.tier.mapper.namespace for s in spaces],
                "namespaces_closed_idle": self._reg.evicted,
                "degraded_namespaces": degraded,
                "io_path": spaces[0].tier.io_path.backend if spaces else None,
                "checksum": self.tier_config.checksum,
                "max_bytes": self.tier_config.max_bytes,
                "usage_bytes": usage,
                "tasks_in_flight": self._in_flight,
            }

        def close(self) -> None:
            """Finish in-flight jobs, close every tier and the event fds. Idempotent."""
            with self._collect_lock:
                if self._closed:
                    return
                self._closed = True
            for space in self._reg.close():
                unexport_tier(space.tier)
                try:
                    space.tier.close()
                except Exception:
                    log.exception("fstier: closing %s failed", space.tier.mapper.namespace)
            self._efd_closed = True
            for efd in self._efd.values():
                with contextlib.suppress(OSError):
                    efd.close()
