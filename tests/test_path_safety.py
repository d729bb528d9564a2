"""Path safety (issue 15, items 2-4): a directory swapped for a symlink after
first use, hostile manifests, and what gc/verify/inspect may count or touch.

Every test plants real symlinks, FIFOs and files under ``tmp_path`` and checks
that a directory outside the root is byte-for-byte and mtime-for-mtime what
it was."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
from manager_support import keys, load, open_tier, store

from fstier.io import _blockio, fsops, iotypes
from fstier.io.blockfile import padded_len
from fstier.io.manifest import ensure_manifest
from fstier.keys import BlockKey
from fstier.tier.gc import collect_garbage


def _snapshot(d: Path) -> dict[str, tuple[bytes, int]]:
    """Every file under ``d``: its bytes and mtime."""
    out = {}
    for p in sorted(d.rglob("*")):
        if p.is_file() and not p.is_symlink():
            out[str(p.relative_to(d))] = (p.read_bytes(), p.stat().st_mtime_ns)
    return out


@pytest.fixture(params=["openat2", "walk"])
def resolution(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Both ways a path is resolved: openat2, and the per-component walk
    used where the kernel has no openat2."""
    import fstier.io.fsops as resolve

    if request.param == "walk":
        monkeypatch.setattr(resolve, "HAVE_OPENAT2", False)
    elif not resolve.HAVE_OPENAT2:
        pytest.skip("this kernel has no openat2")
    return str(request.param)


@pytest.fixture
def outside(tmp_path: Path) -> Path:
    d = tmp_path / "outside"
    d.mkdir()
    (d / "precious.txt").write_bytes(b"not yours")
    return d


def _swap_for_link(directory: Path, target: Path) -> None:
    """Replace ``directory`` (and its files) by a symlink to ``target``,
    copying the files there first so that every name fstier knows exists
    outside with the right content and mtime: following the link would
    find them."""
    for f in directory.iterdir():
        shutil.copy2(f, target / f.name)
    shutil.rmtree(directory)
    directory.symlink_to(target, target_is_directory=True)


# ------------------------------------------------------------- item 2: swap
def test_fanout_dir_swapped_after_first_use_store_load_never_go_outside(
    tmp_path: Path, outside: Path, resolution: str
) -> None:
    with open_tier(tmp_path / "root") as tier:
        ks = keys(0, 3)
        assert store(tier, "s", ks[:2]).success  # the fan-out dir is now "verified"
        fanout = tier.mapper.path_for(ks[0]).parent
        _swap_for_link(fanout, outside)
        before = _snapshot(outside)
        res = store(tier, "s2", [ks[2]])  # same fan-out directory as ks[0:2]
        assert not res.success
        res = load(tier, "l", ks[:2])
        assert res.keys_completed == 0  # the copies outside are never read
        assert tier.lookup(ks[:1]) == 0  # a failed load is a miss from now on
    assert _snapshot(outside) == before
    assert not (outside / tier.mapper.path_for(ks[2]).name).exists()


def test_recency_never_touches_a_file_through_a_swapped_dir(tmp_path: Path, outside: Path, resolution: str) -> None:
    with open_tier(tmp_path / "root") as tier:
        ks = keys(0, 2)
        assert store(tier, "s", ks).success
        assert load(tier, "l", ks).success  # hits pending a recency write
        _swap_for_link(tier.mapper.path_for(ks[0]).parent, outside)
        old = 1_000_000_000
        for f in outside.iterdir():
            os.utime(f, ns=(old, old))
        before = _snapshot(outside)
        tier.run_capacity_pass()  # flushes recency first
    assert _snapshot(outside) == before


def test_corrupt_file_behind_swapped_dir_is_not_removed(tmp_path: Path, outside: Path, resolution: str) -> None:
    """A load that meets the swapped directory removes nothing, whatever lies
    at the same name outside (old code unlinked through the link when the
    file outside failed its checks)."""
    with open_tier(tmp_path / "root") as tier:
        (k,) = keys(0, 1)
        assert store(tier, "s", [k]).success
        path = tier.mapper.path_for(k)
        _swap_for_link(path.parent, outside)
        (outside / path.name).write_bytes(b"garbage" * 100)
        before = _snapshot(outside)
        res = load(tier, "l", [k])
        assert res.keys_completed == 0
    assert _snapshot(outside) == before


