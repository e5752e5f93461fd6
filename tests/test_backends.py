"""Attention backends: every kernel matches its float64 reference; dispatch explains its refusals."""

import os

# Triton wraps its own language helpers (tl.zeros, tl.max, ...) for the interpreter or the compiler
# when triton.language is first imported, as TRITON_INTERPRET says then; a later change is ignored.
# So this comes before any import that could import triton. setdefault keeps an explicit
# TRITON_INTERPRET=0, the way to test the compiled kernel on a GPU (the `gpu` tests).
os.environ.setdefault("TRITON_INTERPRET", "1")

import importlib.util  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import dataclasses  # noqa: E402
from dataclasses import dataclass  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

from sparseattn.backends import (  # noqa: E402
    BACKENDS,
    EXTENSION_OPS,
    OPS,
    REFERENCES,
    AttentionBackend,
    BackendBase,
    Capability,
    CpuBackend,
    TorchBackend,
    TritonBackend,
    XformersBackend,
    merge_partials,
    backend_names,
    merge_partials_ref,
    select_backend,
)
from sparseattn.backends.cpu_kernels import cpu_kernel_refusal, supported_dtypes  # noqa: E402
from sparseattn.backends.triton_backend import interpreting, segment_decode_partials  # noqa: E402
from sparseattn.ops.attention import segment_attention_ref, segment_mask  # noqa: E402
from sparseattn.ops.layout import SegmentLayout  # noqa: E402
from sparseattn.ops.segments import RestSums  # noqa: E402
from sparseattn.testing import assert_close  # noqa: E402
from host_reads import host_reads  # noqa: E402

HAS_TRITON = importlib.util.find_spec("triton") is not None
INTERPRETING = HAS_TRITON and interpreting()
HAS_CUDA = torch.cuda.is_available()
CPU_KERNEL = cpu_kernel_refusal()  # None when the C kernel built and loaded here
AUTO_ON_CPU = "cpu" if CPU_KERNEL is None else "torch"


#: How to run the interpreter tests when this process cannot (see needs_interpreter).
RUN_INTERPRETED = "run them alone with `TRITON_INTERPRET=1 python -m pytest tests/test_backends.py`"


def needs_interpreter(test):
    """The kernel tests on CPU: skipped, with the reason, when triton is missing or runs compiled."""
    test = pytest.mark.skipif(
        not HAS_TRITON,
        reason="needs triton, which is not installed: these tests run the Triton kernel on CPU in its interpreter; "
        "install it with `pip install -e '.[dev]'` (triton==3.9.0, Linux x86-64)",
    )(test)
    return pytest.mark.skipif(
        HAS_TRITON and not INTERPRETING,
        reason="needs triton in interpreter mode (TRITON_INTERPRET=1), but it was imported compiled in this process "
        "(TRITON_INTERPRET=0 was set, or another test module imported triton first, as in a full run); "
        "test_interpreter_tests_in_a_fresh_process runs these tests in a fresh process instead, or "
        + RUN_INTERPRETED,
    )(test)


#: Why the compiled-kernel tests skip on a machine without a GPU, and where their code is tested instead.
NO_GPU = (
    "needs a CUDA GPU: the compiled Triton kernel runs only on a GPU; on CPU the same kernel code runs in "
    "the Triton interpreter in the tests of test_backends.py that are not marked gpu (run with TRITON_INTERPRET=1)"
)


def needs_compiled_gpu(test):
    """The compiled kernel on CUDA: run with ``TRITON_INTERPRET=0 pytest -m gpu tests/test_backends.py``."""
    test = pytest.mark.gpu(test)
    test = pytest.mark.skipif(not HAS_CUDA, reason=NO_GPU)(test)
    test = pytest.mark.skipif(
        not HAS_TRITON, reason="needs triton, which is not installed: `pip install -e '.[gpu]'` on a CUDA machine"
    )(test)
    return pytest.mark.skipif(
        INTERPRETING,
        reason="needs triton compiled, but this process runs it in the interpreter (TRITON_INTERPRET=1); on a GPU "
        "run `TRITON_INTERPRET=0 python -m pytest -m gpu tests/test_backends.py`",
    )(test)


DTYPES = [torch.float32, torch.float16, torch.bfloat16]
SOFTCAPS = [None, 30.0]


@dataclass(frozen=True)
class Case:
    """One decode step: shapes, the layout of the past, and the selection (k: "0", "1" or "all")."""

    B: int
    H: int
    G: int
    D: int
    c: int
    n_seg: int
    sinks: int
    window: int
    buffer: int
    k: str
    shared: bool
    cache: str = "bhtd"  # the capacity buffer's memory layout: [B, H, cap, D] or [B, cap, H, D]

    @property
    def layout(self) -> SegmentLayout:
        length = self.sinks + self.n_seg * self.c + self.buffer
        return SegmentLayout(length=length, sinks=self.sinks, segment_size=self.c, n_segments=self.n_seg, window=self.window)

    @property
    def n_sel(self) -> int:
        return {"0": 0, "1": 1, "3": 3, "all": self.n_seg}[self.k]

    @property
    def id(self) -> str:
        lay = self.layout
        return (
            f"B{self.B}H{self.H}G{self.G}-D{self.D}-c{self.c}n{self.n_seg}-s{self.sinks}w{self.window}b{self.buffer}"
            f"-t{lay.length}-k{self.k}-{'shared' if self.shared else 'perhead'}-{self.cache}"
        )


CASES = [
    Case(1, 1, 1, 16, c=1, n_seg=7, sinks=0, window=0, buffer=1, k="1", shared=True),
    Case(2, 2, 3, 64, c=5, n_seg=6, sinks=3, window=7, buffer=2, k="all", shared=False, cache="bthd"),
    Case(1, 2, 3, 16, c=16, n_seg=3, sinks=3, window=0, buffer=5, k="1", shared=False),
    Case(2, 1, 3, 64, c=5, n_seg=9, sinks=0, window=7, buffer=3, k="0", shared=True, cache="bthd"),
    Case(1, 1, 3, 16, c=5, n_seg=4, sinks=0, window=0, buffer=0, k="all", shared=True),  # no tail
    Case(2, 2, 1, 16, c=16, n_seg=2, sinks=3, window=7, buffer=0, k="all", shared=True),  # the window cuts a segment
    Case(1, 1, 3, 16, c=1, n_seg=13, sinks=3, window=7, buffer=0, k="all", shared=False, cache="bthd"),
    Case(2, 2, 3, 16, c=5, n_seg=5, sinks=3, window=0, buffer=0, k="0", shared=True),  # sinks only
    Case(1, 2, 3, 80, c=5, n_seg=4, sinks=3, window=7, buffer=1, k="all", shared=True),  # D padded to 128
    Case(1, 1, 3, 16, c=5, n_seg=3, sinks=3, window=100, buffer=2, k="all", shared=False),  # the tail covers all
    # few listed segments against a large grid: the kernel sorts them instead of scanning the grid
    Case(2, 2, 3, 16, c=2, n_seg=150, sinks=2, window=5, buffer=1, k="3", shared=False),
    Case(1, 2, 4, 64, c=3, n_seg=100, sinks=0, window=4, buffer=2, k="3", shared=True, cache="bthd"),
]


def make_inputs(case: Case, dtype: torch.dtype, seed: int = 0, poison: bool = True):
    """Fresh random q, K/V views of a capacity buffer, and distinct segment indices.

    Returns ``(q, keys, values, segments, clean_keys, clean_values)``: ``keys``/``values`` are
    non-contiguous views whose never-attended tokens and capacity slack hold NaN (a kernel that reads
    them fails), ``clean_*`` the same views without NaN, for the reference.
    """
    gen = torch.Generator().manual_seed(seed)
    lay = case.layout
    B, H, G, D = case.B, case.H, case.G, case.D
    cap = lay.length + 5
    Gs = 1 if case.shared else G
    segments = torch.stack([torch.randperm(case.n_seg, generator=gen)[: case.n_sel] for _ in range(B * H * Gs)])
    segments = segments.view(B, H, Gs, case.n_sel)
    q = torch.randn(B, H, G, D, generator=gen).to(dtype)

    def cache() -> tuple[torch.Tensor, torch.Tensor]:
        if case.cache == "bhtd":
            buf = torch.randn(B, H, cap, D, generator=gen).to(dtype)
            view = buf.narrow(2, 0, lay.length)
        else:
            buf = torch.randn(B, cap, H, D, generator=gen).to(dtype)
            view = buf.narrow(1, 0, lay.length).transpose(1, 2)
        clean = view.clone()
        if poison:
            view.fill_(float("nan"))
            attended = segment_mask(lay, segments, G).any(dim=2)  # [B, H, t]: read by some head of the group
            view.copy_(torch.where(attended.unsqueeze(-1), clean, view))
            buf.narrow(2 if case.cache == "bhtd" else 1, lay.length, cap - lay.length).fill_(float("nan"))
        return view, clean

    keys, clean_keys = cache()
    values, clean_values = cache()
    return q, keys, values, segments, clean_keys, clean_values


