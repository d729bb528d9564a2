"""An asyncio facade over a :class:`~fstier.io.blockstore.BlockStore`:
``await io.store(items)``, ``load``, ``present``, ``read_manifest``.

The block I/O runs on the process's job engine (:mod:`fstier.io.engine`),
the one every :class:`~fstier.manager.FsTier` of the same thread counts
uses: an :class:`AsyncBlockIO` is a registration with it, not threads of
its own. ``store`` and ``load`` are ONE engine job each (the caller's
buffers lent by index, its keys' paths named once): on the native path one
GIL-free call, on the Python path one key per unit. The job's tag is the
awaiting future itself, so no table maps jobs to waiters: the engine's
completion hands each finished job to its future's loop with
``loop.call_soon_threadsafe`` and the loop never blocks on a system call.
``present`` is a probe job (the engine's probe queue, taken before queued
reads and writes), awaited at most the deadline.

The namespace manifest is read with ``asyncio.to_thread`` through the one
hardened manifest reader (:mod:`fstier.io.manifest`: no symlinks, no blocking on
a FIFO, size-capped); aiofiles, which opens by path and follows symlinks,
is not used for it. Nor for blocks: ``benchmarks/bench_io.py`` compares an
aiofiles-only block path with this engine path; the engine path stores faster
and reads with O_DIRECT into the caller's slot with no extra copy
(aiofiles' read allocates and copies), see docs/performance.md.

Invariants
    One outcome per item, in order. A unit the engine gave up on (past
    ``io_timeout_s``, or never run) makes its keys' outcomes failures
    (``ETIMEDOUT``, ``cancelled``); its buffer may still be written by the
    late call until it returns (nothing fences a caller's own buffer).

Costs
    Per call: one engine job (one record), one thread hand-off back to the loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Sequence
from typing import Any

from fstier.io.blockstore import BlockStore
from fstier.io.engine import CANCELLED, EXPIRED, TIMED_OUT, EngineJob, shared_engine
from fstier.io.iotypes import LoadOutcome, LoadStatus, StoreOutcome, StoreStatus
from fstier.keys import BlockKey

__all__ = ["AsyncBlockIO"]


def _set_result(fut: asyncio.Future[Any], value: Any) -> None:
    if not fut.done():  # the awaiting task may have been cancelled
        fut.set_result(value)


def _hand_back(fut: asyncio.Future[Any], value: Any) -> None:
    """Complete ``fut`` on its own loop, from an engine thread."""
    with contextlib.suppress(RuntimeError):  # the loop closed while the job ran; nobody awaits it
        fut.get_loop().call_soon_threadsafe(_set_result, fut, value)


def _failure_cause(result: Any) -> tuple[str, str]:
    if result is TIMED_OUT:
        return "ETIMEDOUT", "I/O op exceeded io_timeout_s; its buffer stays in use until it returns"
    if result is EXPIRED:
        return "ETIMEDOUT", "I/O op still queued io_timeout_s after its job was submitted; it never ran"
    if result is CANCELLED:
        return "cancelled", "I/O engine shut down before the op ran"
    return type(result).__name__, str(result)


class _Lent:
    """A job's buffers: the caller's own views, slot ``i`` being item ``i``
    (:class:`~fstier.io.engine.record.Buffers`)."""

    __slots__ = ("_views",)

    def __init__(self, views: list[memoryview]) -> None:
        self._views = views

    def views(self, slots: Sequence[int], nbytes: Sequence[int]) -> list[memoryview]:
        v = self._views
        return [v[s] for s in slots]


class AsyncBlockIO:
    """Async store/load/presence of ``blocks``' files on the process's job
    engine of ``read_threads`` read- and ``write_threads`` write-priority
    threads (shared with every tier and facade of the same counts; pass a
    tier's ``read_threads``/``write_threads`` to share its engine). Each job
    ends by ``io_timeout_s`` after submission (None: no deadline).
    :meth:`aclose` leaves the engine (its last registration stops it)."""

    def __init__(
        self,
        blocks: BlockStore,
        *,
        read_threads: int = 4,
        write_threads: int = 2,
        io_timeout_s: float | None = 30.0,
    ) -> None:
        if io_timeout_s is not None and not (0 < io_timeout_s <= threading.TIMEOUT_MAX):
            raise ValueError(
                f"AsyncBlockIO io_timeout_s must be > 0 and finite (or None for no deadline), got {io_timeout_s}"
            )
        self.blocks = blocks
        self.io_timeout_s = io_timeout_s
        self.engine = shared_engine(read_threads, write_threads, on_complete=self._completed)

    def _completed(self, _kind: str) -> None:
        """The engine's completion (an engine thread): each finished job to its future."""
        for job in self.engine.collect():
            _hand_back(job.tag, job)  # type: ignore[arg-type]  # the tag is the awaiting future (_run)

    async def _run(self, kind: str, items: Sequence[tuple[BlockKey, memoryview]], replace: Any = None) -> list[Any]:
        """One engine job of ``items``; per item its outcome, or the marker or exception of its unit."""
        fut: asyncio.Future[EngineJob] = asyncio.get_running_loop().create_future()
        keys = tuple(k for k, _ in items)
        views = [v for _, v in items]
        job = EngineJob(
            fut, "store" if kind == "store" else "load", keys, tuple(range(len(items))), tuple(map(len, views)),
            self.blocks, _Lent(views), self.blocks.paths(keys), replace, self.io_timeout_s,
        )
        self.engine.submit(job)
        done = await fut
        out: list[Any] = []
        for u, r in enumerate(done.results):
            span = done.bounds[u + 1] - done.bounds[u]
            out.extend(r if isinstance(r, list) else [r] * span)
        return out

    async def store(
        self, items: Sequence[tuple[BlockKey, memoryview]], *, replace: Sequence[bool] | None = None
    ) -> list[StoreOutcome]:
        """Store every ``(key, payload)`` (exactly the payload's bytes) in
        parallel; one outcome per item, in order."""
        if not items:
            return []
        flags = list(replace) if replace is not None and any(replace) else None
        out: list[StoreOutcome] = []
        for r in await self._run("store", items, flags):
            out.append(r if isinstance(r, StoreOutcome) else StoreOutcome(StoreStatus.FAILED, *_failure_cause(r)))
        return out

    async def load(self, items: Sequence[tuple[BlockKey, memoryview]]) -> list[LoadOutcome]:
        """Load every ``(key, buffer)`` in parallel (each buffer exactly the
        payload length expected); one outcome per item, in order. Only a
        LOADED buffer holds verified bytes."""
        if not items:
            return []
        out: list[LoadOutcome] = []
        for r in await self._run("load", items):
            out.append(r if isinstance(r, LoadOutcome) else LoadOutcome(LoadStatus.ERROR, *_failure_cause(r)))
        return out

    async def present(self, keys: Sequence[BlockKey]) -> list[bool]:
        """Per key, whether its block file is present
        (:meth:`~fstier.io.blockstore.BlockStore.present_many`, one batch,
        a probe job of the engine, off the loop); a key whose check failed,
        or did not answer within ``io_timeout_s``, is absent."""
        fut: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        blocks = self.blocks

        def probe() -> None:
            try:
                found: Any = blocks.present_many(keys)
            except Exception as exc:  # a failed check: every key absent
                found = exc
            _hand_back(fut, found)

        self.engine.submit(EngineJob(("aio", "present"), "probe", call=probe, timeout_s=self.io_timeout_s))
        try:
            r = await asyncio.wait_for(fut, self.io_timeout_s)
        except asyncio.TimeoutError:
            return [False] * len(keys)
        return r if isinstance(r, list) else [False] * len(keys)

    async def read_manifest(self) -> dict[str, Any] | None:
        """The namespace's ``config.json`` as a dict, or None when absent.

        Read off the loop like every manifest read (:mod:`fstier.io.manifest`):
        no symlink followed, non-blocking (a FIFO cannot hang it), regular
        files only, size-capped, depth-checked JSON; anything else raises
        :class:`~fstier.errors.NamespaceMismatchError` naming the path."""
        from fstier.file_mapper import MANIFEST_NAME
        from fstier.io.manifest import parse_json_object, read_manifest_bytes

        path = self.blocks.mapper.namespace_dir / MANIFEST_NAME
        raw = await asyncio.to_thread(read_manifest_bytes, path)
        if raw is None:
            return None
        return parse_json_object(path, raw)

    async def aclose(self) -> None:
        """Leave the engine: jobs not started are cancelled; the last
        registration to leave stops its threads. Idempotent."""
        await asyncio.to_thread(self.engine.close)

    async def __aenter__(self) -> AsyncBlockIO:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()
