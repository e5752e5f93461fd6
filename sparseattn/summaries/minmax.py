"""Quest's summary: per-channel min/max keys, an upper bound of every logit in the segment."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from sparseattn.summaries.base import bound_scores


@dataclass(frozen=True)
class MinMaxBound:
    """Score = ``log c + sum_i max(q_i min_i, q_i max_i)`` (Tang et al. 2024, Quest).

    ``sum_i max(q_i min_i, q_i max_i) >= q . k_j`` for every key of the segment, so the score is
    an upper bound of the log attention mass. O(d) per segment.
    """

    reads_keys = False
    #: vLLM's fused step computes this bound (:data:`sparseattn.vllm.route.KERNELS`; this class's own).
    paged_kernel = "bound"

    def prepare(self, kv_heads: int, head_dim: int, *, layer_idx: int, device: torch.device, dtype: torch.dtype) -> None:
        return None

    def summarize(self, params: None, keys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return keys.amin(dim=-2), keys.amax(dim=-2)

    def score(
        self,
        params: None,
        summaries: tuple[torch.Tensor, torch.Tensor],
        queries: torch.Tensor,
        segment_keys: torch.Tensor | None,
        segment_size: int,
    ) -> torch.Tensor:
        low, high = summaries  # [B, H, S, D]
        # Two products per KV group (max(q, 0) . high + min(q, 0) . low), by a kernel on CUDA:
        # no [B, H, G, S, D] temporary (a gigabyte per step at 128k tokens, batch 8).
        return bound_scores(low, high, queries).add_(math.log(segment_size))
