"""Block keys to file paths, under a namespace that digests every byte-changing field.

Layout on disk (see docs/format.md)::

    <root>/<safe_model_name>-<digest16>/config.json           manifest
    <root>/<safe_model_name>-<digest16>/[r<rank>/]abc/de/<hash hex>-g<group>.bin

The digest is the first 16 hex chars of sha256 over the canonical JSON
(sorted keys, no spaces) of :meth:`FileMapper.namespace_fields`. When the
model is parallel-agnostic (:func:`is_parallel_agnostic`) tp/pp/pcp/dcp are
written as 1 and there is no rank segment, so every parallel layout of the
same model shares one directory; otherwise they stay in the digest and each
rank has its own ``r<rank>`` subtree.

An engine that owns its byte layout (vLLM's offloading rows) defines the
namespace itself: :meth:`FileMapper.for_engine` digests the engine's fields
and follows the engine's parallel-agnostic verdict, with the same layout.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import re
import stat
import threading
from pathlib import Path
from typing import Any

from fstier.canonical import canonical_format_id, canonical_page_bytes, is_certified
from fstier.config import FstierConfig, ModelSpec, ParallelSpec
from fstier.errors import FstierError, NamespaceMismatchError, PathSafetyError, StorageError
from fstier.keys import BlockKey

__all__ = [
    "BLOCK_NAME_RE",
    "BLOCK_SUFFIX",
    "MANIFEST_NAME",
    "NAMESPACE_VERSION",
    "FileMapper",
    "canonical_json",
    "decode",
    "encode",
    "is_parallel_agnostic",
    "safe_model_name",
]

NAMESPACE_VERSION = 1
BLOCK_SUFFIX = ".bin"
#: The namespace manifest's file name, in the namespace directory.
MANIFEST_NAME = "config.json"
#: A block file's name, as :meth:`FileMapper.path_for` writes it: the key's
#: hash in hex (8..64 bytes) and its group.
BLOCK_NAME_RE = re.compile(r"^([0-9a-f]{16,128})-g([0-9]{1,5})\.bin$")
_MAX_NAME = 64
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC
_UNSAFE = re.compile(r"[^A-Za-z0-9._-]")


def is_parallel_agnostic(model: ModelSpec, parallel: ParallelSpec) -> bool:
    """True only for exactly one KV group of kind ``full_attention`` (hence not
    MLA, not sliding window, not mamba) on a model runner other than ``v2``,
    whose pages this layout can map onto the canonical page (heads shard or
    replicate evenly, the block splits evenly over context-parallel ranks).
    See docs/parallel-agnostic.md for why each exclusion exists."""
    if len(model.groups) != 1:
        return False
    group = model.groups[0]
    return (
        group.kind == "full_attention"
        and parallel.model_runner != "v2"
        # Without a certified mapping the pages are rank-private: two layouts
        # with equal world size would share files they cannot read correctly.
        and is_certified(group, parallel)
    )


def safe_model_name(name: str) -> str:
    """One safe path component: ``/`` and anything outside ``[A-Za-z0-9._-]``
    become ``_``, a leading ``.`` becomes ``_``, at most 64 characters."""
    safe = _UNSAFE.sub("_", name)[:_MAX_NAME]
    if safe.startswith("."):
        safe = "_" + safe[1:]
    return safe or "model"


# ------------------------------------------------------------- the path codec
def encode(key: BlockKey) -> str:
    """THE path codec, key -> file: ``key``'s block file relative to the
    namespace's blocks directory, ``<hex[:3]>/<hex[3:5]>/<hex>-g<group>.bin``
    (two-level hex fan-out, the group in the name). A string: it is on every
    store's and lookup's path, where ``pathlib`` costs more than the rest."""
    h = key.block_hash.hex()
    return f"{h[:3]}/{h[3:5]}/{h}-g{key.group_idx}{BLOCK_SUFFIX}"


def decode(name: str) -> BlockKey | None:
    """THE path codec, file -> key: the key a block file's name holds, or
    None for any name :func:`encode` does not write. ``name`` is a file name,
    or a path relative to the blocks directory, which must then be exactly
    where :func:`encode` puts that key (a misplaced block name is None)."""
    dirs, _, base = name.rpartition("/")
    m = BLOCK_NAME_RE.match(base)
    if m is None or len(m.group(1)) % 2:
        return None
    try:
        key = BlockKey(bytes.fromhex(m.group(1)), int(m.group(2)))
    except (ValueError, FstierError):  # a hash length or group BlockKey refuses
        return None
    if dirs and encode(key) != name:
        return None
    return key


def canonical_json(obj: Any) -> bytes:
    """Sorted keys, no spaces, ASCII: what the namespace digest is taken over."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode()


