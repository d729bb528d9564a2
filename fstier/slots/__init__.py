"""Slots: the fixed-size, writable host regions FsTier moves bytes between
and files, and their providers.

- :mod:`~fstier.slots.provider`: :class:`SlotProvider`, the contract every
  provider keeps (fencing included);
- :mod:`~fstier.slots.host_pool`: :class:`HostBlockPool`, fstier's own named
  shared, aligned memory (imports torch for ``slot_tensor``: loaded lazily);
- :mod:`~fstier.slots.rows`: :class:`RowSlots`, an engine's own rows lent in
  place (torch-free);
- :mod:`~fstier.slots.joined`: :class:`JoinedSlots`, providers of one slot
  size numbered end to end (an engine's rows, then fstier's own).

Importing :mod:`fstier.slots` imports neither torch nor numpy.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from fstier.slots.joined import JoinedSlots
from fstier.slots.provider import SlotProvider
from fstier.slots.rows import RowSlots

if TYPE_CHECKING:  # pragma: no cover
    from fstier.slots.host_pool import HostBlockPool

__all__ = ["HostBlockPool", "JoinedSlots", "RowSlots", "SlotProvider"]


def __getattr__(name: str) -> Any:
    if name == "HostBlockPool":
        return importlib.import_module("fstier.slots.host_pool").HostBlockPool
    raise AttributeError(f"module 'fstier.slots' has no attribute {name!r}")
