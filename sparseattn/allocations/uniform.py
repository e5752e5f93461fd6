"""Every head attends the same number of segments: the split every segment search used before allocation parts."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Uniform:
    """``k`` segments for every head (the default)."""

    uniform = True

    def width(self, k: int, n_segments: int) -> int:
        return min(k, n_segments)

    def plan(self, scores: torch.Tensor, always_mass: torch.Tensor, k: int) -> torch.Tensor:
        return torch.full(scores.shape[:3], min(k, scores.shape[-1]), dtype=torch.long, device=scores.device)
