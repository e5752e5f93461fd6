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
selection and the output are those of :class:`~sparseattn.methods.segment_search.SegmentSearchState`
on the same tokens (``tests/test_vllm_paged.py`` holds them equal).

No vLLM import here: the engine reads a cache tensor and integer tables. The vLLM CPU cache of one
layer is ``[num_blocks, H_kv, block_size, 2 * D]``; per (block, KV head) its ``2 * block_size * D``
elements are the page's keys stored *transposed*, ``[D, block_size]``, then its values
``[block_size, D]`` (checked against ``cpu_attn_reshape_and_cache`` for the ``vec``/``vec16`` ISAs:
see :func:`page_views`). An fp8 cache (vLLM's ``kv_cache_dtype="fp8"``, ``"fp8_e4m3"``, ``"fp8_e5m2"``)
has the same layout in one byte per element, each the value divided by its layer's scale
(:class:`KVFormat`): read as float8 views, dequantised by the scale where they are read.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from sparseattn.allocations.base import Selection
from sparseattn.methods.dense import Dense
from sparseattn.methods.layers import FirstLayers, SplitLayers, layer_method
from sparseattn.methods.rest import MergedRest
from sparseattn.methods.segment_search import SegmentSearch
from sparseattn.methods.streaming import StreamingLLM
from sparseattn.ops.layout import SegmentLayout
from sparseattn.selectors.base import selector_seed
from sparseattn.selectors.topk import TopK
from sparseattn.summaries.base import SegmentKeys, Shortlist, TopKAwareSummary

__all__ = [
    "FP8_FORMATS", "KVFormat", "MergedPages", "PageKeys", "amx_layout", "layer_methods", "vec_layout", "PageSelection", "PageStep", "PageSummaries", "PagedPolicy",
    "attend_pages", "choose_pages", "merged_pages_ref", "own_segment", "page_layout", "page_sums", "page_views", "paged_decode",
    "paged_decode_ref", "select_pages",
]

#: vLLM's fp8 KV cache dtypes (``kv_cache_dtype``) and the float8 format its uint8 cache holds (checked against
#: vLLM's CPU cache-update op: tests/test_vllm_plugin.py).
FP8_FORMATS = {"fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}


@dataclass(frozen=True)
class KVFormat:
    """How a layer's paged cache stores its keys and values.

    ``dtype``: vLLM's ``kv_cache_dtype``: ``"auto"`` (the cache holds the model's dtype) or one of
    :data:`FP8_FORMATS` (a uint8 cache of float8 numbers); ``k_scale``, ``v_scale``: the layer's scales
    (a stored number times its scale is the key or value; vLLM's ``layer._k_scale_float``).

    Example:
        >>> KVFormat("fp8_e5m2", 0.5).fp8
        torch.float8_e5m2
    """

    dtype: str = "auto"
    k_scale: float = 1.0
    v_scale: float = 1.0

    def __post_init__(self) -> None:
        if self.dtype != "auto" and self.dtype not in FP8_FORMATS:
            raise ValueError(f"KVFormat.dtype must be 'auto' or one of {sorted(FP8_FORMATS)}, got {self.dtype!r}")
        for name in ("k_scale", "v_scale"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
                raise ValueError(f"KVFormat.{name} must be a finite number > 0, got {value!r}")

    @property
    def fp8(self) -> torch.dtype | None:
        """The float8 format of an fp8 cache, None for ``"auto"``."""
        return FP8_FORMATS.get(self.dtype)


def page_views(kv_cache: torch.Tensor, fmt: KVFormat = KVFormat()) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys ``[N, H_kv, D, bs]`` (transposed) and values ``[N, H_kv, bs, D]`` of a CPU cache ``[N, H_kv, bs, 2 D]`` (views, no copy).

    An fp8 cache (uint8, ``fmt.dtype`` one of :data:`FP8_FORMATS`) is viewed as its float8 format: the
    numbers as stored, which the reader multiplies by ``fmt.k_scale`` / ``fmt.v_scale``.
    """
    if (kv_cache.dtype == torch.uint8) != (fmt.fp8 is not None):
        raise ValueError(f"a {kv_cache.dtype} KV cache read as {fmt.dtype!r}: an fp8 kv_cache_dtype needs vLLM's uint8 cache, and only it")
    if fmt.fp8 is not None:
        kv_cache = kv_cache.view(fmt.fp8)
    n, h, bs, two_d = kv_cache.shape
    d = two_d // 2
    pages = kv_cache.view(n, h, 2, bs * d)
    return pages[:, :, 0].view(n, h, d, bs), pages[:, :, 1].view(n, h, bs, d)


def amx_layout(kv_cache: torch.Tensor) -> torch.Tensor:
    """A cache in the ``vec`` layout (:func:`page_views`) rewritten in the layout of vLLM's ``amx`` kernel (bfloat16, pages
    and head dims of multiples of 32): per (block, KV head), keys ``[bs/16, D/2, 16, 2]`` (groups of 16 tokens, each
    token's keys of a pair of channels side by side) then values ``[D/16, bs/2, 16, 2]`` (blocks of 16 channels, each
    channel's values of a pair of tokens side by side). A copy; checked against vLLM's own cache-update op for
    ``amx`` (tests/test_vllm_plugin.py). The paged kernel reads it in place (``fused_decode(..., layout="amx")``);
    :func:`vec_layout` is the way back.

    >>> cache = torch.randn(3, 2, 32, 2 * 64).to(torch.bfloat16)
    >>> torch.equal(vec_layout(amx_layout(cache)), cache)
    True
    """
    n, h, bs, two_d = kv_cache.shape
    d = two_d // 2
    if bs % 32 or d % 32:
        raise ValueError(f"amx_layout: pages of {bs} tokens, head dim {d}; allowed: multiples of 32 (vLLM's amx kernel)")
    keys_t, values = page_views(kv_cache)
    out = torch.empty_like(kv_cache).view(n, h, 2, bs * d)
    out[:, :, 0] = keys_t.reshape(n, h, d // 2, 2, bs // 16, 16).permute(0, 1, 4, 2, 5, 3).reshape(n, h, bs * d)
    out[:, :, 1] = values.reshape(n, h, bs // 2, 2, d // 16, 16).permute(0, 1, 4, 2, 5, 3).reshape(n, h, bs * d)
    return out.view(kv_cache.shape)


def vec_layout(kv_cache: torch.Tensor) -> torch.Tensor:
    """The inverse of :func:`amx_layout`: an ``amx``-layout cache in the ``vec`` layout (a copy)."""
    n, h, bs, two_d = kv_cache.shape
    d = two_d // 2
    pages = kv_cache.view(n, h, 2, bs * d)
    out = torch.empty_like(kv_cache).view(n, h, 2, bs * d)
    out[:, :, 0] = pages[:, :, 0].reshape(n, h, bs // 16, d // 2, 16, 2).permute(0, 1, 3, 5, 2, 4).reshape(n, h, bs * d)
    out[:, :, 1] = pages[:, :, 1].reshape(n, h, d // 16, bs // 2, 16, 2).permute(0, 1, 3, 5, 2, 4).reshape(n, h, bs * d)
    return out.view(kv_cache.shape)


def layer_methods(method: Any) -> list[Any]:
    """Every method a per-layer choice may run in some layer (its leaves)."""
    if isinstance(method, SplitLayers):
        return layer_methods(method.first) + layer_methods(method.others)
    if isinstance(method, FirstLayers):
        return layer_methods(method.method)
    return [method]


def page_layout(length: int, block_size: int, sinks: int, window: int, segment: int | None = None) -> SegmentLayout:
    """The page-aligned :class:`SegmentLayout` of a sequence of ``length`` tokens (the current one included).

    Sinks are rounded up to whole pages; the tail starts at the page holding the first of the last
    ``max(window, 1)`` tokens (the current token is never in a candidate page). ``segment``: tokens per
    segment, a divisor of ``block_size`` (None: the page); each candidate page then holds
    ``block_size // segment`` segments.

    >>> lay = page_layout(300, 128, sinks=4, window=0)
    >>> lay.sink_end, lay.n_segments, lay.tail_start
    (128, 1, 256)
    """
    if length < 1:
        raise ValueError(f"page_layout: length must be >= 1, got {length}")
    segment = block_size if segment is None else segment
    if segment < 1 or block_size % segment:
        raise ValueError(f"page_layout: segment {segment} does not divide the block size {block_size}; allowed: a divisor of it")
    sink_pages = min(-(-sinks // block_size), -(-length // block_size)) if sinks else 0
    first_tail_page = max(sink_pages, (length - max(window, 1)) // block_size)
    return SegmentLayout(
        length=length, sinks=sink_pages * block_size, segment_size=segment,
        n_segments=(first_tail_page - sink_pages) * (block_size // segment),
    )


def own_segment(method: Any, length: int, block_size: int) -> int | None:
    """The segment the paged engine runs ``method`` on when none is given: the method's own grid.

    The transformers engine cuts a sequence by the method's schedule (radar+adaptive: ``sqrt(t) /
    16`` tokens, radar+: ``sqrt(t) / 8``, quest: 16); the paged engine keeps one segment size for a
    cache's life, so it takes the schedule's segment at ``length`` (the longest sequence served: the
    coarsest grid the method reaches there, the cheapest) and rounds it down to a divisor of the
    page. None (a page is a segment) when that is the whole page, and for dense and streamingllm,
    which read whole pages. A per-layer method takes its layers' finest grid.

    >>> from sparseattn import registry
    >>> [own_segment(registry.build(n, budget=512), 8192, 32) for n in ("radar+adaptive", "radar+", "quest", "radar")]
    [4, 8, 16, 16]
    >>> own_segment(registry.build("dense"), 8192, 32) is None
    True
    >>> own_segment(registry.build("radar+adaptive", budget=512), 8192, 128), own_segment(registry.build("radar+"), 1024, 32)
    (4, 4)
    """
    if length < 1 or block_size < 1:
        raise ValueError(f"own_segment: length and block_size must be >= 1, got {length} and {block_size}")
    sizes = [
        m.schedule.plan(length, None).segment_size for m in layer_methods(method) if isinstance(m, SegmentSearch)
    ]  # fmt: skip
    if not sizes:
        return None
    own = min(min(sizes), block_size)
    segment = max(d for d in range(1, own + 1) if block_size % d == 0)
    return None if segment == block_size else segment


@dataclass(frozen=True)
class PagedPolicy:
    """A registry method as the paged engine runs it: dense, or a :class:`SegmentSearch` over pages.

    :class:`StreamingLLM` runs as a selection (its sinks' pages and the most recent pages within its
    budget, whole pages; nothing is evicted). A segment search runs with its own parts: any summary
    and selector, any allocation (:class:`~sparseattn.allocations.PooledMass`,
    :class:`~sparseattn.allocations.TopP`: each head attends its own number of pages, the layer's
    total within the budget) and a :class:`~sparseattn.methods.rest.MergedRest` (the pages a head does
    not attend, merged per block of pages from per-page key and value sums). Per-layer methods
    (:class:`FirstLayers`, :class:`SplitLayers`) run each layer's own method: :meth:`for_layer`.
    Refused (ValueError naming the method and why): the other eviction methods (they drop tokens from
    the cache, which vLLM owns, by scores a per-token record would have to keep), an ``always`` part
    (heavy hitters need a per-token record), token refinement (the engine attends whole pages) and a
    rest other than :class:`MergedRest`. A summary that reads keys (``reads_keys``: radar+'s exact
    rerank) is handed a :class:`PageKeys`: only the pages it takes are read.

    ``segment``: tokens per segment, a divisor of vLLM's block size (None: each page is one segment).
    Smaller segments select finer (a page holds several), as the transformers engine's grid does;
    the fused C step runs them too (its split step: :func:`~sparseattn.vllm.paged_kernel.fused_mode`).
    """

    method: Any
    name: str = ""
    segment: int | None = None

    def __post_init__(self) -> None:
        m, label = self.method, self.name or type(self.method).__name__
        if self.segment is not None and (isinstance(self.segment, bool) or not isinstance(self.segment, int) or self.segment < 1):
            raise ValueError(f"sparseattn method {label!r}: segment must be a positive number of tokens (a divisor of vLLM's "
                             f"block size) or None (the page), got {self.segment!r}")
        if isinstance(m, (FirstLayers, SplitLayers)):
            for leaf in layer_methods(m):  # every layer's own method must run here
                PagedPolicy(leaf, label, self.segment)
            return
        if isinstance(m, (Dense, StreamingLLM)):
            return
        if not isinstance(m, SegmentSearch):
            raise ValueError(
                f"sparseattn method {label!r} ({type(m).__name__}) cannot run in vLLM: the paged engine runs dense, "
                "streamingllm (as a selection) and segment-search methods (quest, radar, radar-*...); eviction methods "
                "drop tokens from a cache that vLLM owns and stay transformers-only"
            )
        if m.always is not None:
            raise ValueError(f"sparseattn method {label!r}: an always-kept part ({m.always!r}) is not supported in vLLM yet")
        if m.refine is not None:
            raise ValueError(
                f"sparseattn method {label!r}: token refinement ({m.refine!r}) is not supported in vLLM yet (the paged "
                "engine attends whole pages); it runs in the transformers engine"
            )
        if m.rest is not None and type(m.rest) is not MergedRest:
            raise ValueError(
                f"sparseattn method {label!r}: the rest part {m.rest!r} is not supported in vLLM (the paged engine merges "
                "the rest from per-page sums: MergedRest only); it runs in the transformers engine"
            )

    @property
    def layered(self) -> bool:
        """True for a per-layer method: each layer runs its own, :meth:`for_layer`."""
        return isinstance(self.method, (FirstLayers, SplitLayers))

    def for_layer(self, layer_idx: int, n_layers: int | None) -> PagedPolicy:
        """The policy layer ``layer_idx`` of a model of ``n_layers`` layers runs (this one unless :attr:`layered`).

        >>> from sparseattn import registry
        >>> policy = PagedPolicy(registry.build("radar+adaptive", budget=512), "radar+adaptive")
        >>> policy.for_layer(0, 30).method.rest is None, policy.for_layer(7, 30).method.rest
        (True, MergedRest(segments=128))
        """
        if not self.layered:
            return self
        return PagedPolicy(layer_method(self.method, layer_idx, n_layers), self.name, self.segment)

    def _leaf(self) -> None:
        if self.layered:
            raise ValueError(f"sparseattn method {self.name!r} runs a method per layer: use PagedPolicy.for_layer(layer, n_layers)")

    @property
    def dense(self) -> bool:
        return isinstance(self.method, Dense)

    def segments_per_page(self, block_size: int) -> int:
        """Segments a page of ``block_size`` tokens holds (1: the page is the segment; dense and streamingllm read
        whole pages); ValueError when ``segment`` does not divide it."""
        if self.segment is None or self.fixed:
            return 1
        if block_size % self.segment:
            raise ValueError(f"sparseattn method {self.name!r}: segment {self.segment} does not divide the block size "
                             f"{block_size}; allowed: a divisor of it")
        return block_size // self.segment

    @property
    def merged(self) -> MergedRest | None:
        """The merged rest the policy joins to its softmax (None: the rest is dropped)."""
        return None if self.fixed or self.layered else self.method.rest

    @property
    def fixed(self) -> bool:
        """True when the pages attended do not depend on the query (dense, streamingllm): nothing is scored."""
        return isinstance(self.method, (Dense, StreamingLLM))

    @property
    def shared_selection(self) -> bool:
        """One page list per KV group (else one per query head)."""
        return self.fixed or self.method.shared_kv_selection

    def layout(self, length: int, block_size: int) -> SegmentLayout:
        self._leaf()
        m = self.method
        if self.dense:
            return page_layout(length, block_size, 0, 0)
        if isinstance(m, StreamingLLM):
            # StreamingLLM as a selection: its sinks' pages and the last pages, none in between. Pages are
            # whole: the sink pages count whole, and the recent pages are those that fit in what is left
            # of the budget (their first page may start up to a page before ``window`` tokens from the end).
            sink_tokens = min(-(-m.sinks // block_size) * block_size, length) if m.sinks else 0
            window = max(1, m.budget - sink_tokens - (block_size - 1))
            return page_layout(length, block_size, m.sinks, window)
        return page_layout(length, block_size, m.sinks, m.window, self.segment)

    def pages_for(self, layout: SegmentLayout) -> int:
        """Candidate pages one step attends: all for dense, none for streamingllm, else the method's own count."""
        if self.fixed:
            return layout.n_segments if self.dense else 0
        return self.method.segments_for(layout)

    def prepare(
        self, kv_heads: int, head_dim: int, layer_idx: int, *, heads: Sequence[int] | None = None
    ) -> tuple[Any, torch.Generator]:
        """The summary's per-layer parameters and the selector's generator (seeded as the decode state seeds it).

        ``heads``: the model's KV heads this process holds, under tensor parallelism (``kv_heads`` is
        then the model's total): the parameters are drawn for every head, as one process would, and
        the rows of these heads kept, so that a head's summary does not depend on the TP size.

        >>> from sparseattn import registry
        >>> policy = PagedPolicy(registry.build("radar"), "radar")
        >>> whole, _ = policy.prepare(3, 64, 5)
        >>> rank, _ = policy.prepare(3, 64, 5, heads=[2])
        >>> torch.equal(rank, whole[2:3])
        True
        """
        self._leaf()
        generator = torch.Generator()
        if self.fixed:
            return None, generator
        s = self.method
        params = s.summary.prepare(kv_heads, head_dim, layer_idx=layer_idx, device=torch.device("cpu"), dtype=torch.float32)
        if heads is not None and params is not None:
            if not (isinstance(params, torch.Tensor) and params.dim() >= 1 and params.shape[0] == kv_heads):
                raise ValueError(
                    f"sparseattn method {self.name!r}: its summary's parameters ({type(params).__name__}) are not one row "
                    f"per KV head, so they cannot be split across tensor-parallel ranks"
                )
            params = params[torch.as_tensor(list(heads), dtype=torch.long)]
        generator.manual_seed((selector_seed(s.selector) * 0x9E3779B1 + layer_idx) % (2**63))
        return params, generator


class PageSummaries:
    """The summaries of one layer's pages, kept per physical block id beside vLLM's cache, and (for a
    merged rest) each page's key and value sums.

    A page's summary is computed the first time a step needs it (the page is then full and in the
    past) and kept until vLLM writes into that block again: :meth:`invalidate` is called with every
    slot mapping vLLM writes through, so a freed block reused for another sequence is summarised
    afresh, and a block prefix caching shares between sequences is summarised once for all of them.
    Tensors ``[N, H_kv, ...]`` (one per summary output), float32, allocated on first use; the sums
    ``[N, H_kv, 2 D]`` float32 (keys then values, as stored times the format's scales), kept the same way.
    """

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.block_size = block_size
        self.valid = torch.zeros(num_blocks, dtype=torch.bool)
        self.store: list[torch.Tensor] | None = None
        self.sums_valid = torch.zeros(num_blocks, dtype=torch.bool)
        self.sums_store: torch.Tensor | None = None
        self.computed = 0  #: pages summarised so far (for tests and accounting)

    def invalidate(self, slot_mapping: torch.Tensor) -> None:
        """Forget the summaries and sums of the blocks ``slot_mapping`` (slots, ``-1`` for padding) writes into."""
        slots = slot_mapping[slot_mapping >= 0]
        if slots.numel():
            blocks = torch.div(slots, self.block_size, rounding_mode="floor").long()
            self.valid[blocks] = False
            self.sums_valid[blocks] = False

    def _per_page(self, r: int) -> None:
        if getattr(self, "r", r) != r:
            raise ValueError(f"PageSummaries keeps {self.r} segment(s) per page; asked for {r}: one store per segment size")
        self.r = r

    def get(
        self, summary: Any, params: Any, keys_t: torch.Tensor, blocks: torch.Tensor, root: float, r: int = 1
    ) -> tuple[torch.Tensor, ...]:
        """Summaries ``[B, H_kv, P r, ...]`` of the ``r`` segments of each physical block of ``blocks: [B, P]``,
        computing the missing ones (a block's segments together)."""
        self._per_page(r)
        known = self.valid[blocks]
        missing = blocks[~known].unique() if not bool(known.all()) else blocks[:0]  # all known: no nonzero pass
        if missing.numel():
            fresh = summary.summarize(params, _page_keys(keys_t, missing[None], root, r))  # each [1, H, n r, ...]
            if self.store is None:
                n = self.valid.shape[0]
                self.store = [torch.zeros(n, t.shape[1], r, *t.shape[3:], dtype=t.dtype) for t in fresh]
            for buf, t in zip(self.store, fresh):
                buf[missing] = t[0].unflatten(1, (-1, r)).transpose(0, 1)
            self.valid[missing] = True
            self.computed += int(missing.numel())
        return tuple(buf[blocks].transpose(1, 2).flatten(2, 3) for buf in self.store)

    def sums(self, kv_cache: torch.Tensor, blocks: torch.Tensor, fmt: KVFormat, r: int = 1) -> torch.Tensor:
        """Key and value sums ``[B, H_kv, P r, 2 D]`` float32 of the ``r`` segments of each physical block of
        ``blocks: [B, P]``, computing the missing ones."""
        self._per_page(r)
        known = self.sums_valid[blocks]
        missing = blocks[~known].unique() if not bool(known.all()) else blocks[:0]
        if missing.numel():
            if self.sums_store is None:
                self.sums_store = torch.zeros(self.sums_valid.shape[0], kv_cache.shape[1], r, kv_cache.shape[3], dtype=torch.float32)
            self.sums_store[missing] = page_sums(kv_cache, missing[None], fmt, r)[0].unflatten(1, (-1, r)).transpose(0, 1)
            self.sums_valid[missing] = True
        return self.sums_store[blocks].transpose(1, 2).flatten(2, 3)


def page_sums(kv_cache: torch.Tensor, blocks: torch.Tensor, fmt: KVFormat = KVFormat(), r: int = 1) -> torch.Tensor:
    """Each segment's key sum then value sum ``[B, H_kv, P r, 2 D]`` (float32) of the ``r`` segments of each physical
    block of ``blocks: [B, P]``: what a merged rest subtracts for a segment it attends and adds for one it does not
    (the keys and values dequantised)."""
    keys_t, values = page_views(kv_cache, fmt)
    B, P = blocks.shape
    N, H, D, bs = keys_t.shape
    k = keys_t[blocks].float().view(B, P, H, D, r, bs // r).sum(-1).transpose(-1, -2) * fmt.k_scale  # [B, P, H, r, D]
    v = values[blocks].float().view(B, P, H, r, bs // r, D).sum(-2) * fmt.v_scale
    return torch.cat([k, v], dim=-1).transpose(1, 2).flatten(2, 3)


def _page_keys(keys_t: torch.Tensor, blocks: torch.Tensor, root: float, r: int = 1) -> torch.Tensor:
    """Scaled float32 keys ``[B, H, P r, bs / r, D]`` of the ``r`` segments of each physical block of ``blocks: [B, P]`` (a copy)."""
    keys = keys_t[blocks].permute(0, 2, 1, 4, 3).float() * root  # [B, P, H, D, bs] -> [B, H, P, bs, D]
    return keys if r == 1 else keys.reshape(*keys.shape[:2], -1, keys.shape[3] // r, keys.shape[4])


class PageKeys(SegmentKeys):
    """Candidate pages' keys as a summary that ``reads_keys`` receives them, read from the paged cache on demand.

    radar+'s exact rerank asks for the keys of its shortlist only (:meth:`take`): those pages are
    copied out of vLLM's cache, the other candidates are never read. :meth:`all` (an oracle such as
    ``radar-exact``) copies every candidate page. ``blocks: [B, S]`` are the candidates' physical
    block ids; keys come scaled by ``factor`` in float32, as the decode state hands them.
    """

    def __init__(self, keys_t: torch.Tensor, blocks: torch.Tensor, factor: float, r: int = 1) -> None:
        from sparseattn.backends.registry import get_backend

        # Not SegmentKeys.__init__: there is no [B, H, S, c, D] view of a paged cache to hold as ``raw``.
        self.keys_t, self.blocks, self.factor, self.dtype, self.r = keys_t, blocks, factor, torch.float32, r
        self.workspace = None
        self.backend = get_backend("torch")  # the cpu kernel reads ``raw`` in place, which pages do not have

    @property
    def shape(self) -> torch.Size:
        N, H, D, bs = self.keys_t.shape
        return torch.Size((self.blocks.shape[0], H, self.blocks.shape[1] * self.r, bs // self.r, D))

    @property
    def raw(self) -> torch.Tensor:
        """Every candidate segment's unscaled keys ``[B, H, S, c, D]`` (a copy: for references and tests)."""
        return self.keys_t[self.blocks].permute(0, 2, 1, 4, 3).reshape(self.shape)

    def all(self) -> torch.Tensor:
        return _page_keys(self.keys_t, self.blocks, self.factor, self.r)

    def take(self, index: torch.Tensor) -> torch.Tensor:
        """Candidate segments ``index: [B, H, m]`` -> scaled keys ``[B, H, m, c, D]``: only their pages are read."""
        B, H, m = index.shape
        N, _, D, bs = self.keys_t.shape
        r = self.r
        page = index.div(r, rounding_mode="floor") if r > 1 else index
        phys = self.blocks.gather(1, page.reshape(B, H * m)).view(B, H, m)
        rows = (phys * H + torch.arange(H).view(1, H, 1)).flatten()  # whole contiguous pages of one head
        taken = self.keys_t.flatten(0, 1).index_select(0, rows).view(B, H, m, D, bs).transpose(-1, -2)
        if taken.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
            taken = taken.float()  # torch gathers no float8 numbers
        if r > 1:  # the segment's share of its page: tokens [sub c, (sub + 1) c)
            c = bs // r
            sub = (index % r).view(B, H, m, 1, 1, 1).expand(B, H, m, 1, c, D)
            taken = taken.reshape(B, H, m, r, c, D).gather(3, sub).squeeze(3)
        return taken.float().mul_(self.factor)


class PageStep:
    """One decode step of a group of alike sequences over their pages, as a select stage sees it.

    The paged engine's side of the interface a select stage reads
    (:class:`~sparseattn.allocations.SelectStage`: what :class:`~sparseattn.methods.segment_search.SegmentStep`
    gives it in the decode state): ``query [b, H_kv, G, D]`` (float32), ``layout`` (the candidates: the
    group's sequences share their sink pages and candidate count), ``k``, ``shared`` (``G'``), ``group``
    (``G``), and scores and picks on demand. So an allocation (uniform, pooled, top-p, a user's) splits
    pages exactly as it splits segments in the transformers engine, on the same scores.
    """

    def __init__(
        self, method: SegmentSearch, params: Any, generator: torch.Generator, query: torch.Tensor, layout: SegmentLayout,
        k: int, shared: int, scorer: Any, always: Any, shortlist: Shortlist | None = None,
    ) -> None:
        self.method, self._params, self._generator = method, params, generator
        self.query, self.layout, self.k, self.shared, self.group = query, layout, k, shared, query.shape[2]
        self._scorer, self._always = scorer, always
        #: The scores' :class:`~sparseattn.summaries.base.Shortlist` when the scorer has one (the split step's):
        #: a :class:`TopK` selection of at most its length reads its best off it, as the decode state does.
        self._shortlist = shortlist
        self._scores: dict[int, torch.Tensor] = {}

    def scores(self, top_k: int | None = None) -> torch.Tensor:
        """Each selection's page log-mass estimates ``[b, H_kv, G', S]`` (a shared selection: its group's summed masses)."""
        top_k = self.k if top_k is None else top_k
        if top_k not in self._scores:
            scores = self._scorer(top_k)  # [b, H, G, S]
            self._scores[top_k] = torch.logsumexp(scores, dim=2, keepdim=True) if self.shared == 1 else scores
        return self._scores[top_k]

    def selector_scores(self, top_k: int | None = None) -> torch.Tensor:
        """:meth:`scores`, or zeros (nothing scored) for a selector with ``uses_scores = False``."""
        if self.method.selector.uses_scores:
            return self.scores(top_k)
        b, H = self.query.shape[:2]
        return torch.zeros(b, H, self.shared, self.layout.n_segments)

    def choose(self, n: int, scores: torch.Tensor) -> torch.Tensor:
        """The selector's ``n`` picks ``[b, H_kv, G', n]`` among ``scores`` (the layer's seeded generator)."""
        picked = self.method.selector.select(scores, n, self._generator)
        if tuple(picked.shape) != (*scores.shape[:3], n) or (n and not (0 <= int(picked.min()) and int(picked.max()) < scores.shape[-1])):
            raise ValueError(f"{self.method.selector!r} picked {tuple(picked.shape)} indices out of {scores.shape[-1]} pages")
        return picked

    def _read_off_shortlist(self, n: int) -> bool:
        sl = self._shortlist
        return sl is not None and self.shared != 1 and type(self.method.selector) is TopK and n <= sl.exact.shape[-1]

    def picks(self, n: int) -> torch.Tensor:
        if self._read_off_shortlist(n):
            return self._shortlist.top(n, sorted=False)[1]
        return self.choose(n, self.selector_scores(self.k))

    def scored_picks(self, n: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(scores [b, H_kv, G', S], estimates [b, H_kv, G', n], pages [b, H_kv, G', n])``; ``n`` best under
        :class:`TopK`, read off the shortlist when there is one that holds them (the same pages: it ranks above the rest)."""
        if self._read_off_shortlist(n):
            return (self.scores(self.k), *self._shortlist.top(n, sorted=False))
        scores = self.scores(self.k)
        picked = self.choose(n, scores)
        return scores, scores.gather(-1, picked), picked

    def always_log_mass(self) -> torch.Tensor:
        """``[b, H_kv, G']`` the log attention mass of each sequence's sink and tail tokens (on the scores' scale)."""
        mass = self._always()  # [b, H, G]
        return torch.logsumexp(mass, dim=2, keepdim=True) if self.shared == 1 else mass


@dataclass(frozen=True)
class MergedPages:
    """A merged rest's tokens per page list: ``keys, values [B, H_kv, G', n, D]`` (float32 mean key and value of the
    unattended candidate tokens of each block of ``per_block`` candidate pages) and ``log_counts [B, H_kv, G', n]``
    (log of their count, the merged token's weight; -inf: nothing left, or no such block)."""

    keys: torch.Tensor
    values: torch.Tensor
    log_counts: torch.Tensor


@dataclass(frozen=True)
class PageSelection:
    """What each decode query attends: ``pages [B, H_kv, G', P]`` logical pages (sinks, chosen candidates, tail;
    ``-1`` past a list's end, so a list's partial last page is its last entry), the merged rest (None: dropped),
    and with segments smaller than a page ``tokens [B, H_kv, G', P, bs]``, which of each listed page's tokens are
    attended (None: every token of every listed page)."""

    pages: torch.Tensor
    merged: MergedPages | None = None
    tokens: torch.Tensor | None = None


def _always_mass(keys_t: torch.Tensor, table: torch.Tensor, layouts: list[SegmentLayout], q: torch.Tensor, factor: float) -> torch.Tensor:
    """Log mass ``[b, H, G]`` of each sequence's sink and tail tokens: ``logsumexp(factor q . k)`` over them (float32)."""
    bs = keys_t.shape[-1]
    out = []
    for i, lay in enumerate(layouts):
        n_pages = -(-lay.length // bs)
        pages = list(range(lay.sink_end // bs)) + list(range(lay.tail_start // bs, n_pages))
        k = keys_t[table[i, pages].long()].float()  # [P, H, D, bs]
        logits = torch.einsum("hgd,phdj->hgpj", q[i], k) * factor
        positions = torch.tensor(pages).view(-1, 1) * bs + torch.arange(bs)
        logits = logits.masked_fill(positions >= lay.length, float("-inf"))
        out.append(torch.logsumexp(logits.flatten(2), dim=-1))
    return torch.stack(out)


def _merged_rest(rest: MergedRest, sums: torch.Tensor, chosen: torch.Tensor, segment: int) -> MergedPages:
    """The merged tokens of what each list leaves out: ``sums [b, H, S, 2 D]`` the candidate segments' sums,
    ``chosen [b, H, G', S]`` the segments each list attends, ``segment`` tokens each. Blocks of ``rest.per_block``
    candidate segments, as :class:`~sparseattn.methods.rest.MergedRest` groups them; sums accumulated in float64."""
    b, H, Gs, S = chosen.shape
    D = sums.shape[-1] // 2
    n = rest.blocks(S)
    per_block = min(rest.per_block, max(S, 1))
    onehot = (torch.arange(S).div(per_block, rounding_mode="floor").view(S, 1) == torch.arange(n)).double()  # [S, n]
    left = (~chosen).double().unsqueeze(-1) * onehot  # [b, H, G', S, n]: unattended pages by block
    rest_sums = left.transpose(-1, -2) @ sums.double().unsqueeze(2)  # [b, H, G', n, 2 D]
    count = left.sum(3) * segment  # [b, H, G', n] whole numbers
    mean = (rest_sums / count.clamp_min(1.0).unsqueeze(-1)).float()
    log_counts = torch.where(count > 0.5, count.clamp_min(1.0).log(), float("-inf")).float()
    return MergedPages(mean[..., :D], mean[..., D:], log_counts)


def _page_lists(sink_pages: int, n_cand: int, n_pages: int, picked: torch.Tensor, valid: torch.Tensor | None) -> torch.Tensor:
    """``[H, G', P]`` page lists: sinks, the ``picked [H, G', w]`` candidates in the selection's order (those ``valid``
    flags, None: all), tail; -1 after each list's end (the tail's partial last page is each list's last entry)."""
    H, Gs = picked.shape[:2]
    chosen = picked + sink_pages if valid is None else torch.where(valid, picked + sink_pages, -1)
    return _compact(torch.cat([torch.arange(sink_pages).expand(H, Gs, -1), chosen,
                               torch.arange(sink_pages + n_cand, n_pages).expand(H, Gs, -1)], dim=-1))  # fmt: skip


def _compact(lists: torch.Tensor) -> torch.Tensor:
    """Each list's -1 entries moved to its end, the others in their order."""
    if bool((lists >= 0).all()):
        return lists
    slot = torch.arange(lists.shape[-1]).expand_as(lists)
    return lists.gather(-1, torch.where(lists >= 0, slot, lists.shape[-1] + slot).argsort(dim=-1))


def _segment_lists(sink_pages: int, n_pages: int, flags: torch.Tensor, r: int, bs: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Segments smaller than a page: ``flags [H, G', S]`` the candidate segments each list attends (``r`` per
    page) -> ``(pages [H, G', P], tokens [H, G', P, bs])``: the sinks, every candidate page holding a chosen
    segment (in order), the tail, and which tokens of each listed page are attended."""
    H, Gs, S = flags.shape
    n_cand = S // r
    per_page = flags.view(H, Gs, n_cand, r)
    held = per_page.any(-1)  # [H, G', Pc]
    order = torch.arange(n_cand).expand(H, Gs, n_cand)
    chosen = torch.where(held, order + sink_pages, -1)
    pages = _compact(torch.cat([torch.arange(sink_pages).expand(H, Gs, -1), chosen,
                                torch.arange(sink_pages + n_cand, n_pages).expand(H, Gs, -1)], dim=-1))  # fmt: skip
    width = sink_pages + int(held.sum(-1).max()) + (n_pages - sink_pages - n_cand)
    pages = pages[..., :width]
    is_cand = (pages >= sink_pages) & (pages < sink_pages + n_cand)
    sub = per_page.gather(2, (pages - sink_pages).clamp(0, max(n_cand - 1, 0)).unsqueeze(-1).expand(H, Gs, width, r))
    tokens = torch.where(is_cand.unsqueeze(-1), sub.repeat_interleave(bs // r, dim=-1), (pages >= 0).unsqueeze(-1))
    return pages, tokens


def choose_pages(
    policy: PagedPolicy, params: Any, generator: torch.Generator, kv_cache: torch.Tensor, query: torch.Tensor,
    block_table: torch.Tensor, seq_lens: torch.Tensor, scale: float, summaries: PageSummaries | None = None,
    fmt: KVFormat = KVFormat(),
) -> PageSelection:
    """What each decode query attends (:class:`PageSelection`), by the policy's own parts over the pages.

    Sequences whose candidates are scored alike (the same sink pages, candidate count and page count
    to select) are scored and selected together, as one batch of the method's own parts: the method's
    select stage (its ``allocation``'s ``select_segments``) is handed a :class:`PageStep` and sees
    exactly the tensors the decode state would give it, no padding. Each (sequence, KV head, selection)
    attends its own number of candidate pages (a non-uniform allocation), its list padded with -1.
    With a :class:`MergedRest` the pages a list leaves out are merged per block from the per-page sums
    (kept in ``summaries``). Arguments as :func:`paged_decode`.
    """
    policy._leaf()
    keys_t = page_views(kv_cache, fmt)[0]
    H_kv, D, bs = keys_t.shape[1], keys_t.shape[2], keys_t.shape[3]
    B, H_q = query.shape[0], query.shape[1]
    if policy.dense:  # every page of every sequence, in order: no per-sequence work
        n_pages = (seq_lens.long() + bs - 1) // bs
        ar = torch.arange(int(n_pages.max()))
        return PageSelection(torch.where(ar < n_pages[:, None], ar, -1).view(B, 1, 1, -1).expand(B, H_kv, 1, -1).contiguous())
    q = query.reshape(B, H_kv, H_q // H_kv, D)
    G = q.shape[2]
    layouts = [policy.layout(length, bs) for length in seq_lens.tolist()]
    seg = layouts[0].segment_size
    r = bs // seg  # segments per page
    shared = 1 if policy.shared_selection else G
    picks: list[tuple[torch.Tensor, torch.Tensor | None]] = [None] * B  # per sequence: ([H, G', w] candidates, valid)
    merged: list[MergedPages | None] = [None] * B
    groups: dict[tuple[int, int, int], list[int]] = {}
    for i, lay in enumerate(layouts):
        k = policy.pages_for(lay)
        if k >= lay.n_segments or policy.fixed:  # every candidate (dense), or none (streamingllm)
            picks[i] = (torch.arange(min(k, lay.n_segments)).expand(H_kv, shared, -1), None)
        else:
            groups.setdefault((lay.sink_end // bs, lay.n_segments, k), []).append(i)
    root = math.sqrt(scale)
    key_root = root * fmt.k_scale  # an fp8 cache's stored keys times its scale are the keys
    m = policy.method
    for (sink_pages, n_seg, k), members in groups.items():
        idx = torch.tensor(members)
        cand = block_table[idx, sink_pages : sink_pages + n_seg // r].long()  # [b, P] physical blocks
        qf = q[idx].float()

        def scorer(top_k: int, cand=cand, qf=qf) -> torch.Tensor:
            seg_keys = PageKeys(keys_t, cand, key_root, r)
            sums = (summaries.get(m.summary, params, keys_t, cand, key_root, r) if summaries is not None
                    else m.summary.summarize(params, seg_keys.all()))  # fmt: skip
            extra = {"top_k": top_k} if isinstance(m.summary, TopKAwareSummary) and m.summary.uses_top_k else {}
            return m.summary.score(params, sums, qf * root, seg_keys if m.summary.reads_keys else None, seg, **extra)

        def always(idx=idx, qf=qf) -> torch.Tensor:
            return _always_mass(keys_t, block_table[idx], [layouts[i] for i in members], qf, scale * fmt.k_scale)

        step = PageStep(m, params, generator, qf, layouts[members[0]], k, shared, scorer, always)
        selection: Selection = m.select_stage.select_segments(step)
        flags = torch.zeros(len(members), H_kv, shared, n_seg, dtype=torch.bool)
        flags.scatter_(-1, selection.segments, True if selection.valid is None else selection.valid)
        if m.rest is not None:
            page_sums_ = summaries.sums(kv_cache, cand, fmt, r) if summaries is not None else page_sums(kv_cache, cand, fmt, r)
            rest = _merged_rest(m.rest, page_sums_, flags, seg)
        for j, i in enumerate(members):
            picks[i] = (selection.segments[j], None if selection.valid is None else selection.valid[j])
            if m.rest is not None:
                merged[i] = MergedPages(rest.keys[j], rest.values[j], rest.log_counts[j])
    tokens = None
    if r == 1:
        lists = [_page_lists(lay.sink_end // bs, lay.n_segments, -(-lay.length // bs), *p) for lay, p in zip(layouts, picks)]
    else:
        both = []
        for lay, (picked, valid) in zip(layouts, picks):
            flags = torch.zeros(H_kv, shared, lay.n_segments, dtype=torch.bool)
            flags.scatter_(-1, picked, True if valid is None else valid)
            both.append(_segment_lists(lay.sink_end // bs, -(-lay.length // bs), flags, r, bs))
        lists = [p for p, _ in both]
        tokens = torch.zeros(B, H_kv, shared, max(p.shape[-1] for p in lists), bs, dtype=torch.bool)
        for i, (p, t) in enumerate(both):
            tokens[i, ..., : p.shape[-1], :] = t
    pages = torch.full((B, H_kv, shared, max(p.shape[-1] for p in lists)), -1, dtype=torch.long)
    for i, p in enumerate(lists):
        pages[i, ..., : p.shape[-1]] = p
    if not any(x is not None for x in merged):
        return PageSelection(pages, None, tokens)
    n = max(x.log_counts.shape[-1] for x in merged if x is not None)
    keys = torch.zeros(B, H_kv, shared, n, D)
    values = torch.zeros(B, H_kv, shared, n, D)
    log_counts = torch.full((B, H_kv, shared, n), float("-inf"))
    for i, x in enumerate(merged):
        if x is not None:
            w = x.log_counts.shape[-1]
            keys[i, ..., :w, :], values[i, ..., :w, :], log_counts[i, ..., :w] = x.keys, x.values, x.log_counts
    return PageSelection(pages, MergedPages(keys, values, log_counts), tokens)


def select_pages(
    policy: PagedPolicy, params: Any, generator: torch.Generator, kv_cache: torch.Tensor, query: torch.Tensor,
    block_table: torch.Tensor, seq_lens: torch.Tensor, scale: float, summaries: PageSummaries | None = None,
    fmt: KVFormat = KVFormat(),
) -> torch.Tensor:
    """The logical pages each decode query attends: ``[B, H_kv, G', P]``, ``-1`` past a list's end.

    ``G'`` is 1 when a KV group shares its selection (dense, ``shared_kv_selection``), else the
    group size. Each list is sinks, selected candidates, tail (:func:`choose_pages`), so the
    sequence's partial last page is the list's last entry. A policy with a merged rest also attends
    merged tokens: :func:`choose_pages` gives them. Arguments as :func:`paged_decode`.
    """
    return choose_pages(policy, params, generator, kv_cache, query, block_table, seq_lens, scale, summaries, fmt).pages


def attend_pages(
    query: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor, pages: torch.Tensor,
    seq_lens: torch.Tensor, scale: float, softcap: float | None = None, fmt: KVFormat = KVFormat(),
    merged: MergedPages | None = None, tokens: torch.Tensor | None = None,
) -> torch.Tensor:
    """float32 softmax attention of ``query: [B, H_q, D]`` over the listed logical pages ``[B, H_kv, G', P]`` (-1: none).

    The torch path (and the reference of a kernel's): one gather of whole pages for the batch (rows
    of the ``[N * H_kv, ...]`` views: indexing the bf16 cache per head then converting was ~20x
    slower), one product per page with the query rows broadcast, one softmax over every page of a
    row, the last page masked past the sequence's length. Returns ``[B, H_q, D]`` in the query's dtype.
    An fp8 cache (``fmt``) is dequantised page by page as it is gathered. ``merged``: a merged rest's
    tokens per list, in the same softmax with logit ``log m + scale q . mean k`` (soft-capped as the
    others) and value ``mean v`` (:class:`~sparseattn.methods.rest.MergedRest`). ``tokens [B, H_kv, G', P, bs]``:
    which tokens of each listed page are attended (segments smaller than a page; None: all).
    """
    keys_t, values = page_views(kv_cache, fmt)
    B, H_q, D = query.shape
    H, bs = keys_t.shape[1], keys_t.shape[-1]
    Gs, P = pages.shape[2], pages.shape[3]
    g = H_q // H // Gs  # query rows sharing one page list
    phys = block_table.long().gather(1, pages.clamp(min=0).view(B, -1)).view(B, H, Gs, P)
    rows = (phys * H + torch.arange(H).view(1, H, 1, 1)).flatten()
    k = keys_t.flatten(0, 1).index_select(0, rows).view(B, H, Gs, P, D, bs).float()
    v = values.flatten(0, 1).index_select(0, rows).view(B, H, Gs, P, bs, D).float()
    if fmt.fp8 is not None:
        k, v = k.mul_(fmt.k_scale), v.mul_(fmt.v_scale)
    positions = pages.unsqueeze(-1) * bs + torch.arange(bs)  # [B, H, G', P, bs]
    valid = (pages.unsqueeze(-1) >= 0) & (positions < seq_lens.view(B, 1, 1, 1, 1))
    if tokens is not None:
        valid = valid & tokens
    q = query.float().reshape(B, H, Gs, 1, g, D)
    logits = torch.matmul(q, k) * scale  # [B, H, G', P, g, bs]
    if softcap:
        logits = torch.tanh(logits / softcap) * softcap
    logits = logits.masked_fill(~valid.unsqueeze(-2), float("-inf"))
    flat = logits.transpose(3, 4).reshape(B, H, Gs, g, P * bs)
    if merged is None:
        probs = torch.softmax(flat, dim=-1).view(B, H, Gs, g, P, bs).transpose(3, 4)  # [B, H, G', P, g, bs]
        return torch.matmul(probs, v).sum(3).reshape(B, H_q, D).to(query.dtype)
    extra = torch.matmul(q.squeeze(3), merged.keys.transpose(-1, -2)) * scale  # [B, H, G', g, n]
    if softcap:
        extra = torch.tanh(extra / softcap) * softcap
    extra = extra + merged.log_counts.unsqueeze(3)
    both = torch.softmax(torch.cat([flat, extra], dim=-1), dim=-1)
    probs = both[..., : P * bs].reshape(B, H, Gs, g, P, bs).transpose(3, 4)
    out = torch.matmul(probs, v).sum(3) + torch.matmul(both[..., P * bs :], merged.values)  # [B, H, G', g, D]
    return out.reshape(B, H_q, D).to(query.dtype)


def paged_decode(
    policy: PagedPolicy, params: Any, generator: torch.Generator, kv_cache: torch.Tensor, query: torch.Tensor,
    block_table: torch.Tensor, seq_lens: torch.Tensor, scale: float, softcap: float | None = None,
    summaries: PageSummaries | None = None, fmt: KVFormat = KVFormat(),
) -> torch.Tensor:
    """One decode token per sequence: ``query: [B, H_q, D]`` over the paged cache -> ``[B, H_q, D]`` (query's dtype).

    ``kv_cache: [N, H_kv, bs, 2 D]`` (the CPU layout, :func:`page_views`); ``block_table: [B, >= ceil(L/bs)]``
    physical block ids; ``seq_lens: [B]`` tokens per sequence, the current one included (already in the cache).
    Per sequence: sink pages + the selected candidate pages + the tail pages (+ a merged rest's
    tokens), one float32 softmax: :func:`choose_pages` then :func:`attend_pages` (the vLLM backend
    runs vLLM's own paged kernel over the same page lists instead, when there is no merged rest).
    ``summaries`` keeps page summaries (and sums) between steps (None: computed every step).
    """
    chosen = choose_pages(policy, params, generator, kv_cache, query, block_table, seq_lens, scale, summaries, fmt)
    return attend_pages(query, kv_cache, block_table, chosen.pages, seq_lens, scale, softcap, fmt, chosen.merged, chosen.tokens)


def merged_pages_ref(
    kv_cache: torch.Tensor, query: torch.Tensor, block_table: torch.Tensor, seq_lens: torch.Tensor, scale: float,
    pages: torch.Tensor, sink_pages: list[int], n_cand: list[int], per_block: int, fmt: KVFormat = KVFormat(),
) -> torch.Tensor:
    """Reference of a merged step over a paged cache, float64, one loop per sequence, query head and block.

    Each query head attends the tokens of its list's pages (``pages [B, H_kv, G', P]``) plus, for every
    block of ``per_block`` consecutive candidate pages (``n_cand[i]`` of them after ``sink_pages[i]``), one
    token made of the block's tokens in pages it does not list: logit ``log m + scale q . mean k``, value
    ``mean v`` (none when the block is wholly listed). Returns ``[B, H_q, D]`` float64.
    """
    keys_t, values = page_views(kv_cache, fmt)
    H_kv, D, bs = keys_t.shape[1], keys_t.shape[2], keys_t.shape[3]
    B, H_q = query.shape[:2]
    Gs = pages.shape[2]
    G = H_q // H_kv
    out = torch.zeros(B, H_q, D, dtype=torch.float64)
    for i, length in enumerate(seq_lens.tolist()):
        blocks = block_table[i, : -(-length // bs)].long()
        K = keys_t[blocks].permute(1, 0, 3, 2).double() * fmt.k_scale  # [H, P_all, bs, D]
        V = values[blocks].permute(1, 0, 2, 3).double() * fmt.v_scale
        for hq in range(H_q):
            h, g = divmod(hq, G)
            listed = {int(p) for p in pages[i, h, g if Gs > 1 else 0] if p >= 0}
            qv = query[i, hq].double()
            logits, vals = [], []
            for p in sorted(listed):
                n = min(bs, length - p * bs)
                logits.append(K[h, p, :n] @ qv * scale)
                vals.append(V[h, p, :n])
            first = sink_pages[i]
            for b0 in range(first, first + n_cand[i], per_block):
                left = [p for p in range(b0, min(b0 + per_block, first + n_cand[i])) if p not in listed]
                if left:
                    mk = K[h, left].reshape(-1, D).mean(0)
                    mv = V[h, left].reshape(-1, D).mean(0)
                    logits.append((mk @ qv * scale + math.log(len(left) * bs)).view(1))
                    vals.append(mv.view(1, D))
            p_all = torch.softmax(torch.cat(logits), dim=0)
            out[i, hq] = p_all @ torch.cat(vals)
    return out


def paged_decode_ref(
    kv_cache: torch.Tensor, query: torch.Tensor, block_table: torch.Tensor, seq_lens: torch.Tensor, scale: float,
    mask: list[torch.Tensor] | None = None, fmt: KVFormat = KVFormat(),
) -> torch.Tensor:
    """Reference: gather each sequence's tokens contiguously and attend in float64 (``mask[i]: [H_q, L]`` optional),
    an fp8 cache dequantised (stored number times scale) in float64."""
    keys_t, values = page_views(kv_cache, fmt)
    H_kv, D, bs = keys_t.shape[1], keys_t.shape[2], keys_t.shape[3]
    H_q = query.shape[1]
    out = torch.empty_like(query)
    for i, length in enumerate(seq_lens.tolist()):
        blocks = block_table[i, : -(-length // bs)].long()
        k = keys_t[blocks].permute(1, 0, 3, 2).reshape(H_kv, -1, D)[:, :length].double() * fmt.k_scale
        v = values[blocks].permute(1, 0, 2, 3).reshape(H_kv, -1, D)[:, :length].double() * fmt.v_scale
        k = k.repeat_interleave(H_q // H_kv, dim=0)
        v = v.repeat_interleave(H_q // H_kv, dim=0)
        logits = torch.einsum("hd,htd->ht", query[i].double(), k) * scale
        if mask is not None:
            logits = logits.masked_fill(~mask[i], float("-inf"))
        out[i] = torch.einsum("ht,htd->hd", torch.softmax(logits, dim=-1), v).to(query.dtype)
    return out
