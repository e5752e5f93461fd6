"""Random features of keys centred on their segment's mean: the centroid is scored exactly."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from sparseattn.summaries.performer import PerformerFeatures


@dataclass(frozen=True)
class CenteredFeatures:
    """Score = ``q . mu_s + log(phi(q) . sum_j phi(k_j - mu_s))`` with ``mu_s`` the segment's mean key.

    Exact rewriting of the segment mass: ``sum_j exp(q . k_j) = exp(q . mu_s) sum_j exp(q . (k_j - mu_s))``,
    so the centroid part is computed exactly and the random features (Lemma 1: unbiased) estimate only
    the within-segment spread. Theorem 1's variance term grows like ``exp(|k'|^2)``; here ``|k' - mu'|``
    replaces ``|k'|``, which for real keys (large shared components, e.g. outlier channels) is far
    smaller, while the estimate of the (exp of the) score stays unbiased. Costs ``d`` more numbers per
    segment and one ``d``-dot product per segment and query.

    Args:
        features: the random features applied to the centred keys.
    """

    features: PerformerFeatures = field(default_factory=PerformerFeatures)

    reads_keys = False

    def __post_init__(self) -> None:
        if not isinstance(self.features, PerformerFeatures):
            raise ValueError(f"CenteredFeatures.features must be a PerformerFeatures, got {self.features!r}")

    def prepare(self, kv_heads: int, head_dim: int, *, layer_idx: int, device: torch.device, dtype: torch.dtype):
        return self.features.prepare(kv_heads, head_dim, layer_idx=layer_idx, device=device, dtype=dtype)

    def summarize(self, omega: torch.Tensor, keys: torch.Tensor) -> tuple[torch.Tensor, ...]:
        centre = keys.mean(dim=-2)  # [B, H, S, D]
        return (centre, *self.features.summarize(omega, keys - centre.unsqueeze(-2)))

    def score(self, omega, summaries, queries: torch.Tensor, segment_keys, segment_size: int) -> torch.Tensor:
        centre, *rest = summaries
        residual = self.features.score(omega, tuple(rest), queries, None, segment_size)  # [B, H, G, S]
        return residual + queries @ centre.transpose(-1, -2)
