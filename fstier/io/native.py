"""The native block I/O path and its selection (pure-Python fallback).

``fstier.io._native`` is a C extension (``fstier/io/_native.c``) built by
``pip install`` wherever a C compiler and Python's headers exist. It runs a
whole batch of block stores, loads, lookups, mtime touches or removals
(``store_batch``, ``load_batch``, ``lookup_batch``, ``touch_batch``,
``remove_batch``) in ONE call with the GIL released: no Python object is touched per block, so pool threads do not
hand the GIL to each other per file (the Python path costs ~150 us of user
CPU and ~95 futex calls per 64 KiB file; docs/performance.md has the
measured figures of both paths). The protocol is the Python path's
(:mod:`fstier.io._blockio`), step for step, and so are the outcomes: this
module turns the extension's per-block tuples into
:class:`~fstier.io.blockstore.StoreOutcome` / :class:`~fstier.io.blockstore.LoadOutcome`
with the same statuses, causes (errno names) and reasons, so every caller
handles both paths with one code path.

Selection (:func:`status`): the native path when the extension imports
and ``FSTIER_NATIVE`` is not ``0``; otherwise the Python path, with the
reason (:func:`status`) logged once per process at tier start and shown by
``fstier bench``, vLLM's ``config_info`` and the ``fstier_native_io``
metric. ``FSTIER_NATIVE=1`` makes a missing extension an error instead.

Invariants
    - Nothing outside the base directory is created, written or removed:
      every path is resolved by the kernel below the base directory's fd with
      no symlink in any component (``openat2`` RESOLVE_BENEATH |
      RESOLVE_NO_SYMLINKS; a walk of ``O_NOFOLLOW`` opens where the kernel
      lacks it). A corrupt file is removed by the C call that read it, by
      :func:`fstier.io.fsops.unlink_if_same`'s rule (the name must still hold
      the inode that was read).
    - Only LOADED means the buffer holds verified bytes.
    - The extension keeps references to the caller's buffers only for the
      duration of the call; a late call (a hung mount) still holds them, which
      is why the tier fences the slots of a timed-out batch until it returns.

Fault injection: :func:`fault` arms the extension's test-only rule table
(fail the Nth ``open``/``write``/``read``/``link``/... with an errno, delay
it, shorten it, or fail after it happened); :func:`clear_faults` disarms it.
The reliability suite runs its fault matrix through it on this path, as it
runs it through ``fstier.io.fsops.FS`` on the Python path.
"""

from __future__ import annotations

import errno
import logging
import os
import sys
import threading
from collections.abc import Sequence
from itertools import repeat
from operator import attrgetter, itemgetter, methodcaller
from types import ModuleType
from typing import Any, NamedTuple

from fstier.errors import ConfigError
from fstier.io import _blockio
from fstier.io.blockfile import FORMAT_VERSION
from fstier.io.fsops import _HOST
from fstier.io.iotypes import (
    IOOptions,
    LoadOutcome,
    LoadStatus,
    StoreOutcome,
    StoreStatus,
)
from fstier.keys import BlockKey

__all__ = [
    "NativeStatus",
    "clear_faults",
    "fault",
    "fault_count",
    "flags",
    "load_batch",
    "load_outcomes",
    "log_selection_once",
    "lookup_batch",
    "lookup_stuck",
    "lookup_within",
    "native_backend",
    "python_backend",
    "split",
    "status",
    "store_batch",
    "store_outcomes",
    "touch_batch",
    "xxh3_64",
]

log = logging.getLogger("fstier.io")

_ext: ModuleType | None
_import_error: str
try:
    from fstier.io import _native as _ext_mod

    _ext = _ext_mod
    _import_error = ""
    _settings: dict[str, Any] = _ext.configure(host=_HOST, format_version=FORMAT_VERSION)
except ImportError as _exc:  # not built (no compiler), or built for another Python
    _ext = None
    _import_error = str(_exc) or type(_exc).__name__
    _settings = {}


class NativeStatus(NamedTuple):
    """Which block I/O path runs and why."""

    #: ``"native"`` or ``"python"``
    backend: str
    #: one line: why this path (for logs, ``fstier bench``, ``config_info``)
    reason: str
    #: the checksum implementation (``xxh3-64 avx2``, ``xxh3-64 (xxhash package)``)
    checksum: str