def reference(case, q, keys, values, segments, softcap):
    return segment_attention_ref(q, keys, values, case.layout, segments, softcap=softcap)


def check_against_reference(backend, case, dtype, softcap=None, seed=0, device="cpu"):
    """``backend.segment_attention`` on ``case``'s poisoned inputs (moved to ``device``) is float32, shaped as
    ``q``, and the float64 reference over the clean inputs."""
    q, keys, values, segments, clean_k, clean_v = make_inputs(case, dtype, seed=seed)
    dq, dk, dv, ds = (x.to(device) for x in (q, keys, values, segments))
    out = backend.segment_attention(dq, dk, dv, case.layout, ds, softcap=softcap)
    assert out.dtype == torch.float32 and out.shape == q.shape
    assert_close(out.cpu(), reference(case, q, clean_k, clean_v, segments, softcap), dtype)


# --- the float64 references agree with each other --------------------------------------------------


def test_softcap_bounds_every_logit():
    # With one attended key per side of the cap, the weights follow from tanh alone.
    lay = SegmentLayout(length=2, sinks=2, segment_size=1, n_segments=0)
    q = torch.tensor([[[[1000.0]]]], dtype=torch.float64)
    keys = torch.tensor([[[[1.0], [-1.0]]]], dtype=torch.float64)
    values = torch.tensor([[[[1.0], [0.0]]]], dtype=torch.float64)
    segments = torch.zeros(1, 1, 1, 0, dtype=torch.long)
    out = segment_attention_ref(q, keys, values, lay, segments, scale=1.0, softcap=2.0)
    w = torch.softmax(torch.tensor([2.0 * torch.tanh(torch.tensor(500.0)), -2.0 * torch.tanh(torch.tensor(500.0))]), 0)
    assert torch.allclose(out.flatten(), w[:1].double())


# --- torch backend ---------------------------------------------------------------------------------


@pytest.mark.parametrize("softcap", SOFTCAPS, ids=str)
@pytest.mark.parametrize("dtype", [*DTYPES, torch.float64], ids=str)
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_torch_backend_matches_reference(case, dtype, softcap):
    # The torch op reads non-attended tokens of the dense parts' views, so no NaN poisoning here.
    q, keys, values, segments, _, _ = make_inputs(case, dtype, poison=False)
    out = TorchBackend().segment_attention(q, keys, values, case.layout, segments, softcap=softcap)
    assert out.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    assert_close(out, reference(case, q, keys, values, segments, softcap), dtype)


# --- cpu kernel (C, compiled on first use) --------------------------------------------------------

needs_cpu_kernel = pytest.mark.skipif(CPU_KERNEL is not None, reason=f"the C kernel is unavailable: {CPU_KERNEL}")

# Enough tokens per KV head (>= 2 x 512) that a row is split into parts merged by log-sum-exp, head dims
# with (64, 128) and without (96) a specialised body, MHA (G = 1) and a 7-head group.
SPLIT_CASES = [
    Case(1, 1, 4, 128, c=100, n_seg=40, sinks=4, window=64, buffer=37, k="all", shared=False),
    Case(1, 2, 4, 64, c=64, n_seg=50, sinks=0, window=0, buffer=11, k="1", shared=True, cache="bthd"),
    Case(2, 1, 7, 96, c=33, n_seg=70, sinks=3, window=9, buffer=5, k="all", shared=True),
    Case(1, 1, 1, 128, c=300, n_seg=9, sinks=1, window=0, buffer=2, k="all", shared=False),
]


