"""Budget: tokens attended per step <= top_k * c + buffer + sinks + window, and O(sqrt(t)) for SqrtSchedule."""

import math

import pytest
import torch

from parts import SCHEDULES, part_id
from sparseattn import PerformerFeatures, Radar, SegmentLayout, SegmentSearch, SqrtSchedule, TopK


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


@pytest.mark.parametrize("t", [1_000, 10_000, 100_000])
def test_reported_attention_counts_match_the_layout_at_long_contexts(t):
    # Cheap dims: the structure, not the arithmetic, is under test.
    method = Radar(top_k=4, n_features=8)
    state = method.new_state(1, 1, 4)
    state.prefill(torch.randn(1, 1, t - 1, 4), torch.randn(1, 1, t - 1, 4))
    _, info = state.step(torch.randn(1, 1, 4), torch.randn(1, 1, 4), torch.randn(1, 1, 4))
    lay = info.layout
    assert lay.segment_size == lay.n_segments == math.isqrt(t)
    assert int(info.attended) == 4 * math.isqrt(t) + lay.buffer_size
    assert int(info.attended) / math.sqrt(t) <= 4 + 2
