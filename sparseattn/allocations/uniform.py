"""Every head attends the same number of segments: the split every segment search used before allocation parts."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from sparseattn.allocations.base import Selection

if TYPE_CHECKING:
    from sparseattn.allocations.step import SearchStep


@dataclass(frozen=True)
class Uniform:
    """``k`` segments for every head (the default): each selection attends the selector's ``k`` picks, whole
    segments, so the step runs a backend's fused segment kernel."""

    uniform = True
    #: vLLM's fused step splits so in C (:data:`sparseattn.vllm.route.KERNELS`).
    paged_kernel = "uniform"

    def select_segments(self, step: SearchStep) -> Selection:
        return Selection(step.picks(step.k))

    def width(self, k: int, n_segments: int) -> int:
        return min(k, n_segments)

    def plan(self, estimates: torch.Tensor, log_total: torch.Tensor, k: int) -> torch.Tensor:
        w = estimates.shape[-1]
        if w <= k:
            return torch.ones(estimates.shape, dtype=torch.bool, device=estimates.device)
        top = estimates.nan_to_num(nan=float("-inf")).topk(k, dim=-1, sorted=False).indices  # each selection's best k
        return torch.zeros(estimates.shape, dtype=torch.bool, device=estimates.device).scatter_(-1, top, True)
