"""The most recent segments: extending the sliding window (the paper's recency baseline)."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Recent:
    """The last ``k`` sealed segments, whatever the scores."""

    uses_scores = False
    distinct_indices = True  # topk/arange indices never repeat

    def select(self, scores: torch.Tensor, k: int, generator: torch.Generator | None) -> torch.Tensor:
        n = scores.shape[-1]
        picked = torch.arange(n - min(k, n), n, device=scores.device)
        return picked.expand(*scores.shape[:-1], picked.numel())
