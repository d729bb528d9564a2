"""The shape of ``cli/`` and ``demo/`` (docs/architecture.md): modules small
enough to read, helpers shared under public names from the module that owns
them, and ONE place that turns failures into exit codes."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parents[1] / "fstier"
MODULES = sorted([*PKG.joinpath("cli").rglob("*.py"), *PKG.joinpath("demo").rglob("*.py")])
#: A module past this many lines holds more than one concept: split it.
MAX_LINES = 600


def _name(path: Path) -> str:
    return str(path.relative_to(PKG.parent))


@pytest.mark.parametrize("path", MODULES, ids=_name)
def test_no_module_in_cli_or_demo_exceeds_600_lines(path: Path) -> None:
    n = len(path.read_text().splitlines())
    assert n <= MAX_LINES, f"{_name(path)} has {n} lines (> {MAX_LINES}): split it by concept"


def test_no_private_name_is_imported_across_modules() -> None:
    """A helper another module needs is public in its owner's module
    (``from fstier.cli.output import display``), never ``_display``."""
    bad = []
    for path in MODULES:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith(("fstier.cli", "fstier.demo")):
                bad += [f"{_name(path)}: {node.module}.{a.name}" for a in node.names if a.name.startswith("_")]
    assert bad == []


def test_only_the_command_group_exits() -> None:
    """Commands raise typed failures (fstier.cli.exits); the group's one
    handler prints them and calls sys.exit, so no command decides an exit
    code on its own."""
    calls = []
    for path in MODULES:
        if path == PKG / "cli" / "__init__.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and ast.unparse(node.func) in ("sys.exit", "exit", "os._exit"):
                calls.append(f"{_name(path)}:{node.lineno}")
    assert calls == []
