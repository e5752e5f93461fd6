"""Mean and per-channel spread of a segment's keys: a second-order estimate of its log attention mass."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

_SPREAD_DTYPES = (None, torch.bfloat16, torch.float16, torch.float32, torch.float64)


@dataclass(frozen=True, repr=False)
class CentroidSpread:
    """Score = ``log c + q . mean_j k_j + 1/2 sum_d q_d^2 var_j(k_jd)``.

    The log mass of a segment is ``log c + log mean_j exp(l_j)`` with logits ``l_j = q . k_j``; the cumulant
    expansion of ``log mean exp`` is ``kappa_1 + kappa_2 / 2 + ...``, with ``kappa_1 = q . mean k`` (what
    :class:`~sparseattn.summaries.Centroid` scores: Jensen's lower bound, tight when the logits are equal) and
    ``kappa_2`` the logits' variance, ``q^T Cov(k) q``. This summary keeps the diagonal of the covariance (``d``
    numbers per segment, as many as the mean): a segment whose keys spread along the query's strong channels
    holds more mass than its mean says, which is where a centroid shortlist misses segments a head needs.
    Neither a lower nor an upper bound (exact for Gaussian logits with a diagonal key covariance).

    On the default model it cut the ranking's share of what radar+adaptive lost against the exact pooled oracle
    by about three quarters at the same shortlist (``benchmarks/selection_gap.py``; docs/methods.md). vLLM's
    fused step does not run it: with it a method runs on the paged engine's generic path.

    Args:
        dtype: storage of the means and variances (None: the compute dtype); each is taken in float64 and
            rounded once, as :class:`~sparseattn.summaries.Centroid` rounds its means.
    """

    dtype: torch.dtype | None = None
    reads_keys = False

    def __post_init__(self) -> None:
        if self.dtype not in _SPREAD_DTYPES:
            raise ValueError(f"CentroidSpread.dtype must be one of {_SPREAD_DTYPES}, got {self.dtype!r}")

    def __repr__(self) -> str:
        return "CentroidSpread()" if self.dtype is None else f"CentroidSpread(dtype={self.dtype})"

    def prepare(self, kv_heads: int, head_dim: int, *, layer_idx: int, device: torch.device, dtype: torch.dtype) -> None:
        return None

    def summarize(self, params: None, keys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        wide = keys.to(torch.float64)
        mean, var = wide.mean(dim=-2), wide.var(dim=-2, unbiased=False)
        dtype = keys.dtype if self.dtype is None else self.dtype
        return mean.to(dtype), var.to(dtype)

    def score(
        self, params: None, summaries: tuple[torch.Tensor, torch.Tensor], queries: torch.Tensor,
        segment_keys: torch.Tensor | None, segment_size: int,
    ) -> torch.Tensor:  # fmt: skip
        mean, var = (s.to(queries.dtype) for s in summaries)
        return queries @ mean.transpose(-1, -2) + 0.5 * (queries * queries) @ var.transpose(-1, -2) + math.log(segment_size)
