"""The paged engine's fused CPU step: score, select and attend vLLM's pages in one C call per layer.

:func:`~sparseattn.vllm.paged.select_pages` runs any policy's own parts over the pages (torch, one
batch of the method's summary and selector per group of alike sequences) and a paged kernel then
attends the listed pages. For the policies whose parts it knows, :func:`fused_decode` does the same
step in ``paged_kernels.c`` (built like the cpu backend's kernel, :func:`~sparseattn.backends.cpu_kernels.build_library`):

* ``Rerank(Centroid(), per_group=True)`` + ``TopK`` (radar+): centroid scores of every candidate
  page, the KV group's shortlist, the shortlist's exact log masses, each head's top pages; the
  shortlist's logits are kept and attended, so a shortlisted key is read once (``RERANK``; on segments
  inside pages, and with per-head counts or a merged rest, the split step ``SPLIT``);
* ``MinMaxBound`` + ``TopK`` (quest): the per-channel bound of every candidate page, each head's top pages;
* dense and streamingllm (the pages attended do not depend on the query).

Every other policy (radar's random features, a third party's summary or selector, a centroid
stored in float16) keeps the generic path: :func:`fused_mode` says which. Page summaries (mean
key, or min and max) are kept per physical block in a :class:`PageStore`, computed inside the call
when a candidate page is stale, once for all sequences sharing it under prefix caching.

The references are the generic path's: ``tests/test_vllm_paged_kernel.py`` checks that the kernel
selects the pages :func:`~sparseattn.vllm.paged.select_pages` selects and that its output equals
float64 attention over them.
"""

from __future__ import annotations

import ctypes
import functools
import math
import threading
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from sparseattn.backends.cpu_kernels import DTYPE_CODES, build_library, build_refusal
from sparseattn.allocations.pooled import PooledMass
from sparseattn.selectors.topk import TopK
from sparseattn.summaries.centroid import Centroid
from sparseattn.summaries.minmax import MinMaxBound
from sparseattn.summaries.rerank import Rerank
from sparseattn.methods.rest import MergedRest
from sparseattn.summaries.base import Shortlist
from sparseattn.vllm.paged import PagedPolicy, PageStep

__all__ = [
    "BOUND", "FIXED", "RERANK", "SPLIT", "PageStore", "StepPlan", "cache_share", "fused_decode", "fused_mode", "kernel_refusal", "split_decode",
    "step_plan", "summary_dtype",
]

#: The kernel's modes (``paged_kernels.c``); SPLIT: radar+'s scoring with the policy's own allocation (per-head
#: page counts) and merged rest, in two calls with the allocation between them (:func:`split_decode`).
RERANK, BOUND, FIXED, SPLIT = 0, 1, 2, 3
SYMBOLS = ("sa_paged_decode", "sa_paged_invalidate", "sa_paged_float16_supported", "sa_paged_score", "sa_paged_attend_lists")
_ERRORS = {
    1: "a block table entry is outside the cache's blocks",
    2: "the kernel could not allocate its scratch memory",
    4: "the kernel was built without this cache dtype",
    6: "the step plan does not fit the sequences (sinks + candidates past the last page, k or m out of range)",
}
#: The most tokens per page the kernel takes (one page's row is scratch on the stack).
MAX_BLOCK_SIZE = 4096


@functools.cache
def _library() -> ctypes.CDLL:
    lib = build_library("sparseattn.vllm", "paged_kernels.c", SYMBOLS)
    i64, i32, ptr, f32 = ctypes.c_int64, ctypes.c_int, ctypes.c_void_p, ctypes.c_float
    lib.sa_paged_decode.restype = ctypes.c_int
    lib.sa_paged_decode.argtypes = [
        ptr, ptr, i32, i64, i64, i64, i64, i64, i64, i64, ptr, i64, ptr, ptr, i32, i32, f32, f32, ptr, ptr, ptr, ptr, i64, ptr, i32,
    ]  # fmt: skip
    lib.sa_paged_score.restype = ctypes.c_int
    lib.sa_paged_score.argtypes = [
        ptr, ptr, i32, i64, i64, i64, i64, i64, i64, i64, ptr, i64, ptr, ptr, f32, ptr, i32, f32, ptr, i64, i64, ptr, ptr, ptr, ptr,
        ptr, i32,
    ]  # fmt: skip
    lib.sa_paged_attend_lists.restype = ctypes.c_int
    lib.sa_paged_attend_lists.argtypes = [
        ptr, ptr, i32, i64, i64, i64, i64, i64, i64, i64, ptr, i64, ptr, ptr, i32, f32, f32, ptr, i64, ptr, ptr, i64, i64, ptr,
        ptr, i32, ptr, ptr, i32,
    ]  # fmt: skip
    lib.sa_paged_pooled_split.restype = ctypes.c_int
    lib.sa_paged_pooled_split.argtypes = [i64, i64, i64, ptr, ptr, i64, ptr, ptr, i64, ptr, i64, i64, ptr, i32]
    lib.sa_paged_invalidate.restype = None
    lib.sa_paged_invalidate.argtypes = [ptr, i64, i64, ptr, i64]
    lib.sa_paged_float16_supported.restype = ctypes.c_int
    return lib