def status(mode: str = "auto") -> NativeStatus:
    """The path a tier configured with ``native_io: mode`` uses now (reads
    ``FSTIER_NATIVE`` each call: ``0`` forces the Python path; ``1`` turns
    ``auto`` into ``on``, i.e. the extension is required; ``off`` stays
    off). Raises :class:`~fstier.errors.ConfigError` when the extension is
    required but does not import."""
    env = os.environ.get("FSTIER_NATIVE", "").strip()
    if env == "0":
        return python_backend("FSTIER_NATIVE=0 forces the Python I/O path")
    if mode == "off":
        return python_backend("tier.native_io: off selects the Python I/O path")
    if _ext is None:
        if env == "1" or mode == "on":
            why = "FSTIER_NATIVE=1" if env == "1" else "tier.native_io: on"
            raise ConfigError(
                f"{why}, but fstier's native extension does not import ({_import_error}); "
                "reinstall fstier where a C compiler and Python headers exist "
                "(pip install --force-reinstall --no-binary fstier fstier), or set "
                "tier.native_io to 'auto'"
            )
        return python_backend(
            f"native extension unavailable ({_import_error}); using the Python I/O path"
        )
    return native_backend()


def python_backend(reason: str = "the Python I/O path, chosen by the caller") -> NativeStatus:
    """The Python I/O path as a :class:`~fstier.io.blockstore.BlockStore`
    backend (what ``native_io: off`` and ``FSTIER_NATIVE=0`` select)."""
    return NativeStatus("python", reason, "xxh3-64 (xxhash package)")


def native_backend() -> NativeStatus:
    """The native I/O path as a backend, whatever ``FSTIER_NATIVE`` says
    (tests, ``fstier bench``); :class:`~fstier.errors.ConfigError` when the
    extension is not built."""
    if _ext is None:
        raise ConfigError(f"fstier's native extension does not import ({_import_error})")
    how = "openat2" if _settings.get("openat2") else "O_NOFOLLOW walk"
    return NativeStatus(
        "native",
        f"native extension loaded (a batch per call, GIL released, path resolution by {how})",
        f"xxh3-64 {_settings.get('xxh3_impl', '')}".strip(),
    )


_logged = False
_log_lock = threading.Lock()


def log_selection_once(mode: str = "auto") -> NativeStatus:
    """The path for ``native_io: mode``, logged once per process (at the
    first tier start)."""
    global _logged
    st = status(mode)
    with _log_lock:
        if not _logged:
            _logged = True
            if st.backend == "native":
                log.info("fstier: block I/O path: native (%s; checksum %s)", st.reason, st.checksum)
            elif _ext is not None:  # chosen (FSTIER_NATIVE=0, native_io: off): no alarm
                log.info("fstier: block I/O path: python (%s)", st.reason)
            else:  # wanted but not built: say so where operators look
                log.warning("fstier: block I/O path: python (%s)", st.reason)
    return st


def _require() -> ModuleType:
    if _ext is None:
        raise RuntimeError(f"fstier's native extension is not available: {_import_error}")
    return _ext


def xxh3_64(buf: Any) -> int:
    """XXH3-64 (seed 0) computed by the extension (the checksum of kind 1)."""
    return int(_require().xxh3_64(buf))


# ------------------------------------------------------------ outcome tables
_STORE_STATUS = (StoreStatus.STORED, StoreStatus.SKIPPED, StoreStatus.FAILED)
_STAGES = (
    "", "open directory of", "stat", "create temp for", "write", "fsync", "link", "close",
    "rename", "directory fsync after publishing", "mkdir for", "open base directory for",
)
_LOAD_STATUS = (LoadStatus.LOADED, LoadStatus.MISSING, LoadStatus.CORRUPT, LoadStatus.ERROR)
_REASONS = (
    "", "symlink", "not_regular", "bad_size", "short_read", "bad_magic", "unsupported_version",
    "header_checksum", "bad_header", "bad_key", "bad_checksum_kind", "bad_length", "wrong_key",
    "wrong_namespace", "wrong_length", "payload_checksum", "open", "read",
)


_HASH, _GROUP = attrgetter("block_hash"), attrgetter("group_idx")
#: a load whose file is not there (outcomes are frozen: one for every such key)
_MISSING = LoadOutcome(LoadStatus.MISSING, "ENOENT")
_FSENCODE = methodcaller("encode", "utf-8", "surrogateescape")
#: os.fsencode is _FSENCODE here (Linux's usual locale)
_FS_UTF8 = (sys.getfilesystemencoding(), sys.getfilesystemencodeerrors()) == ("utf-8", "surrogateescape")


def _errname(code: int) -> str:
    return errno.errorcode.get(code, f"errno{code}")


