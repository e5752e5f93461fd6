"""Budget allocation parts: the layer's segments split between heads, the total honoured.

Statements checked:

* ``PooledMass.plan`` is the greedy pooled split of its float64 reference (each head's floor first,
  then the largest shares of each head's mass, up to ``H G k`` segments, none beyond the width);
* a segment search with an allocation attends, per head, its top ``count`` segments in score order,
  and its output is softmax attention over exactly what it reports;
* the token-level oracle with the pooled split is the brute-force pooled top of the heads' exact
  attention shares (float64, from dense attention), and attends ``budget`` tokens per head on average;
* a head whose attention is peaked gets fewer tokens than a diffuse one;
* every summary x selector runs with an allocation; at full budget it is dense attention;
* token refinement (``TopTokens``) attends each head's best tokens inside the shortlisted segments
  (with every segment shortlisted: the token-level oracle over the segmented tokens), composes
  with every summary, selector and allocation, and with heavy hitters counts each token once;
* per-layer budgets (``FirstLayers``) give the first layers more and the others the rest, the
  model's total unchanged, and transformers tells every layer how many layers there are.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import hf_models
from sparseattn.backends.cpu_kernels import cpu_kernel_refusal
from hf_models import prompts, tiny_model
from parts import SELECTORS, SUMMARIES, part_id
from sparseattn import (
    Centroid,
    HeavyHitters,
    LayerSpec,
    OracleTokens,
    PooledMass,
    RadarPlus,
    RadarPlusMerged,
    RadarPlusPooled,
    RadarPlusTokens,
    Rerank,
    SegmentSearch,
    SqrtSchedule,
    TopK,
    TopTokens,
    Uniform,
    attention_ref,
)
from sparseattn.allocations import listed_estimates, pooled_counts_ref
from sparseattn.methods.segment_step import SegmentStep
from sparseattn.hf import apply
from sparseattn.methods.layers import FirstLayers, SplitLayers, layer_budgets
from sparseattn.testing import assert_close


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("cap, floor", [(4.0, 0.25), (2.0, 0.0), (1.0, 1.0), (8.0, 0.5)])
def test_pooled_plan_is_the_greedy_pooled_split(seed, cap, floor):
    gen = torch.Generator().manual_seed(seed)
    B, H, G, S = 2, 3, 1 + seed % 3, 10 + seed
    k = 1 + seed % 4
    scores = torch.randn(B, H, G, S, generator=gen) * 3
    always = torch.randn(B, H, G, generator=gen) * 3
    allocation = PooledMass(cap=cap, floor=floor)
    estimates, log_total, _ = listed_estimates(scores, always, allocation.width(k, S))
    valid = allocation.plan(estimates, log_total, k)
    ref = pooled_counts_ref(scores, always, k, allocation.width(k, S), allocation.floor_count(k))
    assert torch.equal(valid.sum(-1), ref)
    # each head attends its best listed segments: every flagged estimate >= every unflagged one
    lowest_taken = estimates.masked_fill(~valid, float("inf")).amin(-1)
    highest_left = estimates.masked_fill(valid, float("-inf")).amax(-1)
    assert bool((lowest_taken >= highest_left).all())
    assert torch.equal(valid.sum((1, 2, 3)), torch.full((B,), H * G * k))


@settings(max_examples=60, deadline=None)
@given(
    shape=st.tuples(st.integers(1, 3), st.integers(1, 4), st.integers(1, 4), st.integers(1, 24)),
    k=st.integers(1, 8), cap=st.floats(1.0, 8.0), floor=st.floats(0.0, 1.0), seed=st.integers(0, 2**16),
    odd=st.sampled_from([None, float("nan"), float("inf"), float("-inf")]),
)
def test_a_pooled_plan_never_exceeds_the_layers_budget(shape, k, cap, floor, seed, odd):
    """What PooledMass's plan is marked ``within_budget`` for (the engine then does not read its counts back):
    per batch row at most ``H G k`` segments flagged, for any scores (non-finite ones included), each head at
    least its floor and at most ``width``, and it is a bool mask of the listing's shape."""
    from sparseattn.allocations.base import keeps_budget

    B, H, G, S = shape
    gen = torch.Generator().manual_seed(seed)
    allocation = PooledMass(cap=cap, floor=floor)
    w = allocation.width(k, S)
    estimates = torch.randn(B, H, G, w, generator=gen) * 4
    log_total = torch.logsumexp(estimates, -1) + torch.rand(B, H, G, generator=gen)
    if odd is not None:  # one head's scores or total not finite
        estimates[0, 0, 0, 0] = odd
        log_total[-1, -1, -1] = odd
    valid = allocation.plan(estimates, log_total, k)
    assert valid.dtype == torch.bool and tuple(valid.shape) == (B, H, G, w)
    assert bool((valid.sum((1, 2, 3)) <= H * G * k).all())
    per_head = valid.sum(-1)
    assert bool((per_head >= min(allocation.floor_count(k), w)).all()) and bool((per_head <= w).all())
    assert keeps_budget(allocation)


