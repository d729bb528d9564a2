"""Every reference the docs make resolves (issue 43): a name moved or deleted fails here, not in a reader's hands.

Checked, statically (the sources are parsed, nothing of fstier is imported, so torch and the engines are not needed):

* every Sphinx-role cross-reference (``:func:``, ``:class:``, ``:meth:``, ``:mod:``, ``:data:``, ``:attr:``,
  ``:exc:``) in a docstring or comment of ``fstier/``, resolved as Sphinx would: against the enclosing class and its
  bases, the module's own names and imports, then the package's top-level names; a ``fstier.`` path must exist as
  written; a standard-library target is looked up in the running interpreter;
* every ``fstier.x.y`` module or name and every repository path (``fstier/...``, ``tests/...``, ``benchmarks/...``,
  ``examples/...``, ``docs/...``, ``scripts/...``) quoted in back-quotes in ``docs/*.md`` and the README, and every
  such path or module named in the C sources' comments and in the package's docstrings and comments; a test node id
  (``tests/x.py::test_y``) must name a test function of that file.

Cost: one parse of every module of the package, well under a second.
"""

from __future__ import annotations

import ast
import builtins
import fnmatch
import importlib
import re
from dataclasses import dataclass, field
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PKG = REPO / "fstier"

ROLE = re.compile(r":(func|class|meth|mod|data|attr|exc|obj|const):`([^`]+)`")
#: a module or name of the package, as a docstring or a page quotes it (``fstier.io.pool.IOPool``)
DOTTED = re.compile(r"(?<![\w./-])(fstier(?:\.[A-Za-z_][A-Za-z0-9_]*)+)")
#: a repository path, as a page, a docstring or a C comment quotes it (``fstier/io/pool.py``, ``tests/x.py::t``)
PATH = re.compile(r"(?<![\w./-])((?:fstier|tests|benchmarks|examples|docs|scripts)/[A-Za-z0-9_./*-]*(?:::[\w*]+)?)")
#: a member of a class as a page quotes it (``FsTier.submit_load``, ``BlockStore.present_within``)
MEMBER = re.compile(r"(?<![\w.])([A-Z][A-Za-z0-9_]*(?:\.[a-z_][A-Za-z0-9_]*)+)")
#: standard-library (and pydantic) roots a role may point into; anything else outside fstier is not checkable here
#: (the runtime dependencies import quickly and without torch)
EXTERNAL_ROOTS = frozenset({"os", "time", "threading", "asyncio", "pathlib", "signal", "mmap", "ctypes",
                            "concurrent", "multiprocessing", "logging", "errno", "stat", "pydantic", "click",
                            "numpy", "xxhash", "yaml"})


@dataclass
class ClassInfo:
    module: str
    name: str
    members: dict[str, ClassInfo | None] = field(default_factory=dict)
    bases: list[str] = field(default_factory=list)
    #: an attribute's or property's type as written (``self.metrics = TierMetrics()``, ``x: T``, ``-> T``)
    types: dict[str, str] = field(default_factory=dict)


@dataclass
class ModuleInfo:
    name: str
    path: Path
    defs: dict[str, ClassInfo | None] = field(default_factory=dict)
    imports: dict[str, str] = field(default_factory=dict)
    classes_by_line: list[tuple[int, int, ClassInfo]] = field(default_factory=list)


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _type_of(node: ast.AST) -> str | None:
    """The class an assignment's value or annotation names, as written (``TierMetrics()`` -> ``TierMetrics``)."""
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name | ast.Attribute):
        return ast.unparse(node.func)
    if isinstance(node, ast.Name | ast.Attribute):
        return ast.unparse(node)
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    return None


def _class_info(node: ast.ClassDef, module: str, out: list[tuple[int, int, ClassInfo]]) -> ClassInfo:
    info = ClassInfo(module, node.name, bases=[ast.unparse(b) for b in node.bases])
    out.append((node.lineno, node.end_lineno or node.lineno, info))
    for stmt in node.body:
        if isinstance(stmt, ast.ClassDef):
            info.members[stmt.name] = _class_info(stmt, module, out)
        elif isinstance(stmt, ast.FunctionDef | ast.AsyncFunctionDef):
            info.members[stmt.name] = None
            is_property = any(ast.unparse(d) == "property" for d in stmt.decorator_list)
            if is_property and stmt.returns is not None and (kind := _type_of(stmt.returns)) is not None:
                info.types[stmt.name] = kind
            for sub in ast.walk(stmt):  # self.x = ... / self.x: T = ... in any method
                if isinstance(sub, ast.Assign):
                    targets, kind = sub.targets, _type_of(sub.value)
                elif isinstance(sub, ast.AnnAssign):
                    targets, kind = [sub.target], _type_of(sub.annotation)
                else:
                    continue
                for t in targets:
                    if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self":
                        info.members.setdefault(t.attr, None)
                        if kind is not None:
                            info.types.setdefault(t.attr, kind)
        elif (
            isinstance(stmt, ast.AnnAssign)
            and isinstance(stmt.target, ast.Name)
            and (kind := _type_of(stmt.annotation)) is not None
        ):
            info.types.setdefault(stmt.target.id, kind)
        for name in _assigned(stmt):
            info.members.setdefault(name, None)
    return info


