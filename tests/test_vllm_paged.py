"""The paged engine (sparseattn.vllm.paged, no vLLM needed): one policy, two engines.

A paged cache is built from contiguous keys and values with a shuffled block table, in the vLLM CPU
layout (keys transposed per page). At a budget covering the context every method is dense attention;
Quest with ``page_size == block_size`` (and page-aligned sinks) selects and outputs what
SegmentSearchState outputs on the same tokens.
"""

import dataclasses

import pytest
import torch

from sparseattn import registry
from sparseattn.methods.base import LayerSpec
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
    [("h2o", "eviction methods"), ("snapkv", "eviction methods"), ("radar+h2o", "always-kept part"), ("radar+pooled", "non-uniform budget allocation"),
     ("oracle-tokens-pooled-layers", "per-layer budgets"), ("radar+pooled-layers", "per-layer budgets"),
     ("radar+tokens", "token refinement"), ("radar+merged", "non-uniform budget allocation"),
     ("radar+merged-after", "per-layer budgets or methods")],
)
def test_refused_methods_say_why(name, why):
    with pytest.raises(ValueError, match=why):
        PagedPolicy(registry.build(name), name)


def test_a_merged_rest_is_refused_even_with_a_uniform_split():
    method = dataclasses.replace(registry.build("radar+", budget=512), rest=MergedRest(16))
    with pytest.raises(ValueError, match="merged rest"):
        PagedPolicy(method, "radar+ with a merged rest")


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
