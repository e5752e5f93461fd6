"""The fused paged step (sparseattn/vllm/paged_kernels.c) against the generic paged engine and float64 attention.

For every policy the kernel runs (radar+, quest, dense, streamingllm), on fresh random paged caches:
the kernel attends the pages :func:`select_pages` selects (the policy's own parts, in torch), and
its output is float64 attention over exactly those pages. Page summaries kept between calls, shared
by sequences (prefix caching) and invalidated by writes give what fresh summaries give.
"""

import math

import pytest
import torch

from sparseattn import Quest, RadarPlus, registry
from sparseattn.selectors.topk import TopK
from sparseattn.summaries.minmax import MinMaxBound
from sparseattn.testing import assert_close
from sparseattn.vllm.paged import PagedPolicy, paged_decode_ref, select_pages
from sparseattn.vllm.paged_kernel import (
    BOUND,
    FIXED,
    SPLIT,
    PageStore,
    StepPlan,
    fused_decode,
    kernel_refusal,
    step_plan,
)
from sparseattn.vllm.route import route
from tests.test_vllm_paged import paged_cache, sequences

pytestmark = pytest.mark.skipif(kernel_refusal() is not None, reason=f"the fused paged kernel cannot be built here: {kernel_refusal()}")

# (lengths, block size, KV heads, group, head dim)
SHAPES = [
    ((700, 1000, 37), 16, 2, 3, 16),
    ((1200, 77), 32, 3, 5, 64),
    ((2000, 1500), 32, 3, 3, 64),
    ((900,), 16, 1, 4, 8),
    ((333, 64, 16, 1), 16, 2, 2, 32),
]
POLICIES = [
    ("radar+", {"budget": 256}),
    ("radar+", {"budget": 128, "shortlist": 4, "factor": 1.5}),
    ("radar+", {"budget": 96, "sinks": 40, "window": 20}),
    ("quest", {"budget": 200}),
    ("quest", {"budget": 300, "shared_kv_selection": True, "sinks": 16}),
    ("dense", {}),
    ("streamingllm", {"budget": 100}),
    ("radar+", {"budget": 10**6}),
]


def setup(name, options, lengths, bs, H, G, D, dtype=torch.float32, seed=0):
    keys, values = sequences(lengths, H, D, dtype, seed=seed + 1)
    cache, table = paged_cache(keys, values, bs, seed=seed)
    query = torch.randn(len(lengths), H * G, D, generator=torch.Generator().manual_seed(seed + 2)).to(dtype)
    return PagedPolicy(build(name, options), name), cache, table, query, torch.tensor(lengths)


def build(name, options):
    """The registry's method, or the preset's constructor for options the registry does not offer."""
    if set(options) - set(registry.get(name).option_names):
        return {"radar+": RadarPlus, "quest": Quest}[name](**options)
    return registry.build(name, **options)


