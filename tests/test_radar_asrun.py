"""Radar as its authors ran it (issue 15), and the segment family under hostile input (issue 14).

``Radar()`` is the configuration of the authors' code and experiment scripts; ``RadarAlg1()`` is the
paper's Algorithm 1. Every segment preset must also keep a token budget or say why it cannot, carry
NaN/inf like dense attention per KV head, and leave its state untouched when a step is refused.
"""

from __future__ import annotations

import math
import re
import warnings

import pytest
import torch

from parts import SEGMENT_PRESETS
from sparseattn import (
    DoublingSchedule,
    FixedSchedule,
    PerformerFeatures,
    Random,
    Rerank,
    SegmentGrid,
    SqrtSchedule,
    TopK,
    attention_ref,
)
from sparseattn.methods.presets import Radar, RadarAlg1
from sparseattn.schedules.aspect import AspectSchedule
from sparseattn.testing import assert_close

# -- the as-run preset ---------------------------------------------------------------------------


def test_radar_is_the_configuration_the_authors_ran():
    method = Radar()
    assert method.summary == PerformerFeatures(n_features=4096, antithetic=True)  # 2048 draws as +-omega
    assert method.selector == TopK()
    assert method.schedule == AspectSchedule(4)  # c = floor(sqrt(t) / 4), rebuilt when t // c >= 32 c
    assert (method.top_k, method.sinks, method.window, method.budget) == (64, 1, 1024, None)


def test_radar_alg1_is_algorithm_1_as_written():
    method = RadarAlg1()
    assert method.summary == PerformerFeatures(n_features=2048)
    assert (method.selector, method.schedule) == (TopK(), SqrtSchedule(1.0))
    assert (method.top_k, method.sinks, method.window, method.budget) == (64, 0, 0, None)


def test_at_the_papers_perplexity_point_radar_attends_about_3000_tokens_not_9000():
    # 16k prefill, k = 64, window 1024, 1 sink: 15,359 segmentable tokens -> c = 30, 511 segments and
    # a remainder of 29 (tests/test_schedules.py). Each step: 1 + 64 x 30 + 1024 + remainder < 2,975.
    # Algorithm 1 at the same point: c = 128 (sqrt(16384)), 64 x 128 + buffer ~ 8,200 to 8,400.
    state = Radar(n_features=8).new_state(1, 1, 4)
    state.prefill(torch.randn(1, 1, 16384, 4), torch.randn(1, 1, 16384, 4))
    assert (state.grid.segment_size, state.grid.n_segments) == (30, 511)
    for _ in range(40):
        _, info = state.step(torch.randn(1, 1, 4), torch.randn(1, 1, 4), torch.randn(1, 1, 4))
        lay = info.layout
        remainder = lay.tail_size - 1024
        assert lay.segment_size == 30 and 0 <= remainder < 30
        assert int(info.attended) == 1 + 64 * 30 + 1024 + remainder <= 2974


