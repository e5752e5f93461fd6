"""Performer positive random features, in log space (Choromanski et al. 2021; Radar Eq. random-feature).

phi(x) = exp(Omega x - ||x||^2 / 2) / sqrt(n) overflows fp16 for ||x|| around 4 and fp32 around 13;
we therefore never exponentiate here and return the exponents. Callers max-shift before ``exp``.
"""

from __future__ import annotations

import math

import torch

from sparseattn.seeding import feature_generator


def draw_projection(
    heads: int,
    n_draws: int,
    head_dim: int,
    *,
    orthogonal: bool = False,
    seed: int = 0,
    layer_idx: int = 0,
) -> torch.Tensor:
    """Draw the random projection Omega, one independent matrix per KV head.

    Returns ``[heads, n_draws, head_dim]`` float64 on CPU. Rows are i.i.d. N(0, I) or, with
    ``orthogonal``, Performer's orthogonal random features: blocks of ``head_dim`` rows that are
    exactly orthogonal (Haar-random rotation from a sign-corrected QR), each row rescaled to the norm
    of an independent Gaussian vector so that every row is still marginally N(0, I).
    """
    g = feature_generator(seed, layer_idx)
    if not orthogonal:
        return torch.randn(heads, n_draws, head_dim, generator=g, dtype=torch.float64)
    n_blocks = math.ceil(n_draws / head_dim)
    gauss = torch.randn(heads, n_blocks, head_dim, head_dim, generator=g, dtype=torch.float64)
    q, r = torch.linalg.qr(gauss)
    q = q * torch.sign(torch.diagonal(r, dim1=-2, dim2=-1)).unsqueeze(-2)  # Haar measure
    rows = q.transpose(-1, -2)  # rows of an orthogonal matrix
    norms = torch.randn(heads, n_blocks, head_dim, head_dim, generator=g, dtype=torch.float64).norm(dim=-1)
    rows = rows * norms.unsqueeze(-1)
    return rows.reshape(heads, n_blocks * head_dim, head_dim)[:, :n_draws]


def log_positive_features(x: torch.Tensor, omega: torch.Tensor, *, antithetic: bool = False) -> torch.Tensor:
    """Log of the positive random features of ``x``, without the 1/sqrt(n) factor.

    Args:
        x: ``[B, H, ..., D]``, already scaled so that attention logits are plain dot products
            (the paper's k' = k / d^(1/4)).
        omega: ``[H, m, D]``, one projection per head.
        antithetic: also use -omega, giving n = 2m features exp(+-omega.x - ||x||^2/2).

    Returns:
        ``[B, H, ..., n]``: ``omega_i . x - ||x||^2 / 2``; ``exp`` of it averages to exp(u.v) in
        products (Lemma 1).
    """
    B, H, D = x.shape[0], x.shape[1], x.shape[-1]
    # One batched GEMM per head over all leading positions (faster than the equivalent einsum on CPU).
    proj = torch.matmul(x.reshape(B, H, -1, D), omega.transpose(-1, -2)).reshape(*x.shape[:-1], omega.shape[1])
    half_sq = 0.5 * (x * x).sum(-1, keepdim=True)
    if antithetic:
        proj = torch.cat([proj, -proj], dim=-1)
    return proj - half_sq
