"""The cpu backend: the C kernel of :mod:`sparseattn.backends.cpu_kernels`, reading the cache in place.

Where the torch backend gathers the selected tokens into a copy and runs SDPA on it (with a mask when
the query heads of a KV group select differently), this kernel walks the attended token ranges of the
cache directly, once per KV head for all the query heads that attend them, with an online softmax
split across threads and merged by log-sum-exp. It declares CPU tensors, float32/bfloat16/float16
storage (float64 stays with the torch backend, the reference-grade path) and any head dim; it refuses
when no C compiler could build it, when autograd records (it has no backward), when the head dim of
the cache is not contiguous, or for more than 64 query heads per KV head.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import ClassVar

import torch

from sparseattn.backends.base import declared_refusal, refuse_or_check
from sparseattn.backends.cpu_kernels import MAX_GROUP, cpu_kernel_refusal, segment_attention_cpu, supported_dtypes
from sparseattn.ops.layout import SegmentLayout


@dataclass(frozen=True)
class CpuBackend:
    """Segment-sparse decode attention by a compiled C kernel (OpenMP on torch's threads)."""

    name: ClassVar[str] = "cpu"
    SUPPORTED_DEVICES: ClassVar[tuple[str, ...]] = ("cpu",)
    SUPPORTED_DTYPES: ClassVar[tuple[torch.dtype, ...]] = (torch.float32, torch.bfloat16, torch.float16)
    SUPPORTED_HEAD_DIMS: ClassVar[range] = range(1, sys.maxsize)

    def refusal(
        self, q: torch.Tensor, keys: torch.Tensor, layout: SegmentLayout, segments: torch.Tensor, softcap: float | None = None
    ) -> str | None:
        reason = declared_refusal(self, q)
        if reason is not None:
            return reason
        if q.shape[2] > MAX_GROUP:
            return f"{q.shape[2]} query heads per KV head; the kernel handles at most {MAX_GROUP}"
        if torch.is_grad_enabled() and (q.requires_grad or keys.requires_grad):
            return "autograd is recording and the kernel has no backward (run decoding under torch.no_grad())"
        reason = cpu_kernel_refusal()
        if reason is not None:
            return f"the kernel is unavailable: {reason}"
        if keys.dtype not in supported_dtypes():
            names = ", ".join(str(d).removeprefix("torch.") for d in supported_dtypes())
            return f"the cache is {keys.dtype}; the built kernel reads {names}"
        if keys.dim() == 4 and keys.stride(-1) != 1:
            return f"the cache's head dim is not contiguous (stride {keys.stride(-1)})"
        return None

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
        """See :class:`sparseattn.backends.base.AttentionBackend`; float32 out."""
        refuse_or_check(self, q, keys, values, layout, segments, softcap)
        if values.stride(-1) != 1:
            raise ValueError(f"the cpu backend needs the values' head dim contiguous, got stride {values.stride(-1)}")
        return segment_attention_cpu(q, keys, values, layout, segments, scale, softcap)
