"""The generic path's selection over vLLM's pages: the policy's own summary, selector and allocation, in torch.

Page summaries are kept per physical block (:class:`PageSummaries`), keys are read on demand (:class:`PageKeys`),
and :class:`PageStep` gives the method's select stage the pages' scores as :class:`~sparseattn.methods.segment_step.SegmentStep`
gives it a segment grid's; :func:`choose_pages` returns each selection's pages and a merged rest's tokens. No vLLM import.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from sparseattn.allocations.base import Selection
from sparseattn.allocations.step import SearchStep
from sparseattn.methods.rest import MergedRest
from sparseattn.methods.segment_search import SegmentSearch
from sparseattn.ops.layout import SegmentLayout
from sparseattn.summaries.base import SegmentKeys, Shortlist, TopKAwareSummary
from sparseattn.vllm.cache_format import KVFormat, page_views
from sparseattn.vllm.policy import PagedPolicy

__all__ = ["MergedPages", "PageKeys", "PageSelection", "PageStep", "PageSummaries", "choose_pages", "page_sums", "select_pages"]


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


class PageStep(SearchStep):
    """One decode step of a group of alike sequences over their pages: the paged engine's
    :class:`~sparseattn.allocations.step.SearchStep`.

    ``query [b, H_kv, G, D]`` (float32), ``layout`` (the candidates: the group's sequences share their
    sink pages and candidate count); the engine supplies how it scores the candidate pages (``scorer``:
    ``top_k -> [b, H_kv, G, S]``, computed once per ``top_k``), the sink and tail mass (``always``) and,
    when the scorer has one, the scores' :class:`~sparseattn.summaries.base.Shortlist` (the split step's),
    off which a selector that keeps the best reads its picks, as the decode state does. So an allocation
    (uniform, pooled, top-p, a user's) splits pages exactly as it splits segments in the transformers
    engine, on the same scores.
    """

    __slots__ = ("_scorer", "_always", "_shortlist", "_scores")

    def __init__(
        self, method: SegmentSearch, generator: torch.Generator, query: torch.Tensor, layout: SegmentLayout,
        k: int, shared: int, scorer: Any, always: Any, shortlist: Shortlist | None = None,
    ) -> None:
        super().__init__(method, query, layout, k, shared, generator)
        self._scorer, self._always, self._shortlist = scorer, always, shortlist
        self._scores: dict[int, torch.Tensor] = {}

    def head_scores(self, top_k: int) -> torch.Tensor:
        if top_k not in self._scores:
            self._scores[top_k] = self._scorer(top_k)  # [b, H, G, S]
        return self._scores[top_k]

    def best(self, n: int, with_scores: bool) -> tuple[torch.Tensor | None, torch.Tensor, torch.Tensor] | None:
        """Each selection's ``n`` best off the shortlist, when there is one that holds them (the same pages:
        it ranks above the rest); None otherwise."""
        sl = self._shortlist
        if sl is None or self.shared == 1 or n > sl.exact.shape[-1]:
            return None
        return (self.scores() if with_scores else None, *sl.top(n, sorted=False))

    def head_always_log_mass(self) -> torch.Tensor:
        return self._always()  # [b, H, G]


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

        step = PageStep(m, generator, qf, layouts[members[0]], k, shared, scorer, always)
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
