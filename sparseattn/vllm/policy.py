"""A sparse method as the paged engine runs it over vLLM's pages: :class:`PagedPolicy` (what runs, refused with the
reason otherwise), the page-aligned layout of a sequence (:func:`page_layout`) and the method's own grid
(:func:`own_segment`). No vLLM import.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from sparseattn.methods.dense import Dense
from sparseattn.methods.layers import FirstLayers, SplitLayers, layer_method
from sparseattn.methods.rest import MergedRest
from sparseattn.methods.segment_search import SegmentSearch
from sparseattn.methods.streaming import StreamingLLM
from sparseattn.ops.layout import SegmentLayout
from sparseattn.seeding import layer_seed
from sparseattn.selectors.base import selector_seed

__all__ = ["PagedPolicy", "layer_methods", "own_segment", "page_layout"]


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
    the fused C step runs them too (its split step: :func:`~sparseattn.vllm.route.route`).
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
        generator.manual_seed(layer_seed(selector_seed(s.selector), layer_idx))
        return params, generator
