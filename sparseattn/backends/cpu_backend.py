"""The cpu backend: the C kernels of :mod:`sparseattn.backends.cpu_kernels`, reading the cache in place.

Where the torch backend gathers the selected tokens into a copy and runs SDPA on it (with a mask when
the query heads of a KV group select differently), this kernel walks the attended token ranges of the
cache directly, once per KV head for all the query heads that attend them, with an online softmax
split across threads and merged by log-sum-exp. It implements ``segment_attention``, ``dense`` (the
same kernel with every token a sink) and ``segment_log_mass`` (a second kernel, the keys read in
place); not ``slot_attention``. It declares CPU tensors, float32/bfloat16/float16 queries (float32
for ``segment_log_mass``, whose queries are in the compute dtype; float64 stays with the torch
backend, the reference-grade path) and any head dim; it refuses when no C compiler could build it,
when autograd records (it has no backward), when the head dim of the cache is not contiguous, for a
cache dtype the built kernel does not read, or for more than 64 query rows per KV head.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import ClassVar

import torch

from sparseattn.backends.base import BackendBase, Capability, check_cache, check_inputs, declared_refusal, refuse
from sparseattn.backends.cpu_kernels import (
    MAX_GROUP,
    cpu_kernel_refusal,
    merged_rest_cpu,
    segment_attention_cpu,
    segment_log_mass_cpu,
    supported_dtypes,
)
from sparseattn.ops.buffers import Workspace
from sparseattn.ops.layout import SegmentLayout
from sparseattn.ops.segments import SegmentKeys, check_segment_lists

_ATTENTION = Capability(devices=("cpu",), dtypes=(torch.float32, torch.bfloat16, torch.float16))


@dataclass(frozen=True)
class CpuBackend(BackendBase):
    """Segment-sparse and dense decode attention, and exact segment masses, by compiled C kernels (OpenMP on torch's threads)."""

    name: ClassVar[str] = "cpu"
    CAPABILITIES: ClassVar[Mapping[str, Capability]] = {
        "segment_attention": _ATTENTION,
        "segment_log_mass": Capability(devices=("cpu",), dtypes=(torch.float32,)),
        "dense": _ATTENTION,
    }

    def refusal(self, op: str, q: torch.Tensor, keys: torch.Tensor, softcap: float | None = None) -> str | None:
        reason = declared_refusal(self, op, q)
        if reason is not None:
            return reason
        if q.dim() >= 3 and q.shape[2] > MAX_GROUP:
            return f"{q.shape[2]} query heads per KV head; the kernel handles at most {MAX_GROUP}"
        if torch.is_grad_enabled() and (q.requires_grad or keys.requires_grad):
            return "autograd is recording and the kernel has no backward (run decoding under torch.no_grad())"
        reason = cpu_kernel_refusal()
        if reason is not None:
            return f"the kernel is unavailable: {reason}"
        if keys.dtype not in supported_dtypes():
            names = ", ".join(str(d).removeprefix("torch.") for d in supported_dtypes())
            return f"the cache is {keys.dtype}; the built kernel reads {names}"
        if keys.dim() >= 1 and keys.stride(-1) != 1:
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
        *,
        workspace: Workspace | None = None,
        checked: bool = True,
    ) -> torch.Tensor:
        """See :class:`sparseattn.backends.base.AttentionBackend`; float32 out. No scratch: ``workspace`` is unused."""
        if checked:
            check_inputs(q, keys, values, layout, segments, softcap)
            refuse(self, "segment_attention", q, keys, softcap)
            check_values(values)
        return segment_attention_cpu(q, keys, values, layout, segments, scale, softcap)

    def segment_attention_masked(
        self,
        q: torch.Tensor,
        keys: torch.Tensor,
        values: torch.Tensor,
        layout: SegmentLayout,
        segments: torch.Tensor,
        valid: torch.Tensor,
        scale: float | None = None,
        softcap: float | None = None,
    ) -> torch.Tensor:
        """:class:`~sparseattn.backends.base.MaskedSegmentAttention`: the kernel builds each row's spans from
        the listed segments flagged in ``valid``. Unchecked: the decode state had ``segment_attention``
        accept these inputs; a flagged index outside ``[0, n_segments)`` is refused by the kernel."""
        return segment_attention_cpu(q, keys, values, layout, segments, scale, softcap, valid)

    def segment_attention_lse(
        self,
        q: torch.Tensor,
        keys: torch.Tensor,
        values: torch.Tensor,
        layout: SegmentLayout,
        segments: torch.Tensor,
        valid: torch.Tensor | None = None,
        scale: float | None = None,
        softcap: float | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """:class:`~sparseattn.backends.base.SegmentAttentionLSE`: the same kernel, also writing each query
        head's log-sum-exp. Unchecked, as :meth:`segment_attention_masked`."""
        return segment_attention_cpu(q, keys, values, layout, segments, scale, softcap, valid, lse=True)

    def segment_attention_merged(
        self,
        q: torch.Tensor,
        keys: torch.Tensor,
        values: torch.Tensor,
        layout: SegmentLayout,
        segments: torch.Tensor,
        valid: torch.Tensor | None,
        seg_kv: torch.Tensor,
        block_k: torch.Tensor,
        block_v: torch.Tensor,
        per_block: int,
        scale: float,
        softcap: float | None = None,
    ) -> torch.Tensor:
        """:class:`~sparseattn.backends.base.MergedRestAttention`: the kernel with its log-sum-exp, then the
        merged rest in C from the segments' and blocks' sums (no token read twice, no tensor operation
        between). Unchecked, as :meth:`segment_attention_masked`."""
        if layout.tail_start < layout.segment_end:
            raise ValueError(f"segment_attention_merged needs a window that reaches into no segment: tail_start "
                             f"{layout.tail_start} < segment_end {layout.segment_end}")  # fmt: skip
        # Converted once for both calls (each would otherwise convert its own copy every step).
        q, segments = q.to(torch.float32).contiguous(), segments.to(torch.int64).contiguous()
        valid = None if valid is None else valid.to(torch.uint8).contiguous()
        out, lse = segment_attention_cpu(q, keys, values, layout, segments, scale, softcap, valid, lse=True)
        return merged_rest_cpu(out, lse, q, layout, segments, valid, seg_kv, block_k, block_v, per_block, scale, softcap)

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
        """See :class:`sparseattn.backends.base.AttentionBackend`; float32 out. The segment kernel with every token a sink."""
        if checked:
            check_cache(q, keys, values, keys.shape[2] if keys.dim() == 4 else 0, softcap)
            refuse(self, "dense", q, keys, softcap)
            check_values(values)
        every = SegmentLayout(length=keys.shape[2], sinks=keys.shape[2], segment_size=1, n_segments=0)
        none = torch.zeros(*q.shape[:2], 1, 0, dtype=torch.long)
        return segment_attention_cpu(q, keys, values, every, none, scale, softcap)

    def segment_log_mass(
        self, segment_keys: SegmentKeys, queries: torch.Tensor, index: torch.Tensor, *, checked: bool = True
    ) -> torch.Tensor:
        """See :class:`sparseattn.backends.base.AttentionBackend`; float32 out, the keys read in place."""
        if checked:
            check_segment_lists(queries, index)
            refuse(self, "segment_log_mass", queries, segment_keys.raw)
        return segment_log_mass_cpu(queries, segment_keys.raw, segment_keys.factor, index)


def check_values(values: torch.Tensor) -> None:
    """The kernel reads value rows in place: their head dim must be contiguous (keys are checked by the refusal)."""
    if values.stride(-1) != 1:
        raise ValueError(f"the cpu backend needs the values' head dim contiguous, got stride {values.stride(-1)}")
