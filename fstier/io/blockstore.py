"""The block store: one namespace's block files, key -> file end to end.

:class:`BlockStore` is the one object that turns a key into a file and back
(naming comes from :func:`fstier.file_mapper.encode`; callers never build a
path): it makes the namespace (:func:`fstier.io.manifest.ensure_manifest`),
creates fan-out directories without following a symlink
(:class:`NamespaceDirs`), recovers when they were removed under it (an
operator's ``rm -rf``, gc of empty directories), builds each block's header,
and stores, loads, checks and removes blocks through the per-file path of
:mod:`fstier.io._blockio`.

API shape (the seam between backends)
    Per key: :meth:`BlockStore.store`, :meth:`~BlockStore.load`,
    :meth:`~BlockStore.remove`, :meth:`~BlockStore.exists`; per batch:
    :meth:`~BlockStore.store_many`, :meth:`~BlockStore.load_many`,
    :meth:`~BlockStore.present_many` and :meth:`~BlockStore.remove_many`,
    which take a batch of keys and return
    one answer per key in order, and :meth:`~BlockStore.touch_many`
    (recency: a batch of paths' mtimes set to now). The backend is a constructor argument,
    chosen once: native (:mod:`fstier.io.native`: the whole batch in one
    call, GIL released) or Python, key by key (:mod:`fstier.io._blockio`).
    Either way the contract is the same: the same outcomes, the same files,
    the same promises (exact-length buffers, no symlink followed, atomic
    publication, the one validator); ``tests/test_contract_block_store.py``
    runs every case on both. A native batch hands the keys it cannot finish
    itself (a directory removed under it: ENOENT; a file to replace) to the
    per-key Python path, which re-creates directories and removes the old
    file. Fault injection: the Python path's calls go through the syscall
    seam ``fsops.FS``, the native path's through :func:`fstier.io.native.fault`.
    :meth:`~BlockStore.batch_plan` says how a caller should cut a job into
    batches and how many C helper threads each native call may start.

Costs
    A native batch: one call for the batch (Python around it per batch, no bytecode per key unless a
    key failed or must be replaced), then per key the system calls below, made in C. A store into a
    directory already made: the per-file store path (7 system calls). Into a new fan-out directory:
    the walk's ``mkdirat``/``openat`` calls, then the store through the fd the walk opened (no
    second resolution, no existence check). A load: 3 system calls. Directories known to exist are
    remembered only to skip ``mkdir`` calls: the memory grants nothing, since every store resolves
    its directory again without following a symlink.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import stat
from collections.abc import Callable, Sequence
from itertools import starmap
from operator import attrgetter, itemgetter
from typing import TYPE_CHECKING

from fstier.errors import FstierError
from fstier.file_mapper import FileMapper, decode, encode, encode_many
from fstier.io import fsops, native
from fstier.io._blockio import load_block, store_block, store_block_at
from fstier.io.blockfile import BlockHeader, ChecksumKind, payload_checksum
from fstier.io.capabilities import RootCapabilities
from fstier.io.engine import record as plans
from fstier.io.iotypes import (
    IOOptions,
    LoadOutcome,
    LoadRequest,
    StoreOutcome,
    StoreRequest,
    StoreStatus,
)
from fstier.io.manifest import ensure_manifest
from fstier.io.nsdirs import DIR_FLAGS as _DIR_FLAGS
from fstier.io.nsdirs import NamespaceDirs
from fstier.io.tree import iter_namespace_files
from fstier.keys import BlockKey

if TYPE_CHECKING:  # pragma: no cover
    from fstier.clock import Clock
    from fstier.config import TierConfig

__all__ = ["BlockStore", "NamespaceDirs"]

log = logging.getLogger("fstier.manager")
_STATUS = attrgetter("status")
_FIRST, _SECOND = itemgetter(0), itemgetter(1)

_PATH_DIR_FLAGS = getattr(os, "O_PATH", os.O_RDONLY) | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


def _padded(got: list[bool], n: int) -> list[bool]:
    """A prefix probe's answers (it stops after its first miss) padded with False to ``n``."""
    if len(got) < n:
        got.extend([False] * (n - len(got)))
    return got