_canonical_json = canonical_json


class FileMapper:
    """Maps :class:`BlockKey` to paths for one (model, parallel layout, tier) config."""

    def __init__(self, config: FstierConfig) -> None:
        self.config: FstierConfig | None = config
        self._setup(
            Path(config.tier.root_dir),
            config.model.name,
            is_parallel_agnostic(config.model, config.parallel),
            config.parallel.rank,
            self.namespace_fields(),
            [
                config.tier.blocks_per_file * canonical_page_bytes(g, config.parallel)
                for g in config.model.groups
            ],
        )

    @classmethod
    def for_engine(
        cls,
        root_dir: str | os.PathLike[str],
        model_name: str,
        fields: dict[str, Any],
        *,
        agnostic: bool,
        rank: int,
        payload_bytes: list[int],
    ) -> FileMapper:
        """A mapper whose namespace an engine defines (e.g. vLLM's offloading
        config, :mod:`fstier.integrations.vllm`) instead of a :class:`ModelSpec`.

        ``fields`` is digested as given (it must already hold every field that
        changes a file's bytes, with parallel sizes collapsed when
        ``agnostic``); ``payload_bytes[g]`` is the payload length of group
        ``g``'s files. The on-disk layout and manifest are the same as for a
        config-built mapper; :attr:`config` is ``None``."""
        if not isinstance(rank, int) or rank < 0:
            raise ValueError(f"FileMapper.for_engine: rank must be an int >= 0, got {rank!r}")
        if not payload_bytes or any(n <= 0 for n in payload_bytes):
            raise ValueError(
                f"FileMapper.for_engine: payload_bytes must list one size > 0 per group, "
                f"got {payload_bytes!r}"
            )
        self = cls.__new__(cls)
        self.config = None
        self._setup(
            Path(root_dir), model_name, agnostic, rank,
            {"namespace_version": NAMESPACE_VERSION, **fields}, list(payload_bytes),
        )
        return self

    def _setup(
        self,
        root: Path,
        model_name: str,
        agnostic: bool,
        rank: int,
        fields: dict[str, Any],
        payload_bytes: list[int],
    ) -> None:
        # The real path: block paths are then free of symlinks by
        # construction, and every later resolution refuses any symlink it
        # meets (fstier/io/fsops.py), planted below the root or not.
        self.root = Path(os.path.realpath(root))
        self.agnostic = agnostic
        self.fields = fields
        self._payload_bytes = payload_bytes
        self.digest = hashlib.sha256(_canonical_json(self.fields)).hexdigest()[:16]
        self.digest_bytes = bytes.fromhex(self.digest)
        self.namespace = f"{safe_model_name(model_name)}-{self.digest}"
        self.namespace_dir = self.root / self.namespace
        self.blocks_dir = self.namespace_dir if self.agnostic else self.namespace_dir / f"r{rank}"
        self._verified_dirs: set[str] = set()
        self._lock = threading.Lock()

    @property
    def num_groups(self) -> int:
        """Number of KV groups (valid ``BlockKey.group_idx`` values)."""
        return len(self._payload_bytes)

    # -- namespace -------------------------------------------------------
    def namespace_fields(self) -> dict[str, Any]:
        """Every field that changes the bytes of a block file, as digested."""
        cfg = self.config
        if cfg is None:  # an engine-defined namespace (for_engine)
            return dict(self.fields)
        model, par = cfg.model, cfg.parallel
        agnostic = is_parallel_agnostic(model, par)
        groups = [
            {
                "kind": g.kind,
                "block_size": g.block_size,
                "num_layers": g.num_layers,
                "num_kv_heads": g.num_kv_heads,
                "head_size": g.head_size,
                "dtype": g.dtype,
                "kv_layout": g.kv_layout,
                "sliding_window": g.sliding_window,
                "page_size_bytes": g.page_size_bytes,
                "page_bytes": g.page_bytes,
                "file_page_bytes": canonical_page_bytes(g, par),
                "format_id": canonical_format_id(g),
            }
            for g in model.groups
        ]
        return {
            "namespace_version": NAMESPACE_VERSION,
            "model": model.name,
            "revision": model.revision,
            "dtype": model.dtype,
            "groups": groups,
            "blocks_per_file": cfg.tier.blocks_per_file,
            "format_id": "+".join(str(g["format_id"]) for g in groups),
            "tp_size": 1 if agnostic else par.tp_size,
            "pp_size": 1 if agnostic else par.pp_size,
            "pcp_size": 1 if agnostic else par.pcp_size,
            "dcp_size": 1 if agnostic else par.dcp_size,
            "cp_kv_cache_interleave_size": 1 if agnostic else par.cp_kv_cache_interleave_size,
            "model_runner": par.model_runner,
            "namespace_salt": cfg.tier.namespace_salt,
        }

    def manifest(self) -> dict[str, Any]:
        """The content of ``config.json``: the digested fields plus identity."""
        return {
            "fstier_manifest": NAMESPACE_VERSION,
            "namespace": self.namespace,
            "digest": self.digest,
            "parallel_agnostic": self.agnostic,
            "fields": self.fields,
        }

    def ensure_manifest(self) -> None:
        """Create the namespace directory and write ``config.json`` once,
        atomically. An existing manifest with other fields is refused; a root
        that cannot be created or written is a :class:`StorageError` naming it."""
        try:
            self._ensure_manifest()
        except FstierError:
            raise
        except OSError as exc:
            raise self._storage_error(exc) from None

    def _storage_error(self, exc: OSError) -> StorageError:
        where = exc.filename or self.namespace_dir
        return StorageError(
            f"tier.root_dir {str(self.root)!r}: cannot create or write {str(where)!r} "
            f"({exc.strerror or exc}); fix its permissions or mount, or choose another root_dir",
            exc.errno,
        )

    def _ensure_manifest(self) -> None:
        # Here, not at module level: naming a block (and `fstier config
        # validate`) imports no part of the I/O layer.
        from fstier.io.fsops import atomic_write
        from fstier.io.manifest import read_manifest

        self._check_root()
        self.namespace_dir.mkdir(mode=0o755, exist_ok=True)
        self._check_not_symlink(self.namespace_dir)
        path = self.namespace_dir / MANIFEST_NAME
        want = self.manifest()
        # A symlink, FIFO, oversized, malformed or mistyped manifest is
        # refused with NamespaceMismatchError naming it (fstier/io/manifest.py).
        existing = read_manifest(self.namespace_dir)
        if existing is None:
            atomic_write(path, json.dumps(want, indent=2, sort_keys=True).encode(), fsync="file+dir")
            return
        if existing.fields != want["fields"]:
            raise NamespaceMismatchError(
                f"{path}: manifest fields differ from this config although the digest "
                f"{self.digest} matches; the directory was altered by hand. Move it aside."
            )

    # -- paths ------------------------------------------------------------
    def expected_payload_bytes(self, group_idx: int) -> int:
        """Payload length of a full file of group ``group_idx``."""
        return self._payload_bytes[group_idx]

    def path_for(self, key: BlockKey) -> Path:
        """The final path of ``key``'s block file (two-level hex fan-out)."""
        if key.group_idx >= self.num_groups:
            raise PathSafetyError(
                f"key group {key.group_idx} does not exist; the model has "
                f"{self.num_groups} group(s)"
            )
        return self.blocks_dir / encode(key)

    def ensure_parent(self, path: str | Path) -> None:
        """Create ``path``'s directories under the namespace, one ``mkdirat``
        per level inside directory fds opened with no symlink on their path,
        so nothing lands outside root even if a directory is swapped for a
        symlink meanwhile (that is refused with :class:`PathSafetyError`).

        Directories already made are remembered only to skip the ``mkdir``
        calls: the cache grants nothing, since every store resolves its
        directory again without following symlinks."""
        made = self.make_parent(path)
        if made is not None:
            os.close(made[0])

    def make_parent(self, path: str | Path) -> tuple[int, bool] | None:
        """:meth:`ensure_parent`, keeping what the walk opened: ``None`` when
        the directory was already known, else an fd of ``path``'s directory
        (opened with no symlink on its path; the caller closes it) and
        whether this call created it. A store into a new fan-out directory
        then needs no second resolution and no existence check. The walk
        goes through the I/O layer's system-call seam (``fsops.FS``), as
        the store itself does."""
        # The cache check runs on strings: it is every store's first step,
        # and building Path objects costs more than the rest of it.
        key = os.fspath(path).rpartition("/")[0]
        if key in self._verified_dirs:
            return None
        # Here, not at module level: `fstier --help` must not import numpy.
        from fstier.io import fsops
        ns = os.fspath(self.namespace_dir)
        if key != ns and not key.startswith(ns + "/"):
            raise ValueError(f"{path!r} is not under the namespace directory {ns}")
        # Strings, not pathlib: with 4096 x 256 fan-out directories most new
        # keys create one, and Path parsing cost more than the mkdirs
        # (issue 14). The walk starts at the deepest directory already made
        # (opened again with no symlink on its path, as the namespace is).
        parts = key[len(ns) + 1 :].split("/") if key != ns else []
        start, base = 0, ns
        for i in range(len(parts) - 1, 0, -1):
            ancestor = f"{ns}/{'/'.join(parts[:i])}"
            if ancestor in self._verified_dirs:
                start, base = i, ancestor
                break
        try:
            fd = fsops.FS.open(base, _DIR_FLAGS)
        except FileNotFoundError:
            if base == ns:
                raise
            # That ancestor was removed too (gc of empty directories, an
            # operator's rm -rf): forget it and walk from the namespace.
            with self._lock:
                self._verified_dirs.discard(base)
            start, base = 0, ns
            try:
                fd = fsops.FS.open(base, _DIR_FLAGS)
            except OSError as exc:
                raise self._unsafe(Path(base), exc) from None
        except OSError as exc:
            raise self._unsafe(Path(base), exc) from None
        made: list[str] = []
        fresh = False
        try:
            current = base
            for part in parts[start:]:
                current = f"{current}/{part}"
                try:
                    fsops.FS.mkdir_at(fd, part, 0o755)
                    fresh = True
                except FileExistsError:
                    fresh = False
                try:
                    nfd = fsops.FS.openat(fd, part, _DIR_FLAGS)
                except OSError as exc:
                    raise self._unsafe(Path(current), exc) from None
                fsops.FS.close(fd)
                fd = nfd
                made.append(current)
        except BaseException:
            with contextlib.suppress(OSError):
                fsops.FS.close(fd)
            raise
        with self._lock:
            self._verified_dirs.update(made)
        return fd, fresh

    @staticmethod
    def _unsafe(path: Path, exc: OSError) -> Exception:
        if exc.errno in (errno.ELOOP, errno.ENOTDIR):
            return PathSafetyError(
                f"{path} (or a directory above it, below the root) is a symlink or not a "
                "directory; fstier refuses to follow it. Remove it."
            )
        return exc

    def forget_parent(self, path: str | Path) -> None:
        """Drop ``path``'s directory from the verified cache, so the next
        :meth:`ensure_parent` re-creates and re-checks it (it was removed)."""
        with self._lock:
            self._verified_dirs.discard(os.fspath(path).rpartition("/")[0])

    def _check_root(self) -> None:
        try:
            self.root.mkdir(parents=True, exist_ok=True)
        except FileExistsError:
            raise PathSafetyError(f"tier.root_dir {str(self.root)!r} exists and is not a directory") from None
        if not self.root.is_dir():
            raise PathSafetyError(f"tier.root_dir {str(self.root)!r} is not a directory")

    @staticmethod
    def _check_not_symlink(path: Path) -> None:
        st = os.lstat(path)
        if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode):
            raise PathSafetyError(
                f"{path} is a symlink or not a directory; fstier refuses to follow it. Remove it."
            )
