"""Uniformly random segments: the "uneducated guess" ablation (Figure 7, middle)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sparseattn.validation import check_int


@dataclass(frozen=True)
class Random:
    """``k`` distinct segments drawn uniformly, per query head, from a seeded generator.

    The generator lives in the decode state (seeded from ``seed`` and the layer index), so a run is
    reproducible and layers draw independently.
    """

    seed: int = 0
    uses_scores = False

    def __post_init__(self) -> None:
        check_int("Random", "seed", self.seed, 0)
    distinct_indices = True  # topk/arange indices never repeat

    def select(self, scores: torch.Tensor, k: int, generator: torch.Generator | None) -> torch.Tensor:
        noise = torch.rand(scores.shape, generator=generator, dtype=torch.float32).to(scores.device)
        return noise.topk(min(k, scores.shape[-1]), dim=-1, sorted=False).indices
