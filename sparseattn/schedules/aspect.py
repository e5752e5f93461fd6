"""The rebuild rule of the Radar authors' code: segments of floor(sqrt(t) / a), rebuilt when the grid has doubled."""

from __future__ import annotations

import math
from dataclasses import dataclass

from sparseattn.schedules.base import SegmentGrid
from sparseattn.validation import check_real


@dataclass(frozen=True)
class AspectSchedule:
    """Segments of ``c = floor(sqrt(t) / aspect)`` tokens, rebuilt once ``t // c >= 2 aspect^2 c``.

    This is the schedule the Radar authors ran (their public code, with ``aspect = 4`` in both
    experiment scripts), not the perfect-square rule of the paper's Algorithm 1 (:class:`SqrtSchedule`):

    * at a rebuild over ``t`` segmentable tokens, ``c = max(1, floor(sqrt(t) / aspect))`` and the
      ``t // c`` full segments are summarised; the remainder (``< c`` tokens) stays unsegmented;
    * between rebuilds, full segments of the same ``c`` are sealed as tokens arrive;
    * a rebuild is due once the grid holds ``t // c >= 2 aspect^2 c`` segments. Right after a rebuild it
      holds ``t // c ~ aspect^2 c`` (since ``t ~ aspect^2 c^2``), so the rule fires when ``t`` has
      roughly doubled: rebuild work is O(t) per doubling, O(1) amortised per token, while the grid
      keeps between ``aspect^2 c`` and ``2 aspect^2 c`` segments, i.e. O(aspect sqrt(t)) to score;
    * when the rule fires but ``floor(sqrt(t) / aspect)`` is still ``c`` (only for ``c <= 2``), the
      rebuilt grid would be the grid already held: nothing is recomputed and sealing goes on.

    Hand-computed boundaries for ``aspect = 4`` from ``t = 0`` (see tests/test_schedules.py): rebuilds
    at t = 64 (c = 2), 144 (3), 288 (4), 512 (5), 800 (7), 1568 (9), ...; a prefill of 15,359
    segmentable tokens (16,384 - 1 sink - a 1024-token window) gives c = 30: 511 segments, remainder 29.

    Differences from :class:`DoublingSchedule` (rebuild once ``t >= 2 t0``): the rule here counts
    segments, so it fires at ``2 aspect^2 c^2``, which is below ``2 t0`` whenever ``sqrt(t0) / aspect`` is
    not an integer (t0 = 20,000, aspect 4: c = 35, rebuild at 39,200 rather than 40,000).

    Args:
        aspect: ``a`` > 0; segments are ``a`` times shorter than ``sqrt(t)`` and ``a`` times more
            numerous (the authors' 4; 1 gives ``c = sqrt(t)``, Algorithm 1's shape).
    """

    aspect: float = 4.0

    def __post_init__(self) -> None:
        check_real("AspectSchedule", "aspect", self.aspect, above=0)

    def segment_size(self, n_tokens: int) -> int:
        """``max(1, floor(sqrt(n_tokens) / aspect))``: the size a rebuild at ``n_tokens`` chooses."""
        # math.sqrt is exact on perfect squares below 2^52, so the floor is never off by one there.
        return max(1, math.floor(math.sqrt(n_tokens) / self.aspect))

    def due(self, n_tokens: int, size: int) -> bool:
        """The authors' condition: the grid of ``size`` holds ``n_tokens // size >= 2 aspect^2 size`` segments."""
        return n_tokens // size >= 2 * self.aspect**2 * size

    def plan(self, n_tokens: int, grid: SegmentGrid | None) -> SegmentGrid:
        if grid is not None:
            size = grid.segment_size
            if not self.due(n_tokens, size) or self.segment_size(n_tokens) == size:
                return SegmentGrid(segment_size=size, n_segments=n_tokens // size, built_at=grid.built_at)
        size = self.segment_size(n_tokens)
        return SegmentGrid(segment_size=size, n_segments=n_tokens // size, built_at=n_tokens)