def _assigned(stmt: ast.stmt) -> list[str]:
    if isinstance(stmt, ast.Assign):
        return [n.id for t in stmt.targets for n in ast.walk(t) if isinstance(n, ast.Name)]
    if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name):
        return [stmt.target.id]
    return []


def _index_module(path: Path) -> ModuleInfo:
    name = _module_name(path)
    tree = ast.parse(path.read_text())
    info = ModuleInfo(name, path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(tree):  # every import, top-level or not (TYPE_CHECKING, function-local)
        if isinstance(node, ast.Import):
            for a in node.names:
                info.imports.setdefault(a.asname or a.name.split(".")[0], a.name if a.asname else a.name.split(".")[0])
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: up node.level - 1 packages from this one
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*up, base] if base else up)
            for a in node.names:
                info.imports.setdefault(a.asname or a.name, f"{base}.{a.name}")
    for stmt in tree.body:
        if isinstance(stmt, ast.ClassDef):
            info.defs[stmt.name] = _class_info(stmt, name, info.classes_by_line)
        elif isinstance(stmt, ast.FunctionDef | ast.AsyncFunctionDef):
            info.defs[stmt.name] = None
        elif isinstance(stmt, ast.If | ast.Try):  # definitions under `if`/`try` at the top level
            for sub in ast.walk(stmt):
                if isinstance(sub, ast.ClassDef) and not isinstance(info.defs.get(sub.name), ClassInfo):
                    info.defs[sub.name] = _class_info(sub, name, info.classes_by_line)
                elif isinstance(sub, ast.FunctionDef | ast.AsyncFunctionDef):
                    info.defs.setdefault(sub.name, None)
                elif isinstance(sub, ast.Assign | ast.AnnAssign):
                    for n in _assigned(sub):
                        info.defs.setdefault(n, None)
        for n in _assigned(stmt):
            info.defs.setdefault(n, None)
    return info


class Index:
    """The package's names, parsed once: modules, their top-level names and imports, classes and members."""

    def __init__(self) -> None:
        self.modules = {m.name: m for m in map(_index_module, sorted(PKG.rglob("*.py")))}
        stub = PKG / "io" / "_native.pyi"
        self.modules["fstier.io._native"] = _index_module(stub)
        self.modules["fstier.io._native"].name = "fstier.io._native"
        self.top_level: dict[str, list[str]] = {}
        for mod in self.modules.values():
            for name in mod.defs:
                self.top_level.setdefault(name, []).append(mod.name)

    # -- absolute paths ------------------------------------------------------------------------------------------
    def resolve(self, dotted: str, seen: frozenset[str] = frozenset()) -> object | None:
        """What ``dotted`` names (a module, a ClassInfo, or True for a leaf), or None if nothing."""
        if dotted in seen:
            return None
        parts = dotted.split(".")
        for i in range(len(parts), 0, -1):
            mod = ".".join(parts[:i])
            if mod in self.modules:
                return self._walk(self.modules[mod], parts[i:], seen | {dotted})
        if parts[0] in EXTERNAL_ROOTS or hasattr(builtins, parts[0]):
            return _external(parts)
        return None

    def _walk(self, obj: object, rest: list[str], seen: frozenset[str]) -> object | None:
        for name in rest:
            obj = self._member(obj, name, seen)
            if obj is None:
                return None
        return obj

    def _member(self, obj: object, name: str, seen: frozenset[str]) -> object | None:
        if isinstance(obj, ModuleInfo):
            if name in obj.defs:
                return obj.defs[name] or True
            if name in obj.imports:
                return self.resolve(obj.imports[name], seen)
            return self.modules.get(f"{obj.name}.{name}")
        if isinstance(obj, ClassInfo):
            if name.startswith("__") and name.endswith("__"):
                return True  # the object protocol (``__hash__``, ``__eq__``): every class has it
            if name in obj.members:
                if obj.members[name] is None and name in obj.types:  # an attribute of a known class
                    kind = self.in_module(obj.types[name], obj.module, None, seen)
                    if isinstance(kind, ClassInfo):
                        return kind
                return obj.members[name] or True
            for base in obj.bases:
                found = self.in_module(base, obj.module, None, seen)
                if isinstance(found, ClassInfo | _External) and (hit := self._member(found, name, seen)) is not None:
                    return hit
            return None
        if isinstance(obj, _External):
            return _External(getattr(obj.value, name)) if hasattr(obj.value, name) else None
        return None

    # -- names as a module's text writes them --------------------------------------------------------------------
    def in_module(self, target: str, module: str, cls: ClassInfo | None, seen: frozenset[str] = frozenset()) -> object:
        """What ``target`` names where ``module`` (inside ``cls``) writes it; the first scope that resolves the
        whole dotted name wins: the class and the classes around it, the module, absolute and standard-library
        paths, then a top-level name of any module of the package."""
        parts = target.split(".")
        scopes: list[ModuleInfo | ClassInfo] = []
        scope = cls
        while scope is not None:
            scopes.append(scope)
            scope = self._outer(scope)
        scopes.append(self.modules[module])
        for owner in scopes:
            if (hit := self._walk(owner, parts, seen)) is not None:
                return hit
        if (hit := self.resolve(target, seen)) is not None:
            return hit
        for owner_name in self.top_level.get(parts[0], []):  # a top-level name of another module of the package
            if (hit := self._walk(self.modules[owner_name], parts, seen)) is not None:
                return hit
        return None

    def _outer(self, cls: ClassInfo) -> ClassInfo | None:
        for _, _, other in self.modules[cls.module].classes_by_line:
            if cls in [m for m in other.members.values() if isinstance(m, ClassInfo)]:
                return other
        return None

    def class_at(self, module: str, line: int) -> ClassInfo | None:
        """The innermost class whose body holds ``line`` of ``module``."""
        spans = [(s, e, c) for s, e, c in self.modules[module].classes_by_line if s <= line <= e]
        return max(spans, key=lambda s: s[0])[2] if spans else None


