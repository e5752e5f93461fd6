"""Sparse decode methods built from the parts."""

from sparseattn.methods.base import DecodeState, KVState, SparseMethod, StepInfo
from sparseattn.methods.dense import AllTokens, Dense, DenseState
from sparseattn.methods.segment_search import Radar, SegmentSearch, SegmentSearchState, SegmentSelection

__all__ = [
    "AllTokens",
    "DecodeState",
    "Dense",
    "DenseState",
    "KVState",
    "Radar",
    "SegmentSearch",
    "SegmentSearchState",
    "SegmentSelection",
    "SparseMethod",
    "StepInfo",
]
