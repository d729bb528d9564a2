"""Slots: the fixed-size, writable host regions FsTier moves bytes between
and files, and their providers.

- :mod:`~fstier.slots.provider`: :class:`SlotProvider`, the contract every
  provider keeps (fencing included);
- :mod:`~fstier.slots.host_pool`: :class:`HostBlockPool`, fstier's own named
  shared, aligned memory (its tensors and CUDA pinning are the staging
  side's: :class:`fstier.layout.PoolTensors`);
- :mod:`~fstier.slots.rows`: :class:`RowSlots`, an engine's own rows lent in
  place (torch-free);
- :mod:`~fstier.slots.joined`: :class:`JoinedSlots`, providers of one slot
  size numbered end to end (an engine's rows, then fstier's own).

Nothing here imports torch or numpy (tests/test_torch_free.py).
"""

from __future__ import annotations

from fstier.slots.host_pool import HostBlockPool
from fstier.slots.joined import JoinedSlots
from fstier.slots.provider import SlotProvider
from fstier.slots.rows import RowSlots

__all__ = ["HostBlockPool", "JoinedSlots", "RowSlots", "SlotProvider"]
