"""``verify_root`` and ``inspect_root``, the library calls behind ``fstier
verify`` and ``fstier inspect``, called directly on real block files that
FsTier wrote: good ones, corrupt ones, one valid file under another key's
name, and things that are not this fstier's (a format v1 namespace, a
directory without a manifest, a stray file, a symlink). ``fix`` removes the
bad files and nothing else."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import pytest
from conftest import make_config

import fstier
from fstier import BlockKey, FsTier, VerifyReport, verify_root
from fstier.file_mapper import FileMapper, canonical_json
from fstier.io.blockfile import HEADER_SIZE
from fstier.io.blockstore import NamespaceDirs
from fstier.slots.host_pool import HostBlockPool
from fstier.tier.scan import ScanReport, inspect_root

GROUP = [{"kind": "full_attention", "block_size": 16, "num_layers": 1, "num_kv_heads": 2, "head_size": 64}]


def _store(root: Path, n: int, salt: str = "") -> tuple[FileMapper, list[Path]]:
    """``n`` real block files written by FsTier, each slot filled with its own bytes."""
    cfg = make_config(root, groups=GROUP, tier={"namespace_salt": salt} if salt else {})
    keys = [BlockKey(hashlib.sha256(f"{salt}{i}".encode()).digest()[:16], 0) for i in range(n)]
    tier = FsTier.from_config(cfg)
    try:
        pool: HostBlockPool = tier.pool  # type: ignore[assignment]
        slots = pool.alloc(n)
        for i, s in enumerate(slots):
            view = pool.slot_view(s)
            view[:] = bytes([i + 1]) * len(view)
        tier.submit_store("store", keys, slots)
        assert tier.drain(30)
        (result,) = tier.get_finished()
        assert result.success, result
        pool.free(slots)
        mapper = tier.mapper
    finally:
        tier.close()
    paths = [mapper.path_for(k) for k in keys]
    assert all(p.is_file() for p in paths)
    return mapper, paths


def _v1_namespace(root: Path) -> Path:
    """A namespace as fstier's format v1 wrote it (manifest version 1, a
    block two fan-out levels down): foreign to this version."""
    fields = {"model": "old", "namespace_version": 1}
    digest = hashlib.sha256(canonical_json(fields)).hexdigest()[:16]
    ns = root / f"old-{digest}"
    ns.mkdir(parents=True)
    (ns / "config.json").write_text(json.dumps({
        "fstier_manifest": 1, "namespace": ns.name, "digest": digest,
        "parallel_agnostic": True, "fields": fields,
    }))
    h = "ab" * 16
    block = ns / h[:3] / h[3:5] / f"{h}-g0.bin"
    block.parent.mkdir(parents=True)
    block.write_bytes(b"\x00" * 8192)
    return block


def _flip(path: Path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0x01]))


@dataclass
class Tree:
    root: Path
    mapper: FileMapper
    good: list[Path]
    flipped: Path
    header: Path
    wrong_key: Path
    #: not this fstier's blocks: never judged, never removed
    kept: list[Path]


def _root_with_everything(tmp_path: Path) -> Tree:
    """Six good files, then: a payload bit flipped, a header byte damaged, a
    valid file copied under another key's name; and things verify must not
    judge: a v1 namespace, a namespace-named directory without a manifest, a
    stray file in the valid namespace, a symlink named like a block."""
    root = tmp_path / "root"
    mapper, paths = _store(root, 6)
    _flip(paths[1], HEADER_SIZE + 100)  # payload: only a full check sees it
    _flip(paths[2], 3)  # header magic
    wrong_key = mapper.path_for(BlockKey(b"\xab" * 16, 0))
    NamespaceDirs(mapper).ensure(wrong_key)
    shutil.copyfile(paths[3], wrong_key)
    v1_block = _v1_namespace(root)
    no_manifest = root / "nomanifest-0123456789abcdef"
    (no_manifest / "abc").mkdir(parents=True)
    bogus = no_manifest / "abc" / f"{'ab' * 16}-g0.bin"
    bogus.write_bytes(b"junk")
    junk = root / "junk" / "abc" / f"{'ab' * 16}-g0.bin"  # not even named like a namespace
    junk.parent.mkdir(parents=True)
    junk.write_bytes(b"junk")
    stray = mapper.namespace_dir / "notes.txt"
    stray.write_text("not a block")
    outside = tmp_path / "outside.bin"
    outside.write_bytes(b"junk")
    link = mapper.path_for(BlockKey(b"\xcd" * 16, 0))
    NamespaceDirs(mapper).ensure(link)
    link.symlink_to(outside)
    return Tree(
        root, mapper, [paths[0], paths[3], paths[4], paths[5]], paths[1], paths[2], wrong_key,
        [v1_block, bogus, junk, stray, outside, link],
    )


def _reasons(report: VerifyReport) -> dict[str, str]:
    return {Path(b.path).name: b.reason for b in report.bad}


def test_verify_root_reports_bad_files_and_judges_nothing_else(tmp_path: Path) -> None:
    t = _root_with_everything(tmp_path)
    flipped, header, wrong_key = t.flipped, t.header, t.wrong_key

    report = verify_root(t.root)
    assert isinstance(report, VerifyReport) and report.full and not report.fix
    assert _reasons(report) == {
        flipped.name: "payload_checksum", header.name: "bad_magic", wrong_key.name: "wrong_key",
    }
    assert report.checked == 7 and report.removed == 0 and report.bad_remaining == 3
    assert not report.ok and not report.partial
    by_ns = {ns.namespace: ns for ns in report.namespaces}
    ours = by_ns[t.mapper.namespace]
    assert (ours.checked, ours.good, ours.bad, ours.removed, ours.manifest_error) == (7, 4, 3, 0, None)
    # Not fstier's (this version's): listed with why, nothing in them checked.
    foreign = [ns for name, ns in by_ns.items() if name.startswith("old-")]
    assert len(foreign) == 1 and foreign[0].checked == 0
    assert "foreign: a format v1 namespace" in (foreign[0].manifest_error or "")
    assert by_ns["nomanifest-0123456789abcdef"].checked == 0
    assert "missing" in (by_ns["nomanifest-0123456789abcdef"].manifest_error or "")
    assert set(by_ns) == {t.mapper.namespace, foreign[0].namespace, "nomanifest-0123456789abcdef"}  # junk/: not one
    doc = json.loads(json.dumps(report.to_json()))
    assert doc["checked"] == 7 and len(doc["bad"]) == 3 and doc["partial"] is False
    # Without fix nothing is removed.
    assert all(p.exists() for p in (flipped, header, wrong_key))

    headers = verify_root(t.root, headers_only=True)
    assert not headers.full
    assert flipped.name not in _reasons(headers)  # the payload is not read
    assert set(_reasons(headers)) == {header.name, wrong_key.name}


def test_verify_root_fix_removes_only_the_bad_files(tmp_path: Path) -> None:
    t = _root_with_everything(tmp_path)
    report = verify_root(t.root, fix=True)
    assert report.fix and report.removed == 3 and report.bad_remaining == 0 and report.ok
    assert all(b.removed for b in report.bad)
    for path in (t.flipped, t.header, t.wrong_key):
        assert not os.path.lexists(path), path
    for path in [*t.good, *t.kept]:
        assert os.path.lexists(path), path
    assert t.kept[4].read_bytes() == b"junk"  # the symlink's target, outside the root
    again = verify_root(t.root)
    assert again.ok and again.checked == 4 and again.bad == []


def test_fix_keeps_a_file_replaced_after_it_was_judged(tmp_path: Path) -> None:
    """``fix`` unlinks only the very file it checked: a good file put in its
    place between the check and the removal (``on_file`` runs right after
    each check) stays."""
    root = tmp_path / "root"
    _mapper, (path,) = _store(root, 1)
    good_copy = tmp_path / "good.bin"
    shutil.copyfile(path, good_copy)
    _flip(path, HEADER_SIZE + 7)
    calls = []

    def writer_replaces_it() -> None:  # the one block was just judged bad
        calls.append(path.stat().st_ino)
        os.replace(good_copy, path)  # good bytes, a new inode, as a writer's rename

    report = verify_root(root, fix=True, on_file=writer_replaces_it)
    assert len(calls) == 1 and calls[0] != path.stat().st_ino
    assert [(Path(b.path).name, b.reason, b.removed) for b in report.bad] == [(path.name, "payload_checksum", False)]
    assert report.removed == 0 and path.exists() and verify_root(root).ok


def test_verify_root_one_namespace_and_bad_arguments(tmp_path: Path) -> None:
    root = tmp_path / "root"
    mapper_a, _ = _store(root, 3)
    mapper_b, paths_b = _store(root, 2, salt="tenant-b")
    _flip(paths_b[0], HEADER_SIZE + 1)
    only_a = verify_root(root, namespace=mapper_a.namespace, fix=True)
    assert [ns.namespace for ns in only_a.namespaces] == [mapper_a.namespace]
    assert only_a.ok and only_a.checked == 3 and paths_b[0].exists()
    assert not verify_root(str(root), namespace=mapper_b.namespace).ok  # str roots too

    for bad in ("..", "", ".", f"../{root.name}/{mapper_a.namespace}", "nope"):
        with pytest.raises(ValueError, match=r"namespace '"):
            verify_root(root, namespace=bad, fix=True)
    (root / "link").symlink_to(mapper_a.namespace_dir)
    with pytest.raises(ValueError, match="no such namespace directory"):
        verify_root(root, namespace="link")
    # A namespace directory is not a root: refused, not "0 files, ok".
    with pytest.raises(ValueError, match="is a namespace directory"):
        verify_root(mapper_a.namespace_dir)
    with pytest.raises(FileNotFoundError):
        verify_root(tmp_path / "missing")


def test_inspect_root_counts_what_verify_checks(tmp_path: Path) -> None:
    t = _root_with_everything(tmp_path)
    report = inspect_root(t.root)
    assert isinstance(report, ScanReport) and not report.partial
    mapper = t.mapper
    ours = {ns.namespace: ns for ns in report.namespaces}[mapper.namespace]
    assert ours.files == report.total_files == verify_root(t.root).checked == 7
    assert ours.other_files == 2  # the stray file and the symlink
    assert report.total_bytes == ours.bytes > 0
    doc = json.loads(json.dumps(report.to_json()))
    assert doc["total_files"] == 7 and doc["partial"] is False and len(doc["namespaces"]) == 3
    assert report.stray_entries == 1  # junk/
    with pytest.raises(ValueError, match="is a namespace directory"):
        inspect_root(mapper.namespace_dir)


def test_verify_root_is_public() -> None:
    assert fstier.verify_root is verify_root and fstier.VerifyReport is VerifyReport
    from fstier.tier.verify import verify_root as home

    assert home is verify_root


def test_the_docs_example_runs(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """docs/cli.md's ``verify_root`` example, run on a real root: one bad file
    is printed and the example exits 1, as ``fstier verify`` would."""
    import re

    text = (Path(__file__).resolve().parents[1] / "docs" / "cli.md").read_text()
    marker = "<!-- verify_root example: run by tests/test_verify_root.py -->"
    (code,) = re.findall(r"```python\n(.*?)```", text[text.index(marker):], re.S)[:1]
    root = tmp_path / "root"
    _mapper, paths = _store(root, 3)
    code = code.replace('"/kvcache"', repr(str(root)))
    exec(compile(code, "docs/cli.md", "exec"), {})  # all good: no exit
    assert "3 checked, 0 bad, 0 removed" in capsys.readouterr().out
    _flip(paths[2], 3)
    with pytest.raises(SystemExit) as exit_info:
        exec(compile(code, "docs/cli.md", "exec"), {})
    assert exit_info.value.code == 1
    out = capsys.readouterr().out
    assert f"{paths[2]} bad_magic kept" in out and "3 checked, 1 bad, 0 removed" in out


def test_the_command_prints_the_library_refusals_as_exit_2(tmp_path: Path) -> None:
    """``fstier verify`` turns verify_root's argument errors into usage
    failures: a namespace directory given as ROOT (even with --namespace) and
    a --namespace that is not one directory name under ROOT."""
    from click.testing import CliRunner

    from fstier.cli import main

    root = tmp_path / "root"
    mapper, _ = _store(root, 1)
    runner = CliRunner()
    res = runner.invoke(main, ["verify", str(mapper.namespace_dir), "--namespace", mapper.namespace_dir.name[:3]])
    assert res.exit_code == 2 and "one level too deep" in res.output, res.output
    res = runner.invoke(main, ["verify", str(root), "--namespace", "..", "--fix", "--json"])
    assert res.exit_code == 2
    assert (
        json.loads(res.stdout)["error"]
        == "--namespace '..': must be one directory name under ROOT (see fstier inspect)"
    )


def test_the_library_side_prints_nothing_and_loads_no_cli() -> None:
    """verify_root and inspect_root are library calls: their modules import
    neither click nor rich (the CLI prints their reports), and calling one
    loads no CLI, engine, torch or numpy module."""
    import ast
    import subprocess
    import sys

    pkg = Path(__file__).resolve().parents[1] / "fstier"
    for path in (pkg / "tier" / "scan.py", pkg / "tier" / "verify.py"):
        names = []
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names += [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                names.append(node.module or "")
        assert [n for n in names if n.split(".")[0] in ("click", "rich") or n.startswith("fstier.cli")] == [], path
    code = (
        "import sys, tempfile, fstier\n"
        "with tempfile.TemporaryDirectory() as d:\n"
        "    assert fstier.verify_root(d).ok\n"
        "    from fstier.tier.scan import inspect_root\n"
        "    assert inspect_root(d).total_files == 0\n"
        "print(sorted({m for m in sys.modules if m.split('.')[0] in ('click', 'rich', 'torch', 'numpy', 'vllm')"
        " or m.startswith('fstier.cli')}))\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]", proc.stdout
