"""The rest of a step estimated from a uniform sample (``SampledRest``, vAttention's idea), with an error bound.

Statements checked (the module docstring of ``sparseattn.methods.sampled_rest`` derives them):

* the ``r``-th token a head leaves out is found from the attended positions alone (hypothesis);
* the sample's scaled sums estimate the rest's denominator and numerator without bias: over many
  independent draws their mean is the exact float64 sums, within the draws' own standard error;
* when a head's rest fits in the sample it is attended whole, once per token, and the output is dense
  attention with bound 0; with nothing left out it is attention over the attended set;
* the reported bound covers the error against dense attention in at least ``1 - delta`` of random
  trials (a one-sided binomial test, false-alarm rate stated);
* both attend hooks (the backend's log-sum-exp op over whole segments, the torch gather path over
  listed tokens) give the float64 reference's output and bound for the same draws;
* the draws count against the budget, the options are refused with their names, and radar+ with
  ``rest="sampled"`` decodes end to end.
"""

from __future__ import annotations

import dataclasses
import math
from statistics import NormalDist

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from sparseattn import (
    ExactScore,
    FixedSchedule,
    HeavyHitters,
    RadarPlus,
    SampledRest,
    SegmentSearch,
    SegmentStep,
    Selection,
    TopK,
    attention_ref,
    registry,
)
from sparseattn.backends.cpu_kernels import cpu_kernel_refusal
from sparseattn.methods.base import LayerSpec
from sparseattn.methods.sampled_rest import (
    RestComplement,
    rest_of_segments,
    rest_of_tokens,
    sample_ranks,
    sample_state,
    sampled_attention_ref,
)
from sparseattn.ops.attention import segment_attention_lse_ref, segment_mask
from sparseattn.ops.layout import SegmentLayout
from sparseattn.testing import assert_close

CPU_KERNEL = cpu_kernel_refusal()  # None when the C kernel built and loaded here
F64 = torch.float64


class ReferenceLSE:
    """A backend with ``segment_attention_lse`` only, the float64 reference: the segments hook in float64."""

    segment_attention_lse = staticmethod(segment_attention_lse_ref)


def binomial_critical(n: int, p: float, false_alarm: float) -> int:
    """The smallest ``k`` with ``P(Binomial(n, p) > k) <= false_alarm``."""
    tail, k = 1.0, -1
    while tail > false_alarm:
        k += 1
        tail -= math.comb(n, k) * p**k * (1 - p) ** (n - k)
    return k


def decoded_state(method, B, H, D, T, seed, dtype=torch.float32, layer_idx=0, softcap=None, spread=1.0):
    """A state of ``method`` after a prefill of ``T`` random tokens, and ``T + 1`` tokens' keys and values."""
    gen = torch.Generator().manual_seed(seed)
    keys = torch.randn(B, H, T + 1, D, generator=gen, dtype=F64).to(dtype) * spread
    values = torch.randn(B, H, T + 1, D, generator=gen, dtype=F64).to(dtype)
    state = method.new_state(LayerSpec(B, H, D, layer_idx=layer_idx, dtype=dtype, softcap=softcap))
    state.prefill(keys[:, :, :T], values[:, :, :T])
    return state, keys, values, gen


def reference_of(rest, info, q, keys, values, layer_idx, scale, softcap=None):
    """The reference's ``(out, bound)`` for a step's report: the same draws, regenerated from the rest's generator."""
    lay = info.layout
    B, H = keys.shape[:2]
    G = q.shape[1] // H
    mask = info.to_mask().view(B, H, G, lay.length)
    start, end = lay.sink_end, lay.tail_start
    n_rest = (~mask[..., start:end]).sum(-1)
    draws = sample_ranks(n_rest, rest.samples, rest.generator(layer_idx, lay.length))
    return sampled_attention_ref(q.view(B, H, G, -1), keys, values, mask, start, end, draws, scale, softcap, rest.delta)


