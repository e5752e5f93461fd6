"""Always-kept parts on top of a segment selection (issue 13, item 2): ``H2O ∪ segment search`` in one line.

* The output is dense attention (float64) over exactly the tokens the step reports: sinks, the
  selected segments, the tail and the always-kept tokens, each counted once.
* The heavy hitters are the tokens with the largest recorded attention (the prompt's column sums,
  then every step's weights), and every step attends them.
* The extra tokens count against the budget; at a budget of at least ``t`` it is dense attention.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

import sparseattn as sa
from sparseattn.ops.attention import attention_ref
from sparseattn.ops.slots import causal_probability_sums_ref
from sparseattn.testing import assert_close

B, H, G, D = 2, 2, 3, 16


def decode(method, prompt=120, steps=12, dtype=torch.float64, seed=0):
    """Prefill a prompt with its queries, then decode; yield (state, query, out, info) per step."""
    torch.manual_seed(seed)
    state = method.new_state(B, H, D, dtype=dtype)
    k, v, q = (torch.randn(*s, dtype=dtype) for s in ((B, H, prompt, D), (B, H, prompt, D), (B, H * G, prompt, D)))
    state.append(k, v)
    state.attend_block(q)
    for _ in range(steps):
        query = torch.randn(B, H * G, D, dtype=dtype)
        out, info = state.step(query, torch.randn(B, H, D, dtype=dtype), torch.randn(B, H, D, dtype=dtype))
        yield state, query, out, info


@pytest.mark.parametrize("shared", [False, True], ids=["per-query-head", "shared-per-kv-head"])
@pytest.mark.parametrize("always", [sa.HeavyHitters(8), sa.Sinks(5) | sa.HeavyHitters(4), sa.RecentWindow(20)])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_the_output_is_dense_attention_over_exactly_the_reported_tokens(shared, always, dtype):
    method = sa.SegmentSearch(sa.PerformerFeatures(32), sa.TopK(), sa.FixedSchedule(8), top_k=2, sinks=1, window=4,
                              shared_kv_selection=shared, always=always)
    for state, q, out, info in decode(method, dtype=dtype):
        mask = info.to_mask()  # [B, H_q, t]
        assert torch.equal(info.attended, mask.sum(-1))  # every token counted once
        ref = attention_ref(q.view(B, H, G, D), state.keys, state.values, mask.view(B, H, G, -1)).view(B, H * G, D)
        assert_close(out, ref, dtype)
        assert int(info.attended.max()) <= 1 + 4 + 2 * 8 + always.size + 8  # sinks, window + remainder, segments, extra


def test_every_step_attends_the_tokens_with_the_most_recorded_attention():
    method = dataclasses.replace(sa.RadarAlg1(top_k=2, n_features=32), always=sa.HeavyHitters(6))
    torch.manual_seed(1)
    k, v, q = torch.randn(B, H, 150, D, dtype=torch.float64), torch.randn(B, H, 150, D, dtype=torch.float64), torch.randn(B, H * G, 150, D, dtype=torch.float64)
    state = method.new_state(B, H, D, dtype=torch.float64)
    state.append(k, v)
    state.attend_block(q)
    sums = causal_probability_sums_ref(q.view(B, H, G, 150, D), k)
    assert torch.allclose(state.attention_record, sums, rtol=1e-10)  # the prompt's column sums
    for step in range(5):
        heavy = state.attention_record.topk(6, dim=-1).indices  # before this step's weights are added
        record = state.attention_record.clone()
        query = torch.randn(B, H * G, D, dtype=torch.float64)
        _, info = state.step(query, torch.randn(B, H, D, dtype=torch.float64), torch.randn(B, H, D, dtype=torch.float64))
        mask = info.to_mask().view(B, H, G, -1)
        assert mask[..., :150].gather(-1, heavy.unsqueeze(2).expand(B, H, G, 6)).all(), step
        # The step's weights went to what it attended, summed over the group: the record grew by exactly 1 per query head.
        grown = state.attention_record[..., : record.shape[-1]] - record
        assert torch.allclose(state.attention_record.sum(-1) - record.sum(-1), torch.full((B, H), float(G), dtype=torch.float64))
        assert (grown[~mask[..., : record.shape[-1]].any(2)] == 0).all()


def test_radar_plus_h2o_is_one_line_and_honours_the_budget():
    method = sa.RadarH2O(budget=200, n_features=32)
    assert method == dataclasses.replace(sa.Radar(budget=200, n_features=32), always=sa.HeavyHitters(25))
    for _, _, _, info in decode(method, prompt=400, steps=20, dtype=torch.float32):
        assert int(info.attended.max()) <= 200


def test_a_part_that_needs_a_record_reads_the_one_the_state_keeps():
    with pytest.raises(ValueError, match="SegmentSearch.always must be None or an always-kept part"):
        sa.SegmentSearch(always=sa.H2O())
    state = sa.SegmentSearch(top_k=1, always=sa.Sinks(2)).new_state(1, 1, 4)
    state.append(torch.randn(1, 1, 30, 4), torch.randn(1, 1, 30, 4))
    assert state.attention_record is None and "attention_record" not in state.nbytes()