def flags(opts: IOOptions, *, mkdir: bool = False) -> int:
    """The extension's flag bits for ``opts`` (``mkdir``: create missing directories)."""
    ext = _require()
    f = 0
    if opts.checksum:
        f |= ext.F_CHECKSUM
    if opts.o_direct:
        f |= ext.F_DIRECT
    elif opts.o_direct_cold:
        f |= ext.F_DIRECT_COLD
    if opts.fsync in ("file", "file+dir"):
        f |= ext.F_FSYNC_FILE
    if opts.fsync == "file+dir":
        f |= ext.F_FSYNC_DIR
    if mkdir:
        f |= ext.F_MKDIR
    caps = opts.capabilities
    if caps is not None and not caps.tmpfile:
        f |= ext.F_NO_TMPFILE
    return f


def split(base: str, paths: Sequence[str]) -> list[bytes]:
    """Paths below ``base`` made relative to it, as bytes (``os.fsencode``:
    a root's path need not be UTF-8; a path elsewhere is a bug)."""
    cut = len(base) + 1
    prefix = base + "/"
    if not all(map(str.startswith, paths, repeat(prefix))):  # C-level loop
        bad = next(p for p in paths if not p.startswith(prefix))
        raise ValueError(f"{bad!r} is not below the base directory {base}")
    if _FS_UTF8:  # os.fsencode's own result, with no bytecode per path
        return list(map(_FSENCODE, map(itemgetter(slice(cut, None)), paths)))
    enc = os.fsencode
    return [enc(p[cut:]) for p in paths]


# --------------------------------------------------------------------- store
def store_batch(
    base: str,
    paths: Sequence[str],
    keys: Sequence[BlockKey],
    payloads: Sequence[memoryview],
    namespace_digest: bytes,
    page_count: int,
    opts: IOOptions,
    *,
    created_ns: int | None = None,
    helpers: int = 0,
) -> list[StoreOutcome]:
    """Store ``payloads[i]`` (exactly its length) as ``keys[i]``'s file at
    ``paths[i]`` (below ``base``), creating missing directories below
    ``base``. One GIL-free call; never raises ``OSError``. ``helpers``: up
    to this many more C threads share the batch's files (started and joined
    inside the call, all at once: it returns only once none of them can
    touch a payload).

    A refusal of ``O_TMPFILE`` (EOPNOTSUPP, EISDIR) switches the rest of the
    call to named temps and is recorded in ``opts.capabilities`` (this
    root's, never the process's), so later calls for this root skip it; a
    call without capabilities tries ``O_TMPFILE`` again next time."""
    ext = _require()
    rels = split(base, paths)
    raw = ext.store_batch(
        os.fsencode(base), rels, list(map(_HASH, keys)), list(map(_GROUP, keys)), list(payloads),
        namespace_digest, page_count, flags(opts, mkdir=True), opts.file_mode,
        created_ns if created_ns is not None else _now_ns(), opts.alignment, helpers,
    )
    return store_outcomes(raw, paths, opts)


def store_outcomes(
    raw: Sequence[tuple[int, int, int, int, int]], paths: Sequence[str], opts: IOOptions
) -> list[StoreOutcome]:
    """The outcomes of the extension's per-key store tuples (``store_batch``'s,
    or the native engine's), a refusal of ``O_TMPFILE`` recorded in ``opts``."""
    if len(raw) == len(paths) and len(set(raw)) == 1 and raw[0][0] != 2 and not raw[0][4]:
        # Every block got the same success tuple (the common batch): one
        # shared outcome, no loop over the keys (outcomes are frozen; mixed
        # batches still get one each: test_batch_fast_paths.py::
        # test_a_uniform_native_batch_shares_one_outcome_and_a_mixed_one_does_not).
        return [StoreOutcome(_STORE_STATUS[raw[0][0]], nbytes=raw[0][2])] * len(raw)
    out: list[StoreOutcome] = []
    refused = 0
    for (st, err, nbytes, stage, tmpfile_err), path in zip(raw, paths, strict=True):
        refused = refused or tmpfile_err
        if st == 2:
            name = path.rpartition("/")[2]
            out.append(StoreOutcome(
                StoreStatus.FAILED, _errname(err), f"{_STAGES[stage]} {name}: {os.strerror(err)}"
            ))
        else:
            out.append(StoreOutcome(_STORE_STATUS[st], nbytes=nbytes))
    if refused and opts.capabilities is not None:
        opts.capabilities.refuse_tmpfile(OSError(refused, os.strerror(refused)))
    return out


def _now_ns() -> int:
    import time

    return time.time_ns()