@settings(max_examples=100, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), start=st.integers(0, 5), width=st.integers(1, 60), share=st.floats(0.0, 1.0), m=st.integers(1, 20))
def test_the_rth_left_out_token_is_found_from_the_attended_positions(seed, start, width, share, m):
    gen = torch.Generator().manual_seed(seed)
    B, H, G = 2, 2, 3
    end = start + width
    attended = torch.rand(B, H, G, end + 3, generator=gen) < share
    pos = torch.arange(end + 3).expand(B, H, G, -1)
    listed = torch.where(attended & (pos >= start) & (pos < end), pos, 2**62).sort(-1).values
    rest = RestComplement.from_sorted(listed, start, end)
    left = [[[[p for p in range(start, end) if not attended[b, h, g, p]] for g in range(G)] for h in range(H)] for b in range(B)]
    assert rest.n_rest.tolist() == [[[len(x) for x in row] for row in head] for head in left]
    n = rest.n_rest.clamp(min=1).unsqueeze(-1)
    ranks = (torch.rand(B, H, G, m, generator=gen, dtype=F64) * n).long()
    got = rest.positions(ranks)
    for b, h, g in ((b, h, g) for b in range(B) for h in range(H) for g in range(G)):
        if left[b][h][g]:
            assert got[b, h, g].tolist() == [left[b][h][g][r] for r in ranks[b, h, g].tolist()]


def _random_selection(gen, B, H, G, S, w, masked):
    segments = torch.stack([torch.randperm(S, generator=gen)[:w] for _ in range(B * H * G)]).view(B, H, G, w)
    valid = (torch.rand(B, H, G, w, generator=gen) < 0.6) if masked else None
    return segments, valid


@pytest.mark.parametrize("masked", [False, True], ids=["whole", "valid-masked"])
def test_the_sample_estimates_the_rest_without_bias(masked):
    """Horvitz-Thompson: ``E[(n/m) sum_i exp(l_i)] = Z_R`` and ``E[(n/m) sum_i exp(l_i) v_i] = N_R``. Many
    independent draws (rows of one call, over several seeds) average to the exact float64 sums within
    ``z`` of their empirical standard errors, ``z`` the normal quantile at a false-alarm rate of 1e-3
    split (Bonferroni) over every compared number."""
    gen = torch.Generator().manual_seed(7)
    H, G, D, c, S, sinks, window, m = 2, 2, 5, 3, 12, 2, 4, 6
    lay = SegmentLayout(length=sinks + S * c + window, sinks=sinks, segment_size=c, n_segments=S, window=window)
    keys, values = torch.randn(1, H, lay.length, D, generator=gen, dtype=F64), torch.randn(1, H, lay.length, D, generator=gen, dtype=F64)
    q = torch.randn(1, H, G, D, generator=gen, dtype=F64)
    segments, valid = _random_selection(gen, 1, H, G, S, 4, masked)
    scale = D**-0.5
    rest = rest_of_segments(lay, segments, valid)
    mask = segment_mask(lay, segments, G, valid)  # [1, H, G, t]
    logits = torch.einsum("bhgd,bhtd->bhgt", q, keys) * scale
    left = ~mask & (torch.arange(lay.length) >= lay.sink_end) & (torch.arange(lay.length) < lay.tail_start)
    weight = torch.exp(logits).masked_fill(~left, 0.0)
    exact_z, exact_n = weight.sum(-1), torch.einsum("bhgt,bhtd->bhgd", weight, values)
    assert bool((rest.n_rest > m).all())  # the estimate is a sample, not the whole rest
    rows, z_hat, n_hat = 500, [], []
    for seed in range(8):
        draws = sample_ranks(rest.n_rest.expand(rows, H, G), m, torch.Generator().manual_seed(seed))
        positions = RestComplement(rest.gaps.expand(rows, H, G, -1), rest.n_rest, rest.start).positions(draws.ranks)
        big = (x.expand(rows, *x.shape[1:]) for x in (q, keys, values))
        part = sample_state(*big, positions, draws, scale)
        z_hat.append(part.lse.exp())
        n_hat.append(part.lse.exp().unsqueeze(-1) * part.out)
    for estimates, exact in ((torch.cat(z_hat), exact_z[0]), (torch.cat(n_hat), exact_n[0])):
        trials = estimates.shape[0]
        stderr = estimates.std(0) / math.sqrt(trials)
        z = NormalDist().inv_cdf(1 - 1e-3 / (2 * exact.numel() * 2))
        assert bool(((estimates.mean(0) - exact).abs() <= z * stderr).all()), ((estimates.mean(0) - exact) / stderr).abs().max()


