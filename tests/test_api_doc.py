"""docs/api.md renders the whole public API (issue 43), read the way mkdocstrings reads it (griffe, static).

* every public module has a ``::: module`` entry: a module of the package, none of whose names starts with ``_``,
  outside the internal packages (the tier's parts ``fstier.tier``, the storage layer's modules behind its face
  ``fstier.io``, the command line ``fstier.cli``, the demo ``fstier.demo``). A new public module not in api.md fails;
* every class and function that ``fstier`` or ``fstier.io`` exports is rendered by an entry (its own, or its
  module's), and every class and function a rendered module exports has a docstring (mkdocstrings shows nothing for
  one without).

Cost: one static load of the package by griffe (about a second); nothing is imported.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

griffe = pytest.importorskip("griffe", reason="griffe comes with the dev extra (mkdocstrings[python])")

REPO = Path(__file__).resolve().parents[1]
API = REPO / "docs" / "api.md"

#: packages whose modules are internal, with where their public face is
INTERNAL = {
    "fstier.tier": "the tier's parts, behind fstier.manager.FsTier",
    "fstier.cli": "the command line, documented in docs/cli.md",
    "fstier.demo": "the demo behind `fstier demo`",
}
#: packages that are public as a face: the package renders, its modules are internal
FACES = ("fstier.io",)


def _entries() -> dict[str, bool]:
    """Each ``::: path`` of api.md -> whether it renders members (``members: false`` says it does not)."""
    text = API.read_text()
    out = {}
    for m in re.finditer(r"^::: (\S+)\n((?:[ \t]+\S.*\n)*)", text, re.M):
        out[m.group(1)] = not re.search(r"members:\s*false", m.group(2))
    return out


def public_modules() -> list[str]:
    names = []
    for path in sorted((REPO / "fstier").rglob("*.py")):
        parts = list(path.relative_to(REPO).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        name = ".".join(parts)
        if any(p.startswith("_") for p in parts) or any(name == i or name.startswith(i + ".") for i in INTERNAL):
            continue
        if any(name.startswith(face + ".") for face in FACES):
            continue
        names.append(name)
    return names


@pytest.fixture(scope="module")
def package() -> object:
    return griffe.load("fstier", search_paths=[str(REPO)], allow_inspection=False)


def test_every_public_module_is_rendered() -> None:
    entries = _entries()
    missing = [m for m in public_modules() if m not in entries]
    assert missing == [], f"add a `::: module` entry to docs/api.md for {missing} (or make the module private)"


def _get(package: object, path: str) -> object:
    return package if path == "fstier" else package[path.removeprefix("fstier.")]  # type: ignore[index]


def _rendered(path: str, entries: dict[str, bool]) -> bool:
    """Whether an entry renders ``path``: its own, or an enclosing one that renders members."""
    if path in entries:
        return True
    parts = path.split(".")
    return any(entries.get(".".join(parts[:i])) for i in range(len(parts) - 1, 0, -1))


@pytest.mark.parametrize("face", ["fstier", "fstier.io"])
def test_every_class_and_function_of_the_public_faces_is_rendered(package: object, face: str) -> None:
    entries = _entries()
    module = _get(package, face)
    missing = []
    for name in module.exports:  # type: ignore[attr-defined]
        obj = module[name]  # type: ignore[index]
        if obj.kind.value not in ("class", "function"):
            continue  # data and type aliases are documented by a `#:` comment where they are defined
        here = f"{face}.{name}"
        if not (_rendered(here, entries) or _rendered(obj.canonical_path, entries)):
            missing.append(obj.canonical_path)
        elif not obj.docstring:
            missing.append(f"{obj.canonical_path} (no docstring)")
    assert missing == [], f"{face} exports what docs/api.md does not render: {missing}"


def test_every_class_and_function_a_rendered_module_exports_has_a_docstring(package: object) -> None:
    bare = []
    for path, members in _entries().items():
        obj = _get(package, path)
        if obj.kind.value != "module" or not members:  # type: ignore[attr-defined]
            continue
        names = obj.exports if obj.exports is not None else [  # type: ignore[attr-defined]
            n for n in obj.members if not n.startswith("_")  # type: ignore[attr-defined]
        ]
        for name in names:
            member = obj[name]  # type: ignore[index]
            if member.kind.value in ("class", "function") and not member.docstring:
                bare.append(f"{path}.{name}")
    assert bare == [], f"rendered without a word (give each a docstring): {bare}"


def test_a_new_public_module_would_fail(tmp_path: Path) -> None:
    """The check is not vacuous: a module the page does not name is reported, a private or internal one is not."""
    entries = _entries()
    assert "fstier.manager" in entries and "fstier.integrations.vllm" in entries
    assert "fstier.integrations.vllm" in public_modules() and "fstier.io" in public_modules()
    assert not {"fstier.tier.jobs", "fstier.io.pool", "fstier.integrations._options"} & set(public_modules())
    assert not _rendered("fstier.integrations.new_engine", entries)
