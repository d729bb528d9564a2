"""LMCache's keys and values in fstier's terms: which namespace a chunk's
file lives in, what it is called, and the memory FsTier moves it through.

* :class:`Layout`: a value's shapes and dtypes (from the L1 memory object
  on store and load, from the lookup's ``group_layout_descs`` hint on a
  lookup) and its byte size. MLA values are ``[layers, tokens, latent]``
  (3-D), others ``[2, layers, tokens, hidden]``.
* :class:`SpaceId`: everything of an ``ObjectKey`` but the chunk hash and
  the object group, plus the layout and the hash form (:func:`hash_form`).
  :func:`space_mapper` digests it into one fstier namespace: the model
  name, ``kv_rank``'s world size (all its bits above the low 24: any int
  rank is exact, :func:`split_kv_rank`), local world size and local rank,
  the ``cache_salt``, the layout, a short hash's length, fstier's format
  version and the tier's ``namespace_salt``; the global rank is the
  namespace's ``r<rank>`` segment. A file written under another layout (or
  salt, or parallel layout) is therefore never found, let alone loaded at
  the wrong size. LMCache's MLA ``kv_rank`` leaves tensor parallelism out
  (its world size is pipeline x decode-context stages), so MLA files are
  shared by every TP size exactly where LMCache's keys are; other models'
  files are rank-private, as their keys are.
* One chunk is one block file: ``BlockKey(chunk_hash, group=object_group_id)``
  (groups 0..:data:`MAX_GROUPS` - 1; every group of a namespace has the
  namespace's layout, so the same payload size).
* :class:`LentSlots`: the :class:`~fstier.slots.SlotProvider` of one
  namespace: LMCache's L1 objects are lent to FsTier for one job each,
  in place (no copy), and given back when its result is taken.
* :func:`one_signature` (store, load) and :func:`one_owner` (lookup): whether
  a task's keys and objects all map to one namespace, so the adapter asks
  once for the whole task (reading the keys' hashes and groups once);
  :func:`block_keys_of`: its block keys, checked once per batch;
  :class:`KeyMemo`: a namespace's block keys its lookups and loads built
  lately, reused by the load that follows a lookup.
* :class:`L1Arena`: an L1 object's bytes, in place: a slice of one view of
  LMCache's L1 arena (``L1MemoryDesc``), built once, its slices kept by
  size and offset (bounded); an object outside the arena (or no arena
  described) gives its own ``byte_array``.

Importing this module imports neither LMCache nor torch. Costs: a
:class:`SpaceId` is built once per namespace the adapter resolves (its
answers are memoised); a mapper once per namespace. Lending a job's buffers
(:meth:`L1Arena.lend`, :meth:`LentSlots.lend`, ``check_slots``,
``slot_views``, ``payload_views``, ``release``) costs no bytecode per buffer in the common
case (every object in the arena, whose slices need no per-view form
check, the next slot indices free, nothing fenced): C-level loops
(``map``, ``set``, ``min``/``max``, dict ``update``) do the per-buffer
work, and anything else takes the per-buffer code, which names the same
refusals (tests/lmcache/test_lmcache_fast_paths.py).
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import repeat
from operator import add, attrgetter, methodcaller, sub
from typing import TYPE_CHECKING, Any

from fstier.config import DTYPE_SIZES
from fstier.file_mapper import FileMapper
from fstier.io import FORMAT_VERSION
from fstier.keys import MAX_HASH_BYTES, MIN_HASH_BYTES, BlockKey, block_keys
from fstier.slots.provider import generic_payload_views

if TYPE_CHECKING:  # pragma: no cover
    from fstier.config import TierConfig

__all__ = [
    "MAX_GROUPS", "KeyMemo", "L1Arena", "Layout", "LentSlots", "SpaceId", "block_keys_of", "hash_form", "one_owner",
    "one_signature", "space_mapper", "split_kv_rank",
]

#: Object groups a namespace holds (``object_group_id`` 0..MAX_GROUPS-1);
#: a key of a higher group is a miss and is never stored.
MAX_GROUPS = 64

#: a plain writable byte view: what FsTier moves bytes through
_VIEW_FORM = attrgetter("format", "ndim", "readonly", "contiguous")
_PLAIN_VIEW = frozenset({("B", 1, False, True)})
_DATA_PTR = attrgetter("data_ptr")
_OWNER = attrgetter("model_name", "kv_rank", "cache_salt")
_GROUP = attrgetter("object_group_id")
_HASH = attrgetter("chunk_hash")
#: An L1 object's layout fields, read from its ``meta`` (the
#: ``MemoryObjMetadata`` LMCache's ``MemoryObj.__init__`` sets), not through
#: ``TensorMemoryObj.metadata``, a property that takes the object's lock
#: per call. Safe in LMCache 0.5.6 (memory_management.py and
#: memory_allocators/): ``shape``, ``dtype``, ``shapes`` and ``dtypes`` are
#: assigned when a block is allocated (the paged allocator's ``allocate``
#: and ``batched_allocate``) or narrowed after a read (a connector's
#: ``reshape_partial_chunk``), always without that lock, and never while
#: the object is in an L2 task; the lock orders only ``ref_count``,
#: ``pin_count`` and the used-size override, none of which is read here.
_META = attrgetter("meta")
_LAYOUT = attrgetter("shape", "dtype", "shapes", "dtypes")
_SIZE = methodcaller("get_size")


def one_signature(keys: Sequence[Any], objects: Sequence[Any]) -> tuple[list[bytes], list[int]] | None:
    """Whether a task's LMCache keys share model, rank, salt and hash form
    (:func:`hash_form`) with every group in 0..MAX_GROUPS-1, and its L1
    objects share shapes, dtypes and size: then every key's namespace is the
    first key's, and the keys' chunk hashes and groups, read once here, are
    returned for :func:`block_keys_of`. Decided with C-level loops
    (``map``, ``list.count``, ``min``/``max``), no bytecode per key; None
    for anything else, an empty task, or an object without LMCache's
    ``meta``."""
    try:
        owners = list(map(_OWNER, keys))  # list.count: no tuple hashed per key
        if owners.count(owners[0]) != len(owners) or len(keys) != len(objects):
            return None
        groups = list(map(_GROUP, keys))
        if not (min(groups) >= 0 and max(groups) < MAX_GROUPS):
            return None
        hashes = list(map(_HASH, keys))
        lens = list(map(len, hashes))  # one hash form: one length, or all of 8..64
        lo, hi = min(lens), max(lens)
        if not (lo == hi or lo >= MIN_HASH_BYTES and hi <= MAX_HASH_BYTES):
            return None
        layouts = list(map(_LAYOUT, map(_META, objects)))
        sizes = list(map(_SIZE, objects))
        if layouts.count(layouts[0]) == len(layouts) and sizes.count(sizes[0]) == len(sizes):
            return hashes, groups
    except Exception:
        pass
    return None


def one_owner(keys: Sequence[Any]) -> bool:
    """Whether LMCache keys share model, rank, salt, object group and hash
    form (one namespace under one layout hint); C-level loops."""
    if len(set(map(_GROUP, keys))) != 1 or len(set(map(_OWNER, keys))) != 1:
        return False
    lens = set(map(len, map(_HASH, keys)))
    return len(lens) == 1 or min(lens) >= MIN_HASH_BYTES and max(lens) <= MAX_HASH_BYTES


def hash_form(n: int) -> int | None:
    """How a chunk hash of ``n`` bytes is named: ``None`` for 8..64 bytes
    (the block key's own hash, as ever); ``n`` for 0..7 bytes (zero-padded
    to 8 in a namespace that records ``n``: exact, since every hash of that
    namespace has length ``n``); ``-1`` for more than 64 bytes, which fstier
    cannot name exactly (a miss, never stored)."""
    if MIN_HASH_BYTES <= n <= MAX_HASH_BYTES:
        return None
    return n if n < MIN_HASH_BYTES else -1


def block_keys_of(keys: Sequence[Any], read: tuple[list[bytes], list[int]] | None = None) -> list[BlockKey]:
    """The block key of each LMCache key, ``BlockKey(chunk_hash,
    object_group_id)``, built and checked once per batch (:func:`block_keys`);
    a hash shorter than 8 bytes is zero-padded to 8 (its namespace records
    its length: :func:`hash_form`). ``read``: the keys' hashes and groups
    as :func:`one_signature` read them (not read again)."""
    hashes, groups = read if read is not None else (list(map(_HASH, keys)), list(map(_GROUP, keys)))
    if hashes and min(map(len, hashes)) < MIN_HASH_BYTES:
        hashes = [h.ljust(MIN_HASH_BYTES, b"\0") if len(h) < MIN_HASH_BYTES else h for h in hashes]
    return block_keys(hashes, groups)


class KeyMemo:
    """The block keys one namespace built lately, by object group and chunk
    hash: a chunk LMCache looks up and then loads (its prefetch:
    ``submit_lookup_and_lock_task``, then ``submit_load_task`` of the hits),
    or loads again, gets the ``BlockKey`` already built, found by C-level
    loops (``map`` of ``dict.get``, ``all``) instead of built and checked
    again (:func:`block_keys_of`). A key's ``BlockKey`` is a function of its
    hash and group alone, so a remembered one is always right; one
    namespace's memo is never another's (the adapter's ``StoreKeys`` finds a
    store's own LMCache keys by the ``id()`` of its block keys: two
    namespaces must never share one). Stores do not use it (their chunks are
    new). Batches of one group only; bounded: cleared when it would hold
    more than :attr:`BOUND` keys, and a batch of more is not kept (~290 KiB
    with the chunk hashes it keeps alive, so at most ~18 MiB over
    :data:`~fstier.integrations.lmcache.MAX_SPACES` open namespaces).
    Costs, a hit: a few C-level passes over the batch; a miss:
    :func:`block_keys_of` and one ``dict.update``. Safe without a lock
    (each step one dict operation under the GIL; the bound is approximate
    under races)."""

    BOUND = 2048

    def __init__(self) -> None:
        self._by_group: dict[int, dict[bytes, BlockKey]] = {}
        self._held = 0

    def block_keys(self, keys: Sequence[Any], read: tuple[list[bytes], list[int]] | None = None) -> list[BlockKey]:
        """:func:`block_keys_of` of ``keys`` (``read``: their hashes and
        groups, as :func:`one_signature` read them), remembered ones reused."""
        hashes, groups = read if read is not None else (list(map(_HASH, keys)), list(map(_GROUP, keys)))
        if not groups or groups.count(groups[0]) != len(groups):
            return block_keys_of(keys, (hashes, groups))
        memo = self._by_group.get(groups[0])
        if memo is not None:
            found = list(map(memo.get, hashes))
            if all(found):  # a BlockKey is truthy; a miss is None
                return found  # type: ignore[return-value]
        bkeys = block_keys_of(keys, (hashes, groups))
        if len(bkeys) > self.BOUND:  # a batch past the bound is not kept (the memo would outgrow it)
            return bkeys
        if self._held + len(bkeys) > self.BOUND:
            self._by_group = {}
            self._held = 0
        self._by_group.setdefault(groups[0], {}).update(zip(hashes, bkeys, strict=True))
        self._held += len(bkeys)
        return bkeys

    def __len__(self) -> int:
        return sum(map(len, self._by_group.values()))


def split_kv_rank(kv_rank: int) -> tuple[int, int, int, int]:
    """LMCache's packed ``kv_rank`` (``ObjectKey.ComputeKVRank``) as
    ``(world_size, global_rank, local_world_size, local_rank)``, exactly:
    the world size is everything above the low 24 bits (``kv_rank >> 24``,
    unbounded and signed), so any int ``kv_rank`` is
    ``ComputeKVRank(*split_kv_rank(kv_rank))`` and two ranks never share a
    namespace (``kv_rank`` and ``kv_rank + 2**32``, ``0xFFFFFFFF`` and
    ``-1`` differ). For a rank of 0..2**32-1 the world size is the packed
    byte, so the namespaces of such ranks are those fstier always wrote."""
    return kv_rank >> 24, (kv_rank >> 16) & 0xFF, (kv_rank >> 8) & 0xFF, kv_rank & 0xFF


@dataclass(frozen=True, slots=True)
class Layout:
    """A value's tensors: ``shapes`` and ``dtypes`` (torch names, e.g.
    ``float16``), and ``nbytes``, their total size."""

    shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[str, ...]
    nbytes: int

    @classmethod
    def of(cls, shapes: Sequence[Any], dtypes: Sequence[Any]) -> Layout | None:
        """The layout of ``shapes`` / ``dtypes`` (torch sizes and dtypes or
        their plain forms), or None when it is empty, inconsistent or has a
        dtype fstier does not know."""
        if not shapes or len(shapes) != len(dtypes):
            return None
        shp = tuple(tuple(int(d) for d in s) for s in shapes)
        names = tuple(str(d).removeprefix("torch.") for d in dtypes)
        if any(n not in DTYPE_SIZES for n in names) or any(not s or min(s) < 1 for s in shp):
            return None
        total = 0
        for s, n in zip(shp, names, strict=True):
            count = 1
            for d in s:
                count *= d
            total += count * DTYPE_SIZES[n]
        return cls(shp, names, total)

    @classmethod
    def of_object(cls, obj: Any) -> Layout | None:
        """The layout of an LMCache memory object (its metadata's
        ``shapes``/``dtypes``, else ``shape``/``dtype``), or None when it has
        none or its size is not the layout's (a narrowed object)."""
        try:
            meta = obj.metadata
            shapes = meta.shapes if meta.shapes else [meta.shape]
            dtypes = meta.dtypes if meta.dtypes else [meta.dtype]
            layout = cls.of(shapes, dtypes)
            return layout if layout is not None and layout.nbytes == int(obj.get_size()) else None
        except Exception:
            return None

    @property
    def mla(self) -> bool:
        """True for LMCache's MLA value (``[layers, tokens, latent]``)."""
        return all(len(s) == 3 for s in self.shapes)