def _step(state, q):
    """A :class:`SegmentStep` of ``state`` at its current layout, every selection per query head."""
    B, H, G = state.batch, state.kv_heads, q.shape[1] // state.kv_heads
    return SegmentStep(state, q.view(B, H, G, -1), state.layout, state.layout.n_segments, G)


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), T=st.integers(12, 60), c=st.integers(1, 5), k=st.integers(1, 4), softcap=st.sampled_from([None, 4.0]))
def test_a_rest_that_fits_in_the_sample_is_attended_whole_and_the_output_is_dense(seed, T, c, k, softcap):
    """``samples >= n``: the draws are the rest's tokens, each once with weight 1, so the output is dense
    attention (float64) and the bound 0, on both paths of the state (the gather path in float64, the C
    kernel's log-sum-exp in float32 where it built)."""
    rest = SampledRest(samples=T)  # more than any rest here holds
    method = SegmentSearch(ExactScore(), TopK(), FixedSchedule(c), top_k=k, sinks=1, window=2, rest=rest)
    backends = [("torch", F64)] + ([("cpu", torch.float32)] if CPU_KERNEL is None else [])
    for backend, dtype in backends:
        state, keys, values, gen = decoded_state(dataclasses.replace(method, backend=backend), 2, 2, 8, T, seed, dtype, softcap=softcap)
        q = torch.randn(2, 6, 8, generator=gen, dtype=F64).to(dtype)
        out, info = state.step(q, keys[:, :, T], values[:, :, T])
        dense = attention_ref(q.view(2, 2, 3, 8), keys, values, softcap=softcap).view(2, 6, 8)
        assert_close(out, dense.to(dtype), dtype)
        if info.rest_bound is not None:  # None: the budget bought every segment, no rest to join
            assert bool((info.rest_bound == 0).all())


@pytest.mark.parametrize("path", ["tokens", "segments"])
def test_with_nothing_left_out_the_output_is_attention_over_the_attended_set(path):
    """A selection of every segment leaves no token out: no draw is used, the output is attention over the
    attended set (here every token) and the bound 0."""
    B, H, G, D, T = 2, 2, 3, 8, 40
    method = SegmentSearch(ExactScore(), TopK(), FixedSchedule(4), top_k=2, sinks=1, window=3, rest=SampledRest(5))
    state, keys, values, gen = decoded_state(method, B, H, D, T, 0, F64)
    state.append(keys[:, :, T:], values[:, :, T:])
    q = torch.randn(B, H * G, D, generator=gen, dtype=F64)
    step, lay = _step(state, q), state.layout
    selection = Selection(torch.arange(lay.n_segments).expand(B, H, G, -1))
    if path == "tokens":
        out, probs = method.rest.attend_tokens(step, *selection.listing(lay))
        assert_close(probs.sum(-1), torch.ones(B, H, G, dtype=F64), F64, what="listed weights")
    else:
        out = method.rest.attend_segments(step, selection, ReferenceLSE(), False)
    assert_close(out, attention_ref(q.view(B, H, G, D), keys, values), F64)
    assert bool((step.rest_bound == 0).all())


def test_the_bound_covers_the_error_in_at_least_1_minus_delta_of_random_trials():
    """``|o^ - o| <= bound`` per head, against dense float64 attention, over random prompts and draws. Under
    the statement a head fails with probability at most ``delta``: the failures are at most the
    binomial's critical value at a false-alarm rate of 1e-4. Keys at two spreads (the rest's weights
    from mild to skewed); every head's rest is larger than the sample (the bound is not trivially 0)."""
    delta, samples, heads, failures = 0.1, 16, 0, 0
    B, H, G, D, T = 4, 2, 2, 16, 600
    for trial in range(24):
        rest = SampledRest(samples=samples, delta=delta, seed=trial)
        method = dataclasses.replace(RadarPlus(budget=128), rest=rest, backend="torch")
        state, keys, values, gen = decoded_state(method, B, H, D, T, 1000 + trial, F64, spread=(1.0, 1.7)[trial % 2])
        q = torch.randn(B, H * G, D, generator=gen, dtype=F64)
        out, info = state.step(q, keys[:, :, T], values[:, :, T])
        dense = attention_ref(q.view(B, H, G, D), keys, values).view(B, H * G, D)
        bound = info.rest_bound.reshape(B, H * G)
        assert bool(torch.isfinite(bound).all()) and bool((bound > 0).all())
        failures += int(((out - dense).norm(dim=-1) > bound).sum())
        heads += B * H * G
    allowed = binomial_critical(heads, delta, 1e-4)
    assert failures <= allowed, f"{failures} of {heads} heads outside the bound; at most {allowed} expected at delta={delta}"


