"""The paged engine (sparseattn.vllm.paged, no vLLM needed): one policy, two engines.

A paged cache is built from contiguous keys and values with a shuffled block table, in the vLLM CPU
layout (keys transposed per page). At a budget covering the context every method is dense attention;
Quest with ``page_size == block_size`` (and page-aligned sinks) selects and outputs what
SegmentSearchState outputs on the same tokens.
"""

import dataclasses
import math

import pytest
import torch

from sparseattn import registry
from sparseattn.methods.base import LayerSpec
from sparseattn.methods.layers import SplitLayers
from sparseattn.methods.rest import MergedRest
from sparseattn.testing import assert_close
from sparseattn.vllm.config import MethodRequest, parse_spec, request_from
from sparseattn.vllm.paged import (
    KVFormat,
    PagedPolicy,
    attend_pages,
    page_layout,
    page_views,
    paged_decode,
    paged_decode_ref,
    select_pages,
)

# (lengths of the batch's sequences, block size, kv heads, group, head dim): odd lengths, GQA, batch > 1.
SHAPES = [
    ((1, 33, 200), 32, 2, 3, 16),
    ((129, 64), 16, 3, 1, 32),
    ((97,), 32, 1, 4, 8),
]


def paged_cache(keys: list[torch.Tensor], values: list[torch.Tensor], block_size: int, seed: int = 0):
    """A ``[N, H, bs, 2 D]`` cache holding each ``[H, L, D]`` sequence in shuffled blocks, and its block table."""
    H, D = keys[0].shape[0], keys[0].shape[2]
    pages = [-(-k.shape[1] // block_size) for k in keys]
    n_blocks = sum(pages) + 3  # spare blocks hold garbage: a read of one would show
    g = torch.Generator().manual_seed(seed)
    order = torch.randperm(n_blocks, generator=g)
    cache = torch.randn(n_blocks, H, block_size, 2 * D, generator=g, dtype=keys[0].dtype) * 100
    keys_t, vals = page_views(cache)
    table = torch.zeros(len(keys), max(pages), dtype=torch.int32)
    used = 0
    for i, (k, v) in enumerate(zip(keys, values)):
        for p in range(pages[i]):
            b = int(order[used])
            used += 1
            table[i, p] = b
            n = min(block_size, k.shape[1] - p * block_size)
            keys_t[b, :, :, :n] = k[:, p * block_size : p * block_size + n].transpose(1, 2)
            vals[b, :, :n] = v[:, p * block_size : p * block_size + n]
    return cache, table


def sequences(lengths, H, D, dtype=torch.float32, seed=1):
    g = torch.Generator().manual_seed(seed)
    keys = [torch.randn(H, n, D, generator=g, dtype=dtype) for n in lengths]
    values = [torch.randn(H, n, D, generator=g, dtype=dtype) for n in lengths]
    return keys, values


def decode(name: str, lengths, bs, H, G, D, dtype=torch.float32, **options):
    keys, values = sequences(lengths, H, D, dtype)
    cache, table = paged_cache(keys, values, bs)
    query = torch.randn(len(lengths), H * G, D, generator=torch.Generator().manual_seed(2), dtype=dtype)
    policy = PagedPolicy(registry.build(name, **options), name)
    params, gen = policy.prepare(H, D, layer_idx=0)
    seq_lens = torch.tensor(lengths)
    out = paged_decode(policy, params, gen, cache, query, table, seq_lens, D**-0.5)
    return out, (keys, values, cache, table, query, seq_lens)


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"L{s[0]}-bs{s[1]}-H{s[2]}-G{s[3]}-D{s[4]}")
@pytest.mark.parametrize("name, options", [("dense", {}), ("quest", {"budget": 10**6}), ("quest", {"top_k": 10**6, "sinks": 5, "window": 7})])
def test_full_budget_is_dense(shape, name, options):
    lengths, bs, H, G, D = shape
    out, (_, _, cache, table, query, seq_lens) = decode(name, lengths, bs, H, G, D, **options)
    assert_close(out, paged_decode_ref(cache, query, table, seq_lens, D**-0.5), torch.float32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_bfloat16_cache(dtype):
    out, (_, _, cache, table, query, seq_lens) = decode("dense", (75, 140), 32, 2, 3, 16, dtype)
    assert out.dtype == dtype
    assert_close(out, paged_decode_ref(cache, query, table, seq_lens, 16**-0.5), dtype)


@pytest.mark.filterwarnings("ignore:SegmentSearch budget=40 is below")  # the reference's own warning
@pytest.mark.parametrize("budget", [40, 100, 333])
@pytest.mark.parametrize("sinks", [0, 16])
def test_quest_pages_equal_segment_search(budget, sinks):
    """Quest over vLLM pages == Quest's SegmentSearchState on the same tokens (page_size = block size)."""
    bs, H, G, D, lengths = 16, 2, 3, 8, (211, 90, 17)
    out, (keys, values, *_ , query, _) = decode("quest", lengths, bs, H, G, D, budget=budget, sinks=sinks, page_size=bs)
    method = registry.build("quest", budget=budget, sinks=sinks, page_size=bs)
    for i, n in enumerate(lengths):
        state = method.new_state(LayerSpec(batch=1, kv_heads=H, head_dim=D))
        state.append(keys[i][None], values[i][None])
        expected, info = state.attend(query[i][None])
        assert page_layout(n, bs, sinks, 0) == info.layout
        assert_close(out[i], expected[0], torch.float32, what=f"sequence {i} (L={n})")


@pytest.mark.parametrize("name", ["radar+", "radar", "radar-exact"])
def test_segment_search_presets_over_pages_equal_segment_search(name):
    """A preset with its schedule replaced by pages of block_size (sinks a whole page): the same output as its decode state."""
    import dataclasses

    from sparseattn.schedules.fixed import FixedSchedule

    bs = 16
    method = dataclasses.replace(registry.build(name, budget=96), schedule=FixedSchedule(bs), sinks=bs, window=0)
    assert_pages_equal_state(method, bs, (211, 150), name)


def assert_pages_equal_state(method, bs: int, lengths, name: str, H: int = 2, G: int = 3, D: int = 8) -> None:
    """``method`` (pages of ``bs`` tokens, one sink page) over a shuffled paged cache gives each sequence's
    decode-state output on the same tokens, with the same layout."""
    keys, values = sequences(lengths, H, D)
    cache, table = paged_cache(keys, values, bs)
    query = torch.randn(len(lengths), H * G, D, generator=torch.Generator().manual_seed(2))
    policy = PagedPolicy(method, name)
    params, gen = policy.prepare(H, D, layer_idx=0)
    out = paged_decode(policy, params, gen, cache, query, table, torch.tensor(lengths), D**-0.5)
    for i, n in enumerate(lengths):
        state = method.new_state(LayerSpec(batch=1, kv_heads=H, head_dim=D))
        state.append(keys[i][None], values[i][None])
        expected, info = state.attend(query[i][None])
        assert info.layout == page_layout(n, bs, bs, 0)
        assert_close(out[i], expected[0], torch.float32, what=f"{name}, sequence {i} (L={n})")



@pytest.mark.parametrize("name", ["radar+", "radar", "quest"])
@pytest.mark.parametrize("ranks", [3, 6], ids=["tp3", "tp6-replicated"])
def test_tensor_parallel_ranks_decode_their_heads_as_one_process_does(name, ranks):
    """Each TP rank holds its KV heads' pages (and query heads): with its parameter rows, its output is those heads' rows."""
    bs, H, G, D, lengths, budget = 16, 3, 2, 8, (211, 150), 64
    keys, values = sequences(lengths, H, D)
    cache, table = paged_cache(keys, values, bs)
    query = torch.randn(len(lengths), H * G, D, generator=torch.Generator().manual_seed(3))
    policy = PagedPolicy(registry.build(name, budget=budget), name)
    params, gen = policy.prepare(H, D, layer_idx=4)
    whole = paged_decode(policy, params, gen, cache, query, table, torch.tensor(lengths), D**-0.5)
    for rank in range(ranks):
        first = rank * H // ranks  # vLLM's split: H / ranks heads each, or one head replicated ranks / H times
        heads = list(range(first, first + max(1, H // ranks)))
        params_r, gen_r = policy.prepare(H, D, layer_idx=4, heads=heads)
        rows = [h * G + g for h in heads for g in range(G)]
        out = paged_decode(policy, params_r, gen_r, cache[:, heads].contiguous(), query[:, rows], table, torch.tensor(lengths), D**-0.5)
        assert_close(out, whole[:, rows], torch.float32, what=f"{name}, rank {rank} of {ranks}, heads {heads}")

def test_selected_pages_are_what_the_mask_says():
    """A budget that selects: the output equals the float64 reference under the page mask the policy reports."""
    bs, H, G, D, lengths = 16, 2, 2, 8, (200,)
    out, (keys, values, cache, table, query, seq_lens) = decode("quest", lengths, bs, H, G, D, budget=64)
    method = registry.build("quest", budget=64, page_size=bs)
    state = method.new_state(LayerSpec(batch=1, kv_heads=H, head_dim=D))
    state.append(keys[0][None], values[0][None])
    _, info = state.attend(query[0][None])
    mask = info.to_mask()[0]
    assert int(mask.sum(-1).max()) <= 64
    assert_close(out, paged_decode_ref(cache, query, table, seq_lens, D**-0.5, mask=[mask]), torch.float32)


@pytest.mark.parametrize(
    "name, why",
    [("h2o", "eviction methods"), ("snapkv", "eviction methods"), ("radar-with-h2o", "always-kept part"),
     ("radar+tokens", "token refinement")],
)
def test_refused_methods_say_why(name, why):
    with pytest.raises(ValueError, match=why):
        PagedPolicy(registry.build(name), name)


def test_a_per_layer_method_refuses_a_layer_method_that_cannot_run():
    """Every layer's method is checked at start-up, not when that layer first decodes."""
    from sparseattn.methods.layers import SplitLayers

    method = SplitLayers(registry.build("radar+", budget=512), registry.build("radar-with-h2o", budget=512), layers=1)
    with pytest.raises(ValueError, match="always-kept part"):
        PagedPolicy(method, "split")


def test_a_rest_other_than_the_merged_one_is_refused():
    @dataclasses.dataclass(frozen=True)
    class OtherRest(MergedRest):
        pass

    method = dataclasses.replace(registry.build("radar+", budget=512), rest=OtherRest(16))
    with pytest.raises(ValueError, match="MergedRest only"):
        PagedPolicy(method, "radar+ with another rest")


def test_a_per_layer_policy_is_resolved_per_layer_before_it_runs():
    policy = PagedPolicy(registry.build("radar+adaptive", budget=512), "radar+adaptive")
    assert policy.layered
    with pytest.raises(ValueError, match="for_layer"):
        policy.prepare(3, 64, 0)
    first, later = policy.for_layer(0, 30), policy.for_layer(5, 30)
    assert first.method.rest is None and later.method.rest == MergedRest(128)
    assert not first.layered and first.for_layer(3, 30) is first


def _on_pages(method, bs: int):
    """``method`` (or every method of a per-layer one) with pages of ``bs`` tokens as segments and one sink page."""
    from sparseattn.methods.layers import FirstLayers, SplitLayers
    from sparseattn.schedules.fixed import FixedSchedule

    if isinstance(method, SplitLayers):
        return dataclasses.replace(method, first=_on_pages(method.first, bs), others=_on_pages(method.others, bs))
    if isinstance(method, FirstLayers):
        return dataclasses.replace(method, method=_on_pages(method.method, bs))
    return dataclasses.replace(method, schedule=FixedSchedule(bs), sinks=bs, window=0)


#: The adaptive capabilities, each over pages as in the decode state: per-head page counts (pooled, top-p),
#: the merged rest (alone and with a split), a refined TopP with a budget cap.
ADAPTIVE = [
    ("radar+", {"split": "pooled"}),
    ("radar+", {"split": "pooled", "cap": 3.0, "floor": 0.1}),
    ("radar+", {"split": "topp", "p": 0.8}),
    ("radar+", {"rest": "merged", "merge": 2}),
    ("radar+", {"split": "pooled", "rest": "merged", "merge": 3}),
    ("radar+", {"split": "topp", "p": 0.9, "rest": "merged", "merge": 100}),
    ("oracle-tokens", {"split": "pooled"}),
    ("quest", {}),
]


@pytest.mark.parametrize("name, options", ADAPTIVE, ids=lambda x: x if isinstance(x, str) else ",".join(f"{k}={v}" for k, v in x.items()))
@pytest.mark.parametrize("G", [1, 3])
def test_adaptive_parts_over_pages_equal_the_decode_state(name, options, G):
    """Per-head page counts and the merged rest: the paged engine's output is its decode state's on the same tokens (float32)."""
    bs = 16
    method = _on_pages(registry.build(name, budget=120, **options), bs)
    assert_pages_equal_state(method, bs, (340, 211, 150), f"{name}:{options}", G=G)


@pytest.mark.parametrize("name, options", [("radar+adaptive", {}), ("radar+", {"first_layers": 2, "layer_factor": 2.0})],
                         ids=["radar+adaptive", "radar+first_layers=2"])
@pytest.mark.parametrize("layer", [0, 1, 2, 5])
def test_per_layer_methods_over_pages_equal_each_layers_decode_state(name, options, layer):
    """A per-layer method: layer ``i`` of the paged engine (``for_layer(i, n)``) gives the decode state of layer ``i``."""
    spec = name
    n_layers, bs, H, G, D, lengths = 6, 16, 2, 3, 8, (300, 170)
    method = _on_pages(registry.build(name, budget=128, **options), bs)
    keys, values = sequences(lengths, H, D)
    cache, table = paged_cache(keys, values, bs)
    query = torch.randn(len(lengths), H * G, D, generator=torch.Generator().manual_seed(2))
    policy = PagedPolicy(method, spec).for_layer(layer, n_layers)
    params, gen = policy.prepare(H, D, layer_idx=layer)
    out = paged_decode(policy, params, gen, cache, query, table, torch.tensor(lengths), D**-0.5)
    for i, n in enumerate(lengths):
        state = method.new_state(LayerSpec(batch=1, kv_heads=H, head_dim=D, layer_idx=layer, n_layers=n_layers))
        state.append(keys[i][None], values[i][None])
        expected, _ = state.attend(query[i][None])
        assert_close(out[i], expected[0], torch.float32, what=f"{spec}, layer {layer}, sequence {i}")


@pytest.mark.parametrize("options", [{"split": "pooled"}, {"split": "topp", "p": 0.7}], ids=["pooled", "topp"])
def test_heads_attend_their_own_page_counts_within_the_layers_budget(options):
    """A non-uniform split gives heads different page counts (a test that can fail), the layer's total within what
    the uniform split attends (pooled: equal at most; top-p: each head at most k)."""
    from sparseattn.vllm.paged import choose_pages

    bs, H, G, D, lengths = 16, 3, 3, 8, (600, 400)
    keys, values = sequences(lengths, H, D)
    # Heads differ: head 0's keys are near-constant (diffuse attention), head 2's spiky.
    for k in keys:
        k[0] *= 0.05
        k[2] *= 4.0
    cache, table = paged_cache(keys, values, bs)
    query = torch.randn(len(lengths), H * G, D, generator=torch.Generator().manual_seed(2))
    method = _on_pages(registry.build("radar+", budget=160, **options), bs)
    policy = PagedPolicy(method, "adaptive")
    params, gen = policy.prepare(H, D, layer_idx=0)
    sel = choose_pages(policy, params, gen, cache, query, table, torch.tensor(lengths), D**-0.5)
    for i, n in enumerate(lengths):
        lay = policy.layout(n, bs)
        k = policy.pages_for(lay)
        counts = (sel.pages[i] >= 0).sum(-1) - (lay.sink_end // bs) - (-(-n // bs) - lay.sink_end // bs - lay.n_segments)
        assert counts.unique().numel() > 1, counts
        assert int(counts.sum()) <= H * counts.shape[1] * k
        assert int(counts.max()) <= (2 * k if "pooled" in options.values() else k)


def test_the_merged_rest_over_pages_equals_its_float64_reference():
    """The merged step over a shuffled paged cache == the float64 loop over sequences, query heads and blocks."""
    from sparseattn.vllm.paged import choose_pages, merged_pages_ref

    bs, H, G, D, lengths = 16, 2, 3, 8, (420, 333, 97)
    keys, values = sequences(lengths, H, D)
    cache, table = paged_cache(keys, values, bs)
    query = torch.randn(len(lengths), H * G, D, generator=torch.Generator().manual_seed(2))
    method = _on_pages(registry.build("radar+", budget=100, split="pooled", rest="merged", merge=4), bs)
    policy = PagedPolicy(method, "merged")
    params, gen = policy.prepare(H, D, layer_idx=0)
    seq_lens = torch.tensor(lengths)
    sel = choose_pages(policy, params, gen, cache, query, table, seq_lens, D**-0.5)
    assert sel.merged is not None and torch.isfinite(sel.merged.log_counts).any()
    out = attend_pages(query, cache, table, sel.pages, seq_lens, D**-0.5, merged=sel.merged)
    lays = [policy.layout(n, bs) for n in lengths]
    ref = merged_pages_ref(cache, query, table, seq_lens, D**-0.5, sel.pages, [lay.sink_end // bs for lay in lays],
                           [lay.n_segments for lay in lays], 4)  # fmt: skip
    assert_close(out, ref, torch.float32)
    dropped = attend_pages(query, cache, table, sel.pages, seq_lens, D**-0.5)
    assert not torch.allclose(out, dropped, atol=1e-4)  # the rest changed the output: the comparison can fail


def test_page_layout_matches_segment_search_bounds():
    lay = page_layout(300, 128, sinks=4, window=0)
    assert (lay.sink_end, lay.n_segments, lay.tail_start, lay.tail_size) == (128, 1, 256, 44)
    lay = page_layout(256, 128, sinks=0, window=0)  # the current token fills the last page: never a candidate
    assert (lay.n_segments, lay.tail_start) == (1, 128)
    lay = page_layout(5, 128, sinks=300, window=0)
    assert (lay.sink_end, lay.n_segments, lay.tail_size) == (5, 0, 0)


def test_requests_from_config_and_environment():
    assert request_from({"sparseattn": "quest:budget=64"}, {}) == MethodRequest("quest", {"budget": 64})
    assert request_from({"other": 1}, {"SPARSEATTN_VLLM_METHOD": "dense"}) == MethodRequest("dense")
    with pytest.raises(ValueError, match="unknown method 'nope'; known methods: dense"):
        request_from({"sparseattn": {"method": "nope"}}, {})
    with pytest.raises(ValueError, match='needs "method"'):
        request_from({"sparseattn": {"budget": 3}}, {})
    with pytest.raises(ValueError, match="quest does not take n_features"):
        parse_spec("quest:n_features=3").check()
    with pytest.raises(ValueError, match="budget 0 is out of range"):
        MethodRequest("quest", {"budget": 0}).check()


def test_the_engines_segment_is_read_beside_the_method_and_checked():
    """``"segment"`` is the paged engine's (tokens per segment inside a page), not a method option: read from the
    dict form, handed to the policy, refused when it is not a positive number."""
    request = request_from({"sparseattn": {"method": "radar+adaptive", "budget": 512, "segment": "16"}}, {})
    assert request == MethodRequest("radar+adaptive", {"budget": 512}, 16) and request.policy().segment == 16
    assert request_from({"sparseattn": {"method": "quest", "segment": None}}, {}).policy().segment is None
    for bad in (0, -4, "x", True, 2.5):
        with pytest.raises(ValueError, match=r'\["segment"\] must be a positive number of tokens'):
            request_from({"sparseattn": {"method": "quest", "segment": bad}}, {})
    with pytest.raises(ValueError, match="segment 12 does not divide the block size 32"):
        PagedPolicy(request.build(), "r", 12).segments_per_page(32)


def test_segment_auto_is_the_methods_own_grid_rounded_to_a_divisor_of_the_page():
    """``"auto"`` (``sparseattn serve``'s default) runs a method on its schedule's segment at the engine's longest
    sequence, rounded down to a divisor of the page: the transformers engine's grid where the pages allow it."""
    from sparseattn.vllm.paged import own_segment

    for name, aspect in (("radar+adaptive", 16), ("radar+", 8)):
        method = registry.build(name, budget=512)
        for length in (300, 1024, 4096, 8192, 65536, 300_000):
            own = math.isqrt(length) // aspect  # the transformers grid at this length (SqrtSchedule)
            for page in (16, 32, 128):
                got = own_segment(method, length, page)
                want = max(d for d in range(1, min(max(own, 1), page) + 1) if page % d == 0)
                assert got == (None if want == page else want), (name, length, page)
    assert own_segment(registry.build("streamingllm", budget=512), 8192, 32) is None
    # a per-layer method: its layers' finest grid
    coarse, fine = registry.build("radar+", budget=512), registry.build("radar+", budget=512, aspect=16.0)
    assert own_segment(SplitLayers(coarse, fine), 8192, 32) == own_segment(SplitLayers(fine, coarse), 8192, 32) == 4
    assert own_segment(registry.build("radar+", budget=512, first_layers=1), 8192, 32) == 8
    request = request_from({"sparseattn": {"method": "radar+adaptive", "budget": 512, "segment": "AUTO"}}, {})
    assert request.segment == "auto"
    assert request.policy(block_size=32, length=8192).segment == 4
    assert request.policy(block_size=128, length=65536).segment == 16
    with pytest.raises(ValueError, match="segment 'auto' needs the engine's block size"):
        request.policy()
    page = request_from({"sparseattn": {"method": "radar+adaptive", "budget": 512, "segment": "page"}}, {})
    assert page.policy().segment is None
    with pytest.raises(ValueError, match="own_segment: length and block_size must be >= 1"):
        own_segment(request.build(), 0, 32)


def test_page_summaries_are_kept_and_invalidated_by_writes():
    """Summaries kept per physical block give the selection recomputing them does; a write to a block forgets it."""
    from sparseattn.vllm.paged import PageSummaries

    bs, H, G, D, lengths = 16, 2, 3, 8, (211, 90)
    keys, values = sequences(lengths, H, D)
    cache, table = paged_cache(keys, values, bs)
    query = torch.randn(2, H * G, D, generator=torch.Generator().manual_seed(2))
    policy = PagedPolicy(registry.build("quest", budget=48), "quest")
    params, gen = policy.prepare(H, D, layer_idx=0)
    seq_lens = torch.tensor(lengths)
    kept = PageSummaries(cache.shape[0], bs)
    first = paged_decode(policy, params, gen, cache, query, table, seq_lens, D**-0.5, summaries=kept)
    n = kept.computed
    assert n == (210 // bs) + (89 // bs)  # every candidate page once
    again = paged_decode(policy, params, gen, cache, query, table, seq_lens, D**-0.5, summaries=kept)
    assert kept.computed == n and torch.equal(first, again)
    # vLLM reuses block table[0, 3] for new tokens: its keys change and the slot mapping says so
    block = int(table[0, 3])
    page_views(cache)[0][block] = torch.randn(H, D, bs) * 10
    kept.invalidate(torch.tensor([-1, block * bs + 5]))
    fresh = paged_decode(policy, params, gen, cache, query, table, seq_lens, D**-0.5, summaries=None)
    kept_out = paged_decode(policy, params, gen, cache, query, table, seq_lens, D**-0.5, summaries=kept)
    assert kept.computed == n + 1
    assert torch.equal(fresh, kept_out)


@pytest.mark.parametrize("name", ["quest", "radar+", "radar", "radar-exact", "radar-lowest"])
def test_a_batch_decodes_as_its_sequences_do_one_by_one(name):
    """Sequences scored together (equal shapes) or alone, padded into one attention pass: each row as if decoded alone."""
    bs, H, G, D, lengths = 16, 2, 3, 8, (211, 215, 90, 17, 211, 300)
    keys, values = sequences(lengths, H, D)
    cache, table = paged_cache(keys, values, bs)
    query = torch.randn(len(lengths), H * G, D, generator=torch.Generator().manual_seed(5))
    policy = PagedPolicy(registry.build(name, budget=64), name)
    params, gen = policy.prepare(H, D, layer_idx=1)
    seq_lens = torch.tensor(lengths)
    batch = paged_decode(policy, params, gen, cache, query, table, seq_lens, D**-0.5)
    for i in range(len(lengths)):
        alone = paged_decode(policy, params, gen, cache, query[i : i + 1], table[i : i + 1], seq_lens[i : i + 1], D**-0.5)
        assert_close(batch[i], alone[0], torch.float32, what=f"{name}, sequence {i} (L={lengths[i]})")


def test_page_keys_take_reads_the_listed_pages():
    """PageKeys.take(index) == the listed candidates of every candidate's keys (scaled), for per-head lists."""
    from sparseattn.vllm.paged import PageKeys

    bs, H, D, lengths = 16, 3, 8, (170, 120)
    keys, values = sequences(lengths, H, D, torch.bfloat16)
    cache, table = paged_cache(keys, values, bs)
    cand = table[:, 1:7].long()
    pk = PageKeys(page_views(cache)[0], cand, 0.5)
    everything = pk.all()  # [B, H, S, bs, D]
    assert everything.shape == pk.shape == (2, H, 6, bs, D)
    expected = torch.stack([keys[i][:, bs : 7 * bs].float().reshape(H, 6, bs, D) * 0.5 for i in range(2)])
    assert torch.equal(everything, expected)
    index = torch.randint(0, 6, (2, H, 4), generator=torch.Generator().manual_seed(0))
    b, h = torch.arange(2).view(2, 1, 1), torch.arange(H).view(1, H, 1)
    assert torch.equal(pk.take(index), everything[b, h, index])


def test_radar_plus_reads_only_its_shortlisted_pages(monkeypatch):
    """radar+'s exact rerank takes the shortlist's pages from the cache: no step copies every candidate's keys."""
    from sparseattn.vllm import paged

    def every_page(self):
        raise AssertionError("radar+ copied every candidate page's keys")

    monkeypatch.setattr(paged.PageKeys, "all", every_page)
    bs, H, G, D, lengths = 16, 2, 3, 8, (600, 450)
    keys, values = sequences(lengths, H, D)
    cache, table = paged_cache(keys, values, bs)
    query = torch.randn(len(lengths), H * G, D, generator=torch.Generator().manual_seed(2))
    policy = PagedPolicy(registry.build("radar+", budget=96), "radar+")
    params, gen = policy.prepare(H, D, layer_idx=0)
    kept = paged.PageSummaries(cache.shape[0], bs)  # as the backend runs it: page summaries kept per block
    out = paged_decode(policy, params, gen, cache, query, table, torch.tensor(lengths), D**-0.5, summaries=kept)
    assert kept.computed == (599 // bs - 1) + (449 // bs - 1) and torch.isfinite(out).all()  # 4 sinks: one sink page


@pytest.mark.parametrize("budget, sinks", [(100, 4), (64, 0), (40, 20), (500, 4)])
def test_streamingllm_attends_its_sink_pages_and_the_recent_pages_within_its_budget(budget, sinks):
    """StreamingLLM as a selection: the sink pages and the last pages, no more tokens than the budget."""
    bs, H, G, D, lengths = 16, 2, 3, 8, (211, 90, 17, 33)
    out, (keys, values, cache, table, query, seq_lens) = decode("streamingllm", lengths, bs, H, G, D, budget=budget, sinks=sinks)
    masks = []
    for n in lengths:
        sink_end = min(-(-sinks // bs) * bs, n) if sinks else 0
        window = max(1, budget - sink_end - (bs - 1))
        tail_start = max(sink_end, (n - window) // bs * bs)
        pos = torch.arange(n)
        mask = (pos < sink_end) | (pos >= tail_start)
        # the budget, or at least the whole sink pages and the current token's page; the current token always
        assert int(mask.sum()) <= max(budget, sink_end + bs) and bool(mask[-1])
        if n > budget + bs:
            assert int(mask.sum()) > budget - 2 * bs  # and no page less than fits
        masks.append(mask.expand(H * G, n))
    assert_close(out, paged_decode_ref(cache, query, table, seq_lens, D**-0.5, mask=masks), torch.float32)


# --- fp8 caches (vLLM's kv_cache_dtype="fp8", "fp8_e4m3", "fp8_e5m2"): one byte per number, times the layer's scale ---


def fp8_cache(cache: torch.Tensor, fmt: KVFormat) -> torch.Tensor:
    """``cache`` (float ``[N, H, bs, 2 D]``) as vLLM's fp8 cache: uint8 bytes of float8 numbers, key / k_scale, value / v_scale."""
    out = torch.empty(cache.shape, dtype=torch.uint8)
    keys_t, values = page_views(cache)
    stored_k, stored_v = page_views(out, fmt)  # float8 views of the bytes
    stored_k.copy_((keys_t.float() / fmt.k_scale).to(fmt.fp8))
    stored_v.copy_((values.float() / fmt.v_scale).to(fmt.fp8))
    return out


def dequantised(cache: torch.Tensor, fmt: KVFormat) -> torch.Tensor:
    keys_t, values = page_views(cache, fmt)
    out = torch.empty(cache.shape, dtype=torch.float32)
    k, v = page_views(out)
    k.copy_(keys_t.float() * fmt.k_scale)
    v.copy_(values.float() * fmt.v_scale)
    return out


FP8 = [KVFormat("fp8", 0.5, 0.25), KVFormat("fp8_e4m3", 1.0, 1.0), KVFormat("fp8_e5m2", 2.0, 0.5)]


@pytest.mark.parametrize("fmt", FP8, ids=lambda f: f"{f.dtype}-k{f.k_scale}-v{f.v_scale}")
@pytest.mark.parametrize("name, options", [("dense", {}), ("quest", {"budget": 96}), ("radar+", {"budget": 96}), ("radar", {"budget": 96})])
def test_an_fp8_cache_selects_and_attends_as_its_dequantised_float32_cache_does(fmt, name, options):
    """Scores, selection and attention over fp8 pages are those over the dequantised cache (the float64 reference's input)."""
    bs, H, G, D, lengths = 16, 2, 3, 32, (300, 45, 170)
    keys, values = sequences(lengths, H, D)
    cache, table = paged_cache([k * 2 for k in keys], [v * 2 for v in values], bs)
    stored = fp8_cache(cache, fmt)
    plain = dequantised(stored, fmt)
    query = torch.randn(len(lengths), H * G, D, generator=torch.Generator().manual_seed(5))
    policy = PagedPolicy(registry.build(name, **options), name)
    params, gen = policy.prepare(H, D, layer_idx=1)
    seq_lens = torch.tensor(lengths)
    pages = select_pages(policy, params, gen, stored, query, table, seq_lens, D**-0.5, fmt=fmt)
    params, gen = policy.prepare(H, D, layer_idx=1)
    assert torch.equal(pages, select_pages(policy, params, gen, plain, query, table, seq_lens, D**-0.5))
    out = attend_pages(query, stored, table, pages, seq_lens, D**-0.5, fmt=fmt)
    want = attend_pages(query, plain, table, pages, seq_lens, D**-0.5)
    assert_close(out, want.double(), torch.float32)
    if name == "dense":  # every page: the float64 reference of the dequantised cache, read from the fp8 bytes
        assert_close(out, paged_decode_ref(stored, query, table, seq_lens, D**-0.5, fmt=fmt), torch.float32)


def test_an_fp8_format_is_read_only_from_a_uint8_cache_and_checked():
    cache = torch.zeros(2, 1, 16, 16)
    with pytest.raises(ValueError, match="a torch.float32 KV cache read as 'fp8'"):
        page_views(cache, KVFormat("fp8"))
    with pytest.raises(ValueError, match="a torch.uint8 KV cache read as 'auto'"):
        page_views(cache.to(torch.uint8))
    with pytest.raises(ValueError, match=r"KVFormat.dtype must be 'auto' or one of \['fp8', 'fp8_e4m3', 'fp8_e5m2'\], got 'int8'"):
        KVFormat("int8")
    with pytest.raises(ValueError, match="KVFormat.k_scale must be a finite number > 0, got 0"):
        KVFormat("fp8", 0)


def _on_segments(method, seg: int, bs: int):
    """``method`` (or every method of a per-layer one) on a fixed grid of ``seg``-token segments, one sink page."""
    from sparseattn.methods.layers import FirstLayers, SplitLayers
    from sparseattn.schedules.fixed import FixedSchedule

    if isinstance(method, SplitLayers):
        return dataclasses.replace(method, first=_on_segments(method.first, seg, bs), others=_on_segments(method.others, seg, bs))
    if isinstance(method, FirstLayers):
        return dataclasses.replace(method, method=_on_segments(method.method, seg, bs))
    return dataclasses.replace(method, schedule=FixedSchedule(seg), sinks=bs, window=0)


@pytest.mark.parametrize("bs, seg", [(16, 8), (32, 8), (32, 16)])
@pytest.mark.parametrize("name, options", [("radar+", {}), ("radar+", {"split": "pooled", "rest": "merged", "merge": 3}),
                                           ("radar+", {"split": "topp", "p": 0.9}), ("quest", {}), ("radar", {}),
                                           ("radar+", {"split": "pooled", "prefilter": 2, "prefilter_keep": 1.5})],
                         ids=["radar+", "pooled-merged", "topp", "quest", "radar", "prefilter"])  # fmt: skip
@pytest.mark.parametrize("G", [1, 3])
def test_segments_inside_pages_equal_the_decode_state_on_that_grid(bs, seg, name, options, G):
    """``PagedPolicy(segment=c)``: c-token segments inside each page (a page holds bs / c), selected and attended as
    the decode state does on a fixed grid of c-token segments, the same tokens (float32)."""
    from sparseattn.vllm.paged import choose_pages

    H, D = 2, 8
    # Lengths whose unsegmented tail ends on a page boundary in both engines (the paged tail is whole pages).
    lengths = tuple(bs * pages + 1 + extra for pages, extra in ((17, seg - 2), (11, 0), (26, seg // 2)))
    method = _on_segments(registry.build(name, budget=120, **options), seg, bs)
    keys, values = sequences(lengths, H, D)
    cache, table = paged_cache(keys, values, bs)
    query = torch.randn(len(lengths), H * G, D, generator=torch.Generator().manual_seed(2))
    policy = PagedPolicy(method, name, segment=seg)
    params, gen = policy.prepare(H, D, layer_idx=0)
    out = paged_decode(policy, params, gen, cache, query, table, torch.tensor(lengths), D**-0.5)
    sel = choose_pages(policy, *policy.prepare(H, D, layer_idx=0), cache, query, table, torch.tensor(lengths), D**-0.5)
    assert sel.tokens is not None and not bool(sel.tokens[sel.pages >= 0].all())  # some listed page is attended in part
    for i, n in enumerate(lengths):
        state = method.new_state(LayerSpec(batch=1, kv_heads=H, head_dim=D))
        state.append(keys[i][None], values[i][None])
        expected, info = state.attend(query[i][None])
        assert info.layout == page_layout(n, bs, bs, 0, seg)
        assert_close(out[i], expected[0], torch.float32, what=f"{name}:{options} seg {seg} of {bs}, sequence {i} (L={n})")


def test_a_segment_must_divide_the_page():
    with pytest.raises(ValueError, match="does not divide the block size 32"):
        page_layout(300, 32, 4, 0, 12)
    with pytest.raises(ValueError, match="segment must be a positive number"):
        PagedPolicy(registry.build("radar+", budget=512), "radar+", segment=0)


def test_the_vllm_modules_form_no_import_cycle():
    """The plugin's modules import one way (the worker the backend, the kernel's step the ctypes binding and the
    profile, never back; function-local imports count): a cycle hid here before (the worker took the backend's
    private layer index while the backend imported the worker for one flag)."""
    from import_graph import in_cycles, package_imports

    assert in_cycles(package_imports("vllm")) == []
