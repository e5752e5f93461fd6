"""Schedules: when segments are sealed and when the segment structure is rebuilt."""

from sparseattn.schedules.aspect import AspectSchedule
from sparseattn.schedules.base import Schedule, SegmentGrid
from sparseattn.schedules.doubling import DoublingSchedule
from sparseattn.schedules.fixed import FixedSchedule
from sparseattn.schedules.sqrt import SqrtSchedule

__all__ = ["AspectSchedule", "DoublingSchedule", "FixedSchedule", "Schedule", "SegmentGrid", "SqrtSchedule"]
