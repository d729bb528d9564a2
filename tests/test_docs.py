"""The repository stands alone and its docs match the package: no citation
of documents that are not in the repository, and docs/architecture.md's
module table names every module there is."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
#: Design notes kept outside the repository; the repository must not send a
#: reader to them (what they said that matters is in docs/architecture.md).
OUTSIDE = re.compile(r"DESIGN(\.md| §)|STYLE\.md|RELIABILITY\.md")


def _sources() -> list[Path]:
    files = [REPO / "README.md", REPO / "Makefile", REPO / "pyproject.toml"]
    for folder, pattern in (
        ("fstier", "*.py"),
        ("docs", "*.md"),
        ("benchmarks", "*.py"),
        ("examples", "*"),
        ("tests", "*.py"),
    ):
        files += [p for p in (REPO / folder).rglob(pattern) if p.is_file() and "__pycache__" not in p.parts]
    return [p for p in files if p.exists() and p.resolve() != Path(__file__).resolve()]


def test_no_citation_of_documents_outside_the_repository() -> None:
    cited = [
        f"{p.relative_to(REPO)}:{n}"
        for p in _sources()
        for n, line in enumerate(p.read_text(errors="replace").splitlines(), 1)
        if OUTSIDE.search(line)
    ]
    assert cited == [], cited


def test_architecture_module_table_names_every_module() -> None:
    text = (REPO / "docs" / "architecture.md").read_text()
    table = text[text.index("## Modules") : text.index("## Internal interfaces")]
    missing = []
    for path in sorted((REPO / "fstier").rglob("*.py")):
        rel = path.relative_to(REPO).as_posix()
        if rel.endswith("/__init__.py") and rel not in ("fstier/__init__.py", "fstier/cli/__init__.py"):
            continue  # a package is named by its folder
        if rel.startswith("fstier/integrations/"):
            if "`fstier/integrations/`" not in table:
                missing.append(rel)
            continue
        if f"`{rel}`" not in table and f"`{path.name}`" not in table:
            missing.append(rel)
    assert missing == [], f"docs/architecture.md's module table does not name {missing}"


def test_local_doc_links_resolve() -> None:
    # docs/vllm.md ships with fstier/integrations/vllm.py; until a tree has
    # that module, links to it from the integration guide are expected.
    pending = set() if (REPO / "fstier" / "integrations" / "vllm.py").exists() else {"vllm.md"}
    broken = []
    for doc in [REPO / "README.md", *(REPO / "docs").glob("*.md")]:
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", doc.read_text()):
            if "://" in target or target in pending:
                continue
            if not (doc.parent / target).exists():
                broken.append(f"{doc.relative_to(REPO)} -> {target}")
    assert broken == [], broken


def _make_n(target: str, tmp_path: Path) -> str:
    import subprocess

    out = subprocess.run(
        ["make", "-n", target, f"VENV={tmp_path / 'venv'}"], capture_output=True, text=True, cwd=REPO, timeout=60
    )
    assert out.returncode == 0, out.stderr
    return out.stdout


def test_make_demo_installs_lean_and_the_readme_says_so(tmp_path: Path) -> None:
    import shutil

    import pytest

    if shutil.which("make") is None:
        pytest.skip("make is not installed")
    demo = _make_n("demo", tmp_path)
    assert "torch==2.13.0" in demo and "install --quiet -e ." in demo
    assert "[dev" not in demo and "examples" not in demo, demo
    assert demo.index("torch==2.13.0") < demo.index("-e .")
    test = _make_n("test", tmp_path)
    assert re.search(r"-e '\.\[[^\]]*\bdev\b", test), test
    readme = (REPO / "README.md").read_text()
    assert "installs torch==2.13.0 then fstier (no extras)" in readme
    assert "plus the extras dev, metrics and examples" in readme


def test_make_test_builds_the_docs_strict_first(tmp_path: Path) -> None:
    """The API reference is generated from the docstrings (mkdocs.yml,
    docs/api.md); `make test` builds the site with --strict before pytest,
    so a broken link or a reference to a name that is gone fails CI."""
    import shutil

    import pytest

    if shutil.which("make") is None:
        pytest.skip("make is not installed")
    test = _make_n("test", tmp_path)
    assert "mkdocs build --strict" in test and test.index("mkdocs build --strict") < test.index("-m pytest"), test
    config = (REPO / "mkdocs.yml").read_text()
    assert "strict: true" in config and "api.md" in config and "mkdocstrings" in config