# ---------------------------------------------------------------------- load
def load_batch(
    base: str,
    paths: Sequence[str],
    keys: Sequence[BlockKey],
    buffers: Sequence[memoryview],
    namespace_digest: bytes,
    opts: IOOptions,
    *,
    helpers: int = 0,
    eager: int = -1,
) -> list[LoadOutcome]:
    """Load and verify ``keys[i]``'s file into ``buffers[i]`` (exactly its
    length, the expected payload). Every block is attempted; only LOADED
    buffers hold verified bytes. Proven-corrupt files are removed here (if
    the name still holds the inode read), planted symlinks at a block's name
    too. Never raises ``OSError``. ``helpers``: as :func:`store_batch`'s, ``eager``
    of them at once (-1: all), the rest one per read that would block (each
    read asks the page cache first, ``RWF_NOWAIT``: see ``_native.c``)."""
    ext = _require()
    rels = split(base, paths)
    raw = ext.load_batch(
        os.fsencode(base), rels, list(map(_HASH, keys)), list(map(_GROUP, keys)), list(buffers),
        namespace_digest, flags(opts), opts.alignment, helpers, eager,
    )
    return load_outcomes(raw, paths)


def load_outcomes(
    raw: Sequence[tuple[int, int, int, int, int, int]], paths: Sequence[str]
) -> list[LoadOutcome]:
    """The outcomes of the extension's per-key load tuples ``(status, errno,
    nbytes, reason, removed, removal errno)`` (``load_batch``'s, or the
    native engine's). A proven-corrupt file or a planted link was removed by
    the C call itself (``remove_bad`` in ``_native.c``: the same rule as
    :func:`fstier.io.fsops.unlink_if_same`); a removal that failed is logged
    here, as the Python path logs it."""
    if len(raw) == len(paths) and len(set(raw)) == 1 and raw[0][0] in (0, 1):
        # Every block LOADED with one length, or every one MISSING (no name
        # in it): one shared (frozen) outcome.
        one = LoadOutcome(LoadStatus.LOADED, nbytes=raw[0][2]) if raw[0][0] == 0 else _MISSING
        return [one] * len(raw)
    out: list[LoadOutcome] = []
    for (st, err, nbytes, reason, removed, rm_err), path in zip(raw, paths, strict=True):
        if st == 0:
            out.append(LoadOutcome(LoadStatus.LOADED, nbytes=nbytes))
            continue
        name = path.rpartition("/")[2]
        status_ = _LOAD_STATUS[st]
        why = _REASONS[reason]
        if status_ is LoadStatus.MISSING:
            out.append(_MISSING)
        elif why == "symlink":
            out.append(LoadOutcome(
                LoadStatus.CORRUPT, "symlink", f"{name}: a symlink on its path", removed=bool(removed)
            ))
        elif status_ is LoadStatus.CORRUPT:
            if rm_err:
                _blockio._removal_failed(OSError(rm_err, os.strerror(rm_err), path))
            out.append(LoadOutcome(LoadStatus.CORRUPT, why, _corrupt_detail(why, nbytes, path), removed=bool(removed)))
        elif why == "not_regular":
            out.append(LoadOutcome(LoadStatus.ERROR, "not_regular", f"{name} is not a regular file"))
        elif why == "read" and err in (errno.ENOENT, errno.ESTALE):
            # Removed between open and read by another host's eviction
            # (GlusterFS: ENOENT, kernel NFS: ESTALE): a miss, as on the
            # Python path, not a device error.
            out.append(LoadOutcome(
                LoadStatus.MISSING, _errname(err), f"{name} vanished while being read"
            ))
        else:
            verb = "open" if why == "open" else "read"
            out.append(LoadOutcome(
                LoadStatus.ERROR, _errname(err), f"{verb} {name}: {os.strerror(err)}"
            ))
    return out


def _corrupt_detail(why: str, size: int, path: str) -> str:
    if why == "bad_size":
        return f"file is {size} bytes"
    return f"{path.rpartition('/')[2]}: {why.replace('_', ' ')}"


# -------------------------------------------------------------------- lookup
def lookup_batch(base: str, paths: Sequence[str], *, prefix: bool = False, cached: bool = False) -> list[bool]:
    """Whether a regular file is at each path, resolved below ``base`` with
    no symlink in any component (a symlink, FIFO, socket or directory is
    not; nor is a file reached through a symlinked directory). One call,
    the GIL released for the probe; with ``cached`` (only where the kernel's
    caches are the truth: a local filesystem, :attr:`RootCapabilities.coherent_cache
    <fstier.io.capabilities.RootCapabilities.coherent_cache>`) answered from
    its dentry and inode caches with the GIL held when they hold every key
    (no system call there can wait on a device or a server). With ``prefix``
    the answer stops after the first miss."""
    ext = _require()
    got = ext.lookup_batch(os.fsencode(base), split(base, paths), prefix, cached)
    return [b == 1 for b in got]


