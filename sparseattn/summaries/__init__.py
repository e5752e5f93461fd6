"""Segment summaries: each scores a segment by an estimate of its log attention mass."""

from sparseattn.summaries.base import Summary
from sparseattn.summaries.centroid import Centroid
from sparseattn.summaries.exact import ExactScore
from sparseattn.summaries.minmax import MinMaxBound
from sparseattn.summaries.performer import PerformerFeatures

__all__ = ["Centroid", "ExactScore", "MinMaxBound", "PerformerFeatures", "Summary"]
