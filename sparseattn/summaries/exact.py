"""The oracle summary: the true segment attention mass (the paper's "exact segment search" ablation)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sparseattn.summaries.base import scaled_keys


@dataclass(frozen=True)
class ExactScore:
    """Score = ``logsumexp_{j in segment} q . k_j``, read from the keys themselves.

    Stores nothing and costs O(t) per step: it is the upper limit of what any summary can find,
    not a fast method.
    """

    reads_keys = True

    def prepare(self, kv_heads: int, head_dim: int, *, layer_idx: int, device: torch.device, dtype: torch.dtype) -> None:
        return None

    def summarize(self, params: None, keys: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return ()

    def score(
        self, params: None, summaries: tuple[torch.Tensor, ...], queries: torch.Tensor,
        segment_keys: torch.Tensor | None, segment_size: int,
    ) -> torch.Tensor:  # fmt: skip
        if segment_keys is None:
            raise ValueError("ExactScore.score needs the segments' keys")
        return torch.logsumexp(torch.einsum("bhgd,bhscd->bhgsc", queries, scaled_keys(segment_keys)), dim=-1)
