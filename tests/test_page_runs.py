"""Byte runs and fragments (fstier.page_runs): coalescing keeps every fragment
in order, a contiguous layout is one run, and the tiling proof names the
first bad byte."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fstier.page_runs import Fragments, PageRun, coalesce, expand, intervals_tile, run_intervals


@settings(max_examples=200, deadline=None)
@given(
    size=st.sampled_from([1, 2, 8, 16]),
    steps=st.lists(st.tuples(st.integers(-3, 4), st.integers(-3, 4)), min_size=0, max_size=40),
)
def test_coalesce_then_expand_gives_every_fragment_back_in_order(size, steps):
    lo, co = [100 * size], [200 * size]
    for dl, dc in steps:
        lo.append(lo[-1] + dl * size)
        co.append(co[-1] + dc * size)
    frags = Fragments(np.array(lo, np.int64), np.array(co, np.int64), size)
    back = expand(coalesce(frags), size)
    assert back.lo.tolist() == lo and back.co.tolist() == co and back.size == size


def test_a_contiguous_layout_is_one_run_and_a_strided_one_is_one_run():
    n = 64
    contiguous = Fragments(np.arange(n) * 8, np.arange(n) * 8 + 32, 8)
    assert coalesce(contiguous) == [PageRun(0, 32, 8 * n, 1, 8 * n, 8 * n)]
    # a head slice of every token row: 16 bytes of every 64 on the canonical side
    strided = Fragments(np.arange(n) * 16, np.arange(n) * 64 + 16, 16)
    assert coalesce(strided) == [PageRun(0, 16, 16, n, 16, 64)]


def test_run_intervals_list_each_side():
    runs = [PageRun(0, 16, 16, 3, 16, 64)]
    starts, sizes = run_intervals(runs, "canonical")
    assert starts.tolist() == [16, 80, 144] and sizes.tolist() == [16, 16, 16]
    starts, _ = run_intervals(runs, "local")
    assert starts.tolist() == [0, 16, 32]


@pytest.mark.parametrize(
    ("starts", "sizes", "total", "error"),
    [
        ([0, 8, 16], [8, 8, 8], 24, None),
        ([16, 0, 8], [8, 8, 8], 24, None),
        ([0, 12], [8, 12], 24, "gap at byte 8"),
        ([0, 4], [8, 20], 24, "overlap at byte 4"),
        ([4], [20], 24, "bytes [0, 4) are not covered"),
        ([0], [16], 24, "covered up to byte 16, page has 24"),
        ([], [], 24, "nothing covers [0, 24)"),
        ([], [], 0, None),
    ],
)
def test_intervals_tile_names_the_first_bad_byte(starts, sizes, total, error):
    got = intervals_tile(np.array(starts, np.int64), np.array(sizes, np.int64), total)
    assert got == error
