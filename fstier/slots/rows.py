"""RowSlots: a slot provider over fixed-stride rows of an engine's own buffer.

An engine that keeps its KV blocks in host rows (vLLM's primary CPU tier)
lends them to FsTier in place, with no copy: slot ``i`` is ``row_bytes``
bytes at ``offset + i * stride``. Rows need not be 4096-aligned nor a
multiple of 4096 long; the I/O layer moves exactly a payload's bytes.
A job's payload views are one pass of C-level slicing
(:meth:`RowSlots.payload_views`). Checking a job's slots costs a few C-level passes over them under one
lock (:func:`~fstier.slots.provider.plain_indices` and one set
``isdisjoint`` with the fenced rows: no Python bytecode per slot); only a
job with a bad slot pays a per-slot loop, which names it.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from itertools import repeat
from operator import add, mul

from fstier.slots.provider import generic_payload_views, plain_indices

__all__ = ["RowSlots"]

log = logging.getLogger("fstier.slots")


class RowSlots:
    """A :class:`~fstier.slots.SlotProvider` over fixed-stride rows of an
    engine's buffer, in place: slot ``i`` is ``row_bytes`` bytes at
    ``offset + i * stride``. Rows need not be 4096-aligned nor a multiple of
    4096 long (FsTier then moves exactly the payload's bytes and the I/O layer
    pads from its own buffer), and nothing outside a row is ever touched.

    The engine owns the rows: :meth:`check_slots` checks indices and fences
    only, and :meth:`fence` marks rows a timed-out I/O call may still write
    (the vLLM adapter holds such a job's result back, so vLLM keeps the rows
    pinned, until :meth:`unfence`)."""

    def __init__(
        self,
        buffer: memoryview,
        num_rows: int,
        stride: int,
        row_bytes: int | None = None,
        offset: int = 0,
    ) -> None:
        if num_rows == 0 or len(buffer) == 0:
            # memoryview.cast refuses a shape with a zero in it (TypeError).
            raise ValueError("RowSlots: the buffer has no rows (0 bytes or 0 rows)")
        flat = buffer if buffer.format == "B" and buffer.ndim == 1 else buffer.cast("B")
        row_bytes = stride if row_bytes is None else row_bytes
        if num_rows < 0 or stride <= 0 or not 0 < row_bytes <= stride or offset < 0:
            raise ValueError(
                f"RowSlots: need num_rows >= 0, stride > 0, 0 < row_bytes <= stride and "
                f"offset >= 0, got num_rows={num_rows}, stride={stride}, "
                f"row_bytes={row_bytes}, offset={offset}"
            )
        end = offset + (num_rows - 1) * stride + row_bytes if num_rows else offset
        if end > len(flat):
            raise ValueError(
                f"RowSlots: {num_rows} rows of stride {stride} from offset {offset} need "
                f"{end} bytes, but the buffer holds {len(flat)}"
            )
        if flat.readonly:
            raise ValueError("RowSlots: the buffer must be writable (loads fill rows)")
        self._flat = flat
        self._num_rows = num_rows
        self._stride = stride
        self._row_bytes = row_bytes
        self._offset = offset
        self._fenced: set[int] = set()
        self._lock = threading.Lock()

    @classmethod
    def from_primary_view(cls, view: memoryview) -> RowSlots:
        """Rows of vLLM's ``primary_kv_view`` (2-D, chunks x row stride)."""
        if view.ndim != 2 or view.strides is None or view.shape is None:
            raise ValueError(
                f"primary_kv_view must be 2-D (chunks x row bytes), got ndim={view.ndim}"
            )
        if view.shape[0] == 0 or view.shape[1] == 0:
            raise ValueError(
                f"primary_kv_view has no rows (shape {tuple(view.shape)}): vLLM's CPU tier got "
                "no chunks; raise cpu_bytes_to_use (kv_connector_extra_config)"
            )
        return cls(view, view.shape[0], view.strides[0])

    @property
    def num_slots(self) -> int:
        return self._num_rows

    @property
    def slot_bytes(self) -> int:
        return self._row_bytes

    @property
    def stride(self) -> int:
        return self._stride

    def slot_view(self, i: int) -> memoryview:
        start = self._offset + i * self._stride
        return self._flat[start : start + self._row_bytes]

    def slot_views(self, slots: Sequence[int]) -> list[memoryview]:
        """:meth:`slot_view` of each of ``slots``: row indices in range are
        sliced by C-level loops (no bytecode per slot), anything else row
        by row, exactly as :meth:`slot_view` answers it."""
        if not plain_indices(slots, self._num_rows):
            return list(map(self.slot_view, slots))
        starts = list(map(add, map(mul, slots, repeat(self._stride)), repeat(self._offset)))
        ends = map(add, starts, repeat(self._row_bytes))
        return list(map(self._flat.__getitem__, map(slice, starts, ends)))

    def payload_views(self, slots: Sequence[int], nbytes: Sequence[int]) -> list[memoryview]:
        """:func:`~fstier.slots.provider.payload_views` of these rows: each of
        ``slots``' first ``nbytes[i]`` bytes (at most a row), sliced from the
        buffer in one pass of C-level loops; anything else as that function
        answers it (through :meth:`slot_views`)."""
        if len(slots) != len(nbytes) or not plain_indices(slots, self._num_rows) or (
                nbytes and not 0 <= min(nbytes) <= max(nbytes) <= self._row_bytes):
            return generic_payload_views(self, slots, nbytes)
        starts = list(map(add, map(mul, slots, repeat(self._stride)), repeat(self._offset)))
        return list(map(self._flat.__getitem__, map(slice, starts, map(add, starts, nbytes))))

    def payload_views_checked(self, slots: Sequence[int], nbytes: Sequence[int]) -> list[memoryview]:
        """:meth:`payload_views` of a job its tier checked already (FsTier: ``slots`` plain row
        indices in range, by ``check_job``; every payload length at most a row, by ``check_pool``):
        the slicing alone, no second pass over the slots."""
        starts = list(map(add, map(mul, slots, repeat(self._stride)), repeat(self._offset)))
        return list(map(self._flat.__getitem__, map(slice, starts, map(add, starts, nbytes))))

    def check_slots(self, slots: Sequence[int]) -> None:
        if not self._fenced and plain_indices(slots, self._num_rows):
            return  # no row fenced (one read; a fence racing this is as if it came after): no lock, no per-slot Python
        with self._lock:
            if plain_indices(slots, self._num_rows) and self._fenced.isdisjoint(slots):
                return  # no per-slot Python (test_checks_fast.py)
            for s in slots:
                if isinstance(s, bool) or not isinstance(s, int) or not 0 <= s < self._num_rows:
                    raise ValueError(
                        f"slot {s!r} is not a row index in 0..{self._num_rows - 1}"
                    )
                if s in self._fenced:
                    raise ValueError(
                        f"slot {s} is fenced: a timed-out I/O call may still write it"
                    )

    def check_plain(self, slots: Sequence[int]) -> None:
        """:meth:`check_slots` of ``slots`` its caller found plain row indices in range (FsTier's common job):
        only the fences are left to check; none fenced: one read, no lock."""
        if self._fenced:
            self.check_slots(slots)

    def fence(self, i: int) -> None:
        with self._lock:
            self._fenced.add(i)

    def unfence(self, i: int) -> None:
        with self._lock:
            self._fenced.discard(i)

    @property
    def fenced(self) -> frozenset[int]:
        with self._lock:
            return frozenset(self._fenced)

    def release(self) -> None:
        """Drop this provider's export of the engine's buffer (after the last
        I/O), so the engine can unmap it; slot views are invalid after.
        Never raises: slot views still referenced (by a caller, or by a
        not yet collected reference cycle) are collected first; one that
        survives that is logged and the buffer stays exported."""
        try:
            self._flat.release()
        except BufferError:
            import gc

            gc.collect()
            try:
                self._flat.release()
            except BufferError as exc:
                log.warning("fstier: rows of the engine's buffer are still in use (%s)", exc)
