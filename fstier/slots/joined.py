"""JoinedSlots: the slots of several providers of one slot size, end to end.

An engine adapter that lends FsTier an engine's rows in place and also
needs a few rows of its own (SGLang's legacy calls stage flat page tensors
through fstier-owned scratch rows) hands FsTier one provider: the joined
slot ``i`` is slot ``i - start(k)`` of the provider ``k`` whose range holds
it, where each provider's range starts after the previous one's
``num_slots``. Routing costs one binary search over the providers per slot
(a batch of one provider's slots: two, :meth:`JoinedSlots.slot_views`);
this class holds no state of its own: fencing, and which slots a job may
use, are each provider's.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from itertools import repeat
from operator import sub

from fstier.slots.provider import SlotProvider, plain_indices, slot_views

__all__ = ["JoinedSlots"]


class JoinedSlots:
    """A :class:`~fstier.slots.SlotProvider` made of ``providers`` (at least
    one, every one with the same ``slot_bytes``), their slots numbered one
    after another."""

    def __init__(self, *providers: SlotProvider) -> None:
        if not providers:
            raise ValueError("JoinedSlots: give at least one slot provider")
        sizes = sorted({int(p.slot_bytes) for p in providers})
        if len(sizes) != 1:
            raise ValueError(
                f"JoinedSlots: every provider must have the same slot_bytes, got {sizes}"
            )
        self.providers: tuple[SlotProvider, ...] = providers
        self._slot_bytes = sizes[0]
        self._starts: list[int] = []
        n = 0
        for p in providers:
            self._starts.append(n)
            n += int(p.num_slots)
        self._n = n

    @property
    def num_slots(self) -> int:
        return self._n

    @property
    def slot_bytes(self) -> int:
        return self._slot_bytes

    def start_of(self, k: int) -> int:
        """The joined index of provider ``k``'s slot 0."""
        return self._starts[k]

    def _route(self, i: int) -> tuple[SlotProvider, int]:
        k = bisect.bisect_right(self._starts, i) - 1
        return self.providers[k], i - self._starts[k]

    def slot_view(self, i: int) -> memoryview:
        p, j = self._route(i)
        return p.slot_view(j)

    def slot_views(self, slots: Sequence[int]) -> list[memoryview]:
        """:meth:`slot_view` of each of ``slots``: slots all of one provider
        (the common job) are that provider's batch
        (:func:`~fstier.slots.provider.slot_views`), anything else slot by slot."""
        if slots and plain_indices(slots, self._n):
            k = bisect.bisect_right(self._starts, min(slots)) - 1
            if bisect.bisect_right(self._starts, max(slots)) - 1 == k:
                return slot_views(self.providers[k], list(map(sub, slots, repeat(self._starts[k]))))
        return list(map(self.slot_view, slots))

    def check_slots(self, slots: Sequence[int]) -> None:
        for s in slots:
            if isinstance(s, bool) or not isinstance(s, int) or not 0 <= s < self._n:
                raise ValueError(f"slot {s!r} is not a slot index in 0..{self._n - 1}")
            p, j = self._route(s)
            try:
                p.check_slots([j])
            except ValueError as exc:
                raise ValueError(f"slot {s} (its provider's slot {j}): {exc}") from None

    def fence(self, i: int) -> None:
        p, j = self._route(i)
        p.fence(j)

    def unfence(self, i: int) -> None:
        p, j = self._route(i)
        p.unfence(j)

    def release(self) -> None:
        """Release every provider that lends an engine's buffer (has a
        ``release()``, as :class:`~fstier.slots.RowSlots` does), in order;
        the others are their owners' to close."""
        for p in self.providers:
            release = getattr(p, "release", None)
            if callable(release):
                release()
