"""Radar's summary: the mean positive random feature of a segment (Radar Eq. 4-5)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from sparseattn.ops.features import draw_projection, log_positive_features

_FEATURE_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


@dataclass(frozen=True)
class PerformerFeatures:
    """Segment summary ``sum_j phi(k_j)`` with phi(x) = exp(Omega x - ||x||^2/2) / sqrt(n).

    The paper stores the mean ``mean_j phi(k_j)``; we store the sum (c times the mean, the same
    ranking for equal segments), so that ``log(phi(q) . sum_j phi(k_j))`` is directly an estimate of
    the segment's log attention mass, unbiased before the log (Lemma 1).

    Storage is log-space with a max-shift per segment: ``summary = exp(L - m)`` in ``feature_dtype``
    (entries in [0, 1]) and the shift ``m`` in float32/64, where ``L = logsumexp_j log phi(k_j)``.
    Scoring is one matmul ``exp(b - max b) @ summary^T`` plus the shifts; when that product underflows
    (very large key norms) the affected scores are recomputed exactly with a logsumexp.

    Omega is drawn once per layer and per KV head from ``seed`` and the layer index
    (:func:`sparseattn.ops.features.draw_projection`); the query heads of a KV group share it,
    because their features must live in the same space as that head's keys.

    Args:
        n_features: n, the feature dimension (paper default 2048).
        orthogonal: draw Omega as Performer's orthogonal random features (same mean, variance no larger).
        antithetic: use the pairs +-omega (n/2 draws): still unbiased, as the reference code does.
        seed: seed of Omega; layers draw independent matrices from it.
        feature_dtype: storage dtype of the normalised summaries.
    """

    n_features: int = 2048
    orthogonal: bool = False
    antithetic: bool = False
    seed: int = 0
    feature_dtype: torch.dtype = torch.float32

    reads_keys = False

    def __post_init__(self) -> None:
        if self.n_features < 1:
            raise ValueError(f"PerformerFeatures.n_features must be >= 1, got {self.n_features}")
        if self.antithetic and self.n_features % 2:
            raise ValueError(f"PerformerFeatures.n_features must be even with antithetic=True, got {self.n_features}")
        if self.feature_dtype not in _FEATURE_DTYPES:
            raise ValueError(f"PerformerFeatures.feature_dtype must be one of {_FEATURE_DTYPES}, got {self.feature_dtype}")

    def prepare(self, kv_heads: int, head_dim: int, *, layer_idx: int, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
        n_draws = self.n_features // 2 if self.antithetic else self.n_features
        omega = draw_projection(
            kv_heads, n_draws, head_dim, orthogonal=self.orthogonal, seed=self.seed, layer_idx=layer_idx
        )
        return omega.to(device=device, dtype=dtype)

    def log_features(self, omega: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """``log phi(x)`` including the 1/sqrt(n) factor: ``[B, H, ..., D] -> [B, H, ..., n]``."""
        return log_positive_features(x, omega, antithetic=self.antithetic) - 0.5 * math.log(self.n_features)

    def summarize(self, omega: torch.Tensor, keys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # Sum (not mean) over the segment, so the score is a log-mass without knowing c.
        log_sum = torch.logsumexp(self.log_features(omega, keys), dim=-2)  # [B, H, S, n]
        shift = log_sum.amax(dim=-1)  # [B, H, S]
        return torch.exp(log_sum - shift.unsqueeze(-1)).to(self.feature_dtype), shift

    def score(
        self,
        omega: torch.Tensor,
        summaries: tuple[torch.Tensor, torch.Tensor],
        queries: torch.Tensor,
        segment_keys: torch.Tensor | None,
        segment_size: int,
    ) -> torch.Tensor:
        normalised, shift = summaries
        log_q = self.log_features(omega, queries)  # [B, H, G, n]
        q_shift = log_q.amax(dim=-1, keepdim=True)
        feats = normalised.to(queries.dtype)
        raw = torch.exp(log_q - q_shift) @ feats.transpose(-1, -2)  # [B, H, G, S]
        scores = torch.log(raw) + q_shift + shift.unsqueeze(-2)
        underflow = raw < torch.finfo(raw.dtype).tiny * 2**10
        if bool(underflow.any()):
            exact = torch.logsumexp(log_q.unsqueeze(-2) + torch.log(feats).unsqueeze(-3), dim=-1)
            scores = torch.where(underflow, exact + shift.unsqueeze(-2), scores)
        return scores
