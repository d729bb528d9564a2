"""Prints the figures docs/reliability.md publishes at the end of a run
(``pytest -s`` not needed): kills survived, corruptions tried and detected,
concurrent operations, faults injected, wrong bytes loaded."""

from __future__ import annotations

import sys
from typing import Any


def pytest_terminal_summary(terminalreporter: Any) -> None:
    mods = {name.rsplit(".", 1)[-1]: mod for name, mod in sys.modules.items() if name.startswith("reliability.test_")}
    if not mods:
        return
    lines = []
    crash = getattr(mods.get("test_crash"), "FIGURES", {})
    if crash:
        kills = crash.get("kills", 0) + crash.get("fast_kills", 0)
        acked = crash.get("acked", 0) + crash.get("fast_acked", 0)
        orphans = crash.get("orphans", 0) + crash.get("fast_orphans", 0)
        lines.append(f"kills survived: {kills} (acknowledged keys verified: {acked}, orphans swept: {orphans})")
    tally = getattr(mods.get("test_corruption"), "TALLY", None)
    if tally is not None and tally.tried:
        lines.append(
            f"corruptions tried: {tally.tried}, detected: {tally.detected}, "
            f"harmless (padding) loads with right bytes: {tally.loaded_ok}, wrong bytes loaded: {tally.wrong_bytes}"
        )
    conc = getattr(mods.get("test_concurrency"), "FIGURES", {})
    if conc:
        lines.append(f"concurrent operations (8 processes): {conc.get('ops', 0) + conc.get('fast_ops', 0)}")
    faults = getattr(mods.get("test_faults"), "FAULTS_INJECTED", {})
    if faults.get("count"):
        lines.append(f"faults injected (io seam): {faults['count']}")
    if lines:
        terminalreporter.section("fstier reliability figures")
        for line in lines:
            terminalreporter.write_line(line)
