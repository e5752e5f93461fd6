"""The ``Schedule`` protocol: when segments are sealed and when the whole structure is rebuilt."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from sparseattn.validation import check_int


@dataclass(frozen=True)
class SegmentGrid:
    """Equal segments over the first ``n_segments * segment_size`` segmentable tokens.

    Segmentable tokens are those after the sinks that have left the always-attended recent window
    (the newest token among them: see :class:`~sparseattn.methods.segment_search.SegmentSearch`).
    ``built_at`` is the token count at the last rebuild; a schedule returns the same ``segment_size``
    and ``built_at`` to seal more segments onto the grid, and a new ``built_at`` to rebuild every summary.
    """

    segment_size: int
    n_segments: int
    built_at: int

    def __post_init__(self) -> None:
        check_int("SegmentGrid", "segment_size", self.segment_size, 1)
        check_int("SegmentGrid", "n_segments", self.n_segments, 0)
        check_int("SegmentGrid", "built_at", self.built_at, 0)

    @property
    def covered(self) -> int:
        return self.segment_size * self.n_segments

    def is_rebuild_of(self, previous: SegmentGrid | None) -> bool:
        return previous is None or (self.segment_size, self.built_at) != (previous.segment_size, previous.built_at)


@runtime_checkable
class Schedule(Protocol):
    """Decide the segment grid for ``n_tokens`` segmentable tokens, given the current grid.

    ``n_tokens`` never decreases between calls on one state; the grid returned must cover at most
    ``n_tokens`` tokens, and may only grow unless it is a rebuild (a new ``built_at`` or size).
    """

    def plan(self, n_tokens: int, grid: SegmentGrid | None) -> SegmentGrid: ...
