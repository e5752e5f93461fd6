"""Sparse decode methods built from the parts."""

from sparseattn.methods.base import DecodeState, SparseMethod, StepInfo
from sparseattn.methods.segment_search import Radar, SegmentSearch, SegmentSearchState, SegmentSelection

__all__ = ["DecodeState", "Radar", "SegmentSearch", "SegmentSearchState", "SegmentSelection", "SparseMethod", "StepInfo"]
