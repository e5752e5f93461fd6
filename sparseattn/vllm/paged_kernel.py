"""The paged engine's fused CPU step: score, select and attend vLLM's pages in one C call per layer.

:func:`~sparseattn.vllm.paged.select_pages` runs any policy's own parts over the pages (torch, one
batch of the method's summary and selector per group of alike sequences) and a paged kernel then
attends the listed pages. For the policies whose parts it knows, :func:`fused_decode` does the same
step in ``paged_kernels.c`` (built like the cpu backend's kernel, :func:`~sparseattn.backends.cpu_kernels.build_library`):

* ``Rerank(Centroid(), per_group=True)`` + ``TopK`` (radar+ in every form: whole pages or segments inside
  them, any allocation, a merged rest): centroid scores of every candidate, the KV group's shortlist,
  its exact log masses, each head's segments; the shortlist's logits are kept and attended, so a
  shortlisted key is read once (``SPLIT``, :class:`SplitCall`);
* ``MinMaxBound`` + ``TopK`` (quest): the per-channel bound of every candidate page, each head's top pages;
* dense and streamingllm (the pages attended do not depend on the query).

Every other policy (radar's random features, a third party's summary or selector that does not declare a
C implementation, a centroid stored in float16) keeps the generic path: :func:`~sparseattn.vllm.route.route`
decides, from what the parts declare. Page summaries (mean
key, or min and max) are kept per physical block in a :class:`PageStore`, computed inside the call
when a candidate page is stale, once for all sequences sharing it under prefix caching.

The references are the generic path's: ``tests/test_vllm_paged_kernel.py`` checks that the kernel
selects the pages :func:`~sparseattn.vllm.paged.select_pages` selects and that its output equals
float64 attention over them.
"""

from __future__ import annotations

import ctypes
import math
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch

from sparseattn.backends.cpu_kernels import DTYPE_CODES
from sparseattn.summaries.rerank import Rerank
from sparseattn.summaries.base import Shortlist
from sparseattn.vllm.cache_format import KVFormat
from sparseattn.vllm.policy import PagedPolicy, layer_methods
from sparseattn.vllm.selection import PageStep
from sparseattn.vllm.paged_library import kernel_refusal, library
from sparseattn.vllm.profile import active, python_part
from sparseattn.vllm.route import FusedMode, declared, route

__all__ = [
    "ALLOC_NONE", "ALLOC_POOLED", "ALLOC_TOPK", "BOUND", "FIXED", "SPLIT", "SPLIT_ALLOCATE", "SPLIT_ATTEND", "SPLIT_SCORE",
    "DecodeArgs", "FP8_CODES", "PageStore", "SplitArgs", "SplitCall", "StepPlan", "LAYOUTS", "amx_refusal", "c_allocation", "cache_code", "cache_share", "fused_decode",
    "kernel_refusal", "step_plan", "top_k_positions",
]

#: The kernel's modes (:class:`~sparseattn.vllm.route.FusedMode`, which :func:`~sparseattn.vllm.route.route` picks), short:
#: BOUND (quest) and SPLIT (radar+ in every form) run in ``sa_paged_split``, one C call with the allocation in it or two
#: with the allocation in Python between them (:class:`SplitCall`); FIXED (dense, streamingllm) in ``sa_paged_decode``.
BOUND, FIXED, SPLIT = FusedMode.BOUND, FusedMode.FIXED, FusedMode.SPLIT
_ERRORS = {
    1: "a block table entry is outside the cache's blocks",
    2: "the kernel could not allocate its scratch memory",
    4: "the kernel was built without this cache dtype",
    6: "the step plan does not fit the sequences (sinks + candidates past the last page, k or m out of range)",
}
#: The most tokens per page the kernel takes (one page's row is scratch on the stack).
MAX_BLOCK_SIZE = 4096


def top_k_positions(x: torch.Tensor, k: int) -> torch.Tensor:
    """The positions of the ``k`` largest of ``x`` (1-D float32), in no order, as the kernel's selection finds them
    (``top_k_set``: a radix select; a NaN ranks lowest; ties at the k-th value go to the earlier positions).

    >>> sorted(top_k_positions(torch.tensor([0.5, 2.0, float("nan"), 2.0, -1.0]), 2).tolist())
    [1, 3]
    """
    x = x.to(torch.float32).contiguous()
    if x.dim() != 1 or not 1 <= k <= x.numel():
        raise ValueError(f"top_k_positions: k={k} of a tensor of shape {tuple(x.shape)}; allowed: 1 <= k <= its length, 1-D")
    out = torch.empty(k, dtype=torch.int64)
    _check(library().sa_paged_top_k(x.data_ptr(), x.numel(), k, out.data_ptr()))
    return out