@dataclass(frozen=True, slots=True)
class SpaceId:
    """One namespace: an ``ObjectKey`` without its chunk hash and group,
    and the value layout."""

    model_name: str
    kv_rank: int
    cache_salt: str
    layout: Layout
    #: :func:`hash_form` of its keys' chunk hashes (None: 8..64 bytes)
    hash_bytes: int | None = None

    @classmethod
    def of(cls, key: Any, layout: Layout) -> SpaceId:
        return cls(key.model_name, int(key.kv_rank), key.cache_salt, layout, hash_form(len(key.chunk_hash)))

    @property
    def owner(self) -> tuple[str, int, str, int | None]:
        """What an LMCache key tells of its namespace: model, rank, salt, hash form."""
        return self.model_name, self.kv_rank, self.cache_salt, self.hash_bytes

    def chunk_hash(self, block_hash: bytes) -> bytes:
        """The LMCache chunk hash a block key of this namespace names."""
        return block_hash if self.hash_bytes is None else block_hash[: self.hash_bytes]


def space_fields(space: SpaceId, namespace_salt: str) -> dict[str, Any]:
    """The digested fields of ``space``'s namespace (see the module docstring)."""
    ws, _rank, lws, lrank = split_kv_rank(space.kv_rank)
    lay = space.layout
    extra = {} if space.hash_bytes is None else {"hash_bytes": space.hash_bytes}
    return {
        "engine": "lmcache",
        "model": space.model_name,
        "kv_world_size": ws,
        "kv_local_world_size": lws,
        "kv_local_rank": lrank,
        "cache_salt": space.cache_salt,
        "shapes": [list(s) for s in lay.shapes],
        "dtypes": list(lay.dtypes),
        "mla": lay.mla,
        "payload_bytes": lay.nbytes,
        "format_version": FORMAT_VERSION,
        "namespace_salt": namespace_salt,
        **extra,
    }


