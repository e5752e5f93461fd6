"""Where every past token sits at one decode step: sinks, sealed segments, and the always-attended tail."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SegmentLayout:
    """The partition of the past ``[0, length)`` that one decode step sees.

    ::

        [0, sink_end)            sinks: always attended
        [sink_end, segment_end)  n_segments sealed segments of segment_size tokens: attended if selected
        [segment_end, length)    the buffer (Algorithm 1's W): always attended
        [length - window, length) the recent window: always attended

    The attended set is ``sinks ∪ (selected segments ∩ [sink_end, tail_start)) ∪ [tail_start, length)``,
    with ``tail_start`` the first token of buffer ∪ window. The three parts are disjoint, so selecting
    every segment reproduces dense attention exactly.
    """

    length: int
    sinks: int
    segment_size: int
    n_segments: int
    window: int = 0

    def __post_init__(self) -> None:
        for name in ("length", "sinks", "n_segments", "window"):
            if getattr(self, name) < 0:
                raise ValueError(f"SegmentLayout.{name} must be >= 0, got {getattr(self, name)}")
        if self.segment_size < 1:
            raise ValueError(f"SegmentLayout.segment_size must be >= 1, got {self.segment_size}")
        if self.segment_end > self.length:
            raise ValueError(f"segments end at {self.segment_end}, past the sequence length {self.length}")

    @property
    def sink_end(self) -> int:
        return min(self.sinks, self.length)

    @property
    def segment_end(self) -> int:
        return self.sink_end + self.n_segments * self.segment_size

    @property
    def buffer_size(self) -> int:
        return self.length - self.segment_end

    @property
    def tail_start(self) -> int:
        return min(self.segment_end, max(self.sink_end, self.length - self.window))

    @property
    def tail_size(self) -> int:
        return self.length - self.tail_start

    def segment_start(self, index: int) -> int:
        return self.sink_end + index * self.segment_size

    def max_attended(self, top_k: int) -> int:
        """The most tokens one step can attend: sinks + top_k whole segments + the tail."""
        return self.sink_end + min(top_k, self.n_segments) * self.segment_size + self.tail_size
