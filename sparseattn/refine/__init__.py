"""Token refinement: after the segments are found, attend their best tokens rather than whole segments."""

from sparseattn.refine.tokens import TopTokens

__all__ = ["TopTokens"]
