"""The book-keeping records of :class:`~fstier.integrations.lmcache.FstierL2Adapter`:
an open namespace (:class:`Space`), an LMCache task (:class:`Task`), the
tag of each FsTier job (the task itself, or a :class:`Part` of a task
spanning several namespaces), and what one collection of results tells
LMCache's listeners (:class:`Notes`).

No table of jobs or tasks: a job's tag is its record, handed back by the
tier with its result (``JobResult.job_id``), and a :class:`Part` names its
task. Invariants: a :class:`Task`'s mutable fields change only under the
adapter's collect lock; a task is complete when ``pending`` reaches 0, and
its result is then published once. Importing this module imports neither
LMCache nor torch. Costs: one record per task of one namespace, one more
per further namespace; O(1) Python per job's result when its keys all
completed (slices and ``+=``).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from itertools import repeat
from operator import attrgetter
from typing import TYPE_CHECKING, Any

from fstier.integrations.lmcache_space import KeyMemo
from fstier.io import block_file_size
from fstier.tier.records import BlockRemoved, BlockStored

if TYPE_CHECKING:  # pragma: no cover
    from fstier.integrations.lmcache_space import LentSlots, SpaceId
    from fstier.keys import BlockKey
    from fstier.manager import FsTier, JobResult, TierEvent

__all__ = ["Notes", "Part", "Space", "StoreKeys", "Task"]

_BLOCK_HASH = attrgetter("block_hash")
_BLOCK_GROUP = attrgetter("group_idx")


@dataclass(eq=False)
class Space:
    """One open namespace: its id, tier, lent slots and the block keys its
    lookups and loads built lately (``keys``); ``users`` pins it
    open, ``used`` orders its last use, ``closed`` once it left the open set
    (both under :class:`~fstier.integrations.lmcache_spaces.Spaces`' lock)."""

    sid: SpaceId
    tier: FsTier
    slots: LentSlots
    keys: KeyMemo = field(default_factory=KeyMemo)
    users: int = 0
    used: int = 0
    closed: bool = False

    @property
    def file_bytes(self) -> int:
        """Bytes one chunk file of this namespace occupies (header and padded
        payload): the size LMCache is told, as fstier counts it against ``max_bytes``."""
        return block_file_size(self.sid.layout.nbytes)

    def object_keys(self, keys: Sequence[BlockKey], make: Any) -> list[Any]:
        """LMCache's ``ObjectKey`` (built by ``make``) of each block key of
        this namespace, built by ``map``: no bytecode of ours per key."""
        s = self.sid
        hashes = map(_BLOCK_HASH, keys) if s.hash_bytes is None else map(s.chunk_hash, map(_BLOCK_HASH, keys))
        return list(map(
            make, hashes, repeat(s.model_name), repeat(s.kv_rank),
            map(_BLOCK_GROUP, keys), repeat(s.cache_salt),
        ))


class Part:
    """One FsTier job of an LMCache task, and that job's tag: the tier hands
    it back as ``JobResult.job_id``, so a result finds its task with no
    table. ``positions``: the task's key positions the job moves (a
    ``range`` of all of them for a task of one namespace); ``slots``: the
    slots lent for them; ``keys`` / ``bkeys``: their LMCache and block keys."""

    __slots__ = ("bkeys", "keys", "positions", "slots", "space", "task")

    def __init__(
        self, task: Task, space: Space, positions: Sequence[int], slots: list[int], keys: list[Any],
        bkeys: list[BlockKey],
    ) -> None:
        self.task, self.space, self.positions = task, space, positions
        self.slots, self.keys, self.bkeys = slots, keys, bkeys


class Task(Part):
    """One LMCache store or load task, and the tag of its first FsTier job
    (a task of one namespace, the common one, is ONE record): ``pending``
    counts its jobs without a result; ``ok`` the positions of the keys
    stored or loaded (each job adds its completed prefix, a slice: no loop
    over keys). A task spanning several namespaces tags each further job
    with a :class:`Part` naming it (:meth:`part`)."""

    __slots__ = ("accessed", "failed", "id", "kind", "n", "nbytes", "ok", "pending")

    def __init__(self, task_id: int, kind: str, n: int) -> None:
        self.task = self
        self.id, self.kind, self.n = task_id, kind, n
        self.pending = self.nbytes = 0
        self.failed = False
        self.ok: list[int] = []
        self.accessed: list[Any] = []
        self.space: Space | None = None  # type: ignore[assignment]  # set by its first part

    def part(
        self, space: Space, positions: Sequence[int], slots: list[int], keys: list[Any], bkeys: list[BlockKey],
    ) -> Part:
        """The tag of the task's job in ``space``: the task itself for its
        first job, else a new :class:`Part`."""
        if self.space is not None:
            return Part(self, space, positions, slots, keys, bkeys)
        self.space, self.positions, self.slots, self.keys, self.bkeys = space, positions, slots, keys, bkeys
        return self

    def refused(self) -> None:
        """A job of the task was not submitted: it fails, one job fewer pending."""
        self.failed = True
        self.pending -= 1

    def add(self, part: Part, r: JobResult) -> bool:
        """Count ``part``'s FsTier result (its completed keys are a leading
        prefix: slices, no loop over keys); whether the task is complete."""
        done = r.keys_completed
        self.ok += part.positions[:done]
        if self.kind == "load":
            self.accessed += part.keys[:done]
            if r.loaded_after:  # chunks past a miss that loaded and checked: each its own result
                self.ok += map(part.positions.__getitem__, r.loaded_after)
                self.accessed += map(part.keys.__getitem__, r.loaded_after)
        self.nbytes += r.nbytes
        self.failed |= not r.success
        self.pending -= 1
        return self.pending == 0


@dataclass(eq=False)
class Notes:
    """What one collection tells LMCache's listeners once its locks are released."""

    stored: list[Any] = field(default_factory=list)
    sizes_stored: list[int] = field(default_factory=list)
    deleted: list[Any] = field(default_factory=list)
    sizes_deleted: list[int] = field(default_factory=list)
    accessed: list[Any] = field(default_factory=list)

    def add(self, space: Space, ev: TierEvent, make: Any, known: StoreKeys) -> None:
        """Note one of ``space``'s tier events: a store part's own LMCache
        keys where ``known`` has them all, else keys built by ``make``.
        Evictions are not noted here: the adapter tells LMCache of each as
        its file goes (``FsTier(on_evicted=...)``)."""
        if isinstance(ev, BlockRemoved) and ev.reason == "evicted":
            return
        okeys = known.of(ev.keys) if isinstance(ev, BlockStored) else None
        if okeys is None:
            okeys = space.object_keys(ev.keys, make)
        size = [space.file_bytes] * len(okeys)
        if isinstance(ev, BlockStored):
            self.stored += okeys
            self.sizes_stored += size
        elif isinstance(ev, BlockRemoved):
            self.deleted += okeys
            self.sizes_deleted += size

    def tell(self, adapter: Any) -> None:
        """Tell LMCache's listeners through ``adapter``'s ``_notify_keys_*``
        (never under the adapter's locks)."""
        if self.stored:
            adapter._notify_keys_stored(self.stored, self.sizes_stored)
        if self.deleted:
            adapter._notify_keys_deleted(self.deleted, self.sizes_deleted)
        if self.accessed:
            adapter._notify_keys_accessed(self.accessed)


class StoreKeys:
    """The LMCache key of each block key an in-flight part's job was given,
    by the block key's ``id()``: FsTier's :class:`BlockStored` event names
    the very ``BlockKey`` objects of its job, so the keys LMCache is told
    were stored are the task's own, found with C-level loops instead of an
    ``ObjectKey`` built (and validated) per key. An entry lives from the
    part's submit to its result; the part holds its block keys meanwhile,
    so no ``id()`` is reused while it is here. Callers hold the adapter's
    collect lock. An event whose keys are not all here (an eviction, a
    corrupt file, an event taken after its part's result) gets ``None``
    from :meth:`of`, and its keys are built."""

    def __init__(self) -> None:
        self._by_id: dict[int, Any] = {}

    def add(self, bkeys: Sequence[BlockKey], keys: Sequence[Any]) -> None:
        self._by_id.update(zip(map(id, bkeys), keys, strict=True))

    def forget(self, bkeys: Sequence[BlockKey]) -> None:
        deque(map(self._by_id.pop, map(id, bkeys), repeat(None)), maxlen=0)

    def of(self, bkeys: Sequence[BlockKey]) -> list[Any] | None:
        found = list(map(self._by_id.get, map(id, bkeys)))
        return found if all(found) else None  # an LMCache key is truthy; a miss is None

    def __len__(self) -> int:
        return len(self._by_id)
