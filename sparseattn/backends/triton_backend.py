"""The Triton backend: a flash-decoding style segment-sparse decode kernel, and the LSE merge of its splits.

Triton is imported lazily (``import sparseattn`` works without it); a missing triton, CPU tensors
without the interpreter, or an unsupported dtype or head dim are refusals, not import errors.

Design (kernels in :mod:`sparseattn.backends.triton_kernels`):

* grid ``(B * H_kv * G', n_splits)``: one program per (batch, KV head, selection) and split. With a
  shared selection (``G' = 1``) one program holds all ``G`` query heads of the KV group as the M
  dimension of ``tl.dot``, so each K/V block is loaded once for the whole group; with one selection
  per query head (``G' = G``) each query head has its own program.
* each program walks its chunk of the attended tokens (sinks, selected segments read from the cache
  by index, tail) in blocks of ``block_n`` with an online softmax, and writes its split's normalised
  output and log-sum-exp (float32);
* :func:`merge_partials` combines the splits by log-sum-exp (a second, small kernel), skipped when
  there is one split.

The cache is read in place through its strides: ``keys``/``values`` may be non-contiguous views
(a narrow of a capacity buffer) and are never copied.
"""

from __future__ import annotations

import contextlib
import functools
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import ClassVar

import torch

from sparseattn.backends.base import BackendBase, Capability, check_inputs, declared_refusal, package_missing, refuse
from sparseattn.ops.buffers import Workspace
from sparseattn.ops.layout import SegmentLayout

#: Splits per row are capped so the merge kernel holds all of a row's states in one tile.
MAX_SPLITS = 64

#: The grid aims at this many programs per streaming multiprocessor (flash-decoding's occupancy target).
PROGRAMS_PER_SM = 2


def on_device(device: torch.device) -> contextlib.AbstractContextManager:
    """Triton launches on the current CUDA device: make it the tensors' one."""
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