def space_of_fields(fields: dict[str, Any], kv_rank: int) -> SpaceId | None:
    """The :class:`SpaceId` of an LMCache namespace's manifest ``fields``
    for the rank ``kv_rank`` (whose global rank is one of its ``r<rank>``
    subtrees), or None when they do not describe one this module writes."""
    try:
        layout = Layout.of(fields["shapes"], fields["dtypes"])
        hb = fields.get("hash_bytes")
        sid = SpaceId(str(fields["model"]), kv_rank, str(fields["cache_salt"]), layout, hb)  # type: ignore[arg-type]
        ws, _, lws, lr = split_kv_rank(kv_rank)
        ok = (
            layout is not None and (fields["kv_world_size"], fields["kv_local_world_size"], fields["kv_local_rank"])
            == (ws, lws, lr) and (hb is None or isinstance(hb, int) and 0 <= hb < MIN_HASH_BYTES)
        )
    except (KeyError, TypeError, ValueError):
        return None
    return sid if ok else None


def space_mapper(space: SpaceId, tier: TierConfig) -> FileMapper:
    """The :class:`FileMapper` of ``space`` under ``tier``'s root."""
    return FileMapper.for_engine(
        tier.root_dir,
        space.model_name,
        space_fields(space, tier.namespace_salt),
        agnostic=False,
        rank=split_kv_rank(space.kv_rank)[1],
        payload_bytes=[space.layout.nbytes] * MAX_GROUPS,
    )


