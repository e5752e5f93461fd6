"""The torch backend: the ops functions of :mod:`sparseattn.ops`, on any float dtype, CPU or CUDA.

It implements every op, and each method is the ops function itself behind the checks (so its
numbers are the ops' numbers, bit for bit): ``segment_attention`` is
:func:`sparseattn.ops.attention.segment_attention`, ``segment_log_mass``
:func:`sparseattn.ops.segments.segment_log_mass`, ``slot_attention``
:func:`sparseattn.ops.slots.slot_attention`, ``dense``
:func:`sparseattn.ops.attention.dense_decode_attention` and ``bound_scores``
:func:`sparseattn.ops.bounds.bound_scores`. It is the last resort of ``auto``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import ClassVar

import torch

from sparseattn.backends.base import BackendBase, Capability
from sparseattn.ops.attention import dense_decode_attention, segment_attention
from sparseattn.ops.bounds import bound_scores
from sparseattn.ops.segments import segment_log_mass
from sparseattn.ops.slots import slot_attention

_EVERYWHERE = Capability(
    devices=("cpu", "cuda"), dtypes=(torch.float16, torch.bfloat16, torch.float32, torch.float64)
)


@dataclass(frozen=True)
class TorchBackend(BackendBase):
    """Plain torch ops; runs everywhere torch does, in every float dtype.

    Each op method (:class:`~sparseattn.backends.base.BackendBase`'s: the checks, then ``run_<op>``) returns
    its ops function's result: ``segment_attention`` and ``dense`` float32 (float64 for float64 inputs),
    ``segment_log_mass`` and ``bound_scores`` in the queries' dtype, ``slot_attention`` ``(out, probs)``
    in the compute dtype.
    """

    name: ClassVar[str] = "torch"
    CAPABILITIES: ClassVar[Mapping[str, Capability]] = {
        "segment_attention": _EVERYWHERE,
        "segment_log_mass": _EVERYWHERE,
        "slot_attention": _EVERYWHERE,
        "dense": _EVERYWHERE,
        "bound_scores": _EVERYWHERE,
    }

    def run_segment_attention(self, q, keys, values, layout, segments, scale, softcap, workspace):
        return segment_attention(q, keys, values, layout, segments, scale, softcap, workspace)

    def run_segment_log_mass(self, segment_keys, queries, index):
        return segment_log_mass(segment_keys, queries, index)

    def run_slot_attention(self, q, keys, values, den_weight, num_weight, scale, softcap, floor_weight):
        return slot_attention(q, keys, values, den_weight, num_weight, scale, softcap, floor_weight)

    def run_dense(self, q, keys, values, scale, softcap):
        return dense_decode_attention(q, keys, values, scale, softcap)

    def run_bound_scores(self, low, high, queries):
        return bound_scores(low, high, queries)
