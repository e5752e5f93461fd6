"""sparseattn: composable sparse attention for fast, training-free long-context decoding.

Radar (Hao et al., ICLR 2025) and its relatives are assembled from parts:

>>> import torch
>>> from sparseattn import RadarAlg1
>>> state = RadarAlg1(top_k=4, n_features=64).new_state(batch=1, kv_heads=2, head_dim=16)
>>> state.prefill(torch.randn(1, 2, 100, 16), torch.randn(1, 2, 100, 16))
>>> out, info = state.step(torch.randn(1, 4, 16), torch.randn(1, 2, 16), torch.randn(1, 2, 16))
>>> tuple(out.shape), int(info.attended.max()) <= 4 * 10 + 2 * 10
((1, 4, 16), True)

The recommended method is a plain function, the same in both engines: :func:`RadarPlusAdaptive`
(``recommended(engine)`` names its registry entry; ``sparseattn methods`` lists every method by what it
is for).

>>> recommended("transformers").name, recommended("vllm").name
('radar+adaptive', 'radar+adaptive')
"""

from sparseattn.allocations import Allocation, PooledMass, Selection, SelectStage, TopP, Uniform
from sparseattn.methods.rest import Rest
from sparseattn.allocations.step import SearchStep
from sparseattn.methods.segment_step import SegmentStep
from sparseattn.registry import recommended
from sparseattn.refine import TopTokens
from sparseattn.methods import *  # noqa: F403  (the methods and their parts, listed once in sparseattn.methods)
from sparseattn.methods import __all__ as _METHODS
from sparseattn.ops import SegmentLayout, attention_ref, segment_attention, segment_attention_ref, segment_mask
from sparseattn.schedules import AspectSchedule, DoublingSchedule, FixedSchedule, Schedule, SegmentGrid, SqrtSchedule
from sparseattn.selectors import Lowest, Random, Recent, Selector, TopK
from sparseattn.summaries import CenteredFeatures, Centroid, CentroidSpread, ExactScore, MinMaxBound, PerformerFeatures, Rerank, SegmentKeys, Summary

__version__ = "0.1.0"

__all__ = [
    *_METHODS,
    "Allocation",
    "AspectSchedule",
    "CenteredFeatures",
    "SearchStep",
    "Centroid",
    "CentroidSpread",
    "DoublingSchedule",
    "ExactScore",
    "FixedSchedule",
    "Lowest",
    "MinMaxBound",
    "PerformerFeatures",
    "PooledMass",
    "Random",
    "Recent",
    "Rerank",
    "Rest",
    "Schedule",
    "SegmentGrid",
    "SegmentKeys",
    "SegmentLayout",
    "SegmentStep",
    "SelectStage",
    "Selection",
    "Selector",
    "SqrtSchedule",
    "Summary",
    "TopK",
    "TopP",
    "TopTokens",
    "Uniform",
    "attention_ref",
    "recommended",
    "segment_attention",
    "segment_attention_ref",
    "segment_mask",
]

# The transformers integration is imported on first use, so `import sparseattn` stays light.
_HF_NAMES = ("apply", "cache_kwargs", "generate", "SparseAttention", "SparseCache", "load_model")


def __getattr__(name: str):
    if name in _HF_NAMES:
        from sparseattn import hf

        return getattr(hf, name)
    raise AttributeError(f"module 'sparseattn' has no attribute {name!r}")
