"""Schedules: Algorithm 1's restructuring at perfect squares, and the invariants every grid keeps."""

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from parts import SCHEDULES, SELECTORS, SUMMARIES, part_id
from sparseattn import DoublingSchedule, FixedSchedule, Lowest, Radar, SegmentLayout, SegmentSearch, SqrtSchedule


def walk(schedule, n_max, start=0):
    """Feed token counts start..n_max one by one; yield (n, grid, rebuilt)."""
    grid = None
    for n in range(start, n_max + 1):
        new = schedule.plan(n, grid)
        yield n, new, new.is_rebuild_of(grid)
        grid = new


def test_sqrt_schedule_restructures_exactly_at_perfect_squares():
    rebuilds = [n for n, _, rebuilt in walk(SqrtSchedule(), 20_000, start=1) if rebuilt]
    assert rebuilds == [r * r for r in range(1, math.isqrt(20_000) + 1)]


def test_sqrt_schedule_makes_c_segments_of_c_tokens_and_keeps_the_buffer_below_two_sqrt_t():
    for n, grid, _ in walk(SqrtSchedule(), 100_000, start=1):
        c = math.isqrt(n)
        assert grid.segment_size == c and grid.n_segments == c
        assert n - grid.covered < 2 * math.sqrt(n)


def test_sqrt_schedule_restructures_at_squares_during_decoding():
    method = Radar(top_k=2, n_features=16)
    state = method.new_state(1, 1, 8)
    state.prefill(torch.randn(1, 1, 5, 8), torch.randn(1, 1, 5, 8))
    for t in range(6, 150):
        _, info = state.step(torch.randn(1, 1, 8), torch.randn(1, 1, 8), torch.randn(1, 1, 8))
        assert info.rebuilt == (math.isqrt(t) ** 2 == t), t
        assert info.layout.buffer_size < 2 * math.sqrt(t)


@given(aspect=st.floats(0.25, 4.0), n=st.integers(1, 50_000))
def test_sqrt_schedule_with_an_aspect_ratio_covers_the_last_square(aspect, n):
    grid = SqrtSchedule(aspect).plan(n, None)
    r = math.isqrt(n)
    assert grid.built_at == r * r
    assert grid.segment_size == max(1, math.floor(r / aspect))
    assert r * r - grid.segment_size < grid.covered <= r * r


def test_fixed_schedule_seals_each_segment_once_when_it_fills_and_never_rebuilds():
    rebuilds, previous = 0, None
    for n, grid, rebuilt in walk(FixedSchedule(16), 2000):
        rebuilds += rebuilt
        assert grid.n_segments == n // 16
        if previous is not None:
            assert grid.n_segments - previous.n_segments == (1 if n % 16 == 0 else 0)
        previous = grid
    assert rebuilds == 1  # the first build only


def test_doubling_schedule_rebuilds_only_when_the_context_doubles():
    built = [n for n, _, rebuilt in walk(DoublingSchedule(), 100_000, start=1) if rebuilt]
    assert built == [2**i for i in range(17)]
    for n, grid, _ in walk(DoublingSchedule(), 100_000, start=1):
        assert n - grid.covered < grid.segment_size  # the buffer is less than one segment
        assert grid.n_segments <= 2 * math.sqrt(2) * math.sqrt(n) + 1


@pytest.mark.parametrize("schedule", SCHEDULES, ids=part_id)
@given(sinks=st.integers(0, 5), window=st.integers(0, 40), n=st.integers(0, 5000))
def test_segments_partition_the_past(schedule, sinks, window, n):
    grid = schedule.plan(n, None)
    t = n + sinks
    lay = SegmentLayout(length=t, sinks=sinks, segment_size=grid.segment_size, n_segments=grid.n_segments, window=window)
    bounds = [(0, lay.sink_end)] + [
        (lay.segment_start(i), lay.segment_start(i) + lay.segment_size) for i in range(lay.n_segments)
    ] + [(lay.segment_end, t)]
    # contiguous, disjoint, covering [0, t)
    assert bounds[0][0] == 0 and bounds[-1][1] == t
    assert all(a[1] == b[0] for a, b in zip(bounds, bounds[1:]))
    assert lay.sink_end <= lay.tail_start <= lay.segment_end
    assert lay.tail_size >= min(window, t - lay.sink_end)


@pytest.mark.parametrize("summary", SUMMARIES, ids=part_id)
@pytest.mark.parametrize("schedule", SCHEDULES, ids=part_id)
@pytest.mark.parametrize("selector", SELECTORS, ids=part_id)
def test_sinks_buffer_and_window_are_always_kept_and_nothing_beyond_the_past_is_selected(summary, selector, schedule):
    sinks, window = 3, 4
    method = SegmentSearch(summary, selector, schedule, top_k=1, sinks=sinks, window=window)
    state = method.new_state(2, 2, 8)
    state.prefill(torch.randn(2, 2, 20, 8), torch.randn(2, 2, 20, 8))
    for t in range(21, 90):
        _, info = state.step(torch.randn(2, 6, 8), torch.randn(2, 2, 8), torch.randn(2, 2, 8))
        mask, lay = info.to_mask(), info.layout
        assert mask.shape[-1] == t == lay.length
        assert mask[..., :sinks].all()
        assert mask[..., lay.segment_end :].all()  # the buffer
        assert mask[..., t - window :].all()
        assert (info.segments >= 0).all() and (info.segments < lay.n_segments).all()


def test_lowest_selection_still_keeps_sinks_and_the_newest_token():
    state = SegmentSearch(selector=Lowest(), top_k=1, sinks=1, window=1).new_state(1, 1, 4)
    state.prefill(torch.randn(1, 1, 50, 4), torch.randn(1, 1, 50, 4))
    _, info = state.step(torch.randn(1, 1, 4), torch.randn(1, 1, 4), torch.randn(1, 1, 4))
    assert info.to_mask()[0, 0, 0] and info.to_mask()[0, 0, -1]
