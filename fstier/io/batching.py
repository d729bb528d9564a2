"""How a block job is cut into native calls, and how many threads each runs.

One owner for the numbers :class:`~fstier.io.blockstore.BlockStore` answers
with (``batch_plan``, ``batch_bounds``) and uses for its native calls:

- A job on the native backend is ONE call into ``fstier.io._native``, moved by ``min(threads, n //
  NATIVE_MIN_BATCH)`` threads (at least one): the calling I/O thread and C
  helper threads started inside the call and joined before it returns.
  Each Python call is a pool op, a thread wake-up and a GIL hand-off; one
  per job instead of one per I/O thread (32 warm 256 KiB chunks of an
  LMCache task: 8 calls cost ~0.9 ms more than one).
- Which helpers start at once (:func:`load_eager`): a buffered load of
  cached files only copies and hashes, so it uses no more threads than the
  process has CPUs (8 threads on 2 CPUs loaded cached 256 KiB files 25%
  slower than 2); its further helpers start as reads would block
  (``RWF_NOWAIT`` in the C code), so cold files still get every spare
  thread's read in flight. Direct loads and every store start all of them
  (a write cannot ask whether it would block; through LMCache's adapter,
  32 buffered 256 KiB stores ran 9-15% faster with 7 helpers than with 1,
  at the same CPU per GB).
- The Python backend: one key per op (each key its own deadline), no
  helpers.

Costs: arithmetic only; :data:`CPUS` is read once at import.
"""

from __future__ import annotations

import os

from fstier.io.iotypes import IOOptions

__all__ = [
    "CPUS",
    "NATIVE_MIN_BATCH",
    "bounds",
    "load_eager",
    "plan",
]

#: Keys per native thread at least (a job is spread across threads, but not
#: into shares smaller than this: each costs a thread start or a call).
NATIVE_MIN_BATCH = 4

#: CPUs this process may run on: how many threads a batch that only copies
#: and hashes can keep busy.
CPUS = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def plan(n: int, threads: int, batched: bool) -> tuple[tuple[int, ...], int]:
    """``(bounds, helpers)`` for ``n`` keys and ``threads`` threads: batch
    ``j`` is keys ``[bounds[j], bounds[j + 1])``, one call each, with up to
    ``helpers`` C helper threads inside it (``batched``: the native backend,
    one batch of every key; else one key per batch and no helpers)."""
    if not batched:
        return tuple(range(n + 1)), 0
    return (0, n), max(1, min(threads, n // NATIVE_MIN_BATCH)) - 1


def bounds(n: int, threads: int, batched: bool) -> tuple[int, ...]:
    """One call per thread (no helpers): at most ``threads`` near-equal
    batches of at least :data:`NATIVE_MIN_BATCH` keys; Python: one key each."""
    if not batched:
        return tuple(range(n + 1))
    parts = max(1, min(threads, n // NATIVE_MIN_BATCH))
    return tuple(n * j // parts for j in range(parts + 1))


def load_eager(helpers: int, opts: IOOptions) -> int:
    """The helpers a native load call starts at once (the rest of
    ``helpers`` start as reads would block): all for direct I/O (every read
    goes to the device), else one thread per CPU."""
    return helpers if opts.o_direct else max(0, min(helpers, CPUS - 1))