@functools.cache
def multiprocessors(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def triton_installed() -> bool:
    return not package_missing("triton")


def interpreting() -> bool:
    """Whether triton runs kernels in its interpreter in this process (importing triton if needed).

    The mode is fixed when ``triton.language`` is first imported: its own helpers (``tl.zeros``,
    ``tl.max``, ...) are wrapped for the interpreter or the compiler then, as ``TRITON_INTERPRET``
    says, and a kernel in the other mode cannot call them. Setting the variable later changes nothing.
    """
    import triton.language as tl
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(tl.zeros, InterpretedFunction)


@functools.cache
def kernels(interpret: bool):
    """``(segment_decode, merge_partials)`` wrapped for the interpreter or the compiler (see :func:`interpreting`)."""
    import triton.language

    from sparseattn.backends import triton_kernels as tk

    tk.tl = triton.language
    if interpret:
        from triton.runtime.interpreter import InterpretedFunction

        return InterpretedFunction(tk.segment_decode_kernel), InterpretedFunction(tk.merge_partials_kernel)
    from triton.runtime import JITFunction

    # Layout counters change every step; specialising on them (== 1, % 16) would recompile.
    dynamic = ["sink_end", "n_sel", "tail_start", "n_virtual", "tokens_per_split"]
    return JITFunction(tk.segment_decode_kernel, do_not_specialize=dynamic), JITFunction(tk.merge_partials_kernel)


def merge_partials(outs: torch.Tensor, lses: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge attention states over disjoint key sets by log-sum-exp (FlashInfer's ``merge_state``).

    State ``s`` is a normalised output ``outs[..., s, :]`` with the log-sum-exp ``lses[..., s]`` of
    its logits; a state with ``lse = -inf`` saw no key and is skipped. Reference:
    :func:`sparseattn.backends.naive.merge_partials_ref`.

    Args:
        outs: ``[..., S, D]`` float16/bfloat16/float32; lses: ``[..., S]`` float32.
    Returns:
        ``(out [..., D], lse [...])`` in float32.
    """
    if not triton_installed():
        raise ValueError("merge_partials needs triton, which is not installed")
    if outs.dim() < 2 or lses.shape != outs.shape[:-1]:
        raise ValueError(f"need outs [..., S, D] and lses [..., S]; got outs {tuple(outs.shape)}, lses {tuple(lses.shape)}")
    if outs.dtype not in (torch.float16, torch.bfloat16, torch.float32) or lses.dtype != torch.float32:
        raise ValueError(f"merge_partials takes fp16/bf16/fp32 outs and float32 lses; got {outs.dtype}, {lses.dtype}")
    S, D = outs.shape[-2:]
    if not 1 <= S <= MAX_SPLITS:
        raise ValueError(f"merge_partials merges 1..{MAX_SPLITS} states per row, got {S}")
    lead = outs.shape[:-2]
    R = math.prod(lead)
    o3, l2 = outs.reshape(R, S, D), lses.reshape(R, S)
    out = torch.empty(R, D, dtype=torch.float32, device=outs.device)
    lse = torch.empty(R, dtype=torch.float32, device=outs.device)
    if R > 0:
        _, merge = kernels(interpreting())
        with on_device(outs.device):
            merge[(R,)](
                o3, l2, out, lse,
                *o3.stride(), *l2.stride(), *out.stride(), lse.stride(0),
                S, D,
                BLOCK_S=triton_block(S, 1), BLOCK_D=triton_block(D, 16),
            )  # fmt: skip
    return out.reshape(*lead, D), lse.reshape(lead)


def triton_block(n: int, minimum: int) -> int:
    """The power-of-two tile covering ``n`` (at least ``minimum``: ``tl.dot`` needs 16)."""
    return max(minimum, 1 << max(0, n - 1).bit_length())


def segment_decode_partials(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    layout: SegmentLayout,
    segments: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    *,
    scale: float | None = None,
    softcap: float | None = None,
    block_n: int = 64,
    num_warps: int = 4,
) -> None:
    """Launch the split kernel: write every split's state into ``out [B, H_kv, G, S, D]`` and ``lse [B, H_kv, G, S]``.

    ``S = out.shape[3]`` splits share the ``n_virtual = sinks + k * segment_size + tail`` attended
    tokens in chunks of whole blocks; a split past the end writes ``lse = -inf`` and a zero output.
    Inputs are not checked here (:class:`TritonBackend` does that).
    """
    B, H, G, D = q.shape
    Gs, k = segments.shape[2], segments.shape[3]
    S = out.shape[3]
    n_virtual = layout.sink_end + k * layout.segment_size + layout.tail_size
    tokens_per_split = math.ceil(math.ceil(n_virtual / block_n) / S) * block_n
    scale = D**-0.5 if scale is None else scale
    rows = G // Gs
    interpret = interpreting()
    decode, _ = kernels(interpret)
    launch = decode[(B * H * Gs, S)]
    with on_device(q.device):
        launch(
            q, keys, values, segments, out, lse,
            *q.stride(), *keys.stride(), *values.stride(), *segments.stride(), *out.stride(), *lse.stride(),
            H, Gs, rows, D,
            layout.sink_end, layout.segment_size, k, layout.tail_start, n_virtual, tokens_per_split,
            float(scale), float(softcap or 0.0),
            HAS_SOFTCAP=softcap is not None,
            # The interpreter multiplies bf16 bit patterns in tl.dot (triton-lang/triton#11584): upcast there.
            UPCAST_DOT=interpret and q.dtype == torch.bfloat16,
            BLOCK_G=triton_block(rows, 16), BLOCK_N=block_n, BLOCK_D=triton_block(D, 16),
            num_warps=num_warps,
        )  # fmt: skip


@dataclass(frozen=True)
class TritonBackend(BackendBase):
    """Fused segment-sparse decode on CUDA (or on CPU in the Triton interpreter, for tests).

    Implements ``segment_attention`` only: a Triton kernel for another op (``segment_log_mass``,
    ``slot_attention``, ``dense``) goes beside it in ``triton_kernels.py``, with its capability
    declared here (see docs/backends.md).

    Fields:
        block_n: attended tokens per block (a power of two >= 16).
        num_splits: splits of the attended tokens per row (None: enough programs for
            ``PROGRAMS_PER_SM`` per multiprocessor; one split in the interpreter).
        num_warps: warps per program.

    With ``TRITON_INTERPRET=1`` set before triton is first imported, kernels run in the Triton
    interpreter, which also accepts CPU tensors when the backend is named (slow: for tests; ``auto``
    keeps to the declared devices).
    """

    block_n: int = 64
    num_splits: int | None = None
    num_warps: int = 4

    name: ClassVar[str] = "triton"
    REQUIRES: ClassVar[tuple[str, ...]] = ("triton",)
    CAPABILITIES: ClassVar[Mapping[str, Capability]] = {
        # tl.dot needs K >= 16; dims that are not powers of two are padded to one and masked.
        "segment_attention": Capability(
            devices=("cuda",), dtypes=(torch.float16, torch.bfloat16, torch.float32), head_dims=range(16, 257)
        ),
    }

    def __post_init__(self) -> None:
        if self.block_n < 16 or self.block_n & (self.block_n - 1):
            raise ValueError(f"TritonBackend.block_n must be a power of two >= 16, got {self.block_n}")
        if self.num_splits is not None and not 1 <= self.num_splits <= MAX_SPLITS:
            raise ValueError(f"TritonBackend.num_splits must be in 1..{MAX_SPLITS} or None, got {self.num_splits}")
        if self.num_warps < 1 or self.num_warps & (self.num_warps - 1):
            raise ValueError(f"TritonBackend.num_warps must be a power of two, got {self.num_warps}")

    def refusal(self, op: str, q: torch.Tensor, keys: torch.Tensor, softcap: float | None = None) -> str | None:
        if not triton_installed():
            return "triton is not installed (pip install 'sparseattn[gpu]')"
        if op not in self.CAPABILITIES:  # before interpreting(), which imports triton
            return declared_refusal(self, op, q)
        interpret = interpreting()
        if q.device.type == "cpu" and not interpret:
            late = " (it is set now, but triton was imported before)" if os.environ.get("TRITON_INTERPRET") == "1" else ""
            return (
                "tensors are on cpu; the kernel needs CUDA, or the Triton interpreter, which needs "
                f"TRITON_INTERPRET=1 before triton is first imported{late}"
            )
        # The interpreter runs CPU tensors (and CUDA ones, through host copies).
        reason = declared_refusal(self, op, q, devices=("cpu", "cuda") if interpret else None)
        if reason is not None:
            return reason
        if keys.dtype != q.dtype:
            return f"q is {q.dtype} but keys are {keys.dtype}; the kernel needs one dtype for q, keys and values"
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
        """See :class:`sparseattn.backends.base.AttentionBackend`; returns ``[B, H_kv, G, D]`` float32. ``workspace`` is unused."""
        if checked:
            check_inputs(q, keys, values, layout, segments, softcap)
            refuse(self, "segment_attention", q, keys, softcap)
        B, H, G, D = q.shape
        interpret = interpreting()
        n_virtual = layout.sink_end + segments.shape[-1] * layout.segment_size + layout.tail_size
        S = self.splits(B * H * segments.shape[2], math.ceil(n_virtual / self.block_n), q.device, interpret)
        out = torch.empty(B, H, G, S, D, dtype=torch.float32, device=q.device)
        lse = torch.empty(B, H, G, S, dtype=torch.float32, device=q.device)
        segment_decode_partials(
            q, keys, values, layout, segments, out, lse,
            scale=scale, softcap=softcap, block_n=self.block_n, num_warps=self.num_warps,
        )  # fmt: skip
        if S == 1:
            return out.view(B, H, G, D)
        return merge_partials(out, lse)[0]

    def splits(self, programs: int, n_blocks: int, device: torch.device, interpret: bool) -> int:
        """How many splits to cut ``n_blocks`` blocks into, so that no split is empty."""
        if self.num_splits is not None:
            want = self.num_splits
        elif interpret or device.type != "cuda":
            want = 1  # the interpreter runs programs one after another: splitting only adds work
        else:
            sms = multiprocessors(device.index if device.index is not None else torch.cuda.current_device())
            want = math.ceil(PROGRAMS_PER_SM * sms / programs)
        want = max(1, min(want, n_blocks, MAX_SPLITS))
        return math.ceil(n_blocks / math.ceil(n_blocks / want))

