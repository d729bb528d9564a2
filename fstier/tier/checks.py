"""What a caller must hand :class:`~fstier.manager.FsTier`: keys of the
model's groups, for a job one slot per key that the slot provider has
handed out, slots that hold the largest payload, and for a wait a
timeout in seconds.

Pure checks, no I/O and no tier state: each failure is one ``ValueError``
naming the call or job, the offending element and the fix; nothing is
queued before they pass. Costs: one pass over the keys and the slots, plus
the provider's ``check_slots``.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Hashable, Iterable, Sequence
from operator import attrgetter
from typing import cast

from fstier.errors import PoolError
from fstier.io import padded_len
from fstier.keys import BlockKey
from fstier.slots.provider import SlotProvider, plain_indices

_GROUP = attrgetter("group_idx")
_PLAIN_SEQUENCES = (list, tuple)

__all__ = ["check_job", "check_keys", "check_pool", "known_groups", "wait_timeout"]


def _check_sequence(seq: object, name: str, what: str) -> None:
    """``seq`` is a sized, indexable sequence (a list, tuple or array of keys
    or slots), else
    one ``ValueError`` naming the call and what was passed (None, a string,
    a generator are caller mistakes, never "no keys")."""
    if type(seq) in _PLAIN_SEQUENCES:
        return  # the common call: one type check
    if isinstance(seq, str | bytes | bytearray) or not (hasattr(seq, "__len__") and hasattr(seq, "__getitem__")):
        raise ValueError(
            f"{what}: {name} must be a list or tuple, got {type(seq).__name__} "
            f"({str(seq)[:80] if seq is not None else 'None'})"
        )


def check_keys(keys: Sequence[BlockKey], num_groups: int, what: str) -> None:
    """``keys`` a sequence whose every element is a :class:`BlockKey` of a
    group ``< num_groups``, or a ``ValueError`` naming the first that is
    not (``what`` names the call)."""
    _check_sequence(keys, "keys", what)
    if len(keys) == 0 or (set(map(type, keys)) == {BlockKey} and max(map(_GROUP, keys)) < num_groups):
        return  # C-level loops, no bytecode per key (test_checks_fast.py)
    for i, k in enumerate(keys):
        if not isinstance(k, BlockKey):
            raise ValueError(
                f"{what}: keys[{i}] is {k!r} ({type(k).__name__}); keys must be BlockKey, "
                "e.g. from fstier.chain_hashes"
            )
        if k.group_idx >= num_groups:
            raise ValueError(
                f"{what}: keys[{i}]: group {k.group_idx} does not exist "
                f"(the model has {num_groups} group(s))"
            )


def known_groups(keys: Iterable[BlockKey], num_groups: int) -> Sequence[BlockKey]:
    """``[k for k in keys if k.group_idx < num_groups]`` (what a touch
    notes: a key of no group has no file), with no bytecode per key when
    every key's group exists (test_checks_fast.py)."""
    seq = cast("Sequence[BlockKey]", keys) if type(keys) in _PLAIN_SEQUENCES else list(keys)
    if not seq or max(map(_GROUP, seq)) < num_groups:
        return seq
    return [k for k in seq if k.group_idx < num_groups]


def check_job(
    job_id: Hashable,
    keys: Sequence[BlockKey],
    slots: Sequence[int],
    pool: SlotProvider,
    num_groups: int,
) -> None:
    """A job's arguments: valid keys (:func:`check_keys`), one distinct slot
    index per key, each currently handed out by ``pool``. The common job
    (lists or tuples of one length, BlockKeys of known groups, distinct
    plain slot indices) is accepted by one test of C-level loops."""
    if (
        type(keys) in _PLAIN_SEQUENCES and type(slots) in _PLAIN_SEQUENCES and len(keys) == len(slots)
        and (len(keys) == 0 or (set(map(type, keys)) == {BlockKey} and max(map(_GROUP, keys)) < num_groups
                                and plain_indices(slots, pool.num_slots) and len(set(slots)) == len(slots)))
    ):
        _provider_check(job_id, pool, slots)
        return
    _check_sequence(keys, "keys", f"job {job_id!r}")
    _check_sequence(slots, "slots", f"job {job_id!r}")
    if len(keys) != len(slots):
        raise ValueError(
            f"job {job_id!r}: {len(keys)} keys but {len(slots)} slots; one slot per key"
        )
    check_keys(keys, num_groups, f"job {job_id!r}")
    num_slots = pool.num_slots
    for s in () if plain_indices(slots, num_slots) else slots:
        if isinstance(s, bool) or not isinstance(s, int) or not 0 <= s < num_slots:
            raise ValueError(
                f"job {job_id!r}: slot {s!r} is not a slot index in 0..{num_slots - 1}"
            )
    if len(set(slots)) != len(slots):
        raise ValueError(f"job {job_id!r}: a slot appears twice; one slot per key")
    _provider_check(job_id, pool, slots)


def _provider_check(job_id: Hashable, pool: SlotProvider, slots: Sequence[int]) -> None:
    """The provider knows which slots the caller holds now: a slot that was
    never allocated, or was freed, may be handed to someone else at any
    time, so moving bytes through it is refused
    (test_slots_not_currently_allocated_are_refused)."""
    try:
        pool.check_slots(slots)
    except ValueError as exc:
        raise ValueError(f"job {job_id!r}: {exc}") from None


def wait_timeout(what: str, timeout: float | None) -> float | None:
    """A wait's timeout: ``inf`` means no limit (threading's waits raise
    OverflowError for it); nan or a negative value is a caller's mistake."""
    if timeout is None or timeout == math.inf:
        return None
    if not timeout >= 0:  # also catches nan
        raise ValueError(f"{what}(timeout=...): expected seconds >= 0 or None, got {timeout!r}")
    return min(float(timeout), threading.TIMEOUT_MAX)


def check_pool(pool: SlotProvider, need: int) -> None:
    """``pool``'s slots hold a payload of ``need`` bytes (the largest file's),
    else a :class:`~fstier.errors.PoolError` naming the size to provide."""
    if pool.slot_bytes < need:
        raise PoolError(
            f"{type(pool).__name__} slot_bytes is {pool.slot_bytes} but the largest file "
            f"payload is {need} bytes; provide slots with slot_bytes >= {need} "
            f"({padded_len(need)} lets I/O run on the slot in place)"
        )
