"""Every Triton kernel against its op's float64 reference, on fresh random inputs.

On a CPU the kernels run in Triton's interpreter (``TRITON_INTERPRET=1``, set below before anything
imports triton); on a GPU machine, run with ``TRITON_INTERPRET=0`` (``scripts/gpu-check.sh`` does), the
same tests run the compiled kernels on CUDA, and the ``gpu`` tests add real head sizes, half
precision and long contexts that the interpreter would take hours over.

Kernels: the split segment-attention kernel with a mask of listed segments and its log-sum-exp
(``MaskedSegmentAttention``, ``SegmentAttentionLSE``), ``dense`` (every token a sink),
``segment_log_mass`` (radar+'s rerank), ``bound_scores`` (Quest) and ``slot_attention`` (the
evicting methods, with their weights and floor).
"""

from __future__ import annotations

import importlib.util
import math
import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before any import that could import triton

import pytest  # noqa: E402
import torch  # noqa: E402
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from sparseattn.backends import REFERENCES, TorchBackend, TritonBackend  # noqa: E402
from sparseattn.ops.attention import attention_ref, segment_mask  # noqa: E402
from sparseattn.ops.layout import SegmentLayout  # noqa: E402
from sparseattn.ops.segments import SegmentKeys  # noqa: E402
from sparseattn.ops.slots import slot_attention  # noqa: E402
from sparseattn.testing import assert_close  # noqa: E402

HAS_TRITON = importlib.util.find_spec("triton") is not None
if HAS_TRITON:
    from sparseattn.backends.triton_backend import interpreting

    INTERPRETING = interpreting()
else:
    INTERPRETING = False
ON_GPU = HAS_TRITON and not INTERPRETING and torch.cuda.is_available()
#: Where the kernels run: compiled on CUDA, or interpreted on CPU tensors.
DEVICE = "cuda" if ON_GPU else "cpu"

needs_kernels = pytest.mark.skipif(
    not (HAS_TRITON and (INTERPRETING or ON_GPU)),
    reason="needs triton (pip install -e '.[dev]') running in its interpreter (TRITON_INTERPRET=1 before triton is "
    "first imported: run this file alone, or tests/test_backends.py reruns it in a fresh process) or compiled on a CUDA GPU",
)


def on_gpu_only(test):
    """Real head sizes, half precision, long contexts: too slow for the interpreter; scripts/gpu-check.sh runs them."""
    test = pytest.mark.gpu(test)
    return pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU and TRITON_INTERPRET=0 (scripts/gpu-check.sh runs it)")(test)


