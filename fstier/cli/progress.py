"""Progress on stderr while a long command runs, for people only.

Shown only when stderr is a terminal and never with ``--json``
(:func:`show_progress`); otherwise a :class:`Progress` is a no-op whose
``advance`` costs one attribute test, cheap enough for per-file calls.
rich is imported only when a bar is really shown.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from typing import Any

__all__ = ["Progress", "progress_bar", "show_progress"]


class Progress:
    """A count of files on stderr while a long walk runs, for a terminal only.

    ``total`` known: a bar with done/total and time left (verify counts first);
    unknown: a spinner with the running count and rate (inspect, gc: counting
    first would double a walk that takes a minute at a million files).
    ``advance`` is cheap enough for per-file calls: it batches updates.
    """

    _BATCH = 64

    def __init__(self, label: str, enabled: bool, total: int | None = None) -> None:
        self._bar: Any = None
        self._pending = 0
        if not enabled:
            return
        from rich.console import Console
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            Progress,
            SpinnerColumn,
            TextColumn,
            TimeElapsedColumn,
            TimeRemainingColumn,
        )

        console = Console(stderr=True)
        if total is None:
            self._bar = Progress(
                SpinnerColumn(),
                TextColumn(f"{label}: {{task.completed:,}} files"),
                TimeElapsedColumn(),
                console=console,
                transient=True,
            )
        else:
            self._bar = Progress(
                TextColumn(label),
                BarColumn(),
                MofNCompleteColumn(),
                TimeRemainingColumn(),
                console=console,
                transient=True,
            )
        self._task = self._bar.add_task(label, total=total)
        self._bar.start()

    def advance(self, n: int = 1) -> None:
        if self._bar is None:
            return
        self._pending += n
        if self._pending >= self._BATCH:
            self._bar.advance(self._task, self._pending)
            self._pending = 0

    def close(self) -> None:
        if self._bar is not None:
            self._bar.stop()
            self._bar = None


@contextlib.contextmanager
def progress_bar(label: str, enabled: bool, total: int | None = None) -> Iterator[Progress]:
    bar = Progress(label, enabled, total)
    try:
        yield bar
    finally:
        bar.close()


def show_progress(as_json: bool) -> bool:
    """Progress is for people: stderr must be a terminal, and never with --json."""
    return not as_json and sys.stderr.isatty()