@settings(max_examples=60, deadline=None)
@given(
    shape=st.tuples(st.integers(1, 3), st.integers(1, 4), st.integers(1, 4), st.integers(1, 24)),
    k=st.integers(1, 8), wider=st.integers(0, 6), below=st.integers(0, 8), above=st.integers(0, 6), cap=st.floats(1.0, 8.0),
    floor=st.floats(0.0, 1.0), seed=st.integers(0, 2**16), odd=st.sampled_from([None, float("nan"), float("inf")]),
)  # fmt: skip
def test_the_fixed_shape_plan_flags_what_the_plan_flags(shape, k, wider, below, above, cap, floor, seed, odd):
    """``plan_fixed`` (a decode step of fixed shapes: ``k`` a device tensor within a phase's bounds, a phase's wider
    listing of which the first ``width(k)`` columns are the step's) flags exactly what ``plan`` flags over the
    step's own listing, and no column past it, whatever the columns past it hold."""
    B, H, G, S = shape
    gen = torch.Generator().manual_seed(seed)
    allocation = PooledMass(cap=cap, floor=floor)
    k = min(k, S)
    w = allocation.width(k, S)
    estimates = torch.randn(B, H, G, w + wider, generator=gen) * 4
    estimates[..., w:] += 10  # the columns not listed score above the listed ones: they must still not be taken
    log_total = torch.logsumexp(estimates[..., :w], -1) + torch.rand(B, H, G, generator=gen)
    if odd is not None:  # one head's estimate not finite: it ranks last, as in plan
        estimates[0, 0, 0, 0] = odd
    listed = torch.arange(w + wider) < w
    bounds = (max(1, k - below), min(k + above, w + wider))  # the phase's narrowest and widest k around this step's
    fixed = allocation.plan_fixed(estimates, log_total, torch.tensor(k), listed, bounds)
    want = allocation.plan(estimates[..., :w], log_total, k)
    assert torch.equal(fixed[..., :w], want)
    assert not fixed[..., w:].any()
    # The columns in another order per head (what a step passes: its listing unsorted, the flags scattered).
    order = torch.rand(B, H, G, w + wider, generator=gen).argsort(-1)
    scattered = allocation.plan_fixed(estimates.gather(-1, order), log_total, torch.tensor(k), order < w, bounds)
    assert torch.equal(torch.zeros_like(scattered).scatter_(-1, order, scattered)[..., :w], want)


def test_uniform_gives_every_head_its_best_k():
    estimates = torch.randn(2, 3, 4, 9)
    valid = Uniform().plan(estimates, torch.zeros(2, 3, 4), 5)
    assert torch.equal(valid.sum(-1), torch.full((2, 3, 4), 5))
    assert torch.equal(valid, estimates >= estimates.topk(5, dim=-1).values[..., -1:])
    assert bool(Uniform().plan(estimates[..., :5], torch.zeros(2, 3, 4), 5).all())


@pytest.mark.parametrize("bad, match", [(dict(cap=0.5), "PooledMass.cap"), (dict(floor=1.5), "PooledMass.floor"), (dict(floor=-0.1), "PooledMass.floor")])
def test_bad_pooled_options_are_refused_with_their_name(bad, match):
    with pytest.raises(ValueError, match=match):
        PooledMass(**bad)


def test_an_allocation_class_instead_of_an_instance_is_refused():
    with pytest.raises(ValueError, match="SegmentSearch.allocation must be an instance"):
        SegmentSearch(allocation=PooledMass)