class LentSlots:
    """A :class:`~fstier.slots.SlotProvider` over buffers lent one job at a
    time: :meth:`lend` gives each buffer a slot index (an LMCache L1 object's
    bytes, in place), :meth:`release` takes them back once the job's result
    is in. A fenced slot (a timed-out call may still touch it) keeps its
    buffer until :meth:`unfence`, and its index is not reused meanwhile.
    One lock; costs one dict operation per slot."""

    def __init__(self, slot_bytes: int, num_slots: int = 1 << 20) -> None:
        if slot_bytes <= 0 or num_slots <= 0:
            raise ValueError(f"LentSlots: need slot_bytes > 0 and num_slots > 0, got {slot_bytes}, {num_slots}")
        self._slot_bytes = slot_bytes
        self._num_slots = num_slots
        self._views: dict[int, memoryview] = {}
        self._fenced: set[int] = set()
        self._orphans: set[int] = set()  # released while fenced
        self._next = 0
        self._lock = threading.Lock()

    @property
    def num_slots(self) -> int:
        return self._num_slots

    @property
    def slot_bytes(self) -> int:
        return self._slot_bytes

    def lend(self, buffers: Sequence[memoryview], *, plain: bool = False) -> list[int] | None:
        """Slot indices for ``buffers`` (each writable, exactly
        ``slot_bytes`` long), or None when one is not or all slots are lent.
        Plain byte views of the right length, lent to the next free run of
        indices: no bytecode per buffer. ``plain``: the caller made every
        buffer a slice of one plain byte view (:meth:`L1Arena.lend`), so
        their form is not checked again; their lengths are."""
        views = list(buffers)
        if plain or set(map(_VIEW_FORM, views)) <= _PLAIN_VIEW:
            if views and set(map(len, views)) != {self._slot_bytes}:
                return None
        else:
            views = []
            for b in buffers:
                v = b if b.format == "B" and b.ndim == 1 else b.cast("B")
                if len(v) != self._slot_bytes or v.readonly or not v.contiguous:
                    return None
                views.append(v)
        n = len(views)
        with self._lock:
            if len(self._views) + n > self._num_slots:
                return None
            start = self._next
            run = range(start, start + n)
            if start + n <= self._num_slots and self._views.keys().isdisjoint(run):
                out = list(run)
                self._views.update(zip(out, views, strict=True))
                self._next = (start + n) % self._num_slots
                return out
            out = []
            for v in views:
                while self._next in self._views:
                    self._next = (self._next + 1) % self._num_slots
                self._views[self._next] = v
                out.append(self._next)
                self._next = (self._next + 1) % self._num_slots
        return out

    def release(self, slots: Sequence[int]) -> None:
        """Take back ``slots`` (a fenced one is kept until it is unfenced)."""
        with self._lock:
            if not self._fenced:
                deque(map(self._views.pop, slots, repeat(None)), maxlen=0)
                return
            for s in slots:
                if s in self._fenced:
                    self._orphans.add(s)
                else:
                    self._views.pop(s, None)

    def slot_view(self, i: int) -> memoryview:
        # No lock: one dict read (atomic under the GIL) of a slot that stays
        # lent until its job's result is taken; FsTier's I/O threads call
        # this per key, and a lock here was one acquire per key between them.
        return self._views[i]

    def slot_views(self, slots: Sequence[int]) -> list[memoryview]:
        """:meth:`slot_view` of each of ``slots`` (the same ``KeyError`` for
        one not lent), by ``map``: no bytecode per slot."""
        return list(map(self._views.__getitem__, slots))

    def payload_views(self, slots: Sequence[int], nbytes: Sequence[int]) -> list[memoryview]:
        """:func:`~fstier.slots.provider.payload_views` of lent buffers. A
        job of one namespace moves whole slots (every payload is
        ``slot_bytes``: the layout's size): the lent views themselves,
        :meth:`slot_views`, not a second slice of each; anything else cut
        as :func:`~fstier.slots.provider.generic_payload_views` cuts it."""
        if len(slots) == len(nbytes) and (not nbytes or min(nbytes) == max(nbytes) == self._slot_bytes):
            return self.slot_views(slots)
        return generic_payload_views(self, slots, nbytes)

    def check_slots(self, slots: Sequence[int]) -> None:
        """ValueError naming the first of ``slots`` not lent, or fenced."""
        with self._lock:
            if self._views.keys() >= set(slots) and self._fenced.isdisjoint(slots):
                return
            for s in slots:
                if s not in self._views:
                    raise ValueError(f"slot {s!r} is not lent to the tier")
                if s in self._fenced:
                    raise ValueError(f"slot {s} is fenced: a timed-out I/O call may still touch it")

    def check_plain(self, slots: Sequence[int]) -> None:
        """:meth:`check_slots` of ``slots`` its caller found plain indices in range (FsTier's common job):
        every one lent and none fenced (two C-level set tests, atomic under the GIL, no lock); else
        :meth:`check_slots` names the first that is not."""
        if self._fenced or not self._views.keys() >= set(slots):
            self.check_slots(slots)

    def fence(self, i: int) -> None:
        with self._lock:
            self._fenced.add(i)

    def unfence(self, i: int) -> None:
        with self._lock:
            self._fenced.discard(i)
            if i in self._orphans:
                self._orphans.discard(i)
                self._views.pop(i, None)

    @property
    def lent(self) -> int:
        """Slots lent now (fenced ones included)."""
        with self._lock:
            return len(self._views)


