"""The slots :meth:`fstier.manager.FsTier.from_config` makes for itself when
the caller brings none: a private :class:`~fstier.slots.host_pool.HostBlockPool`
sized from the config, owned and closed by that tier.

Sizing: each slot holds the largest file payload padded to 4096 (so I/O runs
on the slot in place, O_DIRECT included); about 256 MiB in all, at most 1024
slots, and at least two slots per I/O thread so every thread can have a job
in flight while another is being filled. Costs: one shared-memory mapping of
that size; nothing is touched until a job uses a slot.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from fstier.config import FstierConfig
from fstier.file_mapper import FileMapper
from fstier.io import padded_len

if TYPE_CHECKING:  # pragma: no cover
    from fstier.slots.host_pool import HostBlockPool

__all__ = ["DEFAULT_POOL_BYTES", "private_pool"]

#: The private pool's budget in bytes.
DEFAULT_POOL_BYTES = 256 << 20


def private_pool(cfg: FstierConfig) -> HostBlockPool:
    """A new pool for a tier of ``cfg`` (the caller closes it)."""
    # Imported here: the slot pool is only needed by a tier that makes its own.
    from fstier.slots.host_pool import HostBlockPool

    mapper = FileMapper(cfg)
    slot_bytes = max(padded_len(mapper.expected_payload_bytes(g)) for g in range(mapper.num_groups))
    threads = cfg.tier.read_threads + cfg.tier.write_threads
    return HostBlockPool(max(2 * threads, min(1024, DEFAULT_POOL_BYTES // slot_bytes)), slot_bytes)
