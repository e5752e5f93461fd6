"""Fixed-size segments sealed as they fill (Quest's pages), never rebuilt."""

from __future__ import annotations

from dataclasses import dataclass

from sparseattn.schedules.base import SegmentGrid
from sparseattn.validation import check_int


@dataclass(frozen=True)
class FixedSchedule:
    """Segments of ``size`` tokens; a segment is sealed (summarised once) when it fills.

    O(1) summary work per token, but O(t / size) segments to score per step.
    """

    size: int = 16

    def __post_init__(self) -> None:
        check_int("FixedSchedule", "size", self.size, 1)

    def plan(self, n_tokens: int, grid: SegmentGrid | None) -> SegmentGrid:
        return SegmentGrid(segment_size=self.size, n_segments=n_tokens // self.size, built_at=0)