@pytest.mark.parametrize("budget", [64, 128, 512, 1024, 4096])
def test_radar_under_a_token_budget_attends_at_most_the_budget(budget):
    # Rule: window min(1024, budget // 4), 1 sink, the rest whole segments (the remainder counted).
    method = Radar(n_features=8, budget=budget)
    assert (method.window, method.sinks) == (min(1024, budget // 4), 1)
    state = method.new_state(1, 2, 4)
    state.prefill(torch.randn(1, 2, 3000, 4), torch.randn(1, 2, 3000, 4))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a budget this size is honoured without a word
        for _ in range(100):
            _, info = state.step(torch.randn(1, 2, 4), torch.randn(1, 2, 4), torch.randn(1, 2, 4))
            assert int(info.attended.max()) <= budget
            assert torch.equal(info.attended, info.to_mask().sum(-1))


def test_an_explicit_window_overrides_the_budget_rule():
    assert Radar(budget=512, window=32).window == 32
    assert Radar(window=32).window == 32


# -- a budget below what a method can honour -----------------------------------------------------


def test_radar_with_budget_1_says_it_attends_3_of_7_tokens():
    # Issue 14: `radar --budget 1` attended 5 of 7 tokens without a word. Now 3 (the sink, one
    # segment, the current token), with a warning that gives the numbers and the smallest budget.
    state = Radar(budget=1).new_state(1, 1, 8)
    state.prefill(torch.randn(1, 1, 6, 8), torch.randn(1, 1, 6, 8))
    with pytest.warns(UserWarning, match=r"budget=1 is below what it can honour: a step at t=7 attends 3 of 7 tokens") as record:
        _, info = state.step(torch.randn(1, 1, 8), torch.randn(1, 1, 8), torch.randn(1, 1, 8))
    assert int(info.attended) == 3
    assert "Raise the budget to >= 3" in str(record[0].message)


@pytest.mark.parametrize("name", SEGMENT_PRESETS)
def test_a_budget_below_the_floor_warns_once_per_method_with_the_numbers(name):
    method = SEGMENT_PRESETS[name](budget=2)
    states = [method.new_state(1, 1, 8, layer_idx=i) for i in range(3)]  # three layers, one method
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        for state in states:
            state.prefill(torch.randn(1, 1, 40, 8), torch.randn(1, 1, 40, 8))
        for _ in range(5):
            for state in states:
                _, info = state.step(torch.randn(1, 1, 8), torch.randn(1, 1, 8), torch.randn(1, 1, 8))
                assert int(info.attended.max()) > 2
    messages = [str(w.message) for w in record if "budget=2" in str(w.message)]
    assert len(messages) == 1, messages
    attended, stored = map(int, re.search(r"attends (\d+) of (\d+) tokens", messages[0]).groups())
    assert attended > 2 and stored == 41


@pytest.mark.parametrize("name", SEGMENT_PRESETS)
def test_a_budget_that_is_honoured_does_not_warn(name):
    state = SEGMENT_PRESETS[name](budget=64).new_state(1, 1, 8)
    state.prefill(torch.randn(1, 1, 200, 8), torch.randn(1, 1, 200, 8))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for _ in range(5):
            _, info = state.step(torch.randn(1, 1, 8), torch.randn(1, 1, 8), torch.randn(1, 1, 8))
            assert int(info.attended.max()) <= 64


# -- NaN and inf: carried like dense attention, per KV head --------------------------------------

B, H, G, D, T = 2, 2, 2, 8, 90


def _small(name):
    """The preset at a size where its segments are searched (window, pages and k small)."""
    kw = {"top_k": 2}
    if name == "radar":
        kw["window"] = 4
    return SEGMENT_PRESETS[name](**kw)


def _tokens(seed, steps):
    gen = torch.Generator().manual_seed(seed)
    prompt = (torch.randn(B, H, T, D, generator=gen), torch.randn(B, H, T, D, generator=gen))
    decode = [tuple(torch.randn(*shape, generator=gen) for shape in ((B, H * G, D), (B, H, D), (B, H, D))) for _ in range(steps)]
    return prompt, decode


def _run(method, prompt, decode):
    state = method.new_state(B, H, D)
    state.prefill(*prompt)
    return [state.step(q, k, v)[0].view(B, H, G, D) for q, k, v in decode]


@pytest.mark.parametrize("where", ["prompt key", "prompt value", "decode key"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")], ids=["nan", "inf", "-inf"])
@pytest.mark.parametrize("name", SEGMENT_PRESETS)
def test_a_non_finite_key_or_value_reaches_the_output_of_its_row_and_kv_head_only(name, bad, where):
    # Dense attention: a NaN key or value makes the softmax (or the weighted sum) NaN for every
    # query head of its KV head, at every later step, whichever token is selected. Here the same,
    # and nothing else changes: other rows and other KV heads give the clean run's output exactly.
    method = _small(name)
    prompt, decode = _tokens(3, steps=6)
    clean = _run(method, prompt, decode)
    prompt = tuple(x.clone() for x in prompt)
    decode = [tuple(x.clone() for x in step) for step in decode]
    if where == "prompt key":
        prompt[0][0, 1, 10, 3] = bad  # row 0, KV head 1, a token deep in the segments
    elif where == "prompt value":
        prompt[1][0, 1, 10, 3] = bad
    else:
        decode[2][1][0, 1, 3] = bad  # the key of the third decode token
    first = 2 if where == "decode key" else 0
    for i, (out, ref) in enumerate(zip(_run(method, prompt, decode), clean)):
        if i >= first:
            assert not torch.isfinite(out[0, 1]).any(), i
        else:
            assert torch.equal(out[0, 1], ref[0, 1])
        assert torch.equal(out[1], ref[1]) and torch.equal(out[0, 0], ref[0, 0])


@pytest.mark.parametrize("name", SEGMENT_PRESETS)
def test_a_nan_query_gives_nan_for_its_own_head_and_leaves_other_rows_and_kv_heads_alone(name):
    method = _small(name)
    prompt, decode = _tokens(4, steps=3)
    clean = _run(method, prompt, decode)
    decode = [tuple(x.clone() for x in step) for step in decode]
    decode[1][0][0, 3, 5] = float("nan")  # row 0, query head 3 (KV head 1), step 1
    out = _run(method, prompt, decode)
    assert not torch.isfinite(out[1][0, 1, 1]).any()
    assert torch.isfinite(out[1][0, 1, 0]).all()  # the other head of the group stays finite
    for got, ref in zip(out, clean):
        assert torch.equal(got[1], ref[1]) and torch.equal(got[0, 0], ref[0, 0])
    assert torch.equal(out[2], clean[2])  # one bad query leaves no trace


def test_a_nan_key_in_the_always_attended_tail_matches_dense_nan_pattern():
    # The poisoned KV head is NaN in dense attention too (the reference, over every token).
    prompt, decode = _tokens(5, steps=1)
    prompt[0][1, 0, T - 1, 0] = float("nan")
    state = Radar(n_features=16, top_k=2, window=4).new_state(B, H, D)
    state.prefill(*prompt)
    q, k, v = decode[0]
    out, _ = state.step(q, k, v)
    dense = attention_ref(q.view(B, H, G, D), state.keys, state.values).view(B, H * G, D)
    assert torch.equal(torch.isfinite(out), torch.isfinite(dense))


# -- a refused step changes nothing --------------------------------------------------------------

BAD_STEPS = {
    "query head_dim": lambda q, k, v: (q[..., :-1], k, v),
    "query heads not a multiple": lambda q, k, v: (q[:, :-1], k, v),
    "query dtype": lambda q, k, v: (q.double(), k, v),
    "key shape": lambda q, k, v: (q, k[:, :1], v),
    "value dtype": lambda q, k, v: (q, k, v.half()),
}


@pytest.mark.parametrize("bad", BAD_STEPS)
@pytest.mark.parametrize("name", SEGMENT_PRESETS)
def test_a_step_that_fails_validation_leaves_the_state_as_if_it_never_happened(name, bad):
    method = _small(name)
    prompt, decode = _tokens(6, steps=4)
    seen, twin = method.new_state(B, H, D), method.new_state(B, H, D)
    for state in (seen, twin):
        state.prefill(*prompt)
        state.step(*decode[0])
    length, keys, grid = seen.length, seen.keys.clone(), seen.grid
    with pytest.raises(ValueError):
        seen.step(*BAD_STEPS[bad](*decode[1]))
    assert (seen.length, seen.grid) == (length, grid)
    assert torch.equal(seen.keys, keys)
    for q, k, v in decode[1:]:  # the next valid steps: same output and selection as the twin
        out, info = seen.step(q, k, v)
        ref, ref_info = twin.step(q, k, v)
        assert torch.equal(out, ref) and torch.equal(info.segments, ref_info.segments)


# -- every numeric field of the parts is checked -------------------------------------------------

BAD_FIELDS = [
    (lambda: PerformerFeatures(n_features=2.5), "PerformerFeatures.n_features", "2.5"),
    (lambda: PerformerFeatures(n_features="8"), "PerformerFeatures.n_features", "'8'"),
    (lambda: PerformerFeatures(n_features=True), "PerformerFeatures.n_features", "True"),
    (lambda: PerformerFeatures(n_features=0), "PerformerFeatures.n_features", "0"),
    (lambda: PerformerFeatures(n_features=9, antithetic=True), "PerformerFeatures.n_features", "9"),
    (lambda: PerformerFeatures(antithetic="yes"), "PerformerFeatures.antithetic", "'yes'"),
    (lambda: PerformerFeatures(orthogonal=1), "PerformerFeatures.orthogonal", "1"),
    (lambda: PerformerFeatures(seed=1.5), "PerformerFeatures.seed", "1.5"),
    (lambda: PerformerFeatures(seed=-1), "PerformerFeatures.seed", "-1"),
    (lambda: SqrtSchedule(aspect="2"), "SqrtSchedule.aspect", "'2'"),
    (lambda: SqrtSchedule(aspect=float("nan")), "SqrtSchedule.aspect", "nan"),
    (lambda: DoublingSchedule(aspect=0), "DoublingSchedule.aspect", "0"),
    (lambda: AspectSchedule(aspect=-4), "AspectSchedule.aspect", "-4"),
    (lambda: AspectSchedule(aspect=float("inf")), "AspectSchedule.aspect", "inf"),
    (lambda: AspectSchedule(aspect=True), "AspectSchedule.aspect", "True"),
    (lambda: FixedSchedule(size=2.0), "FixedSchedule.size", "2.0"),
    (lambda: FixedSchedule(size=0), "FixedSchedule.size", "0"),
    (lambda: Random(seed="1"), "Random.seed", "'1'"),
    (lambda: Rerank(shortlist=1.5), "Rerank.shortlist", "1.5"),
    (lambda: Rerank(factor="2"), "Rerank.factor", "'2'"),
    (lambda: Rerank(factor=float("nan")), "Rerank.factor", "nan"),
    (lambda: Rerank(per_group=1), "Rerank.per_group", "1"),
    (lambda: SegmentGrid(1.5, 0, 0), "SegmentGrid.segment_size", "1.5"),
    (lambda: SegmentGrid(2, -1, 0), "SegmentGrid.n_segments", "-1"),
    (lambda: Radar(budget="512"), "Radar.budget", "'512'"),
    (lambda: Radar(budget=0), "Radar.budget", "0"),
]


@pytest.mark.parametrize("make, field, value", BAD_FIELDS, ids=[f"{f}={v}" for _, f, v in BAD_FIELDS])
def test_a_bad_field_is_refused_naming_the_field_the_value_and_what_is_allowed(make, field, value):
    with pytest.raises(ValueError, match=rf"{re.escape(field)} must be .*(int|number|True or False).*got {re.escape(value)}"):
        make()


def test_aspect_schedule_takes_a_fractional_aspect():
    assert AspectSchedule(2.5).plan(400, None).segment_size == math.floor(20 / 2.5)


def test_as_run_and_alg1_outputs_are_attention_over_their_selection():
    # Both presets are exact attention over what they report (the segment-search contract).
    from sparseattn import segment_attention_ref

    for method in (Radar(n_features=32, top_k=3, window=5), RadarAlg1(n_features=32, top_k=3)):
        prompt, decode = _tokens(8, steps=5)
        state = method.new_state(B, H, D)
        state.prefill(*prompt)
        for q, k, v in decode:
            out, info = state.step(q, k, v)
            ref = segment_attention_ref(q.view(B, H, G, D), state.keys, state.values, info.layout, info.segments)
            assert_close(out, ref.view(B, H * G, D), torch.float32)
