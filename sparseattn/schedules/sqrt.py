"""Algorithm 1's dynamic restructuring: c = sqrt(t) segments of sqrt(t) tokens at every perfect square."""

from __future__ import annotations

import math
from dataclasses import dataclass

from sparseattn.schedules.base import SegmentGrid
from sparseattn.validation import check_real


@dataclass(frozen=True)
class SqrtSchedule:
    """Rebuild when the token count t is a perfect square r^2, into segments of ``floor(r / aspect)``.

    Between squares nothing is sealed: new tokens wait in the buffer, which holds at most
    ``(r+1)^2 - 1 - r^2 = 2r < 2 sqrt(t)`` tokens (with ``aspect = 1``, the paper's setting).
    Rebuilding costs O(t) once every ~sqrt(t) tokens: amortised O(sqrt(t)) per step.

    ``aspect > 1`` gives more, smaller segments; the r^2 tokens are then covered by ``r^2 // size``
    segments and the remainder joins the buffer. (The authors' experiment scripts use ``aspect = 4``,
    but with a different rebuild rule: :class:`~sparseattn.schedules.aspect.AspectSchedule`.)
    """

    aspect: float = 1.0

    def __post_init__(self) -> None:
        check_real("SqrtSchedule", "aspect", self.aspect, above=0)

    def plan(self, n_tokens: int, grid: SegmentGrid | None) -> SegmentGrid:
        root = math.isqrt(n_tokens)
        square = root * root
        if grid is not None and grid.built_at == square:
            return grid
        size = max(1, math.floor(root / self.aspect))
        return SegmentGrid(segment_size=size, n_segments=square // size, built_at=square)
