"""A job whose keys did not all return alike, on the C engine: its summary is
a byte per key, the few distinct successes once each and a tuple only per
failed key (``ce_mixed`` in ``fstier/io/_native_engine.c``), and the
outcomes judged from it are the Python engine's, field for field. A load's
proven-corrupt file (or a planted link at its name) is removed by the C
worker that read it, by :func:`fstier.io.fsops.unlink_if_same`'s rule: only
while the name still holds the inode that was read, never through a
symlinked directory, a failed removal logged (both engines run the native
I/O path here, so both remove in C). A store whose namespace directory was
removed under the running tier makes it again in the C worker."""

from __future__ import annotations

import errno
import logging
import os
import shutil
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from manager_support import keys, payload_for
from test_engine_contract import Rig, outcomes

from fstier.io import native
from fstier.io.engine import summary
from fstier.io.engine.native import NativeEngine, available
from fstier.io.iotypes import LoadStatus, StoreStatus
from fstier.io.manifest import manifest_bytes

pytestmark = pytest.mark.skipif(
    not available() or os.environ.get("FSTIER_NATIVE") == "0",
    reason="the native extension is not built, or FSTIER_NATIVE=0 forces the Python I/O path",
)


@pytest.fixture(params=["python", "native"])
def rig(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Rig]:
    r = Rig(tmp_path / "root", request.param)
    try:
        yield r
    finally:
        native.clear_faults()
        r.close()


def _store(rig: Rig, ks: list[Any]) -> list[str]:
    slots = list(range(len(ks)))
    rig.fill(ks, slots)
    got = outcomes(rig.run(rig.job("s", "store", ks, slots)))
    assert [o.status for o in got] == [StoreStatus.STORED] * len(ks)
    return list(rig.blocks.paths(ks))


def _flip(path: str) -> None:
    with open(path, "r+b") as f:  # a flipped payload byte: corrupt, same size
        f.seek(4096 + 3)
        b = f.read(1)
        f.seek(4096 + 3)
        f.write(bytes([b[0] ^ 0xFF]))


def _mixed(rig: Rig, tmp_path: Path) -> tuple[list[Any], list[str]]:
    """Eight keys: loaded, corrupt, missing, loaded, a planted link, short, loaded, loaded."""
    ks = keys(500, 8)
    paths = _store(rig, ks)
    _flip(paths[1])
    os.unlink(paths[2])
    os.unlink(paths[4])
    (tmp_path / "target").write_bytes(b"not fstier's")
    os.symlink(tmp_path / "target", paths[4])
    os.truncate(paths[5], 4096 + 10)
    return ks, paths


def _fields(o: Any) -> tuple[Any, ...]:
    return (o.status, o.cause, o.detail, o.removed, o.nbytes)


def test_a_mixed_load_is_judged_alike_on_both_engines(tmp_path: Path) -> None:
    seen = {}
    for kind in ("python", "native"):
        r = Rig(tmp_path / kind / "root", kind)
        try:
            ks, paths = _mixed(r, tmp_path / kind)
            got = outcomes(r.run(r.job("l", "load", ks, list(range(20, 28)))))
            seen[kind] = [_fields(o) for o in got]
            assert [os.path.lexists(p) for p in paths] == [True, False, False, True, False, False, True, True]
            assert (tmp_path / kind / "target").read_bytes() == b"not fstier's", "a link's target was touched"
            for i in (0, 3, 6, 7):
                assert r.slot(ks[i], 20 + i) == payload_for(ks[i], r.tier.payload_bytes(ks[i]))
        finally:
            r.close()
    assert seen["native"] == seen["python"]
    statuses = [f[0] for f in seen["native"]]
    assert statuses == [
        LoadStatus.LOADED, LoadStatus.CORRUPT, LoadStatus.MISSING, LoadStatus.LOADED,
        LoadStatus.CORRUPT, LoadStatus.CORRUPT, LoadStatus.LOADED, LoadStatus.LOADED,
    ]
    names = [os.path.basename(p) for p in paths]
    assert [seen["native"][i][1:4] for i in (1, 4, 5)] == [
        ("payload_checksum", f"{names[1]}: payload checksum", True),
        ("symlink", f"{names[4]}: a symlink on its path", True),
        ("bad_size", "file is 4106 bytes", True),
    ]


