"""Budget: tokens attended per step <= top_k * c + buffer + sinks + window, and O(sqrt(t)) for SqrtSchedule."""

import math

import pytest
import torch

from parts import SCHEDULES, part_id
from sparseattn import PerformerFeatures, SegmentLayout, SegmentSearch, SqrtSchedule, TopK
from sparseattn.methods.presets import Radar, RadarAlg1


@pytest.mark.parametrize("schedule", SCHEDULES, ids=part_id)
@pytest.mark.parametrize("top_k", [1, 3, 8])
def test_tokens_attended_per_step_stay_within_the_budget(schedule, top_k):
    sinks, window = 2, 5
    method = SegmentSearch(PerformerFeatures(32), TopK(), schedule, top_k=top_k, sinks=sinks, window=window)
    state = method.new_state(2, 2, 8)
    state.prefill(torch.randn(2, 2, 64, 8), torch.randn(2, 2, 64, 8))
    for _ in range(200):
        _, info = state.step(torch.randn(2, 4, 8), torch.randn(2, 2, 8), torch.randn(2, 2, 8))
        lay = info.layout
        bound = top_k * lay.segment_size + lay.buffer_size + sinks + window
        assert int(info.attended.max()) <= bound
        assert torch.equal(info.attended, info.to_mask().sum(-1))


@pytest.mark.parametrize("top_k,sinks,window", [(1, 0, 0), (4, 4, 64), (64, 1, 1024)])
def test_sqrt_schedule_attends_a_bounded_multiple_of_sqrt_t_up_to_1e5_tokens(top_k, sinks, window):
    # sinks + k whole segments of c <= sqrt(t) + the tail (buffer < 2 sqrt(t), plus the window)
    schedule, grid = SqrtSchedule(), None
    for t in range(1, 100_001):
        grid = schedule.plan(max(0, t - sinks), grid)
        lay = SegmentLayout(t, sinks, grid.segment_size, grid.n_segments, window)
        assert lay.max_attended(top_k) <= (top_k + 2) * math.sqrt(t) + sinks + window


def step_after_prefill(method, t):
    """What step ``t`` attends after a prefill of ``t - 1`` random tokens (one row, one KV head, d = 4)."""
    state = method.new_state(1, 1, 4)
    state.prefill(torch.randn(1, 1, t - 1, 4), torch.randn(1, 1, t - 1, 4))
    _, info = state.step(torch.randn(1, 1, 4), torch.randn(1, 1, 4), torch.randn(1, 1, 4))
    return info


@pytest.mark.parametrize("t", [1_000, 10_000, 100_000])
def test_reported_attention_counts_match_the_layout_at_long_contexts(t):
    # Cheap dims: the structure, not the arithmetic, is under test. Algorithm 1 over the t - 1 past
    # tokens (the current one is never sealed): sqrt(t - 1) segments of sqrt(t - 1) tokens.
    info = step_after_prefill(RadarAlg1(top_k=4, n_features=8), t)
    lay = info.layout
    assert lay.segment_size == lay.n_segments == math.isqrt(t - 1)
    assert int(info.attended) == 4 * math.isqrt(t - 1) + lay.buffer_size
    assert int(info.attended) / math.sqrt(t) <= 4 + 2


@pytest.mark.parametrize("t", [4_000, 20_000, 100_000])
def test_as_run_radar_attends_a_sink_k_segments_of_sqrt_t_over_4_the_window_and_the_remainder(t):
    # After a prefill of t - 1 and one step: t - 1 sink - 1024 window tokens are segmentable, cut
    # into segments of floor(sqrt(that) / 4) by the first (prefill) rebuild, then sealed as they fill.
    info = step_after_prefill(Radar(top_k=4, n_features=8), t)
    lay = info.layout
    c = math.isqrt(t - 2 - 1024) // 4
    remainder = (t - 1 - 1024) - lay.n_segments * c
    assert lay.segment_size == c and 0 <= remainder < c
    assert int(info.attended) == 1 + 4 * c + 1024 + remainder
    assert lay.tail_size == 1024 + remainder
