"""Which other instances on a root are alive, judged by this reader's own clock.

Every instance publishes a new generation of its usage count at least every
:data:`HEARTBEAT_S` (:mod:`fstier.tier.usage`). A reader notes, per other
instance, when its generation (for fstier < 0.6's count files, the file's
mtime) last moved by the reader's own monotonic clock, never by anything the
writer's clock put in a name or a file:

- an instance whose generation has not moved for :data:`STALE_S` is gone
  (:meth:`Liveness.saw` returns it; the reader removes its names, its last
  value stays in the reader's sum);
- one whose generation moved within two heartbeats is live
  (:meth:`Liveness.live`: the ``fstier_root_instances`` gauge, and
  admission's estimate of stores not listed yet, :mod:`fstier.tier.unseen`).

Costs: a dict lookup per instance per listing, a pass over the instances per
:meth:`Liveness.live`; an unlink per name of a gone instance or leftover
(:meth:`Liveness.remove_gone`). Not locked: the caller (the usage count)
holds its lock, except for :meth:`Liveness.remove_gone` (its I/O lock).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterable, Mapping, Sequence

__all__ = ["HEARTBEAT_S", "STALE_S", "Liveness"]

#: Publish a new generation this often even when unchanged (others judge liveness by it).
HEARTBEAT_S = 30.0
#: An instance whose generation has not moved for this long (the reader's time) is gone.
STALE_S = 3600.0


class Liveness:
    """Per other instance: its last generation and when it moved."""

    def __init__(self) -> None:
        self._seen: dict[str, tuple[int, float]] = {}

    def saw(self, beats: Mapping[str, int], now: float) -> list[str]:
        """Note each instance's generation as one listing shows it; return
        the instances whose generation has not moved for :data:`STALE_S`."""
        gone = []
        for inst, beat in beats.items():
            last = self._seen.get(inst)
            if last is None or last[0] != beat:
                self._seen[inst] = (beat, now)
            elif now - last[1] > STALE_S:
                gone.append(inst)
        return gone

    def forget(self, inst: str) -> None:
        self._seen.pop(inst, None)

    def remove_gone(
        self,
        dfd: int,
        dead: Iterable[str],
        files: Mapping[str, Iterable[str]],
        leftovers: Mapping[str, float],
        listed_leftovers: Sequence[str],
        now: float,
    ) -> dict[str, float]:
        """Unlink (in the usage directory ``dfd``) the names of every ``dead``
        instance (:meth:`saw`; forgotten here: its last value stays in the
        reader's view, a delta of zero from now on) and every leftover name
        first seen :data:`STALE_S` ago (its maker is gone). Returns when each
        leftover listed now was first seen (``leftovers``: the last listing's)."""
        seen_now = {name: leftovers.get(name, now) for name in listed_leftovers[:1000]}
        for name, first in seen_now.items():
            if now - first > STALE_S:
                with contextlib.suppress(OSError):
                    os.unlink(name, dir_fd=dfd)
        for inst in dead:
            self.forget(inst)
            for name in files.get(inst, ()):
                with contextlib.suppress(OSError):
                    os.unlink(name, dir_fd=dfd)
        return seen_now

    def live(self, now: float) -> list[str]:
        """The other instances whose generations moved within two heartbeats."""
        return [inst for inst, (_, moved) in list(self._seen.items()) if now - moved <= 2 * HEARTBEAT_S]
