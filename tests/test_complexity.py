"""Per-step work: storage grows by doubling and summaries are computed only when segments are sealed or rebuilt."""

import math
from dataclasses import dataclass, field

import pytest
import torch

from sparseattn import Centroid, DoublingSchedule, FixedSchedule, SegmentSearch, SqrtSchedule
from sparseattn.schedules.aspect import AspectSchedule
from sparseattn.ops.buffers import GrowableBuffer


@dataclass(frozen=True)
class CountingCentroid(Centroid):
    """A Centroid that records how many tokens it summarised."""

    log: list = field(default_factory=list, compare=False)

    def summarize(self, params, keys):
        self.log.append(keys.shape[2] * keys.shape[3])
        return super().summarize(params, keys)


def summarised_tokens(schedule, n):
    """Tokens summarised while decoding n tokens one by one (the current token is never sealed: n - 1 past)."""
    summary = CountingCentroid()
    state = SegmentSearch(summary, schedule=schedule, top_k=2).new_state(1, 1, 4)
    state.append(torch.randn(1, 1, 1, 4), torch.randn(1, 1, 1, 4))
    for _ in range(n - 1):
        state.step(torch.randn(1, 1, 4), torch.randn(1, 1, 4), torch.randn(1, 1, 4))
    return sum(summary.log)


N = 3000


def test_fixed_schedule_summarises_each_token_once():
    assert summarised_tokens(FixedSchedule(10), N) == ((N - 1) // 10) * 10


def test_sqrt_schedule_summary_work_is_the_papers_amortised_sqrt_t():
    # Rebuild at every square r^2 <= N - 1 past tokens costs r^2 tokens: sum_r r^2 ~ N^1.5 / 3.
    expected = sum(r * r for r in range(1, math.isqrt(N - 1) + 1))
    assert summarised_tokens(SqrtSchedule(), N) == expected


def test_doubling_schedule_summary_work_is_amortised_constant():
    work = summarised_tokens(DoublingSchedule(), N)
    assert work <= 3 * N  # rebuilds cost N + N/2 + ... < 2N, sealing in between < N


def test_authors_rule_summary_work_is_amortised_constant():
    # Rebuilds at the hand-computed t of tests/test_schedules.py (64, 144, 288, ..., 2592) cost t each,
    # sealing in between costs each token once more at most.
    work = summarised_tokens(AspectSchedule(4), N)
    assert work <= 3 * N


def test_growable_buffer_copies_are_amortised_constant_per_token():
    buf, reallocations, ptr = GrowableBuffer(dim=2, min_capacity=1), 0, None
    blocks = []
    for i in range(1000):
        block = torch.full((1, 2, 1, 3), float(i))
        blocks.append(block)
        buf.append(block)
        if buf._data.data_ptr() != ptr:
            reallocations, ptr = reallocations + 1, buf._data.data_ptr()
    assert reallocations <= math.ceil(math.log2(1000)) + 1
    assert torch.equal(buf.view(), torch.cat(blocks, dim=2))


@pytest.mark.parametrize("schedule", [SqrtSchedule(), FixedSchedule(8), DoublingSchedule(), AspectSchedule(4)], ids=repr)
def test_decode_steps_do_not_copy_the_key_cache(schedule):
    state = SegmentSearch(Centroid(), schedule=schedule, top_k=2).new_state(1, 1, 4)
    state.prefill(torch.randn(1, 1, 500, 4), torch.randn(1, 1, 500, 4))
    moves = 0
    for _ in range(600):
        before = state.keys.data_ptr()
        state.step(torch.randn(1, 1, 4), torch.randn(1, 1, 4), torch.randn(1, 1, 4))
        moves += state.keys.data_ptr() != before
    assert moves <= 2  # capacity 500 -> 1000 -> 2000 while growing to 1100 tokens
