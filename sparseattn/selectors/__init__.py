"""Segment selectors: turn segment scores into the segments a query attends to."""

from sparseattn.selectors.base import BestSelector, DistinctSelector, SeededSelector, Selector, keeps_best
from sparseattn.selectors.lowest import Lowest
from sparseattn.selectors.random import Random
from sparseattn.selectors.recent import Recent
from sparseattn.selectors.topk import TopK

__all__ = ["BestSelector", "DistinctSelector", "Lowest", "Random", "Recent", "SeededSelector", "Selector", "TopK", "keeps_best"]
