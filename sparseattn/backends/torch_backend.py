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

from sparseattn.backends.base import BackendBase, Capability, check_bounds, check_cache, check_inputs, check_slots, refuse
from sparseattn.ops.attention import dense_decode_attention, segment_attention
from sparseattn.ops.bounds import bound_scores
from sparseattn.ops.buffers import Workspace
from sparseattn.ops.layout import SegmentLayout
from sparseattn.ops.segments import SegmentKeys, check_segment_lists, segment_log_mass
from sparseattn.ops.slots import slot_attention

_EVERYWHERE = Capability(
    devices=("cpu", "cuda"), dtypes=(torch.float16, torch.bfloat16, torch.float32, torch.float64)
)


@dataclass(frozen=True)
class TorchBackend(BackendBase):
    """Plain torch ops; runs everywhere torch does, in every float dtype."""

    name: ClassVar[str] = "torch"
    CAPABILITIES: ClassVar[Mapping[str, Capability]] = {
        "segment_attention": _EVERYWHERE,
        "segment_log_mass": _EVERYWHERE,
        "slot_attention": _EVERYWHERE,
        "dense": _EVERYWHERE,
        "bound_scores": _EVERYWHERE,
    }

    def segment_attention(
        self,
        q: torch.Tensor,
        keys: torch.Tensor,
        values: torch.Tensor,
        layout: SegmentLayout,
        segments: torch.Tensor,
        scale: float | None = None,
        softcap: float | None = None,
        *,
        workspace: Workspace | None = None,
        checked: bool = True,
    ) -> torch.Tensor:
        """See :class:`sparseattn.backends.base.AttentionBackend`; float32 out (float64 for float64 in)."""
        if checked:
            check_inputs(q, keys, values, layout, segments, softcap)
            refuse(self, "segment_attention", q, keys, softcap)
        return segment_attention(q, keys, values, layout, segments, scale, softcap, workspace)

    def segment_log_mass(
        self, segment_keys: SegmentKeys, queries: torch.Tensor, index: torch.Tensor, *, checked: bool = True
    ) -> torch.Tensor:
        """See :class:`sparseattn.backends.base.AttentionBackend`; in the queries' dtype."""
        if checked:
            check_segment_lists(queries, index)
            refuse(self, "segment_log_mass", queries, segment_keys.raw)
        return segment_log_mass(segment_keys, queries, index)

    def slot_attention(
        self,
        q: torch.Tensor,
        keys: torch.Tensor,
        values: torch.Tensor,
        den_weight: torch.Tensor | None = None,
        num_weight: torch.Tensor | None = None,
        scale: float | None = None,
        softcap: float | None = None,
        floor_weight: torch.Tensor | None = None,
        *,
        checked: bool = True,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """See :class:`sparseattn.backends.base.AttentionBackend`; ``(out, probs)`` in the compute dtype."""
        if checked:
            check_slots(q, keys, values)
            refuse(self, "slot_attention", q, keys, softcap)
        return slot_attention(q, keys, values, den_weight, num_weight, scale, softcap, floor_weight)

    def dense(
        self,
        q: torch.Tensor,
        keys: torch.Tensor,
        values: torch.Tensor,
        scale: float | None = None,
        softcap: float | None = None,
        *,
        checked: bool = True,
    ) -> torch.Tensor:
        """See :class:`sparseattn.backends.base.AttentionBackend`; float32 out (float64 for float64 in)."""
        if checked:
            check_cache(q, keys, values, keys.shape[2] if keys.dim() == 4 else 0, softcap)
            refuse(self, "dense", q, keys, softcap)
        return dense_decode_attention(q, keys, values, scale, softcap)

    def bound_scores(self, low: torch.Tensor, high: torch.Tensor, queries: torch.Tensor, *, checked: bool = True) -> torch.Tensor:
        """See :class:`sparseattn.backends.base.AttentionBackend`; in the queries' dtype."""
        if checked:
            check_bounds(low, high, queries)
            refuse(self, "bound_scores", queries, low)
        return bound_scores(low, high, queries)
