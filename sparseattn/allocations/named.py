"""An allocation named by a preset's options: ``split="uniform" | "pooled" | "topp"`` with its numbers, or a part."""

from __future__ import annotations

from sparseattn.allocations.base import Allocation
from sparseattn.allocations.pooled import PooledMass
from sparseattn.allocations.topp import TopP
from sparseattn.allocations.uniform import Uniform


def named_allocation(
    split: str | Allocation, allocation: Allocation | None, cap: float | None, floor: float | None, default_cap: float,
    p: float | None = None,
) -> Allocation:  # fmt: skip
    """The :class:`Allocation` part ``split`` names (``cap``/``floor`` only with ``"pooled"``, ``p`` only with ``"topp"``)."""
    if allocation is not None:
        if split != "uniform":
            raise ValueError(f"give split or allocation, not both (split={split!r}, allocation={allocation!r})")
        split = allocation
    if isinstance(split, Allocation):
        part = split
    elif split == "uniform":
        part = Uniform()
    elif split == "pooled":
        if p is not None:
            raise ValueError(f"p shapes the 'topp' split; split is {split!r}")
        return PooledMass(cap=default_cap if cap is None else cap, floor=0.25 if floor is None else floor)
    elif split == "topp":
        if cap is not None or floor is not None:
            raise ValueError(f"cap and floor shape the 'pooled' split; split is {split!r}")
        return TopP(0.95 if p is None else p)
    else:
        raise ValueError(f"split must be 'uniform', 'pooled', 'topp' or an Allocation part, got {split!r}")
    if p is not None:
        raise ValueError(f"p shapes the 'topp' split; split is {split!r}")
    if cap is not None or floor is not None:
        raise ValueError(f"cap and floor shape the 'pooled' split; split is {split!r}")
    return part
