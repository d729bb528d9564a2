"""JoinedSlots: the slots of two providers of one slot size, end to end.

An engine adapter that lends FsTier an engine's rows in place and also
needs a few rows of its own (SGLang's legacy calls stage flat page tensors
through fstier-owned scratch rows) hands FsTier one provider: slot ``i`` is
the first provider's slot ``i`` below its ``num_slots``, the second's slot
``i - first.num_slots`` above. Routing costs one comparison per slot; this
class holds no state of its own (fencing is the providers').
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

__all__ = ["JoinedSlots"]


class JoinedSlots:
    """The slots of one backend: the host pool's fragment rows (in place),
    then fstier-owned scratch rows for the legacy calls. Both are
    :class:`RowSlots` of the same row size; this only routes indices."""

    def __init__(self, host: Any, scratch: Any) -> None:
        self.host = host
        self.scratch = scratch
        self._n = host.num_slots

    @property
    def num_slots(self) -> int:
        return self._n + self.scratch.num_slots

    @property
    def slot_bytes(self) -> int:
        return int(self.host.slot_bytes)

    def _route(self, i: int) -> tuple[Any, int]:
        return (self.host, i) if i < self._n else (self.scratch, i - self._n)

    def slot_view(self, i: int) -> memoryview:
        rows, j = self._route(i)
        return rows.slot_view(j)  # type: ignore[no-any-return,unused-ignore]

    def check_slots(self, slots: Sequence[int]) -> None:
        for s in slots:
            if isinstance(s, bool) or not isinstance(s, int) or not 0 <= s < self.num_slots:
                raise ValueError(f"slot {s!r} is not a row index in 0..{self.num_slots - 1}")
            rows, j = self._route(s)
            rows.check_slots([j])

    def fence(self, i: int) -> None:
        rows, j = self._route(i)
        rows.fence(j)

    def unfence(self, i: int) -> None:
        rows, j = self._route(i)
        rows.unfence(j)

    def release(self) -> None:
        self.host.release()
        self.scratch.release()