def pooled_token_oracle_mask(q, keys, budget, scale):
    """Brute force in float64: per head the exact attention shares of every past token; the current
    token always attended; the layer's ``H (budget - 1)`` other slots to the largest shares (each head
    at least ``floor`` and at most ``cap`` times its uniform share, by the same greedy rule)."""
    B, H, G, D = q.shape
    t = keys.shape[2]
    logits = torch.einsum("bhgd,bhtd->bhgt", q.double(), keys.double()) * scale
    k = budget - 1
    counts = pooled_counts_ref(logits[..., :-1], logits[..., -1], k, min(t - 1, math.ceil(4 * k)), math.ceil(0.25 * k))
    mask = torch.zeros(B, H, G, t, dtype=torch.bool)
    mask[..., -1] = True
    order = logits[..., :-1].argsort(dim=-1, descending=True)
    for b in range(B):
        for h in range(H):
            for g in range(G):
                mask[b, h, g, order[b, h, g, : counts[b, h, g]]] = True
    return mask


@pytest.mark.parametrize("seed", range(4))
def test_pooled_token_oracle_attends_the_pooled_top_of_the_exact_attention_shares(seed):
    gen = torch.Generator().manual_seed(seed)
    B, H, G, D, T, budget = 2, 2, 3, 16, 120, 17
    # Heads of different temperature: some peaked, some diffuse.
    temperature = torch.tensor([0.3, 3.0]).view(1, H, 1, 1)
    keys, values = torch.randn(B, H, T + 1, D, generator=gen), torch.randn(B, H, T + 1, D, generator=gen)
    state = OracleTokens(budget=budget, allocation=PooledMass()).new_state(B, H, D)
    state.prefill(keys[:, :, :T], values[:, :, :T])
    q = (torch.randn(B, H, G, D, generator=gen) * temperature).reshape(B, H * G, D)
    out, info = state.step(q, keys[:, :, T], values[:, :, T])
    mask = pooled_token_oracle_mask(q.view(B, H, G, D), keys, budget, D**-0.5)
    assert torch.equal(info.to_mask(), mask.view(B, H * G, T + 1))
    assert torch.equal(info.attended, mask.sum(-1).view(B, H * G))
    assert torch.equal(info.attended.sum(-1), torch.full((B,), H * G * budget))  # the layer's total, exactly
    ref = attention_ref(q.view(B, H, G, D), keys, values, mask)
    assert_close(out, ref.view(B, H * G, D), torch.float32)


@pytest.mark.parametrize("backend", ["torch", "cpu"])
@pytest.mark.parametrize("shared", [False, True])
@pytest.mark.parametrize("seed", range(3))
def test_the_mass_a_split_is_measured_against_includes_the_sinks_and_tail_exactly(backend, shared, seed):
    """A head's share is its segments' estimate over the total, sinks and tail included: their log mass is the
    float64 logsumexp of their logits (the C kernel's normaliser over an empty selection, or torch), summed over
    the group for a shared selection."""
    if backend == "cpu" and cpu_kernel_refusal() is not None:
        pytest.skip(f"the C kernel is unavailable here: {cpu_kernel_refusal()}")
    gen = torch.Generator().manual_seed(seed)
    B, H, G, D, T = 2, 2, 3, 16, 300
    method = dataclasses.replace(RadarPlusPooled(budget=96), backend=backend, shared_kv_selection=shared)
    state = method.new_state(B, H, D)
    keys, values = torch.randn(B, H, T, D, generator=gen) * 2, torch.randn(B, H, T, D, generator=gen)
    state.prefill(keys, values)
    q = torch.randn(B, H, G, D, generator=gen) * 2
    lay = state.layout
    got = SegmentStep(state, q, lay, 1, 1 if shared else G).always_log_mass()
    always = torch.cat([keys[:, :, : lay.sink_end], keys[:, :, lay.tail_start : lay.length]], dim=2).double()
    ref = torch.logsumexp(torch.einsum("bhgd,bhtd->bhgt", q.double(), always) * state.scale, dim=-1)
    if shared:
        ref = torch.logsumexp(ref, dim=2, keepdim=True)
    assert lay.sink_end > 0 and lay.tail_start < lay.length
    torch.testing.assert_close(got.double(), ref, rtol=1e-5, atol=1e-5)


