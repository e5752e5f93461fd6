"""The paged engine's fused CPU step: score, select and attend vLLM's pages in one C call per layer.

:func:`~sparseattn.vllm.paged.select_pages` runs any policy's own parts over the pages (torch, one
batch of the method's summary and selector per group of alike sequences) and a paged kernel then
attends the listed pages. For the policies whose parts it knows, :func:`fused_decode` does the same
step in ``paged_kernels.c`` (built like the cpu backend's kernel, :func:`~sparseattn.backends.cpu_kernels.build_library`):

* ``Rerank(Centroid(), per_group=True)`` + ``TopK`` (radar+): centroid scores of every candidate
  page, the KV group's shortlist, the shortlist's exact log masses, each head's top pages; the
  shortlist's logits are kept and attended, so a shortlisted key is read once;
* ``MinMaxBound`` + ``TopK`` (quest): the per-channel bound of every candidate page, each head's top pages;
* dense and streamingllm (the pages attended do not depend on the query).

Every other policy (radar's random features, a third party's summary or selector, a centroid
stored in bfloat16) keeps the generic path: :func:`fused_mode` says which. Page summaries (mean
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
from dataclasses import dataclass

import torch

from sparseattn.backends.cpu_kernels import DTYPE_CODES, build_library, build_refusal
from sparseattn.selectors.topk import TopK
from sparseattn.summaries.centroid import Centroid
from sparseattn.summaries.minmax import MinMaxBound
from sparseattn.summaries.rerank import Rerank
from sparseattn.vllm.paged import PagedPolicy

__all__ = ["BOUND", "FIXED", "RERANK", "PageStore", "StepPlan", "fused_decode", "fused_mode", "kernel_refusal", "step_plan"]

#: The kernel's modes (``paged_kernels.c``).
RERANK, BOUND, FIXED = 0, 1, 2
SYMBOLS = ("sa_paged_decode", "sa_paged_invalidate", "sa_paged_float16_supported")
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
        ptr, ptr, i32, i64, i64, i64, i64, i64, i64, ptr, i64, ptr, ptr, i32, i32, f32, f32, ptr, ptr, ptr, ptr, i64, ptr, i32,
    ]  # fmt: skip
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
    """
    if policy.fixed:
        return FIXED
    m = policy.method
    if type(m.selector) is not TopK:  # a subclass may rank otherwise
        return None
    summary = m.summary
    if (
        type(summary) is Rerank and type(summary.coarse) is Centroid and summary.coarse.dtype in (None, torch.float32)
        and summary.per_group and summary.shortlist > 0
    ):  # fmt: skip
        return RERANK
    if type(summary) is MinMaxBound:
        return BOUND
    return None


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
    """One layer's page summaries for the fused kernel, per physical block: ``[N, H_kv, D]`` float32 (two for quest).

    ``state[n]`` is 1 while block ``n``'s summary is valid; :meth:`invalidate` clears it for every block
    vLLM writes into (a block reused for another sequence, or still filling), so the kernel summarises
    it afresh the next time it is a candidate. A block that prefix caching shares is summarised once.
    """

    def __init__(self, num_blocks: int, kv_heads: int, head_dim: int, mode: int) -> None:
        shape = (num_blocks, kv_heads, head_dim)
        self.summary = torch.zeros(shape, dtype=torch.float32)
        self.summary2 = torch.zeros(shape, dtype=torch.float32) if mode == BOUND else None
        self.state = torch.zeros(num_blocks, dtype=torch.uint8)
        self.mode = mode

    @property
    def num_blocks(self) -> int:
        return self.state.shape[0]

    def invalidate(self, slot_mapping: torch.Tensor, block_size: int) -> None:
        """Mark stale the blocks ``slot_mapping`` (int64 slots, ``-1`` for padding) writes into."""
        slots = slot_mapping.to(torch.int64).contiguous()
        _library().sa_paged_invalidate(slots.data_ptr(), slots.numel(), block_size, self.state.data_ptr(), self.num_blocks)


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
    if (store is None) != (mode == FIXED):
        raise ValueError("fused paged decode: a PageStore is needed exactly when the mode scores pages")
    plan = plan or step_plan(policy, seq_lens, bs)
    if not (plan.plan.shape[0] == block_table.shape[0] == seq_lens.shape[0] == B):
        raise ValueError(f"fused paged decode: {B} queries, {block_table.shape[0]} block-table rows, {seq_lens.shape[0]} "
                         f"lengths and {plan.plan.shape[0]} plan rows; expected one of each per sequence")
    if store is not None and (store.summary.shape != (N, H, D) or store.mode != mode):
        raise ValueError(f"fused paged decode: the page store {tuple(store.summary.shape)} (mode {store.mode}) does not fit "
                         f"the cache's {(N, H, D)} in mode {mode}")
    G = H_q // H
    shared = policy.shared_selection
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
        q.data_ptr(), kv_cache.data_ptr(), DTYPE_CODES[kv_cache.dtype], N, H, bs, D, G, B, table.data_ptr(),
        table.shape[1], lens.data_ptr(), plan.plan.data_ptr(), mode, int(shared), float(scale), float(softcap or 0.0),
        None if store is None else store.summary.data_ptr(),
        None if store is None or store.summary2 is None else store.summary2.data_ptr(),
        None if store is None else store.state.data_ptr(),
        None if selected is None else selected.data_ptr(), kmax, out.data_ptr(), torch.get_num_threads(),
    )  # fmt: skip
    if status:
        raise ValueError(f"fused paged decode failed: {_ERRORS.get(status, f'status {status}')}")
    return out, selected