def _present_python(base: str, paths: Sequence[str], prefix: bool) -> list[bool]:
    """:meth:`BlockStore.present_many` on the Python path: ``base`` (the
    blocks directory) opened once with no symlink on its path (through the
    syscall seam), each fan-out directory opened once below it with
    ``O_NOFOLLOW`` (one fd open at a time: a batch never runs out of
    descriptors), then one ``fstatat`` (no follow) per name in it."""
    n = len(paths)
    out = [False] * n
    try:
        base_fd = fsops.FS.open(base, _DIR_FLAGS)
    except (OSError, ValueError):
        return out
    cut = len(base) + 1
    try:
        for d, idx in _runs(paths, cut) if prefix else _groups(paths, cut):
            try:
                dfd = os.open(d, _PATH_DIR_FLAGS, dir_fd=base_fd) if d and "/" not in d else fsops.FS.open(
                    f"{base}/{d}" if d else base, _DIR_FLAGS
                )
            except (OSError, ValueError):
                if prefix:
                    break
                continue
            try:
                for i in idx:
                    try:
                        out[i] = stat.S_ISREG(os.lstat(paths[i].rpartition("/")[2], dir_fd=dfd).st_mode)
                    except (OSError, ValueError):
                        out[i] = False
                    if prefix and not out[i]:
                        return out
            finally:
                os.close(dfd)
    finally:
        os.close(base_fd)
    return out


def _unzip(items: Sequence[tuple[BlockKey, memoryview]]) -> tuple[list[BlockKey], list[memoryview]]:
    """A batch's keys and buffers, as two lists (C-level loops)."""
    return list(map(_FIRST, items)), list(map(_SECOND, items))


def _groups(paths: Sequence[str], cut: int) -> list[tuple[str, list[int]]]:
    """Keys grouped by directory (each directory opened once)."""
    groups: dict[str, list[int]] = {}
    for i, p in enumerate(paths):
        groups.setdefault(p[cut:].rpartition("/")[0], []).append(i)
    return list(groups.items())


def _runs(paths: Sequence[str], cut: int) -> list[tuple[str, list[int]]]:
    """Keys in their own order, consecutive keys of one directory together
    (a prefix probe stops at the first absent key)."""
    runs: list[tuple[str, list[int]]] = []
    for i, p in enumerate(paths):
        d = p[cut:].rpartition("/")[0]
        if runs and runs[-1][0] == d:
            runs[-1][1].append(i)
        else:
            runs.append((d, [i]))
    return runs