@needs_cpu_kernel
@pytest.mark.parametrize("softcap", SOFTCAPS, ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", CASES + SPLIT_CASES, ids=lambda c: c.id)
def test_cpu_kernel_matches_reference(case, dtype, softcap):
    # Poisoned views: a token the selection does not attend, or the capacity slack, is NaN.
    check_against_reference(CpuBackend(), case, dtype, softcap)


@needs_cpu_kernel
@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("case", SPLIT_CASES[:2], ids=lambda c: c.id)
def test_cpu_kernel_any_thread_count_gives_the_reference(case, threads):
    # The thread count sets how a row is split into parts: every split must merge to the same softmax.
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(threads)
        check_against_reference(CpuBackend(), case, torch.float32, seed=threads)
    finally:
        torch.set_num_threads(before)


@needs_cpu_kernel
@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("case", [c for c in CASES + SPLIT_CASES if c.k != "0"], ids=lambda c: c.id)
def test_cpu_kernel_with_a_mask_attends_each_selections_flagged_segments(case, dtype, seed):
    """A budget allocation's split: selection (b, h, s) attends the listed segments flagged in valid[b, h, s]
    (the others are NaN in the cache: reading one fails the test), as attention_ref under that mask."""
    from sparseattn.ops.attention import attention_ref

    q, _, _, segments, clean_k, clean_v = make_inputs(case, dtype, seed=seed, poison=False)
    gen = torch.Generator().manual_seed(100 + seed)
    valid = torch.rand(segments.shape, generator=gen) < 0.5
    mask = segment_mask(case.layout, segments, case.G, valid)
    read = mask.any(2).unsqueeze(-1)  # [B, H, t, 1]: what some head of the group attends
    keys = torch.where(read, clean_k, torch.full_like(clean_k, float("nan")))
    values = torch.where(read, clean_v, torch.full_like(clean_v, float("nan")))
    if not bool(mask.any(-1).all()):  # a head with no token (nothing flagged, no sinks, no tail): refused, not NaN
        with pytest.raises(ValueError, match="attends no token"):
            CpuBackend().segment_attention_masked(q, keys, values, case.layout, segments, valid)
        return
    out = CpuBackend().segment_attention_masked(q, keys, values, case.layout, segments, valid)
    assert_close(out, attention_ref(q, clean_k, clean_v, mask), dtype)


@needs_cpu_kernel
@pytest.mark.parametrize("threads", [1, 3])
@pytest.mark.parametrize("softcap", [None, 5.0])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("case", [c for c in CASES + SPLIT_CASES if c.k != "0"], ids=lambda c: c.id)
def test_cpu_kernel_returns_each_heads_log_sum_exp_of_what_it_attends(case, dtype, softcap, threads):
    """``segment_attention_lse``: the masked output and ``log sum exp(logit)`` over each head's attended
    tokens (float64 reference), whatever the split of a row into parts (the thread count)."""
    from sparseattn.ops.attention import attention_ref

    q, keys, values, segments, _, _ = make_inputs(case, dtype, seed=threads, poison=False)
    gen = torch.Generator().manual_seed(7 + threads)
    valid = torch.rand(segments.shape, generator=gen) < 0.7
    mask = segment_mask(case.layout, segments, case.G, valid)
    if not bool(mask.any(-1).all()):
        valid[..., 0] = True  # every head attends something here (an empty head is refused: tested above)
        mask = segment_mask(case.layout, segments, case.G, valid)
    if not bool(mask.any(-1).all()):
        pytest.skip("a head of this case attends nothing whatever is flagged")
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(threads)
        out, lse = CpuBackend().segment_attention_lse(q, keys, values, case.layout, segments, valid, None, softcap)
    finally:
        torch.set_num_threads(before)
    D = q.shape[-1]
    logits = torch.einsum("bhgd,bhtd->bhgt", q.double(), keys[:, :, : mask.shape[-1]].double()) * D**-0.5
    if softcap is not None:
        logits = softcap * torch.tanh(logits / softcap)
    ref_lse = torch.logsumexp(logits.masked_fill(~mask, float("-inf")), dim=-1)
    assert lse.shape == ref_lse.shape and lse.dtype == torch.float32
    torch.testing.assert_close(lse.double(), ref_lse, rtol=1e-5, atol=1e-4)
    assert_close(out, attention_ref(q, keys, values, mask, softcap=softcap), dtype)


@needs_cpu_kernel
def test_cpu_kernel_skips_unflagged_indices_and_refuses_a_flagged_bad_one():
    call = small_call()
    values = torch.randn_like(call["keys"])
    segments = torch.tensor([0, 10**6]).view(1, 1, 1, 2).expand(1, 2, 1, 2)  # the second is out of range
    skip = torch.tensor([True, False]).expand(1, 2, 1, 2)
    out = CpuBackend().segment_attention_masked(call["q"], call["keys"], values, SMALL_LAYOUT, segments, skip)
    first = CpuBackend().segment_attention(call["q"], call["keys"], values, SMALL_LAYOUT, segments[..., :1])
    torch.testing.assert_close(out, first)
    with pytest.raises(ValueError, match="cpu segment attention failed"):
        CpuBackend().segment_attention_masked(call["q"], call["keys"], values, SMALL_LAYOUT, segments, torch.ones(1, 2, 1, 2, dtype=torch.bool))


@needs_cpu_kernel
def test_cpu_kernel_large_logits_do_not_overflow():
    # Logits near 1e4: exp is taken after the running maximum is subtracted, so nothing overflows.
    case = SPLIT_CASES[1]
    q, keys, values, segments, clean_k, clean_v = make_inputs(case, torch.float32, poison=False)
    q = q * 1000
    out = CpuBackend().segment_attention(q, keys, values, case.layout, segments)
    assert_close(out, reference(case, q, clean_k, clean_v, segments, None), torch.float32)


@needs_cpu_kernel
def test_cpu_kernel_rejects_an_out_of_range_segment():
    call = small_call()
    values = torch.randn_like(call["keys"])
    bad = torch.tensor([2, 3]).view(1, 1, 1, 2).expand(1, 2, 1, 2)
    with pytest.raises(ValueError, match=r"segment index is outside \[0, n_segments\)"):
        CpuBackend().segment_attention(call["q"], call["keys"], values, SMALL_LAYOUT, bad)


def test_cpu_backend_refusals_say_why():
    call = small_call()
    assert "dtype torch.float64 is not supported" in CpuBackend().refusal(ATTEND, **small_call(torch.float64))
    q = call["q"].clone().requires_grad_()
    with torch.enable_grad():
        assert "no backward" in CpuBackend().refusal(ATTEND, q, call["keys"])
    many = torch.randn(1, 2, 65, 16)
    assert "at most 64" in CpuBackend().refusal(ATTEND, many, call["keys"])
    assert CpuBackend().refusal("slot_attention", call["q"].unsqueeze(3), call["keys"]).startswith(
        "it does not implement slot_attention (it implements: segment_attention, segment_log_mass, dense)"
    )
    if CPU_KERNEL is None:
        strided = torch.randn(1, 2, 16, 12).transpose(-1, -2)
        assert "head dim is not contiguous" in CpuBackend().refusal(ATTEND, call["q"], strided)


@needs_cpu_kernel
def test_loading_the_cpu_kernel_keeps_subnormal_floats():
    # The kernel is compiled with -ffast-math; linked with it, its constructor would set flush-to-zero
    # for the whole process. A fresh process, so that this one's state does not hide it.
    script = (
        "from sparseattn.backends.cpu_kernels import load_library\n"
        "tiny = float.fromhex('0x1p-1074')\n"
        "assert tiny * 2 == float.fromhex('0x1p-1073')\n"
        "load_library()\n"
        "print(tiny * 2 == float.fromhex('0x1p-1073'), tiny + 0.0 > 0)\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["True", "True"]


def test_cpu_backend_without_a_compiler_refuses_and_auto_falls_to_torch(tmp_path):
    # A fresh process and an empty kernel cache, so that the kernel must be built, with a compiler that does not exist.
    script = (
        "import torch, sparseattn.backends as b\n"
        "from sparseattn.ops.layout import SegmentLayout\n"
        "lay = SegmentLayout(length=12, sinks=1, segment_size=3, n_segments=3)\n"
        "kw = dict(q=torch.randn(1, 2, 3, 16), keys=torch.randn(1, 2, 12, 16))\n"
        "print(b.CpuBackend().refusal('segment_attention', **kw))\n"
        "print('auto:', b.select_backend(**kw).name)\n"
    )
    env = {**os.environ, "CC": str(tmp_path / "no-such-cc"), "SPARSEATTN_CACHE": str(tmp_path / "cache")}
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    refusal, auto = done.stdout.splitlines()
    assert refusal.startswith("the kernel is unavailable: the C compiler") and "no-such-cc" in refusal
    assert auto == "auto: torch"


# A foreign or corrupt library at the kernel's cached path (defect 5 of issue 14): it must be rebuilt
# (or, where the build itself gives a foreign library, refused with the reason), never crash the process.

KERNEL_PROBE = (
    "import torch, sparseattn.backends as b\n"
    "from sparseattn.ops.layout import SegmentLayout\n"
    "from sparseattn.ops.attention import segment_attention_ref\n"
    "lay = SegmentLayout(length=12, sinks=1, segment_size=3, n_segments=3)\n"
    "q, k, v = torch.randn(1, 2, 3, 16), torch.randn(1, 2, 12, 16), torch.randn(1, 2, 12, 16)\n"
    "seg = torch.zeros(1, 2, 1, 1, dtype=torch.long)\n"
    "print('refusal:', b.CpuBackend().refusal('segment_attention', q, k))\n"
    "print('auto:', b.select_backend(q=q, keys=k).name)\n"
    "if b.CpuBackend().refusal('segment_attention', q, k) is None:\n"
    "    out = b.CpuBackend().segment_attention(q, k, v, lay, seg)\n"
    "    ref = segment_attention_ref(q.double(), k.double(), v.double(), lay, seg)\n"
    "    print('max error:', float((out.double() - ref).abs().max()))\n"
)


def run_kernel_probe(cache, **env):
    """KERNEL_PROBE in a fresh process (the dynamic loader and the load cache start empty) with the
    kernel cached under ``cache``; returns its output lines."""
    env = {**os.environ, "SPARSEATTN_CACHE": str(cache), **env}
    done = subprocess.run([sys.executable, "-c", KERNEL_PROBE], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, f"the probe crashed instead of refusing:\n{done.stderr[-3000:]}"
    return done.stdout.splitlines()


@pytest.fixture
def foreign_library(tmp_path):
    """A real shared library that exports none of the kernel's symbols."""
    from sparseattn.backends.cpu_kernels import find_compiler

    compiler = find_compiler()
    if compiler is None:
        pytest.skip("needs a C compiler (gcc, clang or $CC) to build a foreign library for the kernel cache")
    source = tmp_path / "foreign.c"
    source.write_text("int not_the_kernel(void) { return 42; }\n")
    library = tmp_path / "foreign.so"
    subprocess.run([compiler, "-shared", "-fPIC", "-o", str(library), str(source)], check=True, timeout=120)
    return library


@needs_cpu_kernel
@pytest.mark.parametrize("intruder", ["foreign-library", "garbage"])
def test_a_foreign_file_at_the_cached_kernel_path_is_rebuilt(tmp_path, foreign_library, intruder):
    cache = tmp_path / "cache"
    first = run_kernel_probe(cache)
    assert first[:2] == ["refusal: None", "auto: cpu"]
    (library,) = (cache / "kernels").glob("cpu_kernels-*.so")
    # The intruder takes the kernel's exact file name (the name's hash matches; only the content differs).
    library.write_bytes(foreign_library.read_bytes() if intruder == "foreign-library" else b"\x7fELF not a library")
    again = run_kernel_probe(cache)
    assert again[:2] == ["refusal: None", "auto: cpu"], again
    assert float(again[2].removeprefix("max error: ")) < 1e-5
    assert list((cache / "kernels").glob("cpu_kernels-*.so")) == [library]  # rebuilt in place, no stray files
    assert library.read_bytes() != foreign_library.read_bytes()


@needs_cpu_kernel
def test_a_build_that_yields_a_foreign_library_is_refused_with_the_reason(tmp_path, foreign_library):
    # A "compiler" that builds another source than the one it is given: the library loads but lacks the
    # kernel's symbols. The backend refuses, naming them, and auto falls back to torch.
    from sparseattn.backends.cpu_kernels import find_compiler

    wrapper = tmp_path / "wrong-cc"
    wrapper.write_text(
        f"#!{sys.executable}\n"
        "import os, sys\n"
        f"args = [{str(tmp_path / 'foreign.c')!r} if a.endswith('cpu_kernels.c') else a for a in sys.argv[1:]]\n"
        f"os.execv({find_compiler()!r}, [{find_compiler()!r}, *args])\n"
    )
    wrapper.chmod(0o755)
    refusal, auto = run_kernel_probe(tmp_path / "cache", CC=str(wrapper))
    assert refusal.startswith("refusal: the kernel is unavailable: the library ")
    assert "does not export sa_segment_attention, sa_segment_log_mass, sa_merged_rest, sa_float16_supported" in refusal
    assert auto == "auto: torch"


@needs_cpu_kernel
def test_a_foreign_library_with_a_forged_manifest_is_refused_then_rebuilt(tmp_path, foreign_library):
    # The checksum passes (the manifest was rewritten to match), so the process loads the library, finds
    # no kernel symbols and refuses; it drops the manifest so that the next process rebuilds.
    import hashlib
    import json

    cache = tmp_path / "cache"
    run_kernel_probe(cache)
    (library,) = (cache / "kernels").glob("cpu_kernels-*.so")
    manifest = library.with_suffix(".json")
    library.write_bytes(foreign_library.read_bytes())
    forged = {**json.loads(manifest.read_text()), "library_sha256": hashlib.sha256(library.read_bytes()).hexdigest()}
    manifest.write_text(json.dumps(forged))
    refusal, auto = run_kernel_probe(cache)
    assert "does not export sa_segment_attention" in refusal and "the next run rebuilds it" in refusal
    assert auto == "auto: torch" and not manifest.exists()
    assert run_kernel_probe(cache)[:2] == ["refusal: None", "auto: cpu"]


# Both C kernels (cpu_kernels.c, sparseattn/vllm/paged_kernels.c) include kernel_common.h by its name.


@pytest.mark.skipif(CPU_KERNEL is not None and "compiler" in CPU_KERNEL, reason=f"needs a C compiler: {CPU_KERNEL}")
def test_a_kernel_file_builds_with_the_shared_header_beside_it(tmp_path):
    import ctypes
    from importlib import resources

    from sparseattn.backends import cpu_kernels

    header = resources.files("sparseattn.backends").joinpath(cpu_kernels.HEADER).read_bytes()
    source = b'#include "kernel_common.h"\nint sa_probe(void) { return 10 * SA_BAD_DTYPE + sa_float16_built(); }\n'
    target = tmp_path / "probe.so"
    assert cpu_kernels._ensure_built(cpu_kernels.find_compiler(), "cc", source, target, "probe", "probe.c", {cpu_kernels.HEADER: header})
    assert ctypes.CDLL(str(target)).sa_probe() in (40, 41)  # SA_BAD_DTYPE, and float16 built or not


def test_a_change_of_the_shared_header_rebuilds_every_kernel():
    from sparseattn.backends.cpu_kernels import HEADER, build_key

    source = b'#include "kernel_common.h"\n'
    assert build_key(source, {HEADER: b"/* one */"}, "cc 12") != build_key(source, {HEADER: b"/* two */"}, "cc 12")


def test_the_package_data_ships_the_shared_header():
    import fnmatch
    from pathlib import Path

    from sparseattn.backends.cpu_kernels import HEADER

    tomllib = pytest.importorskip("tomllib")
    pyproject = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())
    shipped = pyproject["tool"]["setuptools"]["package-data"]["sparseattn.backends"]
    assert any(fnmatch.fnmatch(HEADER, pattern) for pattern in shipped)


# --- triton kernel, in the interpreter -------------------------------------------------------------


@needs_interpreter
@pytest.mark.parametrize("softcap", SOFTCAPS, ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_triton_kernel_matches_reference(case, dtype, softcap):
    # block_n=16 with 3 splits: several blocks per split, blocks spanning segments, and merges.
    check_against_reference(TritonBackend(block_n=16, num_splits=3), case, dtype, softcap)


@needs_interpreter
@pytest.mark.parametrize("case", [CASES[1], CASES[6], CASES[7]], ids=lambda c: c.id)
def test_triton_splits_write_every_state_into_poisoned_buffers(case):
    # More splits than blocks: the trailing splits are empty and must still write lse=-inf, out=0.
    q, keys, values, segments, clean_k, clean_v = make_inputs(case, torch.float32)
    B, H, G, D = q.shape
    S = 8
    out = torch.full((B, H, G, S, D), float("nan"))
    lse = torch.full((B, H, G, S), float("nan"))
    segment_decode_partials(q, keys, values, case.layout, segments, out, lse, block_n=16)
    assert not out.isnan().any() and not lse.isnan().any()
    empty = lse == float("-inf")
    assert empty[..., -1].all() and not empty[..., 0].any()
    assert (out[empty] == 0).all()
    merged, merged_lse = merge_partials(out, lse)
    assert_close(merged, reference(case, q, clean_k, clean_v, segments, None), torch.float32)
    assert torch.isfinite(merged_lse).all()


@needs_interpreter
def test_triton_one_split_and_many_splits_agree():
    case = CASES[1]
    q, keys, values, segments, _, _ = make_inputs(case, torch.float32)
    one = TritonBackend(block_n=16, num_splits=1).segment_attention(q, keys, values, case.layout, segments)
    many = TritonBackend(block_n=16, num_splits=5).segment_attention(q, keys, values, case.layout, segments)
    assert_close(many, one.double(), torch.float32)


@needs_interpreter
@pytest.mark.parametrize("D", [16, 80], ids=lambda d: f"D{d}")
@pytest.mark.parametrize("S", [1, 4, 5], ids=lambda s: f"S{s}")
def test_merge_partials_matches_reference(S, D):
    gen = torch.Generator().manual_seed(S * 100 + D)
    outs = torch.randn(2, 3, S, D, generator=gen)
    lses = torch.randn(2, 3, S, generator=gen) * 10
    if S > 1:  # states that saw no key: skipped, even with a NaN output
        lses[0, 1, 1:] = float("-inf")
        outs[0, 1, 1:] = float("nan")
    lses[1, 2, :] = float("-inf")  # a row with nothing: out 0, lse -inf
    out, lse = merge_partials(outs, lses)
    ref_out, ref_lse = merge_partials_ref(outs, lses)
    assert out.dtype == lse.dtype == torch.float32
    assert (out[1, 2] == 0).all() and lse[1, 2] == float("-inf")
    assert_close(out, ref_out, torch.float32)
    seen = ref_lse > float("-inf")
    assert_close(lse[seen], ref_lse[seen], torch.float32, what="lse")


def test_merge_partials_ref_of_disjoint_parts_is_the_whole_softmax():
    gen = torch.Generator().manual_seed(5)
    logits = torch.randn(4, 11, generator=gen, dtype=torch.float64) * 5
    values = torch.randn(4, 11, 7, generator=gen, dtype=torch.float64)
    parts = [(0, 3), (3, 4), (4, 11)]
    outs = torch.stack([torch.softmax(logits[:, a:b], -1).unsqueeze(1).matmul(values[:, a:b]).squeeze(1) for a, b in parts], 1)
    lses = torch.stack([torch.logsumexp(logits[:, a:b], -1) for a, b in parts], 1)
    out, lse = merge_partials_ref(outs, lses)
    whole = torch.softmax(logits, -1).unsqueeze(1).matmul(values).squeeze(1)
    assert_close(out, whole, torch.float64)
    assert_close(lse, torch.logsumexp(logits, -1), torch.float64, what="lse")


@needs_interpreter
@pytest.mark.slow
@pytest.mark.parametrize("softcap", SOFTCAPS, ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shared", [True, False], ids=["shared", "perhead"])
@pytest.mark.parametrize("k", ["0", "1", "all"])
@pytest.mark.parametrize("window", [0, 7], ids=lambda w: f"w{w}")
@pytest.mark.parametrize("sinks", [0, 3], ids=lambda s: f"s{s}")
@pytest.mark.parametrize("c", [1, 5, 16], ids=lambda c: f"c{c}")
def test_triton_kernel_sweep(c, sinks, window, k, shared, dtype, softcap):
    buffer = 2 if sinks == window == 0 and k == "0" else 0  # an empty tail, unless nothing else is attended
    case = Case(2, 2, 3, 64, c=c, n_seg=5, sinks=sinks, window=window, buffer=buffer, k=k, shared=shared)
    check_against_reference(TritonBackend(block_n=16, num_splits=2), case, dtype, softcap, seed=c + 10 * sinks + window)


COMPILE_FOR_SM90 = """
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from sparseattn.backends.triton_backend import kernels

ks = kernels(False)
FLOATS = ("scale", "softcap", "factor")
def compile(fn, pointers, constexprs):
    sig = {n: "constexpr" if n in constexprs else pointers.get(n, "fp32" if n in FLOATS else "i32") for n in fn.arg_names}
    triton.compile(ASTSource(fn, sig, constexprs=constexprs), target=GPUTarget("cuda", 90, 32))
for dtype, softcap, masked in [("fp16", True, False), ("bf16", False, True), ("fp32", False, False)]:
    ptrs = dict(Q="*" + dtype, K="*" + dtype, V="*" + dtype, SEG="*i64", VALID="*u8", COUNT="*i64", OUT="*fp32", LSE="*fp32")
    compile(ks.segment_decode, ptrs, dict(HAS_SOFTCAP=softcap, MASKED=masked, ROW_BITS=False, UPCAST_DOT=False, BLOCK_G=16, BLOCK_N=64, BLOCK_D=128))
    if masked:  # a KV group's per-head selections as their union: int32 bit sets of the rows per listed segment
        compile(ks.segment_decode, {**ptrs, "VALID": "*i32", "COUNT": "*i32"}, dict(HAS_SOFTCAP=softcap, MASKED=True, ROW_BITS=True, UPCAST_DOT=False, BLOCK_G=16, BLOCK_N=64, BLOCK_D=128))
    for rows in (1, 4):  # one list per query row, and one shared by a KV group of 4
        compile(ks.segment_log_mass, dict(Q="*fp32", K="*" + dtype, IDX="*i64", OUT="*fp32"), dict(BLOCK_R=rows, BLOCK_C=64 // rows, BLOCK_D=128, SEGS=4))
        compile(ks.bound_scores, dict(Q="*fp32", LOW="*" + dtype, HIGH="*" + dtype, OUT="*fp32"), dict(BLOCK_G=rows, BLOCK_S=64 // rows, BLOCK_D=128))
    for weighted, floor in [(False, False), (True, True)]:
        slots = dict(Q="*" + dtype, K="*" + dtype, V="*" + dtype, A="*fp32", BW="*fp32", F="*fp32", OUT="*fp32", PROBS="*fp32")
        compile(ks.slot_attention, slots, dict(WEIGHTED=weighted, HAS_FLOOR=floor, HAS_SOFTCAP=softcap, BLOCK_M=16, BLOCK_S=64, BLOCK_D=128))
compile(ks.merge_partials, dict(OUTS="*fp32", LSES="*fp32", OUT="*fp32", LSE_OUT="*fp32"), dict(BLOCK_S=8, BLOCK_D=128))
print("compiled")
"""


@pytest.mark.skipif(not HAS_TRITON, reason="needs triton, which is not installed: `pip install -e '.[dev]'` (Linux x86-64)")
def test_kernels_compile_for_sm90_without_a_gpu():
    # The interpreter skips triton's type checks and lowering; compiling ahead of time (triton ships
    # ptxas) checks the compiled path on a machine with no GPU. A fresh process: compiled mode.
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", COMPILE_FOR_SM90], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.strip() == "compiled", done.stderr[-3000:]


@pytest.mark.skipif(not HAS_TRITON, reason="needs triton, which is not installed: `pip install -e '.[dev]'` (Linux x86-64)")
@pytest.mark.skipif(INTERPRETING, reason="not needed: the interpreter tests already ran in this process (it reruns them "
                    "in a fresh process only when triton was imported compiled first, as in a full run)")
def test_interpreter_tests_in_a_fresh_process():
    # In a full run something imports triton (transformers' model classes do) before this module can
    # set TRITON_INTERPRET, so triton runs compiled and the CPU kernel tests above skip: run them
    # again in a process where this module comes first.
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    skip = "not fresh_process and not compile_for and not without_the_interpreter"
    ops = os.path.join(os.path.dirname(__file__), "test_triton_ops.py")  # every other kernel, likewise
    loop = os.path.join(os.path.dirname(__file__), "test_static_loop.py::test_the_fixed_shape_step_runs_the_triton_kernels")
    args = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "not slow and not gpu", "-k", skip, __file__, ops, loop]
    root = os.path.dirname(os.path.dirname(__file__))
    done = subprocess.run(args, env=env, cwd=root, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-5000:] + done.stderr[-2000:]
    assert " skipped" not in done.stdout.splitlines()[-1], done.stdout[-2000:]


# --- dispatch --------------------------------------------------------------------------------------


ATTEND = "segment_attention"

#: The layout and selection of :func:`small_call`'s step.
SMALL_LAYOUT = SegmentLayout(length=12, sinks=1, segment_size=3, n_segments=3)
SMALL_SEGMENTS = torch.tensor([2, 0]).view(1, 1, 1, 2).expand(1, 2, 1, 2)


def small_call(dtype=torch.float32, D=16, device="cpu"):
    """The query and keys of a small segment-attention step (what dispatch looks at)."""
    return dict(
        q=torch.randn(1, 2, 3, D, dtype=dtype, device=device),
        keys=torch.randn(1, 2, 12, D, dtype=dtype, device=device),
    )


def test_auto_without_the_interpreter_picks_the_cpu_kernel_on_cpu_and_says_why_not_triton():
    # A fresh process: triton's interpreter mode is fixed at its first import (see the top of this file).
    script = (
        "import sys, torch\n"
        "import sparseattn, sparseattn.backends as b\n"
        "print('triton imported:', 'triton' in sys.modules)\n"
        "from sparseattn.ops.layout import SegmentLayout\n"
        "lay = SegmentLayout(length=12, sinks=1, segment_size=3, n_segments=3)\n"
        "kw = dict(q=torch.randn(1, 2, 3, 16), keys=torch.randn(1, 2, 12, 16))\n"
        "print('auto:', b.select_backend(**kw).name)\n"
        "print('triton:', b.TritonBackend().refusal('segment_attention', kw['q'], kw['keys']))\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0] == "triton imported: False"
    assert lines[1] == f"auto: {AUTO_ON_CPU}"
    if HAS_TRITON:
        assert lines[2].startswith("triton: tensors are on cpu; the kernel needs CUDA") and "TRITON_INTERPRET=1" in lines[2]
    else:
        assert lines[2] == "triton: triton is not installed (pip install 'sparseattn[gpu]')"


@needs_interpreter
def test_auto_never_picks_the_interpreter_but_a_named_triton_runs_in_it():
    # The interpreter is a test vehicle (orders of magnitude slower than torch): only by name.
    assert select_backend(**small_call()).name == AUTO_ON_CPU
    assert select_backend("triton", **small_call()).name == "triton"


def test_auto_falls_through_to_torch_for_float64():
    assert select_backend(**small_call(torch.float64)).name == "torch"


def test_a_named_backend_that_refuses_says_why():
    with pytest.raises(ValueError) as err:
        select_backend("triton", **small_call(torch.float64))
    msg = str(err.value)
    assert msg.startswith("backend 'triton' cannot run segment_attention for q [1, 2, 3, 16] torch.float64 on cpu")
    assert "  - triton: " in msg
    if HAS_TRITON and INTERPRETING:
        assert "dtype torch.float64 is not supported (supported: float16, bfloat16, float32)" in msg


def test_when_nothing_fits_every_backend_and_its_reason_is_listed():
    with pytest.raises(ValueError) as err:
        select_backend(**small_call(torch.float64), backends=[TritonBackend(), XformersBackend()])
    lines = str(err.value).splitlines()
    assert lines[0].startswith("no backend can run segment_attention for q [1, 2, 3, 16] torch.float64 on cpu")
    assert lines[0].endswith("tried in priority order:")
    assert [line.split(":")[0] for line in lines[1:]] == ["  - triton", "  - xformers"]
    if importlib.util.find_spec("xformers") is None:
        assert lines[2] == "  - xformers: xformers is not installed (auto walks only installed backends)"


@needs_interpreter
def test_triton_refuses_head_dims_below_16_and_mixed_dtypes():
    reason = TritonBackend().refusal(ATTEND, **small_call(D=8), softcap=None)
    assert reason == "head dim 8 is not supported (supported: 16..256)"
    call = small_call()
    call["keys"] = call["keys"].half()
    assert "one dtype" in TritonBackend().refusal(ATTEND, **call)


def test_unknown_backend_names_the_choices():
    with pytest.raises(ValueError, match="unknown backend 'flash'; choose one of 'auto', 'triton', 'xformers', 'cpu', 'torch'"):
        select_backend("flash", **small_call())


def test_a_refusing_backend_raises_instead_of_falling_back():
    call = small_call(torch.float64)
    values = torch.randn_like(call["keys"])
    with pytest.raises(ValueError, match="the xformers backend cannot run segment_attention"):
        XformersBackend().segment_attention(call["q"], call["keys"], values, SMALL_LAYOUT, SMALL_SEGMENTS)
    if HAS_TRITON:
        with pytest.raises(ValueError, match="the triton backend cannot run segment_attention.*float64"):
            TritonBackend().segment_attention(call["q"], call["keys"], values, SMALL_LAYOUT, SMALL_SEGMENTS)


NO_SEGMENTS = torch.zeros(1, 2, 1, 0, dtype=torch.long)


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(segments=torch.zeros(1, 2, 2, 1, dtype=torch.long)), "segments must be"),
        (dict(segments=torch.zeros(1, 2, 1, 1)), "integer indices"),
        (dict(keys=torch.randn(1, 2, 11, 16)), "fewer than the layout's length 12"),
        (dict(softcap=0.0), "softcap must be > 0"),
        (dict(layout=SegmentLayout(length=9, sinks=0, segment_size=3, n_segments=3), segments=NO_SEGMENTS), "nothing to attend"),
    ],
    ids=["selection-groups", "float-indices", "short-cache", "softcap-0", "empty"],
)
def test_invalid_inputs_raise_whatever_the_backend(change, message):
    # The shapes are checked before any backend's own refusal (BackendBase's op methods), so every backend says the same.
    call = {**small_call(), "layout": SMALL_LAYOUT, "segments": SMALL_SEGMENTS, "softcap": None, **change}
    values = torch.randn_like(call["keys"])
    for backend in BACKENDS:
        with pytest.raises(ValueError, match=message):
            backend.segment_attention(call["q"], call["keys"], values, call["layout"], call["segments"], softcap=call["softcap"])


def test_backends_declare_what_they_support():
    for backend in (TritonBackend(), XformersBackend(), CpuBackend(), TorchBackend()):
        assert isinstance(backend, AttentionBackend) and isinstance(backend.name, str)
        assert set(backend.CAPABILITIES) <= set(OPS)
        assert all(isinstance(c.dtypes, tuple) for c in backend.CAPABILITIES.values())
    assert set(TorchBackend.CAPABILITIES) == set(OPS)
    assert set(CpuBackend.CAPABILITIES) == {"segment_attention", "segment_log_mass", "dense"}
    assert set(TritonBackend.CAPABILITIES) == set(OPS)
    attend = {b.name: b.CAPABILITIES[ATTEND] for b in (TritonBackend(), CpuBackend(), TorchBackend())}
    assert torch.float64 in attend["torch"].dtypes and torch.float64 not in attend["triton"].dtypes
    assert attend["cpu"].devices == ("cpu",) and torch.float64 not in attend["cpu"].dtypes
    assert 64 in attend["triton"].head_dims and 8 not in attend["triton"].head_dims
    assert TritonBackend.REQUIRES == ("triton",) and XformersBackend.REQUIRES == ("xformers",)
    with pytest.raises(ValueError, match="block_n must be a power of two >= 16, got 24"):
        TritonBackend(block_n=24)


# --- the compiled kernel on a GPU ------------------------------------------------------------------

GPU_CASES = [
    Case(2, 4, 8, 128, c=64, n_seg=40, sinks=4, window=64, buffer=37, k="1", shared=True),
    Case(2, 4, 8, 128, c=64, n_seg=40, sinks=4, window=64, buffer=37, k="all", shared=False, cache="bthd"),
    Case(1, 8, 4, 64, c=37, n_seg=60, sinks=0, window=0, buffer=11, k="1", shared=True),
    Case(1, 2, 7, 96, c=50, n_seg=30, sinks=4, window=100, buffer=3, k="all", shared=True),
]


@needs_compiled_gpu
@pytest.mark.parametrize("softcap", SOFTCAPS, ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", GPU_CASES, ids=lambda c: c.id)
def test_compiled_kernel_matches_reference_on_gpu(case, dtype, softcap):
    check_against_reference(TritonBackend(), case, dtype, softcap, device="cuda")


@needs_compiled_gpu
def test_auto_picks_triton_on_gpu():
    assert select_backend(**small_call(torch.float16, device="cuda")).name == "triton"


# --- exact segment masses (Rerank), read in place by the cpu kernel --------------------------------


@needs_cpu_kernel
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shared", [True, False], ids=["one-list", "list-per-row"])
@pytest.mark.parametrize("c, D", [(1, 16), (5, 64), (37, 128), (70, 96)], ids=lambda x: str(x))
def test_cpu_segment_log_mass_matches_reference(c, D, shared, dtype):
    from sparseattn.summaries.base import SegmentKeys, segment_log_mass

    gen = torch.Generator().manual_seed(c + D)
    B, H, R, S, m, sinks, factor = 2, 3, 4, 9, 4, 2, D**-0.25
    cache = torch.randn(B, H, sinks + S * c + 3, D, generator=gen).to(dtype)
    segment_view = cache[:, :, sinks : sinks + S * c].view(B, H, S, c, D)
    sets = 1 if shared else R
    index = torch.stack([torch.randperm(S, generator=gen)[:m] for _ in range(B * H * sets)]).view(B, H, sets, m)
    listed = torch.zeros(B, H, S, dtype=torch.bool)
    listed.scatter_(-1, index.flatten(2), True)
    clean = segment_view.clone()
    segment_view.masked_fill_(~listed[..., None, None], float("nan"))  # a key outside the lists is NaN
    queries = torch.randn(B, H, R, D, generator=gen) * factor
    got = segment_log_mass(SegmentKeys(segment_view, factor, torch.float32), queries, index)
    keys = clean.double() * factor  # float64 brute force over every listed segment
    logits = torch.einsum("bhrd,bhscd->bhrsc", queries.double(), keys)
    want = torch.logsumexp(logits, dim=-1).gather(-1, index.expand(B, H, R, m))
    assert got.shape == (B, H, R, m)
    assert_close(got, want, dtype, what="log mass")


def test_segment_log_mass_torch_path_is_the_reference_too():
    # float64 queries take the torch path (take the keys, matmul, logsumexp): the same numbers.
    from sparseattn.summaries.base import SegmentKeys, segment_log_mass

    gen = torch.Generator().manual_seed(1)
    raw = torch.randn(1, 2, 6, 5, 16, generator=gen, dtype=torch.float64)
    index = torch.tensor([[[[4, 0]], [[1, 5]]]])
    queries = torch.randn(1, 2, 3, 16, generator=gen, dtype=torch.float64)
    got = segment_log_mass(SegmentKeys(raw, 0.5, torch.float64), queries, index)
    want = torch.logsumexp(torch.einsum("bhrd,bhscd->bhrsc", queries, raw * 0.5), -1).gather(-1, index.expand(1, 2, 3, 2))
    assert_close(got, want, torch.float64)


# --- every op on every backend that accepts it, against the op's float64 reference ----------------


@dataclass(frozen=True)
class OpCase:
    """Sizes of one call of any op: batch, KV heads, query rows per KV head, head dim, stored tokens."""

    B: int
    H: int
    G: int
    D: int
    t: int

    @property
    def id(self) -> str:
        return f"B{self.B}H{self.H}G{self.G}-D{self.D}-t{self.t}"


# Odd sizes, batch > 1, GQA groups, a head dim that is not a power of two.
OP_CASES = [OpCase(2, 2, 3, 16, 37), OpCase(1, 3, 5, 80, 63)]


def capacity_view(gen, B, H, t, D, dtype):
    """``[B, H, t, D]``: a narrow of a larger, token-major capacity buffer (not contiguous), as a cache is."""
    return torch.randn(B, t + 5, H, D, generator=gen).to(dtype).narrow(1, 0, t).transpose(1, 2)


def op_call(op, case, dtype, softcap, seed):
    """``(args, q, keys)`` of a fresh random call of ``op``: the method's positional arguments, and what dispatch sees."""
    gen = torch.Generator().manual_seed(seed)
    B, H, G, D, t = case.B, case.H, case.G, case.D, case.t
    keys, values = capacity_view(gen, B, H, t, D, dtype), capacity_view(gen, B, H, t, D, dtype)
    if op == "segment_attention":
        c, n_seg = 5, (t - 3) // 5  # 3 sinks; the rest of the tokens is the tail
        lay = SegmentLayout(length=t, sinks=3, segment_size=c, n_segments=n_seg, window=4)
        q = torch.randn(B, H, G, D, generator=gen).to(dtype)
        segments = torch.stack([torch.randperm(n_seg, generator=gen)[:2] for _ in range(B * H * G)]).view(B, H, G, 2)
        return (q, keys, values, lay, segments, 0.3, softcap), q, keys
    if op == "dense":
        q = torch.randn(B, H, G, D, generator=gen).to(dtype)
        return (q, keys, values, 0.3, softcap), q, keys
    if op == "slot_attention":
        T = 3  # the last three slots are the queries' own tokens (causal)
        q = torch.randn(B, H, G, T, D, generator=gen).to(dtype)
        den, num = torch.rand(B, H, t, generator=gen), torch.rand(B, H, t, generator=gen)
        return (q, keys, values, den, num, 0.3, softcap, num), q, keys
    if op == "bound_scores":  # Quest's summaries: each segment's channel minima and maxima, in the compute dtype
        compute = torch.float64 if dtype == torch.float64 else torch.float32
        low = torch.randn(B, H, t // 4, D, generator=gen).to(compute)
        high = low + torch.rand(B, H, t // 4, D, generator=gen).to(compute)
        queries = torch.randn(B, H, G, D, generator=gen, dtype=compute) * D**-0.25
        return (low, high, queries), queries, low
    # segment_log_mass: queries pre-scaled in the compute dtype, one segment list per query row.
    from sparseattn.ops.segments import SegmentKeys

    c = 4
    S = t // c
    raw = keys[:, :, : S * c].unflatten(2, (S, c))
    compute = torch.float64 if dtype == torch.float64 else torch.float32
    queries = torch.randn(B, H, G, D, generator=gen, dtype=compute) * D**-0.25
    index = torch.stack([torch.randperm(S, generator=gen)[:3] for _ in range(B * H * G)]).view(B, H, G, 3)
    return (SegmentKeys(raw, D**-0.25, compute), queries, index), queries, raw


def run_op(backend, op, args, checked=True):
    """``backend``'s method for ``op`` on ``args``: the output (``out`` alone for slot attention)."""
    out = getattr(backend, op)(*args, checked=checked)
    return out[0] if op == "slot_attention" else out


@pytest.mark.parametrize("softcap", SOFTCAPS, ids=str)
@pytest.mark.parametrize("dtype", [*DTYPES, torch.float64], ids=str)
@pytest.mark.parametrize("case", OP_CASES, ids=lambda c: c.id)
@pytest.mark.parametrize("op", OPS)
def test_every_backend_that_accepts_an_op_matches_its_reference(op, case, dtype, softcap):
    if op in ("segment_log_mass", "bound_scores") and softcap is not None:
        return  # masses and bounds have no soft-capping: the softcap=None run covers them
    args, q, keys = op_call(op, case, dtype, softcap, seed=OPS.index(op) + 7 * case.D)
    want = REFERENCES[op](*args)  # each reference takes its op's arguments
    ran = []
    for backend in BACKENDS:
        if backend.refusal(op, q, keys, softcap) is not None:
            continue
        got = run_op(backend, op, args)
        assert_close(got, want, dtype, what=f"{backend.name} {op}")
        # The unchecked path the decode states take runs the same arithmetic.
        assert torch.equal(run_op(backend, op, args, checked=False), got)
        ran.append(backend.name)
    assert "torch" in ran  # the torch backend runs every op, on every dtype
    if CPU_KERNEL is None and op in CpuBackend.CAPABILITIES and dtype in supported_dtypes():
        assert "cpu" in ran
    if INTERPRETING and q.dtype in TritonBackend.CAPABILITIES[op].dtypes:
        assert "triton" in ran


def as_tuple(result):
    """An op's result as a tuple: ``(out,)``, ``(out, lse)`` or ``(out, probs)``."""
    return result if isinstance(result, tuple) else (result,)


def extension_call(op, case, dtype, softcap, seed):
    """``(args, q, keys)`` of a fresh random call of the optional op ``op``: a segment attention step whose
    selections attend only their listed segments flagged in ``valid``, and for the merged rest the segments'
    and blocks' sums. The window reaches into no segment (the merged rest's one condition)."""
    from sparseattn.methods.rest import block_sums, segment_sums

    gen = torch.Generator().manual_seed(seed)
    B, H, G, D, t = case.B, case.H, case.G, case.D, case.t
    keys, values = capacity_view(gen, B, H, t, D, dtype), capacity_view(gen, B, H, t, D, dtype)
    c, sinks = 5, 3
    n_seg = (t - sinks - 2) // c  # at least 2 tokens of buffer after the segments
    lay = SegmentLayout(length=t, sinks=sinks, segment_size=c, n_segments=n_seg)
    q = torch.randn(B, H, G, D, generator=gen).to(dtype)
    segments = torch.stack([torch.randperm(n_seg, generator=gen)[:3] for _ in range(B * H * G)]).view(B, H, G, 3)
    valid = torch.rand(B, H, G, 3, generator=gen) < 0.6
    if op != "segment_attention_merged":
        return (q, keys, values, lay, segments, valid, 0.3, softcap), q, keys
    grid = keys[:, :, sinks : lay.segment_end].float().unflatten(2, (n_seg, c)), values[:, :, sinks : lay.segment_end].float().unflatten(2, (n_seg, c))
    seg_kv = torch.cat(segment_sums(*grid), dim=-1)
    per_block = 2
    sums = RestSums(seg_kv, *block_sums(*grid, per_block), per_block)
    return (q, keys, values, lay, segments, valid, sums, 0.3, softcap), q, keys


@pytest.mark.parametrize("softcap", SOFTCAPS, ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", OP_CASES, ids=lambda c: c.id)
@pytest.mark.parametrize("op", EXTENSION_OPS)
def test_every_backend_with_an_optional_op_matches_its_reference(op, case, dtype, softcap):
    # The optional ops are unchecked: a backend runs them for inputs its segment_attention accepts.
    args, q, keys = extension_call(op, case, dtype, softcap, seed=list(EXTENSION_OPS).index(op) + 7 * case.D)
    want = as_tuple(REFERENCES[op](*args))
    ran = []
    for backend in BACKENDS:
        if not isinstance(backend, EXTENSION_OPS[op]) or backend.refusal("segment_attention", q, keys, softcap) is not None:
            continue
        got = as_tuple(getattr(backend, op)(*args))
        assert len(got) == len(want)
        for part, (g, w) in enumerate(zip(got, want)):
            assert_close(g, w, dtype, what=f"{backend.name} {op} result {part}")
        ran.append(backend.name)
    if CPU_KERNEL is None and dtype in supported_dtypes():
        assert "cpu" in ran  # the cpu backend has every optional op
    if INTERPRETING and isinstance(TritonBackend(), EXTENSION_OPS[op]):
        assert "triton" in ran


def test_every_op_a_backend_can_run_has_its_float64_reference():
    """REFERENCES is the one table of the references: every op of OPS, every optional op (one per protocol of
    the interface besides AttentionBackend), and every op method of a registered backend has its entry."""
    import inspect

    import sparseattn.backends.base as base

    def own_methods(cls):
        return {name for name, value in vars(cls).items() if callable(value) and not name.startswith("_")}

    protocols = {
        cls for cls in vars(base).values()
        if inspect.isclass(cls) and getattr(cls, "_is_protocol", False) and cls.__module__ == base.__name__
    }  # fmt: skip
    assert own_methods(AttentionBackend) - {"refusal"} == set(OPS)
    assert protocols - {AttentionBackend} == set(EXTENSION_OPS.values())
    assert all(own_methods(protocol) == {op} for op, protocol in EXTENSION_OPS.items())
    # Public methods of a backend that run no op: a new op method fails here until it is an op with a reference.
    not_ops = {"refusal", "splits", *(f"run_{op}" for op in OPS)}
    for backend in BACKENDS:
        methods = {name for name in dir(type(backend)) if callable(getattr(type(backend), name)) and not name.startswith("_")}
        assert methods - not_ops <= set(OPS) | set(EXTENSION_OPS), backend.name
        assert set(backend.CAPABILITIES) <= set(OPS), backend.name
    missing = (set(OPS) | set(EXTENSION_OPS)) - set(REFERENCES)
    assert not missing, f"ops without a float64 reference in sparseattn.backends.naive.REFERENCES: {sorted(missing)}"
    assert set(REFERENCES) <= set(OPS) | set(EXTENSION_OPS), "a reference of no op"


# --- the registry: names once, dispatch by declared capability, no cycle ---------------------------


def test_names_are_listed_once_and_the_methods_check_theirs_against_them():
    from sparseattn import Dense
    from sparseattn.methods.segment_search import SegmentSearch

    names = backend_names()
    assert names == tuple(b.name for b in BACKENDS) == ("triton", "xformers", "cpu", "torch")
    assert backend_names("dense") == ("triton", "cpu", "torch") and backend_names("slot_attention") == ("triton", "torch")
    with pytest.raises(ValueError, match=r"SegmentSearch.backend must be one of \('auto', 'triton', 'xformers', 'cpu', 'torch'\), got 'flash'"):
        SegmentSearch(backend="flash")
    with pytest.raises(ValueError, match=r"Dense.backend must be one of \('torch', 'triton', 'cpu'\), got 'xformers'"):
        Dense(backend="xformers")
    with pytest.raises(ValueError, match=r"got \['cpu'\]"):
        Dense(backend=["cpu"])
    assert SegmentSearch().backend == "auto" and Dense().backend == "torch"


class MissingPackageBackend(BackendBase):
    """A backend whose package is not installed: auto must not even ask it."""

    name = "missing"
    REQUIRES = ("sparseattn_no_such_package",)
    CAPABILITIES = {ATTEND: Capability(devices=("cpu",), dtypes=(torch.float32,))}
    asked = 0

    def refusal(self, op, q, keys, softcap=None):
        MissingPackageBackend.asked += 1
        return super().refusal(op, q, keys, softcap)


def test_auto_does_not_walk_a_backend_that_is_not_installed_but_a_named_one_says_so():
    MissingPackageBackend.asked = 0
    backends = [MissingPackageBackend(), TorchBackend()]
    assert select_backend("auto", ATTEND, **small_call(), backends=backends).name == "torch"
    assert MissingPackageBackend.asked == 0
    with pytest.raises(ValueError, match="  - missing: sparseattn_no_such_package is not installed$"):
        select_backend("missing", ATTEND, **small_call(), backends=backends)


def test_auto_skips_backends_that_do_not_declare_the_op_or_the_device():
    call = small_call()
    assert select_backend("auto", "slot_attention", q=call["q"].unsqueeze(3), keys=call["keys"]).name == "torch"
    with pytest.raises(ValueError) as err:
        select_backend("auto", "slot_attention", q=call["q"].unsqueeze(3), keys=call["keys"], backends=[CpuBackend()])
    assert str(err.value).endswith("  - cpu: it does not implement slot_attention")
    with pytest.raises(ValueError, match="unknown op 'flash'; the ops are 'segment_attention', "):
        select_backend("auto", "flash", **call)


def test_the_interface_module_imports_no_backend_and_the_backends_form_no_cycle():
    # Static: every import of a sparseattn module in sparseattn/backends and sparseattn/ops, wherever it is
    # written (function-local imports count: they hid the old cycle), except typing-only ones.
    from import_graph import in_cycles, package_imports

    modules = package_imports("backends", "ops")
    assert not {m for m in modules["sparseattn.backends.base"] if m.startswith("sparseattn.backends")}
    for name, found in modules.items():
        if name.startswith("sparseattn.ops"):
            assert not {m for m in found if m.startswith("sparseattn.backends")}, name
    assert in_cycles(modules) == []


def test_the_hot_paths_name_no_backend():
    import inspect

    import sparseattn.methods.dense as dense
    import sparseattn.methods.segment_search as segment_search
    import sparseattn.methods.segment_state as segment_state
    import sparseattn.summaries.base as summaries

    for module in (segment_search, segment_state, dense, summaries):
        source = inspect.getsource(module)
        assert ".name ==" not in source and "cpu_kernels" not in source and "CpuBackend" not in source, module.__name__


def test_a_state_chooses_its_backends_once(monkeypatch):
    import sparseattn.methods.segment_state as segment_state
    from sparseattn.methods.segment_search import SegmentSearch
    from sparseattn.summaries import Centroid, Rerank

    chosen = []
    real = segment_state.select_backend
    monkeypatch.setattr(segment_state, "select_backend", lambda *a, **kw: chosen.append(a[1]) or real(*a, **kw))
    method = SegmentSearch(Rerank(Centroid(), shortlist=2), top_k=1)
    state = method.new_state(1, 2, 16)
    state.prefill(torch.randn(1, 2, 40, 16), torch.randn(1, 2, 40, 16))
    with torch.no_grad():
        for _ in range(4):
            state.step(torch.randn(1, 4, 16), torch.randn(1, 2, 16), torch.randn(1, 2, 16))
    assert sorted(chosen) == ["segment_attention", "segment_log_mass"]
    assert state._backend.name == AUTO_ON_CPU and state._mass_backend.name == AUTO_ON_CPU


def test_the_slot_attention_backend_is_slot_attention_bit_for_bit():
    from sparseattn.ops.slots import slot_attention

    args, q, keys = op_call("slot_attention", OP_CASES[0], torch.float32, 5.0, seed=3)
    backend = select_backend("auto", "slot_attention", q=q, keys=keys, softcap=5.0)
    got = backend.slot_attention(*args, checked=False)
    want = slot_attention(*args)
    assert all(torch.equal(g, w) for g, w in zip(got, want))


class CheckedSplit:
    """A third-party allocation: PooledMass's split through its own plan (not marked within_budget)."""

    def __new__(cls, **options):
        from sparseattn.allocations import PooledMass

        class Split(PooledMass):
            def plan(self, estimates, log_total, k):
                return super().plan(estimates, log_total, k)

        return Split(**options)


@needs_interpreter
@pytest.mark.parametrize("split", ["uniform", "pooled", "pooled+merged", "third-party pooled"])
def test_the_triton_decode_step_reads_nothing_back_to_the_host(split):
    """radar+ and its pooled split, with and without the merged rest (the preset's layers 1-29), decode through
    the Triton backend without reading a tensor back to the host: on a GPU the step is one stream of launches
    that a CUDA graph captures. A third-party allocation's plan is checked against the budget, which reads its
    counts back (the one host read this test must find). The preset's heads list different segments of their
    group's shortlist (it is twice what the widest head may take): the merged rest reads them as they are listed."""
    from sparseattn import RadarPlus

    pooled = {"split": "pooled", "cap": 2.0, "floor": 0.25}  # the preset's split
    options = {"uniform": {}, "pooled": pooled, "pooled+merged": {**pooled, "rest": "merged", "merge": 128},
               "third-party pooled": {"allocation": CheckedSplit(cap=2.0, floor=0.25)}}[split]  # fmt: skip
    method = dataclasses.replace(RadarPlus(budget=256, aspect=16.0, **options), backend="triton")
    gen = torch.Generator().manual_seed(7)
    keys, values, q = (torch.randn(2, 2, 2048, 16, generator=gen), torch.randn(2, 2, 2048, 16, generator=gen),
                       torch.randn(2, 4, 16, generator=gen))  # fmt: skip
    state = method.new_state(2, 2, 16)
    state.append(keys, values)
    state.attend(q)  # first-call set-up (workspaces, the backend) is not the step
    reads = host_reads(lambda: state.attend(q))
    assert reads == (["aten._local_scalar_dense.default"] if split == "third-party pooled" else []), reads