def store_for(policy, cache):
    mode = route(policy).mode
    return None if mode == FIXED else PageStore.for_policy(policy, cache.shape[0], cache.shape[1], cache.shape[3] // 2, cache.shape[2])


def candidate_sets(policy, cache, table, query, lens, bs):
    """Per (sequence, KV head, selection): the set of candidate pages the generic engine attends."""
    params, gen = policy.prepare(cache.shape[1], cache.shape[3] // 2, 0)
    pages = select_pages(policy, params, gen, cache, query, table, lens, query.shape[-1] ** -0.5)
    plan = step_plan(policy, lens, bs).plan
    sets = {}
    for b in range(pages.shape[0]):
        lo, hi = int(plan[b, 0]), int(plan[b, 0] + plan[b, 1])
        for h in range(pages.shape[1]):
            for g in range(pages.shape[2]):
                sets[b, h, g] = {p - lo for p in pages[b, h, g].tolist() if lo <= p < hi}
    return sets


def mask_of(selected, plan, lens, bs, G):
    """Per sequence, the ``[H_q, L]`` tokens attended: sinks, the selected candidates, the tail."""
    masks = []
    B, H, Gs, _ = selected.shape
    for b in range(B):
        L, sink, n = int(lens[b]), int(plan[b, 0]), int(plan[b, 1])
        m = torch.zeros(H, G, L, dtype=torch.bool)
        m[..., : sink * bs] = True
        m[..., (sink + n) * bs :] = True
        for h in range(H):
            for gs in range(Gs):
                for c in selected[b, h, gs].tolist():
                    if c >= 0:
                        rows = slice(None) if Gs == 1 else gs
                        m[h, rows, (sink + c) * bs : (sink + c + 1) * bs] = True
        masks.append(m.view(H * G, L))
    return masks


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"L{s[0]}-bs{s[1]}-H{s[2]}-G{s[3]}-D{s[4]}")
@pytest.mark.parametrize("name, options", POLICIES, ids=lambda v: str(v))
def test_the_kernel_attends_what_the_policy_selects(name, options, shape, dtype):
    lengths, bs, H, G, D = shape
    seed = int(torch.randint(0, 2**30, ()))  # fresh inputs each run; the seed is in the failure message
    policy, cache, table, query, lens = setup(name, options, lengths, bs, H, G, D, dtype, seed)
    mode = route(policy).mode
    assert mode is not None
    plan = step_plan(policy, lens, bs)
    out, selected = fused_decode(policy, mode, store_for(policy, cache), cache, query, table, lens, D**-0.5, plan=plan,
                                 with_selection=True)
    expected = candidate_sets(policy, cache, table, query, lens, bs)
    got = {(b, h, g): {c for c in selected[b, h, g].tolist() if c >= 0}
           for b in range(selected.shape[0]) for h in range(H) for g in range(selected.shape[2])}
    assert got == expected, f"seed {seed}"
    reference = paged_decode_ref(cache.double(), query.double(), table, lens, D**-0.5, mask_of(selected, plan.plan, lens, bs, G))
    assert_close(out, reference.float(), torch.float32 if dtype == torch.float32 else dtype, what=f"seed {seed}")


def test_a_budget_covering_the_context_is_dense():
    policy, cache, table, query, lens = setup("radar+", {"budget": 10**6}, (300, 77, 1024), 32, 2, 3, 16)
    out, _ = fused_decode(policy, SPLIT, store_for(policy, cache), cache, query, table, lens, 0.25)
    assert_close(out, paged_decode_ref(cache.double(), query.double(), table, lens, 0.25).float(), torch.float32)


@pytest.mark.parametrize("name, options", [("dense", {}), ("radar+", {"budget": 128}), ("quest", {"budget": 128})])
def test_the_kernel_writes_into_a_given_output_what_it_returns(name, options):
    """The backend hands vLLM's float32 output rows as ``out``: the kernel writes there, nothing else differs."""
    policy, cache, table, query, lens = setup(name, options, (600, 300), 16, 2, 3, 16)
    mode = route(policy).mode
    expected, _ = fused_decode(policy, mode, store_for(policy, cache), cache, query, table, lens, 0.25)
    buffer = torch.full((4, 6, 16), float("nan"))  # vLLM's output: more rows than decode tokens
    got, _ = fused_decode(policy, mode, store_for(policy, cache), cache, query, table, lens, 0.25, out=buffer[:2])
    assert got.data_ptr() == buffer.data_ptr() and torch.equal(buffer[:2], expected)
    assert buffer[2:].isnan().all()  # rows past the decode tokens untouched


@pytest.mark.parametrize("name, options", [("dense", {}), ("radar+", {"budget": 128}), ("quest", {"budget": 128})])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_the_kernel_writes_the_models_dtype_as_torch_rounds_it(name, options, dtype):
    """A bf16 or fp16 output buffer (vLLM's, in the model's dtype) gets each float32 result rounded to nearest, as
    ``tensor.to(dtype)`` rounds it: the layer needs no float32 buffer and no conversion after the call."""
    policy, cache, table, query, lens = setup(name, options, (600, 300), 16, 2, 3, 16, dtype=dtype)
    mode = route(policy).mode
    wide, _ = fused_decode(policy, mode, store_for(policy, cache), cache, query, table, lens, 0.25)
    narrow, _ = fused_decode(policy, mode, store_for(policy, cache), cache, query, table, lens, 0.25, out=torch.empty(2, 6, 16, dtype=dtype))
    assert narrow.dtype == dtype and torch.equal(narrow, wide.to(dtype))


@pytest.mark.parametrize("bad", [torch.empty(2, 6, 16, dtype=torch.int32), torch.empty(3, 6, 16), torch.empty(2, 16, 6).transpose(1, 2)])
def test_an_output_buffer_that_does_not_fit_is_refused_before_any_work(bad):
    policy, cache, table, query, lens = setup("radar+", {"budget": 128}, (600, 300), 16, 2, 3, 16)
    store = store_for(policy, cache)
    with pytest.raises(ValueError, match="out"):
        fused_decode(policy, SPLIT, store, cache, query, table, lens, 0.25, out=bad)
    assert int(store.state.sum()) == 0  # no page was summarised


def test_kept_summaries_are_used_shared_and_refreshed_after_a_write():
    """Summaries computed once, shared by sequences on the same blocks, recomputed after vLLM writes a block."""
    policy, cache, table, query, lens = setup("radar+", {"budget": 128}, (600, 600), 16, 2, 3, 16)
    table[1] = table[0]  # prefix caching: both sequences read the same blocks
    query[1] = query[0]
    store = store_for(policy, cache)
    first, sel = fused_decode(policy, SPLIT, store, cache, query, table, lens, 0.25, with_selection=True)
    assert torch.equal(first[0], first[1]) and torch.equal(sel[0], sel[1])
    n_cand = int(step_plan(policy, lens, 16).plan[0, 1])
    assert int(store.state.sum()) == n_cand  # each shared candidate block summarised once
    again, _ = fused_decode(policy, SPLIT, store, cache, query, table, lens, 0.25)
    assert torch.equal(again, first)
    # vLLM writes into two candidate blocks: their keys change, the slot mapping marks them stale.
    blocks = table[0, 3:5].long()
    cache[blocks] = torch.randn_like(cache[blocks]) * 3
    store.invalidate((blocks * 16 + 5).to(torch.int64), 16)
    assert int(store.state.sum()) == n_cand - 2
    after, _ = fused_decode(policy, SPLIT, store, cache, query, table, lens, 0.25)
    fresh, _ = fused_decode(policy, SPLIT, store_for(policy, cache), cache, query, table, lens, 0.25)
    assert torch.equal(after, fresh)


def test_quest_bounds_are_kept_and_stale_pages_refreshed():
    policy, cache, table, query, lens = setup("quest", {"budget": 200}, (900,), 16, 2, 3, 16)
    store = store_for(policy, cache)
    assert store.mode == BOUND and store.summary2 is not None
    fused_decode(policy, BOUND, store, cache, query, table, lens, 0.25)
    block = table[0, 10:11].long()
    cache[block] = cache[block] * -2
    store.invalidate(block * 16, 16)
    after, _ = fused_decode(policy, BOUND, store, cache, query, table, lens, 0.25)
    fresh, _ = fused_decode(policy, BOUND, store_for(policy, cache), cache, query, table, lens, 0.25)
    assert torch.equal(after, fresh)


def test_a_bad_plan_or_table_is_refused_before_any_work():
    policy, cache, table, query, lens = setup("radar+", {"budget": 128}, (600, 300), 16, 2, 3, 16)
    store = store_for(policy, cache)
    plan = step_plan(policy, lens, 16)
    bad = plan.plan.clone()
    bad[0, 1] += 10  # candidates past the last page
    with pytest.raises(ValueError, match="plan does not fit"):
        fused_decode(policy, SPLIT, store, cache, query, table, lens, 0.25, plan=StepPlan(bad, plan.kmax))
    bad_table = table.clone()
    bad_table[1, 2] = cache.shape[0]
    with pytest.raises(ValueError, match="block table entry"):
        fused_decode(policy, SPLIT, store, cache, query, bad_table, lens, 0.25)
    assert int(store.state.sum()) == 0  # nothing was summarised
    with pytest.raises(ValueError, match="page store"):
        fused_decode(policy, SPLIT, PageStore(cache.shape[0], 1, 16, SPLIT), cache, query, table, lens, 0.25)
    with pytest.raises(ValueError, match="one of each per sequence"):
        fused_decode(policy, SPLIT, store, cache, query[:1], table, lens, 0.25)


def test_policies_the_kernel_does_not_know_keep_the_generic_path():
    import dataclasses

    import torch as t

    from sparseattn.selectors.topk import TopK
    from sparseattn.summaries import Centroid, Rerank

    assert route(PagedPolicy(registry.build("radar"), "radar")).mode is None
    f16 = dataclasses.replace(registry.build("radar+"), summary=Rerank(Centroid(t.float16), per_group=True))
    assert route(PagedPolicy(f16, "radar+f16")).mode is None
    bf16 = dataclasses.replace(registry.build("radar+"), summary=Rerank(Centroid(t.bfloat16), per_group=True))
    assert route(PagedPolicy(bf16, "radar+bf16")).mode == SPLIT  # bf16 centroids: the split step's scoring only
    per_head = dataclasses.replace(registry.build("radar+"), summary=Rerank(Centroid(), per_group=False))
    assert route(PagedPolicy(per_head, "radar+per-head")).mode is None
    for split in ("uniform", "pooled"):  # the page-level prefilter: the C step scores every segment's centroid
        assert route(PagedPolicy(registry.build("radar+", split=split, prefilter=4), "radar+:prefilter=4")).mode is None

    class Shuffled(TopK):
        pass

    assert route(PagedPolicy(dataclasses.replace(registry.build("quest"), selector=Shuffled()), "q")).mode is None


class RenamedBound(MinMaxBound):
    """A third party's summary that computes quest's bound (here: by inheriting it) and says so: ``paged_kernel``."""

    paged_kernel = "bound"


class UndeclaredBound(MinMaxBound):
    """The same arithmetic, not declared: a subclass may score otherwise, so it keeps the generic path."""


class RenamedTopK(TopK):
    paged_kernel = "top_k"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_part_declaring_a_c_implementation_runs_the_fused_step_with_no_other_file_edited(dtype):
    """Parts declare what they are to the fused step (:data:`~sparseattn.vllm.route.KERNELS`): a summary and a selector
    defined here, in no file of the package, route to the bound step and give the generic path's pages and output."""
    import dataclasses

    seed = int(torch.randint(0, 2**30, ()))
    quest = registry.build("quest", budget=200)
    declared = dataclasses.replace(quest, summary=RenamedBound(), selector=RenamedTopK())
    assert route(PagedPolicy(dataclasses.replace(quest, summary=UndeclaredBound()), "u")).refusal == (
        "UndeclaredBound declares no fused implementation")
    lengths, bs, H, G, D = (1200, 77), 32, 3, 5, 64
    _, cache, table, query, lens = setup("quest", {"budget": 200}, lengths, bs, H, G, D, dtype, seed)
    policy = PagedPolicy(declared, "renamed quest")
    assert route(policy).mode == BOUND
    plan = step_plan(policy, lens, bs)
    out, selected = fused_decode(policy, BOUND, store_for(policy, cache), cache, query, table, lens, D**-0.5, plan=plan,
                                 with_selection=True)
    got = {(b, h, g): {c for c in selected[b, h, g].tolist() if c >= 0}
           for b in range(selected.shape[0]) for h in range(H) for g in range(selected.shape[2])}
    assert got == candidate_sets(policy, cache, table, query, lens, bs), f"seed {seed}"
    reference = paged_decode_ref(cache.double(), query.double(), table, lens, D**-0.5, mask_of(selected, plan.plan, lens, bs, G))
    assert_close(out, reference.float(), torch.float32 if dtype == torch.float32 else dtype, what=f"seed {seed}")


@pytest.mark.parametrize("name, options", [("radar+", {"budget": 256}), ("quest", {"budget": 200}), ("dense", {})])
def test_softcap_is_applied_to_the_attended_logits_as_the_torch_path_does(name, options):
    """Gemma-style logit capping: the kernel's output equals attend_pages with the same softcap over the same pages."""
    from sparseattn.vllm.paged import attend_pages

    policy, cache, table, query, lens = setup(name, options, (1200, 640), 32, 2, 3, 64)
    query = query * 8  # logits well past the cap, so capping changes the output
    params, gen = policy.prepare(2, 64, 0)
    pages = select_pages(policy, params, gen, cache, query, table, lens, 0.125)
    expected = attend_pages(query, cache, table, pages, lens, 0.125, softcap=5.0)
    got, _ = fused_decode(policy, route(policy).mode, store_for(policy, cache), cache, query, table, lens, 0.125, softcap=5.0)
    assert_close(got, expected, torch.float32)
    uncapped, _ = fused_decode(policy, route(policy).mode, store_for(policy, cache), cache, query, table, lens, 0.125)
    assert not torch.allclose(uncapped, expected, atol=1e-3)


#: The split step's policies: per-head page counts (pooled, top-p), the merged rest, both, a per-layer preset's layers.
SPLIT_POLICIES = [
    ("radar+", {"budget": 256, "split": "pooled"}),
    ("radar+", {"budget": 200, "split": "pooled", "cap": 4.0}),  # past the shortlist: pages scored without kept logits
    ("radar+", {"budget": 256, "split": "topp", "p": 0.9}),
    ("radar+", {"budget": 256, "rest": "merged", "merge": 4}),
    ("radar+", {"budget": 192, "split": "pooled", "rest": "merged", "merge": 3}),
    ("radar+", {"budget": 10**6, "split": "pooled", "rest": "merged"}),  # nothing to select: no rest
    # bfloat16 centroids (stored so, scored in float32): the split step runs them, uniform top-k included
    ("radar+", {"budget": 256, "bf16_centroids": True}),
    ("radar+", {"budget": 192, "split": "pooled", "rest": "merged", "merge": 3, "bf16_centroids": True}),
]


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"L{'-'.join(map(str, s[0]))}-bs{s[1]}-H{s[2]}-G{s[3]}-D{s[4]}")
@pytest.mark.parametrize("name, options", SPLIT_POLICIES, ids=lambda x: x if isinstance(x, str) else ",".join(f"{k}={v}" for k, v in x.items()))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_split_step_gives_the_generic_paths_output(shape, name, options, dtype):
    """Per-head page counts and the merged rest in the fused kernel == the generic path (the policy's own parts in torch)."""
    from sparseattn.vllm.paged import paged_decode

    lengths, bs, H, G, D = shape
    policy, cache, table, query, lens = setup(name, options, lengths, bs, H, G, D, dtype)
    assert route(policy).mode == SPLIT
    store = PageStore.for_policy(policy, cache.shape[0], H, D, bs)
    params, gen = policy.prepare(H, D, 0)
    want = paged_decode(policy, params, gen, cache, query.float(), table, lens, D**-0.5)
    for _ in range(2):  # summaries and sums computed, then kept
        got, _ = fused_decode(policy, SPLIT, store, cache, query, table, lens, D**-0.5)
        assert_close(got, want, torch.float32)


