"""Schedules: Algorithm 1's restructuring at perfect squares, the authors' rebuild rule, and the invariants every grid keeps."""

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from parts import SCHEDULES, SELECTORS, SUMMARIES, part_id
from sparseattn import DoublingSchedule, FixedSchedule, Lowest, SegmentLayout, SegmentSearch, SqrtSchedule
from sparseattn.methods.presets import RadarAlg1
from sparseattn.schedules.aspect import AspectSchedule


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


def test_sqrt_schedule_restructures_when_the_past_reaches_a_perfect_square_during_decoding():
    # Algorithm 1 restructures at t = r^2; the current token is never sealed (it is always attended),
    # so here the r^2 past tokens are restructured at the step that brings token r^2 + 1.
    method = RadarAlg1(top_k=2, n_features=16)
    state = method.new_state(1, 1, 8)
    state.prefill(torch.randn(1, 1, 5, 8), torch.randn(1, 1, 5, 8))
    for t in range(6, 150):
        _, info = state.step(torch.randn(1, 1, 8), torch.randn(1, 1, 8), torch.randn(1, 1, 8))
        assert info.rebuilt == (math.isqrt(t - 1) ** 2 == t - 1), t
        assert info.layout.segment_end <= t - 1  # the current token is in the buffer
        assert info.layout.buffer_size < 2 * math.sqrt(t)


# -- the authors' rule: c = floor(sqrt(t) / a), rebuilt when t // c >= 2 a^2 c --------------------

# Worked by hand for a = 4 (2 a^2 = 32), feeding t = 0, 1, 2, ...:
#   t = 0:     c = max(1, floor(0 / 4)) = 1
#   c = 1:     due once t // 1 >= 32, at t = 32; floor(sqrt(32) / 4) = 1 is c already: no rebuild
#              until floor(sqrt(t) / 4) = 2, i.e. t = 64
#   c = 2:     due at t // 2 >= 64, t = 128; floor(11.3 / 4) = 2 again; c = 3 first at t = 144
#   c = 3:     due at t // 3 >= 96,  t = 288: floor(16.97 / 4) = 4
#   c = 4:     due at t // 4 >= 128, t = 512: floor(22.6 / 4) = 5
#   c = 5:     due at t // 5 >= 160, t = 800: floor(28.3 / 4) = 7
#   c = 7:     due at t // 7 >= 224, t = 1568: floor(39.6 / 4) = 9
#   c = 9:     due at t // 9 >= 288, t = 2592: floor(50.9 / 4) = 12
#   c = 12:    due at t // 12 >= 384, t = 4608: floor(67.9 / 4) = 16
#   c = 16:    due at t // 16 >= 512, t = 8192: floor(90.5 / 4) = 22
#   c = 22:    due at t // 22 >= 704, t = 15488: floor(124.5 / 4) = 31
AUTHORS_REBUILDS_FROM_ZERO = [
    (0, 1), (64, 2), (144, 3), (288, 4), (512, 5), (800, 7), (1568, 9), (2592, 12), (4608, 16), (8192, 22), (15488, 31),
]  # fmt: skip


def test_authors_rule_rebuilds_where_worked_out_by_hand():
    rebuilds = [(n, grid.segment_size) for n, grid, rebuilt in walk(AspectSchedule(4), 20_000) if rebuilt]
    assert rebuilds == AUTHORS_REBUILDS_FROM_ZERO


def test_authors_rule_after_a_16k_prefill_with_a_sink_and_a_1024_window():
    # 16384 - 1 sink - 1024 window = 15359 segmentable: c = floor(123.93 / 4) = 30, 511 segments, 29 left.
    schedule = AspectSchedule(4)
    grid = schedule.plan(15359, None)
    assert (grid.segment_size, grid.n_segments, 15359 - grid.covered) == (30, 511, 29)
    # Next rebuild when t // 30 >= 2 * 16 * 30 = 960, i.e. t = 28800: c = floor(169.7 / 4) = 42.
    rebuilds = [(n, g.segment_size) for n, g, rebuilt in walk(schedule, 40_000, start=15359) if rebuilt]
    assert rebuilds == [(15359, 30), (28800, 42)]


def test_authors_rule_with_aspect_one_and_a_non_square_start():
    # a = 1 (2 a^2 = 2): t0 = 50 -> c = 7; due at t // 7 >= 14, t = 98: floor(9.9) = 9;
    # due at t // 9 >= 18, t = 162: floor(12.7) = 12; due at t // 12 >= 24, t = 288: floor(16.97) = 16.
    rebuilds = [(n, g.segment_size) for n, g, rebuilt in walk(AspectSchedule(1), 300, start=50) if rebuilt]
    assert rebuilds == [(50, 7), (98, 9), (162, 12), (288, 16)]


def test_authors_rule_seals_full_segments_between_rebuilds_and_leaves_less_than_one_segment():
    previous = None
    for n, grid, rebuilt in walk(AspectSchedule(4), 50_000):
        assert grid.n_segments == n // grid.segment_size  # every full segment is sealed
        assert n - grid.covered < grid.segment_size  # the unsegmented remainder
        if previous is not None and not rebuilt:
            assert grid.segment_size == previous.segment_size
            assert grid.n_segments - previous.n_segments == (1 if n % grid.segment_size == 0 else 0)
        if grid.segment_size >= 3:  # the grid keeps at most twice its target shape a^2 c
            assert grid.n_segments <= 2 * 16 * grid.segment_size
        previous = grid


def test_authors_rule_rebuild_work_is_amortised_constant_per_token():
    work, n_max = 0, 100_000
    for n, grid, rebuilt in walk(AspectSchedule(4), n_max):
        work += grid.covered if rebuilt else 0
    assert work <= 2 * n_max  # one O(t) rebuild per (roughly) doubling


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


@pytest.mark.parametrize("schedule", [*SCHEDULES, AspectSchedule(4)], ids=part_id)
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
