"""Byte runs between a rank's local page and the canonical page, and their arithmetic.

A :class:`PageRun` is ``num_fragments`` equal fragments at constant strides on
both sides: the unit page mappings (:mod:`fstier.layout`) and copy plans
(:mod:`fstier.copy_plan`) are written in. The helpers go between runs and
:class:`Fragments` (parallel numpy arrays of local and canonical offsets, one
size): :func:`expand` cuts runs into fragments (optionally into smaller
units), :func:`coalesce` merges fragments back into strided runs, greedily,
left to right (a contiguous layout is one run), :func:`run_intervals` lists one
side's byte intervals and :func:`intervals_tile` proves that intervals tile a
page exactly once (or names the first gap or overlap).

Invariants: fragments keep their given order (copy order) and coalescing
neither reorders, drops nor adds one: ``expand(coalesce(f), f.size)`` gives
``f`` back, fragment for fragment. Costs: numpy over the fragments plus a Python step per
stride change (never per fragment); start-up work only, never on a transfer's
path. Imports numpy, not torch.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal, NamedTuple

import numpy as np

__all__ = ["Fragments", "PageRun", "coalesce", "expand", "intervals_tile", "run_intervals"]


class PageRun(NamedTuple):
    """``num_fragments`` fragments of ``fragment_size`` bytes: fragment ``j`` is at
    ``local_offset + j * local_stride`` in the local page and at
    ``canonical_offset + j * canonical_stride`` in the canonical page."""

    local_offset: int
    canonical_offset: int
    fragment_size: int
    num_fragments: int
    local_stride: int
    canonical_stride: int


# --------------------------------------------------------------------------- #
# Fragment arithmetic (numpy, start-up only)
# --------------------------------------------------------------------------- #


@dataclass(frozen=True)
class Fragments:
    """Fragments of one uniform size ``size`` as parallel arrays, in copy order."""

    lo: np.ndarray
    co: np.ndarray
    size: int


def coalesce(frags: Fragments) -> list[PageRun]:
    """Coalesce fragments (kept in their given order) into strided runs.

    First adjacent fragments contiguous on both sides merge into segments; then
    consecutive equal-size segments with constant positive strides on both
    sides form one run (greedy, left to right). The Python loop runs over
    stride changes, not fragments, so regular layouts cost a handful of steps.
    """
    lo, co, f = frags.lo.astype(np.int64), frags.co.astype(np.int64), frags.size
    n = lo.size
    if n == 0:
        return []
    brk = np.ones(n, dtype=bool)
    brk[1:] = (lo[1:] != lo[:-1] + f) | (co[1:] != co[:-1] + f)
    starts = np.flatnonzero(brk)
    slo, sco = lo[starts], co[starts]
    ssz = np.diff(np.append(starts, n)) * f
    m = slo.size
    if m == 1:
        return [PageRun(int(slo[0]), int(sco[0]), int(ssz[0]), 1, int(ssz[0]), int(ssz[0]))]
    dl, dc = np.diff(slo), np.diff(sco)
    valid = (ssz[1:] == ssz[:-1]) & (dl > 0) & (dc > 0)
    # Run-length encode the steps by (valid, size, dl, dc).
    change = np.ones(m - 1, dtype=bool)
    change[1:] = (
        (valid[1:] != valid[:-1]) | (ssz[1:-1] != ssz[:-2]) | (dl[1:] != dl[:-1]) | (dc[1:] != dc[:-1])
    )
    block_starts = np.flatnonzero(change)
    block_ends = np.append(block_starts[1:], m - 1) - 1
    runs: list[PageRun] = []
    pos = 0

    def singles(upto: int) -> None:
        for i in range(pos, upto):
            s = int(ssz[i])
            runs.append(PageRun(int(slo[i]), int(sco[i]), s, 1, s, s))

    for a0, b in zip(block_starts.tolist(), block_ends.tolist(), strict=True):
        if not valid[a0]:
            continue
        a = max(a0, pos)
        if a > b:
            continue
        singles(a)
        s = int(ssz[a])
        runs.append(PageRun(int(slo[a]), int(sco[a]), s, b - a + 2, int(dl[a]), int(dc[a])))
        pos = b + 2
    singles(m)
    return runs


def expand(runs: Sequence[PageRun], unit: int | None = None) -> Fragments:
    """Runs back to fragments (in run order), optionally cut into ``unit`` bytes."""
    if not runs:
        return Fragments(np.zeros(0, np.int64), np.zeros(0, np.int64), unit or 1)
    arr = np.array(runs, dtype=np.int64).reshape(-1, 6)
    lo0, co0, fs, nf, ls, cs = arr.T
    if unit is None:
        unit = math.gcd(*(int(x) for x in np.unique(fs)))
    reps = nf * (fs // unit)
    total = int(reps.sum())
    run_idx = np.repeat(np.arange(arr.shape[0]), reps)
    first = np.cumsum(reps) - reps
    k = np.arange(total) - first[run_idx]
    per = fs[run_idx] // unit
    j, piece = k // per, k % per
    lo = lo0[run_idx] + j * ls[run_idx] + piece * unit
    co = co0[run_idx] + j * cs[run_idx] + piece * unit
    return Fragments(lo, co, unit)


def intervals_tile(starts: np.ndarray, sizes: np.ndarray, total: int) -> str | None:
    """None when ``[start, start+size)`` intervals tile ``[0, total)`` exactly once."""
    if starts.size == 0:
        return None if total == 0 else f"nothing covers [0, {total})"
    order = np.argsort(starts, kind="stable")
    s, z = starts[order], sizes[order]
    ends = s + z
    if s[0] != 0:
        return f"bytes [0, {int(s[0])}) are not covered"
    gaps = np.flatnonzero(s[1:] != ends[:-1])
    if gaps.size:
        i = int(gaps[0])
        kind = "overlap" if s[i + 1] < ends[i] else "gap"
        return f"{kind} at byte {int(min(s[i + 1], ends[i]))}"
    if ends[-1] != total:
        return f"covered up to byte {int(ends[-1])}, page has {total}"
    return None


def run_intervals(runs: Sequence[PageRun], side: Literal["local", "canonical"]) -> tuple[np.ndarray, np.ndarray]:
    """Every fragment of ``runs`` on one ``side`` as ``(starts, sizes)`` arrays, in run order."""
    if not runs:
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    arr = np.array(runs, dtype=np.int64).reshape(-1, 6)
    base = arr[:, 0] if side == "local" else arr[:, 1]
    stride = arr[:, 4] if side == "local" else arr[:, 5]
    nf = arr[:, 3]
    idx = np.repeat(np.arange(arr.shape[0]), nf)
    j = np.arange(int(nf.sum())) - (np.cumsum(nf) - nf)[idx]
    return base[idx] + j * stride[idx], arr[idx, 2]
