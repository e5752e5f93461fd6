"""The split step's C entry point (``sa_paged_split``) beyond its outputs (tests/test_vllm_paged_kernel.py holds those
to the generic path): its argument struct as ctypes mirrors it, the selection it ranks with (``top_k_set``, a radix
select) against a sort, and the profile's accounting of what a step reads.
"""

import ctypes

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from sparseattn import registry
from sparseattn.vllm.paged import PagedPolicy
from sparseattn.vllm.paged_kernel import (
    SPLIT,
    DecodeArgs,
    PageStore,
    SplitArgs,
    fused_decode,
    kernel_refusal,
    step_plan,
    top_k_positions,
)
from sparseattn.vllm.route import route
from sparseattn.vllm.paged_library import library
from sparseattn.vllm.profile import C_PHASES, StepProfile
from tests.test_vllm_paged import paged_cache, sequences

pytestmark = pytest.mark.skipif(kernel_refusal() is not None, reason=f"the fused paged kernel cannot be built here: {kernel_refusal()}")


@pytest.mark.parametrize("struct, layout", [(SplitArgs, "sa_paged_split_layout"), (DecodeArgs, "sa_paged_decode_layout")])
def test_the_argument_structs_are_laid_out_as_the_c_ones(struct, layout):
    """Every field of each entry point's ctypes struct at the offset the C struct has it, and the same size: a field
    added on one side only, or in another order, would hand the kernel another field's value."""
    fields = [name for name, _ in struct._fields_]
    offsets = (ctypes.c_int64 * len(fields))()
    size = getattr(library(), layout)(offsets)
    assert size == ctypes.sizeof(struct)
    assert {name: getattr(struct, name).offset for name in fields} == dict(zip(fields, offsets))


def _sorted_reference(x: torch.Tensor, k: int) -> list[int]:
    """The positions of the k largest (a NaN the lowest number, -0 equal to 0, ties to the earlier position)."""
    key = torch.where(torch.isnan(x), torch.tensor(-torch.finfo(torch.float32).max), x).tolist()
    return sorted(sorted(range(len(key)), key=lambda i: (-key[i], i))[:k])


@settings(max_examples=300, deadline=None)
@given(
    values=st.lists(st.one_of(st.floats(width=32), st.sampled_from([0.0, -0.0, 1.0, -1.0])), min_size=1, max_size=300),
    data=st.data(),
)
def test_the_kernels_top_k_is_a_sorts_top_k(values, data):
    """Any float32 numbers (NaN, infinities, repeats, signed zeros): the k positions the kernel's radix select keeps
    are the first k of a stable sort, largest first."""
    x = torch.tensor(values, dtype=torch.float32)
    k = data.draw(st.integers(1, len(values)))
    assert sorted(top_k_positions(x, k).tolist()) == _sorted_reference(x, k)