class BlockStore:
    """The block files of ``mapper``'s namespace, stored with ``options``,
    batches run by ``backend`` (:func:`fstier.io.native.status` chooses it
    from ``tier.native_io`` and ``FSTIER_NATIVE``;
    :func:`~fstier.io.native.python_backend` and
    :func:`~fstier.io.native.native_backend` name one). The backend is chosen
    once, here: nothing a caller patches later changes it.

    ``blocks_per_file`` is what each header records as its page count (a
    file's payload holds that many pages). :attr:`io_path` says which
    backend runs and why."""

    def __init__(
        self,
        mapper: FileMapper,
        options: IOOptions,
        backend: native.NativeStatus,
        *,
        blocks_per_file: int = 1,
    ) -> None:
        self.mapper = mapper
        self.options = options
        self._bpf = blocks_per_file
        self._prefix = os.fspath(mapper.blocks_dir)
        self.dirs = NamespaceDirs(mapper)
        #: which path the batch methods run (fstier.io.native): "native" or "python"
        self.io_path = backend
        self._native = backend.backend == "native"
        #: a probe may trust the kernel's caches: the root is on a local filesystem (RootCapabilities.coherent_cache)
        self._cached = options.capabilities is not None and options.capabilities.coherent_cache

    @classmethod
    def for_tier(cls, mapper: FileMapper, tier: TierConfig, clock: Clock | None = None) -> BlockStore:
        """The store a tier runs on: the namespace made (manifest, blocks
        directory, through directory fds), the root's capabilities probed for
        this root alone (an NFS mount elsewhere in the process never changes how this one
        is written; one that could not run is repeated by ``clock``), options and backend from ``tier``."""
        ensure_manifest(mapper)
        NamespaceDirs(mapper).ensure(f"{mapper.blocks_dir}/_")
        caps = RootCapabilities.probe(mapper.namespace_dir, tier.o_direct, clock=clock)
        return cls(
            mapper, IOOptions.from_tier(tier, caps), native.log_selection_once(tier.native_io),
            blocks_per_file=tier.blocks_per_file,
        )

    @property
    def batched(self) -> bool:
        """True when the batch methods run as one native call per batch."""
        return self._native

    def batch_plan(self, n: int, threads: int) -> tuple[tuple[int, ...], int]:
        """``(bounds, helpers)``: ``n`` keys moved by ``threads`` threads as batch calls
        (``keys[bounds[j]:bounds[j + 1]]``) with up to ``helpers`` C threads each
        (:func:`fstier.io.engine.record.plan`: native, one call per job; Python, one key per call)."""
        return plans.plan(n, threads, self._native)

    def batch_bounds(self, n: int, threads: int) -> tuple[int, ...]:
        """One batch call per thread, no helpers (:func:`fstier.io.engine.record.bounds`)."""
        return plans.bounds(n, threads, self._native)

    # ------------------------------------------------------------- naming
    def path(self, key: BlockKey) -> str:
        """``key``'s file (a string: this is on every lookup's path)."""
        return f"{self._prefix}/{encode(key)}"

    def paths(self, keys: Sequence[BlockKey]) -> list[str]:
        """:meth:`path` of each key, with no bytecode per key."""
        return encode_many(keys, self._prefix + "/")

    def key_of(self, path: str) -> BlockKey | None:
        """The key whose file ``path`` names, when it is below this store's
        blocks directory and its name decodes (:func:`fstier.file_mapper.decode`);
        else None (another namespace's file, a temp file)."""
        if not path.startswith(self._prefix + "/"):
            return None
        return decode(path.rpartition("/")[2])

    # ----------------------------------------------------------- namespace
    def ensure_namespace(self) -> None:
        """Make the namespace directory, its manifest and the blocks directory."""
        ensure_manifest(self.mapper)
        self.dirs.ensure(f"{self._prefix}/_")

    def _namespace_back(self) -> bool:
        """Re-create the namespace directory and its manifest if they were
        removed under a running tier (an operator's ``rm -rf`` of the cache);
        True when it did. Without this every later store failed ENOENT until
        a restart, since the fan-out walk starts at the namespace."""
        if os.path.lexists(self.mapper.namespace_dir):
            return False
        try:
            ensure_manifest(self.mapper, make_root=False)  # a root gone is never made again here
        except FstierError:  # root gone or unwritable: the store fails as it would
            return False
        log.warning(
            "fstier: namespace directory %s was removed under a running tier; re-created it",
            self.mapper.namespace_dir,
        )
        return True

    # ------------------------------------------------------------ per key
    def header(self, key: BlockKey, payload: memoryview) -> BlockHeader:
        """The header of ``key``'s file holding ``payload`` (checksummed per options)."""
        n = len(payload)
        checksum = self.options.checksum
        return BlockHeader(
            key=key,
            namespace_digest=self.mapper.digest_bytes,
            payload_len=n,
            page_count=self._bpf,
            page_bytes=n // self._bpf,
            checksum_kind=ChecksumKind.XXH3_64 if checksum else ChecksumKind.NONE,
            payload_checksum=payload_checksum(payload) if checksum else 0,
        )

    def store(self, key: BlockKey, payload: memoryview, *, replace: bool = False) -> StoreOutcome:
        """Store exactly ``payload`` as ``key``'s file (on this store's
        backend). SKIPPED when a file is already there, unless ``replace``
        (its last load failed without proof of corruption: replace the file
        rather than skip onto it). Never raises ``OSError`` for the store
        itself; a path refused as unsafe is :class:`PathSafetyError`."""
        return self.store_many([(key, payload)], replace=[replace])[0]

    def _store_guarded(
        self, key: BlockKey, payload: memoryview, replace: bool, path: str | None = None
    ) -> StoreOutcome:
        """:meth:`_store_one`, its refusal (:class:`PathSafetyError`: a
        fan-out directory swapped for a symlink) or unexpected ``OSError``
        turned into this key's FAILED outcome, so one key never fails the
        keys stored beside it in a batch
        (test_contract_block_store.py::test_one_refused_key_fails_alone)."""
        try:
            return self._store_one(key, payload, replace, path)
        except OSError as exc:
            return StoreOutcome(StoreStatus.FAILED, fsops.errno_name(exc), str(exc))
        except FstierError as exc:
            return StoreOutcome(StoreStatus.FAILED, type(exc).__name__, str(exc))

    def _store_one(self, key: BlockKey, payload: memoryview, replace: bool, path: str | None = None) -> StoreOutcome:
        """:meth:`store` on the Python path (and the native path's hand-back)."""
        header = self.header(key, payload)
        path = self.path(key) if path is None else path
        try:
            opened = self.dirs.open_parent(path)
        except FileNotFoundError:
            if not self._namespace_back():
                raise
            opened = self.dirs.open_parent(path)
        if replace:
            with contextlib.suppress(FileNotFoundError):
                fsops.FS.unlink(path)
        request = StoreRequest(path, header, payload)
        if opened is None:
            outcome = store_block(request, self.options)
        else:
            # The directory was just made (or checked): store through the
            # fd that walk opened, with no second resolution
            # (test_posix.py::test_store_block_at_a_directory_fd).
            dir_fd, fresh = opened
            try:
                outcome = store_block_at(
                    dir_fd, path.rpartition("/")[2], header, payload, self.options, fresh=fresh
                )
            finally:
                fsops.FS.close(dir_fd)
        if outcome.status is StoreStatus.FAILED and outcome.cause == "ENOENT":
            # The fan-out directory was removed under us (an operator's
            # rm -rf, another host, gc of empty dirs): re-create it once
            # instead of failing every later store into it (the whole
            # namespace directory too, manifest included).
            self._namespace_back()
            self.dirs.forget(path)
            self.dirs.ensure(path)
            outcome = store_block(request, self.options)
        return outcome

    def load(self, key: BlockKey, buffer: memoryview) -> LoadOutcome:
        """Load ``key``'s file into exactly ``buffer`` (its length is the
        payload length the caller expects) and check it with the one
        validator, on this store's backend; a proven-corrupt file is removed."""
        return self.load_many([(key, buffer)])[0]

    def _load_one(self, key: BlockKey, buffer: memoryview, path: str) -> LoadOutcome:
        return load_block(
            LoadRequest(path, buffer, key, self.mapper.digest_bytes, len(buffer)),
            self.options,
        )

    def remove(self, key: BlockKey) -> bool:
        """Remove ``key``'s name; False when it was not removed (nothing there, a fan-out
        directory that is a file or a symlink, a directory at the name: as ``remove_batch``)."""
        try:
            fsops.FS.unlink(self.path(key))
        except OSError:
            return False
        return True

    def remove_many(self, keys: Sequence[BlockKey]) -> list[bool]:
        """:meth:`remove` of each key; True where a file was removed (a key that could not be fails itself
        only). Native: ONE GIL-free call for the batch (no symlink followed below the root); Python: per key."""
        if not keys:
            return []
        if self._native:
            return native.remove_batch(self._prefix, [self.path(k) for k in keys])
        return [self.remove(k) for k in keys]

    def touch_many(self, paths: Sequence[str]) -> None:
        """Set each file's mtime to now (its LRU recency): only a regular
        file with one link, reached with no symlink below the root; a file
        evicted or replaced meanwhile is skipped. Native: ONE call for the
        batch with the GIL released; Python: one touch per file."""
        if not paths:
            return
        if self._native:
            native.touch_batch(os.fspath(self.mapper.blocks_dir), paths)
            return
        for p in paths:
            fsops.touch_file(p)

    def exists(self, key: BlockKey) -> bool:
        """:meth:`present_many` of one key."""
        return self.present_many([key])[0]

    def present_many(self, keys: Sequence[BlockKey], *, prefix: bool = False) -> list[bool]:
        """Per key, whether its block file is present: a regular file at
        :meth:`path`, reached with no symlink in any component below the
        root (a FIFO, socket, directory or symlink at the name is absent, and
        so is a file reached through a symlinked fan-out directory). With
        ``prefix`` probing stops at the first absent key (the rest answer
        False). Never raises ``OSError``: what cannot be checked is absent.

        Costs: native, ONE call for the batch (one ``openat2`` + ``fstat``
        per key), the GIL held where a local filesystem's caches answer it,
        else released; Python, one directory open per distinct fan-out
        directory and one ``fstatat`` per key."""
        if not keys:
            return []
        paths = self.paths(keys)
        if self._native:
            got = native.lookup_batch(self._prefix, paths, prefix=prefix, cached=self._cached)
        else:
            got = _present_python(self._prefix, paths, prefix)
        return _padded(got, len(keys))

    def present_within(self, keys: Sequence[BlockKey], *, prefix: bool = False, timeout_s: float) -> list[bool] | None:
        """:meth:`present_many` with a deadline, on the calling thread: answered
        from a local filesystem's caches with the GIL held when they can, else the
        native probe runs on a C thread waited for at most ``timeout_s``
        (one GIL release, no Python thread hand-off); None past it. Native
        only (``ValueError`` on the Python path, whose caller keeps its own
        deadline thread)."""
        if not self._native:
            raise ValueError("present_within needs the native I/O path")
        if not keys:
            return []
        paths = self.paths(keys)
        got = native.lookup_within(self._prefix, paths, prefix=prefix, timeout_s=timeout_s, cached=self._cached)
        return None if got is None else _padded(got, len(keys))

    def clear(self, on_error: Callable[[OSError], None] | None = None) -> list[tuple[BlockKey, int]]:
        """Remove every block file this store names: the files under
        ``blocks_dir`` exactly where :meth:`path` puts their key (this rank's
        subtree, or the whole parallel-agnostic namespace). Temp files,
        other ranks' blocks, the manifest and foreign files stay. Returns
        ``(key, bytes)`` of each file removed; errors (naming the path) go to
        ``on_error`` and the walk goes on. Costs one walk of the namespace
        through directory fds (no symlink followed) and one unlink per file."""
        removed: list[tuple[BlockKey, int]] = []
        for e in iter_namespace_files(self.mapper.namespace_dir, on_error):
            key = e.key
            if key is None:
                continue
            if e.path != self.path(key):
                continue  # another rank's subtree
            if fsops.unlink_if(e.path, lambda _st: False, on_error) == "removed":
                removed.append((key, e.size))
        return removed

    # ------------------------------------------------------------ batches
    def _reprobe(self, caps: RootCapabilities) -> None:
        """The root's O_DIRECT probe could not run (a full pool at start):
        probe again (:meth:`RootCapabilities.reprobe`, on this I/O thread)
        and store the way it found (new options: the root's watchers told)."""
        dio = caps.reprobe()
        opts = self.options
        cold = caps.o_direct_mode == "cold"
        found = (dio.enabled and not cold, dio.enabled and cold, dio.alignment)
        if found != (opts.o_direct, opts.o_direct_cold, opts.alignment):
            self.options = dataclasses.replace(
                opts, o_direct=found[0], o_direct_cold=found[1], alignment=dio.alignment
            )
            caps.changed()  # what cached these options (the native engine's submit arguments) drops them

    def store_many(
        self, items: Sequence[tuple[BlockKey, memoryview]], *,
        replace: Sequence[bool] | None = None, helpers: int = 0, paths: Sequence[str] | None = None,
    ) -> list[StoreOutcome]:
        """Store every ``(key, payload)``; one outcome per item, in order (a
        failure does not stop the batch). ``replace[i]``: as :meth:`store`'s.
        ``helpers``: native only, up to this many more C threads share the batch
        (:meth:`batch_plan`; all started at once). ``paths``: the keys' :meth:`paths`,
        when the caller named them already (for its recency note): not encoded again."""
        flags = replace if replace is not None else [False] * len(items)
        caps = self.options.capabilities
        if caps is not None and caps.reprobe_due():
            self._reprobe(caps)
        keys, payloads = _unzip(items)
        paths = self._named(keys, paths)
        if not items or not self._native:
            return list(starmap(self._store_guarded, zip(keys, payloads, flags, paths, strict=True)))
        outs = native.store_batch(
            self._prefix, paths, keys, payloads, self.mapper.digest_bytes,
            self._bpf, self.options, helpers=helpers,
        )
        statuses = set(map(_STATUS, outs))  # C-level: most batches need no loop below
        if StoreStatus.FAILED not in statuses and (StoreStatus.SKIPPED not in statuses or not any(flags)):
            return outs
        for j, out in enumerate(outs):
            if (out.status is StoreStatus.FAILED and out.cause == "ENOENT") or (
                flags[j] and out.status is StoreStatus.SKIPPED
            ):
                outs[j] = self._store_guarded(keys[j], payloads[j], flags[j], paths[j])
        return outs

    def load_many(
        self, items: Sequence[tuple[BlockKey, memoryview]], *, helpers: int = 0, paths: Sequence[str] | None = None
    ) -> list[LoadOutcome]:
        """Load every ``(key, buffer)``; one outcome per item, in order (every key
        is attempted). ``helpers``, ``paths``: as :meth:`store_many`'s (a load's
        helpers: :func:`fstier.io.engine.record.load_eager`)."""
        keys, buffers = _unzip(items)
        paths = self._named(keys, paths)
        if not items or not self._native:
            return list(map(self._load_one, keys, buffers, paths))
        return native.load_batch(
            self._prefix, paths, keys, buffers,
            self.mapper.digest_bytes, self.options, helpers=helpers,
            eager=plans.load_eager(helpers, self.options.o_direct),
        )

    def _named(self, keys: Sequence[BlockKey], paths: Sequence[str] | None) -> Sequence[str]:
        """``paths`` a caller named ``keys`` with (one per key), else :meth:`paths`."""
        if paths is not None and len(paths) != len(keys):
            raise ValueError(f"{len(paths)} paths for {len(keys)} keys")
        return self.paths(keys) if paths is None else paths
