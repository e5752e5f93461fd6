"""Top-p selection: each head attends the fewest segments whose estimated share of its attention mass reaches ``p``.

Twilight (Lin et al. 2025) observes that a fixed top-k is wrong both ways: a peaked head needs far
fewer than ``k`` tokens to hold most of its attention, a diffuse one more. It selects, per head and
step, the smallest set whose attention mass reaches a threshold ``p``. Here the masses are the
summary's log-mass estimates (exact with :class:`~sparseattn.summaries.ExactScore`), the sinks and
the tail count towards ``p`` (every head attends them anyway), and the budget caps the set: a head
never attends more than the ``k`` segments a uniform split gives it, so ``budget`` keeps its meaning
as a ceiling and a peaked head simply attends less.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from sparseattn.allocations.base import Selection, log_total_mass
from sparseattn.validation import check_number

if TYPE_CHECKING:
    from sparseattn.allocations.step import SearchStep


def top_p_mask(estimates: torch.Tensor, log_always: torch.Tensor | None, log_total: torch.Tensor, p: float) -> torch.Tensor:
    """``[..., w]`` bool: of each row's listed segments, the fewest with the largest estimates whose shares,
    with the always-attended tokens' share (``log_always``, None: counted as not attended), reach ``p``.

    ``estimates: [..., w]`` log masses, ``log_always, log_total: [...]`` log masses. All ``w`` when even
    they fall short (the cap binds). A row with a non-finite total attends none of its listed segments
    (its output is NaN anyway, as in dense attention).
    """
    work = torch.float64 if estimates.dtype == torch.float64 else torch.float32
    ranked, order = estimates.to(work).sort(dim=-1, descending=True)
    total = log_total.to(work)[..., None]
    shares = (ranked - total).exp()
    before = shares.cumsum(dim=-1) - shares  # the listed share already attended before each segment
    if log_always is not None:
        before = before + (log_always.to(work)[..., None] - total).exp()
    keep = (before < p) & torch.isfinite(total)  # a segment is taken while the set is still short of p
    return torch.zeros_like(keep).scatter(-1, order, keep)


@dataclass(frozen=True)
class TopP:
    """Each selection attends the fewest of its best ``k`` segments whose estimated mass, with the sinks'
    and the tail's, reaches a share ``p`` of its whole estimated attention mass.

    ``k`` is the uniform split's (what the budget buys): the cap. A head whose sinks and window hold
    ``p`` already attends no segment; one whose mass is spread over more than ``k`` segments attends
    ``k``. Selections are independent (no pooling between heads), so every head honours the budget.

    Args:
        p: the share of attention mass to reach, in (0, 1).
    """

    p: float = 0.95

    uniform = False

    def __post_init__(self) -> None:
        check_number("TopP", "p", self.p, "a number in (0, 1)", lambda v: 0.0 < v < 1.0)

    def width(self, k: int, n_segments: int) -> int:
        return min(k, n_segments)

    def select_segments(self, step: SearchStep) -> Selection:
        w = self.width(step.k, step.layout.n_segments)
        scores, estimates, segments = step.scored_picks(w)
        always = step.always_log_mass()  # [B, H_kv, G']: the sinks and the tail, attended by every head
        return Selection(segments, top_p_mask(estimates, always, log_total_mass(scores, always), self.p))

    def plan(self, estimates: torch.Tensor, log_total: torch.Tensor, k: int) -> torch.Tensor:
        """The allocation protocol's plan (token refinement calls it): the always-attended share is not
        among its inputs, so it counts as not attended (the set reaches ``p`` without it: never smaller)."""
        return top_p_mask(estimates, None, log_total, self.p)
