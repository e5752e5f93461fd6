"""Quest's per-segment logit bound (torch op and reference).

A segment summarised by its keys' channel-wise minimum ``low`` and maximum ``high`` bounds every
logit in it: ``q . k <= sum_i max(q_i low_i, q_i high_i)`` (Tang et al. 2024). Because
``high_i >= low_i``, the larger of the two products is ``q_i high_i`` where ``q_i >= 0`` and
``q_i low_i`` where ``q_i < 0``, so the bound is two matrix products,
``max(q, 0) . high + min(q, 0) . low``: :func:`bound_scores` computes it that way (no
``[B, H, G, S, D]`` temporary), :func:`bound_scores_ref` from the definition in float64.
"""

from __future__ import annotations

import torch


def bound_scores(low: torch.Tensor, high: torch.Tensor, queries: torch.Tensor) -> torch.Tensor:
    """``sum_i max(q_i low_i, q_i high_i)`` for ``queries: [B, H, G, D]`` over ``low, high: [B, H, S, D]``.

    Returns ``[B, H, G, S]`` in the queries' dtype (the summaries are converted to it).

    Example:
        >>> low, high = torch.tensor([[[[-1.0, 0.0]]]]), torch.tensor([[[[2.0, 3.0]]]])
        >>> bound_scores(low, high, torch.tensor([[[[1.0, -1.0]]]]))  # 1 * 2 + (-1) * 0
        tensor([[[[2.]]]])
    """
    positive, negative = queries.clamp(min=0), queries.clamp(max=0)
    high, low = high.to(queries.dtype), low.to(queries.dtype)
    return torch.matmul(positive, high.transpose(-1, -2)).add_(torch.matmul(negative, low.transpose(-1, -2)))


def bound_scores_ref(low: torch.Tensor, high: torch.Tensor, queries: torch.Tensor) -> torch.Tensor:
    """Reference for :func:`bound_scores`: the definition, elementwise, in float64. Returns ``[B, H, G, S]``."""
    q = queries.double().unsqueeze(-2)  # [B, H, G, 1, D]
    return torch.maximum(q * low.double().unsqueeze(2), q * high.double().unsqueeze(2)).sum(-1)
