"""The namespaces one :class:`~fstier.integrations.lmcache.FstierL2Adapter`
has open (:class:`Spaces`) and those on its root (:class:`DiskIndex`).

* :class:`Spaces`: one :class:`~fstier.integrations.lmcache_tasks.Space`
  (an FsTier) per :class:`~fstier.integrations.lmcache_space.SpaceId`,
  opened on first use. A space is *pinned* while a caller uses it
  (:meth:`Spaces.acquire` .. :meth:`Spaces.release`: an in-flight job's
  part, a lookup, a delete); when a release leaves more than ``max_idle``
  open, the least recently used unpinned ones are closed, on a closer
  thread, never one with a job in flight (opening closes nothing: a task's
  own namespaces, resolved before they are pinned, stay open for it). A pinned space is never closed, so as many are
  open as LMCache has namespaces in flight (each holds at least one of
  LMCache's L1 objects: bounded by L1's memory) plus ``max_idle``. A closed
  space found again (a memo, a race) is reopened by :meth:`Spaces.acquire`.
* :class:`DiskIndex`: the LMCache namespaces on the root (their manifests),
  read again at most every ``ttl`` seconds: a lookup without a usable
  layout hint asks every namespace of the key's model, rank, salt and hash
  form; ``delete`` removes from every one of them, open or not, written by
  this process or another.
* :func:`walk_keys`: every chunk file of the root's LMCache namespaces (its
  namespace, chunk hash and group), for ``list_l2_keys`` and the start-up seed.
* :func:`key_of_path`: the LMCache key of a block file's path (an
  eviction, heard as the file goes).

Invariants: the open set changes only under :class:`Spaces`' lock; a
space's ``users`` count is changed only under it. Costs: opening a space is
one FsTier (its threads); an index refresh is one listing of the root and
one manifest read per namespace; :func:`walk_keys` one walk of the root.
Importing this module imports neither LMCache nor torch.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fstier.file_mapper import decode
from fstier.integrations.lmcache_space import SpaceId, space_of_fields, split_kv_rank
from fstier.io import block_file_size
from fstier.tier import scan

if TYPE_CHECKING:  # pragma: no cover
    from fstier.config import TierConfig
    from fstier.integrations.lmcache_tasks import Space

__all__ = ["DiskIndex", "Spaces", "key_of_path", "walk_keys"]

log = logging.getLogger("fstier.lmcache")

#: a namespace's owner as an LMCache key tells it: model, kv_rank, salt, hash form
Owner = tuple[str, int, str, "int | None"]


class Spaces:
    """The open namespaces of one adapter (see the module docstring).
    ``make(sid)`` opens one (None: it cannot be opened; not retried);
    ``on_closed(space)`` runs on a closer thread once a space left the open
    set (it closes the tier and tells LMCache what its last events say)."""

    def __init__(
        self, make: Callable[[SpaceId], Space | None], on_closed: Callable[[Space], None], max_idle: int
    ) -> None:
        self._make = make
        self._on_closed = on_closed
        self.max_idle = max_idle
        self._open: dict[SpaceId, Space] = {}
        self._owners: dict[Owner, dict[SpaceId, Space]] = {}  # the open ones by owner
        self._refused: set[SpaceId] = set()
        self._lock = threading.Lock()
        self._tick = itertools.count(1)
        self._closers: list[threading.Thread] = []
        self.closed = False
        self.evicted = 0  # spaces closed by the LRU bound (status, tests)

    def get(self, sid: SpaceId) -> Space | None:
        """The open space of ``sid``, opened if needed (not pinned)."""
        space = self._open.get(sid)
        if space is not None:
            return space
        with self._lock:
            return self._get_locked(sid)

    def _get_locked(self, sid: SpaceId) -> Space | None:
        space = self._open.get(sid)
        if space is not None or self.closed or sid in self._refused or sid.hash_bytes == -1:
            return space
        space = self._make(sid)
        if space is None:
            self._refused.add(sid)
            return None
        space.used = next(self._tick)
        self._open[sid] = space
        self._owners.setdefault(sid.owner, {})[sid] = space
        return space

    def _trim_locked(self) -> None:
        """Close the least recently used unpinned spaces beyond ``max_idle``."""
        over = len(self._open) - self.max_idle
        if over <= 0:
            return
        idle = sorted((s for s in self._open.values() if s.users == 0), key=lambda s: s.used)[:over]
        if not idle:
            return
        for s in idle:
            del self._open[s.sid]
            of_owner = self._owners[s.sid.owner]
            del of_owner[s.sid]
            if not of_owner:
                del self._owners[s.sid.owner]
            s.closed = True
        self.evicted += len(idle)
        t = threading.Thread(target=self._close_all, args=(idle,), name="fstier-lmcache-close", daemon=True)
        self._closers = [c for c in self._closers if c.is_alive()]
        self._closers.append(t)
        t.start()

    def _close_all(self, spaces: list[Space]) -> None:
        for s in spaces:
            try:
                self._on_closed(s)
            except Exception:
                log.exception("fstier: closing the LMCache namespace %s failed", s.sid)

    def acquire(self, space: Space) -> Space | None:
        """Pin ``space`` (reopened if it was closed meanwhile); the space to
        use and :meth:`release` after, or None when it cannot be opened."""
        with self._lock:
            if space.closed:
                found = self._get_locked(space.sid)
                if found is None:
                    return None
                space = found
            space.users += 1
            space.used = next(self._tick)
            return space

    def release(self, space: Space) -> None:
        with self._lock:
            space.users -= 1
            if space.users == 0 and len(self._open) > self.max_idle:
                self._trim_locked()

    def of_owner(self, owner: Owner) -> list[Space]:
        with self._lock:
            return list(self._owners.get(owner, {}).values())

    def all(self) -> list[Space]:
        with self._lock:
            return list(self._open.values())

    def close(self) -> list[Space]:
        """Stop opening; the spaces still open (the caller closes them),
        once every closer thread finished."""
        with self._lock:
            self.closed = True
            spaces, self._open, self._owners = list(self._open.values()), {}, {}
            closers = list(self._closers)
        for t in closers:
            t.join()
        return spaces


class DiskIndex:
    """The LMCache namespaces under a root, as their manifests' fields by
    namespace name and by owner, listed again when older than ``ttl``
    seconds. A namespace's name is the digest of its fields, so a manifest
    is read once per name (a refresh lists the root and reads only new
    names' manifests)."""

    def __init__(self, tier: TierConfig, ttl: float = 2.0) -> None:
        self._tier = tier
        self._ttl = ttl
        self._read_at = -1e18
        self._fields: dict[str, dict[str, Any]] = {}
        self._other: set[str] = set()  # names that are not this adapter's namespaces
        self._by_owner: dict[tuple[Any, ...], list[dict[str, Any]]] = {}
        self._lock = threading.Lock()

    def fields(self, max_age: float | None = None) -> dict[str, dict[str, Any]]:
        """Manifest fields by namespace name (``max_age``: refresh when the
        last listing is older; default the index's ``ttl``)."""
        age = self._ttl if max_age is None else max_age
        with self._lock:
            if time.monotonic() - self._read_at > age:
                self._refresh_locked()
            return self._fields

    def _refresh_locked(self) -> None:
        try:
            names = {p.name: p for p, is_dir in scan.iter_namespace_dirs(self._tier.root_dir) if is_dir}
        except OSError:
            names = {}
        fields = {n: f for n, f in self._fields.items() if n in names}
        self._other &= names.keys()
        for name, path in names.items():
            if name not in fields and name not in self._other:
                f = lmcache_fields(self._tier, path)
                if f is None:
                    self._other.add(name)
                else:
                    fields[name] = f
        by_owner: dict[tuple[Any, ...], list[dict[str, Any]]] = {}
        for f in fields.values():
            by_owner.setdefault(_owner_fields(f), []).append(f)
        self._fields, self._by_owner = fields, by_owner
        self._read_at = time.monotonic()

    def of_name(self, name: str) -> dict[str, Any] | None:
        """One namespace's fields (None: not an LMCache namespace of this
        adapter's salt); a name the index lacks lists the root again if the
        listing is older than ``ttl`` (at most one per ``ttl`` for a burst
        of another engine's evicted files)."""
        found = self._fields.get(name)
        return found if found is not None else self.fields().get(name)

    def sids(self, owner: Owner, max_age: float | None = None) -> list[SpaceId]:
        """The namespaces on the root of ``owner`` (any layout): one dict lookup."""
        self.fields(max_age)
        ws, _, lws, lr = split_kv_rank(owner[1])
        out = []
        for f in self._by_owner.get((owner[0], owner[2], ws, lws, lr, owner[3]), ()):
            sid = space_of_fields(f, owner[1])
            if sid is not None:
                out.append(sid)
        return out


def _owner_fields(f: dict[str, Any]) -> tuple[Any, ...]:
    """A manifest's owner fields: model, salt, world size, local world size,
    local rank, short hash length (the global rank is a subtree)."""
    return (
        f.get("model"), f.get("cache_salt"), f.get("kv_world_size"), f.get("kv_local_world_size"),
        f.get("kv_local_rank"), f.get("hash_bytes"),
    )


def lmcache_fields(tier: TierConfig, path: Path) -> dict[str, Any] | None:
    """The manifest fields of the namespace directory ``path`` when it is a
    valid LMCache namespace of ``tier``'s ``namespace_salt``, else None."""
    manifest = scan.check_namespace(path).manifest
    if manifest is None:
        return None
    f = manifest.fields
    if f.get("engine") != "lmcache" or f.get("namespace_salt") != tier.namespace_salt:
        return None
    return f


def lmcache_namespaces(tier: TierConfig, model_name: str | None) -> Iterator[tuple[Path, dict[str, Any]]]:
    """``(directory, manifest fields)`` of every valid LMCache namespace of
    ``tier``'s root and ``namespace_salt`` (of ``model_name``, if given)."""
    try:
        entries = sorted(scan.iter_namespace_dirs(tier.root_dir))
    except OSError:
        return
    for path, is_dir in entries:
        f = lmcache_fields(tier, path) if is_dir else None
        if f is not None and (model_name is None or f.get("model") == model_name):
            yield path, f


def _kv_rank(f: dict[str, Any], rank: int) -> int:
    ws, lws, lr = int(f["kv_world_size"]), int(f["kv_local_world_size"]), int(f["kv_local_rank"])
    return (ws << 24) | (rank << 16) | (lws << 8) | lr  # LMCache's ObjectKey.ComputeKVRank


def walk_keys(tier: TierConfig, model_name: str | None) -> Iterator[tuple[str, SpaceId, bytes, int]]:
    """``(path, namespace, chunk hash, object group)`` of every chunk file of
    the root's LMCache namespaces (of ``model_name``, if given)."""
    for path, f in lmcache_namespaces(tier, model_name):
        for e in scan.iter_namespace_files(path):
            if e.kind != "block" or e.key is None or e.rank is None:
                continue
            sid = space_of_fields(f, _kv_rank(f, e.rank))
            if sid is None:
                break  # not a namespace this adapter writes
            yield e.path, sid, sid.chunk_hash(e.key.block_hash), e.key.group_idx


def key_of_path(
    root: str, path: str, index: DiskIndex, make_key: Callable[..., Any]
) -> tuple[Any, int] | None:
    """The LMCache key (``make_key(hash, model, kv_rank, group, salt)``) and
    file bytes of the block file ``path`` under ``root``, or None when it
    is not a chunk file of an LMCache namespace of this adapter's kind."""
    if not path.startswith(root.rstrip("/") + "/"):
        return None
    parts = path[len(root.rstrip("/")) + 1 :].split("/")
    if len(parts) < 3 or not parts[1].startswith("r") or not parts[1][1:].isdigit():
        return None
    key = decode(parts[-1])
    f = index.of_name(parts[0])
    if key is None or f is None:
        return None
    try:
        sid = space_of_fields(f, _kv_rank(f, int(parts[1][1:])))
    except (KeyError, TypeError, ValueError):
        return None
    if sid is None:
        return None
    okey = make_key(sid.chunk_hash(key.block_hash), sid.model_name, sid.kv_rank, key.group_idx, sid.cache_salt)
    return okey, block_file_size(sid.layout.nbytes)
