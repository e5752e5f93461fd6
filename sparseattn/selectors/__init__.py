"""Segment selectors: turn segment scores into the segments a query attends to."""

from sparseattn.selectors.base import Selector
from sparseattn.selectors.lowest import Lowest
from sparseattn.selectors.random import Random
from sparseattn.selectors.recent import Recent
from sparseattn.selectors.topk import TopK

__all__ = ["Lowest", "Random", "Recent", "Selector", "TopK"]
