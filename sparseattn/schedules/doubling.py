"""Rebuild only when the context has doubled; seal fixed-size segments in between."""

from __future__ import annotations

import math
from dataclasses import dataclass

from sparseattn.schedules.base import SegmentGrid
from sparseattn.validation import check_real


@dataclass(frozen=True)
class DoublingSchedule:
    """Rebuild at t0 into segments of ``floor(sqrt(t0) / aspect)``; rebuild again once t >= 2 t0.

    In between, segments of the same size are sealed as the buffer fills, so the buffer holds fewer
    than ``size`` tokens and at most ``2 t0 / size ~ 2 aspect sqrt(t0)`` segments exist: scoring stays
    O(sqrt(t)) per step while rebuild work is O(t) per doubling, amortised O(1) per token
    (Algorithm 1 pays O(sqrt(t)) per token for its rebuilds). The authors' code rebuilds on a segment
    count instead (:class:`~sparseattn.schedules.aspect.AspectSchedule`), which fires at slightly
    different t.
    """

    aspect: float = 1.0

    def __post_init__(self) -> None:
        check_real("DoublingSchedule", "aspect", self.aspect, above=0)

    def plan(self, n_tokens: int, grid: SegmentGrid | None) -> SegmentGrid:
        if grid is None or (n_tokens > grid.built_at and n_tokens >= 2 * grid.built_at):
            size = max(1, math.floor(math.isqrt(n_tokens) / self.aspect))
            return SegmentGrid(segment_size=size, n_segments=n_tokens // size, built_at=n_tokens)
        return SegmentGrid(segment_size=grid.segment_size, n_segments=n_tokens // grid.segment_size, built_at=grid.built_at)