def test_gc_eviction_never_unlinks_through_a_dir_swapped_after_the_scan(
    tmp_path: Path, outside: Path, monkeypatch: pytest.MonkeyPatch, resolution: str
) -> None:
    """The victim list is made by the scan; the directory is swapped before
    the unlink. The file outside has the same name and mtime."""
    from fstier.io import fsops

    with open_tier(tmp_path / "root") as tier:
        assert store(tier, "s", keys(0, 4)).success
        fanout = tier.mapper.path_for(keys(0, 1)[0]).parent
    real = fsops.FS.open
    swapped = []

    def swap_then_open(path, flags, mode=0o600):  # type: ignore[no-untyped-def]
        # The scan walks through directory fds; the first open of the fan-out
        # directory by path is the unlink's, after the scan chose its victims.
        if not swapped and os.fspath(path) == str(fanout):
            _swap_for_link(fanout, outside)
            swapped.append(True)
        return real(path, flags, mode)

    monkeypatch.setattr(fsops.FS, "open", swap_then_open)
    report = collect_garbage(tmp_path / "root", max_bytes=0, low_watermark=0.0, unlink_threads=1)
    before = _snapshot(outside)
    assert swapped and report.scanned_files == 4 and report.removed_files == 0
    assert len(before) == 5  # 4 block copies + precious.txt, all still there


def test_store_and_load_at_any_alignment_touch_only_the_payload(tmp_path: Path) -> None:
    """The exact-length API: a payload at an odd address and odd length is
    stored and loaded without a byte outside it being read or written, and
    the file is the same as the one an aligned, padded slot produces."""
    from fstier.io.blockfile import header_for_payload

    n = 3 * 4096 + 123
    key = BlockKey(b"\x01" * 16, 0)
    digest = b"\x5a" * 8
    backing = fsops.aligned_buffer(n + 2 * 4096)
    data = bytes((i * 7) & 0xFF for i in range(n))
    for direct in (False, True):
        for off in (0, 1, 4095):
            d = tmp_path / f"d{direct}-{off}"
            d.mkdir()
            backing[:] = b"\xcc" * len(backing)
            backing[off : off + n] = data
            header = header_for_payload(key, digest, data, 1, n)
            path = d / "x.bin"
            opts = iotypes.IOOptions(o_direct=direct)
            out = _blockio.store_block(iotypes.StoreRequest(path, header, backing[off : off + n]), opts)
            assert out.ok, out
            assert bytes(backing[:off]) == b"\xcc" * off
            assert bytes(backing[off + n :]) == b"\xcc" * (len(backing) - off - n)
            assert path.stat().st_size == 4096 + padded_len(n)
            assert path.read_bytes()[4096 + n :] == bytes(padded_len(n) - n)
            backing[:] = b"\xdd" * len(backing)
            res = _blockio.load_block(
                iotypes.LoadRequest(path, backing[off : off + n], key, digest, n), opts
            )
            assert res.ok, res
            assert bytes(backing[off : off + n]) == data
            assert bytes(backing[:off]) == b"\xdd" * off
            assert bytes(backing[off + n :]) == b"\xdd" * (len(backing) - off - n)


# ------------------------------------------------- item 3: hostile manifests
def _run_with_timeout(fn, seconds: float = 10.0):  # type: ignore[no-untyped-def]
    """Run ``fn`` in a daemon thread; (finished, result or exception)."""
    import threading

    box: list[object] = []

    def run() -> None:
        try:
            box.append(fn())
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            box.append(exc)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(seconds)
    return (not t.is_alive()), (box[0] if box else None)


def _namespace_of(root: Path) -> Path:
    from manager_support import tiny_config

    from fstier.file_mapper import FileMapper

    return FileMapper(tiny_config(root)).namespace_dir


def test_fifo_manifest_does_not_hang_fstier_or_the_cli(tmp_path: Path) -> None:
    from click.testing import CliRunner
    from manager_support import tiny_config

    from fstier.cli import main
    from fstier.errors import NamespaceMismatchError
    from fstier.manager import FsTier
    from fstier.slots.host_pool import HostBlockPool

    root = tmp_path / "root"
    ns = _namespace_of(root)
    ns.mkdir(parents=True)
    os.mkfifo(ns / "config.json")
    pool = HostBlockPool(4, 8192)
    try:
        done, result = _run_with_timeout(lambda: FsTier(tiny_config(root), pool))
        if not done:  # unblock the stuck open so the thread can end
            fd = os.open(ns / "config.json", os.O_WRONLY | os.O_NONBLOCK)
            os.close(fd)
        assert done, "FsTier construction hangs on a FIFO manifest"
        assert isinstance(result, NamespaceMismatchError), result
        assert "config.json" in str(result) and "Move the namespace directory aside" in str(result)
    finally:
        pool.close()
    for cmd in (["inspect", str(root), "--json"], ["verify", str(root), "--json"]):
        done, res = _run_with_timeout(lambda cmd=cmd: CliRunner().invoke(main, cmd))
        assert done, f"fstier {cmd[0]} hangs on a FIFO manifest"
        assert "not a regular file" in res.output, res.output  # type: ignore[union-attr]


