"""Sparse decode methods built from the parts.

Each method module registers its named methods in :mod:`sparseattn.registry` when it is imported;
the first import below fixes the registration order, which is the order ``sparseattn methods`` lists.
"""

# isort: off
from sparseattn.methods import dense, segment_search, streaming, h2o, snapkv, subgen, radar_plus, presets  # noqa: F401
# isort: on

from sparseattn.methods.base import DecodeState, KVState, LayerSpec, SparseMethod, StepInfo
from sparseattn.methods.compose import PrefillEviction, PrefillEvictionState
from sparseattn.methods.dense import AllTokens, Dense, DenseState
from sparseattn.methods.always import AlwaysKept, AnyOf, HeavyHitters, Protected, RecentWindow, Sinks
from sparseattn.methods.eviction import Candidates, Evicting, EvictingState, EvictionPolicy, Observation, SlotSelection, SlotStore
from sparseattn.ops.slots import slot_attention, slot_attention_ref
from sparseattn.methods.h2o import H2O
from sparseattn.methods.presets import (
    OracleSegments,
    OracleTokens,
    Quest,
    RadarCentered,
    RadarExact,
    RadarLowest,
    RadarAlg1,
    RadarH2O,
    RadarRandom,
    RadarRecent,
    RadarRerank,
    SnapKVRadar,
)
from sparseattn.methods.layers import plain_first
from sparseattn.methods.radar_plus import RadarPlus, RadarPlusAdaptive, RadarPlusMerged, RadarPlusPooled, RadarPlusTokens
from sparseattn.methods.rest import MergedRest
from sparseattn.methods.sampled_rest import SampledRest
from sparseattn.methods.segment_search import Radar, SegmentSearch
from sparseattn.methods.segment_state import SegmentSearchState
from sparseattn.methods.segment_step import SegmentSelection
from sparseattn.methods.snapkv import SnapKV
from sparseattn.methods.streaming import StreamingLLM
from sparseattn.methods.subgen import SubGen, SubGenState

__all__ = [
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
    "DecodeState",
    "Dense",
    "DenseState",
    "EvictingState",
    "H2O",
    "KVState",
    "LayerSpec",
    "PrefillEviction",
    "PrefillEvictionState",
    "Quest",
    "Radar",
    "RadarCentered",
    "RadarExact",
    "RadarLowest",
    "RadarAlg1",
    "RadarH2O",
    "OracleSegments",
    "OracleTokens",
    "RadarPlus",
    "RadarPlusAdaptive",
    "RadarPlusPooled",
    "RadarPlusMerged",
    "MergedRest",
    "SampledRest",
    "RadarPlusTokens",
    "RadarRandom",
    "RadarRecent",
    "RadarRerank",
    "SegmentSearch",
    "SegmentSearchState",
    "SegmentSelection",
    "SlotSelection",
    "SnapKV",
    "SnapKVRadar",
    "SparseMethod",
    "StepInfo",
    "StreamingLLM",
    "SubGen",
    "SubGenState",
    "slot_attention",
    "slot_attention_ref",
    "plain_first",
]
