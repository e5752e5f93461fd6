"""The torch backend: :func:`sparseattn.ops.attention.segment_attention`, on any dtype, CPU or CUDA."""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import ClassVar

import torch

from sparseattn.backends.base import declared_refusal, refuse_or_check
from sparseattn.ops.attention import segment_attention
from sparseattn.ops.layout import SegmentLayout


@dataclass(frozen=True)
class TorchBackend:
    """Plain torch ops; runs everywhere torch does, in every float dtype. The last resort of ``auto``."""

    name: ClassVar[str] = "torch"
    SUPPORTED_DEVICES: ClassVar[tuple[str, ...]] = ("cpu", "cuda")
    SUPPORTED_DTYPES: ClassVar[tuple[torch.dtype, ...]] = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
    SUPPORTED_HEAD_DIMS: ClassVar[range] = range(1, sys.maxsize)

    def refusal(
        self, q: torch.Tensor, keys: torch.Tensor, layout: SegmentLayout, segments: torch.Tensor, softcap: float | None = None
    ) -> str | None:
        return declared_refusal(self, q)

    def segment_attention(
        self,
        q: torch.Tensor,
        keys: torch.Tensor,
        values: torch.Tensor,
        layout: SegmentLayout,
        segments: torch.Tensor,
        scale: float | None = None,
        softcap: float | None = None,
    ) -> torch.Tensor:
        """See :class:`sparseattn.backends.base.AttentionBackend`; float32 out (float64 for float64 in)."""
        refuse_or_check(self, q, keys, values, layout, segments, softcap)
        return segment_attention(q, keys, values, layout, segments, scale, softcap)