def test_a_peaked_head_gets_fewer_tokens_than_a_diffuse_one():
    gen = torch.Generator().manual_seed(0)
    D, T, budget = 16, 400, 40
    keys, values = torch.randn(1, 2, T, D, generator=gen), torch.randn(1, 2, T, D, generator=gen)
    q = torch.randn(1, 2, D, generator=gen) * 0.05  # head 1: nearly uniform attention
    q[0, 0] = keys[0, 0, 123] * 4  # head 0: all its mass on one token
    state = OracleTokens(budget=budget, allocation=PooledMass()).new_state(1, 2, D)
    state.prefill(keys[:, :, :-1], values[:, :, :-1])
    _, info = state.step(q, keys[:, :, -1], values[:, :, -1])
    peaked, diffuse = info.attended[0].tolist()
    assert peaked < budget < diffuse and peaked + diffuse == 2 * budget
    assert bool(info.to_mask()[0, 0, 123])


def steps_match_their_reported_selection(method, budget: int, steps: int, seed: int):
    """Decode ``steps`` tokens after a 150-token prompt; every step is softmax attention over exactly what it
    reports (float64 reference), its ``attended`` is the mask's size, and its heads average at most
    ``budget``. Yields each step's ``info``."""
    B, H, G, D, T = 2, 2, 2, 16, 150
    gen = torch.Generator().manual_seed(seed)
    state = method.new_state(B, H, D)
    keys, values = torch.randn(B, H, T + steps, D, generator=gen), torch.randn(B, H, T + steps, D, generator=gen)
    state.prefill(keys[:, :, :T], values[:, :, :T])
    for t in range(T, T + steps):
        q = torch.randn(B, H * G, D, generator=gen)
        out, info = state.step(q, keys[:, :, t], values[:, :, t])
        mask = info.to_mask()
        assert torch.equal(info.attended, mask.sum(-1))
        assert float(info.attended.double().mean(-1).max()) <= budget
        ref = attention_ref(q.view(B, H, G, D), keys[:, :, : t + 1], values[:, :, : t + 1], mask.view(B, H, G, t + 1))
        assert_close(out, ref.view(B, H * G, D), torch.float32)
        yield info


@pytest.mark.parametrize("selector", SELECTORS, ids=part_id)
@pytest.mark.parametrize("summary", SUMMARIES, ids=part_id)
def test_every_summary_and_selector_composes_with_an_allocation(summary, selector):
    method = SegmentSearch(summary, selector, SqrtSchedule(aspect=2.0), sinks=2, budget=40, allocation=PooledMass(cap=3.0))
    for info in steps_match_their_reported_selection(method, 40, steps=5, seed=1):
        # Each head attends some of its listed segments: at least its floor (ceil(0.25 k) >= 1).
        valid = info.valid
        assert valid is not None and valid.shape == info.segments.shape and bool(valid.any(-1).all())


@pytest.mark.parametrize("shared", [False, True])
def test_full_budget_with_an_allocation_is_dense_attention(shared):
    B, H, G, D, T = 1, 2, 3, 8, 60
    state = OracleTokens(budget=10**6, shared_kv_selection=shared, allocation=PooledMass()).new_state(B, H, D)
    keys, values = torch.randn(B, H, T, D), torch.randn(B, H, T, D)
    state.prefill(keys[:, :, :-1], values[:, :, :-1])
    q = torch.randn(B, H * G, D)
    out, info = state.step(q, keys[:, :, -1], values[:, :, -1])
    assert_close(out, attention_ref(q.view(B, H, G, D), keys, values).view(B, H * G, D), torch.float32)
    assert torch.equal(info.attended, torch.full((B, H * G), T))


def test_shared_selection_and_always_parts_compose_with_an_allocation():
    B, H, G, D, T = 2, 3, 3, 16, 300
    base = OracleTokens(budget=48, allocation=PooledMass())
    for method in (dataclasses.replace(base, shared_kv_selection=True), dataclasses.replace(base, always=HeavyHitters(8))):
        state = method.new_state(B, H, D)
        state.append(torch.randn(B, H, T, D), torch.randn(B, H, T, D))
        state.attend_block(torch.randn(B, H * G, T, D))
        out, info = state.step(torch.randn(B, H * G, D), torch.randn(B, H, D), torch.randn(B, H, D))
        assert torch.isfinite(out).all()
        assert torch.equal(info.attended, info.to_mask().sum(-1))
        assert float(info.attended.double().mean(-1).max()) <= 48


# -- per-layer budgets ------------------------------------------------------------------------------


