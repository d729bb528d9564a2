"""Exit codes of the ``fstier`` command and the failures that carry them.

Every command ends in one of four codes (docs/cli.md, "Conventions"):
0 ok, 1 a runtime failure or something bad found and not fixed, 2 usage or
configuration error, 130 interrupted (Ctrl-C). A command stops by raising
one of the typed failures below, one class per meaning, each a
``click.ClickException`` with its ``exit_code``; library errors (a bad
config, an fstier or OS error) and click's own usage errors are translated
into them by :func:`failure_for`. The command group (``fstier.cli``) is the
ONE place that catches them: one line on stderr, never a traceback, and one
JSON document on stdout under ``--json``.

No I/O here; importing it costs nothing (``fstier --help`` imports it).
"""

from __future__ import annotations

import click

from fstier.errors import ConfigError, FstierError

__all__ = [
    "EXIT_FAILURE",
    "EXIT_INTERRUPTED",
    "EXIT_OK",
    "EXIT_USAGE",
    "CliFailure",
    "ConfigFailure",
    "Interrupted",
    "ReportFailed",
    "RootRefused",
    "RuntimeFailure",
    "UsageFailure",
    "failure_for",
]

EXIT_OK = 0
EXIT_FAILURE = 1
EXIT_USAGE = 2
#: 128 + SIGINT, what shells report for a command stopped by Ctrl-C.
EXIT_INTERRUPTED = 130


class CliFailure(click.ClickException):
    """A command stops with :attr:`exit_code` and one line,
    :meth:`format_message` (what is wrong, and what to do about it)."""

    exit_code = EXIT_FAILURE


class UsageFailure(CliFailure):
    """Exit 2: the command line is wrong, a bad option value included
    (``--blocks: must be >= 1, got 0``) and click's own usage errors
    (``usage error: Missing option '--max-bytes'. (see 'fstier gc --help')``)."""

    exit_code = EXIT_USAGE


class RootRefused(CliFailure):
    """Exit 2: ROOT is not a directory this user can list, or plainly not an
    fstier root (``/etc``, a namespace directory one level too deep); the
    line says what ROOT should be."""

    exit_code = EXIT_USAGE


class ConfigFailure(CliFailure):
    """Exit 2: a configuration document is invalid (a :class:`ConfigError`);
    the line starts ``config error:`` and names the field and the value."""

    exit_code = EXIT_USAGE

    def format_message(self) -> str:
        return f"config error: {self.message}"


class RuntimeFailure(CliFailure):
    """Exit 1: the command could not do its work (an I/O error, a rank
    process that died, torch missing for the demo)."""

    exit_code = EXIT_FAILURE


class ReportFailed(CliFailure):
    """Exit 1: the command printed its whole report (a table, or the JSON
    document, which then carries this line as ``error``) and the report
    fails: bad files remain (``verify`` without ``--fix``), part of ROOT
    could not be read (partial totals), a demo outcome differs, a root check
    failed. Under ``--json`` nothing more is printed; otherwise the line goes
    to stderr, unless ``shown`` (the report's own last line already says it)."""

    exit_code = EXIT_FAILURE

    def __init__(self, message: str, *, shown: bool = False) -> None:
        super().__init__(message)
        self.shown = shown


class Interrupted(CliFailure):
    """Exit 130: Ctrl-C. The demo's rank processes stop quietly and what it
    made (shared memory, a temporary root) is removed before this is raised."""

    exit_code = EXIT_INTERRUPTED

    def __init__(self) -> None:
        super().__init__("interrupted (Ctrl-C)")


def failure_for(exc: BaseException) -> CliFailure | None:
    """The typed failure an exception that reached the top stands for, or
    None for one that is not a command's failure (a bug: let it show its
    traceback; SystemExit: let it exit)."""
    if isinstance(exc, CliFailure):
        return exc
    if isinstance(exc, KeyboardInterrupt):
        return Interrupted()
    if isinstance(exc, click.exceptions.Abort):
        # click turns Ctrl-C during a command into Abort (the cause is kept).
        return Interrupted() if isinstance(exc.__cause__, KeyboardInterrupt) else RuntimeFailure("aborted")
    if isinstance(exc, click.UsageError):
        where = exc.ctx.command_path if exc.ctx is not None else "fstier"
        return UsageFailure(f"usage error: {exc.format_message()} (see '{where} --help')")
    if isinstance(exc, click.ClickException):
        # click's other errors (a file option it could not open): exit 1.
        kind = UsageFailure if exc.exit_code == EXIT_USAGE else RuntimeFailure
        return kind(f"error: {exc.format_message()}")
    if isinstance(exc, ConfigError):
        return ConfigFailure(str(exc))
    if isinstance(exc, FstierError):
        return RuntimeFailure(f"error: {exc}")
    if isinstance(exc, OSError):
        where = f" {exc.filename}" if exc.filename else ""
        return RuntimeFailure(f"error:{where}: {exc.strerror or exc}")
    return None
