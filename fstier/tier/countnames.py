"""The names in ``<root>/.fstier-usage.d/`` (:mod:`fstier.tier.usage`) and
reading fstier < 0.6's count files.

- ``<instance>.<gen>.<stored>.<removed>.<inflight>.cnt``: one instance's
  count, carried by an empty file's name (:func:`count_name`,
  :func:`parse_count_name`); values are decimal, at most 20 digits; an
  instance is named ``<host>-<pid>-<8 hex>`` (:func:`instance_name`).
- ``<name>.count``: fstier < 0.6's count, one line
  ``fstier-usage 2 <stored> <removed>`` rewritten by temp + rename; read by
  :func:`read_legacy_count` (regular files of at most 256 bytes, opened
  ``O_NOFOLLOW|O_NONBLOCK``), never written.
- ``<instance>.<bytes>.<digest>.scn``: a settled scan an instance shares
  (:func:`scan_name`, :func:`parse_scan_name`): the block bytes its walk
  found while no count moved, and a digest of every instance's count it
  saw then (:func:`counts_digest`); another instance whose counts are the
  same takes it as its own scan.
- Leftovers of a process killed mid-step (:func:`is_leftover`): a lease set
  aside while being taken over or given back, fstier < 0.6's temps.

Nothing here raises for what a file holds: bad content is ``None``.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
import secrets
import socket
import stat
from dataclasses import dataclass, field

__all__ = [
    "COUNT_SUFFIX",
    "Listing",
    "MAX_COUNT",
    "SCAN_SUFFIX",
    "count_name",
    "counts_digest",
    "instance_name",
    "is_leftover",
    "is_legacy_name",
    "parse_count_name",
    "parse_scan_name",
    "read_legacy_count",
    "read_listing",
    "scan_name",
]

COUNT_SUFFIX = ".cnt"
SCAN_SUFFIX = ".scn"
#: the largest stored or removed byte count believed (2^60)
MAX_COUNT = 1 << 60
_COUNT_NAME = re.compile(
    r"^([A-Za-z0-9_-][A-Za-z0-9._-]{0,199})\.(\d{1,20})\.(\d{1,20})\.(\d{1,20})\.(\d{1,20})\.cnt$"
)
_SCAN_NAME = re.compile(r"^([A-Za-z0-9_-][A-Za-z0-9._-]{0,199})\.(\d{1,20})\.([0-9a-f]{32})\.scn$")
_LEGACY_NAME = re.compile(r"^[A-Za-z0-9._-]{1,200}\.count$")
_LEFTOVER_NAME = re.compile(r"^\.(evict\.lease\.old\.|.*\.tmp\.)")
_MAX_FILE = 256
_READ_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC


def instance_name() -> str:
    """A new instance's name: this host's name (made safe), this process's
    id and 32 random bits."""
    host = re.sub(r"[^A-Za-z0-9._-]", "_", socket.gethostname())[:64].lstrip(".")
    return f"{host or 'host'}-{os.getpid()}-{secrets.token_hex(4)}"


def count_name(instance: str, gen: int, stored: int, removed: int, inflight: int) -> str:
    return f"{instance}.{gen}.{stored}.{removed}.{inflight}{COUNT_SUFFIX}"


def parse_count_name(name: str) -> tuple[str, int, int, int, int] | None:
    """(instance, gen, stored, removed, inflight) of a count's name, or None."""
    m = _COUNT_NAME.match(name)
    if m is None:
        return None
    return m.group(1), int(m.group(2)), int(m.group(3)), int(m.group(4)), int(m.group(5))


def counts_digest(counts: dict[str, tuple[int, int]]) -> str:
    """A digest of every instance's (stored, removed), order-free."""
    text = "\n".join(f"{inst} {stored} {removed}" for inst, (stored, removed) in sorted(counts.items()))
    return hashlib.blake2b(text.encode(), digest_size=16).hexdigest()


def scan_name(instance: str, nbytes: int, digest: str) -> str:
    return f"{instance}.{nbytes}.{digest}{SCAN_SUFFIX}"