@pytest.mark.parametrize("n_layers, layers, factor, budget", [(30, 1, 4.0, 512), (2, 1, 1.5, 40), (12, 3, 2.0, 100), (5, 0, 3.0, 64)])
def test_first_layers_get_factor_times_the_budget_and_the_total_is_honoured(n_layers, layers, factor, budget):
    method = FirstLayers(RadarPlus(budget=budget), layers=layers, factor=factor)
    budgets = layer_budgets(method, n_layers)
    assert budgets[:layers] == [round(factor * budget)] * layers  # room enough here: the other layers keep >= half
    assert len(set(budgets[layers:])) == 1 and budgets[-1] <= budget
    assert sum(budgets) <= n_layers * budget < sum(budgets) + n_layers  # nothing lost beyond rounding
    state = method.new_state(LayerSpec(1, 2, 8, layer_idx=n_layers - 1, n_layers=n_layers))
    assert state.method.budget == budgets[-1]


def test_first_layers_without_the_number_of_layers_is_one_layer_with_the_whole_budget():
    assert FirstLayers(RadarPlus(budget=64)).new_state(1, 2, 8).method.budget == 64
    assert layer_budgets(FirstLayers(RadarPlus(budget=64), layers=3), 2) == [64, 64]  # no other layer


def test_in_a_shallow_model_the_other_layers_keep_half_the_budget():
    assert layer_budgets(FirstLayers(RadarPlus(budget=48), factor=4.0), 2) == [72, 24]


@pytest.mark.parametrize(
    "build, match",
    [
        (lambda: FirstLayers(RadarPlus), "FirstLayers.method must be a method instance with a budget field"),
        (lambda: FirstLayers(RadarPlus(budget=8), factor=0.5), "FirstLayers.factor"),
        (lambda: FirstLayers(RadarPlus(budget=8), layers=-1), "FirstLayers.layers"),
    ],
)
def test_bad_layer_splits_are_refused_before_any_state(build, match):
    with pytest.raises(ValueError, match=match):
        build()


def test_transformers_tells_each_layer_how_many_layers_there_are():
    model = tiny_model("llama")  # 2 layers
    ids = prompts(1, [120])[0]
    method = FirstLayers(OracleTokens(budget=20), layers=1, factor=1.5)
    with apply(model, method) as sparse:
        cache = sparse.new_cache()
        hf_models.greedy(model, ids, torch.ones_like(ids), cache, 4)
    assert [layer.state.method.budget for layer in cache.sparse_layers] == [30, 10]
    assert cache.mean_attended() == pytest.approx(20)


def test_split_layers_runs_the_first_method_in_the_first_layers_and_the_other_after():
    model = tiny_model("llama")  # 2 layers
    ids = prompts(1, [120])[0]
    method = SplitLayers(RadarPlusMerged(budget=40, merge=0), RadarPlus(budget=40), layers=1)
    with apply(model, method) as sparse:
        cache = sparse.new_cache()
        hf_models.greedy(model, ids, torch.ones_like(ids), cache, 4)
    assert [layer.state.method for layer in cache.sparse_layers] == [method.first, method.others]
    assert method.budget == 40 and method.method_of(0) is method.first and method.method_of(7) is method.others
    assert SplitLayers(method.first, method.others, layers=0).new_state(1, 2, 8).method == method.others


def test_first_layers_over_split_layers_gives_each_layers_own_method_its_budget():
    """``FirstLayers(SplitLayers(a, b))``: layer 0 runs ``a`` with ``factor`` times the budget, the later layers run
    ``b`` with what is left, and the model's total is the budget per layer."""
    model = tiny_model("llama")  # 2 layers
    ids = prompts(1, [120])[0]
    split = SplitLayers(RadarPlus(budget=60), RadarPlusMerged(budget=60, merge=0), layers=1)
    method = FirstLayers(split, layers=1, factor=1.5)
    with apply(model, method) as sparse:
        cache = sparse.new_cache()
        hf_models.greedy(model, ids, torch.ones_like(ids), cache, 4)
    first, later = (layer.state.method for layer in cache.sparse_layers)
    assert first == dataclasses.replace(split.first, budget=90) and later == dataclasses.replace(split.others, budget=30)
    assert layer_budgets(method, 2) == [90, 30]


