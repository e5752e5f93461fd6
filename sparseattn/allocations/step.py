"""One decode step as a select stage sees it, written once for both engines.

A select stage (:class:`~sparseattn.allocations.SelectStage`: an allocation, or a refinement) gets a
:class:`SearchStep` and asks it for what it needs: the scores of every segment, the selector's picks,
their scores, the mass every head attends anyway. Those answers are the same arithmetic in the
transformers engine (:class:`~sparseattn.methods.segment_step.SegmentStep`, over a decode state's
segments) and in vLLM's paged engine (:class:`~sparseattn.vllm.selection.PageStep`, over pages), so a
part splits pages exactly as it splits segments. An engine supplies only how it scores
(:meth:`SearchStep.head_scores`, optionally :meth:`SearchStep.group_scores` and :meth:`SearchStep.best`)
and the mass of the always-attended tokens (:meth:`SearchStep.head_always_log_mass`).
"""

from __future__ import annotations

from typing import Any

import torch

from sparseattn.ops.layout import SegmentLayout
from sparseattn.selectors.base import Selector, has_distinct_indices, keeps_best


def check_picks(selector: Selector, picks: torch.Tensor, shape: tuple[int, ...], n_segments: int) -> None:
    """A selector must return distinct in-range long indices of ``shape``: a repeat would count tokens twice
    in the softmax. ValueError otherwise (the distinctness check skipped for a selector that declares it)."""
    if tuple(picks.shape) != shape or picks.dtype != torch.long:
        raise ValueError(f"{selector!r} returned {picks.dtype} indices of shape {tuple(picks.shape)}, expected long {shape}")
    if has_distinct_indices(selector):  # guaranteed by construction (e.g. topk): skip the sync
        return
    ordered = picks.sort(dim=-1).values
    bad = (ordered[..., 0] < 0) | (ordered[..., -1] >= n_segments) | (ordered.diff(dim=-1) == 0).any(-1)
    if bool(bad.any()):
        raise ValueError(
            f"{selector!r} returned segment indices that are repeated or outside [0, {n_segments}): {picks[bad][0].tolist()}"
        )


class SearchStep:
    """One decode step of a segment search over ``S = layout.n_segments`` candidates (segments or pages).

    Attributes:
        method: the :class:`~sparseattn.methods.segment_search.SegmentSearch` whose parts run the step.
        query: ``[B, H_kv, G, D]`` the step's queries grouped by KV head.
        layout: the step's :class:`SegmentLayout`.
        k: segments the budget buys per selection (``< S`` when a select stage is asked).
        shared: ``G'``, selections per KV head: 1 when the group shares one selection, else ``G``.
        group: ``G``, query heads per KV head.
        generator: the layer's seeded generator (:func:`~sparseattn.seeding.layer_generator`), for a
            selector that draws.

    Scores are computed on demand, so a stage that needs none never pays for them. An engine's step
    implements :meth:`head_scores` and :meth:`head_always_log_mass`; it may give :meth:`group_scores`
    directly (cheaper than reducing the heads') and :meth:`best` (each selection's best read off a
    shortlist, for a selector that :func:`~sparseattn.selectors.base.keeps_best`).
    """

    __slots__ = ("method", "query", "layout", "k", "shared", "group", "generator")

    def __init__(
        self, method: Any, query: torch.Tensor, layout: SegmentLayout, k: int, shared: int, generator: torch.Generator | None
    ) -> None:
        self.method, self.query, self.layout, self.k, self.shared = method, query, layout, k, shared
        self.group = query.shape[2]
        self.generator = generator

    # -- what an engine supplies ---------------------------------------------------------------

    def head_scores(self, top_k: int) -> torch.Tensor:
        """Each query head's segment log-mass estimates ``[B, H_kv, G, S]``; ``top_k`` goes to summaries that take it."""
        raise NotImplementedError

    def group_scores(self, top_k: int) -> torch.Tensor:
        """Each KV group's log summed estimated masses ``[B, H_kv, 1, S]`` (a shared selection ranks them)."""
        return torch.logsumexp(self.head_scores(top_k), dim=2, keepdim=True)

    def best(self, n: int, with_scores: bool) -> tuple[torch.Tensor | None, torch.Tensor, torch.Tensor] | None:
        """``(scores or None, values, segments)``: each selection's ``n`` best and their estimates, when the
        engine has them cheaper than a top-n over :meth:`scores` (a shortlist); None: it has not."""
        return None

    def head_always_log_mass(self) -> torch.Tensor:
        """``[B, H_kv, G]`` each query head's log attention mass of the sinks and the tail (on the scores' scale)."""
        raise NotImplementedError

    # -- what a select stage asks ------------------------------------------------------------

    @property
    def reach(self) -> int:
        """The most segments one selection may attend this step (:meth:`SegmentSearch.reach
        <sparseattn.methods.segment_search.SegmentSearch.reach>`): the ``top_k`` summaries are told by default."""
        return self.method.reach(self.k, self.layout.n_segments)

    def scores(self, top_k: int | None = None) -> torch.Tensor:
        """Each selection's segment log-mass estimates ``[B, H_kv, G', S]`` (a shared selection ranks its
        group's summed masses); ``top_k`` (default :attr:`reach`) goes to summaries that take it."""
        top_k = self.reach if top_k is None else top_k
        return self.group_scores(top_k) if self.shared == 1 else self.head_scores(top_k)

    def selector_scores(self, top_k: int | None = None) -> torch.Tensor:
        """What the selector ranks: :meth:`scores`, or zeros ``[B, H_kv, G', S]`` (nothing scored) for a
        selector that declares ``uses_scores = False``."""
        if self.method.selector.uses_scores:
            return self.scores(top_k)
        B, H = self.query.shape[:2]
        return torch.zeros(B, H, self.shared, self.layout.n_segments, device=self.query.device)

    def choose(self, n: int, scores: torch.Tensor) -> torch.Tensor:
        """The selector's ``n`` picks ``[B, H_kv, G', n]`` among ``scores``, from the layer's generator;
        ValueError when they are not distinct in-range indices (:func:`check_picks`)."""
        selector = self.method.selector
        picks = selector.select(scores, n, self.generator)
        check_picks(selector, picks, (*scores.shape[:3], n), scores.shape[-1])
        return picks

    def picks(self, n: int) -> torch.Tensor:
        """The selector's ``n`` picks ``[B, H_kv, G', n]``: read off :meth:`best` when the selector keeps the
        best and the engine has them (then the scores of every segment are never computed)."""
        best = self.best(n, with_scores=False) if keeps_best(self.method.selector) else None
        return best[2] if best is not None else self.choose(n, self.selector_scores())

    def scored_picks(self, n: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(scores [B, H_kv, G', S], estimates [B, H_kv, G', n], segments [B, H_kv, G', n])``: the step's
        scores, and the selector's ``n`` picks (as :meth:`picks`) with their scores."""
        best = self.best(n, with_scores=True) if keeps_best(self.method.selector) else None
        if best is not None:
            return best
        scores = self.scores()
        segments = self.choose(n, scores)
        return scores, scores.gather(-1, segments), segments

    def always_log_mass(self) -> torch.Tensor:
        """``[B, H_kv, G']`` the log attention mass of the sinks and the tail, which every head attends (a
        shared selection: its group's summed mass)."""
        mass = self.head_always_log_mass()
        return torch.logsumexp(mass, dim=2, keepdim=True) if self.shared == 1 else mass