def parse_scan_name(name: str) -> tuple[str, int, str] | None:
    """(instance, bytes, digest) of a shared scan's name, or None."""
    m = _SCAN_NAME.match(name)
    if m is None:
        return None
    return m.group(1), int(m.group(2)), m.group(3)


def is_legacy_name(name: str) -> bool:
    return _LEGACY_NAME.match(name) is not None


def is_leftover(name: str) -> bool:
    return _LEFTOVER_NAME.match(name) is not None


def read_legacy_count(dfd: int, name: str) -> tuple[tuple[int, int] | None, int, str | None]:
    """A count file of fstier < 0.6: its value (None when not valid), its
    mtime (its owner's heartbeat) and what is wrong with it (None when
    nothing, or when it could not be read at all: gone, a transient error)."""
    try:
        fd = os.open(name, _READ_FLAGS, dir_fd=dfd)
    except OSError:
        return None, 0, None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_size > _MAX_FILE:
            return None, 0, "is not a regular count file"
        data = os.read(fd, _MAX_FILE + 1)
    except OSError:
        return None, 0, None
    finally:
        # GlusterFS fails the close (ESTALE, ENOENT) of a file its owner
        # replaced meanwhile; what was read is still what was read.
        with contextlib.suppress(OSError):
            os.close(fd)
    parts = data.decode("ascii", "replace").split() if len(data) <= _MAX_FILE else []
    value = None
    if len(parts) == 4 and parts[:2] == ["fstier-usage", "2"]:
        with contextlib.suppress(ValueError):
            stored, removed = int(parts[2]), int(parts[3])
            if 0 <= stored <= MAX_COUNT and 0 <= removed <= MAX_COUNT:
                value = (stored, removed)
    return value, st.st_mtime_ns, None if value is not None else "holds no valid count"


@dataclass
class Listing:
    """What one listing of the directory holds, per other instance: its
    largest (stored, removed), its newest generation (or legacy mtime), its
    names, its newest name's stores in flight and its shared scan; plus
    leftovers and the names whose content is bad (each with why)."""

    counts: dict[str, tuple[int, int]] = field(default_factory=dict)
    beats: dict[str, int] = field(default_factory=dict)
    files: dict[str, list[str]] = field(default_factory=dict)
    inflight: dict[str, int] = field(default_factory=dict)
    scans: dict[str, tuple[int, str]] = field(default_factory=dict)
    leftovers: list[str] = field(default_factory=list)
    bad: list[tuple[str, str]] = field(default_factory=list)


def read_listing(dfd: int, names: list[str], skip: set[str], instance: str) -> Listing:
    """Classify ``names`` (a listing of the directory ``dfd``): every
    instance's count but ``instance``'s own and those in ``skip``; reads only
    fstier < 0.6's count files. Never raises for what a name or file holds."""
    out = Listing()
    newest: dict[str, int] = {}
    for name in names:
        if name in skip:
            continue
        if is_leftover(name):
            out.leftovers.append(name)
            continue
        shared_scan = parse_scan_name(name)
        if shared_scan is not None:
            if shared_scan[0] != instance:
                out.scans[shared_scan[0]] = shared_scan[1:]
                out.files.setdefault(shared_scan[0], []).append(name)
            continue
        parsed = parse_count_name(name)
        if parsed is not None:
            inst, gen, stored, removed, inflight = parsed
            if inst == instance:
                continue  # a name of ours that failed to be removed
            value = (stored, removed)
            if gen >= newest.get(inst, -1):
                newest[inst] = gen
                out.inflight[inst] = inflight
            if not (stored <= MAX_COUNT and removed <= MAX_COUNT):
                out.bad.append((name, "holds no valid count"))
                continue
            beat = gen
        elif is_legacy_name(name):
            inst = name
            legacy, beat, wrong = read_legacy_count(dfd, name)
            if wrong is not None:
                out.bad.append((name, wrong))
            if legacy is None:
                continue
            value = legacy
        else:
            continue
        out.files.setdefault(inst, []).append(name)
        if inst not in out.counts or value > out.counts[inst]:
            out.counts[inst] = value
        out.beats[inst] = max(beat, out.beats.get(inst, beat))
    return out
