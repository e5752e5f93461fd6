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
    * ``plan(scores, always_mass, k)``: ``scores: [B, H_kv, G', S]`` the step's segment log-mass
      estimates, ``always_mass: [B, H_kv, G']`` the log attention mass of the tokens every head
      attends anyway (sinks and tail); returns ``[B, H_kv, G']`` long counts in ``[0, width]``
      whose sum over a row's heads is ``H_kv G' k`` (a row's budget is never exceeded).
    """

    uniform: bool

    def width(self, k: int, n_segments: int) -> int: ...

    def plan(self, scores: torch.Tensor, always_mass: torch.Tensor, k: int) -> torch.Tensor: ...


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
    counts = torch.zeros(B, H, G, dtype=torch.long)
    for b in range(B):
        ranked = [sorted(share[b, h, g].tolist(), reverse=True)[:width] for h in range(H) for g in range(G)]
        taken = [min(floor, len(r)) for r in ranked]
        for _ in range(H * G * k - sum(taken)):
            best = max((r[n], i) for i, (r, n) in enumerate(zip(ranked, taken)) if n < len(r))
            taken[best[1]] += 1
        counts[b] = torch.tensor(taken).view(H, G)
    return counts
