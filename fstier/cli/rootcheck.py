"""``fstier config validate --check-root``: prove a tier's ``root_dir`` works
before an engine starts on it.

The checks, in order, each one line (``ok``, ``warn`` or ``fail``):

1. **create**: ``root_dir`` exists or can be made (``mkdir -p``);
2. **write**: a private scratch directory (mode 0755, as the tier makes its
   namespace directories) takes a 4096-byte file that is written, synced,
   renamed, read back and removed -- what a store does where the
   filesystem has no ``O_TMPFILE`` (a named temp renamed into place);
3. **o_direct**: the same probe the tier runs at start (``auto`` falls back
   to buffered I/O with a warning; ``on`` fails here as the tier would);
4. **space**: free and total bytes of the filesystem against ``max_bytes``
   (larger than the filesystem: fail; larger than what is free: warn);
5. **owner**: which UID creates, and so alone can unlink, the files: the
   tier makes directories 0755, so ``fstier gc`` must run as that UID (or
   root); a root owned by another UID is reported with the fix.

Everything it creates is removed again, also when a check fails; it never
touches anything else under the root: the scratch directory has a name of
its own (host, pid, random), is held by its fd from ``mkdir`` on, and only
the files it made there, then the directory itself while it is still the
one held, are removed. Cost: a handful of syscalls and one
4 KiB file. Imports neither torch nor numpy.
"""

from __future__ import annotations

import contextlib
import errno
import os
import secrets
import socket
import stat
from dataclasses import asdict, dataclass
from pathlib import Path

from fstier.config import TierConfig
from fstier.io import open_held_dir, rmdir_if_same

__all__ = ["RootCheck", "check_root"]

_PAYLOAD = b"fstier root check\n".ljust(4096, b"\0")
#: The files the write check makes in its scratch directory.
_TMP, _FINAL = ".probe.tmp", "probe.bin"


@dataclass(frozen=True)
class RootCheck:
    """One check's verdict: ``status`` is ``ok``, ``warn`` or ``fail``."""

    name: str
    status: str
    detail: str

    def to_json(self) -> dict[str, str]:
        return asdict(self)


def _size(n: float) -> str:
    from fstier.units import format_size

    return format_size(n)


def check_root(tier: TierConfig) -> list[RootCheck]:
    """Run the checks on ``tier.root_dir``; stops after the first failing
    check that makes the rest meaningless (create, write)."""
    root = Path(tier.root_dir)
    out: list[RootCheck] = []
    existed = root.is_dir()
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        out.append(RootCheck(
            "create", "fail",
            f"tier.root_dir {str(root)!r}: cannot create it ({exc.strerror or exc}); "
            "create it (as the engine's UID) or mount the volume there",
        ))
        return out
    out.append(RootCheck("create", "ok", f"{root} {'exists' if existed else 'created'}"))

    try:
        failed = _scratch_checks(root, tier, out)
    except OSError as exc:
        out.append(_write_failed(root, exc))
        failed = True
    if failed:
        return out
    out.append(_space_check(root, tier))
    out.append(_owner_check(root))
    return out


def _scratch_name() -> str:
    """A name no one else uses: host, pid and 8 random hex digits."""
    return f".fstier-check.{socket.gethostname()}.{os.getpid()}.{secrets.token_hex(4)}"


def _write_failed(root: Path, exc: OSError) -> RootCheck:
    return RootCheck(
        "write", "fail",
        f"tier.root_dir {str(root)!r}: cannot create, write, rename or remove a file under it "
        f"({exc.strerror or exc}); fix its permissions (owner, mode, read-only or immutable "
        "mount) or choose another root_dir",
    )


def _scratch_checks(root: Path, tier: TierConfig, out: list[RootCheck]) -> bool:
    """Checks 2 and 3 in a scratch directory made here and held by its fd
    from then on: every file is made, read and removed relative to that fd,
    and only what this made is removed (names it made, then the directory
    if it is still the one held and empty). An existing directory of the
    same name is never touched (tests/test_held_removal.py)."""
    root_fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        name = _scratch_name()
        os.mkdir(name, 0o755, dir_fd=root_fd)  # EEXIST: someone else's; fails the check
        held = open_held_dir(root_fd, name)
        try:
            with os.scandir(held) as it:
                replaced = next(it, None) is not None
            if replaced:
                raise OSError(errno.EEXIST, "the scratch directory was replaced by another one", name)
            return _write_check(root, held, tier, out, root / name)
        finally:
            for made in (_TMP, _FINAL):
                with contextlib.suppress(OSError):
                    os.unlink(made, dir_fd=held)
            with contextlib.suppress(OSError):
                rmdir_if_same(root_fd, name, held)
            os.close(held)
    finally:
        os.close(root_fd)


