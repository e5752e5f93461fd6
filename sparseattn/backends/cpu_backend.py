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

from sparseattn.backends.base import BackendBase, Capability, declared_refusal, every_token_a_sink
from sparseattn.backends.cpu_kernels import (
    MAX_GROUP,
    cpu_kernel_refusal,
    kernel_operands,
    merged_rest_cpu,
    segment_attention_cpu,
    segment_log_mass_cpu,
    supported_dtypes,
)

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

    def run_segment_attention(self, q, keys, values, layout, segments, scale, softcap, workspace):
        """Float32 out. No scratch: ``workspace`` is unused."""
        check_values(values)
        return segment_attention_cpu(q, keys, values, layout, segments, scale, softcap)

    # The optional ops of base.EXTENSION_OPS: their arguments are typed once, in their protocols (as the op
    # methods' are in AttentionBackend). Unchecked: the decode state had ``segment_attention`` accept these
    # inputs; a flagged index outside [0, n_segments) is refused by the kernel.

    def segment_attention_masked(self, q, keys, values, layout, segments, valid, scale=None, softcap=None):
        """:class:`~sparseattn.backends.base.MaskedSegmentAttention`: the kernel builds each row's spans from
        the listed segments flagged in ``valid``."""
        return segment_attention_cpu(q, keys, values, layout, segments, scale, softcap, valid)

    def segment_attention_lse(self, q, keys, values, layout, segments, valid=None, scale=None, softcap=None):
        """:class:`~sparseattn.backends.base.SegmentAttentionLSE`: the same kernel, also writing each query
        head's log-sum-exp."""
        return segment_attention_cpu(q, keys, values, layout, segments, scale, softcap, valid, lse=True)

    def segment_attention_merged(self, q, keys, values, layout, segments, valid, sums, scale, softcap=None):
        """:class:`~sparseattn.backends.base.MergedRestAttention`: the kernel with its log-sum-exp, then the
        merged rest in C from the segments' and blocks' sums (no token read twice, no tensor operation
        between)."""
        if layout.tail_start < layout.segment_end:
            raise ValueError(f"segment_attention_merged needs a window that reaches into no segment: tail_start "
                             f"{layout.tail_start} < segment_end {layout.segment_end}")  # fmt: skip
        # Converted once for both calls (each would otherwise convert its own copy every step).
        q, segments, valid = kernel_operands(q, segments, valid)
        out, lse = segment_attention_cpu(q, keys, values, layout, segments, scale, softcap, valid, lse=True)
        return merged_rest_cpu(out, lse, q, layout, segments, valid, sums, scale, softcap)

    def run_dense(self, q, keys, values, scale, softcap):
        """Float32 out: the segment kernel with every token a sink."""
        check_values(values)
        every, none = every_token_a_sink(q, keys)
        return segment_attention_cpu(q, keys, values, every, none, scale, softcap)

    def run_segment_log_mass(self, segment_keys, queries, index):
        """Float32 out, the keys read in place."""
        return segment_log_mass_cpu(queries, segment_keys.raw, segment_keys.factor, index)


def check_values(values: torch.Tensor) -> None:
    """The kernel reads value rows in place: their head dim must be contiguous (keys are checked by the refusal).

    Checked on unchecked calls too (it runs in ``run_segment_attention`` and ``run_dense``): one stride
    comparison, where a strided head dim would be read wrong.
    """
    if values.stride(-1) != 1:
        raise ValueError(f"the cpu backend needs the values' head dim contiguous, got stride {values.stride(-1)}")
