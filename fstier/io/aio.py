"""An asyncio facade over the I/O pool: ``await io.store(reqs)``, ``load``, ``exists``.

The block I/O itself runs on :class:`~fstier.io.pool.IOPool` threads, exactly
the code path :class:`~fstier.manager.FsTier` uses, and each pool job's
completion is handed back to the event loop with
``loop.call_soon_threadsafe``: the loop never blocks on a system call. The
operations of one call run in parallel across the pool's threads.

The namespace manifest is read with ``asyncio.to_thread`` through the one
hardened manifest reader (:mod:`fstier.io.manifest`: no symlinks, no blocking on
a FIFO, size-capped); aiofiles, which opens by path and follows symlinks,
is not used for it. Nor for blocks: ``benchmarks/bench_io.py`` compares an
aiofiles-only block path with this pool path; the pool path stores faster
and reads with O_DIRECT into the caller's slot with no extra copy
(aiofiles' read allocates and copies), see docs/performance.md.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
from collections.abc import Callable, Sequence
from functools import partial
from pathlib import Path
from typing import Any

from fstier.io import fsops
from fstier.io.blockstore import (
    BatchLoadResult,
    IOOptions,
    LoadOutcome,
    LoadRequest,
    LoadStatus,
    StoreOutcome,
    StoreRequest,
    StoreStatus,
    load_block,
    store_block,
)
from fstier.io.pool import OP_CANCELLED, OP_TIMED_OUT, IOPool, PoolJob

__all__ = ["AsyncBlockIO"]


def _set_result(fut: asyncio.Future[PoolJob], job: PoolJob) -> None:
    if not fut.done():  # the awaiting task may have been cancelled
        fut.set_result(job)


def _failure_cause(result: Any) -> tuple[str, str]:
    if result is OP_TIMED_OUT:
        return "ETIMEDOUT", "I/O op exceeded io_timeout_s; its buffer stays in use until it returns"
    if result is OP_CANCELLED:
        return "cancelled", "I/O pool shut down before the op ran"
    return type(result).__name__, str(result)


class AsyncBlockIO:
    """Async store/load/exists of block files on an :class:`IOPool`.

    Pass a ``pool`` to share one with an ``FsTier``; otherwise a private pool
    with ``read_threads``/``write_threads`` is created and closed by
    :meth:`aclose`.
    """

    def __init__(
        self,
        pool: IOPool | None = None,
        opts: IOOptions | None = None,
        *,
        read_threads: int = 4,
        write_threads: int = 2,
        io_timeout_s: float | None = 30.0,
    ) -> None:
        self._owns_pool = pool is None
        self.pool = pool if pool is not None else IOPool(read_threads, write_threads, io_timeout_s)
        self.opts = opts if opts is not None else IOOptions()
        self._ids = itertools.count()

    async def _run(self, kind: str, ops: Sequence[Callable[[], Any]]) -> PoolJob:
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[PoolJob] = loop.create_future()

        def done(job: PoolJob) -> None:
            # RuntimeError: the loop closed while the job ran; nobody awaits it.
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(_set_result, fut, job)

        self.pool.submit(("aio", next(self._ids)), kind, ops, on_done=done)
        return await fut

    async def store(self, reqs: Sequence[StoreRequest]) -> list[StoreOutcome]:
        """Store every request in parallel; one outcome per request."""
        opts = self.opts
        job = await self._run("write", [partial(store_block, r, opts) for r in reqs])
        out: list[StoreOutcome] = []
        for r in job.results:
            if isinstance(r, StoreOutcome):
                out.append(r)
            else:
                cause, detail = _failure_cause(r)
                out.append(StoreOutcome(StoreStatus.FAILED, cause, detail))
        return out

    async def load(self, reqs: Sequence[LoadRequest]) -> BatchLoadResult:
        """Load every request in parallel; ``num_loaded`` counts the leading
        blocks that verified (a prefix hit, as an engine wants it)."""
        opts = self.opts
        job = await self._run("read", [partial(load_block, r, opts) for r in reqs])
        outcomes: list[LoadOutcome] = []
        for r in job.results:
            if isinstance(r, LoadOutcome):
                outcomes.append(r)
            else:
                cause, detail = _failure_cause(r)
                outcomes.append(LoadOutcome(LoadStatus.ERROR, cause, detail))
        num = 0
        while num < len(outcomes) and outcomes[num].ok:
            num += 1
        return BatchLoadResult(num, outcomes)

    async def exists(self, paths: Sequence[str | Path]) -> list[bool]:
        """Whether each path holds a regular file (an lstat, off the loop)."""

        def probe(p: str | Path) -> bool:
            try:
                return fsops.FS.lstat(p).st_mode & 0o170000 == 0o100000
            except OSError:
                return False

        job = await self._run("read", [partial(probe, p) for p in paths])
        return [r is True for r in job.results]

    async def read_manifest(self, namespace_dir: str | Path) -> dict[str, Any] | None:
        """The namespace's ``config.json`` as a dict, or None when absent.

        Read off the loop like every manifest read (:mod:`fstier.io.manifest`):
        no symlink followed, non-blocking (a FIFO cannot hang it), regular
        files only, size-capped, depth-checked JSON; anything else raises
        :class:`~fstier.errors.NamespaceMismatchError` naming the path."""
        from fstier.file_mapper import MANIFEST_NAME
        from fstier.io.manifest import parse_json_object, read_manifest_bytes

        path = Path(namespace_dir) / MANIFEST_NAME
        raw = await asyncio.to_thread(read_manifest_bytes, path)
        if raw is None:
            return None
        return parse_json_object(path, raw)

    async def aclose(self) -> None:
        """Shut the private pool down (a shared pool is left to its owner)."""
        if self._owns_pool:
            await asyncio.to_thread(self.pool.shutdown)

    async def __aenter__(self) -> AsyncBlockIO:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()