@functools.cache
def kernel_refusal() -> str | None:
    """Why the fused kernel cannot be built or loaded here, in words; None when it loads."""
    return build_refusal(_library)


def fused_mode(policy: PagedPolicy) -> int | None:
    """The kernel mode that runs ``policy`` exactly as the generic path does, or None (generic path).

    >>> from sparseattn import registry
    >>> [fused_mode(PagedPolicy(registry.build(n), n)) for n in ("dense", "streamingllm", "radar+", "quest", "radar")]
    [2, 2, 0, 1, None]
    >>> fused_mode(PagedPolicy(registry.build("radar+", split="pooled", rest="merged"), "radar+:split=pooled,rest=merged"))
    3
    >>> fused_mode(PagedPolicy(registry.build("radar+"), "radar+", segment=8))  # segments inside pages: the split step
    3
    """
    if policy.layered:
        raise ValueError(f"fused_mode: {policy.name!r} runs a method per layer; ask for each layer's policy (PagedPolicy.for_layer)")
    if policy.fixed:
        return FIXED
    m = policy.method
    if type(m.selector) is not TopK or (m.rest is not None and type(m.rest) is not MergedRest):
        return None  # a subclass may rank otherwise
    summary = m.summary
    centroids = (
        type(summary) is Rerank and type(summary.coarse) is Centroid and summary.coarse.dtype in (None, torch.float32, torch.bfloat16)
        and summary.per_group and summary.shortlist > 0 and not summary.prefilter
    )  # fmt: skip
    if not m.allocation.uniform or m.rest is not None:  # per-head counts or a merged rest: scored, split, attended
        return SPLIT if centroids else None
    if centroids:
        # Segments inside pages: the split step computes each shortlisted page's logits once for all its segments and
        # attends a group's lists in one pass, where RERANK computes them per segment (radar+ on 8-token segments of
        # 32-token pages at 8k x 8: 2.2 against 3.4 ms; on whole pages RERANK is the faster, 0.67 against 0.73 ms).
        # bfloat16 centroids are scored by the split step only.
        return SPLIT if policy.segment is not None or summary.coarse.dtype == torch.bfloat16 else RERANK
    if type(summary) is MinMaxBound:
        return BOUND
    return None


def summary_dtype(policy: PagedPolicy) -> torch.dtype:
    """The storage of ``policy``'s page summaries in the fused step: bfloat16 for radar+'s centroids stored so
    (``Centroid(dtype=torch.bfloat16)``, ``bf16_centroids=true``), else float32."""
    summary = None if policy.fixed or policy.layered else policy.method.summary
    coarse = getattr(summary, "coarse", None) if type(summary) is Rerank else None
    return torch.bfloat16 if type(coarse) is Centroid and coarse.dtype == torch.bfloat16 else torch.float32