@dataclass
class _External:
    value: object


def _external(parts: list[str]) -> _External | None:
    if hasattr(builtins, parts[0]):
        obj: object = getattr(builtins, parts[0])
        rest = parts[1:]
    else:
        obj, rest = None, parts
        for i in range(len(parts), 0, -1):
            try:
                obj, rest = importlib.import_module(".".join(parts[:i])), parts[i:]
                break
            except ImportError:
                continue
        if obj is None:
            return None
    for name in rest:
        if not hasattr(obj, name):
            return None
        obj = getattr(obj, name)
    return _External(obj)


@pytest.fixture(scope="module")
def index() -> Index:
    return Index()


def _role_target(raw: str) -> str:
    target = raw.split("<")[-1].rstrip(">") if "<" in raw else raw
    return target.strip().lstrip("~.").removesuffix("()")


def unresolved_roles(index: Index, module: str, text: str, label: str) -> list[str]:
    """Every role of ``text`` (the source of ``module``) whose target does not resolve, as ``label:line: role``."""
    bad = []
    for m in ROLE.finditer(text):
        line = text.count("\n", 0, m.start()) + 1
        target = _role_target(m.group(2))
        if index.in_module(target, module, index.class_at(module, line)) is None:
            bad.append(f"{label}:{line}: {m.group(0)}")
    return bad


def test_every_role_reference_in_the_package_resolves(index: Index) -> None:
    bad = []
    for path in [*sorted(PKG.rglob("*.py")), PKG / "io" / "_native.pyi"]:
        module = "fstier.io._native" if path.suffix == ".pyi" else _module_name(path)
        bad += unresolved_roles(index, module, path.read_text(), str(path.relative_to(REPO)))
    assert bad == [], "cross-references to names that do not exist (fix the name, or the claim):\n" + "\n".join(bad)


# -- module names and paths quoted in pages, docstrings and C comments --------------------------------------------
def _logger_names() -> set[str]:
    names = set()
    for path in PKG.rglob("*.py"):
        names.update(re.findall(r"getLogger\(\s*[\"'](fstier[\w.]*)[\"']", path.read_text()))
    return names


def _path_ok(quoted: str) -> bool:
    path, _, node = quoted.rstrip(".").partition("::")
    if "*" in path:
        hits = [p for p in REPO.glob(path) if "__pycache__" not in p.parts]
    else:
        hits = [REPO / path] if (REPO / path).exists() else []
    if not hits:
        return False
    if not node:
        return True
    for hit in hits:
        if hit.suffix != ".py":
            continue
        tree = ast.parse(hit.read_text())
        names = {n.name for n in ast.walk(tree) if isinstance(n, ast.FunctionDef | ast.ClassDef)}
        names |= {t.id for n in tree.body if isinstance(n, ast.Assign) for t in n.targets if isinstance(t, ast.Name)}
        if any(fnmatch.fnmatchcase(name, node) for name in names):
            return True
    return False


