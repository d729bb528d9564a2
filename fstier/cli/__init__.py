"""The ``fstier`` command: a thin shell over the library.

Commands, one module each: ``demo`` (the end-to-end tour: tp=2 stores, tp=4
loads, every fail-closed case; the scenario and its rank processes live in
:mod:`fstier.demo`), ``inspect`` (one row per namespace, from the streaming walk
in ``scan``), ``verify`` (check every block, ``--fix`` removes bad ones),
``gc`` (LRU eviction and temp sweep with FsTier's own capacity code),
``status`` (a live view of a root from what its running tiers publish),
``bench`` (fstier vs raw O_DIRECT), and ``config validate|show``. What they
share has a module each: ``exits`` (exit codes and the failures that carry
them), ``output`` (consoles, ``--json`` documents, sizes, safe printing of
names), ``progress`` (stderr, terminals only), ``roots`` (ROOT of the
root-walking commands), ``options`` (``--json``, sizes) and ``tables``.

Conventions every command follows:

- exit 0 ok, 1 runtime failure (or something bad was found and not fixed),
  2 usage or configuration error, 130 interrupted (Ctrl-C); every failure is
  ONE line on stderr, never a traceback (click's own usage errors included).
  A command stops by raising a typed failure (:mod:`fstier.cli.exits`, one
  class per meaning, each with its exit code); the group's ``_fail`` is the
  one handler that prints it and exits;
- ``--json`` prints one JSON document on stdout for scripts, failures too:
  ``{"ok": false, "exit_code": N, "error": "..."}``; people get rich tables
  and progress bars (progress goes to stderr, and only to a terminal);
- ``fstier --help`` imports no command module at all (commands are
  registered lazily by name), so neither torch nor numpy nor the I/O layer
  is loaded to print help; each command keeps its heavy imports inside its
  body. ``tests/test_cli.py`` checks ``sys.modules`` in a real subprocess.
"""

from __future__ import annotations

import errno
import importlib
import os
import sys
from collections.abc import Sequence
from typing import Any, NoReturn

import click

from fstier.cli.exits import EXIT_FAILURE, ReportFailed, failure_for
from fstier.cli.output import display, emit_json

__all__ = ["main"]

#: name -> (module, attribute, one-line help shown by ``fstier --help``).
#: The help is spelled here so that listing commands imports none of them;
#: tests/test_cli.py checks it equals the first sentence of each command's
#: docstring (``get_short_help_str`` without a length limit).
COMMANDS: dict[str, tuple[str, str, str]] = {
    "bench": (
        "fstier.cli.bench",
        "bench_cmd",
        "fstier store/load vs raw O_DIRECT on the same directory in the same run.",
    ),
    "config": ("fstier.cli.config", "config_group", "Validate or show a YAML configuration."),
    "demo": (
        "fstier.cli.demo",
        "demo_cmd",
        "The end-to-end tour: tp=2 ranks store, tp=4 ranks load, and every fail-closed case "
        "(MLA, hybrid, corruption, restart).",
    ),
    "gc": (
        "fstier.cli.gc",
        "gc_cmd",
        "Evict least-recently-used blocks under ROOT down to --max-bytes and sweep stale temp "
        "files, with the same code as FsTier's capacity manager.",
    ),
    "inspect": (
        "fstier.cli.inspect",
        "inspect_cmd",
        "One row per namespace under ROOT: model, parallel layout, files, bytes, ages.",
    ),
    "status": (
        "fstier.cli.status",
        "status_cmd",
        "A live view of ROOT: usage against max_bytes, the instances and hosts sharing it, the lease, namespaces.",
    ),
    "verify": (
        "fstier.cli.verify",
        "verify_cmd",
        "Read and check every block under ROOT (header, key, length, checksum).",
    ),
}


class _FstierGroup(click.Group):
    """Lazy command registration plus one error policy for the whole tree.

    click prints its own usage errors as three lines (usage, hint, error) and
    nothing on stdout even under ``--json``, and turns Ctrl-C into "Aborted!"
    after a traceback-free but unhelpful exit 1. Here every failure that
    reaches the top, click's included, is one line on stderr, and one JSON
    document on stdout when ``--json`` was given.
    """

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted(COMMANDS)

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        spec = COMMANDS.get(cmd_name)
        if spec is None:
            return None
        command: click.Command = getattr(importlib.import_module(spec[0]), spec[1])
        return command

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        rows = [(name, COMMANDS[name][2]) for name in self.list_commands(ctx)]
        with formatter.section("Commands"):
            formatter.write_dl(rows)

    def main(
        self,
        args: Sequence[str] | None = None,
        prog_name: str | None = None,
        complete_var: str | None = None,
        standalone_mode: bool = True,
        **extra: Any,
    ) -> Any:
        argv = list(sys.argv[1:] if args is None else args)
        as_json = "--json" in argv
        try:
            rv = super().main(argv, prog_name, complete_var, standalone_mode=False, **extra)
        except OSError as exc:
            if exc.errno != errno.EPIPE:
                _fail(exc, as_json)
            # The reader of our stdout went away (``| head``): stop quietly, and
            # point stdout at /dev/null so the interpreter's final flush does
            # not raise again.
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, sys.stdout.fileno())
            sys.exit(EXIT_FAILURE)
        except (Exception, KeyboardInterrupt) as exc:
            _fail(exc, as_json)
        if not standalone_mode:
            return rv
        sys.exit(rv if isinstance(rv, int) else 0)


def _fail(exc: BaseException, as_json: bool) -> NoReturn:
    """THE error handler of every command: the typed failure ``exc`` stands
    for (:func:`fstier.cli.exits.failure_for`) as one line on stderr and,
    under ``--json``, one document on stdout; then exit with its code. A
    :class:`~fstier.cli.exits.ReportFailed` printed its report already. An
    exception that is no command's failure (a bug) keeps its traceback."""
    failure = failure_for(exc)
    if failure is None:
        raise exc
    message = display(failure.format_message())
    if isinstance(failure, ReportFailed):
        if not as_json and not failure.shown:
            click.echo(message, err=True)
    else:
        if as_json:
            emit_json({"ok": False, "exit_code": failure.exit_code, "error": message})
        click.echo(message, err=True)
    sys.exit(failure.exit_code)


@click.group(cls=_FstierGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="fstier")
def main() -> None:
    """fstier: a filesystem tier for LLM KV caches.

    \b
    Start with `fstier demo`: tp=2 ranks store a prompt's KV blocks, tp=4
    ranks load them back, and every case that must fail closed is shown.
    Exit codes: 0 ok, 1 failure, 2 usage or configuration error, 130 Ctrl-C.
    """

