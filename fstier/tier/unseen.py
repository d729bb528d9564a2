"""The bytes other instances stored that this one has not seen yet.

Another instance's stores reach this instance's view of the shared count
(:mod:`fstier.tier.usage`) only once that instance published its count and
this one listed it: a round of each ``fstier-usage`` thread, longer on a
loaded host or a slow mount. Five writer processes on one root peaked at
1.11-1.17x ``max_bytes`` on a loaded 2-core VM, each admitting jobs against
a view that lacked the others' latest. Admission counts an estimate of those
bytes on top of the view (:meth:`StoreRates.unseen`): every other
instance's store rate over its last ``WINDOW_S`` of listings, times how
long ago this instance last listed plus one usual round, at most
``MAX_LAG_S``.

A rate is known only once two listings saw an instance's count move, and
drops to 0 when it stops: an instance that starts storing (every host of a
deployment started at once, or one idle until now) is not seen storing for
a round of each side, and on a slow mount two hosts each filled their
whole watermark in that time (1.71x ``max_bytes`` on GlusterFS, CI). So a
**live** instance (:mod:`fstier.tier.liveness`) counts at least what this
instance stored since its listing before the last (about the rounds a
store takes to reach the others): while this one stores, any other may
store as much, unseen. It needs no rate, so it holds from the first store.
An idle instance counts nothing of that kind for the others, and a lone
writer pays, per live idle peer, one such slice of headroom (a few
milliseconds' stores on a local disk).

Invariants: the estimate only makes admission stricter (the usage reported
is the view alone); an instance that stops storing counts 0 within one
window, for a reader that stored nothing over its last two listings;
without other instances it is 0.
Costs: a few float operations per instance per listing, one sum per
admission check, under the count's lock.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping

__all__ = ["MAX_LAG_S", "WINDOW_S", "StoreRates"]

#: A store rate is measured over at least this long of listings.
WINDOW_S = 0.05
#: The lag counted is at most this (a hung mount: no listing for long).
MAX_LAG_S = 2.0
_ALPHA = 0.3  # weight of the newest interval in the usual round


class StoreRates:
    """Other instances' store rates, from the counts each listing saw."""

    def __init__(self) -> None:
        self._anchor: dict[str, tuple[int, float]] = {}  # stored bytes and when, a window's start
        self._rate: dict[str, float] = {}  # bytes/s over the last full window
        self._live: frozenset[str] = frozenset()  # other instances alive at the last listing
        self._own = (0, 0)  # this instance's stored bytes at the listing before the last, and the last
        self._listed_at: float | None = None
        self._round: float | None = None  # the usual time between two listings

    def listed(
        self, stored: Mapping[str, int], now: float, own: int = 0, live: Collection[str] = ()
    ) -> None:
        """A listing at ``now`` saw each other instance's ``stored`` bytes;
        this instance had stored ``own``; ``live`` names the other instances
        alive now."""
        for inst in [i for i in self._anchor if i not in stored]:
            del self._anchor[inst]
            self._rate.pop(inst, None)
        for inst, nbytes in stored.items():
            anchor = self._anchor.get(inst)
            if anchor is None:
                self._anchor[inst] = (nbytes, now)
            elif now - anchor[1] >= WINDOW_S:
                self._rate[inst] = max(0, nbytes - anchor[0]) / (now - anchor[1])
                self._anchor[inst] = (nbytes, now)
        self._live = frozenset(i for i in live if i in stored)
        self._own = (self._own[1], own)
        if self._listed_at is not None:
            interval = max(0.0, now - self._listed_at)
            self._round = interval if self._round is None else (1 - _ALPHA) * self._round + _ALPHA * interval
        self._listed_at = now

    def unseen(self, now: float, own: int = 0) -> int:
        """Estimated bytes the others stored since what the last listing saw
        (``own``: this instance's stored bytes now)."""
        if self._listed_at is None:
            return 0
        lag = min(MAX_LAG_S, max(0.0, now - self._listed_at) + (self._round or 0.0))
        mine = max(0, own - self._own[0])  # what a live other may have stored unseen as well
        total = sum(r * lag for i, r in self._rate.items() if i not in self._live)
        return int(total + sum(max(mine, self._rate.get(i, 0.0) * lag) for i in self._live))
