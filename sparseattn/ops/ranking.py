"""Ranks along a dimension: where a fixed-shape step needs "the first n" with ``n`` a device tensor (a top-n whose
size changes from step to step cannot keep one shape), it ranks once and compares the ranks with ``n``."""

from __future__ import annotations

import torch


def ranks(x: torch.Tensor) -> torch.Tensor:
    """Each entry's place along the last dim, 0 for the largest; ties to the earlier entry (a stable sort).

    >>> ranks(torch.tensor([0.5, 2.0, 0.5, -1.0])).tolist()
    [1, 0, 2, 3]
    """
    order = x.argsort(dim=-1, descending=True, stable=True)
    placed = torch.empty_like(order)
    return placed.scatter_(-1, order, torch.arange(x.shape[-1], device=x.device).expand_as(order))