@pytest.mark.parametrize("n", [4095, 4096, 9000])  # both histogram widths (8 bits a pass below 4096 numbers, 11 above)
def test_the_top_k_of_long_lists_with_ties(n):
    g = torch.Generator().manual_seed(n)
    x = torch.randint(-50, 50, (n,), generator=g).float() / 8  # many ties at the k-th value
    for k in (1, n // 3, n - 1, n):
        assert sorted(top_k_positions(x, k).tolist()) == _sorted_reference(x, k)


@pytest.mark.parametrize("low, high", [(-10.0, -9.0), (-20.0, 0.0), (3.0, 3.0), (1e-3, 2e-3), (7.25, 7.25 + 2**-20)])
def test_the_top_k_of_numbers_that_share_their_top_bits(low, high):
    """The select starts below the bits every number shares (one sign, one span of exponents: the shares a pooled
    split ranks are all negative), down to lists of one repeated number; lengths around the 16-lane vector loops."""
    g = torch.Generator().manual_seed(int(1e3 * abs(low)) + 7)
    for n in (1, 15, 16, 17, 100, 944, 4248):
        x = low + (high - low) * torch.rand(n, generator=g)
        x[torch.randint(0, n, (n // 4,), generator=g)] = x[0].item()  # ties, some at the k-th value
        for k in {1, max(1, n // 2), n}:
            assert sorted(top_k_positions(x, k).tolist()) == _sorted_reference(x, k)


@pytest.mark.parametrize("n, k", [(15, 7), (16, 15), (40, 3), (100, 99), (944, 472), (4248, 2124)])
def test_the_top_k_writes_its_k_positions_in_order_and_nothing_past_them(n, k):
    """The select's contract the split step relies on: the positions above the k-th value in ascending order, then
    the ties at it in ascending order, and not one word written past the k it was asked for (its vector loops
    store with masks)."""
    g = torch.Generator().manual_seed(n + k)
    x = torch.randint(-6, 6, (n,), generator=g).float() / 4  # many ties at the k-th value
    out = torch.full((k + 32,), -7, dtype=torch.int64)
    assert library().sa_paged_top_k(x.data_ptr(), n, k, out.data_ptr()) == 0
    kth = x.sort(descending=True).values[k - 1]
    above = (x > kth).nonzero().flatten()
    ties = (x == kth).nonzero().flatten()[: k - len(above)]
    assert out[:k].tolist() == above.tolist() + ties.tolist()
    assert (out[k:] == -7).all()


def test_top_k_refuses_a_k_out_of_range():
    with pytest.raises(ValueError, match="k=0"):
        top_k_positions(torch.ones(3), 0)
    with pytest.raises(ValueError, match="k=4"):
        top_k_positions(torch.ones(3), 4)


def _split_case(bs=32, segment=8, lengths=(1500, 1000), budget=256, **options):
    H, G, D = 2, 3, 64
    keys, values = sequences(lengths, H, D, torch.bfloat16, seed=3)
    cache, table = paged_cache(keys, values, bs, seed=4)
    query = torch.randn(len(lengths), H * G, D, generator=torch.Generator().manual_seed(5)).to(torch.bfloat16)
    policy = PagedPolicy(registry.build("radar+", budget=budget, **options), "radar+", segment)
    assert route(policy).mode == SPLIT
    store = PageStore.for_policy(policy, cache.shape[0], H, D, bs)
    return policy, store, cache, table, query, torch.tensor(lengths)


def test_the_profile_counts_the_lines_each_phase_reads():
    """One step's profile: every C phase named, the scoring pass's bytes exactly the candidates' centroid rows, the
    rerank's whole 32-token units (a 64-byte line per channel), and the kept scores attended with no key read."""
    policy, store, cache, table, query, lens = _split_case()
    plan = step_plan(policy, lens, 32)
    fused_decode(policy, SPLIT, store, cache, query, table, lens, 0.125, plan=plan)  # summaries built
    with StepProfile() as prof:
        fused_decode(policy, SPLIT, store, cache, query, table, lens, 0.125, plan=plan)
    assert set(prof.ns) == set(C_PHASES) and prof.calls == 1
    H, D, r = 2, 64, 4
    candidates = int(plan.plan[:, 1].sum())  # segments over both sequences
    assert prof.bytes["score"] == (candidates // r) * H * r * D * 4  # float32 rows, one page's r rows a chunk
    assert prof.bytes["rerank"] > 0 and prof.bytes["rerank"] % (D * 64) == 0  # whole units: D lines of 64 bytes
    assert prof.bytes["summarise"] == 0  # nothing new to summarise
    rows = prof.rows(bandwidth_gbps=10.0)
    assert {row["part"] for row in rows} >= {"score", "rerank", "attend_selected", "glue"}
    assert all(row["us"] >= 0 for row in rows)


def test_profiles_do_not_nest():
    with StepProfile():
        with pytest.raises(RuntimeError, match="do not nest"):
            StepProfile().__enter__()


@pytest.mark.parametrize("bs, segment", [(32, 4), (32, 8), (128, 8), (128, 16), (64, 32)])
def test_the_rerank_reads_the_shortlists_32_token_units_not_whole_pages(bs, segment):
    """A shortlisted segment of a few tokens costs the 64-byte lines of its 32-token unit (32 bf16 keys of a channel),
    not its page's: the rerank's bytes are exactly the distinct units the shortlists hold, D lines each (a longer
    segment is its own unit), and the output is the generic path's."""
    from sparseattn.vllm.paged import paged_decode

    policy, store, cache, table, query, lens = _split_case(bs=bs, segment=segment)
    plan = step_plan(policy, lens, bs)
    with StepProfile() as prof:
        got, _ = fused_decode(policy, SPLIT, store, cache, query, table, lens, 0.125, plan=plan)
    (call,) = plan.calls.values()
    unit = max(segment, 32)
    units = 0
    for b, m in enumerate(plan.plan[:, 3].tolist()):
        for h in range(2):
            units += len({i // (unit // segment) for i in call.short[b, h, :m].tolist()})
    assert prof.bytes["rerank"] == units * 64 * 64 * (unit // 32)  # D = 64 channels, a line per 32 bf16 keys
    params, gen = policy.prepare(2, 64, 0)
    want = paged_decode(policy, params, gen, cache, query.float(), table, lens, 0.125)
    torch.testing.assert_close(got, want, rtol=2e-3, atol=2e-3)


# --- fp8 caches in the fused step: the bytes read in place, each number times its layer's scale ---


@pytest.mark.parametrize("fmt", ["fp8", "fp8_e4m3", "fp8_e5m2"])
def test_every_fp8_byte_reads_as_its_float8_number(fmt):
    """All 256 bytes of each format (NaN aside): the kernel's reading (a float16 reinterpretation, times 2^8 for e4m3)
    is the float8 number torch decodes, subnormals and signed zeros included."""
    from sparseattn.vllm.paged import KVFormat
    from sparseattn.vllm.paged_kernel import FP8_CODES, cache_code

    f8 = KVFormat(fmt).fp8
    everything = torch.arange(256, dtype=torch.uint8)
    want = everything.view(f8).float()
    code, k_mul, _ = cache_code(everything, KVFormat(fmt))
    e5m2 = code == FP8_CODES["fp8_e5m2"]
    half = (everything.to(torch.int32) << 8) if e5m2 else (((everything.to(torch.int32) & 0x80) << 8) | ((everything.to(torch.int32) & 0x7F) << 7))
    got = half.to(torch.int16).view(torch.float16).float() * k_mul
    finite = ~want.isnan()
    assert torch.equal(got[finite], want[finite])


@pytest.mark.parametrize("fmt", [("fp8", 0.5, 0.25), ("fp8_e4m3", 1.0, 1.0), ("fp8_e5m2", 2.0, 0.5)], ids=lambda f: f[0])
@pytest.mark.parametrize("name, options, segment", [
    ("dense", {}, None), ("quest", {"budget": 160}, None), ("radar+", {"budget": 160}, None), ("radar+", {"budget": 160}, 8),
    ("radar+adaptive", {"budget": 192}, 4), ("radar+", {"budget": 160, "bf16_centroids": True}, 8),
], ids=["dense", "quest", "radar+", "radar+seg8", "preset-seg4", "bf16-centroids"])  # fmt: skip
def test_the_fused_step_reads_fp8_pages_as_the_generic_path_does(fmt, name, options, segment):
    """vLLM's fp8 KV cache (uint8 bytes of float8 numbers, a scale per layer for keys and for values) in the fused
    step: the generic path's output (which dequantises with torch), for every fused mode, on pages and segments."""
    from sparseattn.vllm.paged import KVFormat, paged_decode
    from tests.test_vllm_paged import fp8_cache

    kv = KVFormat(*fmt)
    bs, H, G, D, lengths = 32, 2, 3, 64, (1500, 700)
    keys, values = sequences(lengths, H, D, seed=7)
    cache, table = paged_cache([k * 2 for k in keys], [v * 2 for v in values], bs, seed=8)
    stored = fp8_cache(cache, kv)
    query = torch.randn(len(lengths), H * G, D, generator=torch.Generator().manual_seed(9)).to(torch.bfloat16)
    method = registry.build(name, **options)
    policy = PagedPolicy(method, name, segment)
    layer = policy.for_layer(3, 30)
    mode = route(layer).mode
    assert mode is not None
    store = None if not route(layer).keeps_store else PageStore.for_policy(layer, stored.shape[0], H, D, bs)
    lens = torch.tensor(lengths)
    got, _ = fused_decode(layer, mode, store, stored, query, table, lens, D**-0.5, fmt=kv)
    params, gen = layer.prepare(H, D, 3)
    want = paged_decode(layer, params, gen, stored, query.float(), table, lens, D**-0.5, fmt=kv)
    torch.testing.assert_close(got, want.float(), rtol=2e-3, atol=2e-3)


# --- vLLM's amx layout (bfloat16 on CPUs with AMX): the fused step reads it in place ---


@pytest.mark.parametrize("bs", [32, 128])
@pytest.mark.parametrize("name, options, segment", [
    ("dense", {}, None), ("streamingllm", {"budget": 300}, None), ("quest", {"budget": 320}, 16), ("radar+", {"budget": 320}, None),
    ("radar+", {"budget": 320}, 8), ("radar+adaptive", {"budget": 320}, 4), ("radar+", {"budget": 320, "split": "topp", "p": 0.9}, 8),
    ("radar+", {"budget": 256, "bf16_centroids": True, "rest": "merged", "merge": 3}, 8),
], ids=["dense", "streamingllm", "quest16", "radar+", "radar+seg8", "preset-seg4", "topp-seg8", "bf16-merged3-seg8"])  # fmt: skip
def test_the_fused_step_reads_the_amx_layout_as_the_vec_one(bs, name, options, segment):
    """The same pages in vLLM's amx layout (amx_layout) and in the vec layout: the fused step gives the same output
    from both, every mode (a merged rest's sums, a Python allocation, the tail's odd last page included), and the
    selection it reports is the same."""
    from sparseattn.vllm.paged import amx_layout

    H, G, D, lengths = 2, 3, 64, (1500, 701)
    keys, values = sequences(lengths, H, D, torch.bfloat16, seed=11)
    cache, table = paged_cache(keys, values, bs, seed=12)
    query = torch.randn(len(lengths), H * G, D, generator=torch.Generator().manual_seed(13)).to(torch.bfloat16)
    amx = amx_layout(cache)
    assert not torch.equal(amx, cache)
    policy = PagedPolicy(registry.build(name, **options), name, segment).for_layer(2, 30)
    mode = route(policy).mode
    lens = torch.tensor(lengths)
    outs = []
    for pages, layout in ((cache, "vec"), (amx, "amx")):
        store = PageStore.for_policy(policy, pages.shape[0], H, D, bs) if route(policy).keeps_store else None
        plan = step_plan(policy, lens, bs)
        outs.append(fused_decode(policy, mode, store, pages, query, table, lens, D**-0.5, plan=plan, layout=layout,
                                 with_selection=mode != SPLIT or policy.method.allocation.uniform))  # fmt: skip
    (vec_out, vec_sel), (amx_out, amx_sel) = outs
    torch.testing.assert_close(amx_out, vec_out, rtol=1e-5, atol=1e-5)
    if vec_sel is not None:
        assert torch.equal(amx_sel, vec_sel)


def test_a_policy_or_cache_the_amx_layout_does_not_hold_is_refused_before_any_work():
    from sparseattn.vllm.paged_kernel import amx_refusal

    assert amx_refusal(PagedPolicy(registry.build("radar"), "radar"), torch.bfloat16, 128, 64) is not None  # the generic path
    assert amx_refusal(PagedPolicy(registry.build("quest"), "quest", 8), torch.bfloat16, 128, 64) is None
    assert "1-token segments" in amx_refusal(PagedPolicy(registry.build("quest"), "quest", 1), torch.bfloat16, 128, 64)
    assert "float32" in amx_refusal(PagedPolicy(registry.build("dense"), "dense"), torch.float32, 128, 64)
    policy, store, cache, table, query, lens = _split_case()
    with pytest.raises(ValueError, match="layout 'avx'"):
        fused_decode(policy, SPLIT, store, cache, query, table, lens, 0.125, layout="avx")
    with pytest.raises(ValueError, match="amx layout holds bfloat16 pages"):
        fused_decode(policy, SPLIT, store, cache.float(), query, table, lens, 0.125, layout="amx")
    assert int(store.state.sum()) == 0  # nothing was summarised
