"""``fstier demo``: runs the scenario (:mod:`fstier.demo.scenario`) and prints
its report, a table for people or one JSON document with ``--json``."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from typing import Any

import click

from fstier.cli.exits import ReportFailed, RuntimeFailure
from fstier.cli.options import json_option
from fstier.cli.output import display, emit_report, fmt_size, make_console
from fstier.config import load_config
from fstier.demo.processes import ctrl_c_recorded
from fstier.demo.scenario import CaseResult, DemoOptions, DemoReport, run_demo

__all__ = ["CaseResult", "DemoOptions", "DemoReport", "demo_cmd", "run_demo"]


# -- the command -----------------------------------------------------------
def _torch_installed() -> bool:
    try:
        return importlib.util.find_spec("torch") is not None
    except (ImportError, ValueError):  # a finder that refuses it, a broken entry
        return False


@click.command("demo")
@click.option(
    "--root",
    "root",
    type=click.Path(file_okay=False),
    default=None,
    help="Root directory (default: a fresh temp dir, removed after).",
)
@click.option(
    "--config",
    "config_file",
    type=click.Path(dir_okay=False),
    default=None,
    help="YAML config: its tier settings (and a full-attention model) are used.",
)
@click.option("--per-layer", is_flag=True, help="Allocate one KV tensor per layer instead of the cross-layer layout.")
@json_option
def demo_cmd(root: str | None, config_file: str | None, per_layer: bool, as_json: bool) -> None:
    """The end-to-end tour: tp=2 ranks store, tp=4 ranks load, and every
    fail-closed case (MLA, hybrid, corruption, restart). Exit 0 only when
    every outcome matches what is expected."""
    # The config first: a bad file is exit 2 before anything heavy is imported.
    cfg = load_config(config_file) if config_file else None
    # Found, not imported: importing torch starts a thread, and the demo
    # starts its forkserver while it has one (demo.processes.start_forkserver).
    if not _torch_installed():
        # torch is an extra: the tier and the other commands never need it.
        raise RuntimeFailure(
            "fstier demo needs torch (its ranks stage KV tensors) and it is not installed; "
            "install torch (fstier's torch extra; on a CPU-only machine pip install torch==2.13.0)",
        )

    show_progress = not as_json and sys.stderr.isatty()
    opts = DemoOptions(
        root=Path(root) if root else None,
        config=cfg,
        per_layer=per_layer,
        progress=show_progress,
    )
    # The report is printed inside the recorder too: a Ctrl-C up to the
    # last line still ends the command with exit 130 (demo.processes).
    with ctrl_c_recorded():
        report = run_demo(opts)
        verdict = None if report.ok else "some outcomes differ from what is expected (see cases)"
        if as_json:
            emit_report(report.to_json(), verdict)
        else:
            _print_demo(report)
    if verdict is not None:
        # The table's last line (or the JSON document's ``error``) says it.
        raise ReportFailed(verdict, shown=True)


def _print_demo(report: Any) -> None:
    import textwrap

    from fstier.cli.tables import Column, print_table, terminal_width

    console = make_console()
    where = f"{report.root} (temporary, now deleted)" if report.root_temporary else report.root
    # At 80 columns: case, expected, outcome, the verdict and what was loaded;
    # the rest as the width allows, and the details under the table if their
    # column did not fit (--wide is not needed to read them).
    columns = (Column("case", 0), Column("expected", 1), Column("outcome", 0), Column("", 0),
               Column("stored", 3, "right"), Column("loaded", 2, "right"), Column("bytes", 4, "right"),
               Column("GB/s", 5, "right"), Column("detail", 6))
    rows = [
        [display(c.name), display(c.expected), display(c.outcome), "ok" if c.ok else "MISMATCH",
         str(c.stored_blocks), str(c.loaded_blocks), fmt_size(c.bytes), f"{c.gbps:.2f}" if c.gbps else "-",
         display(c.detail)]
        for c in report.cases
    ]
    dropped = print_table(columns, rows, title=display(f"fstier demo ({report.layout} KV cache) root={where}"))
    if "detail" in dropped:
        width = max(terminal_width(), 40)
        for c in report.cases:
            if c.detail:
                click.echo(textwrap.fill(f"{c.name}: {c.detail}", width=width, initial_indent="- ",
                                         subsequent_indent="  "))
    verdict = "[green]all outcomes as expected[/green]" if report.ok else "[red]some outcomes differ[/red]"
    # Wrapped at the terminal's width like the table above it.
    console.width = max(terminal_width(), 40)
    console.print(
        f"store {report.store_gbps:.2f} GB/s, load {report.load_gbps:.2f} GB/s "
        f"(o_direct={report.o_direct}); {verdict}; {report.seconds:.1f} s"
    )
