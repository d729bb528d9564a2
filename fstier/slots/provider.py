"""Slot providers: the fixed-size, writable host regions that FsTier moves
bytes between and files.

A *slot* is one region of host memory that holds one file's payload. FsTier
never allocates or frees slots itself; a *provider* owns them:

- :class:`~fstier.slots.host_pool.HostBlockPool`, fstier's own shared, aligned
  memory (slots are 4096-aligned and a multiple of 4096 long);
- an engine's own rows, e.g. the rows of vLLM's primary CPU tier
  (:mod:`fstier.integrations.vllm`), which may be neither.

The contract a provider keeps:

- ``slot_view(i)`` is a writable memoryview of exactly ``slot_bytes`` bytes;
  FsTier never reads or writes outside it.
- ``check_slots(slots)`` raises ``ValueError`` naming the first slot that a
  job must not use now (not a slot of this provider, or not currently handed
  out to the caller).
- ``fence(i)`` / ``unfence(i)``: while a timed-out I/O call may still write
  slot ``i``, the provider never hands that slot out again (a pool keeps it
  off its free list even after the engine frees it); ``unfence`` is called
  once the late call has returned.

Optional: ``slot_views(slots)``, ``[slot_view(i) for i in slots]`` for a
whole batch (the same views, the same refusals), made with C-level loops
where it can; every provider in :mod:`fstier.slots` and LMCache's
``LentSlots`` has one. :func:`payload_views` is what FsTier's I/O threads
call: one batch's views cut to each payload's exact length, with no
bytecode per slot where the provider has ``slot_views``
(test_slot_views.py pins each provider's against ``slot_view``); a provider
may have its own ``payload_views(slots, nbytes)`` (RowSlots: one slicing
pass), pinned the same way.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from itertools import repeat
from operator import getitem
from typing import Protocol, cast, runtime_checkable

__all__ = ["SlotProvider", "generic_payload_views", "payload_views", "plain_indices", "slot_views"]

#: ``view[:n]`` as a function of (view, slice(None, n))
_CUT = cast("Callable[[memoryview, slice], memoryview]", getitem)


def plain_indices(slots: Sequence[int], n: int) -> bool:
    """Whether every element of ``slots`` is a plain ``int`` in ``0..n-1``,
    decided with C-level loops (``map``/``min``/``max``), so that checking a
    job's slots costs no Python bytecode per slot. False sends the caller to
    its per-slot loop, which names the first bad slot (a ``bool``, an int
    subclass, a float, a slot out of range), or accepts an int subclass as
    before (test_checks_fast.py)."""
    if len(slots) == 0:
        return True
    return set(map(type, slots)) == {int} and min(slots) >= 0 and max(slots) < n


def slot_views(pool: SlotProvider, slots: Sequence[int]) -> list[memoryview]:
    """``pool.slot_view(i)`` of each of ``slots``: the provider's own
    ``slot_views`` where it has one, else ``slot_view`` applied by ``map``."""
    many = getattr(pool, "slot_views", None)
    if many is not None:
        return many(slots)
    return list(map(pool.slot_view, slots))


def payload_views(pool: SlotProvider, slots: Sequence[int], nbytes: Sequence[int]) -> list[memoryview]:
    """``[pool.slot_view(s)[:n] for s, n in zip(slots, nbytes)]``: exactly
    each payload's bytes of its slot, never a byte past them: the
    provider's own ``payload_views`` where it has one (RowSlots: one pass),
    else :func:`generic_payload_views`."""
    own = getattr(pool, "payload_views", None)
    return own(slots, nbytes) if own is not None else generic_payload_views(pool, slots, nbytes)


def generic_payload_views(pool: SlotProvider, slots: Sequence[int], nbytes: Sequence[int]) -> list[memoryview]:
    """:func:`payload_views` of any provider: its :func:`slot_views`, cut to
    each payload's length by C-level loops."""
    if len(slots) != len(nbytes):
        raise ValueError(f"payload_views: {len(slots)} slots but {len(nbytes)} payload lengths")
    return list(map(_CUT, slot_views(pool, slots), map(slice, repeat(None), nbytes)))


@runtime_checkable
class SlotProvider(Protocol):
    """What FsTier needs of the memory its jobs name by slot index. ``num_slots`` is fixed for the
    provider's life. Optional: ``check_plain(slots)``, :meth:`check_slots` of slots FsTier already found
    plain distinct indices in range (its common job), checking only what the provider alone knows (fences,
    what it lent); without it FsTier calls :meth:`check_slots`."""

    @property
    def num_slots(self) -> int: ...

    @property
    def slot_bytes(self) -> int: ...

    def slot_view(self, i: int) -> memoryview: ...

    def check_slots(self, slots: Sequence[int]) -> None: ...

    def fence(self, i: int) -> None: ...

    def unfence(self, i: int) -> None: ...
