"""Budget allocation: how a layer's segment budget is split between its heads.

A uniform split gives every head the same ``k`` segments (what every segment search did before);
:class:`PooledMass` pools the heads' estimated attention masses and gives the layer's ``H x k``
segments to the heads where they hold the most mass, so diffuse heads get more and peaked heads
fewer, the total unchanged. Any allocation composes with any summary, selector and schedule.
"""

from sparseattn.allocations.base import Allocation, log_total_mass, pooled_counts_ref, listed_estimates
from sparseattn.allocations.pooled import PooledMass
from sparseattn.allocations.uniform import Uniform

__all__ = ["Allocation", "PooledMass", "Uniform", "log_total_mass", "pooled_counts_ref", "listed_estimates"]