def test_the_c_summary_of_a_mixed_job_holds_a_tuple_only_per_failed_key(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    r = Rig(tmp_path / "root", "native")
    summaries: list[Any] = []

    def spy(_self: NativeEngine, job: Any, per_key: Any, marks: Any) -> None:
        summaries.append(per_key)
        summary.judge_mixed(job, per_key, marks)

    monkeypatch.setattr(NativeEngine, "_judge_summary", spy)
    try:
        ks, _ = _mixed(r, tmp_path)
        r.run(r.job("l", "load", ks, list(range(20, 28))))
    finally:
        r.close()
    (codes, classes, failures), = summaries
    assert isinstance(codes, bytes) and len(codes) == 8
    assert len(classes) == 1 and classes[0][0] == 0, "the four LOADED keys share one class"
    assert [i for i, _ in failures] == [1, 2, 4, 5], "one tuple per failed key, in key order"
    assert [codes[i] for i in (0, 3, 6, 7)] == [0] * 4 and [codes[i] for i in (1, 2, 4, 5)] == [255] * 4


def test_a_good_file_renamed_over_a_corrupt_one_is_not_removed(rig: Rig) -> None:
    """The removal checks the inode it read: a writer's good file published
    at the name while the corrupt one was judged stays (the removal's
    directory open is held back by the C fault seam's delay meanwhile)."""
    ks = keys(600, 1)
    (path,) = _store(rig, ks)
    good = Path(path).read_bytes()
    _flip(path)
    native.fault("opendir", delay_s=0.6)  # a load opens no directory but for the removal

    def publish() -> None:  # once the removal is held (the load has judged the file)
        end = time.monotonic() + 10
        while native.fault_count("opendir") < 1 and time.monotonic() < end:
            time.sleep(0.005)
        tmp = path + ".swap"
        Path(tmp).write_bytes(good)
        os.replace(tmp, path)

    t = threading.Thread(target=publish)
    t.start()
    (out,) = outcomes(rig.run(rig.job("l", "load", ks, [9])))
    t.join()
    assert (out.status, out.cause, out.removed) == (LoadStatus.CORRUPT, "payload_checksum", False)
    assert Path(path).read_bytes() == good
    native.clear_faults()
    (again,) = outcomes(rig.run(rig.job("l2", "load", ks, [9])))
    assert again.status is LoadStatus.LOADED


def test_a_failed_removal_is_logged_and_the_file_stays(rig: Rig, caplog: pytest.LogCaptureFixture) -> None:
    ks = keys(700, 2)
    paths = _store(rig, ks)
    _flip(paths[0])
    native.fault("unlink", errno.EACCES, times=-1)
    with caplog.at_level(logging.WARNING, logger="fstier.io"):
        got = outcomes(rig.run(rig.job("l", "load", ks, [10, 11])))
    assert [(o.status, o.removed) for o in got] == [(LoadStatus.CORRUPT, False), (LoadStatus.LOADED, False)]
    assert os.path.exists(paths[0])
    msgs = [r.getMessage() for r in caplog.records if "could not remove corrupt block" in r.getMessage()]
    assert msgs == [f"could not remove corrupt block {paths[0]}: {os.strerror(errno.EACCES)}"]


def test_nothing_is_removed_through_a_symlinked_fan_out_directory(rig: Rig, tmp_path: Path) -> None:
    ks = keys(800, 1)
    (path,) = _store(rig, ks)
    fan = os.path.dirname(path)
    outside = tmp_path / "outside"
    os.rename(fan, outside)  # the fan-out directory, with the block, now outside the root
    os.symlink(outside, fan)
    victim = outside / os.path.basename(path)
    _flip(str(victim))
    (out,) = outcomes(rig.run(rig.job("l", "load", ks, [3])))
    assert (out.status, out.cause, out.removed) == (LoadStatus.CORRUPT, "symlink", False)
    assert victim.exists() and os.path.islink(fan)


def test_nothing_is_removed_through_a_blocks_directory_swapped_after_the_read(rig: Rig, tmp_path: Path) -> None:
    """The blocks directory (here the namespace's) renamed out of the root and
    a symlink to it put at its name between the read of a corrupt file and its
    removal (held by the fault seam): the file, now outside the root, stays.
    Before, the worker removed it through the base fd the read used, which
    still reached the moved directory."""
    ks = keys(820, 1)
    (path,) = _store(rig, ks)
    _flip(path)
    blocks = rig.blocks.mapper.blocks_dir
    outside = tmp_path / "outside"
    victim = Path(path.replace(str(blocks), str(outside), 1))
    native.fault("opendir", delay_s=0.6)  # a load opens no directory but for the removal

    def swap() -> None:  # once the removal is held (the load has judged the file)
        end = time.monotonic() + 10
        while native.fault_count("opendir") < 1 and time.monotonic() < end:
            time.sleep(0.005)
        os.rename(blocks, outside)
        os.symlink(outside, blocks)

    t = threading.Thread(target=swap)
    t.start()
    (out,) = outcomes(rig.run(rig.job("l", "load", ks, [9])))
    t.join()
    assert (out.status, out.cause, out.removed) == (LoadStatus.CORRUPT, "payload_checksum", False)
    assert victim.exists() and os.path.islink(blocks)


def test_a_namespace_removed_under_a_running_tier_is_made_again_alike_on_both_engines(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """rm -rf of the namespace (manifest included) between stores: the next
    store job makes the directories and the manifest again and stores every
    key; the C engine does it in its worker (no key is handed to Python's
    ``BlockStore.store_many``), logging the re-creation once per job (a
    one-key job too: its uniform summary is never cached as a success)."""
    seen: dict[str, Any] = {}
    for kind in ("python", "native"):
        r = Rig(tmp_path / kind / "root", kind)
        if kind == "native":
            def refuse(*_a: Any, **_k: Any) -> Any:
                raise AssertionError("the C engine handed a store to Python")

            monkeypatch.setattr(type(r.blocks), "store_many", refuse)
        try:
            mapper = r.blocks.mapper
            ks = keys(900, 5)
            rounds = []
            for first, job in ((0, ks[:1]), (1, ks[1:5]), (0, ks[:1])):
                shutil.rmtree(mapper.namespace_dir)
                slots = list(range(len(job)))
                r.fill(job, slots)
                caplog.clear()
                with caplog.at_level(logging.WARNING, logger="fstier"):
                    got = outcomes(r.run(r.job(("s", first), "store", job, slots)))
                logs = [x.getMessage() for x in caplog.records if "re-created it" in x.getMessage()]
                rounds.append(([(o.status, o.nbytes) for o in got], len(logs)))
                assert (mapper.namespace_dir / "config.json").read_bytes() == manifest_bytes(mapper)
                assert oct(os.stat(mapper.namespace_dir).st_mode & 0o777) == oct(0o755 & ~_umask())
            ld = outcomes(r.run(r.job("l", "load", ks[:1], [40])))
            assert ld[0].status is LoadStatus.LOADED
            assert r.slot(ks[0], 40) == payload_for(ks[0], r.tier.payload_bytes(ks[0]))
            seen[kind] = rounds
        finally:
            monkeypatch.undo()
            r.close()
    assert seen["native"] == seen["python"]
    assert [len(got) for got, _ in seen["native"]] == [1, 4, 1] and [n for _, n in seen["native"]] == [1, 1, 1]
    assert all(o[0] is StoreStatus.STORED for got, _ in seen["native"] for o in got)


def _umask() -> int:
    old = os.umask(0)
    os.umask(old)
    return old


def test_no_key_is_stored_into_a_namespace_made_again_without_its_manifest(tmp_path: Path) -> None:
    """The C engine makes a removed namespace directory again: when its
    manifest cannot be written (the fault seam fails its rename) the key fails
    with that errno and the directory made is removed again, so the next store
    makes both (a scan treats a directory without a manifest as foreign: its
    blocks are never counted or evicted). Before, the key was reported stored
    into a manifest-less directory and every later store kept it so."""
    r = Rig(tmp_path / "root", "native")
    try:
        mapper = r.blocks.mapper
        manifest = mapper.namespace_dir / "config.json"
        ks = keys(950, 2)
        r.fill(ks, [0, 1])
        shutil.rmtree(mapper.namespace_dir)
        native.fault("rename", errno.EIO, times=1)
        (failed,) = outcomes(r.run(r.job("s0", "store", ks[:1], [0])))
        native.clear_faults()
        assert (failed.status, failed.cause) == (StoreStatus.FAILED, "EIO")
        assert not mapper.namespace_dir.exists(), "the directory made for the failed manifest is removed"
        (stored,) = outcomes(r.run(r.job("s1", "store", ks[1:2], [1])))
        assert stored.status is StoreStatus.STORED and manifest.read_bytes() == manifest_bytes(mapper)
        (loaded,) = outcomes(r.run(r.job("l", "load", ks[1:2], [5])))
        assert loaded.status is LoadStatus.LOADED and r.slot(ks[1], 5) == payload_for(ks[1], len(r.slot(ks[1], 5)))
    finally:
        native.clear_faults()
        r.close()


def test_a_callers_lists_changed_after_submit_do_not_reach_the_running_job(tmp_path: Path) -> None:
    """engine_submit and engine_touch kept pointers into the bytes the caller's
    lists held (hashes, names) while the job ran after the call returned: a
    caller that changed its list freed them, and the worker read whatever
    reused the memory (a load judged its good files by other keys' hashes,
    found them "corrupt" and removed them; a touch set other files' mtimes).
    The job now holds tuples of them. The worker is held in the fault seam
    while the lists change and the freed memory is reused."""
    r = Rig(tmp_path / "root", "native")
    ext = r.engine._ext
    try:
        ks = keys(980, 4)
        paths = _store(r, ks)

        class Proxy:
            def __getattr__(self, name: str) -> Any:
                return getattr(ext, name)

            def engine_submit(self, *args: Any) -> Any:
                a = list(args)
                own = a[5] = [bytes(bytearray(h)) for h in a[5]]  # hashes owned by this list alone
                got = ext.engine_submit(*a)
                own[:] = [b"\0" * 16] * len(own)  # changed: its bytes freed
                junk.extend(os.urandom(len(own[0])) for _ in range(400))  # the freed blocks reused
                return got

        junk: list[bytes] = []
        r.engine._ext = Proxy()
        native.fault("open", delay_s=0.3, times=1)  # the load's first open held until the list changed
        got = outcomes(r.run(r.job("l", "load", ks, [10, 11, 12, 13])))
        native.clear_faults()
        assert [(o.status, o.removed) for o in got] == [(LoadStatus.LOADED, False)] * 4
        assert all(os.path.exists(p) for p in paths)

        base = r.blocks.mapper.blocks_dir
        names = [f"t{i:03d}" for i in range(8)]
        for n in names + [f"d{i:03d}" for i in range(8)]:
            (base / n).write_bytes(b"x")
            os.utime(base / n, (1_000_000, 1_000_000))
        cap = ext.engine_new(1, 1)  # an engine of its own: no registration sees this job's events
        rels = [n.encode() for n in names]  # each bytes owned by this list alone
        native.fault("touch", delay_s=0.3, times=1)
        ext.engine_touch(cap, 1, os.fsencode(base), rels, -1.0)
        rels[:] = [b"zz"] * len(rels)
        junk.extend(f"d{i:03d}".encode() for i in list(range(8)) * 50)  # the freed blocks hold other names
        end = time.monotonic() + 10
        while time.monotonic() < end and native.fault_count("touch") < len(names):
            time.sleep(0.01)
        ext.engine_shutdown(cap, 5.0)
        bumped = sorted(n for n in names + [f"d{i:03d}" for i in range(8)] if (base / n).stat().st_mtime > 1_000_000)
        assert bumped == names
    finally:
        native.clear_faults()
        r.engine._ext = ext
        r.close()
