"""Budget allocation: how a layer's segment budget is split between its heads.

A uniform split gives every head the same ``k`` segments; :class:`PooledMass` pools the heads'
estimated attention masses and gives the layer's ``H x k`` segments to the heads where they hold the
most mass, so diffuse heads get more and peaked heads fewer, the total unchanged. Any allocation
composes with any summary, selector and schedule.

An allocation is a segment search's select stage (:class:`SelectStage`): the decode state calls its
``select_segments`` and attends the :class:`Selection` it returns.
"""

from sparseattn.allocations.base import (
    Allocation,
    FixedShapePlan,
    SelectStage,
    Selection,
    listed_estimates,
    log_total_mass,
    pooled_counts_ref,
    split_segments,
)
from sparseattn.allocations.pooled import PooledMass
from sparseattn.allocations.topp import TopP, top_p_mask
from sparseattn.allocations.uniform import Uniform

__all__ = [
    "Allocation",
    "FixedShapePlan",
    "PooledMass",
    "SelectStage",
    "TopP",
    "Selection",
    "Uniform",
    "listed_estimates",
    "log_total_mass",
    "pooled_counts_ref",
    "split_segments",
    "top_p_mask",
]