@pytest.mark.parametrize(
    "content",
    [
        "[" * 30_000 + "]" * 30_000,  # under the size cap; RecursionError in json.loads
        '{"fstier_manifest": 1, "namespace": 5, "digest": [], "parallel_agnostic": "yes", "fields": 3}',
        '{"fstier_manifest": 1, "namespace": "x", "digest": "y", "parallel_agnostic": true,'
        ' "fields": {"model": 5, "revision": {"a": 1}, "tp_size": "2", "groups": 7}}',
        "\udcff not utf-8".encode("utf-8", "surrogateescape").decode("latin-1"),
        "x" * (65 * 1024),
    ],
    ids=["deep", "wrong-types", "wrong-field-types", "not-utf8", "oversized"],
)
def test_hostile_manifest_is_refused_by_name_everywhere(tmp_path: Path, content: str) -> None:
    from click.testing import CliRunner
    from manager_support import tiny_config

    from fstier.cli import main
    from fstier.errors import NamespaceMismatchError
    from fstier.file_mapper import FileMapper

    root = tmp_path / "root"
    ns = _namespace_of(root)
    ns.mkdir(parents=True)
    (ns / "config.json").write_bytes(content.encode("latin-1"))
    with pytest.raises(NamespaceMismatchError, match="config.json: unreadable manifest"):
        ensure_manifest(FileMapper(tiny_config(root)))
    for cmd in ("inspect", "verify"):
        res = CliRunner().invoke(main, [cmd, str(root), "--json"])
        assert res.exception is None or isinstance(res.exception, SystemExit), res.exception
        assert "unreadable manifest" in res.output, res.output
    res = CliRunner().invoke(main, ["inspect", str(root)])  # the table, too
    assert res.exit_code == 0, res.output


def test_symlinked_manifest_is_not_followed(tmp_path: Path, outside: Path) -> None:
    """A valid manifest outside, linked in: refused, and the file outside is
    never read (an unreadable target would not matter either)."""
    from manager_support import tiny_config

    from fstier.errors import NamespaceMismatchError
    from fstier.file_mapper import FileMapper

    good_root = tmp_path / "good"
    ensure_manifest(FileMapper(tiny_config(good_root)))
    ns = _namespace_of(tmp_path / "root")
    ns.mkdir(parents=True)
    (ns / "config.json").symlink_to(_namespace_of(good_root) / "config.json")
    with pytest.raises(NamespaceMismatchError, match="symlink"):
        ensure_manifest(FileMapper(tiny_config(tmp_path / "root")))


def test_async_manifest_read_does_not_hang_on_a_fifo(tmp_path: Path) -> None:
    import asyncio

    from manager_support import tiny_config

    from fstier.errors import NamespaceMismatchError
    from fstier.file_mapper import FileMapper
    from fstier.io import native
    from fstier.io.aio import AsyncBlockIO
    from fstier.io.blockstore import BlockStore
    from fstier.io.iotypes import IOOptions

    mapper = FileMapper(tiny_config(tmp_path / "root"))
    mapper.namespace_dir.mkdir(parents=True)
    os.mkfifo(mapper.namespace_dir / "config.json")
    blocks = BlockStore(mapper, IOOptions(), native.python_backend())

    async def main() -> object:
        async with AsyncBlockIO(blocks) as aio:
            try:
                return await asyncio.wait_for(aio.read_manifest(), 10)
            except NamespaceMismatchError as exc:
                return exc

    assert isinstance(asyncio.run(main()), NamespaceMismatchError)


