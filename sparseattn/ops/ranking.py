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


def top_within(x: torch.Tensor, widest: int, narrowest: int, n: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(values, indices, among)``: the ``widest`` largest entries of ``x`` along the last dim (in no order), and which
    of them are among the ``n`` largest, ``n`` a 0-d device tensor from ``narrowest`` to ``widest`` (a top-n whose
    size changes from step to step, in one shape). Only the ``widest - narrowest`` smallest of them are ranked: a
    sorted top-n of them all costs ~10x an unsorted one on the CPU.

    >>> values, indices, among = top_within(torch.tensor([0.1, 3.0, 2.0, -1.0, 5.0]), 4, 2, torch.tensor(3))
    >>> sorted(indices[among].tolist())  # the 3 largest of the 4 listed
    [1, 2, 4]
    """
    top = x.topk(widest, dim=-1, sorted=False)
    among = torch.ones(top.values.shape, dtype=torch.bool, device=x.device)
    spare = widest - narrowest
    if spare:
        smallest = top.values.topk(spare, dim=-1, largest=False, sorted=True).indices  # the listed ones, least first
        dropped = torch.arange(spare, device=x.device) < widest - n  # the widest - n least are not among the n
        among.scatter_(-1, smallest, ~dropped.expand_as(smallest))
    return top.values, top.indices, among
