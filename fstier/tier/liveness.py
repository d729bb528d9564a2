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
  (:meth:`Liveness.live`: the ``fstier_root_instances`` gauge).

Costs: a dict lookup per instance per listing, a pass over the instances per
:meth:`Liveness.live`. Not locked: the caller (the usage count) holds its lock.
"""

from __future__ import annotations

from collections.abc import Mapping

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

    def live(self, now: float) -> int:
        """How many other instances' generations moved within two heartbeats."""
        return sum(now - moved <= 2 * HEARTBEAT_S for _, moved in self._seen.values())