# ---------------------------------------------- item 4: what gc may touch
def test_gc_touches_only_fstier_files_of_valid_namespaces_and_all_readers_agree(
    tmp_path: Path,
) -> None:
    import json

    from click.testing import CliRunner

    from fstier.cli import main

    root = tmp_path / "root"
    with open_tier(root) as tier:
        ks = keys(0, 4)
        assert store(tier, "s", ks).success
        good = [tier.mapper.path_for(k) for k in ks]
        ns = tier.mapper.namespace_dir
    name = good[0].name
    h = name.split("-")[0]
    decoys = [
        root / name,  # the root's top level
        root / "not-a-namespace" / h[:3] / h[3:5] / name,  # a directory without a manifest
        root / "fake-0123456789abcdef" / h[:3] / h[3:5] / name,  # manifest of the wrong digest
        ns / name,  # inside a valid namespace, but not where fstier puts blocks
        ns / "zzz" / "yy" / name,
        root / ".x.bin.tmp.host.1.2.ab",  # a temp name outside any namespace
        root / "not-a-namespace" / ".nfs0001",
    ]
    (root / "fake-0123456789abcdef").mkdir()
    (root / "fake-0123456789abcdef" / "config.json").write_text(
        '{"fstier_manifest": 1, "namespace": "fake-0123456789abcdef", "digest": "0123456789abcdef",'
        ' "parallel_agnostic": true, "fields": {}}'
    )
    for d in decoys:
        d.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(good[0], d)
        os.utime(d, (1, 1))  # the oldest files under root, and stale temps
    stale = ns / h[:3] / ".y.bin.tmp.host.1.2.cd"  # fstier's own, old: swept
    stale.write_bytes(b"t")
    os.utime(stale, (1, 1))

    inspect = json.loads(CliRunner().invoke(main, ["inspect", str(root), "--json"]).output)
    verify = json.loads(CliRunner().invoke(main, ["verify", str(root), "--json"]).output)
    dry = json.loads(
        CliRunner().invoke(main, ["gc", str(root), "--max-bytes", "0", "--dry-run", "--json"]).output
    )
    assert inspect["total_files"] == verify["checked"] == dry["files_before"] == len(good)
    assert verify["ok"], verify["bad"]  # the misplaced decoys are not "bad blocks": not ours

    res = CliRunner().invoke(main, ["gc", str(root), "--max-bytes", "0", "--temp-max-age", "1", "--json"])
    out = json.loads(res.output)
    assert out["evicted_files"] == len(good) and out["temp_removed"] == 1
    assert all(d.exists() for d in decoys)
    assert not any(p.exists() for p in good) and not stale.exists()


def test_capacity_is_described_identically_in_example_configuration_and_cli_docs() -> None:
    """Item 4: one sentence, the same words, in all three places."""
    import re

    repo = Path(__file__).resolve().parents[1]
    sentence = (
        "Capacity is root-wide: one max_bytes budget for every namespace under the root (one disk), "
        "least recently used first across all of them. Only block, temp and .nfs files inside namespace "
        "directories with a valid config.json are counted or removed; nothing else under the root is touched."
    )
    for rel in ("examples/fstier.yaml", "docs/configuration.md", "docs/cli.md"):
        text = (repo / rel).read_text()
        flat = re.sub(r"\s+", " ", re.sub(r"^\s*#", " ", text, flags=re.M))
        assert sentence in flat, rel


def test_atomic_write_never_writes_through_a_symlinked_directory(tmp_path: Path, outside: Path) -> None:
    """The manifest writer (a sibling of item 2): its directory swapped for a
    link after the namespace check must not receive the file."""
    from fstier.io.fsops import atomic_write

    ns = tmp_path / "root" / "ns"
    ns.parent.mkdir()
    ns.symlink_to(outside, target_is_directory=True)
    before = _snapshot(outside)
    with pytest.raises(OSError) as info:
        atomic_write(ns / "config.json", b"{}", fsync="file+dir")
    assert info.value.errno == 40  # ELOOP
    assert _snapshot(outside) == before and not (outside / "config.json").exists()


def test_fstier_jobs_touch_only_the_payload_bytes_of_a_slot(tmp_path: Path) -> None:
    """A slot may be an engine row followed by other data: a store must not
    zero the padding in the slot, a load must not write past the payload."""
    from manager_support import fill, payload_for

    with open_tier(tmp_path / "root") as tier:
        (k,) = keys(0, 1)
        n = tier.payload_bytes(k)
        view = tier.pool.slot_view(0)
        view[:] = b"\xab" * len(view)
        fill(tier, [k], [0])
        tier.submit_store("s", [k], [0])
        tier.drain()
        assert tier.get_finished()[0].success
        assert bytes(view[n:]) == b"\xab" * (len(view) - n)
        view[:] = b"\xcd" * len(view)
        tier.submit_load("l", [k], [0])
        tier.drain()
        assert tier.get_finished()[0].success
        assert bytes(view[:n]) == payload_for(k, n)
        assert bytes(view[n:]) == b"\xcd" * (len(view) - n)


def test_recency_never_touches_an_inode_another_path_outside_names(tmp_path: Path) -> None:
    """A load's recency update rewrote the mtime of a block file that a
    ``cp -al`` backup outside the root also names (one inode, two paths):
    fstier changed metadata outside its root. A block with a second link is
    now left alone (its recency is then its store time)."""
    backup = tmp_path / "backup"
    backup.mkdir()
    with open_tier(tmp_path / "root") as tier:
        ks = keys(0, 2)
        assert store(tier, "s", ks).success
        linked = backup / "copy.bin"
        os.link(tier.mapper.path_for(ks[0]), linked)
        old = 1_000_000_000
        os.utime(linked, ns=(old, old))
        assert load(tier, "l", ks).success  # hits pending a recency write
        tier.run_capacity_pass()  # flushes recency first
        other = tier.mapper.path_for(ks[1]).stat().st_mtime_ns
    assert linked.stat().st_mtime_ns == old
    assert other > old  # the block with one name is still touched