METHODS = {
    "radar+": RadarPlus(budget=96),
    "shared": dataclasses.replace(RadarPlus(budget=96), shared_kv_selection=True),
    "pooled": RadarPlus(budget=96, split="pooled"),
    "heavy-hitters": dataclasses.replace(RadarPlus(budget=96), always=HeavyHitters(6)),
}


@pytest.mark.parametrize("softcap", [None, 5.0])
@pytest.mark.parametrize("name", list(METHODS))
@pytest.mark.parametrize("backend,dtype", [("torch", F64), ("torch", torch.float32), ("cpu", torch.float32)])
def test_both_paths_of_a_step_are_the_float64_reference_for_the_same_draws(name, backend, dtype, softcap):
    """The state's step (the C kernel's log-sum-exp and the sample for whole segments; the gather path for
    per-head masks it has no kernel for, heavy hitters and float64) against ``sampled_attention_ref`` over
    the step's reported mask, the draws regenerated from the rest's generator: the output and the bound."""
    if backend == "cpu" and CPU_KERNEL is not None:
        pytest.skip(f"the C kernel is unavailable here: {CPU_KERNEL}")
    rest = SampledRest(samples=8, delta=0.2, seed=3)
    method = dataclasses.replace(METHODS[name], rest=rest, backend=backend)
    B, H, G, D, T, layer = 2, 2, 3, 16, 500, 5
    state, keys, values, gen = decoded_state(method, B, H, D, T, 11, dtype, layer_idx=layer, softcap=softcap)
    for t in range(T, T + 2):
        q = torch.randn(B, H * G, D, generator=gen, dtype=F64).to(dtype)
        out, info = state.step(q, keys[:, :, t], values[:, :, t]) if t == T else state.step(q, *_more(state, gen, dtype))
        kv = state.keys, state.values
        ref, bound = reference_of(rest, info, q, *kv, layer, state.scale, softcap)
        assert_close(out, ref.view(B, H * G, D).to(dtype), dtype)
        assert_close(info.rest_bound, bound.to(dtype), dtype, what="bound")
        assert info.n_merged == rest.samples


def _more(state, gen, dtype):
    B, H, D = state.batch, state.kv_heads, state.head_dim
    return torch.randn(B, H, D, generator=gen, dtype=F64).to(dtype), torch.randn(B, H, D, generator=gen, dtype=F64).to(dtype)


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), window=st.integers(0, 9), masked=st.booleans(), shared=st.booleans(), m=st.integers(1, 12))
def test_both_hooks_agree_with_the_reference_when_called_on_any_layout(seed, window, masked, shared, m):
    """The hooks called directly (float64; the window may reach into segments, whose tokens there the tail
    attends): ``attend_segments`` with a reference log-sum-exp backend and ``attend_tokens`` over the same
    selection's listing draw the same tokens and give the reference's output and bound."""
    B, H, G, D, c, S, sinks = 2, 2, 3, 8, 3, 14, 2
    rest = SampledRest(samples=m, delta=0.1, seed=seed % 1000)
    method = SegmentSearch(ExactScore(), TopK(), FixedSchedule(c), top_k=2, sinks=sinks, rest=rest)
    state, keys, values, gen = decoded_state(method, B, H, D, sinks + S * c + 1, seed, F64)
    state.append(keys[:, :, -1:], values[:, :, -1:])
    lay = SegmentLayout(length=state.length, sinks=sinks, segment_size=c, n_segments=S, window=window)
    q = torch.randn(B, H, G, D, generator=gen, dtype=F64)
    segments, valid = _random_selection(gen, B, H, 1 if shared else G, S, 5, masked)
    selection = Selection(segments, valid)
    mask = segment_mask(lay, segments, G, valid)
    n_rest = (~mask[..., lay.sink_end : lay.tail_start]).sum(-1)
    draws = sample_ranks(n_rest, m, rest.generator(0, lay.length))
    ref, bound = sampled_attention_ref(q, keys, values, mask, lay.sink_end, lay.tail_start, draws, state.scale, None, rest.delta)
    for hook in ("segments", "tokens"):
        step = SegmentStep(state, q, lay, 2, G)
        if hook == "segments":
            out = rest.attend_segments(step, selection, ReferenceLSE(), False)
        else:
            out, _ = rest.attend_tokens(step, *selection.listing(lay))
        assert_close(out, ref, F64, what=f"{hook} output")
        finite = torch.isfinite(bound)
        assert torch.equal(torch.isfinite(step.rest_bound), finite)
        assert_close(step.rest_bound[finite], bound[finite], F64, what=f"{hook} bound")