@pytest.mark.parametrize("bs, seg", [(16, None), (32, 4), (32, 8)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_bf16_centroids_in_the_kernel_are_the_generic_paths_bit_for_bit(bs, seg, dtype):
    """The C step's bfloat16 centroids are the ones ``Centroid(torch.bfloat16).summarize`` stores from the generic
    path's scaled keys, every bit: a mean one bf16 step off would move a score by 0.4% of a coordinate and
    could change the shortlist, so both engines must round alike. The float32 store, kept for contrast, is not bf16."""
    from sparseattn.vllm.paged import PageSummaries

    lengths, H, G, D = (700, 1000), 2, 3, 64
    seed = int(torch.randint(0, 2**30, ()))
    policy, cache, table, query, lens = setup("radar+", {"budget": 256, "bf16_centroids": True}, lengths, bs, H, G, D, dtype, seed)
    policy = PagedPolicy(policy.method, "radar+bf16", seg)
    r = policy.segments_per_page(bs)
    store = PageStore.for_policy(policy, cache.shape[0], H, D, bs)
    assert store.summary.dtype == torch.bfloat16
    fused_decode(policy, SPLIT, store, cache, query, table, lens, D**-0.5)
    plan = step_plan(policy, lens, bs).plan
    for b in range(len(lengths)):
        sink_pages, n_cand = int(plan[b, 0]), int(plan[b, 1])
        blocks = table[b, sink_pages : sink_pages + n_cand // r].long()
        assert bool(store.state[blocks].all())
        summaries = PageSummaries(cache.shape[0], bs)
        keys_t = cache.view(cache.shape[0], H, 2, bs * D)[:, :, 0].view(cache.shape[0], H, D, bs)
        (want,) = summaries.get(policy.method.summary, None, keys_t, blocks[None], math.sqrt(D**-0.5), r)  # [1, H, P r, D]
        got = store.summary[blocks].transpose(0, 1).flatten(1, 2)  # [H, P r, D]
        assert want.dtype == torch.bfloat16
        assert torch.equal(got.view(torch.int16), want[0].view(torch.int16)), f"seed {seed}"


def test_the_split_steps_rest_changes_the_output_and_follows_writes():
    """A test that can fail: the merged rest moves the output; a page written to (its block reused) gets fresh sums."""
    from sparseattn.vllm.paged import paged_decode
    from sparseattn.vllm.paged_kernel import SPLIT

    lengths, bs, H, G, D = (900, 700), 16, 2, 3, 16
    merged, cache, table, query, lens = setup("radar+", {"budget": 160, "split": "pooled", "rest": "merged", "merge": 4}, lengths, bs, H, G, D)
    dropped = PagedPolicy(build("radar+", {"budget": 160, "split": "pooled"}), "dropped")
    store = PageStore(cache.shape[0], H, D, SPLIT, sums=True)
    with_rest, _ = fused_decode(merged, SPLIT, store, cache, query, table, lens, D**-0.5)
    without, _ = fused_decode(dropped, SPLIT, PageStore(cache.shape[0], H, D, SPLIT), cache, query, table, lens, D**-0.5)
    assert not torch.allclose(with_rest, without, atol=1e-4)
    block = int(table[0, 5])  # a candidate page of sequence 0: overwritten, as vLLM reusing the block would
    cache[block] = torch.randn(cache[block].shape, generator=torch.Generator().manual_seed(9))
    store.invalidate(torch.arange(block * bs, (block + 1) * bs), bs)
    params, gen = merged.prepare(H, D, 0)
    again, _ = fused_decode(merged, SPLIT, store, cache, query, table, lens, D**-0.5)
    assert_close(again, paged_decode(merged, params, gen, cache, query, table, lens, D**-0.5), torch.float32)


def test_the_split_step_refuses_a_store_without_sums_for_a_merged_rest():
    from sparseattn.vllm.paged_kernel import SPLIT

    policy, cache, table, query, lens = setup("radar+", {"budget": 160, "rest": "merged"}, (600,), 16, 2, 3, 16)
    with pytest.raises(ValueError, match="sums=True"):
        fused_decode(policy, SPLIT, PageStore(cache.shape[0], 2, 16, SPLIT), cache, query, table, lens, 0.25)


#: (lengths, block size, segment, KV heads, group, head dim): segments inside pages, vector and scalar loops.
SEGMENT_SHAPES = [
    ((700, 1000, 37), 16, 8, 2, 3, 16),
    ((1200, 77), 32, 16, 3, 5, 64),
    ((2000, 1500), 32, 8, 3, 3, 64),
    ((900,), 64, 16, 1, 4, 32),
]


@pytest.mark.parametrize("shape", SEGMENT_SHAPES, ids=lambda s: f"L{'-'.join(map(str, s[0]))}-bs{s[1]}-seg{s[2]}-H{s[3]}-G{s[4]}-D{s[5]}")
@pytest.mark.parametrize("name, options", [
    ("radar+", {"budget": 256}), ("quest", {"budget": 200}), ("radar+", {"budget": 192, "split": "pooled", "rest": "merged", "merge": 3}),
    # merge 4: every page in one block (r = 2 or 4), so the blocks sum the pages' own rows, and a whole page chosen leaves in one
    ("radar+", {"budget": 192, "split": "pooled", "rest": "merged", "merge": 4}),
    ("radar+", {"budget": 256, "split": "topp", "p": 0.9}), ("radar+", {"budget": 10**6}),
    ("radar+", {"budget": 192, "split": "pooled", "rest": "merged", "merge": 3, "bf16_centroids": True}),
], ids=["radar+", "quest", "pooled-merged", "pooled-merged-pages", "topp", "full-budget", "bf16-centroids"])  # fmt: skip
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_segments_inside_pages_in_the_fused_step_give_the_generic_paths_output(shape, name, options, dtype):
    """``PagedPolicy(segment=c)``: every fused mode scores, selects and attends c-token segments of the pages as the
    generic path does (which is the decode state's output on that grid: tests/test_vllm_paged.py)."""
    from sparseattn.vllm.paged import paged_decode

    lengths, bs, seg, H, G, D = shape
    keys, values = sequences(lengths, H, D, dtype, seed=1)
    cache, table = paged_cache(keys, values, bs, seed=0)
    query = torch.randn(len(lengths), H * G, D, generator=torch.Generator().manual_seed(2)).to(dtype)
    policy = PagedPolicy(build(name, options), name, segment=seg)
    lens = torch.tensor(lengths)
    mode = route(policy).mode
    assert mode is not None and mode != FIXED
    params, gen = policy.prepare(H, D, 0)
    want = paged_decode(policy, params, gen, cache, query.float(), table, lens, D**-0.5)
    store = PageStore.for_policy(policy, cache.shape[0], H, D, bs)
    for _ in range(2):  # summaries computed, then kept
        got, _ = fused_decode(policy, mode, store, cache, query, table, lens, D**-0.5)
        assert_close(got, want, torch.float32)


def test_a_store_for_whole_pages_is_refused_for_segments():
    policy, cache, table, query, lens = setup("radar+", {"budget": 160}, (600,), 32, 2, 3, 16)
    policy = PagedPolicy(policy.method, "radar+", segment=16)
    with pytest.raises(ValueError, match=r"2 segment\(s\) per page"):
        fused_decode(policy, SPLIT, PageStore(cache.shape[0], 2, 16, SPLIT), cache, query, table, lens, 0.25)


def test_the_store_keeps_page_totals_where_blocks_are_whole_pages_and_centroids_float32():
    """``PageStore.for_policy``: the merged rest's sums are one row per page when every block of the rest is whole
    pages and the centroids are float32 (the merged tokens' logits come off their scores), else a row per segment
    too; what it holds is ``nbytes``, beside vLLM's cache: for the preset on 4-token segments of 32-token pages 28%."""
    def store(spec_options, seg, bs=32):
        policy = PagedPolicy(build("radar+", {"budget": 512, **spec_options}), "radar+", seg)
        return PageStore.for_policy(policy, 100, 3, 64, bs)

    preset = {"split": "pooled", "rest": "merged", "merge": 128}
    # float32 centroids: the values' sums alone (the merged tokens' logits come off the centroid scores)
    assert store(preset, 4).sums.shape == (100, 3, 1, 64) and not store(preset, 4).segment_sums
    assert store({**preset, "merge": 3}, 4).sums.shape == (100, 3, 9, 64)  # blocks of 3 segments end inside pages
    assert store({**preset, "bf16_centroids": True}, 4).sums.shape == (100, 3, 9, 128)  # bf16 means: the keys' sums too
    assert store(preset, None).sums.shape == (100, 3, 1, 64)  # whole pages: one row either way
    kv_bytes = 100 * 3 * 32 * 2 * 64 * 2  # bf16 pages
    # per block and head: 8 centroids x 256 B + one 256 B row = 2,304 B of the page's 8,192 (28%); segment rows 4,352 (53%)
    assert store(preset, 4).nbytes / kv_bytes < 0.29 < 0.53 < store({**preset, "merge": 3}, 4).nbytes / kv_bytes
    with pytest.raises(ValueError, match="segment_sums=False reads the merged tokens' logits off float32 centroids"):
        PageStore(10, 3, 64, SPLIT, sums=True, segments=8, summary_dtype=torch.bfloat16, segment_sums=False)
