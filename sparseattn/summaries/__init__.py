"""Segment summaries: each scores a segment by an estimate of its log attention mass."""

from sparseattn.summaries.base import GroupScoringSummary, SegmentKeys, Shortlist, ShortlistingSummary, Summary, TopKAwareSummary
from sparseattn.summaries.centered import CenteredFeatures
from sparseattn.summaries.centroid import Centroid
from sparseattn.summaries.exact import ExactScore
from sparseattn.summaries.minmax import MinMaxBound
from sparseattn.summaries.performer import PerformerFeatures
from sparseattn.summaries.rerank import Rerank
from sparseattn.summaries.spread import CentroidSpread

__all__ = [
    "CenteredFeatures",
    "Centroid",
    "CentroidSpread",
    "ExactScore",
    "GroupScoringSummary",
    "MinMaxBound",
    "PerformerFeatures",
    "Rerank",
    "SegmentKeys",
    "Shortlist",
    "ShortlistingSummary",
    "Summary",
    "TopKAwareSummary",
]