class L1Arena:
    """LMCache's L1 arena as one writable byte view (``L1MemoryDesc``'s
    ``ptr`` and ``size``), built once: :meth:`bytes_of` slices an object's
    ``get_size()`` bytes from it, exactly ``byte_array``'s bytes, without
    the ctypes array type and cast ``byte_array`` builds per call. Building
    the view touches no memory; only the slices lent to a job are read or
    written. The slices cut are kept, by size and offset (LMCache reuses
    its L1 blocks, so a task's objects mostly lie where earlier ones lay):
    a slice is a function of its offset and size alone, so a kept one is
    always the right bytes; at most :attr:`KEPT` per size and 8 sizes
    (~200 bytes a slice; the arena's view they reference is kept anyway),
    all of a size dropped past it."""

    KEPT = 8192

    def __init__(self, base: int, view: memoryview | None) -> None:
        self._base = base
        self._view = view
        #: the view is plain writable bytes, and so is every slice of it
        self._plain = view is not None and _VIEW_FORM(view) in _PLAIN_VIEW
        self._kept: dict[int, dict[int, memoryview]] = {}  # size -> offset -> slice

    @classmethod
    def of(cls, desc: Any) -> L1Arena:
        """The arena ``desc`` describes (none: every object's own ``byte_array``)."""
        try:
            ptr, size = int(desc.ptr), int(desc.size)
        except (AttributeError, TypeError, ValueError):
            return cls(0, None)
        if ptr <= 0 or size <= 0:
            return cls(0, None)
        import ctypes

        return cls(ptr, memoryview((ctypes.c_ubyte * size).from_address(ptr)).cast("B"))

    def views_of(self, objs: Sequence[Any], size: int) -> list[memoryview]:
        """:meth:`bytes_of` of each of ``objs``, whose ``get_size()`` is
        ``size`` (the caller resolved them with that size: their layout's).
        Every object in the arena: slices of its view made by C-level loops,
        no bytecode per object; else object by object."""
        views = self._slices(objs, size)
        return views if views is not None else list(map(self.bytes_of, objs))

    def _slices(self, objs: Sequence[Any], size: int) -> list[memoryview] | None:
        """``size`` bytes of the arena's view at each object's ``data_ptr``,
        or None unless every one of them (at least one) is in the arena."""
        view = self._view
        if view is None or not objs:
            return None
        offs = list(map(sub, map(_DATA_PTR, objs), repeat(self._base)))
        kept = self._kept.get(size)
        if kept is not None:
            found = list(map(kept.get, offs))
            if all(found):  # a slice of size > 0 is truthy; a miss is None
                return found  # type: ignore[return-value]
        if not (min(offs) >= 0 and max(offs) + size <= len(view)):
            return None
        views = list(map(view.__getitem__, map(slice, offs, map(add, offs, repeat(size)))))
        if kept is None or len(kept) + len(views) > self.KEPT:
            if kept is None and len(self._kept) >= 8:  # sizes: one per layout in use
                self._kept.clear()
            kept = self._kept[size] = {}
        if len(views) <= self.KEPT:
            kept.update(zip(offs, views, strict=True))
        return views

    def lend(self, slots: LentSlots, objs: Sequence[Any]) -> list[int] | None:
        """``slots.lend(self.views_of(objs, slots.slot_bytes))``: when every
        object is in the arena, its slices are lent as ``plain`` (the
        arena's view was checked once: 1-D, writable, contiguous bytes), not
        checked again one by one; anything else as ``lend`` checks any buffer."""
        views = self._slices(objs, slots.slot_bytes)
        if views is not None:
            return slots.lend(views, plain=self._plain)
        return slots.lend(list(map(self.bytes_of, objs)))

    def bytes_of(self, obj: Any) -> memoryview:
        """``obj.byte_array``'s bytes, in place."""
        view = self._view
        if view is not None:
            off = int(obj.data_ptr) - self._base
            end = off + int(obj.get_size())
            if off >= 0 and end <= len(view):
                return view[off:end]
        return obj.byte_array  # type: ignore[no-any-return,unused-ignore]