def test_the_two_complements_are_the_same_set():
    """``rest_of_segments`` (from whole segments) and ``rest_of_tokens`` (from their listing) describe the same
    left-out tokens: the same counts and the same position for every rank."""
    gen = torch.Generator().manual_seed(0)
    B, H, G, c, S = 2, 3, 2, 4, 10
    lay = SegmentLayout(length=2 + S * c + 3, sinks=2, segment_size=c, n_segments=S, window=6)
    segments, valid = _random_selection(gen, B, H, G, S, 4, True)
    a, b = rest_of_segments(lay, segments, valid), rest_of_tokens(lay, *Selection(segments, valid).listing(lay)[:2])
    assert torch.equal(a.n_rest, b.n_rest.expand_as(a.n_rest))
    ranks = (torch.rand(B, H, G, 9, generator=gen, dtype=F64) * a.n_rest.unsqueeze(-1)).long()
    assert torch.equal(a.positions(ranks), b.positions(ranks))


# -- the budget, the options, the engines ------------------------------------------------------------------


@pytest.mark.parametrize("split", ["uniform", "pooled"])
def test_the_draws_count_against_the_budget(split):
    """Each of the ``samples`` draws is one attended token: ``attended = to_mask() + samples <= budget`` (on
    average over a layer's heads under a pooled split), and the selection shrinks by ``samples``."""
    budget, samples = 256, 32
    method = RadarPlus(budget=budget, rest="sampled", samples=samples, split=split)
    plain = RadarPlus(budget=budget, split=split)
    state, keys, values, gen = decoded_state(method, 2, 2, 16, 3000, 0)
    lay = state.layout
    assert method.merged_tokens(lay) == samples
    room = budget - lay.sink_end - lay.tail_size
    assert plain.segments_for(lay) == room // lay.segment_size
    assert method.segments_for(lay) == (room - samples) // lay.segment_size
    for t in range(3):
        out, info = state.step(torch.randn(2, 6, 16, generator=gen), *_more(state, gen, torch.float32))
        assert torch.equal(info.attended, info.to_mask().sum(-1) + samples)
        assert float(info.attended.double().mean(-1).max()) <= budget
        if split == "uniform":
            assert int(info.attended.max()) <= budget


def test_the_state_keeps_no_sums_for_a_sampled_rest():
    state, *_ = decoded_state(RadarPlus(budget=128, rest="sampled"), 1, 2, 8, 400, 0)
    assert "rest_sums" not in state.nbytes()
    merged, *_ = decoded_state(RadarPlus(budget=128, rest="merged"), 1, 2, 8, 400, 0)
    assert merged.nbytes()["rest_sums"] > 0


