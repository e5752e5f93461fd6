"""Highest-scoring segments: Radar's selection (Algorithm 1, line 19)."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class TopK:
    """The ``k`` segments with the highest scores."""

    uses_scores = True
    distinct_indices = True  # topk/arange indices never repeat
    picks_best = True  # its picks are the best: a step may read them off a shortlist
    #: vLLM's fused step selects so (:data:`sparseattn.vllm.route.KERNELS`; ties to the earlier segments).
    paged_kernel = "top_k"

    def select(self, scores: torch.Tensor, k: int, generator: torch.Generator | None) -> torch.Tensor:
        return scores.topk(min(k, scores.shape[-1]), dim=-1, sorted=False).indices
