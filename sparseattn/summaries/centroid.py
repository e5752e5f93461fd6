"""Mean-key summary: a Jensen lower bound of the segment's log attention mass."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Centroid:
    """Score = ``log c + q . mean_j k_j``.

    By Jensen's inequality ``log sum_j exp(q.k_j) >= log c + q . mean_j k_j``: a lower bound,
    tight when the segment's logits are equal. O(d) per segment.
    """

    reads_keys = False

    def prepare(self, kv_heads: int, head_dim: int, *, layer_idx: int, device: torch.device, dtype: torch.dtype) -> None:
        return None

    def summarize(self, params: None, keys: torch.Tensor) -> tuple[torch.Tensor]:
        return (keys.mean(dim=-2),)

    def score(
        self,
        params: None,
        summaries: tuple[torch.Tensor],
        queries: torch.Tensor,
        segment_keys: torch.Tensor | None,
        segment_size: int,
    ) -> torch.Tensor:
        (centroids,) = summaries
        return queries @ centroids.transpose(-1, -2) + math.log(segment_size)
