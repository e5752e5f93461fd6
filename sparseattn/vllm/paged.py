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

from sparseattn.methods.layers import FirstLayers, SplitLayers
from sparseattn.methods.dense import Dense
from sparseattn.methods.segment_search import SegmentSearch
from sparseattn.methods.streaming import StreamingLLM
from sparseattn.ops.layout import SegmentLayout
from sparseattn.selectors.base import selector_seed
from sparseattn.summaries.base import SegmentKeys, TopKAwareSummary

__all__ = [
    "FP8_FORMATS", "KVFormat", "PageKeys", "PageSummaries", "PagedPolicy", "attend_pages", "page_layout", "page_views",
    "paged_decode", "paged_decode_ref", "select_pages",
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


def page_layout(length: int, block_size: int, sinks: int, window: int) -> SegmentLayout:
    """The page-aligned :class:`SegmentLayout` of a sequence of ``length`` tokens (the current one included).

    Sinks are rounded up to whole pages; the tail starts at the page holding the first of the last
    ``max(window, 1)`` tokens (the current token is never in a candidate page).

    >>> lay = page_layout(300, 128, sinks=4, window=0)
    >>> lay.sink_end, lay.n_segments, lay.tail_start
    (128, 1, 256)
    """
    if length < 1:
        raise ValueError(f"page_layout: length must be >= 1, got {length}")
    sink_pages = min(-(-sinks // block_size), -(-length // block_size)) if sinks else 0
    first_tail_page = max(sink_pages, (length - max(window, 1)) // block_size)
    return SegmentLayout(
        length=length, sinks=sink_pages * block_size, segment_size=block_size, n_segments=first_tail_page - sink_pages
    )


@dataclass(frozen=True)
class PagedPolicy:
    """A registry method as the paged engine runs it: dense, or a :class:`SegmentSearch` over pages.

    :class:`StreamingLLM` runs as a selection (its sinks' pages and the most recent pages within its
    budget, whole pages; nothing is evicted). Refused (ValueError naming the method and why): the
    other eviction methods (they drop tokens from the cache, which vLLM owns, by scores a per-token
    record would have to keep) and segment search with an ``always`` part (heavy hitters need a
    per-token record). A summary that reads keys (``reads_keys``: radar+'s exact rerank) is handed
    a :class:`PageKeys`: only the pages it takes are read.
    """

    method: Any
    name: str = ""

    def __post_init__(self) -> None:
        m, label = self.method, self.name or type(self.method).__name__
        if isinstance(m, (Dense, StreamingLLM)):
            return
        if isinstance(m, (FirstLayers, SplitLayers)):
            raise ValueError(
                f"sparseattn method {label!r}: per-layer budgets or methods ({type(m).__name__}) are not supported in vLLM yet (the "
                "backend holds one policy for every layer); they run in the transformers engine"
            )
        if not isinstance(m, SegmentSearch):
            raise ValueError(
                f"sparseattn method {label!r} ({type(m).__name__}) cannot run in vLLM: the paged engine runs dense, "
                "streamingllm (as a selection) and segment-search methods (quest, radar, radar-*...); eviction methods "
                "drop tokens from a cache that vLLM owns and stay transformers-only"
            )
        if m.always is not None:
            raise ValueError(f"sparseattn method {label!r}: an always-kept part ({m.always!r}) is not supported in vLLM yet")
        if not m.allocation.uniform:
            raise ValueError(
                f"sparseattn method {label!r}: a non-uniform budget allocation ({m.allocation!r}) is not supported in "
                "vLLM yet (the page lists of one step are one length per head); it runs in the transformers engine"
            )
        if m.refine is not None:
            raise ValueError(
                f"sparseattn method {label!r}: token refinement ({m.refine!r}) is not supported in vLLM yet (the paged "
                "engine attends whole pages); it runs in the transformers engine"
            )
        if m.rest is not None:
            raise ValueError(
                f"sparseattn method {label!r}: a merged rest ({m.rest!r}) is not supported in vLLM yet (the paged engine "
                "keeps no block sums); it runs in the transformers engine"
            )

    @property
    def dense(self) -> bool:
        return isinstance(self.method, Dense)

    @property
    def fixed(self) -> bool:
        """True when the pages attended do not depend on the query (dense, streamingllm): nothing is scored."""
        return isinstance(self.method, (Dense, StreamingLLM))

    @property
    def shared_selection(self) -> bool:
        """One page list per KV group (else one per query head)."""
        return self.fixed or self.method.shared_kv_selection

    def layout(self, length: int, block_size: int) -> SegmentLayout:
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
        return page_layout(length, block_size, m.sinks, m.window)

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
    """The summaries of one layer's pages, kept per physical block id beside vLLM's cache.

    A page's summary is computed the first time a step needs it (the page is then full and in the
    past) and kept until vLLM writes into that block again: :meth:`invalidate` is called with every
    slot mapping vLLM writes through, so a freed block reused for another sequence is summarised
    afresh, and a block prefix caching shares between sequences is summarised once for all of them.
    Tensors ``[N, H_kv, ...]`` (one per summary output), float32, allocated on first use.
    """

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.block_size = block_size
        self.valid = torch.zeros(num_blocks, dtype=torch.bool)
        self.store: list[torch.Tensor] | None = None
        self.computed = 0  #: pages summarised so far (for tests and accounting)

    def invalidate(self, slot_mapping: torch.Tensor) -> None:
        """Forget the summaries of the blocks ``slot_mapping`` (slots, ``-1`` for padding) writes into."""
        slots = slot_mapping[slot_mapping >= 0]
        if slots.numel():
            self.valid[torch.div(slots, self.block_size, rounding_mode="floor").long()] = False

    def get(self, summary: Any, params: Any, keys_t: torch.Tensor, blocks: torch.Tensor, root: float) -> tuple[torch.Tensor, ...]:
        """Summaries ``[B, H_kv, S, ...]`` of the physical ``blocks: [B, S]``, computing the missing ones."""
        known = self.valid[blocks]
        missing = blocks[~known].unique() if not bool(known.all()) else blocks[:0]  # all known: no nonzero pass
        if missing.numel():
            fresh = summary.summarize(params, _page_keys(keys_t, missing[None], root))
            if self.store is None:
                n = self.valid.shape[0]
                self.store = [torch.zeros(n, *t.shape[1:2], *t.shape[3:], dtype=t.dtype) for t in fresh]
            for buf, t in zip(self.store, fresh):
                buf[missing] = t[0].transpose(0, 1)
            self.valid[missing] = True
            self.computed += int(missing.numel())
        return tuple(buf[blocks].transpose(1, 2) for buf in self.store)


def _page_keys(keys_t: torch.Tensor, blocks: torch.Tensor, root: float) -> torch.Tensor:
    """Scaled float32 keys ``[B, H, S, bs, D]`` of the physical ``blocks: [B, S]`` (a copy)."""
    return keys_t[blocks].permute(0, 2, 1, 4, 3).float() * root  # [B, S, H, D, bs] -> [B, H, S, bs, D]


class PageKeys(SegmentKeys):
    """Candidate pages' keys as a summary that ``reads_keys`` receives them, read from the paged cache on demand.

    radar+'s exact rerank asks for the keys of its shortlist only (:meth:`take`): those pages are
    copied out of vLLM's cache, the other candidates are never read. :meth:`all` (an oracle such as
    ``radar-exact``) copies every candidate page. ``blocks: [B, S]`` are the candidates' physical
    block ids; keys come scaled by ``factor`` in float32, as the decode state hands them.
    """

    def __init__(self, keys_t: torch.Tensor, blocks: torch.Tensor, factor: float) -> None:
        from sparseattn.backends.registry import get_backend

        # Not SegmentKeys.__init__: there is no [B, H, S, c, D] view of a paged cache to hold as ``raw``.
        self.keys_t, self.blocks, self.factor, self.dtype = keys_t, blocks, factor, torch.float32
        self.workspace = None
        self.backend = get_backend("torch")  # the cpu kernel reads ``raw`` in place, which pages do not have

    @property
    def shape(self) -> torch.Size:
        N, H, D, bs = self.keys_t.shape
        return torch.Size((self.blocks.shape[0], H, self.blocks.shape[1], bs, D))

    @property
    def raw(self) -> torch.Tensor:
        """Every candidate page's unscaled keys ``[B, H, S, bs, D]`` (a copy: for references and tests)."""
        return self.keys_t[self.blocks].permute(0, 2, 1, 4, 3)

    def all(self) -> torch.Tensor:
        return _page_keys(self.keys_t, self.blocks, self.factor)

    def take(self, index: torch.Tensor) -> torch.Tensor:
        """Candidates ``index: [B, H, m]`` -> scaled keys ``[B, H, m, bs, D]``: only those pages are read."""
        B, H, m = index.shape
        N, _, D, bs = self.keys_t.shape
        phys = self.blocks.gather(1, index.reshape(B, H * m)).view(B, H, m)
        rows = (phys * H + torch.arange(H).view(1, H, 1)).flatten()  # whole contiguous pages of one head
        taken = self.keys_t.flatten(0, 1).index_select(0, rows).view(B, H, m, D, bs)
        return taken.transpose(-1, -2).float().mul_(self.factor)


def _choose_pages(
    policy: PagedPolicy, params: Any, generator: torch.Generator, keys_t: torch.Tensor, block_table: torch.Tensor,
    layouts: list[SegmentLayout], q: torch.Tensor, scale: float, cache: PageSummaries | None, k_scale: float = 1.0,
) -> list[torch.Tensor]:
    """Per sequence, the logical pages it attends ``[H_kv, G', P_i]``: sinks, selected candidates, tail.

    The tail comes last, so a list's only partial page (the sequence's last) is its last entry: a
    paged kernel given the list as a block table and ``(P_i - 1) * bs + `` the last page's fill as the
    length attends exactly these tokens.

    Sequences whose candidates are scored alike (the same sink pages, candidate count and page count
    to select) are scored and selected together, as one batch of the method's own parts: any
    summary and selector sees exactly the tensors the decode state would give it, no padding.
    """
    B, H, G, _ = q.shape
    shared = 1 if policy.shared_selection else G
    bs = layouts[0].segment_size
    chosen: list[torch.Tensor | None] = [None] * B
    groups: dict[tuple[int, int, int], list[int]] = {}
    for i, lay in enumerate(layouts):
        k = policy.pages_for(lay)
        if k >= lay.n_segments or policy.fixed:  # every candidate (dense), or none (streamingllm)
            chosen[i] = torch.arange(min(k, lay.n_segments)).expand(H, shared, -1)
        else:
            groups.setdefault((lay.sink_end // bs, lay.n_segments, k), []).append(i)
    root = math.sqrt(scale)
    key_root = root * k_scale  # an fp8 cache's stored keys times its scale are the keys
    for (sink_pages, n_seg, k), members in groups.items():
        m = policy.method
        idx = torch.tensor(members)
        if m.selector.uses_scores:
            cand = block_table[idx, sink_pages : sink_pages + n_seg].long()  # [b, S] physical blocks
            seg_keys = PageKeys(keys_t, cand, key_root)
            if cache is not None:
                summaries = cache.get(m.summary, params, keys_t, cand, key_root)
            else:
                summaries = m.summary.summarize(params, seg_keys.all())
            extra = {"top_k": k} if isinstance(m.summary, TopKAwareSummary) and m.summary.uses_top_k else {}
            keys_arg = seg_keys if m.summary.reads_keys else None
            scores = m.summary.score(params, summaries, q[idx].float() * root, keys_arg, bs, **extra)  # [b, H, G, S]
            if shared == 1:
                scores = torch.logsumexp(scores, dim=2, keepdim=True)
        else:
            scores = torch.zeros(len(members), H, shared, n_seg)
        picked = m.selector.select(scores, k, generator)  # [b, H, G', k]
        for j, i in enumerate(members):
            chosen[i] = picked[j]
    pages = []
    for lay, c in zip(layouts, chosen):
        sink_pages, n_pages = lay.sink_end // bs, -(-lay.length // bs)
        sinks = torch.arange(sink_pages).expand(H, shared, -1)
        tail = torch.arange(sink_pages + lay.n_segments, n_pages).expand(H, shared, -1)
        pages.append(torch.cat([sinks, c + sink_pages, tail], dim=-1))
    return pages


def select_pages(
    policy: PagedPolicy, params: Any, generator: torch.Generator, kv_cache: torch.Tensor, query: torch.Tensor,
    block_table: torch.Tensor, seq_lens: torch.Tensor, scale: float, summaries: PageSummaries | None = None,
    fmt: KVFormat = KVFormat(),
) -> torch.Tensor:
    """The logical pages each decode query attends: ``[B, H_kv, G', P]``, ``-1`` past a list's end.

    ``G'`` is 1 when a KV group shares its selection (dense, ``shared_kv_selection``), else the
    group size. Each list is sinks, selected candidates, tail (:func:`_choose_pages`), so the
    sequence's partial last page is the list's last entry. Arguments as :func:`paged_decode`.
    """
    keys_t = page_views(kv_cache, fmt)[0]
    H_kv, D, bs = keys_t.shape[1], keys_t.shape[2], keys_t.shape[3]
    B, H_q = query.shape[0], query.shape[1]
    if policy.dense:  # every page of every sequence, in order: no per-sequence work
        n_pages = (seq_lens.long() + bs - 1) // bs
        ar = torch.arange(int(n_pages.max()))
        return torch.where(ar < n_pages[:, None], ar, -1).view(B, 1, 1, -1).expand(B, H_kv, 1, -1).contiguous()
    q = query.reshape(B, H_kv, H_q // H_kv, D)
    layouts = [policy.layout(length, bs) for length in seq_lens.tolist()]
    lists = _choose_pages(policy, params, generator, keys_t, block_table, layouts, q, scale, summaries, fmt.k_scale)
    pages = torch.full((B, *lists[0].shape[:2], max(p.shape[-1] for p in lists)), -1, dtype=torch.long)
    for i, p in enumerate(lists):
        pages[i, ..., : p.shape[-1]] = p
    return pages


def attend_pages(
    query: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor, pages: torch.Tensor,
    seq_lens: torch.Tensor, scale: float, softcap: float | None = None, fmt: KVFormat = KVFormat(),
) -> torch.Tensor:
    """float32 softmax attention of ``query: [B, H_q, D]`` over the listed logical pages ``[B, H_kv, G', P]`` (-1: none).

    The torch path (and the reference of a kernel's): one gather of whole pages for the batch (rows
    of the ``[N * H_kv, ...]`` views: indexing the bf16 cache per head then converting was ~20x
    slower), one product per page with the query rows broadcast, one softmax over every page of a
    row, the last page masked past the sequence's length. Returns ``[B, H_q, D]`` in the query's dtype.
    An fp8 cache (``fmt``) is dequantised page by page as it is gathered.
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
    q = query.float().reshape(B, H, Gs, 1, g, D)
    logits = torch.matmul(q, k) * scale  # [B, H, G', P, g, bs]
    if softcap:
        logits = torch.tanh(logits / softcap) * softcap
    logits = logits.masked_fill(~valid.unsqueeze(-2), float("-inf"))
    flat = logits.transpose(3, 4).reshape(B, H, Gs, g, P * bs)
    probs = torch.softmax(flat, dim=-1).view(B, H, Gs, g, P, bs).transpose(3, 4)  # [B, H, G', P, g, bs]
    return torch.matmul(probs, v).sum(3).reshape(B, H_q, D).to(query.dtype)


def paged_decode(
    policy: PagedPolicy, params: Any, generator: torch.Generator, kv_cache: torch.Tensor, query: torch.Tensor,
    block_table: torch.Tensor, seq_lens: torch.Tensor, scale: float, softcap: float | None = None,
    summaries: PageSummaries | None = None, fmt: KVFormat = KVFormat(),
) -> torch.Tensor:
    """One decode token per sequence: ``query: [B, H_q, D]`` over the paged cache -> ``[B, H_q, D]`` (query's dtype).

    ``kv_cache: [N, H_kv, bs, 2 D]`` (the CPU layout, :func:`page_views`); ``block_table: [B, >= ceil(L/bs)]``
    physical block ids; ``seq_lens: [B]`` tokens per sequence, the current one included (already in the cache).
    Per sequence: sink pages + the selected candidate pages + the tail pages, one float32 softmax:
    :func:`select_pages` then :func:`attend_pages` (the vLLM backend runs vLLM's own paged kernel
    over the same page lists instead). ``summaries`` keeps page summaries between steps (None:
    summarise the candidate pages every step).
    """
    pages = select_pages(policy, params, generator, kv_cache, query, block_table, seq_lens, scale, summaries, fmt)
    return attend_pages(query, kv_cache, block_table, pages, seq_lens, scale, softcap, fmt)


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
