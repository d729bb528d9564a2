"""One shared usage count per root per process.

Tiers of one process on one root (one per namespace: an LMCache adapter
cycling four namespaces, a worker with several models) each used to hold a
:class:`~fstier.tier.usage.SharedUsage` of their own and learn the others'
stores only from the usage directory's listing, a round of their
``fstier-usage`` thread later: four such tiers peaked at 1.27-1.30x
``max_bytes``. They now hold one count in memory: every tier's admission
sees every other's stores the instant they are admitted (one lock), the
process publishes one count name per root, and one of its tiers runs a
capacity pass at a time (:meth:`~fstier.tier.usage.SharedUsage.evicting`).

Invariants: a root is its directory's ``(st_dev, st_ino)`` (two paths to
one directory share a count; a root replaced by another directory does
not); the key holds the process id (a child of ``fork`` never takes its
parent's count, whose thread it lacks) and the clock (tests' manual clocks
get counts of their own); the first tier's ``file_mode`` names the count's
files; the count is closed when the last tier holding it releases it. A
root that cannot be ``stat``-ed gets a count of its own (what every tier
had before). Costs: one ``stat`` and a dict lookup per tier opened and
closed; nothing on any hot path.
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass
from pathlib import Path

from fstier.clock import Clock
from fstier.tier.usage import SharedUsage

__all__ = ["acquire_count", "release_count"]

_Key = tuple[int, int, int, int]  # (pid, st_dev, st_ino, id(clock))


@dataclass(slots=True)
class _Held:
    usage: SharedUsage
    key: _Key
    tiers: int = 0


_lock = threading.Lock()
_by_key: dict[_Key, _Held] = {}
_by_count: dict[int, _Held] = {}  # id(usage) -> its entry, for release


def _after_fork_in_child() -> None:
    global _lock
    _lock = threading.Lock()  # a thread of the parent may have held it at the fork


os.register_at_fork(after_in_child=_after_fork_in_child)


def acquire_count(root: Path, file_mode: int, clock: Clock) -> SharedUsage:
    """The process's count of ``root`` (made on first use); every call is
    matched by one :func:`release_count`."""
    try:
        st = os.stat(root)
    except OSError:
        return SharedUsage(root, file_mode, clock=clock)
    key = (os.getpid(), st.st_dev, st.st_ino, id(clock))
    with _lock:
        held = _by_key.get(key)
        if held is None:
            held = _by_key[key] = _Held(SharedUsage(root, file_mode, clock=clock), key)
            _by_count[id(held.usage)] = held
        held.tiers += 1
        return held.usage


def release_count(usage: SharedUsage) -> None:
    """One tier is done with ``usage``: the last one closes it (its final
    count is published; other instances keep it)."""
    with _lock:
        held = _by_count.get(id(usage))
        if held is not None and held.usage is usage:
            held.tiers -= 1
            if held.tiers > 0:
                return
            del _by_key[held.key]
            del _by_count[id(usage)]
    usage.close()