@dataclass(frozen=True)
class StepPlan:
    """What each sequence of a step attends: ``plan [B, 4]`` int32 rows ``(sink_pages, candidates, k, m)``.

    ``k``: candidate pages attended (``>= candidates``: all; 0: none); ``m``: the rerank's shortlist.
    ``kmax``: the longest list of attended candidates (the width of :func:`fused_decode`'s ``selected``).
    """

    plan: torch.Tensor
    kmax: int


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
            short = min(max(m.summary.shortlist, math.ceil(m.summary.factor * k)), n)
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
        self, num_blocks: int, kv_heads: int, head_dim: int, mode: int, sums: bool = False, segments: int = 1,
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
    def for_policy(cls, policy: PagedPolicy, mode: int, num_blocks: int, kv_heads: int, head_dim: int, block_size: int) -> PageStore:
        """The store ``policy`` runs on in ``mode`` over a cache of ``num_blocks`` pages of ``block_size`` tokens: its
        segments per page, the merged rest's sums when it has one, its centroids' storage dtype."""
        r, dtype, rest = policy.segments_per_page(block_size), summary_dtype(policy), policy.merged
        # Page totals alone when every block of the merged rest is whole pages and the centroids are float32 (the merged
        # tokens' logits then come off their scores): the store is the centroids and one row per page, not r + 1 rows.
        whole_pages = rest is not None and min(rest.per_block, 2**62) % r == 0
        return cls(num_blocks, kv_heads, head_dim, mode, sums=rest is not None, segments=r, summary_dtype=dtype,
                   segment_sums=not (whole_pages and dtype == torch.float32))  # fmt: skip

    @staticmethod
    def kept_in(mode: int | None) -> bool:
        """Whether the fused step in ``mode`` keeps a store (every mode but :data:`FIXED`; None, the generic path, none)."""
        return mode is not None and mode != FIXED

    @classmethod
    def bytes_per_block(cls, policy: PagedPolicy, mode: int, kv_heads: int, head_dim: int, block_size: int) -> int:
        """Bytes the store of :meth:`for_policy` holds per block of vLLM's cache (what a KV cache of ``n`` blocks
        adds beside it: ``n`` times this), for sizing the cache with its stores (:mod:`sparseattn.vllm.worker`).

        >>> from sparseattn import registry
        >>> policy = PagedPolicy(registry.build("radar+adaptive", budget=512), "radar+adaptive", segment=4).for_layer(1, 30)
        >>> PageStore.bytes_per_block(policy, fused_mode(policy), 3, 64, 32)  # 3 heads x (8 centroids + 1 page sum) x 64 x 4 + 2
        6914
        """
        return cls.for_policy(policy, mode, 1, kv_heads, head_dim, block_size).nbytes

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
                _library().sa_paged_invalidate(slots.data_ptr(), slots.numel(), block_size, state.data_ptr(), self.num_blocks)


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
    policy: PagedPolicy, mode: int, store: PageStore | None, kv_cache: torch.Tensor, query: torch.Tensor,
    block_table: torch.Tensor, seq_lens: torch.Tensor, scale: float, softcap: float | None = None,
    plan: StepPlan | None = None, with_selection: bool = False, out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One decode token per sequence: ``query [B, H_q, D]`` over the paged cache -> ``([B, H_q, D] float32, selected)``.

    Arguments as :func:`~sparseattn.vllm.paged.paged_decode`; ``mode`` from :func:`fused_mode`;
    ``store``: the layer's :class:`PageStore` (None for :data:`FIXED`); ``plan``: the step's
    :func:`step_plan` (computed here when None). ``with_selection``: also return the attended candidate
    pages ``[B, H_kv, G', kmax]`` int32 (candidate indices: logical page - sink pages; ``-1`` past a
    list's end), else None. ``out``: a contiguous float32 ``[B, H_q, D]`` to write the result into
    (the backend hands vLLM's float32 output rows: no copy), else a new tensor.
    """
    lib = _library()
    N, H, bs, two_d = kv_cache.shape
    B, H_q, D = query.shape
    if kv_cache.dtype not in DTYPE_CODES or (kv_cache.dtype == torch.float16 and not lib.sa_paged_float16_supported()):
        raise ValueError(f"fused paged decode: cache dtype {kv_cache.dtype} is not supported; allowed: float32, bfloat16, float16")
    if two_d != 2 * D or H_q % H or not kv_cache.is_contiguous():
        raise ValueError(f"fused paged decode: cache {tuple(kv_cache.shape)} (contiguous: {kv_cache.is_contiguous()}) does "
                         f"not fit queries {tuple(query.shape)}; expected a contiguous [N, H_kv, bs, 2 * D] with H_q % H_kv == 0")
    if bs > MAX_BLOCK_SIZE:
        raise ValueError(f"fused paged decode: block size {bs} is out of range; allowed: <= {MAX_BLOCK_SIZE}")
    r = policy.segments_per_page(bs)
    if (store is None) == PageStore.kept_in(mode):
        raise ValueError("fused paged decode: a PageStore is needed exactly when the mode scores pages")
    plan = plan or step_plan(policy, seq_lens, bs)
    if not (plan.plan.shape[0] == block_table.shape[0] == seq_lens.shape[0] == B):
        raise ValueError(f"fused paged decode: {B} queries, {block_table.shape[0]} block-table rows, {seq_lens.shape[0]} "
                         f"lengths and {plan.plan.shape[0]} plan rows; expected one of each per sequence")
    if store is not None and (store.summary.shape != (N, H, r, D) or store.mode != mode):
        raise ValueError(f"fused paged decode: the page store {tuple(store.summary.shape)} (mode {store.mode}) does not fit "
                         f"the cache's {(N, H, r, D)} ({r} segment(s) per page) in mode {mode}")
    if store is not None and store.summary.dtype != summary_dtype(policy):
        raise ValueError(f"fused paged decode: the page store holds {store.summary.dtype} summaries, the policy's are "
                         f"{summary_dtype(policy)} (PageStore.for_policy)")
    G = H_q // H
    shared = policy.shared_selection
    if mode == SPLIT:
        if with_selection:
            raise ValueError("fused paged decode: the split step reports no selection (its lists are the allocation's)")
        return split_decode(policy, store, kv_cache, query, block_table, seq_lens, scale, softcap, plan, out, r), None
    q = query.to(torch.float32).contiguous()
    table = block_table.to(torch.int32).contiguous()
    lens = seq_lens.to(torch.int32).contiguous()
    if out is None:
        out = torch.empty(B, H_q, D, dtype=torch.float32)
    elif out.shape != (B, H_q, D) or out.dtype != torch.float32 or not out.is_contiguous():
        raise ValueError(f"fused paged decode: out {tuple(out.shape)} {out.dtype} (contiguous: {out.is_contiguous()}); "
                         f"expected a contiguous float32 {(B, H_q, D)}")
    kmax = max(plan.kmax, 1)
    selected = torch.empty(B, H, 1 if shared else G, kmax, dtype=torch.int32) if with_selection else None
    status = lib.sa_paged_decode(
        q.data_ptr(), kv_cache.data_ptr(), DTYPE_CODES[kv_cache.dtype], N, H, bs, D, r, G, B, table.data_ptr(),
        table.shape[1], lens.data_ptr(), plan.plan.data_ptr(), mode, int(shared), float(scale), float(softcap or 0.0),
        None if store is None else store.summary.data_ptr(),
        None if store is None or store.summary2 is None else store.summary2.data_ptr(),
        None if store is None else store.state.data_ptr(),
        None if selected is None else selected.data_ptr(), kmax, out.data_ptr(), torch.get_num_threads(),
    )  # fmt: skip
    if status:
        raise ValueError(f"fused paged decode failed: {_ERRORS.get(status, f'status {status}')}")
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


def split_decode(
    policy: PagedPolicy, store: PageStore, kv_cache: torch.Tensor, query: torch.Tensor, block_table: torch.Tensor,
    seq_lens: torch.Tensor, scale: float, softcap: float | None, plan: StepPlan, out: torch.Tensor | None = None, r: int = 1,
) -> torch.Tensor:
    """The :data:`SPLIT` step (through :func:`fused_decode`, which checks the arguments): per-head page counts and a merged rest.

    1. ``sa_paged_score`` (C): every candidate's centroid score, the KV group's shortlist and its exact log
       masses (the logits kept), the sinks' and tail's log mass, for the sequences that select;
    2. the policy's own allocation (any :class:`~sparseattn.allocations.Allocation`) over those scores, given
       to it as a :class:`~sparseattn.vllm.paged.PageStep` exactly as the generic path gives them (the
       :class:`~sparseattn.summaries.base.Shortlist`'s scores): each selection's own list of pages, one batch
       per group of alike sequences;
    3. ``sa_paged_attend_lists`` (C): sinks, tail and each selection's list (a shortlisted page's logits
       reused), and the merged rest: its values from the value sums in ``store``, its logits from the centroid
       scores of step 1 where the centroids are float32 (from the keys' sums the store keeps where they are bfloat16).

    Returns ``[B, H_q, D]`` float32 (in ``out`` when given). ``r``: segments per page.
    """
    lib = _library()
    N, H, bs, _ = kv_cache.shape
    B, H_q, D = query.shape
    G = H_q // H
    m = policy.method
    shared = policy.shared_selection
    Gs = 1 if shared else G
    rest = m.rest
    if rest is not None and store.sums is None:
        raise ValueError("fused paged decode: a merged rest needs a PageStore made with sums=True")
    rows = plan.plan
    S_max = max(int(rows[:, 1].max()) if B else 0, 1)
    M_max = max(int(rows[:, 3].max()) if B else 0, 1)
    q = query.to(torch.float32).contiguous()
    table = block_table.to(torch.int32).contiguous()
    lens = seq_lens.to(torch.int32).contiguous()
    dtype = DTYPE_CODES[kv_cache.dtype]
    coarse = _SCRATCH.get("coarse", (B, H, G, S_max))
    short = _SCRATCH.get("short", (B, H, M_max), torch.int32)
    exact = _SCRATCH.get("exact", (B, H, G, M_max))
    always = _SCRATCH.get("always", (B, H, G))
    kept = _SCRATCH.get("kept", (B, H, M_max, G, bs))
    status = lib.sa_paged_score(
        q.data_ptr(), kv_cache.data_ptr(), dtype, N, H, bs, D, r, G, B, table.data_ptr(), table.shape[1], lens.data_ptr(),
        rows.data_ptr(), float(scale), store.summary.data_ptr(), int(store.summary.dtype == torch.bfloat16), math.sqrt(scale),
        store.state.data_ptr(), S_max, M_max, coarse.data_ptr(),
        short.data_ptr(), exact.data_ptr(), always.data_ptr(), kept.data_ptr(), torch.get_num_threads(),
    )  # fmt: skip
    if status:
        raise ValueError(f"fused paged decode failed: {_ERRORS.get(status, f'status {status}')}")
    # The allocation, per group of alike sequences (the same candidates, page count and shortlist), as choose_pages runs it.
    groups: dict[tuple[int, int, int, int], list[int]] = {}
    for i, (sink_pages, n_cand, k, mm) in enumerate(rows.tolist()):
        if 0 < k < n_cand:
            groups.setdefault((sink_pages, n_cand, k, mm), []).append(i)
    chosen = _SCRATCH.get("chosen", (B, H, Gs, S_max), torch.uint8).zero_()  # each selection's candidates (rows that do not select: none)
    grouped = q.view(B, H, G, D)
    stage = m.select_stage
    for (sink_pages, n_cand, k, mm), members in groups.items():
        if type(stage) is PooledMass and not shared and type(m.selector) is TopK and stage.width(k, n_cand) <= mm:
            # PooledMass's plan in C on the same scores (its picks are the shortlist's best, as PageStep reads them
            # off): the Python part below is its reference, and the tests hold the two steps' outputs equal.
            w = stage.width(k, n_cand)
            only = rows.clone()
            others = torch.ones(B, dtype=torch.bool)
            others[members] = False
            only[others, 2] = 0  # the other rows select nothing here
            status = lib.sa_paged_pooled_split(
                B, H, G, only.data_ptr(), coarse.data_ptr(), S_max, short.data_ptr(), exact.data_ptr(), M_max,
                always.data_ptr(), w, min(stage.floor_count(k), w), chosen.data_ptr(), torch.get_num_threads(),
            )  # fmt: skip
            if status:
                raise ValueError(f"fused paged decode failed: {_ERRORS.get(status, f'status {status}')}")
            continue
        idx = torch.tensor(members)
        shortlist = Shortlist(coarse[idx, :, :, :n_cand], short[idx, :, :mm].long().unsqueeze(2), exact[idx, :, :, :mm])

        def scorer(top_k: int, shortlist=shortlist, k=k) -> torch.Tensor:
            if top_k != k:
                raise ValueError(f"the split step scored for top_k={k}; the allocation asked for {top_k}")
            return shortlist.scores

        layout = policy.layout(int(lens[members[0]]), bs)
        step = PageStep(m, None, torch.Generator(), grouped[idx], layout, k, Gs, scorer, lambda idx=idx: always[idx], shortlist)
        selection = m.select_stage.select_segments(step)
        flags = torch.zeros(len(members), H, Gs, S_max, dtype=torch.uint8)
        flags.scatter_(-1, selection.segments, 1 if selection.valid is None else selection.valid.to(torch.uint8))
        chosen[idx] = flags
    if out is None:
        out = torch.empty(B, H_q, D, dtype=torch.float32)
    per_block = 0 if rest is None else min(rest.per_block, 2**62)
    status = lib.sa_paged_attend_lists(
        q.data_ptr(), kv_cache.data_ptr(), dtype, N, H, bs, D, r, G, B, table.data_ptr(), table.shape[1], lens.data_ptr(),
        rows.data_ptr(), int(shared), float(scale), float(softcap or 0.0), chosen.data_ptr(), S_max, short.data_ptr(),
        kept.data_ptr(), M_max, per_block, None if store.sums is None else store.sums.data_ptr(),
        None if store.sums_state is None else store.sums_state.data_ptr(), int(store.segment_sums),
        coarse.data_ptr() if store.summary.dtype == torch.float32 else None, out.data_ptr(), torch.get_num_threads(),
    )  # fmt: skip
    if status:
        raise ValueError(f"fused paged decode failed: {_ERRORS.get(status, f'status {status}')}")
    return out
