"""Two-stage segment search: a cheap summary shortlists, the exact segment mass reranks the shortlist."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch

from sparseattn.ops.ranking import ranks
from sparseattn.validation import check_bool, check_int, check_real
from sparseattn.summaries.base import Shortlist, Summary, segment_log_mass
from sparseattn.summaries.centroid import Centroid
from sparseattn.summaries.performer import PerformerFeatures


@dataclass(frozen=True)
class Rerank:
    """Score every segment with ``coarse``; rescore the best ``shortlist`` of them exactly.

    Per query head, the ``shortlist`` segments with the highest coarse scores get their exact log
    attention mass ``logsumexp_j q . k_j`` (read from their keys: ``shortlist * c`` keys, no values);
    the others keep their coarse score pushed below every shortlisted one. With :class:`TopK` and
    ``top_k <= shortlist`` the selection is therefore the exact top-k *within the shortlist*: exact
    search whenever the true top segments are shortlisted, and never worse than the coarse ranking at
    finding them (a shortlisted true-top segment cannot be displaced by a non-shortlisted one).

    Cost per step and query head: the coarse scoring plus ``shortlist * c * d`` multiply-adds over
    keys only; with ``shortlist = 2 k`` the keys read for reranking equal the keys then attended, so
    the step reads about 1.5x the tokens' K/V bytes of the coarse search alone.

    Args:
        coarse: the shortlisting summary (default: Radar's random features, n = 256).
        shortlist: segments rescored exactly per query head, at least; 0 disables reranking.
        factor: the shortlist grows to ``ceil(factor * top_k)`` when a selection of the step may attend
            ``top_k`` segments (its reach: a budget gives more segments at longer contexts, and a pooled
            split lets one head take up to ``cap x k``); 2 is the cost-neutral choice described above.
        per_group: one shortlist per KV group instead of per query head: the segments with the
            highest group mass ``logsumexp_g coarse_g``, whose keys are read once for the group's
            ``G`` query heads (G times fewer key bytes under grouped-query attention). Each head
            still selects the exact top-k *within the group's shortlist*; what is no longer
            guaranteed is that a segment only that head's coarse score ranks high is shortlisted.
        prefilter: 0, or a first pass over groups of that many consecutive segments (a paged cache's
            page: its segments' mean centroid is the page's mean key): every group is scored as one
            segment (``log n + q . mean``, n its tokens) and only the best ``prefilter_keep x m / prefilter``
            groups (at least one; ``m`` the shortlist) have their segments scored one by one and
            shortlisted; a segment of another group is estimated from its group's mean (``log c + q .
            mean``, the group's bound split evenly). The scoring then reads about ``S / prefilter +
            prefilter_keep x m`` centroids instead of ``S``. Needs a :class:`Centroid` coarse summary.
        prefilter_keep: groups kept, as segments over the shortlist (>= 1).
        unit: 0, or the shortlist made of whole units of about that many tokens (``max(1, unit // c)``
            consecutive segments of ``c`` tokens: a paged cache's line of keys, which a segment inside it
            costs whole): units ranked by their segments' coarse log mass (``logsumexp`` of the ranked
            scores), every segment of the best ``m // n`` units (``n`` segments each) shortlisted, then the
            best segments of the next unit up to ``m``. The rerank then reads about ``m`` segments' keys
            rather than every unit a scattered shortlist touches.
    """

    coarse: Summary = field(default_factory=lambda: PerformerFeatures(n_features=256))
    shortlist: int = 16
    factor: float = 2.0
    per_group: bool = False
    prefilter: int = field(default=0, repr=False)
    prefilter_keep: float = field(default=4.0, repr=False)
    unit: int = field(default=0, repr=False)

    reads_keys = True  # only the shortlisted segments' keys are read (a view is passed)
    #: vLLM's fused step reranks a per-group centroid shortlist so (:data:`sparseattn.vllm.route.KERNELS`).
    paged_kernel = "rerank"
    uses_top_k = True  # score() takes the step's top_k

    def __post_init__(self) -> None:
        if not isinstance(self.coarse, Summary) or isinstance(self.coarse, type):
            raise ValueError(f"Rerank.coarse must be a Summary instance, got {self.coarse!r}")
        check_int("Rerank", "shortlist", self.shortlist, 0)
        check_real("Rerank", "factor", self.factor, at_least=0)
        check_bool("Rerank", "per_group", self.per_group)
        check_int("Rerank", "prefilter", self.prefilter, 0)
        check_real("Rerank", "prefilter_keep", self.prefilter_keep, at_least=1)
        check_int("Rerank", "unit", self.unit, 0)
        if self.prefilter and not isinstance(self.coarse, Centroid):
            raise ValueError(f"Rerank.prefilter={self.prefilter} needs a Centroid coarse summary (its groups' mean keys), got {self.coarse!r}")

    def __repr__(self) -> str:  # the prefilter is shown when set: Rerank(...) as before the option existed otherwise
        extra = f", prefilter={self.prefilter}, prefilter_keep={self.prefilter_keep}" if self.prefilter else ""
        extra += f", unit={self.unit}" if self.unit else ""
        return f"Rerank(coarse={self.coarse!r}, shortlist={self.shortlist}, factor={self.factor}, per_group={self.per_group}{extra})"

    def prepare(self, kv_heads: int, head_dim: int, *, layer_idx: int, device: torch.device, dtype: torch.dtype) -> Any:
        return self.coarse.prepare(kv_heads, head_dim, layer_idx=layer_idx, device=device, dtype=dtype)

    def summarize(self, params: Any, keys: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return self.coarse.summarize(params, keys)

    def shortlist_size(self, top_k: int, n_segments: int) -> int:
        """Segments rescored exactly when the step may attend ``top_k`` per selection (its reach): ``max(shortlist,
        ceil(factor x top_k))``, at most ``n_segments``; 0 when reranking is disabled. Both engines size it here."""
        return min(max(self.shortlist, math.ceil(self.factor * top_k)), n_segments) if self.shortlist else 0

    def unit_segments(self, segment_size: int) -> int:
        """Segments of ``segment_size`` tokens per unit of the shortlist (1: single segments)."""
        return max(1, self.unit // segment_size) if self.unit else 1

    def score(
        self, params: Any, summaries: tuple[torch.Tensor, ...], queries: torch.Tensor,
        segment_keys: torch.Tensor | None, segment_size: int, top_k: int = 0,
    ) -> torch.Tensor:  # fmt: skip
        step = self.score_shortlist(params, summaries, queries, segment_keys, segment_size, top_k)
        if step is None:
            return self.coarse.score(params, summaries, queries, segment_keys if self.coarse.reads_keys else None, segment_size)
        return step.scores

    def score_shortlist(
        self, params: Any, summaries: tuple[torch.Tensor, ...], queries: torch.Tensor,
        segment_keys: torch.Tensor | None, segment_size: int, top_k: int = 0,
    ) -> Shortlist | None:  # fmt: skip
        """The coarse scores with the shortlist's exact masses in place, and the shortlist; None (before any
        work) when reranking is disabled (``shortlist = 0``)."""
        if not self.shortlist:
            return None
        coarse_keys = segment_keys if self.coarse.reads_keys else None
        scores = self.coarse.score(params, summaries, queries, coarse_keys, segment_size)  # [B, H, G, S]
        m = self.shortlist_size(top_k, scores.shape[-1])
        if m == 0:  # no segment at all: an empty shortlist
            empty = scores[..., :0]
            return Shortlist(scores, empty.long(), empty)
        if segment_keys is None:
            raise ValueError("Rerank.score needs the segments' keys")
        ranked = scores
        if self.prefilter > 1:
            scores, ranked = self._prefiltered(summaries[0], queries, scores, segment_size, m)
        if self.per_group:  # one shortlist per KV group: its keys are read once for the G query heads
            ranked = torch.logsumexp(ranked, dim=2, keepdim=True)  # [B, H, 1, S]
        if (per_unit := self.unit_segments(segment_size)) > 1:
            ranked = unit_order(ranked, per_unit)
        short = ranked.topk(m, dim=-1, sorted=False).indices  # [B, H, G', m]
        exact = segment_log_mass(segment_keys, queries, short)  # [B, H, G, m]
        # The coarse scores are shifted below the exact ones only when asked for (Shortlist.scores).
        return Shortlist(scores, short, exact)

    def _prefiltered(
        self, centroids: torch.Tensor, queries: torch.Tensor, scores: torch.Tensor, segment_size: int, m: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(scores, ranked)`` under the prefilter: each segment of a group not kept estimated from its
        group's mean key, and the scores the shortlist ranks (those segments at -inf: shortlisted only
        when the kept groups hold fewer than ``m`` segments, a short last group among them)."""
        B, H, S, D = centroids.shape
        fan = self.prefilter
        n_groups = -(-S // fan)
        means = centroids.to(scores.dtype)
        padded = torch.nn.functional.pad(means, (0, 0, 0, n_groups * fan - S)).view(B, H, n_groups, fan, D)
        counts = torch.full((n_groups,), float(fan), dtype=scores.dtype, device=scores.device)
        counts[-1] = S - (n_groups - 1) * fan
        group_means = padded.sum(3) / counts[:, None]  # [B, H, n_groups, D]: each group's mean key
        per_segment = queries.to(scores.dtype) @ group_means.transpose(-1, -2)  # [B, H, G, n_groups]
        group_rank = per_segment + torch.log(counts * segment_size)  # the group scored as one segment
        keep = min(n_groups, max(1, math.ceil(self.prefilter_keep * m / fan), -(-m // fan)))
        rank = torch.logsumexp(group_rank, dim=2, keepdim=True) if self.per_group else group_rank
        kept = torch.zeros(rank.shape, dtype=torch.bool, device=scores.device)
        kept.scatter_(-1, rank.topk(keep, dim=-1, sorted=False).indices, True)
        kept = kept.repeat_interleave(fan, dim=-1)[..., :S].expand_as(scores)  # [B, H, G, S]
        estimate = (per_segment + math.log(segment_size)).repeat_interleave(fan, dim=-1)[..., :S]
        return torch.where(kept, scores, estimate), scores.masked_fill(~kept, float("-inf"))


def unit_order(ranked: torch.Tensor, unit: int) -> torch.Tensor:
    """Scores whose top ``m`` are whole units: every segment of the best ``m // unit`` units of ``unit``
    consecutive segments (ranked by ``logsumexp`` of their scores; a short last unit as it is), then the
    best segments of the next unit. ``ranked [..., S]`` -> ``[..., S]`` of distinct whole numbers (float32,
    exact below 2^24 segments), larger first; ties to the earlier unit and segment.

    >>> unit_order(torch.tensor([0.0, 5.0, 1.0, 1.0, 4.5]), 2).topk(3).indices.tolist()  # units {0,1}, {2,3}, {4}
    [1, 0, 4]
    """
    S = ranked.shape[-1]
    n_units = -(-S // unit)
    padded = torch.nn.functional.pad(ranked.float(), (0, n_units * unit - S), value=float("-inf"))
    grouped = padded.unflatten(-1, (n_units, unit))  # [..., U, unit]
    mass = torch.logsumexp(grouped, dim=-1).nan_to_num(nan=float("-inf"))  # [..., U]
    unit_rank = ranks(mass)  # 0: the best unit
    within = ranks(grouped.nan_to_num(nan=float("-inf")))  # each segment's place in its unit
    place = (unit_rank.unsqueeze(-1) * unit + within).flatten(-2)[..., :S]
    return -place.to(torch.float32)
