"""Per-head budgets from the pooled attention mass (the idea of adaptive head budgets, e.g. Ada-KV)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from sparseattn.allocations.base import Selection, split_segments, within_budget
from sparseattn.ops.ranking import top_within
from sparseattn.validation import check_real

if TYPE_CHECKING:
    from sparseattn.allocations.step import SearchStep


@dataclass(frozen=True)
class PooledMass:
    """Give the layer's segments to the heads where they hold the largest share of attention mass.

    Each head's segment scores become shares of its own estimated mass, ``score - log Z_head`` with
    ``Z_head`` summing every segment's estimate and the always-attended tokens' exact mass. All heads'
    shares are pooled per batch row and the best ``H x k`` taken: a head whose attention is peaked on
    a few segments (or on the sinks and the window) needs few, a diffuse head gets more. Taking the
    largest shares maximises the summed fraction of each head's mass that is attended, under the
    layer's total, which is what a uniform split cannot do when heads differ.

    Guards: every head keeps at least ``floor x k`` of its best segments (estimates can be wrong),
    and none gets more than ``cap x k``.

    The heads of a batch row share its budget, so what one head's scores say moves the others'
    split: a non-finite key or query in one KV head (whose output is NaN, as in dense attention)
    leaves that head its floor and changes the other heads' counts, not their finiteness. Batch rows
    stay independent.

    With a summary whose scores are not comparable log masses across heads the split follows them
    anyway: :class:`~sparseattn.summaries.Rerank` pushes its unshortlisted segments below the
    shortlist, so their estimates (and ``Z_head``) are lower bounds.

    Args:
        cap: the most segments one head may get, as a multiple of the uniform ``k`` (>= 1).
        floor: the fewest, as a fraction of ``k`` (0 to 1).
    """

    cap: float = 4.0
    floor: float = 0.25

    uniform = False
    #: vLLM's fused step pools so in C (:data:`sparseattn.vllm.route.KERNELS`).
    paged_kernel = "pooled"

    def __post_init__(self) -> None:
        check_real("PooledMass", "cap", self.cap, at_least=1)
        check_real("PooledMass", "floor", self.floor, at_least=0)
        if self.floor > 1:
            raise ValueError(f"PooledMass.floor must be in [0, 1] (a fraction of the uniform k), got {self.floor!r}")

    def width(self, k: int, n_segments: int) -> int:
        return min(n_segments, max(k, math.ceil(self.cap * k)))

    def select_segments(self, step: SearchStep) -> Selection:
        return split_segments(self, step)

    def floor_count(self, k: int) -> int:
        return min(k, math.ceil(self.floor * k))

    @within_budget  # exactly min(H G k, H G w) shares per row, the floors among them (tests/test_allocation.py)
    def plan(self, estimates: torch.Tensor, log_total: torch.Tensor, k: int) -> torch.Tensor:
        B, H, G, w = estimates.shape
        share = estimates.float() - log_total.float()[..., None]  # [B, H, G, w]: each listed segment's share
        # A head with a NaN/inf score or always-mass (a non-finite key or query: its output is NaN anyway)
        # ranks last: it keeps its floor and cannot take the layer's slots (topk ranks NaN first).
        share = share.nan_to_num(nan=float("-inf"), posinf=float("-inf"))
        floor = min(self.floor_count(k), w)
        if floor:  # each head's best `floor` are taken first
            share.scatter_(-1, share.topk(floor, dim=-1, sorted=False).indices, float("inf"))
        # The row's H*G*k largest shares. Within a head a share is its estimate minus one constant, so
        # what a head gets is always its best listed segments: no sort is needed.
        total = min(H * G * k, H * G * w)
        taken = torch.zeros(B, H * G * w, dtype=torch.bool, device=estimates.device)
        taken.scatter_(1, share.reshape(B, -1).topk(total, dim=-1, sorted=False).indices, True)
        return taken.view(B, H, G, w)

    def plan_fixed(
        self, estimates: torch.Tensor, log_total: torch.Tensor, k: torch.Tensor, listed: torch.Tensor, k_bounds: tuple[int, int]
    ) -> torch.Tensor:  # fmt: skip
        """:meth:`plan` in fixed shapes (:class:`~sparseattn.allocations.base.FixedShapePlan`): ``k`` a 0-d long device
        tensor within ``k_bounds = (least, most)``, and only the columns ``listed`` flags (bool, ``[w]`` or the
        estimates' shape) are the step's own listing. The same shares, floors and total, each a top-n of the widest
        size the bounds allow of which the least are dropped (:func:`~sparseattn.ops.ranking.top_within`); nothing
        is read back to the host. Flags what :meth:`plan` flags over the listed columns (tests/test_allocation.py)."""
        B, H, G, w = estimates.shape
        least, most = k_bounds
        share = estimates.float() - log_total.float()[..., None]
        # A non-finite share ranks last as in plan, but above the columns not listed, which are never taken.
        low = torch.finfo(share.dtype).min
        share = share.nan_to_num(nan=low, posinf=low, neginf=low).masked_fill(~listed, float("-inf"))
        widest = min(self.floor_count(most), w)
        if widest:  # each head's best floor_count(k) first
            floor = torch.minimum(k, torch.ceil(self.floor * k.double()).long())  # floor_count(k), on the device
            _, best, among = top_within(share, widest, min(self.floor_count(least), w), floor)
            share = share.masked_fill(torch.zeros_like(share, dtype=torch.bool).scatter_(-1, best, among), float("inf"))
        # The row's H G k largest shares (k <= the listed width: only listed columns are taken).
        _, best, among = top_within(share.reshape(B, -1), H * G * most, H * G * least, H * G * k)
        taken = torch.zeros(B, H * G * w, dtype=torch.bool, device=share.device).scatter_(-1, best, among)
        return taken.view(B, H, G, w) & listed
