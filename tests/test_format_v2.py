"""Format v2: one fan-out level of 4096 directories, and v1 namespaces as
foreign (named by inspect, ignored by gc and capacity, removed only by
``fstier gc --remove-foreign``)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from click.testing import CliRunner
from conftest import make_config

from fstier.cli import main
from fstier.file_mapper import FANOUT_HEX, NAMESPACE_VERSION, canonical_json
from fstier.io.blockfile import FORMAT_VERSION
from fstier.keys import BlockKey
from fstier.manager import FsTier
from fstier.slots.host_pool import HostBlockPool


def _v1_namespace(root: Path) -> tuple[Path, Path]:
    """A namespace exactly as fstier v1 wrote it: manifest version 1 and a
    block at ``<hex[:3]>/<hex[3:5]>/``."""
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
    return ns, block


def _store(root: Path, n: int) -> FsTier:
    t = FsTier.from_config(make_config(root))
    pool: HostBlockPool = t.pool  # type: ignore[assignment]
    keys = [BlockKey(hashlib.sha256(b"%d" % i).digest()[:16], 0) for i in range(n)]
    for start in range(0, n, 16):
        ks = keys[start:start + 16]
        slots = pool.alloc(len(ks))
        t.submit_store(start, ks, slots)
        assert t.drain(30)
        (r,) = t.get_finished()
        assert r.success, r
        pool.free(slots)
    return t


def test_versions() -> None:
    assert (FORMAT_VERSION, NAMESPACE_VERSION, FANOUT_HEX) == (2, 2, 3)


def test_blocks_live_one_level_below_the_namespace(tmp_path: Path) -> None:
    t = _store(tmp_path / "root", 64)
    try:
        files = [p for p in t.mapper.blocks_dir.rglob("*.bin")]
        assert len(files) == 64
        for f in files:
            rel = f.relative_to(t.mapper.blocks_dir)
            assert len(rel.parts) == 2 and rel.parts[0] == f.name[:3]
        dirs = [p for p in t.mapper.blocks_dir.iterdir() if p.is_dir()]
        assert 0 < len(dirs) <= 16 ** FANOUT_HEX
    finally:
        t.close()


def test_v1_namespace_is_foreign_until_removed_on_request(tmp_path: Path) -> None:
    root = tmp_path / "root"
    t = _store(root, 8)
    t.close()
    old, old_block = _v1_namespace(root)
    # A forged v1-looking directory (digest mismatch) is not fstier's: never removed.
    forged = root / "forged-0123456789abcdef"
    forged.mkdir()
    (forged / "config.json").write_text(json.dumps({
        "fstier_manifest": 1, "namespace": forged.name, "digest": "0123456789abcdef",
        "parallel_agnostic": True, "fields": {"model": "x"},
    }))
    runner = CliRunner()
    inspect = runner.invoke(main, ["inspect", str(root), "--json"])
    assert inspect.exit_code == 0, inspect.output
    by_name = {ns["namespace"]: ns for ns in json.loads(inspect.output)["namespaces"]}
    assert "foreign: a format v1 namespace" in by_name[old.name]["manifest_error"]
    assert by_name[old.name]["files"] == 0  # never counted as this version's blocks
    # gc without the flag leaves it alone, even at --max-bytes 0
    gc = runner.invoke(main, ["gc", str(root), "--max-bytes", "0", "--json"])
    assert gc.exit_code == 0, gc.output
    assert old_block.exists() and json.loads(gc.output)["foreign_namespaces"] == []
    # --dry-run names it and removes nothing
    dry = runner.invoke(main, ["gc", str(root), "--max-bytes", "1TiB", "--remove-foreign", "--dry-run", "--json"])
    found = json.loads(dry.output)["foreign_namespaces"]
    assert [(Path(f["path"]).name, f["format_version"], f["removed"]) for f in found] == [(old.name, 1, False)]
    assert found[0]["files"] == 2 and old_block.exists()  # manifest + block
    # the real run removes exactly it
    t = _store(root, 8)  # the v2 namespace is in use meanwhile
    try:
        res = runner.invoke(main, ["gc", str(root), "--max-bytes", "1TiB", "--remove-foreign"])
        assert res.exit_code == 0, res.output
        assert "removed foreign namespace" in res.output and "format v1" in res.output
        assert not old.exists() and forged.exists()
        assert len(list(t.mapper.blocks_dir.rglob("*.bin"))) == 8
    finally:
        t.close()
