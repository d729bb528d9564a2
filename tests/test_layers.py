"""The import rules that make the folders layers (docs/architecture.md,
"Import rules"): checked on every import statement of every module, and on
what importing the storage layer really loads."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PKG = REPO / "fstier"


def _imports(path: Path, *, top_level_only: bool = False) -> list[str]:
    """Every module ``path`` imports (``from x import y`` counts as ``x``
    and ``x.y``), skipping ``if TYPE_CHECKING:`` blocks (no runtime import)."""
    tree = ast.parse(path.read_text())
    out: list[str] = []

    def visit(node: ast.AST, depth: int) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                continue
            if isinstance(child, ast.Import) and not (top_level_only and depth):
                out.extend(a.name for a in child.names)
            elif isinstance(child, ast.ImportFrom) and child.module and not (top_level_only and depth):
                out.append(child.module)
                out.extend(f"{child.module}.{a.name}" for a in child.names)
            nested = isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef)
            visit(child, depth + (1 if nested else 0))

    visit(tree, 0)
    return out


def _modules(*parts: str) -> list[Path]:
    base = PKG.joinpath(*parts)
    return sorted(base.rglob("*.py")) if base.is_dir() else [base]


def _violations(files: list[Path], forbidden: tuple[str, ...], *, top_level_only: bool = False) -> list[str]:
    bad = []
    for f in files:
        for mod in _imports(f, top_level_only=top_level_only):
            if any(mod == p or mod.startswith(p + ".") for p in forbidden):
                bad.append(f"{f.relative_to(REPO)} imports {mod}")
    return bad


def test_io_imports_neither_torch_numpy_nor_the_tier() -> None:
    forbidden = (
        "torch", "numpy", "fstier.manager", "fstier.tier", "fstier.integrations", "fstier.cli",
        "fstier.demo", "fstier.layout", "fstier.cross_layer", "fstier.gpu_copy", "fstier.slots",
    )
    assert _violations(_modules("io"), forbidden) == []


def test_the_tier_imports_no_engine_and_no_cli() -> None:
    forbidden = (
        "vllm",
        "sglang",
        "fstier.integrations",
        "fstier.cli",
        "fstier.demo",
        "fstier.gpu_copy",
        "fstier.layout",
        "fstier.cross_layer",
    )
    assert _violations(_modules("manager.py") + _modules("tier"), forbidden) == []


def test_file_mapper_does_no_block_io() -> None:
    """Naming never imports the storage layer, at import time or inside a
    function (no naming <-> io cycle): the storage layer imports naming."""
    path = PKG / "file_mapper.py"
    assert _violations([path], ("fstier.io", "os.open")) == []


def test_integrations_translate_only() -> None:
    """An engine module adapts the engine to FsTier; it never reaches the
    storage layer itself (only the format version, for its namespace, and the
    file size rule, for the usage it reports in fstier's units)."""
    files = _modules("integrations")
    facts = ("", ".FORMAT_VERSION", ".block_file_size")  # from the storage layer's face
    allowed = tuple(f"imports fstier.io{f}" for f in facts)
    bad = [v for v in _violations(files, ("fstier.io",)) if not v.endswith(allowed)]
    assert bad == []


def _fstier_imports(source: str, package: str) -> list[str]:
    """Every ``fstier`` module or name a module of ``package`` imports,
    ``TYPE_CHECKING`` blocks and function bodies included (``from x import
    y`` counts as ``x.y``; relative imports resolved)."""
    out = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            out.extend(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{parent}.{base}" if base else parent
            out.extend(f"{base}.{a.name}" for a in node.names)
    return [m for m in out if m.split(".")[0] == "fstier"]


def _private_outside_integrations(imports: list[str]) -> list[str]:
    return [
        m for m in imports
        if not m.startswith("fstier.integrations.")
        and any(part.startswith("_") for part in m.split(".")[1:])
    ]


def test_integrations_import_only_public_names_of_fstier() -> None:
    """Outside ``integrations/`` itself, an engine module uses fstier's
    public names only: no ``_``-named module or name (``fstier.config._x``,
    ``fstier._cudart``), so a refactor of the core cannot break an engine."""
    bad = [
        f"{f.relative_to(REPO)} imports {m}"
        for f in _modules("integrations")
        for m in _private_outside_integrations(_fstier_imports(f.read_text(), "fstier.integrations"))
    ]
    assert bad == []


def test_the_private_name_check_sees_every_spelling() -> None:
    source = (
        "from fstier.config import _x, TierConfig\n"
        "import fstier._cudart\n"
        "from .. import _units\n"
        "from . import _options\n"
        "if TYPE_CHECKING:\n    from fstier.io._native import y\n"
        "def f():\n    from fstier.tier.capacity import _loop\n"
    )
    got = _private_outside_integrations(_fstier_imports(source, "fstier.integrations"))
    assert got == [
        "fstier.config._x", "fstier._cudart", "fstier._units", "fstier.io._native.y",
        "fstier.tier.capacity._loop",
    ]


def _io_internals(imports: list[str], face: set[str]) -> list[str]:
    """The ``fstier.io`` imports that are not a name of its face: a module of
    ``io/`` (``fstier.io.blockfile...``, ``from fstier.io import native``) or
    anything below one."""
    out = []
    for m in imports:
        parts = m.split(".")
        if parts[:2] == ["fstier", "io"] and len(parts) > 2 and (len(parts) > 3 or parts[2] not in face):
            out.append(m)
    return out


def test_nothing_outside_io_imports_its_modules() -> None:
    """Code outside ``io/`` takes the storage layer's names from its face
    (``fstier.io.__all__``), never from one of its modules, at import time,
    in a function or for type checking: ``io/`` can move what its modules
    hold without touching the tier, the command line or an engine adapter."""
    import fstier.io

    face = set(fstier.io.__all__)
    bad = []
    for f in sorted(PKG.rglob("*.py")):
        rel = f.relative_to(PKG)
        if rel.parts[0] == "io":
            continue
        package = ".".join(("fstier", *rel.parts[:-1]))
        for m in _io_internals(_fstier_imports(f.read_text(), package), face):
            bad.append(f"{f.relative_to(REPO)} imports {m}")
    assert bad == [], "import these from fstier.io (add the name to its __all__ if it is missing)"


def test_the_io_face_check_sees_every_spelling() -> None:
    import fstier.io

    source = (
        "from fstier.io import BlockStore, native\n"
        "import fstier.io.tree\n"
        "from fstier.io.blockfile import padded_len\n"
        "if TYPE_CHECKING:\n    from fstier.io.engine import EngineJob\n"
        "def f():\n    from .io import fsops\n"
    )
    got = _io_internals(_fstier_imports(source, "fstier"), set(fstier.io.__all__))
    assert got == [
        "fstier.io.native", "fstier.io.tree", "fstier.io.blockfile.padded_len", "fstier.io.engine.EngineJob",
        "fstier.io.fsops",
    ]


#: No module of these folders may grow past this many lines (issue 23: one
#: concept per module; an engine module translates only).
MAX_MODULE_LINES = 600


@pytest.mark.parametrize("folder", ["integrations", "slots"])
def test_no_integration_or_slots_module_exceeds_600_lines(folder: str) -> None:
    long = {
        str(f.relative_to(REPO)): n
        for f in _modules(folder)
        if (n := len(f.read_text().splitlines())) > MAX_MODULE_LINES
    }
    assert long == {}, f"split these modules (one concept each, <= {MAX_MODULE_LINES} lines): {long}"


def test_only_the_engine_side_imports_torch() -> None:
    allowed = {"layout.py", "cross_layer.py", "gpu_copy.py", "_cudart.py"}
    files = [
        f for f in sorted(PKG.rglob("*.py"))
        if f.name not in allowed and "integrations" not in f.parts and "demo" not in f.parts
    ]
    assert _violations(files, ("torch",), top_level_only=True) == []


@pytest.mark.parametrize("modules", [
    "fstier.io, fstier.io.blockstore, fstier.io.aio, fstier.io.tree, fstier.io.manifest",
    "fstier.manager, fstier.tier.capacity, fstier.tier.gc, fstier.tier.metrics",
    "fstier.slots",
])
def test_importing_the_core_loads_neither_torch_nor_an_engine(modules: str) -> None:
    code = (
        f"import sys, {modules}\n"
        "heavy = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'vllm', 'sglang'))\n"
        "print(heavy)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]", proc.stdout


def test_the_tier_does_block_io_only_through_the_block_store() -> None:
    """FsTier and its parts reach block files through BlockStore alone: the
    native path is chosen inside it (store_many/load_many), never beside it."""
    per_file = ("fstier.io.native", "fstier.io._native", "fstier.io._blockio")
    assert _violations(_modules("manager.py") + _modules("tier"), per_file) == []


#: issue 23: FsTier is its face; no module of the tier or the storage layer
#: grows past what one concept needs.
MANAGER_MAX_LINES = 450
MODULE_MAX_LINES = 600


def test_manager_is_the_tiers_face_and_no_module_is_too_long() -> None:
    manager = len((PKG / "manager.py").read_text().splitlines())
    assert manager <= MANAGER_MAX_LINES, (
        f"fstier/manager.py has {manager} lines (limit {MANAGER_MAX_LINES}): move a concept into fstier/tier/"
    )
    too_long = {
        str(f.relative_to(REPO)): n
        for f in _modules("manager.py") + _modules("tier") + _modules("io")
        if (n := len(f.read_text().splitlines())) > MODULE_MAX_LINES
    }
    assert too_long == {}, f"modules over {MODULE_MAX_LINES} lines: {too_long}; split a concept out"


def test_no_module_of_the_package_exceeds_600_lines() -> None:
    """Issue 23's bound for every module, top level and folders alike (the
    per-layer tests above name their folder; this one leaves no module out)."""
    long = {
        str(p.relative_to(REPO)): n
        for p in sorted(PKG.rglob("*.py"))
        if (n := len(p.read_text().splitlines())) > MODULE_MAX_LINES
    }
    assert long == {}