@pytest.mark.parametrize(
    "build, match",
    [
        (lambda: SplitLayers(RadarPlus, RadarPlus(budget=8)), "SplitLayers.first must be a method instance"),
        (lambda: SplitLayers(RadarPlus(budget=8), "radar+"), "SplitLayers.others must be a method instance"),
        (lambda: SplitLayers(RadarPlus(budget=8), RadarPlus(budget=16)), "budget 8 and SplitLayers.others budget 16"),
        (lambda: SplitLayers(RadarPlus(budget=8), RadarPlus(budget=8), layers=-1), "SplitLayers.layers"),
    ],
)
def test_bad_split_layers_are_refused_before_any_state(build, match):
    with pytest.raises(ValueError, match=match):
        build()


@settings(max_examples=60, deadline=None)
@given(
    heads=st.integers(1, 4),
    group=st.integers(1, 3),
    n_segments=st.integers(2, 40),
    k=st.integers(1, 8),
    cap=st.floats(1.0, 6.0),
    floor=st.floats(0.0, 1.0),
    seed=st.integers(0, 2**31 - 1),
)
def test_the_pooled_split_attends_at_least_the_uniform_splits_share_of_attention(heads, group, n_segments, k, cap, floor, seed):
    """With exact scores, the summed share of each head's attention mass that its segments hold is at
    least the uniform split's: the uniform split obeys the floor and the cap, and taking the largest
    shares first maximises a sum of each head's best shares (each head's sorted shares are concave)."""
    k = min(k, n_segments)
    gen = torch.Generator().manual_seed(seed)
    scores = torch.randn(1, heads, group, n_segments, generator=gen, dtype=torch.float64) * 4
    always = torch.randn(1, heads, group, generator=gen, dtype=torch.float64) * 4
    shares = (scores - torch.logaddexp(scores.logsumexp(-1), always)[..., None]).exp().sort(-1, descending=True).values
    allocation = PooledMass(cap=cap, floor=floor)
    counts = allocation.plan(*listed_estimates(scores, always, allocation.width(k, n_segments))[:2], k).sum(-1)
    taken = (shares * (torch.arange(n_segments) < counts[..., None])).sum()
    uniform = shares[..., :k].sum()
    assert float(taken) >= float(uniform) - 1e-5


# -- token refinement -------------------------------------------------------------------------------


def refined_mask_ref(q, keys, lay, n):
    """Brute force: sinks and tail, plus each head's ``n`` segmentable tokens with the highest exact logits."""
    B, H, G, D = q.shape
    t = keys.shape[2]
    logits = torch.einsum("bhgd,bhtd->bhgt", q.double(), keys.double())
    pos = torch.arange(t)
    fixed = (pos < lay.sink_end) | (pos >= lay.tail_start)
    ranked = logits.masked_fill(fixed | (pos >= lay.segment_end), float("-inf"))
    mask = fixed.expand(B, H, G, t).clone()
    mask.scatter_(-1, ranked.topk(n, dim=-1).indices, True)
    return mask


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("shared", [True, False])
def test_refinement_over_every_segment_attends_each_heads_top_tokens(seed, shared):
    """With a shortlist covering every segment, a refined step is the token-level oracle over the
    segmented tokens: each head's best ``budget - sinks - tail`` tokens, plus sinks and tail."""
    gen = torch.Generator().manual_seed(seed)
    B, H, G, D, T, budget = 2, 2, 3, 16, 150, 30
    method = SegmentSearch(
        Centroid(), TopK(), SqrtSchedule(aspect=2.0), sinks=3, budget=budget, shared_kv_selection=shared, refine=TopTokens(factor=1000.0)
    )
    keys, values = torch.randn(B, H, T + 1, D, generator=gen), torch.randn(B, H, T + 1, D, generator=gen)
    state = method.new_state(B, H, D)
    state.prefill(keys[:, :, :T], values[:, :, :T])
    q = torch.randn(B, H * G, D, generator=gen)
    out, info = state.step(q, keys[:, :, T], values[:, :, T])
    lay = info.layout
    mask = refined_mask_ref(q.view(B, H, G, D), keys, lay, budget - lay.sink_end - lay.tail_size)
    assert torch.equal(info.to_mask(), mask.view(B, H * G, T + 1))
    assert torch.equal(info.attended, torch.full((B, H * G), budget))
    assert_close(out, attention_ref(q.view(B, H, G, D), keys, values, mask).view(B, H * G, D), torch.float32)


