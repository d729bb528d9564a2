"""LMCache's real ``StorageManager`` stores chunks through FstierL2Adapter
and LMCache's own ``fs`` adapter at once; NEW processes then load them back,
one per adapter: fstier's bytes are identical, and a corrupt, truncated,
foreign-layout or missing file is a miss, never a wrong byte, while the
``fs`` adapter (the control, same chunks, same damage) serves the flipped
byte. Three processes in all (tests/lmcache/sm_worker.py).

Without LMCache these tests skip, unless ``FSTIER_REQUIRE_LMCACHE=1``.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

if os.environ.get("FSTIER_REQUIRE_LMCACHE") == "1":
    import lmcache.v1.distributed.storage_manager  # noqa: F401  (fail loudly in CI)
else:
    pytest.importorskip(
        "lmcache.v1.distributed.storage_manager",
        reason="LMCache not installed (make test-lmcache builds .venv-lmcache with it)",
    )

import _lmc  # noqa: E402

INTACT, CORRUPT, TRUNCATED, FOREIGN, MISSING = 1, 2, 3, 4, 5
SEEDS = "1,2,3,4,5"
CHUNKS = "4"


def _flip_last_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[-1] ^= 0x01
    path.write_bytes(bytes(data))


def _truncate(path: Path) -> None:
    os.truncate(path, path.stat().st_size - 4096)


def test_new_process_loads_byte_identical_and_damage_is_a_miss_unlike_fs(tmp_path: Path) -> None:
    froot, croot = tmp_path / "fstier", tmp_path / "fs"
    croot.mkdir()
    fstier, control = _lmc.fstier_spec(froot), _lmc.fs_spec(croot)
    stored = _lmc.run_worker("store", [fstier, control], "--seeds", SEEDS, "--chunks", CHUNKS)
    assert stored["done"], f"LMCache's store controller did not finish every store: {stored}"
    assert all(failed == 0 for _ok, failed in stored["counts"].values()), stored["counts"]

    # The same damage to chunk 0 of a request, in both adapters' files.
    for root_file in (_lmc.fstier_file, _lmc.fs_file):
        root = froot if root_file is _lmc.fstier_file else croot
        _flip_last_byte(root_file(root, CORRUPT, 0))
        _truncate(root_file(root, TRUNCATED, 0))
        root_file(root, MISSING, 0).unlink()

    # Request FOREIGN is loaded under another layout of the same byte size.
    args = ("--seeds", SEEDS, "--chunks", CHUNKS, "--load-shape", f"{FOREIGN}=2,4,128,128")
    got = _lmc.run_worker("load", [fstier], *args)
    ctl = _lmc.run_worker("load", [control], *args)

    # A new process reads every intact chunk back from fstier, byte for byte.
    assert got[str(INTACT)] == stored[str(INTACT)]
    assert got[f"{INTACT}.l2_hits"] == 4
    # Never a wrong byte: every chunk fstier served is the stored one.
    for seed in (CORRUPT, TRUNCATED, FOREIGN, MISSING):
        served = got[str(seed)]
        assert served[0] is None, f"request {seed}: fstier served damaged chunk 0"
        assert all(d is None or d == s for d, s in zip(served, stored[str(seed)], strict=True))
    assert got[str(FOREIGN)] == [None] * 4  # another layout's files are never found

    # The control: LMCache's fs adapter serves the flipped byte as a hit.
    assert ctl[str(INTACT)] == stored[str(INTACT)]
    assert ctl[str(CORRUPT)][0] is not None and ctl[str(CORRUPT)][0] != stored[str(CORRUPT)][0]
    assert ctl[str(FOREIGN)][0] is not None  # and a chunk of another layout too
    # (docs/lmcache.md's table: fs misses a truncated or missing file.)
    assert ctl[str(TRUNCATED)][0] is None and ctl[str(MISSING)][0] is None