def _quoted(text: str) -> list[tuple[int, str]]:
    """(line, span) of every back-quoted span of a Markdown page (code blocks included)."""
    spans = []
    for m in re.finditer(r"```.*?```|``[^`]+``|`[^`\n]+`", text, re.S):
        spans.append((text.count("\n", 0, m.start()) + 1, m.group(0)))
    return spans


def unresolved_names_and_paths(index: Index, sources: dict[Path, list[tuple[int, str]]]) -> list[str]:
    loggers = _logger_names()
    bad = []
    for path, spans in sources.items():
        for line, span in spans:
            for dotted in DOTTED.findall(span):
                dotted = dotted.rstrip(".")
                if dotted not in loggers and index.resolve(dotted) is None:
                    bad.append(f"{path.relative_to(REPO)}:{line}: module or name {dotted}")
            for quoted in PATH.findall(span):
                if not _path_ok(quoted):
                    bad.append(f"{path.relative_to(REPO)}:{line}: path {quoted}")
    return bad


def _comment_spans(path: Path) -> list[tuple[int, str]]:
    """Docstrings and comments of a Python module; comments of a C source (where names and paths are quoted)."""
    text = path.read_text()
    pattern = r"/\*.*?\*/|//[^\n]*" if path.suffix in (".c", ".h") else r'"""(?:.|\n)*?"""|#[^\n]*'
    return [(text.count("\n", 0, m.start()) + 1, m.group(0)) for m in re.finditer(pattern, text, re.S)]


def unresolved_members(index: Index, sources: dict[Path, list[tuple[int, str]]]) -> list[str]:
    """``Class.member`` spans (outside code blocks) whose class is one of the package's and whose member is not."""
    bad = []
    for path, spans in sources.items():
        for line, span in spans:
            if span.startswith("```"):
                continue  # examples: their names are the engine's and the reader's as much as fstier's
            for dotted in MEMBER.findall(span):
                parts = dotted.split(".")
                owners = index.top_level.get(parts[0], [])
                if owners and all(index._walk(index.modules[o], parts, frozenset()) is None for o in owners):
                    bad.append(f"{path.relative_to(REPO)}:{line}: {dotted}")
    return bad


def test_every_module_and_path_the_pages_quote_exists(index: Index) -> None:
    pages = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
    sources = {p: _quoted(p.read_text()) for p in pages}
    bad = unresolved_names_and_paths(index, sources) + unresolved_members(index, sources)
    assert bad == [], "docs quote modules, names or paths that do not exist:\n" + "\n".join(bad)


def test_every_module_and_path_the_sources_name_exists(index: Index) -> None:
    files = [*sorted(PKG.rglob("*.py")), *sorted(PKG.rglob("*.c")), *sorted(PKG.rglob("*.h")), PKG / "io/_native.pyi"]
    bad = unresolved_names_and_paths(index, {p: _comment_spans(p) for p in files})
    assert bad == [], "docstrings and comments name modules or paths that do not exist:\n" + "\n".join(bad)


# -- the checks fail on a broken reference -------------------------------------------------------------------------
def test_a_broken_reference_fails_the_checks(index: Index, tmp_path: Path) -> None:
    """The checks above are not vacuous: a deleted name, a moved module and a missing path are each reported."""
    text = (PKG / "manager.py").read_text()
    assert unresolved_roles(index, "fstier.manager", text, "manager.py") == []
    broken = text + '\n"""See :meth:`FsTier.submit_loads`, :func:`fstier.io.blockio.touch_file`, :class:`FsTier`."""\n'
    assert [b.rsplit(": ", 1)[1] for b in unresolved_roles(index, "fstier.manager", broken, "manager.py")] == [
        ":meth:`FsTier.submit_loads`",
        ":func:`fstier.io.blockio.touch_file`",
    ]
    assert index.in_module("prefix_keys", "fstier.keys", None) is not None
    assert index.in_module("prefix_keys_gone", "fstier.keys", None) is None
    assert index.in_module("FsTier.submit_load", "fstier.keys", None) is not None
    assert index.in_module("FsTier.submit_loads", "fstier.keys", None) is None
    assert index.resolve("fstier.io.blockstore.BlockStore") is not None
    assert index.resolve("fstier.io.blockstore.verify_file") is None
    assert index.resolve("fstier.io.posix") is None
    page = tmp_path / "page.md"
    page.write_text("See `fstier.io.blockio` and `fstier/io/posix.py` and `tests/test_docs.py::test_nothing_here`.\n"
                    "`FsTier.submit_loads` is gone, `FsTier.metrics.snapshot` and `BlockKey.__hash__` are not.\n")
    sources = {REPO / "docs" / "page.md": _quoted(page.read_text())}
    assert len(unresolved_names_and_paths(index, sources)) == 3
    assert [b.rsplit(": ", 1)[1] for b in unresolved_members(index, sources)] == ["FsTier.submit_loads"]
