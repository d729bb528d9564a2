"""ROOT, the argument of ``inspect``, ``verify`` and ``gc``: resolved, and
refused with one line that says what ROOT should be when it is not a
directory this user can list or plainly not an fstier root.

(``fstier config validate --check-root`` proves a configured ``root_dir``
works for writing: that is :mod:`fstier.cli.rootcheck`.) Only the top-level
names of ROOT are read, so the checks cost nothing on a big root.

Every command that takes ROOT runs these checks through :func:`within_deadline`
(a daemon thread waited for at most ``--deadline``): ROOT is a plain string on
the command line (click's ``Path`` would stat it on the main thread), so a
hung mount is exit 1 with one line, never a command that hangs.
"""

from __future__ import annotations

import errno
import os
import stat
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import click

from fstier.cli.exits import RootRefused, RuntimeFailure, UsageFailure
from fstier.cli.output import display
from fstier.file_mapper import MANIFEST_NAME, is_namespace_name

__all__ = [
    "check_root_shape", "checked_root_argument", "deadline_option", "existing_root", "fstier_root", "within_deadline",
]

T = TypeVar("T")

#: ``--deadline``: how long the ROOT checks may take before a command gives up.
deadline_option = click.option(
    "--deadline", type=float, default=10.0, show_default=True, metavar="SECONDS",
    help="Give up on ROOT (a hung mount) after this long.",
)


def within_deadline(check: Callable[[], T], root: str, deadline: float) -> T:
    """``check()`` (the ROOT checks, whose errors are the command's: exit 2
    for a refused ROOT) on a daemon thread waited for at most ``deadline``
    seconds: a ROOT that does not answer (a hung NFS or FUSE mount) is a
    :class:`RuntimeFailure` (exit 1) naming it. The thread, stuck in the
    kernel, is left behind; it dies with the process."""
    if not deadline > 0 or deadline == float("inf"):
        raise UsageFailure(f"--deadline: must be a finite number > 0 seconds, got {deadline:g}")
    out: list[Any] = []

    def run() -> None:
        try:
            out.append(check())
        except BaseException as exc:  # handed to the caller's thread
            out.append(exc)

    worker = threading.Thread(target=run, name="fstier-root-check", daemon=True)
    worker.start()
    worker.join(deadline)
    if not out:
        raise RuntimeFailure(f"ROOT {display(repr(root))} did not answer within {deadline:g} s (a hung mount?)")
    if isinstance(out[0], BaseException):
        raise out[0]
    result: T = out[0]
    return result


def existing_root(root: str) -> Path:
    """``root`` as a directory this user can list, or a one-line usage error
    that says which of those it is not.

    Returns the real path (``realpath``), as the tier resolves its
    ``root_dir``: a root reached through a symlink (``/mnt/kv -> /data/kv``)
    is the directory it names, while every symlink *below* it is still
    refused by the walks (they resolve with no symlink in any component)."""
    p = Path(root)
    shown = display(repr(root))
    try:
        st = os.stat(p)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise RootRefused(
                f"ROOT {shown}: a symlink loop (a link that points back at itself); give the real directory"
            ) from None
        if exc.errno in (errno.EACCES, errno.EPERM):
            raise RootRefused(
                f"ROOT {shown}: permission denied on a parent directory; run as a user who can enter it"
            ) from None
        if exc.errno == errno.ENOTDIR:
            raise RootRefused(f"ROOT {shown}: a parent of it is a file, not a directory") from None
        raise RootRefused(f"ROOT {shown}: no such directory") from None
    if not stat.S_ISDIR(st.st_mode):
        raise RootRefused(f"ROOT {shown}: is a file, not a directory; give the tier's root_dir")
    if not os.access(p, os.R_OK | os.X_OK):
        raise RootRefused(f"ROOT {shown}: permission denied (cannot list it); run as a user who can read it")
    return Path(os.path.realpath(p))


def checked_root_argument(check: Callable[[], T], root: str, deadline: float) -> T:
    """The ROOT argument of the running command as click's
    ``Path(file_okay=False)`` checks it (its usage errors: a file given as
    ROOT, a directory that cannot be read), then ``check()``, both under
    :func:`within_deadline`."""
    ctx = click.get_current_context()
    param = next(p for p in ctx.command.params if p.name == "root")

    def run() -> T:
        click.Path(file_okay=False).convert(root, param, ctx)
        return check()

    return within_deadline(run, root, deadline)


_MANIFEST = MANIFEST_NAME
#: Entries a fresh volume or a shared mount holds before fstier wrote
#: anything (ext4's lost+found; hidden names such as NetApp's .snapshot are
#: skipped too): a root with only these is an empty root, not a foreign one.
_ROOT_FURNITURE = frozenset({"lost+found"})


def fstier_root(root: str) -> Path:
    """:func:`existing_root`, and refuse a directory that is plainly not an
    fstier root, saying what ROOT should be.

    An fstier root holds namespace directories (``<model>-<digest>`` with a
    ``config.json``). A root that holds ``config.json`` itself is one level
    too deep: it is a namespace directory. A non-empty directory none of whose
    entries looks like a namespace (``/etc``, a home directory) is not a root
    at all: reporting "0 namespaces" there would read as a healthy empty tier.
    An empty directory (or a fresh volume holding only ``lost+found`` and
    hidden entries) is a fresh root and is fine. Only top-level names are
    read (namespaces are few), so this costs nothing on a big root.
    """
    p = existing_root(root)
    check_root_shape(p, root)
    return p


def check_root_shape(p: Path, root: str) -> None:
    shown = display(repr(root))
    if os.path.lexists(p / _MANIFEST) and is_namespace_name(p.resolve().name):
        parent = display(str(p.resolve().parent))
        raise RootRefused(
            f"ROOT {shown} is a namespace directory (it holds {_MANIFEST}), one level too deep; "
            f"ROOT should be its parent {parent!r} (verify takes --namespace NAME for one namespace)",
        )
    entries = 0
    with os.scandir(p) as it:
        for entry in it:
            if entry.name in _ROOT_FURNITURE or entry.name.startswith("."):
                continue  # what filesystems and tools put in any root
            entries += 1
            from fstier.tier.scan import is_namespace_dir

            if is_namespace_dir(Path(entry.path)):  # the rule inspect and verify use
                return
    if entries:
        raise RootRefused(
            f"ROOT {shown} is not an fstier root: none of its {entries} entries is a namespace directory "
            f"(<model>-<16 hex digits> holding {_MANIFEST}); ROOT should be the tier's root_dir "
            f"(see `fstier config show FILE`)",
        )