@dataclass(frozen=True)
class StepPlan:
    """What each sequence of a step attends: ``plan [B, 4]`` int32 rows ``(sink_pages, candidates, k, m)``.

    ``k``: candidate pages attended (``>= candidates``: all; 0: none); ``m``: the rerank's shortlist.
    ``kmax``: the longest list of attended candidates (the width of :func:`fused_decode`'s ``selected``).
    """

    plan: torch.Tensor
    kmax: int
    #: The split step's calls prepared for this step (:class:`SplitCall`, one per policy and layer shape): every layer
    #: of the step that runs the same policy reuses one.
    calls: dict = field(default_factory=dict, compare=False, repr=False)


def step_plan(policy: PagedPolicy, seq_lens: torch.Tensor, block_size: int) -> StepPlan:
    """The per-sequence plan of one decode step, by the policy's own layout and page count (:class:`PagedPolicy`).

    The same for every layer of a step: the backend computes it once per step.

    >>> from sparseattn import registry
    >>> step_plan(PagedPolicy(registry.build("radar+", budget=512), "radar+"), torch.tensor([1000, 300]), 64).plan.tolist()
    [[1, 14, 6, 14], [1, 3, 3, 0]]
    """
    m = policy.method
    rows = []
    for length in seq_lens.tolist():
        layout = policy.layout(length, block_size)
        k = policy.pages_for(layout)
        n = layout.n_segments
        short = 0
        if not policy.fixed and isinstance(m.summary, Rerank) and 0 < k < n:
            short = m.summary.shortlist_size(m.reach(k, n), n)
        rows.append((layout.sink_end // block_size, n, k, short))
    plan = torch.tensor(rows, dtype=torch.int32).view(-1, 4)
    kmax = int(torch.minimum(plan[:, 1], plan[:, 2]).max()) if rows else 0
    return StepPlan(plan, kmax)


class PageStore:
    """One layer's page summaries for the fused kernel, per physical block: ``[N, H_kv, r, D]`` float32 (two for quest),
    one row per segment of the page (``segments``: ``r``, the pages' tokens over the policy's ``segment``).

    ``state[n]`` is 1 while block ``n``'s summary is valid (``sums_state[n]`` its sums'); :meth:`invalidate` clears it for every block
    vLLM writes into (a block reused for another sequence, or still filling), so the kernel summarises
    it afresh the next time it is a candidate. A block that prefix caching shares is summarised once.
    """

    def __init__(
        self, num_blocks: int, kv_heads: int, head_dim: int, mode: FusedMode, sums: bool = False, segments: int = 1,
        summary_dtype: torch.dtype = torch.float32, segment_sums: bool = True,
    ) -> None:  # fmt: skip
        if summary_dtype not in (torch.float32, torch.bfloat16) or (summary_dtype == torch.bfloat16 and mode != SPLIT):
            raise ValueError(f"PageStore: summary_dtype {summary_dtype} in mode {mode}; allowed: torch.float32, or "
                             f"torch.bfloat16 centroids in the split step (mode {SPLIT})")  # fmt: skip
        if not segment_sums and summary_dtype != torch.float32:
            raise ValueError("PageStore: segment_sums=False reads the merged tokens' logits off float32 centroids' scores; "
                             f"these are {summary_dtype}")  # fmt: skip
        #: Whether the sums keep each segment's row beside its page's (else the page's alone; see ``sums``).
        self.segment_sums = segment_sums or segments == 1
        shape = (num_blocks, kv_heads, segments, head_dim)
        self.summary = torch.zeros(shape, dtype=summary_dtype)
        self.summary2 = torch.zeros(shape, dtype=torch.float32) if mode == BOUND else None
        self.state = torch.zeros(num_blocks, dtype=torch.uint8)
        self.mode = mode
        #: A merged rest's per-segment value sums ``[N, H_kv, r, D]`` (with ``r > 1`` each page's own after its
        #: segments': ``[N, H_kv, r + 1, D]``, so a block of pages sums one row per page) and their validity, kept as the
        #: summaries are. With float32 centroids the step reads a merged token's logit off its centroid scores, so only
        #: the values are summed; bf16 centroids (rounded means) need the keys' sums too: rows of ``2 D``, keys' first.
        #: Without ``segment_sums`` (blocks of whole pages) each page's own row alone, ``[N, H_kv, 1, D]``: the step
        #: takes a run of segments' values' sum from the values it attends.
        rows = segments + 1 if segments > 1 and segment_sums else 1
        width = head_dim if summary_dtype == torch.float32 else 2 * head_dim
        self.sums = torch.zeros(num_blocks, kv_heads, rows, width, dtype=torch.float32) if sums else None
        self.sums_state = torch.zeros(num_blocks, dtype=torch.uint8) if sums else None

    @classmethod
    def for_policy(cls, policy: PagedPolicy, num_blocks: int, kv_heads: int, head_dim: int, block_size: int) -> PageStore:
        """The store ``policy``'s fused step keeps (its :func:`~sparseattn.vllm.route.route`: the mode, the summaries'
        storage dtype) over a cache of ``num_blocks`` pages of ``block_size`` tokens: its segments per page, the merged
        rest's sums when it has one. ValueError for a policy whose route keeps none."""
        way = route(policy)
        if not way.keeps_store:
            raise ValueError(f"PageStore.for_policy: {policy.name!r} keeps no page store: it runs {way.describe()}")
        mode, dtype = way.mode, way.summary_dtype
        r, rest = policy.segments_per_page(block_size), policy.merged
        # Page totals alone when every block of the merged rest is whole pages and the centroids are float32 (the merged
        # tokens' logits then come off their scores): the store is the centroids and one row per page, not r + 1 rows.
        whole_pages = rest is not None and min(rest.per_block, 2**62) % r == 0
        return cls(num_blocks, kv_heads, head_dim, mode, sums=rest is not None, segments=r, summary_dtype=dtype,
                   segment_sums=not (whole_pages and dtype == torch.float32))  # fmt: skip

    @classmethod
    def bytes_per_block(cls, policy: PagedPolicy, kv_heads: int, head_dim: int, block_size: int) -> int:
        """Bytes the store of :meth:`for_policy` holds per block of vLLM's cache (what a KV cache of ``n`` blocks
        adds beside it: ``n`` times this), for sizing the cache with its stores (:mod:`sparseattn.vllm.worker`).

        >>> from sparseattn import registry
        >>> policy = PagedPolicy(registry.build("radar+adaptive", budget=512), "radar+adaptive", segment=4).for_layer(1, 30)
        >>> PageStore.bytes_per_block(policy, 3, 64, 32)  # 3 heads x (8 centroids + 1 page sum) x 64 x 4 + 2
        6914
        """
        return cls.for_policy(policy, 1, kv_heads, head_dim, block_size).nbytes

    @property
    def num_blocks(self) -> int:
        return self.state.shape[0]

    @property
    def nbytes(self) -> int:
        """Bytes held beside vLLM's cache (outside its KV cache space): summaries, sums and their states.

        >>> PageStore(100, 3, 64, SPLIT, sums=True, segments=8).nbytes  # per block: 3 heads x (8 x 64 + 9 x 64) x 4 + 2
        1305800
        """
        held = (self.summary, self.summary2, self.state, self.sums, self.sums_state)
        return sum(t.numel() * t.element_size() for t in held if t is not None)

    def invalidate(self, slot_mapping: torch.Tensor, block_size: int) -> None:
        """Mark stale the blocks ``slot_mapping`` (int64 slots, ``-1`` for padding) writes into."""
        slots = slot_mapping.to(torch.int64).contiguous()
        for state in (self.state, self.sums_state):
            if state is not None:
                library().sa_paged_invalidate(slots.data_ptr(), slots.numel(), block_size, state.data_ptr(), self.num_blocks)


def cache_share(page_bytes: Mapping[str, int], store: Mapping[str, int]) -> float:
    """The share of memory the KV cache may take when each layer's store rides on every block beside it:
    ``sum(page_bytes) / sum(page_bytes + store)`` over the layers (``store``: bytes per block, 0 or absent: none).

    >>> round(cache_share({"l0": 24576, "l1": 24576}, {"l1": 6914}), 4)  # the preset's layers 0 and 1 at 8k, 32-token pages
    0.8767
    >>> cache_share({"l0": 24576}, {})
    1.0
    """
    kv = sum(page_bytes.values())
    if kv <= 0:
        raise ValueError(f"cache_share: the KV cache's page bytes sum to {kv}; allowed: a positive total")
    extra = sum(store.get(name, 0) for name in page_bytes)
    return kv / (kv + extra)


def fused_decode(
    policy: PagedPolicy, mode: FusedMode, store: PageStore | None, kv_cache: torch.Tensor, query: torch.Tensor,
    block_table: torch.Tensor, seq_lens: torch.Tensor, scale: float, softcap: float | None = None,
    plan: StepPlan | None = None, with_selection: bool = False, out: torch.Tensor | None = None, fmt: KVFormat = KVFormat(),
    layout: str = "vec",
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One decode token per sequence: ``query [B, H_q, D]`` over the paged cache -> ``([B, H_q, D], selected)``.

    Arguments as :func:`~sparseattn.vllm.paged.paged_decode`; ``mode``: the policy's :func:`~sparseattn.vllm.route.route`'s;
    ``store``: the layer's :class:`PageStore` (None for :data:`FIXED`); ``plan``: the step's
    :func:`step_plan` (computed here when None). ``with_selection``: also return the attended candidate
    pages ``[B, H_kv, G', kmax]`` int32 (candidate indices: logical page - sink pages; ``-1`` past a
    list's end), else None. ``out``: a contiguous ``[B, H_q, D]`` (float32, bfloat16 or float16) to write
    the result into (the backend hands vLLM's output rows: no copy), else a new float32 tensor. ``fmt``: an
    fp8 cache's format and scales (:class:`~sparseattn.vllm.paged.KVFormat`: vLLM's uint8 cache, read in place,
    each number times its scale). ``layout``: the cache's page layout, ``"vec"`` (vLLM's ``vec``/``vec16`` kernels) or
    ``"amx"`` (its ``amx`` kernel's: :func:`~sparseattn.vllm.paged.amx_layout`; bfloat16, read in place,
    :func:`amx_readable` says which policies). Inside a :class:`~sparseattn.vllm.profile.StepProfile` the call's
    phases are timed.
    """
    prof = active()
    args = (policy, mode, store, kv_cache, query, block_table, seq_lens, scale, softcap, plan, with_selection, out, fmt, layout)
    if prof is None:
        return _fused_decode(*args)
    with prof.call():
        return _fused_decode(*args)


#: vLLM's fp8 KV cache dtypes as ``paged_kernels.c`` numbers them (a uint8 cache of e4m3fn or e5m2 numbers), and the
#: factor the kernel's reading of each leaves out (it reads an e4m3fn byte as a float16 2^8 times smaller: exact).
FP8_CODES = {"fp8": 3, "fp8_e4m3": 3, "fp8_e5m2": 4}
_FP8_FACTOR = {3: 256.0, 4: 1.0}


#: The page layouts the fused step reads: vLLM's ``vec``/``vec16`` kernels' and its ``amx`` kernel's.
LAYOUTS = ("vec", "amx")


def amx_refusal(policy: PagedPolicy, dtype: torch.dtype, block_size: int, head_dim: int) -> str | None:
    """Why the fused step cannot read ``policy``'s pages in vLLM's ``amx`` layout (None: it can): the layout holds bfloat16
    pages of multiples of 32 tokens with head dims of multiples of 32, and the fused step reads it for dense,
    streamingllm, quest and radar+ in every form on segments of an even number of tokens; the generic path does not read it.

    >>> from sparseattn import registry
    >>> amx_refusal(PagedPolicy(registry.build("radar+"), "radar+", 8), torch.bfloat16, 128, 64) is None
    True
    >>> amx_refusal(PagedPolicy(registry.build("radar"), "radar"), torch.bfloat16, 128, 64)
    "'radar' runs the generic path, which reads the vec layout only"
    """
    if dtype != torch.bfloat16 or block_size % 32 or head_dim % 32:
        return (f"the amx layout holds bfloat16 pages of multiples of 32 tokens and head dims of multiples of 32; this cache is "
                f"{dtype} with {block_size}-token pages and head dim {head_dim}")  # fmt: skip
    if policy.layered:  # every layer's own method
        reasons = (amx_refusal(PagedPolicy(leaf, policy.name, policy.segment), dtype, block_size, head_dim) for leaf in layer_methods(policy.method))
        return next((r for r in reasons if r is not None), None)
    mode = route(policy).mode
    if mode is None:
        return f"{policy.name!r} runs the generic path, which reads the vec layout only"
    seg = block_size // policy.segments_per_page(block_size)
    if mode != FIXED and seg % 2:
        return f"{policy.name!r} on {seg}-token segments: the amx layout's values are read in pairs of tokens"
    return None


def cache_code(kv_cache: torch.Tensor, fmt: KVFormat) -> tuple[int, float, float]:
    """``(dtype code, key multiplier, value multiplier)`` of a cache as the kernel reads it (ValueError: not readable).

    >>> cache_code(torch.zeros(1, dtype=torch.uint8), KVFormat("fp8_e4m3", 0.5, 2.0))
    (3, 128.0, 512.0)
    """
    if fmt.fp8 is not None:
        if kv_cache.dtype != torch.uint8 or fmt.dtype not in FP8_CODES:
            raise ValueError(f"fused paged decode: an {fmt.dtype!r} cache of {kv_cache.dtype}; allowed: a uint8 cache of "
                             f"{sorted(FP8_CODES)}")  # fmt: skip
        code = FP8_CODES[fmt.dtype]
        return code, fmt.k_scale * _FP8_FACTOR[code], fmt.v_scale * _FP8_FACTOR[code]
    if kv_cache.dtype not in DTYPE_CODES or (kv_cache.dtype == torch.float16 and not library().sa_paged_float16_supported()):
        raise ValueError(f"fused paged decode: cache dtype {kv_cache.dtype} is not supported; allowed: float32, bfloat16, "
                         f"float16, or a uint8 fp8 cache with its KVFormat")  # fmt: skip
    return DTYPE_CODES[kv_cache.dtype], 1.0, 1.0


def _fused_decode(
    policy: PagedPolicy, mode: FusedMode, store: PageStore | None, kv_cache: torch.Tensor, query: torch.Tensor,
    block_table: torch.Tensor, seq_lens: torch.Tensor, scale: float, softcap: float | None, plan: StepPlan | None,
    with_selection: bool, out: torch.Tensor | None, fmt: KVFormat, layout: str,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    lib = library()
    way = route(policy)
    if mode != way.mode:
        raise ValueError(f"fused paged decode: mode {mode!r} for {policy.name!r}, whose route is {way.describe()}; allowed: "
                         f"{way.mode!r} (route)")  # fmt: skip
    N, H, bs, two_d = kv_cache.shape
    B, H_q, D = query.shape
    code, k_mul, v_mul = cache_code(kv_cache, fmt)
    if layout not in LAYOUTS:
        raise ValueError(f"fused paged decode: layout {layout!r}; allowed: {', '.join(LAYOUTS)}")
    amx = layout == "amx"
    if amx and (refusal := amx_refusal(policy, kv_cache.dtype, bs, D)) is not None:
        raise ValueError(f"fused paged decode: {refusal}")
    if two_d != 2 * D or H_q % H or not kv_cache.is_contiguous():
        raise ValueError(f"fused paged decode: cache {tuple(kv_cache.shape)} (contiguous: {kv_cache.is_contiguous()}) does "
                         f"not fit queries {tuple(query.shape)}; expected a contiguous [N, H_kv, bs, 2 * D] with H_q % H_kv == 0")
    if bs > MAX_BLOCK_SIZE:
        raise ValueError(f"fused paged decode: block size {bs} is out of range; allowed: <= {MAX_BLOCK_SIZE}")
    r = policy.segments_per_page(bs)
    if (store is None) == way.keeps_store:
        raise ValueError("fused paged decode: a PageStore is needed exactly when the mode scores pages")
    plan = plan or step_plan(policy, seq_lens, bs)
    if not (plan.plan.shape[0] == block_table.shape[0] == seq_lens.shape[0] == B):
        raise ValueError(f"fused paged decode: {B} queries, {block_table.shape[0]} block-table rows, {seq_lens.shape[0]} "
                         f"lengths and {plan.plan.shape[0]} plan rows; expected one of each per sequence")
    if store is not None and (store.summary.shape != (N, H, r, D) or store.mode != mode):
        raise ValueError(f"fused paged decode: the page store {tuple(store.summary.shape)} (mode {store.mode}) does not fit "
                         f"the cache's {(N, H, r, D)} ({r} segment(s) per page) in mode {mode}")
    if store is not None and store.summary.dtype != way.summary_dtype:
        raise ValueError(f"fused paged decode: the page store holds {store.summary.dtype} summaries, the policy's are "
                         f"{way.summary_dtype} (PageStore.for_policy)")
    G = H_q // H
    shared = policy.shared_selection
    if query.dtype not in DTYPE_CODES:
        raise ValueError(f"fused paged decode: query dtype {query.dtype}; allowed: float32, bfloat16, float16")
    if out is None:
        out = torch.empty(B, H_q, D, dtype=torch.float32)
    elif out.shape != (B, H_q, D) or out.dtype not in DTYPE_CODES or not out.is_contiguous():
        raise ValueError(f"fused paged decode: out {tuple(out.shape)} {out.dtype} (contiguous: {out.is_contiguous()}); "
                         f"expected a contiguous {(B, H_q, D)} of float32, bfloat16 or float16")
    if mode in (SPLIT, BOUND):  # quest's bound runs through the split step too (its attention over runs of segments)
        key = (id(policy), N, H, bs, D, G, kv_cache.dtype, query.dtype, float(scale), float(softcap or 0.0))
        call = plan.calls.get(key)
        if call is None:
            call = plan.calls[key] = SplitCall(policy, plan, kv_cache, query, scale, softcap, r)
        call(store, kv_cache, query, block_table, seq_lens, out, code, k_mul, v_mul, amx)
        return out, call.selected(max(plan.kmax, 1)) if with_selection else None
    q = query.contiguous()
    table = block_table.to(torch.int32).contiguous()
    lens = seq_lens.to(torch.int32).contiguous()
    kmax = max(plan.kmax, 1)
    selected = torch.empty(B, H, 1 if shared else G, kmax, dtype=torch.int32) if with_selection else None
    args = DecodeArgs(
        q.data_ptr(), kv_cache.data_ptr(), table.data_ptr(), lens.data_ptr(), plan.plan.data_ptr(),
        None if store is None else store.summary.data_ptr(), None if store is None or store.summary2 is None else store.summary2.data_ptr(),
        None if store is None else store.state.data_ptr(), None if selected is None else selected.data_ptr(), out.data_ptr(),
        N, H, bs, D, r, G, B, table.shape[1], kmax, float(scale), float(softcap or 0.0), k_mul, v_mul, code,
        DTYPE_CODES[q.dtype], DTYPE_CODES[out.dtype], mode, int(shared), torch.get_num_threads(), int(amx), 0,
    )  # fmt: skip
    _check(lib.sa_paged_decode(ctypes.byref(args)))
    return out, selected


class _Scratch(threading.local):
    """The split step's scratch between its C calls, one set per thread, reused by every layer and step: a fresh
    tensor per call (the shortlist's logits are megabytes at 8k x 8) would be new pages for the kernel to fault in
    every time, and one set per layer would hold those megabytes 30 times. Each buffer grows to the largest step seen."""

    def __init__(self) -> None:
        self.buffers: dict[str, torch.Tensor] = {}

    def get(self, name: str, shape: tuple[int, ...], dtype: torch.dtype = torch.float32) -> torch.Tensor:
        n = math.prod(shape)
        have = self.buffers.get(name)
        if have is None or have.numel() < n or have.dtype != dtype:
            have = self.buffers[name] = torch.empty(n, dtype=dtype)
        return have[:n].view(shape)


_SCRATCH = _Scratch()


def _fields(*groups: tuple[type, str]) -> list[tuple[str, type]]:
    """A ctypes ``_fields_`` list from ``(type, "name name ...")`` groups, in order."""
    return [(name, kind) for kind, names in groups for name in names.split()]


class SplitArgs(ctypes.Structure):
    """``paged_kernels.c``'s ``sa_split_args``, field by field (``tests/test_vllm_paged_kernel.py`` holds the offsets
    to the C struct's): what :class:`SplitCall` hands ``sa_paged_split``."""

    _fields_ = _fields(
        (ctypes.c_void_p, "q cache block_table seq_lens plan pool summary summary2 state sums sums_state coarse short_ix exact always kept "
                          "chosen out"),
        (ctypes.c_int64, "N H bs D r G B bt_stride S_max M_max per_block"),
        (ctypes.c_float, "scale softcap root k_mul v_mul"),
        (ctypes.c_int32, "dtype q_dtype out_dtype shared summary_bf16 segment_rows allocation threads amx bound"),
    )


class DecodeArgs(ctypes.Structure):
    """``paged_kernels.c``'s ``sa_decode_args`` field by field (held to the C offsets by a test): what
    :func:`fused_decode` hands ``sa_paged_decode`` (quest's bound and the fixed selections)."""

    _fields_ = _fields(
        (ctypes.c_void_p, "q cache block_table seq_lens plan summary summary2 state selected out"),
        (ctypes.c_int64, "N H bs D r G B bt_stride kmax"),
        (ctypes.c_float, "scale softcap k_mul v_mul"),
        (ctypes.c_int32, "dtype q_dtype out_dtype mode shared threads amx unused"),
    )


#: ``sa_paged_split``'s phases (bits) and the allocations it runs itself.
SPLIT_SCORE, SPLIT_ALLOCATE, SPLIT_ATTEND = 1, 2, 4
ALLOC_NONE, ALLOC_TOPK, ALLOC_POOLED, ALLOC_TOPK_COARSE = 0, 1, 2, 3


def c_allocation(policy: PagedPolicy, plan: torch.Tensor) -> tuple[int, torch.Tensor | None]:
    """Which allocation the split step runs in C for ``policy`` on ``plan [B, 4]``, and (pooled) its per-row ``[B, 2]``
    widths and floors: ``TopK`` over the shortlist (a uniform split whose ``k`` the shortlist holds), ``PooledMass``
    (each query head selecting, its width within the shortlist), else :data:`ALLOC_NONE` (the policy's own, in Python).

    >>> from sparseattn import registry
    >>> rows = torch.tensor([[1, 100, 10, 20]], dtype=torch.int32)
    >>> c_allocation(PagedPolicy(registry.build("radar+"), "radar+"), rows)[0] == ALLOC_TOPK
    True
    >>> mode, pool = c_allocation(PagedPolicy(registry.build("radar+", split="pooled"), "radar+:split=pooled"), rows)
    >>> mode == ALLOC_POOLED, pool.tolist()
    (True, [[20, 3]])
    >>> c_allocation(PagedPolicy(registry.build("radar+", split="topp"), "radar+:split=topp"), rows)[0] == ALLOC_NONE
    True
    """
    m = policy.method
    stage = m.select_stage
    mode = route(policy).mode
    if mode is None or mode == FIXED:
        return ALLOC_NONE, None
    if mode == BOUND:  # quest: each selection's k best of every candidate's bound (its route: a uniform allocation)
        return ALLOC_TOPK_COARSE, None
    selecting = (plan[:, 2] > 0) & (plan[:, 2] < plan[:, 1])
    rows = plan[selecting].tolist()
    if declared(stage) == "uniform" and all(k <= mm for _, _, k, mm in rows):
        return ALLOC_TOPK, None
    if declared(stage) == "pooled" and not policy.shared_selection:
        pool = torch.zeros(plan.shape[0], 2, dtype=torch.int32)
        for i, (_, n_cand, k, mm) in zip(selecting.nonzero().flatten().tolist(), rows):
            w = stage.width(k, n_cand)
            if w > mm:  # past the shortlist: segments the split step did not rescore (the Python part reads the rest)
                return ALLOC_NONE, None
            pool[i, 0], pool[i, 1] = w, min(stage.floor_count(k), w)
        return ALLOC_POOLED, pool
    return ALLOC_NONE, None


class SplitCall:
    """The :data:`SPLIT` step of one decode step for one policy (through :func:`fused_decode`, which checks the
    arguments): segments inside pages, per-head segment counts and a merged rest, in ``sa_paged_split`` (C,
    ``paged_kernels.c``):

    1. score: every candidate's centroid score, the KV group's shortlist and its exact log masses (the logits
       kept), the sinks' and tail's log mass, for the sequences that select;
    2. allocate: the policy's own allocation over those scores, in C for ``TopK`` over the shortlist and
       :class:`~sparseattn.allocations.PooledMass` (:func:`c_allocation`), else in Python: any
       :class:`~sparseattn.allocations.Allocation`, given a :class:`~sparseattn.vllm.paged.PageStep` exactly as
       the generic path gives it the scores (the :class:`~sparseattn.summaries.base.Shortlist`'s), one batch per
       group of alike sequences (the two C phases are then two calls);
    3. attend: sinks, tail and each selection's segments (a shortlisted page's logits reused), and the merged rest:
       its values from the value sums in ``store``, its logits from the centroid scores of step 1 where the
       centroids are float32 (from the keys' sums the store keeps where they are bfloat16).

    Made once per step and policy (:attr:`StepPlan.calls`): the plan's sizes, the allocation, the scratch and the
    C argument struct are the same in every layer, which sets only its own pointers: a layer's Python runs right
    after the last layer's step swept its megabytes through the caches, where every Python operation is slow.
    """

    def __init__(self, policy: PagedPolicy, plan: StepPlan, kv_cache: torch.Tensor, query: torch.Tensor, scale: float,
                 softcap: float | None, r: int) -> None:  # fmt: skip
        N, H, bs, _ = kv_cache.shape
        B, H_q, D = query.shape
        G = H_q // H
        self.policy, self.plan, self.G = policy, plan, G
        m = policy.method
        self.Gs = 1 if policy.shared_selection else G
        rows = self.rows = plan.plan.contiguous()
        S_max = self.S_max = max(int(rows[:, 1].max()) if B else 0, 1)
        M_max = max(int(rows[:, 3].max()) if B else 0, 1)
        # Views of the thread's scratch (each buffer grows to the largest step seen): held here, so a later call that
        # grows a buffer leaves this one's memory alive.
        self.coarse = _SCRATCH.get("coarse", (B, H, G, S_max))
        self.short = _SCRATCH.get("short", (B, H, M_max), torch.int32)
        self.exact = _SCRATCH.get("exact", (B, H, G, M_max))
        self.always = _SCRATCH.get("always", (B, H, G))
        self.kept = _SCRATCH.get("kept", (B, H, M_max, G, bs))
        self.chosen = _SCRATCH.get("chosen", (B, H, self.Gs, S_max), torch.uint8)
        self.allocation, self.pool = c_allocation(policy, rows)
        rest = m.rest
        self.merged = rest is not None
        self.args = SplitArgs(
            None, None, None, None, rows.data_ptr(), None if self.pool is None else self.pool.data_ptr(), None, None, None, None, None,
            self.coarse.data_ptr(), self.short.data_ptr(), self.exact.data_ptr(), self.always.data_ptr(), self.kept.data_ptr(),
            self.chosen.data_ptr(), None, N, H, bs, D, r, G, B, 0, S_max, M_max, 0 if rest is None else min(rest.per_block, 2**62),
            float(scale), float(softcap or 0.0), math.sqrt(scale), 1.0, 1.0, 0, DTYPE_CODES[query.dtype],
            DTYPE_CODES[torch.float32], int(policy.shared_selection), 0, 0, self.allocation, 1, 0,
            int(self.allocation == ALLOC_TOPK_COARSE),
        )  # fmt: skip
        self._table: tuple[torch.Tensor, torch.Tensor] | None = None  # (the step's block table, as the kernel reads it)
        self._lens: tuple[torch.Tensor, torch.Tensor] | None = None

    def selected(self, kmax: int) -> torch.Tensor:
        """The last call's attended candidates ``[B, H_kv, G', kmax]`` int32 (ascending, -1 past each list's end;
        the selections that did not select: every candidate when they attend all, else none), as ``sa_paged_decode`` reports them."""
        rows, chosen = self.rows, self.chosen
        B, H, Gs, S = chosen.shape
        out = torch.full((B, H, Gs, kmax), -1, dtype=torch.int32)
        for b, (_, n_cand, k, _) in enumerate(rows.tolist()):
            if 0 < k < n_cand:
                flags = chosen[b, :, :, :n_cand].bool()
                order = torch.where(flags, torch.arange(n_cand), n_cand).sort(dim=-1).values[..., :kmax]
                out[b] = torch.where(order < n_cand, order, -1).to(torch.int32)
            elif k >= n_cand > 0:
                out[b, :, :, : min(n_cand, kmax)] = torch.arange(min(n_cand, kmax), dtype=torch.int32)
        return out

    def _int32(self, which: str, t: torch.Tensor) -> torch.Tensor:
        """``t`` as contiguous int32, converted once per step (every layer passes the step's same table and lengths)."""
        have = getattr(self, which)
        if have is None or have[0] is not t:
            have = (t, t.to(torch.int32).contiguous())
            setattr(self, which, have)
        return have[1]

    def __call__(self, store: PageStore, kv_cache: torch.Tensor, query: torch.Tensor, block_table: torch.Tensor,
                 seq_lens: torch.Tensor, out: torch.Tensor, code: int, k_mul: float, v_mul: float, amx: bool = False) -> torch.Tensor:  # fmt: skip
        if self.merged and store.sums is None:
            raise ValueError("fused paged decode: a merged rest needs a PageStore made with sums=True")
        lib = library()
        table = self._int32("_table", block_table)
        a = self.args
        q = query if query.is_contiguous() else query.contiguous()
        a.q, a.q_dtype, a.cache, a.out, a.out_dtype = q.data_ptr(), DTYPE_CODES[q.dtype], kv_cache.data_ptr(), out.data_ptr(), DTYPE_CODES[out.dtype]
        a.dtype, a.k_mul, a.v_mul, a.amx = code, k_mul, v_mul, int(amx)
        a.block_table, a.bt_stride, a.seq_lens = table.data_ptr(), table.shape[1], self._int32("_lens", seq_lens).data_ptr()
        a.summary, a.state = store.summary.data_ptr(), store.state.data_ptr()
        a.summary2 = None if store.summary2 is None else store.summary2.data_ptr()
        a.sums = None if store.sums is None else store.sums.data_ptr()
        a.sums_state = None if store.sums_state is None else store.sums_state.data_ptr()
        a.summary_bf16, a.segment_rows = int(store.summary.dtype == torch.bfloat16), int(store.segment_sums)
        a.threads = torch.get_num_threads()
        if self.allocation != ALLOC_NONE:
            _check(lib.sa_paged_split(ctypes.byref(a), SPLIT_SCORE | SPLIT_ALLOCATE | SPLIT_ATTEND))
            return out
        _check(lib.sa_paged_split(ctypes.byref(a), SPLIT_SCORE))
        # The allocation, per group of alike sequences (the same candidates, page count and shortlist), as choose_pages runs it.
        groups: dict[tuple[int, int, int, int], list[int]] = {}
        for i, row in enumerate(self.rows.tolist()):
            if 0 < row[2] < row[1]:
                groups.setdefault(tuple(row), []).append(i)
        B, H, D, bs = q.shape[0], kv_cache.shape[1], q.shape[2], kv_cache.shape[2]
        grouped = q.float().view(B, H, self.G, D)
        lens = self._int32("_lens", seq_lens)
        for row, members in groups.items():
            with python_part("allocate (python)"):
                self.chosen[torch.tensor(members)] = _python_allocation(
                    self.policy, grouped, members, row, self.coarse, self.short, self.exact, self.always, lens, bs, self.Gs, self.S_max,
                )  # fmt: skip
        _check(lib.sa_paged_split(ctypes.byref(a), SPLIT_ATTEND))
        return out


def _check(status: int) -> None:
    if status:
        raise ValueError(f"fused paged decode failed: {_ERRORS.get(status, f'status {status}')}")


def _python_allocation(
    policy: PagedPolicy, grouped: torch.Tensor, members: list[int], row: tuple[int, int, int, int], coarse: torch.Tensor,
    short: torch.Tensor, exact: torch.Tensor, always: torch.Tensor, lens: torch.Tensor, bs: int, Gs: int, S_max: int,
) -> torch.Tensor:
    """The policy's own allocation over the split step's scores, for the sequences ``members`` (alike: ``row``'s plan):
    flags ``[len(members), H, G', S_max]`` uint8, 1 for each candidate a selection attends."""
    m = policy.method
    _, n_cand, k, mm = row
    idx = torch.tensor(members)
    shortlist = Shortlist(coarse[idx, :, :, :n_cand], short[idx, :, :mm].long().unsqueeze(2), exact[idx, :, :, :mm])
    reach = m.reach(k, n_cand)  # the top_k the split step scored for

    def scorer(top_k: int) -> torch.Tensor:
        if top_k != reach:
            raise ValueError(f"the split step scored for top_k={reach}; the allocation asked for {top_k}")
        return shortlist.scores

    layout = policy.layout(int(lens[members[0]]), bs)
    step = PageStep(m, torch.Generator(), grouped[idx], layout, k, Gs, scorer, lambda: always[idx], shortlist)
    selection = m.select_stage.select_segments(step)
    flags = torch.zeros(len(members), coarse.shape[1], Gs, S_max, dtype=torch.uint8)
    flags.scatter_(-1, selection.segments, 1 if selection.valid is None else selection.valid.to(torch.uint8))
    return flags
