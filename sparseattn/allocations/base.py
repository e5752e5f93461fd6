"""The ``Allocation`` protocol, and the naive reference of the pooled split."""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch


@runtime_checkable
class Allocation(Protocol):
    """Split one decode step's segments between the heads of a layer, the layer's total fixed.

    ``k`` is what the budget buys each head under a uniform split (see
    :meth:`~sparseattn.methods.segment_search.SegmentSearch.segments_for`); the layer attends
    ``k`` segments per selection on average, so the tokens attended per step still honour the budget.

    * ``uniform``: True when every head gets exactly ``k`` (the decode state then skips the plan and
      keeps its fused attention path);
    * ``width(k, n_segments)``: the most segments one head may get (``>= k``, ``<= n_segments``);
    * ``plan(estimates, log_total, k)``: ``estimates: [B, H_kv, G', w]`` the estimated log masses of
      the ``w = width(k, S)`` segments listed for each selection (its best ``w``, in any order);
      ``log_total: [B, H_kv, G']`` the log of each selection's whole estimated mass (every segment
      and the tokens every head attends anyway: sinks and tail). Returns a ``[B, H_kv, G', w]`` bool
      mask of the listed segments each selection attends, at most ``H_kv G' k`` per row (a row's
      budget is never exceeded). :func:`listed_estimates` builds the inputs from a step's scores.

    The plan sees only each selection's listed segments and one total, unordered: what a pooled
    split needs, and what a decode state produces without sorting (a shortlisting summary lists its
    shortlist, ranked against nothing else).
    """

    uniform: bool

    def width(self, k: int, n_segments: int) -> int: ...

    def plan(self, estimates: torch.Tensor, log_total: torch.Tensor, k: int) -> torch.Tensor: ...


def log_total_mass(scores: torch.Tensor, always_mass: torch.Tensor) -> torch.Tensor:
    """``log(sum_s exp(scores[..., s]) + exp(always_mass))``, ``[B, H, G']``, in float32 or wider:
    a selection's whole estimated mass, an allocation's ``log_total``."""
    s = scores if scores.dtype == torch.float64 else scores.float()
    return torch.logaddexp(torch.logsumexp(s, dim=-1), always_mass.to(s.dtype))


def listed_estimates(scores: torch.Tensor, always_mass: torch.Tensor, width: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """An allocation's inputs from a step's scores: ``(estimates, log_total, segments)``.

    ``scores: [B, H, G', S]`` segment log-mass estimates; ``always_mass: [B, H, G']`` the log mass of
    the always-attended tokens. ``segments`` are each selection's best ``width`` segments (in no
    particular order), ``estimates`` their scores, ``log_total`` as :func:`log_total_mass`.
    """
    top = scores.topk(width, dim=-1, sorted=False)
    return top.values, log_total_mass(scores, always_mass), top.indices


def pooled_counts_ref(scores: torch.Tensor, always_mass: torch.Tensor, k: int, width: int, floor: int) -> torch.Tensor:
    """Reference for :class:`~sparseattn.allocations.PooledMass`: a greedy loop in float64.

    Each head first takes its ``floor`` best segments; then, one at a time, the layer's remaining
    slots go to the (head, segment) with the highest share of its head's estimated mass
    ``exp(score - log Z_head)``, ``Z_head`` counting every segment and the always-attended tokens,
    until ``H G' k`` segments are taken (no head beyond ``width``).
    """
    B, H, G, S = scores.shape
    s = scores.double()
    log_z = torch.logaddexp(torch.logsumexp(s, dim=-1), always_mass.double())
    share = s - log_z[..., None]
    counts = torch.zeros(B, H, G, dtype=torch.long, device=scores.device)
    for b in range(B):
        ranked = [sorted(share[b, h, g].tolist(), reverse=True)[:width] for h in range(H) for g in range(G)]
        taken = [min(floor, len(r)) for r in ranked]
        for _ in range(H * G * k - sum(taken)):
            best = max((r[n], i) for i, (r, n) in enumerate(zip(ranked, taken)) if n < len(r))
            taken[best[1]] += 1
        counts[b] = torch.tensor(taken).view(H, G)
    return counts
