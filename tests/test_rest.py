"""The rest of a step merged per block (``MergedRest``) instead of dropped.

Statements checked:

* a merged token's weight ``n exp(q . mean k)`` never exceeds the attention mass of the tokens it
  stands for (Jensen), and equals it when their keys are equal (hypothesis);
* when every block's keys are equal, attention with the merged rest is dense attention, whatever
  the step selected (the merge loses nothing there);
* ``merged_attention`` equals its float64 reference on random inputs, soft-capping and per-head
  masks included; summing a listing by whole segments (runs) is summing it token by token;
* a segment search with the rest attends its selection plus one merged token per block made of
  exactly what it did not attend (the reference over its reported mask), counts every merged token
  in ``attended`` and keeps ``attended <= budget``; every summary x selector, an allocation,
  refinement, heavy hitters and a shared selection compose with it; at full budget it is dense;
* bad options are refused with their name.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from parts import SELECTORS, SUMMARIES, part_id
from sparseattn import (
    Centroid,
    DoublingSchedule,
    FixedSchedule,
    HeavyHitters,
    PooledMass,
    Quest,
    SegmentSearch,
    SqrtSchedule,
    TopK,
    TopTokens,
    attention_ref,
)
from sparseattn.methods.radar_plus import RadarPlus, RadarPlusPooled
from sparseattn.methods.rest import (
    MergedRest,
    add_merged_rest,
    attended_block_sums,
    block_counts,
    block_sums,
    merged_attention,
    segment_sums,
)
from sparseattn.ops.merged import merged_attention_ref
from sparseattn.ops.attention import segment_mask, soft_cap
from sparseattn.ops.layout import SegmentLayout
from sparseattn.ops.segments import RestSums
from sparseattn.backends.cpu_backend import CpuBackend
from sparseattn.backends.cpu_kernels import cpu_kernel_refusal, merged_rest_cpu
from sparseattn.methods import rest as rest_module
from sparseattn.testing import assert_close

CPU_KERNEL = cpu_kernel_refusal()  # None when the C kernel built and loaded here


@settings(max_examples=80, deadline=None)
@given(n=st.integers(1, 40), d=st.integers(1, 16), spread=st.floats(0.0, 3.0), seed=st.integers(0, 2**31 - 1))
def test_a_merged_token_never_outweighs_the_tokens_it_stands_for(n, d, spread, seed):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(d, generator=gen, dtype=torch.float64)
    keys = torch.randn(1, d, generator=gen, dtype=torch.float64) + spread * torch.randn(n, d, generator=gen, dtype=torch.float64)
    merged = math.log(n) + float(keys.mean(0) @ q)
    exact = float(torch.logsumexp(keys @ q, 0))
    assert merged <= exact + 1e-9
    if spread == 0.0:
        assert merged == pytest.approx(exact, abs=1e-9)


@pytest.mark.parametrize("seed", range(3))
def test_equal_keys_in_every_block_make_the_merged_rest_exact(seed):
    """Blocks of equal keys (values free): the merged rest is the dropped share, so the output is dense."""
    gen = torch.Generator().manual_seed(seed)
    B, H, G, D, start, block, n = 2, 2, 3, 8, 3, 5, 6
    t = start + block * n + 4
    keys = torch.randn(B, H, t, D, generator=gen, dtype=torch.float64)
    keys[:, :, start : start + block * n] = keys[:, :, start : start + block * n : block].repeat_interleave(block, dim=2)
    values = torch.randn(B, H, t, D, generator=gen, dtype=torch.float64)
    q = torch.randn(B, H, G, D, generator=gen, dtype=torch.float64)
    attended = torch.rand(B, H, G, t, generator=gen) < 0.3
    attended[..., :start] = True  # sinks and tail: always attended (they are no block's)
    attended[..., start + block * n :] = True
    out = merged_attention_ref(q, keys, values, attended, start, start + block * n, block, D**-0.5)
    assert_close(out, attention_ref(q, keys, values), torch.float64)


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("softcap", [None, 5.0])
@pytest.mark.parametrize("per_head", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_merged_attention_is_its_float64_reference(seed, softcap, per_head, dtype):
    gen = torch.Generator().manual_seed(seed)
    B, H, G, D, start, c, per, S = 2, 2, 3, 16, 4, 3, 4, 21
    end = start + c * S
    t = end + 7
    keys, values = torch.randn(B, H, t, D, generator=gen, dtype=dtype), torch.randn(B, H, t, D, generator=gen, dtype=dtype)
    q = torch.randn(B, H, G, D, generator=gen, dtype=dtype)
    L = 30
    # Distinct positions (a token listed twice would count twice, as in every listing), the newest first.
    index = torch.stack([torch.cat([torch.tensor([t - 1]), torch.randperm(t - 1, generator=gen)[: L - 1]]) for _ in range(B * H)]).view(B, H, L)
    attended = torch.rand(B, H, G if per_head else 1, L, generator=gen) < 0.7
    attended[..., 0] = True
    seg = lambda x: x[:, :, start:end].reshape(B, H, S, c, D)
    ks, vs = block_sums(seg(keys), seg(values), per)
    out, probs = merged_attention(q, keys, values, index, attended, ks, vs, block_counts(S, c, per), start, end, per * c, D**-0.5, softcap)
    mask = torch.zeros(B, H, G, t, dtype=torch.bool)
    mask.scatter_(-1, index.unsqueeze(2).expand(B, H, G, L), attended.expand(B, H, G, L))
    ref = merged_attention_ref(q, keys, values, mask, start, end, per * c, D**-0.5, softcap)
    assert_close(out, ref, dtype)
    assert bool((probs[~attended.expand(B, H, G, L)] == 0).all())


@settings(max_examples=60, deadline=None)
@given(
    seed=st.integers(0, 2**31 - 1),
    lists=st.sampled_from(["shared", "per head", "per head, equal"]),
    per_block=st.integers(1, 6),
    window=st.integers(0, 20),
    extra=st.integers(0, 4),
    softcap=st.sampled_from([None, 3.0]),
)
def test_the_rest_from_segment_sums_is_the_float64_reference(seed, lists, per_block, window, extra, softcap):
    """``add_merged_rest`` (the kernel path: no token gathered) on the attended part's output and log-sum-exp
    is ``merged_attention_ref``, the window reaching into segments included (a segment it
    reaches is attended whole if selected, else only its tail tokens). Both paths: one listing per KV head
    (shared, or per head but equal, as a pooled split off a group's shortlist lists) and one per head."""
    gen = torch.Generator().manual_seed(seed)
    B, H, G, D, c, S, sinks = 2, 2, 3, 8, 3, 12, 2
    lay = SegmentLayout(length=sinks + S * c + extra, sinks=sinks, segment_size=c, n_segments=S, window=window)
    keys, values = torch.randn(B, H, lay.length, D, generator=gen), torch.randn(B, H, lay.length, D, generator=gen)
    q = torch.randn(B, H, G, D, generator=gen)
    sets = 1 if lists == "shared" else G
    segments = torch.stack([torch.randperm(S, generator=gen)[:5] for _ in range(B * H * sets)]).view(B, H, sets, 5)
    if lists == "per head, equal":
        segments = segments[:, :, :1].expand(B, H, G, 5).contiguous()
    valid = torch.rand(segments.shape, generator=gen) < 0.6
    grid = lambda x: x[:, :, sinks : lay.segment_end].reshape(B, H, S, c, D)  # noqa: E731
    seg_kv = torch.cat(segment_sums(grid(keys), grid(values)), dim=-1)
    sums = RestSums(seg_kv, *block_sums(grid(keys), grid(values), per_block), per_block)
    scale = D**-0.5
    mask = segment_mask(lay, segments, G, valid)
    attended = soft_cap(torch.einsum("bhgd,bhtd->bhgt", q.double(), keys.double()) * scale, softcap)
    lse = torch.logsumexp(attended.masked_fill(~mask, float("-inf")), dim=-1).float()
    selection = attention_ref(q, keys, values, mask, softcap=softcap).float()
    out = add_merged_rest(selection, lse, q, keys, values, lay, segments, valid, sums, scale, softcap)
    ref = merged_attention_ref(q, keys, values, mask, sinks, lay.segment_end, per_block * c, scale, softcap)
    assert out.dtype == torch.float32
    assert_close(out, ref.float(), torch.float32)


@pytest.mark.skipif(CPU_KERNEL is not None, reason=f"the C kernel is unavailable here: {CPU_KERNEL}")
@settings(max_examples=60, deadline=None)
@given(
    seed=st.integers(0, 2**31 - 1),
    lists=st.sampled_from(["shared", "per head", "per head, equal"]),
    per_block=st.sampled_from([1, 2, 3, 5, None]),
    masked=st.booleans(),
    softcap=st.sampled_from([None, 3.0]),
    D=st.sampled_from([8, 64, 128]),
    cache=st.sampled_from([torch.float32, torch.bfloat16]),
    threads=st.sampled_from([1, 3]),
    loud=st.sampled_from([1.0, 300.0]),
)
def test_the_c_kernels_merged_rest_is_the_float64_reference(seed, lists, per_block, masked, softcap, D, cache, threads, loud):
    """The C path (``CpuBackend.segment_attention_merged``: the kernel with its log-sum-exp, then the rest in C)
    is ``merged_attention_ref``, the sums read in place from views of capacity buffers (rows contiguous,
    the rest of each buffer NaN: a read past a view would show); ``None``: one block for the whole rest.
    ``loud``: logits in the thousands, whose exponentials overflow even float64 without the max-shift."""
    gen = torch.Generator().manual_seed(seed)
    B, H, G, c, S, sinks = 2, 2, 3, 3, 12, 2
    lay = SegmentLayout(length=sinks + S * c + 5, sinks=sinks, segment_size=c, n_segments=S, window=3)
    assert lay.tail_start >= lay.segment_end
    keys, values = (torch.randn(B, H, lay.length, D, generator=gen).to(cache) for _ in range(2))
    q = torch.randn(B, H, G, D, generator=gen) * loud
    sets = 1 if lists == "shared" else G
    segments = torch.stack([torch.randperm(S, generator=gen)[:5] for _ in range(B * H * sets)]).view(B, H, sets, 5)
    if lists == "per head, equal":
        segments = segments[:, :, :1].expand(B, H, G, 5).contiguous()
    valid = (torch.rand(segments.shape, generator=gen) < 0.6) if masked else None
    grid = lambda x: x[:, :, sinks : lay.segment_end].float().reshape(B, H, S, c, D)  # noqa: E731
    per = per_block or rest_module._ONE_BLOCK
    sums = (torch.cat(segment_sums(grid(keys), grid(values)), dim=-1), *block_sums(grid(keys), grid(values), per))

    def in_capacity(x):  # the view a GrowableBuffer hands out: more rows behind it, NaN
        buf = torch.full((B, H, x.shape[2] + 4, x.shape[3]), float("nan"), dtype=x.dtype)
        buf[:, :, : x.shape[2]] = x
        return buf[:, :, : x.shape[2]]

    before = torch.get_num_threads()
    try:
        torch.set_num_threads(threads)
        sums = RestSums(*map(in_capacity, sums), per)
        out = CpuBackend().segment_attention_merged(q, keys, values, lay, segments, valid, sums, D**-0.5, softcap)
    finally:
        torch.set_num_threads(before)
    mask = segment_mask(lay, segments, G, valid)
    ref = merged_attention_ref(q, keys, values, mask, sinks, lay.segment_end, per * c, D**-0.5, softcap)
    assert out.dtype == torch.float32
    assert_close(out, ref.float(), torch.float32)


def test_the_c_kernels_merged_rest_refuses_what_it_cannot_do():
    """A window reaching into segments (its tail parts are not in the sums), a listed index outside the grid, and
    blocks of no segment."""
    if CPU_KERNEL is not None:
        pytest.skip(f"the C kernel is unavailable here: {CPU_KERNEL}")
    B, H, G, D, c, S = 1, 1, 2, 8, 4, 6
    sums = RestSums(torch.zeros(B, H, S, 2 * D), torch.zeros(B, H, 2, D, dtype=torch.float64), torch.zeros(B, H, 2, D, dtype=torch.float64), 3)
    q, kv = torch.randn(B, H, G, D), torch.randn(B, H, 1 + S * c + 2, D)
    reaching = SegmentLayout(length=1 + S * c + 2, sinks=1, segment_size=c, n_segments=S, window=5)
    with pytest.raises(ValueError, match="window that reaches into no segment"):
        CpuBackend().segment_attention_merged(q, kv, kv, reaching, torch.zeros(B, H, 1, 2, dtype=torch.long), None, sums, 1.0)
    lay = SegmentLayout(length=1 + S * c + 2, sinks=1, segment_size=c, n_segments=S, window=2)
    out, lse = torch.zeros(B, H, G, D), torch.zeros(B, H, G)
    with pytest.raises(ValueError, match="cpu merged rest failed: a segment index is outside"):
        merged_rest_cpu(out, lse, q, lay, torch.full((B, H, 1, 2), S, dtype=torch.long), None, sums, 1.0)
    assert bool((out == 0).all())  # the input is not written
    with pytest.raises(ValueError, match="per_block .* must be >= 1"):
        merged_rest_cpu(out, lse, q, lay, torch.zeros(B, H, 1, 2, dtype=torch.long), None, dataclasses.replace(sums, per_block=0), 1.0)


def run_steps(method, budget, steps=4, seed=0, B=2, H=2, G=3, D=16, T=400):
    """Decode ``steps`` tokens; each output must be the reference over the reported mask plus the merged rest."""
    gen = torch.Generator().manual_seed(seed)
    state = method.new_state(B, H, D)
    keys, values = torch.randn(B, H, T + steps, D, generator=gen), torch.randn(B, H, T + steps, D, generator=gen)
    state.prefill(keys[:, :, :T], values[:, :, :T])
    infos = []
    for t in range(T, T + steps):
        q = torch.randn(B, H * G, D, generator=gen)
        out, info = state.step(q, keys[:, :, t], values[:, :, t])
        lay = info.layout
        mask = info.to_mask().view(B, H, G, t + 1)
        per = min(method.rest.per_block, lay.n_segments) * lay.segment_size
        ref = merged_attention_ref(q.view(B, H, G, D), keys[:, :, : t + 1], values[:, :, : t + 1], mask, lay.sink_end, lay.segment_end, per, state.scale)
        assert_close(out, ref.view(B, H * G, D).float(), torch.float32)
        assert info.n_merged == method.rest.blocks(lay.n_segments)
        assert torch.equal(info.attended, info.to_mask().sum(-1) + info.merged)
        if budget is not None:
            assert float(info.attended.double().mean(-1).max()) <= budget
        infos.append(info)
    return infos


@pytest.mark.parametrize(
    "method",
    [
        RadarPlusPooled(budget=160),
        RadarPlus(budget=160),
        Quest(budget=160),
        dataclasses.replace(RadarPlus(budget=160), shared_kv_selection=True),
        dataclasses.replace(RadarPlus(budget=160), always=HeavyHitters(8)),
        dataclasses.replace(RadarPlus(budget=160, aspect=2.0), refine=TopTokens(2)),
    ],
    ids=["radar+pooled", "radar+", "quest", "shared", "heavy-hitters", "refine"],
)
@pytest.mark.parametrize("backend", ["torch", "cpu"])
@pytest.mark.parametrize("per_block", [4, None])
def test_a_step_attends_its_selection_plus_exactly_what_it_left_out_merged(method, backend, per_block):
    """Both paths: the torch one gathers the attended tokens and sums them; the C kernel's returns each head's
    log-sum-exp and the rest comes from segment sums (``add_merged_rest``). One block: one merged token."""
    if backend == "cpu" and CPU_KERNEL is not None:
        pytest.skip(f"the C kernel is unavailable here: {CPU_KERNEL}")
    infos = run_steps(dataclasses.replace(method, rest=MergedRest(per_block), backend=backend), 160)
    assert all(0 < i.n_merged for i in infos)


@pytest.mark.parametrize("selector", SELECTORS, ids=part_id)
@pytest.mark.parametrize("summary", SUMMARIES, ids=part_id)
def test_every_summary_and_selector_composes_with_the_merged_rest(summary, selector):
    method = SegmentSearch(summary, selector, SqrtSchedule(aspect=2.0), sinks=2, budget=80, allocation=PooledMass(cap=3.0), rest=MergedRest(3))
    run_steps(method, 80, steps=3, T=300)


def test_the_rest_costs_budget_one_token_per_block():
    plain, merged = RadarPlusPooled(budget=512), dataclasses.replace(RadarPlusPooled(budget=512), rest=MergedRest(16))
    s1, s2 = plain.new_state(1, 1, 16), merged.new_state(1, 1, 16)
    for s in (s1, s2):
        s.prefill(torch.randn(1, 1, 4096, 16), torch.randn(1, 1, 4096, 16))
    lay = s2.layout
    assert merged.merged_tokens(lay) == -(-lay.n_segments // 16)
    room = 512 - lay.sink_end - lay.tail_size
    assert plain.segments_for(lay) == room // lay.segment_size
    assert merged.segments_for(lay) == (room - merged.merged_tokens(lay)) // lay.segment_size


def test_at_full_budget_the_rest_changes_nothing():
    B, H, G, D, T = 1, 2, 3, 8, 90
    method = dataclasses.replace(RadarPlus(budget=10**6), rest=MergedRest(2))
    state = method.new_state(B, H, D)
    keys, values = torch.randn(B, H, T, D), torch.randn(B, H, T, D)
    state.prefill(keys[:, :, :-1], values[:, :, :-1])
    q = torch.randn(B, H * G, D)
    out, info = state.step(q, keys[:, :, -1], values[:, :, -1])
    assert_close(out, attention_ref(q.view(B, H, G, D), keys, values).view(B, H * G, D), torch.float32)
    assert info.n_merged == 0 and torch.equal(info.attended, torch.full((B, H * G), T))


def test_beam_reordering_keeps_each_rows_block_sums():
    method = dataclasses.replace(RadarPlus(budget=64), rest=MergedRest(4))
    state = method.new_state(2, 1, 8)
    state.prefill(torch.randn(2, 1, 300, 8), torch.randn(2, 1, 300, 8))
    before = [buf.view().clone() for buf in state._rest_sums]
    state.select_batch(torch.tensor([1, 1, 0]))
    for old, buf in zip(before, state._rest_sums):
        assert torch.equal(buf.view(), old[[1, 1, 0]])


@pytest.mark.parametrize("schedule", [FixedSchedule(4), DoublingSchedule(aspect=2.0)], ids=part_id)
@pytest.mark.parametrize("per_block", [1, 3, None])
def test_block_and_segment_sums_kept_while_decoding_are_the_sums_of_the_grid(per_block, schedule):
    """Sealing adds each new segment to its block (no block is summed again) and a rebuild starts over:
    after every step the kept sums are those of the current grid, summed afresh."""
    method = SegmentSearch(Centroid(), TopK(), schedule, sinks=2, budget=96, allocation=PooledMass(cap=3.0), rest=MergedRest(per_block))
    B, H, D, T, steps = 1, 2, 8, 150, 120
    gen = torch.Generator().manual_seed(per_block or 0)
    keys, values = torch.randn(B, H, T + steps, D, generator=gen), torch.randn(B, H, T + steps, D, generator=gen)
    state = method.new_state(B, H, D)
    state.prefill(keys[:, :, :T], values[:, :, :T])
    grids = set()
    for t in range(T, T + steps):
        state.step(torch.randn(B, H * 3, D, generator=gen), keys[:, :, t], values[:, :, t])
        lay = state.layout
        grids.add((lay.segment_size, lay.n_segments))
        grid = lambda x: x[:, :, lay.sink_end : lay.segment_end].reshape(B, H, lay.n_segments, lay.segment_size, D)  # noqa: E731
        for kept, fresh in zip(state._rest_sums, block_sums(grid(keys), grid(values), MergedRest(per_block).per_block)):
            torch.testing.assert_close(kept.view(), fresh)
        torch.testing.assert_close(state._segment_sums[0].view(), torch.cat(segment_sums(grid(keys), grid(values)), dim=-1))
    assert len(grids) > 3  # segments were sealed (fixed) or the grid rebuilt (doubling)


@pytest.mark.parametrize("bad", [0, -1, 1.5, "4"])
def test_bad_rest_options_are_refused_with_their_name(bad):
    with pytest.raises(ValueError, match="MergedRest.segments"):
        MergedRest(bad)


def test_a_rest_class_instead_of_an_instance_is_refused():
    with pytest.raises(ValueError, match="SegmentSearch.rest"):
        SegmentSearch(rest=MergedRest)


@pytest.mark.parametrize("seed", range(3))
def test_summing_a_listing_by_whole_segments_is_summing_it_token_by_token(seed):
    gen = torch.Generator().manual_seed(seed)
    B, H, G, D, n, first, count, length, after = 2, 2, 3, 8, 5, 3, 6, 4, 5
    L = first + count * length + after
    x = torch.randn(B, H, L, D, generator=gen)
    weight = (torch.rand(B, H, G, L, generator=gen) < 0.6).float()
    block = torch.randint(0, n, (B, H, L), generator=gen)
    block[:, :, first : first + count * length] = torch.randint(0, n, (B, H, count), generator=gen).repeat_interleave(length, -1)
    by_runs = attended_block_sums(x, weight, block, n, (first, count, length))
    by_token = attended_block_sums(x, weight, block, n)
    ref = torch.zeros(B, H, G, n, D, dtype=torch.float64)
    for b, h, g, l in ((b, h, g, l) for b in range(B) for h in range(H) for g in range(G) for l in range(L)):
        ref[b, h, g, block[b, h, l]] += weight[b, h, g, l].double() * x[b, h, l].double()
    assert_close(by_runs, ref, torch.float32)
    assert_close(by_token, ref, torch.float32)
