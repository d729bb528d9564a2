"""The namespace manifest (``config.json``): the typed model and the
hardened reader.

A namespace is **valid** when its ``config.json`` is a regular file (opened
``O_NOFOLLOW|O_NONBLOCK``, so a symlink or FIFO there is refused without
blocking) of at most :data:`MANIFEST_MAX_BYTES`, holds JSON that parses into a
:class:`Manifest` (strict types; a too deeply nested document is refused, not
a ``RecursionError``), names this directory, and carries a digest that is the
sha256 of its own fields and the directory's suffix. Anything else is refused
with :class:`~fstier.errors.NamespaceMismatchError` naming the path and the
fix. Reading costs one ``open``, one ``fstat`` and a read of at most 64 KiB.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import stat
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationError

from fstier.errors import FstierError, NamespaceMismatchError, PathSafetyError, StorageError
from fstier.file_mapper import MANIFEST_NAME, FileMapper, canonical_json
from fstier.io.fsops import atomic_write, open_nofollow

__all__ = [
    "MANIFEST_MAX_BYTES",
    "ensure_manifest",
    "manifest_bytes",
    "MANIFEST_NAME",
    "Manifest",
    "ManifestFields",
    "parse_json_object",
    "parse_manifest",
    "read_manifest",
    "read_manifest_bytes",
]

#: A manifest is about 2 KiB; anything much larger was not written by fstier.
MANIFEST_MAX_BYTES = 64 * 1024
#: JSON nesting deeper than this is refused before parsing (fstier writes 4).
_MAX_DEPTH = 32


class ManifestFields(BaseModel):
    """The digested fields readers use, with their types. Other fields (an
    engine's own) are kept as they are; a known field of the wrong type
    makes the manifest invalid."""

    model_config = ConfigDict(strict=True, extra="allow", frozen=True)

    model: str | None = None
    revision: str | None = None
    tp_size: int | None = None
    pp_size: int | None = None
    format_id: str | None = None
    blocks_per_file: int | None = None
    groups: list[dict[str, Any]] | None = None

    def file_page_bytes(self) -> dict[int, int]:
        """Group index -> page bytes in a file, where the manifest says."""
        out: dict[int, int] = {}
        for idx, g in enumerate(self.groups or []):
            v = g.get("file_page_bytes")
            if isinstance(v, int) and not isinstance(v, bool) and v > 0:
                out[idx] = v
        return out


class Manifest(BaseModel):
    """A parsed, checked ``config.json``."""

    model_config = ConfigDict(strict=True, extra="allow", frozen=True)

    fstier_manifest: int
    namespace: str
    digest: str
    parallel_agnostic: bool
    fields: dict[str, Any]

    @property
    def typed_fields(self) -> ManifestFields:
        return ManifestFields.model_validate(self.fields)


def _json_depth_ok(raw: bytes) -> bool:
    """Nesting of ``[``/``{`` outside strings stays within :data:`_MAX_DEPTH`
    (json.loads would raise RecursionError on ~1000 levels)."""
    depth = 0
    in_str = esc = False
    for c in raw:
        if in_str:
            if esc:
                esc = False
            elif c == 0x5C:  # backslash
                esc = True
            elif c == 0x22:
                in_str = False
        elif c == 0x22:
            in_str = True
        elif c in (0x5B, 0x7B):
            depth += 1
            if depth > _MAX_DEPTH:
                return False
        elif c in (0x5D, 0x7D):
            depth -= 1
    return True


def _refuse(path: Path, why: str) -> NamespaceMismatchError:
    return NamespaceMismatchError(
        f"{path}: unreadable manifest ({why}); fstier did not write it. Move the "
        "namespace directory aside (or remove it) and fstier starts a fresh one."
    )


def read_manifest_bytes(path: Path, dir_fd: int | None = None) -> bytes | None:
    """The bytes of a manifest file, or None if there is none. A symlink,
    FIFO or other non-regular file, or one over the size cap, is refused with
    :class:`NamespaceMismatchError`; I/O errors are ``OSError``. With
    ``dir_fd`` (the namespace directory, held), the file is opened in that
    directory, ``path`` only names it in messages."""
    flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK
    try:
        # O_NONBLOCK: a FIFO must not block the open (FsTier start, the CLI).
        fd = (
            open_nofollow(path, flags) if dir_fd is None
            else os.open(path.name, flags | os.O_CLOEXEC, dir_fd=dir_fd)
        )
    except FileNotFoundError:
        return None
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENOTDIR):
            raise _refuse(path, "a symlink is on its path") from None
        if exc.errno == errno.ENXIO:  # a socket
            raise _refuse(path, "not a regular file") from None
        raise
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise _refuse(path, "not a regular file")
        if st.st_size > MANIFEST_MAX_BYTES:
            raise _refuse(path, f"{st.st_size} bytes, more than the {MANIFEST_MAX_BYTES} a manifest may hold")
        chunks = []
        left = MANIFEST_MAX_BYTES + 1
        while left > 0:
            b = os.read(fd, left)
            if not b:
                break
            chunks.append(b)
            left -= len(b)
        raw = b"".join(chunks)
        if len(raw) > MANIFEST_MAX_BYTES:
            raise _refuse(path, f"more than the {MANIFEST_MAX_BYTES} bytes a manifest may hold")
        return raw
    finally:
        os.close(fd)


def parse_json_object(path: Path, raw: bytes) -> dict[str, Any]:
    """Manifest bytes as a JSON object, or refused (deep nesting included)."""
    if not _json_depth_ok(raw):
        raise _refuse(path, f"JSON nested deeper than {_MAX_DEPTH} levels")
    try:
        data = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise _refuse(path, f"not valid JSON ({exc})") from None
    if not isinstance(data, dict):
        raise _refuse(path, f"a JSON {type(data).__name__}, not an object")
    return data


def parse_manifest(path: Path, raw: bytes) -> Manifest:
    """Parse manifest bytes into a :class:`Manifest` or refuse them."""
    data = parse_json_object(path, raw)
    try:
        manifest = Manifest.model_validate(data)
        manifest.typed_fields  # noqa: B018 - validates the known fields' types
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"])
        raise _refuse(path, f"field {where!r}: {first['msg']}") from None
    return manifest


def read_manifest(namespace_dir: Path, dir_fd: int | None = None) -> Manifest | None:
    """The checked manifest of ``namespace_dir`` (read through ``dir_fd``,
    that directory held, when given), None when it has none.

    Raises :class:`NamespaceMismatchError` when the manifest is not one
    fstier wrote for this directory (see the module docstring)."""
    path = namespace_dir / MANIFEST_NAME
    raw = read_manifest_bytes(path, dir_fd)
    if raw is None:
        return None
    manifest = parse_manifest(path, raw)
    digest = hashlib.sha256(canonical_json(manifest.fields)).hexdigest()[:16]
    if manifest.digest != digest:
        raise _refuse(
            path, f"its fields differ from its digest {manifest.digest!r} (they hash to {digest}): altered by hand"
        )
    if manifest.namespace != namespace_dir.name or not namespace_dir.name.endswith("-" + digest):
        raise _refuse(path, f"it names namespace {manifest.namespace!r}, not this directory")
    return manifest


# ------------------------------------------------------------------- writing
def ensure_manifest(mapper: FileMapper, *, make_root: bool = True) -> None:
    """Create ``mapper``'s namespace directory and write its ``config.json``
    once, atomically. An existing manifest with other fields is refused; a
    root that cannot be created or written is a :class:`StorageError`
    naming it. Costs a few system calls; FsTier calls it at start and when
    the namespace directory was removed under it, then with ``make_root``
    False: a root gone under a running tier (a filesystem unmounted, an
    ``rm -rf`` of it) is never made again, nor the directories above it
    (they are outside the root): a :class:`StorageError` instead."""
    try:
        _ensure_manifest(mapper, make_root)
    except FstierError:
        raise
    except OSError as exc:
        where = exc.filename or mapper.namespace_dir
        raise StorageError(
            f"tier.root_dir {str(mapper.root)!r}: cannot create or write {str(where)!r} "
            f"({exc.strerror or exc}); fix its permissions or mount, or choose another root_dir",
            exc.errno,
        ) from None


def manifest_bytes(mapper: FileMapper) -> bytes:
    """The bytes of ``mapper``'s ``config.json`` as fstier writes it (here,
    and in C when the C engine makes a removed namespace directory again)."""
    return json.dumps(mapper.manifest(), indent=2, sort_keys=True).encode()


def _ensure_manifest(mapper: FileMapper, make_root: bool) -> None:
    root = mapper.root
    try:
        if make_root:
            root.mkdir(parents=True, exist_ok=True)
    except FileExistsError:
        raise PathSafetyError(f"tier.root_dir {str(root)!r} exists and is not a directory") from None
    if not root.is_dir():
        raise PathSafetyError(f"tier.root_dir {str(root)!r} is not a directory")
    ns = mapper.namespace_dir
    ns.mkdir(mode=0o755, exist_ok=True)
    st = os.lstat(ns)
    if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode):
        raise PathSafetyError(f"{ns} is a symlink or not a directory; fstier refuses to follow it. Remove it.")
    path = ns / MANIFEST_NAME
    want = mapper.manifest()
    # A symlink, FIFO, oversized, malformed or mistyped manifest is refused
    # with NamespaceMismatchError naming it (read_manifest).
    existing = read_manifest(ns)
    if existing is None:
        atomic_write(path, manifest_bytes(mapper), fsync="file+dir")
        return
    if existing.fields != want["fields"]:
        raise NamespaceMismatchError(
            f"{path}: manifest fields differ from this config although the digest "
            f"{mapper.digest} matches; the directory was altered by hand. Move it aside."
        )