KERNEL_DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def generator(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def on_device(*xs):
    return tuple(x.to(DEVICE) if isinstance(x, torch.Tensor) else x for x in xs)


# --- exact segment log masses (radar+'s rerank) ------------------------------------------------------


def log_mass_call(B, H, R, S, c, D, m, shared, dtype, seed, sinks=2):
    """Keys as a view of a cache ``[B, H, t, D]`` whose unlisted segments hold NaN, queries, lists, and the clean keys."""
    gen = generator(seed)
    cache = torch.randn(B, H, sinks + S * c + 3, D, generator=gen).to(dtype)
    view = cache[:, :, sinks : sinks + S * c].view(B, H, S, c, D)
    lists = 1 if shared else R
    index = torch.stack([torch.randperm(S, generator=gen)[:m] for _ in range(B * H * lists)]).view(B, H, lists, m)
    listed = torch.zeros(B, H, S, dtype=torch.bool).scatter_(-1, index.flatten(2), True)
    clean = view.clone()
    view.masked_fill_(~listed[..., None, None], float("nan"))  # a kernel that reads an unlisted key fails
    queries = torch.randn(B, H, R, D, generator=gen) * D**-0.25
    return view, queries, index, clean


@needs_kernels
@pytest.mark.parametrize("dtype", KERNEL_DTYPES, ids=str)
@pytest.mark.parametrize("shared", [True, False], ids=["one-list", "list-per-row"])
@pytest.mark.parametrize("c, D", [(1, 16), (5, 64), (37, 80), (40, 32)], ids=lambda x: str(x))
def test_segment_log_mass_kernel_is_the_float64_logsumexp_of_each_listed_segment(c, D, shared, dtype):
    view, queries, index, clean = log_mass_call(2, 3, 4, 9, c, D, 4, shared, dtype, seed=c * 100 + D)
    factor = D**-0.25
    view, queries, index = on_device(view, queries, index)
    got = TritonBackend().segment_log_mass(SegmentKeys(view, factor, torch.float32), queries, index)
    want = REFERENCES["segment_log_mass"](SegmentKeys(clean, factor, torch.float32), queries.cpu(), index.cpu())
    assert got.dtype == torch.float32 and got.shape == (2, 3, 4, 4)
    assert_close(got.cpu(), want, torch.float32, what="log mass")  # float32 arithmetic on the exact stored keys


@needs_kernels
@pytest.mark.parametrize("m", [1, 3, 4, 5, 9])
def test_each_program_of_the_log_mass_kernel_takes_several_listed_segments_and_no_slot_past_the_list(m):
    """Programs of SEGMENTS_PER_PROGRAM (4) slots: a list of m slots ends inside a program or on its edge, and
    every listed slot is written (the output starts as NaN), none past the list (a wider buffer's tail stays NaN)."""
    from sparseattn.backends import triton_backend as tb

    view, queries, index, clean = log_mass_call(2, 2, 3, 11, 3, 16, m, False, torch.float32, seed=m)
    wide = torch.full((2, 2, 3, m + 4), float("nan"))
    got = wide[..., :m]  # the kernel writes through the strides of a view: slots past m would land in the tail
    raw, q, idx = on_device(view, queries, index)
    out = torch.full_like(got, float("nan")) if DEVICE == "cuda" else got
    with tb.on_device(q.device):
        tb.kernels(tb.interpreting()).segment_log_mass[(2 * 2 * 3, -(-m // tb.SEGMENTS_PER_PROGRAM))](
            q, raw, idx, out, *q.stride(), *raw.stride(), *idx.stride(), *out.stride(),
            2, 3, 1, 11, 3, 16, m, 0.5, BLOCK_R=1, BLOCK_C=4, BLOCK_D=16, SEGS=tb.SEGMENTS_PER_PROGRAM,
        )  # fmt: skip
    want = REFERENCES["segment_log_mass"](SegmentKeys(clean, 0.5, torch.float32), queries, index)
    assert_close(out.cpu(), want, torch.float32, what="log mass")
    if DEVICE == "cpu":
        assert wide[..., m:].isnan().all()


@needs_kernels
def test_segment_log_mass_kernel_writes_nan_for_an_index_outside_the_grid_and_reads_nothing_there():
    view, queries, index, clean = log_mass_call(1, 2, 3, 6, 4, 16, 3, True, torch.float32, seed=1)
    index[0, 1, 0, 2] = 6  # one past the grid
    index[0, 0, 0, 0] = -1
    got = TritonBackend().segment_log_mass(SegmentKeys(*on_device(view), 0.5, torch.float32), *on_device(queries, index)).cpu()
    bad = torch.zeros_like(got, dtype=torch.bool)
    bad[0, 1, :, 2] = bad[0, 0, :, 0] = True
    assert got[bad].isnan().all() and torch.isfinite(got[~bad]).all()


# --- Quest's bounds --------------------------------------------------------------------------------


@needs_kernels
@pytest.mark.parametrize("dtype", KERNEL_DTYPES, ids=str)
@pytest.mark.parametrize("G, S, D", [(1, 5, 16), (3, 70, 80), (5, 129, 64)], ids=lambda x: str(x))
def test_bound_scores_kernel_is_the_definition_in_float64(G, S, D, dtype):
    gen = generator(G * 1000 + S + D)
    keys = torch.randn(2, 3, S, 7, D, generator=gen)
    low, high = keys.amin(dim=-2).to(dtype), keys.amax(dim=-2).to(dtype)  # summaries of a storage dtype
    queries = torch.randn(2, 3, G, D, generator=gen)
    got = TritonBackend().bound_scores(*on_device(low, high, queries))
    want = REFERENCES["bound_scores"](low, high, queries)
    assert got.dtype == torch.float32 and got.shape == (2, 3, G, S)
    assert_close(got.cpu(), want, torch.float32, what="bound")
    # It is a bound: no key of a segment has a larger logit (up to float32 rounding).
    logits = torch.einsum("bhgd,bhscd->bhgsc", queries.double(), keys.double()).amax(-1)
    if dtype == torch.float32:
        assert (got.cpu().double() >= logits - 1e-4 * logits.abs().clamp(min=1)).all()


# --- slot attention (the evicting methods) ---------------------------------------------------------


@needs_kernels
@pytest.mark.parametrize("dtype", KERNEL_DTYPES, ids=str)
@pytest.mark.parametrize("softcap", [None, 20.0], ids=str)
@pytest.mark.parametrize("weights", ["none", "den-num", "den-num-floor", "num-only"])
@pytest.mark.parametrize("T", [1, 3])
def test_slot_attention_kernel_gives_the_reference_output_and_weights(T, weights, softcap, dtype):
    gen = generator(T * 10 + len(weights))
    B, H, G, S, D = 2, 2, 3, 41, 32
    q = torch.randn(B, H, G, T, D, generator=gen).to(dtype)
    keys, values = torch.randn(B, H, S, D, generator=gen).to(dtype), torch.randn(B, H, S, D, generator=gen).to(dtype)
    a, b = torch.rand(B, H, S, generator=gen), torch.rand(B, H, S, generator=gen)
    a[:, :, :5] = 0.0  # empty slots: no weight at all
    b[:, :, :5] = 0.0
    den, num, floor = {"none": (None, None, None), "den-num": (a, b, None), "den-num-floor": (a, b, b), "num-only": (None, b, None)}[weights]
    out, probs = TritonBackend().slot_attention(*on_device(q, keys, values, den, num), 0.3, softcap, on_device(floor)[0])
    want = REFERENCES["slot_attention"](q, keys, values, den, num, 0.3, softcap, floor)
    assert out.dtype == probs.dtype == torch.float32 and probs.shape == (B, H, G, T, S)
    assert_close(out.cpu(), want, dtype)
    double = [None if w is None else w.double() for w in (den, num, floor)]
    _, want_probs = slot_attention(q.double(), keys.double(), values.double(), double[0], double[1], 0.3, softcap, double[2])
    assert_close(probs.cpu(), want_probs, dtype, what="probs")


# --- segment attention with a mask of listed segments, and each head's log-sum-exp ------------------


def masked_call(seed, dtype, shared, G=3, D=32, c=5, n_seg=9, k=4, sinks=2, window=6, buffer=2):
    gen = generator(seed)
    lay = SegmentLayout(length=sinks + n_seg * c + buffer, sinks=sinks, segment_size=c, n_segments=n_seg, window=window)
    B, H = 2, 2
    Gs = 1 if shared else G
    segments = torch.stack([torch.randperm(n_seg, generator=gen)[:k] for _ in range(B * H * Gs)]).view(B, H, Gs, k)
    valid = torch.rand(B, H, Gs, k, generator=gen) < 0.6
    q = torch.randn(B, H, G, D, generator=gen).to(dtype)
    keys = torch.randn(B, H, lay.length + 4, D, generator=gen).to(dtype)[:, :, : lay.length]
    values = torch.randn(B, H, lay.length + 4, D, generator=gen).to(dtype)[:, :, : lay.length]
    attended = segment_mask(lay, segments, G, valid)
    poisoned_k, poisoned_v = (x.masked_fill(~attended.any(2).unsqueeze(-1), float("nan")) for x in (keys, values))
    return lay, q, keys, values, poisoned_k, poisoned_v, segments, valid, attended


@needs_kernels
@pytest.mark.parametrize("dtype", KERNEL_DTYPES, ids=str)
@pytest.mark.parametrize("shared", [True, False], ids=["shared", "perhead"])
@pytest.mark.parametrize("softcap", [None, 30.0], ids=str)
def test_masked_kernel_attends_only_the_flagged_segments_and_returns_each_heads_log_sum_exp(softcap, shared, dtype):
    lay, q, keys, values, pk, pv, segments, valid, attended = masked_call(7 + shared, dtype, shared)
    backend = TritonBackend(block_n=16, num_splits=3)
    out, lse = backend.segment_attention_lse(*on_device(q, pk, pv), lay, *on_device(segments, valid), 0.3, softcap)
    assert_close(out.cpu(), attention_ref(q, keys, values, attended, 0.3, softcap), dtype)
    logits = torch.einsum("bhgd,bhtd->bhgt", q.double(), keys.double()) * 0.3
    logits = logits if softcap is None else softcap * torch.tanh(logits / softcap)
    want = torch.logsumexp(logits.masked_fill(~attended, float("-inf")), dim=-1)
    assert lse.shape == want.shape and lse.dtype == torch.float32
    assert_close(lse.cpu(), want, torch.float32 if dtype == torch.float32 else dtype, what="lse")
    masked = backend.segment_attention_masked(*on_device(q, pk, pv), lay, *on_device(segments, valid), 0.3, softcap)
    assert torch.equal(masked, out)


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), G=st.integers(1, 6), k=st.integers(0, 6), S=st.integers(1, 12), flags=st.booleans())
def test_the_union_of_a_groups_selections_lists_each_attended_segment_once_with_its_heads(seed, G, k, S, flags):
    """union_selection against a loop: the segments some head attends, ascending, each once, bit g for head g."""
    from sparseattn.backends.triton_backend import union_selection

    gen = generator(seed)
    k = min(k, S)
    segments = torch.stack([torch.randperm(S, generator=gen)[:k] for _ in range(2 * G)]).view(1, 2, G, k)
    valid = torch.rand(1, 2, G, k, generator=gen) < 0.5 if flags else None
    union, bits, count = union_selection(segments, valid, S)
    assert union.shape == bits.shape == (1, 2, 1, min(G * k, S)) and bits.dtype == count.dtype == torch.int32
    for h in range(2):
        heads = {}
        for g in range(G):
            for i in range(k):
                if valid is None or valid[0, h, g, i]:
                    heads[int(segments[0, h, g, i])] = heads.get(int(segments[0, h, g, i]), 0) | 1 << g
        n = len(heads)
        assert int(count[0, h]) == n
        assert union[0, h, 0, :n].tolist() == sorted(heads)
        assert bits[0, h, 0, :n].tolist() == [heads[s] for s in sorted(heads)]
        assert not bits[0, h, 0, n:].any()  # the unused entries: nothing read, nobody attends


@needs_kernels
@pytest.mark.parametrize("overlap", ["same", "disjoint", "one head empty"])
def test_per_head_selections_are_attended_as_their_union_read_once(overlap, monkeypatch):
    """One program per KV group reads the union (a spy on the launch), and each head still attends its own
    segments only (keys and values no head attends are NaN), as the float64 reference says."""
    import sparseattn.backends.triton_backend as tb

    lay, q, keys, values, *_ = masked_call(21, torch.float32, shared=False, G=3, k=3)
    B, H, G, k = 2, 2, 3, 3
    base = torch.tensor([1, 4, 6])
    if overlap == "same":  # every head the same three segments, in another order each
        segments = torch.stack([base[torch.randperm(3, generator=generator(i))] for i in range(B * H * G)]).view(B, H, G, k)
    else:
        segments = torch.tensor([[0, 1, 2], [3, 4, 5], [6, 7, 8]]).expand(B, H, G, k)
    valid = torch.ones(B, H, G, k, dtype=torch.bool)
    if overlap == "one head empty":
        valid[:, :, 1] = False
    attended = segment_mask(lay, segments, G, valid)
    pk, pv = (x.masked_fill(~attended.any(2).unsqueeze(-1), float("nan")) for x in (keys, values))
    launches = []
    launch = tb.segment_decode_partials
    monkeypatch.setattr(tb, "segment_decode_partials", lambda *a, **kw: launches.append((a[4].shape, kw["count"].tolist())) or launch(*a, **kw))
    out, lse = TritonBackend(block_n=16, num_splits=2).segment_attention_lse(*on_device(q, pk, pv), lay, *on_device(segments, valid), 0.3, None)
    used = {"same": 3, "disjoint": 9, "one head empty": 6}[overlap]  # of a static G k = 9 entries per KV group
    assert launches == [((B, H, 1, G * k), [[used] * H] * B)]
    assert_close(out.cpu(), attention_ref(q, keys, values, attended, 0.3, None), torch.float32)
    logits = torch.einsum("bhgd,bhtd->bhgt", q.double(), keys.double()) * 0.3
    assert_close(lse.cpu(), torch.logsumexp(logits.masked_fill(~attended, float("-inf")), dim=-1), torch.float32, what="lse")


@needs_kernels
def test_a_program_per_head_and_the_union_give_one_answer():
    """TritonBackend(union=False), the A/B row of benchmarks/attention.py, runs a program per query head: the same
    attention and log-sum-exp as the union (float32 sums in another order), both the float64 reference's."""
    lay, q, keys, values, pk, pv, segments, valid, attended = masked_call(5, torch.float32, shared=False)
    args = (*on_device(q, pk, pv), lay, *on_device(segments, valid), 0.3, None)
    union = TritonBackend(block_n=16, num_splits=2).segment_attention_lse(*args)
    apart = TritonBackend(block_n=16, num_splits=2, union=False).segment_attention_lse(*args)
    for a, b in zip(union, apart):
        assert_close(a.cpu(), b.cpu().double(), torch.float32)
    assert_close(apart[0].cpu(), attention_ref(q, keys, values, attended, 0.3, None), torch.float32)
    with pytest.raises(ValueError, match="union must be True or False"):
        TritonBackend(union=1)


@needs_kernels
def test_the_log_sum_exp_over_an_empty_selection_is_the_mass_of_the_sinks_and_tail():
    lay, q, keys, values, *_ = masked_call(3, torch.float32, True)
    none = torch.zeros(2, 2, 1, 0, dtype=torch.long)
    _, lse = TritonBackend().segment_attention_lse(*on_device(q, keys, values), lay, on_device(none)[0], None, 0.3)
    always = torch.cat([keys[:, :, : lay.sink_end], keys[:, :, lay.tail_start :]], dim=2).double()
    want = torch.logsumexp(torch.einsum("bhgd,bhtd->bhgt", q.double(), always) * 0.3, dim=-1)
    assert_close(lse.cpu(), want, torch.float32, what="lse")


@needs_kernels
@pytest.mark.parametrize("dtype", KERNEL_DTYPES, ids=str)
def test_dense_kernel_attends_every_token(dtype):
    gen = generator(11)
    q = torch.randn(2, 3, 5, 48, generator=gen).to(dtype)
    keys = torch.randn(2, 40, 3, 48, generator=gen).to(dtype).transpose(1, 2)  # a token-major cache, read by strides
    values = torch.randn(2, 40, 3, 48, generator=gen).to(dtype).transpose(1, 2)
    got = TritonBackend(block_n=16, num_splits=2).dense(*on_device(q, keys, values), 0.2, None)
    assert_close(got.cpu(), REFERENCES["dense"](q, keys, values, 0.2, None), dtype)


# --- on the GPU: real head sizes, half precision, long contexts -------------------------------------


def cuda_randn(gen, *shape, dtype=torch.float32):
    return torch.randn(*shape, device="cuda", generator=gen).to(dtype)


@on_gpu_only
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("t", [4096, 131072])
def test_gpu_segment_attention_dense_and_masks_at_real_sizes(t, D, dtype):
    gen = torch.Generator(device="cuda").manual_seed(t + D)
    B, H, G = 2, 8, 4
    c = max(1, math.isqrt(t) // 8)
    n_seg = (t - 4 - 64) // c
    lay = SegmentLayout(length=t, sinks=4, segment_size=c, n_segments=n_seg, window=64)
    q, keys, values = cuda_randn(gen, B, H, G, D, dtype=dtype), cuda_randn(gen, B, H, t, D, dtype=dtype), cuda_randn(gen, B, H, t, D, dtype=dtype)
    k = min(n_seg, 4096 // c)
    for Gs in (1, G):  # a selection shared by the KV group, and one per query head
        segments = torch.stack([torch.randperm(n_seg, device="cuda", generator=gen)[:k] for _ in range(B * H * Gs)]).view(B, H, Gs, k)
        valid = torch.rand(B, H, Gs, k, device="cuda", generator=gen) < 0.7
        backend = TritonBackend()
        got = backend.segment_attention(q, keys, values, lay, segments)
        cpu = [x[:1].cpu() for x in (q, keys, values, segments, valid)]
        assert_close(got[:1].cpu(), REFERENCES["segment_attention"](cpu[0], cpu[1], cpu[2], lay, cpu[3]), dtype)
        out, lse = backend.segment_attention_lse(q, keys, values, lay, segments, valid)
        mask = segment_mask(lay, cpu[3], G, cpu[4])
        assert_close(out[:1].cpu(), attention_ref(cpu[0], cpu[1], cpu[2], mask), dtype)
        logits = torch.einsum("bhgd,bhtd->bhgt", cpu[0].double(), cpu[1].double()) * D**-0.5
        assert_close(lse[:1].cpu(), torch.logsumexp(logits.masked_fill(~mask, float("-inf")), -1), dtype, what="lse")
    want = REFERENCES["dense"](q[:1].cpu(), keys[:1].cpu(), values[:1].cpu())
    assert_close(TritonBackend().dense(q, keys, values)[:1].cpu(), want, dtype)
    # The torch backend's dense step attends a half-precision cache on CUDA as stored (no float32 copy).
    assert_close(TorchBackend().dense(q, keys, values)[:1].cpu(), want, dtype, what="torch dense")


@on_gpu_only
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("D", [64, 128])
def test_gpu_log_mass_bounds_and_slots_at_real_sizes(D, dtype):
    gen = torch.Generator(device="cuda").manual_seed(D)
    B, H, G, t = 2, 8, 4, 131072
    c = math.isqrt(t) // 8
    S = t // c
    cache = cuda_randn(gen, B, H, S * c, D, dtype=dtype)
    raw = cache.view(B, H, S, c, D)
    queries = cuda_randn(gen, B, H, G, D) * D**-0.25
    index = torch.stack([torch.randperm(S, device="cuda", generator=gen)[:180] for _ in range(B * H)]).view(B, H, 1, 180)
    got = TritonBackend().segment_log_mass(SegmentKeys(raw, D**-0.25, torch.float32), queries, index)
    want = REFERENCES["segment_log_mass"](SegmentKeys(raw[:1].cpu(), D**-0.25, torch.float32), queries[:1].cpu(), index[:1].cpu())
    assert_close(got[:1].cpu(), want, torch.float32, what="log mass")
    low, high = raw.amin(-2), raw.amax(-2)
    bounds = TritonBackend().bound_scores(low, high, queries)
    assert_close(bounds[:1].cpu(), REFERENCES["bound_scores"](low[:1].cpu(), high[:1].cpu(), queries[:1].cpu()), torch.float32, what="bound")
    slots = 4096
    q5 = cuda_randn(gen, B, H, G, 1, D, dtype=dtype)
    sk, sv = cache[:, :, :slots], cache[:, :, slots : 2 * slots]
    den, num = torch.rand(B, H, slots, device="cuda", generator=gen), torch.rand(B, H, slots, device="cuda", generator=gen)
    out, probs = TritonBackend().slot_attention(q5, sk, sv, den, num, None, None, num)
    cpu = [x[:1].cpu() for x in (q5, sk, sv, den, num)]
    assert_close(out[:1].cpu(), REFERENCES["slot_attention"](*cpu, None, None, cpu[4]), dtype)
    _, want_probs = slot_attention(*(x.double() for x in cpu), None, None, cpu[4].double())
    assert_close(probs[:1].cpu(), want_probs, dtype, what="probs")
