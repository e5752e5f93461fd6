"""sparseattn: composable sparse attention for fast, training-free long-context decoding.

Radar (Hao et al., ICLR 2025) and its relatives are assembled from parts:

>>> import torch
>>> from sparseattn import RadarAlg1
>>> state = RadarAlg1(top_k=4, n_features=64).new_state(batch=1, kv_heads=2, head_dim=16)
>>> state.prefill(torch.randn(1, 2, 100, 16), torch.randn(1, 2, 100, 16))
>>> out, info = state.step(torch.randn(1, 4, 16), torch.randn(1, 2, 16), torch.randn(1, 2, 16))
>>> tuple(out.shape), int(info.attended.max()) <= 4 * 10 + 2 * 10
((1, 4, 16), True)
"""

from sparseattn.allocations import Allocation, PooledMass, Uniform
from sparseattn.refine import TopTokens
from sparseattn.methods import (
    AlwaysKept,
    AnyOf,
    Candidates,
    Evicting,
    EvictionPolicy,
    HeavyHitters,
    MergedRest,
    Observation,
    Protected,
    RecentWindow,
    Sinks,
    SlotStore,
    AllTokens,
    DecodeState,
    Dense,
    DenseState,
    EvictingState,
    H2O,
    KVState,
    LayerSpec,
    PrefillEviction,
    Quest,
    Radar,
    RadarCentered,
    RadarExact,
    RadarLowest,
    RadarAlg1,
    RadarH2O,
    OracleSegments,
    OracleTokens,
    RadarPlus,
    RadarPlusPooled,
    RadarPlusMerged,
    RadarPlusTokens,
    RadarRandom,
    RadarRecent,
    RadarRerank,
    SegmentSearch,
    SegmentSearchState,
    SegmentSelection,
    SlotSelection,
    SnapKV,
    SparseMethod,
    StepInfo,
    StreamingLLM,
    SubGen,
)
from sparseattn.ops import SegmentLayout, attention_ref, segment_attention, segment_attention_ref, segment_mask
from sparseattn.schedules import AspectSchedule, DoublingSchedule, FixedSchedule, Schedule, SegmentGrid, SqrtSchedule
from sparseattn.selectors import Lowest, Random, Recent, Selector, TopK
from sparseattn.summaries import CenteredFeatures, Centroid, ExactScore, MinMaxBound, PerformerFeatures, Rerank, SegmentKeys, Summary

__version__ = "0.1.0"

__all__ = [
    "Allocation",
    "OracleSegments",
    "OracleTokens",
    "PooledMass",
    "Uniform",
    "AlwaysKept",
    "AnyOf",
    "Candidates",
    "Evicting",
    "EvictionPolicy",
    "HeavyHitters",
    "Observation",
    "Protected",
    "RecentWindow",
    "Sinks",
    "SlotStore",
    "AllTokens",
    "CenteredFeatures",
    "Centroid",
    "Dense",
    "DenseState",
    "KVState",
    "LayerSpec",
    "DecodeState",
    "AspectSchedule",
    "DoublingSchedule",
    "EvictingState",
    "ExactScore",
    "FixedSchedule",
    "H2O",
    "Lowest",
    "MinMaxBound",
    "PerformerFeatures",
    "PrefillEviction",
    "Quest",
    "Radar",
    "RadarCentered",
    "RadarExact",
    "RadarLowest",
    "RadarAlg1",
    "RadarH2O",
    "RadarPlus",
    "RadarPlusPooled",
    "RadarPlusMerged",
    "MergedRest",
    "RadarPlusTokens",
    "TopTokens",
    "RadarRandom",
    "RadarRecent",
    "RadarRerank",
    "Random",
    "Recent",
    "Rerank",
    "Schedule",
    "SegmentGrid",
    "SegmentKeys",
    "SegmentLayout",
    "SegmentSearch",
    "SegmentSearchState",
    "SegmentSelection",
    "Selector",
    "SlotSelection",
    "SnapKV",
    "SparseMethod",
    "SqrtSchedule",
    "StepInfo",
    "StreamingLLM",
    "SubGen",
    "Summary",
    "TopK",
    "attention_ref",
    "segment_attention",
    "segment_attention_ref",
    "segment_mask",
]

# The transformers integration is imported on first use, so `import sparseattn` stays light.
_HF_NAMES = ("apply", "cache_kwargs", "SparseAttention", "SparseCache", "load_model")


def __getattr__(name: str):
    if name in _HF_NAMES:
        from sparseattn import hf

        return getattr(hf, name)
    raise AttributeError(f"module 'sparseattn' has no attribute {name!r}")