@pytest.mark.parametrize(
    "spec,words",
    [
        ("radar+:rest=sampled,samples=0", ["samples", "0", "[1, "]),
        ("radar+:rest=sampled,delta=0.0", ["delta", "0.0", "(0, 1)"]),
        ("radar+:rest=sampled,delta=1.5", ["delta", "1.5", "(0, 1)"]),
        ("radar+:rest=merged,samples=8", ["samples=8", "rest='sampled'", "'merged'"]),
        ("radar+:delta=0.1", ["delta=0.1", "rest='sampled'", "'dropped'"]),
        ("radar+:rest=sampled,merge=8", ["merge=8", "rest='merged'", "'sampled'"]),
        ("radar+:rest=kept", ["rest", "'kept'", "dropped, merged, sampled"]),
    ],
)
def test_bad_sampled_rest_options_are_refused_naming_the_option_the_value_and_what_is_allowed(spec, words):
    with pytest.raises(ValueError) as caught:
        registry.parse(spec)
    assert all(w in str(caught.value) for w in words), str(caught.value)


@pytest.mark.parametrize(
    "field,value,words",
    [("samples", 0, ">= 1"), ("samples", 2.5, ">= 1"), ("samples", True, ">= 1"), ("delta", 1.0, "(0, 1)"),
     ("delta", float("nan"), "(0, 1)"), ("delta", -0.1, "(0, 1)"), ("seed", -1, ">= 0")],
)  # fmt: skip
def test_the_part_refuses_bad_fields_with_their_names(field, value, words):
    with pytest.raises(ValueError, match=f"SampledRest.{field}") as caught:
        SampledRest(**{field: value})
    assert words in str(caught.value) and repr(value) in str(caught.value)


def test_the_sampled_rest_is_an_option_of_radar_plus_listed_with_the_others():
    entry = registry.get("radar+")
    assert entry.option("rest").allowed == ("dropped", "merged", "sampled")
    assert entry.option("samples").default is None and entry.option("delta").default is None
    assert registry.build("radar+", budget=256, rest="sampled").rest == SampledRest(32, 0.05)
    layered = registry.build("radar+", budget=256, rest="sampled", samples=8, delta=0.2, plain_layers=1)
    assert layered.first.rest is None and layered.others.rest == SampledRest(8, 0.2)


def test_vllm_refuses_the_sampled_rest_by_name():
    from sparseattn.vllm.paged import PagedPolicy

    with pytest.raises(ValueError, match="SampledRest.*transformers engine"):
        PagedPolicy(RadarPlus(budget=256, rest="sampled"), "radar+:rest=sampled")


# -- end to end ----------------------------------------------------------------------------------------------


def test_radar_plus_with_a_sampled_rest_decodes_reproducibly_with_finite_outputs_and_a_bound():
    method = registry.build("radar+", budget=256, rest="sampled", samples=32)
    B, H, G, D, T = 1, 2, 4, 32, 1200

    def run(m):
        state, keys, values, gen = decoded_state(m, B, H, D, T, 5, layer_idx=2)
        outs, bounds = [], []
        for _ in range(4):
            out, info = state.step(torch.randn(B, H * G, D, generator=gen), *_more(state, gen, torch.float32))
            outs.append(out)
            bounds.append(info.rest_bound)
        return torch.stack(outs), torch.stack(bounds)

    outs, bounds = run(method)
    assert bool(torch.isfinite(outs).all())
    assert bounds.shape == (4, B, H, G) and bool(torch.isfinite(bounds).all()) and bool((bounds >= 0).all())
    again, _ = run(method)
    assert torch.equal(outs, again)  # the draws are a function of (seed, layer, length)
    other, _ = run(dataclasses.replace(method, rest=SampledRest(32, seed=1)))
    assert not torch.equal(outs, other)


def test_a_nonfinite_token_makes_its_heads_bound_nan_as_their_output():
    gen = torch.Generator().manual_seed(0)
    keys, values = torch.randn(2, 2, 501, 8, generator=gen), torch.randn(2, 2, 501, 8, generator=gen)
    values[1, 0, 7] = float("nan")
    state = RadarPlus(budget=128, rest="sampled", samples=8).new_state(2, 2, 8)
    state.prefill(keys, values)
    out, info = state.attend(torch.randn(2, 4, 8, generator=gen))
    assert bool(out[1, :2].isnan().all()) and bool(info.rest_bound[1, 0].isnan().all())
    assert bool(torch.isfinite(info.rest_bound[0]).all()) and bool(torch.isfinite(info.rest_bound[1, 1]).all())