def lookup_within(
    base: str, paths: Sequence[str], *, prefix: bool, timeout_s: float, cached: bool = False
) -> list[bool] | None:
    """:func:`lookup_batch` with its deadline kept in C: with ``cached``, a probe the kernel's
    caches answer returns at once with the GIL held (the caller never waits
    the switch interval to take it back from a scheduler thread that never
    sleeps); any other runs on a C thread and the caller waits at most
    ``timeout_s`` with the GIL released once (no Python thread in between). None past the deadline (a
    hung mount: the C thread finishes on its own and frees what it holds),
    or at once while 4 earlier probes are still stuck (:func:`lookup_stuck`).
    ``timeout_s`` above ``threading.TIMEOUT_MAX`` (``inf`` included) is
    clamped to it; nan or a negative value is a ``ValueError``."""
    ext = _require()
    if not timeout_s >= 0:  # nan too
        raise ValueError(f"lookup_within(timeout_s={timeout_s!r}): expected seconds >= 0")
    timeout_s = min(float(timeout_s), threading.TIMEOUT_MAX)
    got = ext.lookup_within(os.fsencode(base), split(base, paths), prefix, timeout_s, cached)
    return None if got is None else [b == 1 for b in got]


def lookup_stuck() -> int:
    """How many :func:`lookup_within` probes ran past their deadline and
    are still in a system call."""
    return _require().lookup_stuck()


def touch_batch(base: str, paths: Sequence[str]) -> list[bool]:
    """Set each block file's mtime to now (LRU recency) in one call, GIL
    released: no symlink followed anywhere below ``base``, only a regular
    file with one link touched (as :func:`fstier.io.fsops.touch_file`)."""
    ext = _require()
    got = ext.touch_batch(os.fsencode(base), split(base, paths))
    return [b == 1 for b in got]


def remove_batch(base: str, paths: Sequence[str]) -> list[bool]:
    """Unlink each block file's name in one call, GIL released: each
    directory resolved below ``base`` with no symlink in any component, the
    name itself never followed (a symlink there is removed, a directory
    stays). True where a name was removed."""
    ext = _require()
    got = ext.remove_batch(os.fsencode(base), split(base, paths))
    return [b == 1 for b in got]


# ------------------------------------------------------------ fault seam
def fault(
    op: str,
    err: int = 0,
    *,
    nth: int = 1,
    times: int = 1,
    delay_s: float = 0.0,
    short: int = 0,
    after: bool = False,
) -> None:
    """Arm a fault on the native path (tests): from the ``nth`` call of
    ``op`` (``opendir open stat write read fsync link rename close mkdir
    unlink``, ``nowait``: a fan-out's page-cache-only read attempt, whose
    injected error makes it find nothing cached, and ``cachestat``:
    ``o_direct: cold``'s page-cache test, whose injected error makes it
    find nothing cached, but ``ENOSYS``: a kernel without the call, and
    ``touch``: a recency touch, whose injected error leaves the file
    untouched) on, for
    ``times`` calls (-1: all), sleep ``delay_s``, move at most ``short``
    bytes (read/write), and fail with ``err`` (before the call, or ``after``
    it happened). Rules add up until :func:`clear_faults`."""
    _require().fault_set(op, err, nth, times, delay_s, short, after)


def clear_faults() -> None:
    """Disarm every native fault rule and reset the call counters."""
    if _ext is not None:
        _ext.fault_clear()


def fault_count(op: str) -> int:
    """Calls of ``op`` the native path made since the rules were armed."""
    return int(_require().fault_count(op))


def configure(
    *, openat2: bool | None = None, tmpfile: bool | None = None, cold_direct_min: int | None = None
) -> dict[str, Any]:
    """Switch the extension's path resolution (``openat2=False``: the
    ``O_NOFOLLOW`` walk) or publication (``tmpfile=False``: named temps), as
    a kernel without them would, or the smallest payload ``o_direct: cold``
    reads with O_DIRECT (``cold_direct_min``, default 1 MiB) (tests). All
    are process-wide overrides that nothing but a caller sets: a root that
    refuses ``O_TMPFILE`` switches only itself
    (:class:`~fstier.io.capabilities.RootCapabilities`). Returns the settings."""
    ext = _require()
    return dict(ext.configure(
        openat2=-1 if openat2 is None else int(openat2),
        tmpfile=-1 if tmpfile is None else int(tmpfile),
        cold_direct_min=-1 if cold_direct_min is None else int(cold_direct_min),
    ))
