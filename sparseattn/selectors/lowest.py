"""Lowest-scoring segments: the paper's sanity ablation (Figure 7, left)."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Lowest:
    """The ``k`` segments with the lowest scores: should behave like dropping the middle context."""

    uses_scores = True
    distinct_indices = True  # topk/arange indices never repeat

    def select(self, scores: torch.Tensor, k: int, generator: torch.Generator | None) -> torch.Tensor:
        return scores.topk(min(k, scores.shape[-1]), dim=-1, largest=False, sorted=False).indices