def _write_check(root: Path, held: int, tier: TierConfig, out: list[RootCheck], scratch: Path) -> bool:
    """Checks 2 and 3 in the held scratch directory (``scratch`` names it
    for the O_DIRECT probe); True when the write check failed."""
    try:
        fd = os.open(_TMP, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644, dir_fd=held)
        try:
            os.write(fd, _PAYLOAD)
            os.fsync(fd)
        finally:
            os.close(fd)
        os.rename(_TMP, _FINAL, src_dir_fd=held, dst_dir_fd=held)
        fd = os.open(_FINAL, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=held)
        try:
            back = os.read(fd, len(_PAYLOAD) + 1)
        finally:
            os.close(fd)
        if back != _PAYLOAD:
            raise OSError(0, "the file read back differs from what was written")
        os.unlink(_FINAL, dir_fd=held)
    except OSError as exc:
        out.append(_write_failed(root, exc))
        return True
    out.append(RootCheck("write", "ok", "created, wrote, synced, renamed, read back and removed a 4 KiB file"))

    from fstier.errors import DirectIOUnsupportedError
    from fstier.io import probe_o_direct

    # The probe opens by path with no symlink in any component (openat2
    # RESOLVE_NO_SYMLINKS, as the tier does), so it names the scratch
    # directory itself: a /proc/self/fd link is a symlink and would fail
    # with ELOOP on every filesystem
    # (test_operator_config.py::test_check_root_o_direct_agrees_with_the_tiers_probe).
    try:
        support = probe_o_direct(scratch, tier.o_direct)
    except DirectIOUnsupportedError as exc:
        out.append(RootCheck("o_direct", "fail", str(exc).replace(str(scratch), str(root))))
        return False
    if support.enabled or tier.o_direct == "off":
        out.append(RootCheck("o_direct", "ok", f"o_direct: {tier.o_direct}: {support.reason}"))
    else:
        out.append(RootCheck(
            "o_direct", "warn",
            f"o_direct: {tier.o_direct}: the filesystem refuses O_DIRECT ({support.reason}); the tier "
            "will use buffered I/O (set o_direct: off to say so, or mount a filesystem that supports it)",
        ))
    return False


def _space_check(root: Path, tier: TierConfig) -> RootCheck:
    st = os.statvfs(root)
    total = st.f_blocks * st.f_frsize
    free = st.f_bavail * st.f_frsize
    where = f"{_size(free)} free of {_size(total)}"
    if tier.max_bytes is None:
        return RootCheck(
            "space", "ok",
            f"{where}; max_bytes unset: no eviction, stores fail (as misses) once the disk is full",
        )
    if tier.max_bytes > total:
        return RootCheck(
            "space", "fail",
            f"tier.max_bytes {_size(tier.max_bytes)} exceeds the whole filesystem ({where}): stores "
            "fail with ENOSPC long before eviction starts; set max_bytes to about 85% of the volume",
        )
    if tier.max_bytes > free:
        return RootCheck(
            "space", "warn",
            f"tier.max_bytes {_size(tier.max_bytes)} is more than is free now ({where}); fine if "
            "fstier files already use the difference, otherwise stores fail with ENOSPC first",
        )
    return RootCheck("space", "ok", f"{where}; max_bytes {_size(tier.max_bytes)}")


def _owner_check(root: Path) -> RootCheck:
    st = os.stat(root)
    uid, gid = os.geteuid(), os.getegid()
    mode = stat.S_IMODE(st.st_mode)
    base = (
        f"files and directories are created by uid {uid} gid {gid} (directories 0755), so only "
        f"uid {uid} (or root) can unlink them: run `fstier gc` and the gc CronJob as uid {uid} "
        f"(securityContext.runAsUser: {uid}, fsGroup: {gid})"
    )
    if st.st_uid != uid and uid != 0:
        return RootCheck(
            "owner", "warn",
            f"{root} is owned by uid {st.st_uid} gid {st.st_gid} (mode {mode:04o}), not by this uid "
            f"{uid}; {base}. Files another uid created under it cannot be unlinked by this one",
        )
    return RootCheck("owner", "ok", f"{root} owner uid {st.st_uid} gid {st.st_gid} mode {mode:04o}; {base}")