@pytest.mark.parametrize("allocation", [Uniform(), PooledMass(cap=3.0)], ids=part_id)
@pytest.mark.parametrize("selector", SELECTORS, ids=part_id)
@pytest.mark.parametrize("summary", SUMMARIES, ids=part_id)
def test_every_summary_selector_and_allocation_composes_with_refinement(summary, selector, allocation):
    method = SegmentSearch(summary, selector, SqrtSchedule(aspect=2.0), sinks=2, budget=40, allocation=allocation, refine=TopTokens())
    for info in steps_match_their_reported_selection(method, 40, steps=4, seed=2):
        if allocation.uniform:
            assert int(info.attended.max()) <= 40


def test_refinement_with_heavy_hitters_attends_each_token_once_within_the_budget():
    B, H, G, D, T = 1, 2, 3, 16, 300
    method = dataclasses.replace(RadarPlusTokens(budget=64), always=HeavyHitters(8))
    state = method.new_state(B, H, D)
    state.append(torch.randn(B, H, T, D), torch.randn(B, H, T, D))
    state.attend_block(torch.randn(B, H * G, T, D))
    for _ in range(3):
        out, info = state.step(torch.randn(B, H * G, D), torch.randn(B, H, D), torch.randn(B, H, D))
        assert torch.isfinite(out).all() and torch.equal(info.attended, info.to_mask().sum(-1))
        assert int(info.attended.max()) <= 64


def test_a_refine_part_must_be_a_top_tokens_instance():
    with pytest.raises(ValueError, match="SegmentSearch.refine must be None or a TopTokens instance"):
        SegmentSearch(refine=TopTokens)
    with pytest.raises(ValueError, match="TopTokens.factor"):
        TopTokens(factor=0.5)


# -- reading the best segments off a shortlist -----------------------------------------------------


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("per_group", [True, False])
@pytest.mark.parametrize("shared", [False, True])
@pytest.mark.parametrize("n", [1, 5, 12, 30])
def test_the_best_segments_read_off_a_shortlist_are_the_best_of_all_scores(seed, per_group, shared, n):
    """A rerank ranks its shortlist above every other segment, so its top n (n <= shortlist) are the
    top n of all S scores; past the shortlist the state falls back to a top-n over all of them."""
    gen = torch.Generator().manual_seed(seed)
    B, H, G, D, T = 2, 2, 3, 16, 700
    method = SegmentSearch(
        Rerank(Centroid(), shortlist=4, factor=2.0, per_group=per_group), TopK(), SqrtSchedule(aspect=4.0),
        top_k=6, shared_kv_selection=shared,
    )  # shortlist max(4, 2 x 6) = 12 segments
    state = method.new_state(B, H, D)
    state.append(torch.randn(B, H, T, D, generator=gen), torch.randn(B, H, T, D, generator=gen))
    q = torch.randn(B, H, G, D, generator=gen)
    S = state.layout.n_segments
    assert S > 30
    scores, values, segments = state.best_segments(q, 6, n, sorted=True)
    full = state.group_scores(q, 6) if shared else state.scores(q, 6)
    torch.testing.assert_close(scores, full)
    expected = full.topk(n, dim=-1, sorted=True)
    torch.testing.assert_close(values, expected.values)
    assert torch.equal(segments.sort(-1).values, expected.indices.sort(-1).values)
    assert torch.equal(full.gather(-1, segments), values)  # the listed values are those segments' scores


class GreedyEverything(PooledMass):
    """A third-party allocation whose plan flags every listed segment."""

    def plan(self, estimates, log_total, k):
        return torch.ones(estimates.shape, dtype=torch.bool)


class CountsNotMask(PooledMass):
    def plan(self, estimates, log_total, k):
        return super().plan(estimates, log_total, k).sum(-1)


@pytest.mark.parametrize("allocation, match", [(GreedyEverything(cap=2.0), "flagged more than the layer's"), (CountsNotMask(cap=2.0), "expected bool")])
def test_a_plan_beyond_the_layers_total_or_not_a_mask_is_refused(allocation, match):
    state = SegmentSearch(Centroid(), TopK(), SqrtSchedule(aspect=2.0), budget=40, allocation=allocation).new_state(1, 2, 8)
    state.append(torch.randn(1, 2, 300, 8), torch.randn(1, 2, 300, 8))
    with pytest.raises(ValueError, match=match):
        state.attend(torch.randn(1, 4, 8))
