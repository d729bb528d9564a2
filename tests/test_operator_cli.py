"""CLI tables an operator can read (issue 22, point 7): ``inspect`` and
``verify`` fit the terminal (COLUMNS) by dropping columns, never by cutting
what people type back (namespace names with their digest); ``--wide`` shows
all; both commands agree on what a namespace is. Real roots, the real
``fstier`` entry point in a subprocess (off a terminal, as in CI)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import make_config
from test_cli import store_blocks

REPO = Path(__file__).resolve().parents[1]
GROUP = [{"kind": "full_attention", "block_size": 4, "num_layers": 1, "num_kv_heads": 1, "head_size": 8}]
LONG_MODEL = "organization-with-a-long-name/Some-Very-Long-Model-Name-Instruct-v2"


def fstier(*args: str, columns: int | None = None) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    env.pop("COLUMNS", None)
    if columns is not None:
        env["COLUMNS"] = str(columns)
    return subprocess.run(
        [sys.executable, "-m", "fstier.cli", *args], capture_output=True, text=True, timeout=120, env=env
    )


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("cli") / "root"
    store_blocks(make_config(root, groups=GROUP), 3)
    store_blocks(make_config(root, groups=GROUP, model={"name": LONG_MODEL, "groups": GROUP}), 2)
    store_blocks(
        make_config(root, groups=GROUP, model={"name": "x" * 64, "groups": GROUP}), 1
    )  # the longest name there is
    (root / "junk").mkdir()
    (root / "junk" / "x.bin").write_bytes(b"x")
    (root / "lost+found").mkdir()
    return root


def _namespaces(root: Path) -> list[dict]:
    return json.loads(fstier("inspect", str(root), "--json").stdout)["namespaces"]


@pytest.mark.parametrize("columns", [80, 100, 60])
def test_inspect_at_narrow_widths_shows_each_namespace_whole_on_one_line(root: Path, columns: int) -> None:
    res = fstier("inspect", str(root), columns=columns)
    assert res.returncode == 0, res.stderr
    lines = res.stdout.splitlines()
    for ns in _namespaces(root):
        name = ns["namespace"]
        # The name whole, with its files and bytes, on one line.
        (line,) = [ln for ln in lines if name in ln.split()]
        fields = line.split()
        assert fields[fields.index(name) - 1 if fields[0] != name else 1] is not None
        assert str(ns["files"]) in fields, line
        size = f"{ns['bytes'] / 1024:.1f} KiB"
        assert size in line, (size, line)
        if len(name) + 24 <= columns:  # the name, files and bytes fit: so does the line
            assert len(line) <= columns, (columns, line)
    assert "…" not in res.stdout and "--wide" in res.stdout
    # Only a name too long for the terminal (64 characters of model + digest)
    # makes a line longer than the terminal, and only its own.
    long_lines = [ln for ln in lines if len(ln) > columns]
    assert all(any(len(ns["namespace"]) + 20 > columns and ns["namespace"] in ln for ns in _namespaces(root))
               for ln in long_lines), long_lines


def test_inspect_wide_shows_every_column(root: Path) -> None:
    res = fstier("inspect", str(root), "--wide", columns=80)
    header = next(ln for ln in res.stdout.splitlines() if ln.startswith("namespace"))
    for col in ("engine", "row", "blocks/chunk", "model", "revision", "parallel", "groups", "files", "bytes",
                "oldest", "newest", "temp"):
        assert col in header.split(), col
    assert "not shown" not in res.stdout
    assert LONG_MODEL in res.stdout  # the model column is not cut either


def test_verify_never_shortens_a_namespace_name(root: Path) -> None:
    res = fstier("verify", str(root), columns=40)
    assert res.returncode == 0, res.stderr
    for ns in _namespaces(root):
        assert any(ns["namespace"] in ln.split() for ln in res.stdout.splitlines()), ns["namespace"]
    assert "…" not in res.stdout
    # What verify prints is what --namespace takes back.
    name = next(ns["namespace"] for ns in _namespaces(root) if ns["model"] == LONG_MODEL)
    again = fstier("verify", str(root), "--namespace", name, "--json")
    assert again.returncode == 0 and json.loads(again.stdout)["namespaces"][0]["namespace"] == name


def test_inspect_and_verify_agree_on_what_a_namespace_is(root: Path) -> None:
    inspected = {ns["namespace"] for ns in _namespaces(root)}
    verified = {ns["namespace"] for ns in json.loads(fstier("verify", str(root), "--json").stdout)["namespaces"]}
    assert inspected == verified and len(inspected) == 3
    assert "junk" not in inspected and "lost+found" not in inspected
    doc = json.loads(fstier("inspect", str(root), "--json").stdout)
    assert doc["stray_entries"] == 2
    # A directory named like a namespace but without a manifest is listed by
    # both (with why), so a broken namespace is never silently ignored.
    broken = root / "acme_broken-0123456789abcdef"
    broken.mkdir()
    try:
        ins = {ns["namespace"]: ns for ns in _namespaces(root)}
        ver = {ns["namespace"] for ns in json.loads(fstier("verify", str(root), "--json").stdout)["namespaces"]}
        assert broken.name in ins and broken.name in ver and "missing" in ins[broken.name]["manifest_error"]
        text = fstier("inspect", str(root), columns=80).stdout
        assert f"{broken.name}: not counted:" in text
    finally:
        broken.rmdir()


def test_demo_reads_at_80_columns(tmp_path: Path) -> None:
    """`fstier demo` at 80 columns: one line per case with its verdict, the
    details under the table, nothing wider than the terminal (it used to wrap
    into ~70 lines)."""
    res = fstier("demo", "--root", str(tmp_path / "root"), columns=80)
    assert res.returncode == 0, res.stdout + res.stderr
    lines = res.stdout.splitlines()
    assert all(len(ln) <= 80 for ln in lines), [ln for ln in lines if len(ln) > 80]
    assert len(lines) <= 30, len(lines)
    cases = [ln for ln in lines if ln.rstrip().split()[-2:-1] == ["ok"] or " ok " in ln]
    assert len(cases) >= 6, res.stdout
    assert any(ln.startswith("- corruption") for ln in lines)  # the detail column, below the table
