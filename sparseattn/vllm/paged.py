"""The paged engine: a segment-search policy answering decode queries over vLLM's paged KV cache.

A *page* is one vLLM KV block of one KV head: ``block_size`` consecutive tokens of a sequence,
found through the sequence's block table. The paged engine cuts a sequence of ``L`` tokens (the
current one included) exactly as :class:`~sparseattn.ops.layout.SegmentLayout` describes, with the
segment size fixed to ``block_size`` and every boundary on a page boundary::

    pages [0, sink_pages)                  sinks: the pages holding the method's first ``sinks`` tokens
    pages [sink_pages, first_tail_page)    candidates: full pages, scored and selected
    pages [first_tail_page, ceil(L / bs))  tail: the pages holding the window and the current token

so the policy's own parts decide: ``method.summary`` summarises and scores the candidate pages,
``method.selector`` picks them, ``method.segments_for`` turns the token ``budget`` (or ``top_k``)
into a page count. The method's *schedule* is not used: the pages are the segments. With
``sinks`` a multiple of ``block_size`` and ``page_size == block_size`` (Quest) the layout, the
selection and the output are those of :class:`~sparseattn.methods.segment_state.SegmentSearchState`
on the same tokens (``tests/test_vllm_paged.py`` holds them equal).

No vLLM import here: the engine reads a cache tensor and integer tables. The vLLM CPU cache of one
layer is ``[num_blocks, H_kv, block_size, 2 * D]``; per (block, KV head) its ``2 * block_size * D``
elements are the page's keys stored *transposed*, ``[D, block_size]``, then its values
``[block_size, D]`` (checked against ``cpu_attn_reshape_and_cache`` for the ``vec``/``vec16`` ISAs:
see :func:`page_views`). An fp8 cache (vLLM's ``kv_cache_dtype="fp8"``, ``"fp8_e4m3"``, ``"fp8_e5m2"``)
has the same layout in one byte per element, each the value divided by its layer's scale
(:class:`KVFormat`): read as float8 views, dequantised by the scale where they are read.

The engine's parts, one job per module, all named here: :mod:`~sparseattn.vllm.cache_format` (the layouts and
fp8 formats), :mod:`~sparseattn.vllm.policy` (the method over pages), :mod:`~sparseattn.vllm.selection` (the
generic path's selection), :mod:`~sparseattn.vllm.attention` (attention over the listed pages and the float64
references), :mod:`~sparseattn.vllm.route` (which path a policy takes) and :mod:`~sparseattn.vllm.paged_kernel`
(the fused C step).
"""

from __future__ import annotations

from sparseattn.vllm.attention import attend_pages, merged_pages_ref, paged_decode, paged_decode_ref
from sparseattn.vllm.cache_format import FP8_FORMATS, KVFormat, amx_layout, page_views, vec_layout
from sparseattn.vllm.policy import PagedPolicy, layer_methods, own_segment, page_layout
from sparseattn.vllm.selection import (
    MergedPages, PageKeys, PageSelection, PageStep, PageSummaries, choose_pages, page_sums, select_pages,
)  # fmt: skip

__all__ = [
    "FP8_FORMATS", "KVFormat", "MergedPages", "PageKeys", "amx_layout", "layer_methods", "vec_layout", "PageSelection", "PageStep", "PageSummaries", "PagedPolicy",
    "attend_pages", "choose_pages", "merged_pages_ref", "own_segment", "page_layout", "page_sums", "page_views", "paged_decode",
    "paged_decode_ref", "select_pages",
]
