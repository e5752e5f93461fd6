"""The Triton backend: a flash-decoding style segment-sparse decode kernel, and the LSE merge of its splits.

Triton is imported lazily (``import sparseattn`` works without it); a missing triton, CPU tensors
without the interpreter, or an unsupported dtype or head dim are refusals, not import errors.

Design (kernels in :mod:`sparseattn.backends.triton_kernels`):

* grid ``(B * H_kv * G', n_splits)``: one program per (batch, KV head, selection) and split. With a
  shared selection (``G' = 1``) one program holds all ``G`` query heads of the KV group as the M
  dimension of ``tl.dot``, so each K/V block is loaded once for the whole group. One selection per
  query head (``G' = G``) is attended as the union of the group's selections (:func:`union_selection`):
  one program per KV group again, each segment any of its heads listed read once, each head's logits
  masked to its own segments (the kernel's ``ROW_BITS``), where ``G`` programs read the overlap ``G`` times.
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
from typing import Any, ClassVar, NamedTuple

import torch

from sparseattn.backends.base import BackendBase, Capability, declared_refusal, every_token_a_sink, package_missing
from sparseattn.ops.layout import SegmentLayout

#: Splits per row are capped so the merge kernel holds all of a row's states in one tile.
MAX_SPLITS = 64

#: The grid aims at this many programs per streaming multiprocessor by default (TritonBackend.programs_per_sm).
#: Each program walks its tokens with loads whose addresses come from the selection (no pipelining), so
#: it is latency-bound: on an H200, 2 per SM read a dense 4.3 GB cache at 1.9 TB/s (0.46 of the copy
#: bandwidth), where more programs in flight hide more of the latency.
PROGRAMS_PER_SM = 8


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


class Kernels(NamedTuple):
    """The Triton kernels of :mod:`sparseattn.backends.triton_kernels`, wrapped for one mode."""

    segment_decode: Any
    merge_partials: Any
    segment_log_mass: Any
    bound_scores: Any
    slot_attention: Any


#: The helpers the kernels call (wrapped like them, bound in the kernels' module under these names).
HELPERS = ("soft_cap_logits", "slot_logits")


@functools.cache
def kernels(interpret: bool) -> Kernels:
    """The kernels wrapped for the interpreter or the compiler (see :func:`interpreting`)."""
    import triton.language

    from sparseattn.backends import triton_kernels as tk

    tk.tl = triton.language
    if interpret:
        from triton.runtime.interpreter import InterpretedFunction as wrap

        options = {}
    else:
        from triton.runtime import JITFunction as wrap

        # Layout counters and lengths change every step; specialising on them (== 1, % 16) would recompile.
        options = {
            # seg_size too: a rebuild changes it, and a size divisible by 16 would compile a variant mid-decode.
            "segment_decode_kernel": ["sink_end", "seg_size", "n_sel", "tail_start", "n_virtual", "tokens_per_split"],
            "segment_log_mass_kernel": ["n_segments", "seg_size", "n_listed"],
            "bound_scores_kernel": ["n_segments"],
            "slot_attention_kernel": ["n_slots"],
        }
    for name in HELPERS:  # the plain function is kept aside: a second mode would otherwise wrap a wrapper
        plain = tk.__dict__.setdefault(f"_{name}_plain", getattr(tk, name))
        setattr(tk, name, wrap(plain))

    def wrapped(name: str):
        fn = getattr(tk, name)
        return wrap(fn) if interpret else wrap(fn, do_not_specialize=options.get(name, ()))

    return Kernels(
        wrapped("segment_decode_kernel"), wrapped("merge_partials_kernel"), wrapped("segment_log_mass_kernel"),
        wrapped("bound_scores_kernel"), wrapped("slot_attention_kernel"),
    )  # fmt: skip


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
        merge = kernels(interpreting()).merge_partials
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


#: Query heads of a KV group whose selections :func:`union_selection` can join (their bit sets are int32).
MAX_UNION_ROWS = 31


class UnionSelection(NamedTuple):
    """A KV group's per-head selections as one list (:func:`union_selection`)."""

    segments: torch.Tensor  #: ``[B, H_kv, 1, U]`` int64: the segments some head attends, ascending, then unused entries
    bits: torch.Tensor  #: ``[B, H_kv, 1, U]`` int32: bit ``g`` set where query head ``g`` attends the segment (0: unused)
    count: torch.Tensor  #: ``[B, H_kv]`` int32: the segments in use (the kernel walks only these)


def union_selection(segments: torch.Tensor, valid: torch.Tensor | None, n_segments: int) -> UnionSelection:
    """The union of a KV group's per-head selections, and which heads attend each of its segments.

    ``segments [B, H_kv, G, k]`` (each head's list of distinct segments, as every selector gives), ``valid`` (None,
    or flags broadcastable to it: a listed segment is attended only where flagged) -> :class:`UnionSelection` of
    ``U = min(G k, n_segments)`` entries: the segments some head attends in ascending order, then unused entries
    (bits 0: the kernel walks and reads none of them). Static shapes, no read back to the host (a CUDA graph can
    capture it).

    >>> union = union_selection(torch.tensor([[[[3, 0], [0, 2]]]]), None, 5)
    >>> union.segments.flatten().tolist(), union.bits.flatten().tolist(), union.count.tolist()  # 0: both heads (0b11)
    ([0, 2, 3, 1], [3, 2, 1, 0], [[3]])
    """
    B, H, G, k = segments.shape
    if G > MAX_UNION_ROWS:
        raise ValueError(f"union_selection: {G} query heads per KV group; allowed: at most {MAX_UNION_ROWS} (int32 bit sets)")
    listed = segments.long()
    flagged = torch.ones_like(listed, dtype=torch.bool) if valid is None else valid.bool().expand_as(listed)
    # Head by head, its bit written where it attends (a set: a segment listed twice by one head is one bit) and or-ed in;
    # slot n_segments takes the unflagged. Two [B, H, S] buffers whatever G (a bit per head, not a row per head).
    slots = torch.where(flagged, listed, n_segments)
    bits = torch.zeros(B, H, n_segments + 1, dtype=torch.int32, device=listed.device)
    mine = torch.empty_like(bits)
    for g in range(G):
        bits.bitwise_or_(mine.zero_().scatter_(-1, slots[:, :, g], 1 << g))
    bits = bits[..., :n_segments]
    U = min(G * k, n_segments)
    union = (bits == 0).to(torch.uint8).argsort(dim=-1, stable=True)[..., :U]  # attended segments first, ascending
    return UnionSelection(union.unsqueeze(2), bits.gather(-1, union).unsqueeze(2), (bits != 0).sum(-1, dtype=torch.int32))


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
    valid: torch.Tensor | None = None,
    count: torch.Tensor | None = None,
    block_n: int = 64,
    num_warps: int = 4,
) -> None:
    """Launch the split kernel: write every split's state into ``out [B, H_kv, G, S, D]`` and ``lse [B, H_kv, G, S]``.

    ``S = out.shape[3]`` splits share the ``n_virtual = sinks + k * segment_size + tail`` attended
    tokens in chunks of whole blocks; a split past the end writes ``lse = -inf`` and a zero output.
    ``valid [B, H_kv, G', k]`` (optional): only the flagged listed segments are attended; with ``count [B, H_kv]``
    (int32), a union's bit sets of the rows attending each listed segment and the segments in use
    (:func:`union_selection`). Inputs are not checked here (:class:`TritonBackend` does that).
    """
    B, H, G, D = q.shape
    Gs, k = segments.shape[2], segments.shape[3]
    S = out.shape[3]
    n_virtual = layout.sink_end + k * layout.segment_size + layout.tail_size
    tokens_per_split = math.ceil(math.ceil(n_virtual / block_n) / S) * block_n
    scale = D**-0.5 if scale is None else scale
    rows = G // Gs
    interpret = interpreting()
    launch = kernels(interpret).segment_decode[(B * H * Gs, S)]
    flags = segments if valid is None else valid.expand(B, H, Gs, k)  # a stand-in pointer when unmasked: never read
    if flags.dtype == torch.bool:
        flags = flags.view(torch.uint8)  # the same bytes; triton loads bool as int1
    with on_device(q.device):
        launch(
            q, keys, values, segments, flags, segments if count is None else count, out, lse,  # COUNT: a stand-in, unread, without a union
            *q.stride(), *keys.stride(), *values.stride(), *segments.stride(), *flags.stride(), *out.stride(), *lse.stride(),
            H, Gs, rows, D,
            layout.sink_end, layout.segment_size, k, layout.tail_start, n_virtual, tokens_per_split,
            float(scale), float(softcap or 0.0),
            HAS_SOFTCAP=softcap is not None,
            MASKED=valid is not None,
            ROW_BITS=count is not None,
            # The interpreter multiplies bf16 bit patterns in tl.dot (triton-lang/triton#11584): upcast there.
            UPCAST_DOT=interpret and q.dtype == torch.bfloat16,
            BLOCK_G=triton_block(rows, 16), BLOCK_N=block_n, BLOCK_D=triton_block(D, 16),
            num_warps=num_warps,
        )  # fmt: skip


def segment_log_mass_triton(
    raw: torch.Tensor, factor: float, queries: torch.Tensor, index: torch.Tensor, *, num_warps: int = 4
) -> torch.Tensor:
    """Exact log masses ``[B, H, R, m]`` (float32) of listed segments, their keys read in place.

    ``raw: [B, H, S, c, D]`` the segments' keys (a view of the cache, storage dtype, unscaled),
    ``queries: [B, H, R, D]`` pre-scaled, ``index: [B, H, R', m]`` (``R'`` in ``{1, R}``). Unchecked.
    """
    B, H, S, c, D = raw.shape
    R = queries.shape[2]
    lists, m = index.shape[2], index.shape[3]
    out = torch.empty(B, H, R, m, dtype=torch.float32, device=queries.device)
    if out.numel() == 0:
        return out
    rows = R // lists
    block_r, block_d = triton_block(rows, 1), triton_block(D, 16)
    block_c = min(triton_block(c, 1), register_tile(block_r * block_d))  # a [rows, c, d] product in registers
    segs = SEGMENTS_PER_PROGRAM  # fixed: a shortlist that grows with the context compiles no second variant
    with on_device(queries.device):
        kernels(interpreting()).segment_log_mass[(B * H * lists, -(-m // segs))](
            queries, raw, index, out,
            *queries.stride(), *raw.stride(), *index.stride(), *out.stride(),
            H, lists, rows, S, c, D, m, float(factor),
            BLOCK_R=block_r, BLOCK_C=block_c, BLOCK_D=block_d, SEGS=segs, num_warps=num_warps,
        )  # fmt: skip
    return out


#: Listed segments one program of the log-mass kernel takes (issue 48: one program per segment streamed the
#: rerank's keys at 0.42 TB/s on an H200, its programs too short to keep loads in flight). Not yet timed.
SEGMENTS_PER_PROGRAM = 4


#: Elements of the ``[rows, tokens, d]`` product a program of the log-mass and bound kernels holds at once.
REGISTER_TILE = 8192


def register_tile(per_token: int) -> int:
    """The power-of-two number of tokens (or segments) whose ``per_token`` products fit :data:`REGISTER_TILE`."""
    n = max(1, REGISTER_TILE // per_token)
    return 1 << (n.bit_length() - 1)


def bound_scores_triton(low: torch.Tensor, high: torch.Tensor, queries: torch.Tensor, *, num_warps: int = 4) -> torch.Tensor:
    """Quest's bounds ``[B, H, G, S]`` (float32) of ``queries: [B, H, G, D]`` over ``low, high: [B, H, S, D]``. Unchecked."""
    B, H, G, D = queries.shape
    S = low.shape[2]
    out = torch.empty(B, H, G, S, dtype=torch.float32, device=queries.device)
    if out.numel() == 0:
        return out
    block_g, block_d = triton_block(G, 1), triton_block(D, 16)
    block_s = register_tile(block_g * block_d)  # a [G, segments, d] product in registers
    with on_device(queries.device):
        kernels(interpreting()).bound_scores[(B * H, -(-S // block_s))](
            queries, low, high, out,
            *queries.stride(), *low.stride(), *high.stride(), *out.stride(),
            H, G, S, D,
            BLOCK_G=block_g, BLOCK_S=block_s, BLOCK_D=block_d, num_warps=num_warps,
        )  # fmt: skip
    return out


_KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
#: tl.dot needs K >= 16; dims that are not powers of two are padded to one and masked.
_HEAD_DIMS = range(16, 257)


@dataclass(frozen=True)
class TritonBackend(BackendBase):
    """Every hot-path op by Triton kernels on CUDA (or on CPU in the Triton interpreter, for tests).

    ``segment_attention`` (and its masked and log-sum-exp forms) and ``dense`` are the split kernel and
    the LSE merge; ``segment_log_mass`` (radar+'s rerank), ``bound_scores`` (Quest's scoring) and
    ``slot_attention`` (the evicting methods) are one kernel each, reading the cache in place.

    Fields:
        block_n: attended tokens per block (a power of two >= 16).
        num_splits: splits of the attended tokens per row (None: enough programs for
            ``programs_per_sm`` per multiprocessor; one split in the interpreter).
        num_warps: warps per program.
        programs_per_sm: the occupancy ``num_splits=None`` aims at.
        union: selections per query head attended as their union, one program per KV group reading each
            segment once (:func:`union_selection`); False: one program per query head (each reads its own
            segments: the overlap once per head), kept for the A/B row of ``benchmarks/attention.py``.

    With ``TRITON_INTERPRET=1`` set before triton is first imported, kernels run in the Triton
    interpreter, which also accepts CPU tensors when the backend is named (slow: for tests; ``auto``
    keeps to the declared devices).
    """

    block_n: int = 64
    num_splits: int | None = None
    num_warps: int = 4
    programs_per_sm: int = PROGRAMS_PER_SM
    union: bool = True

    name: ClassVar[str] = "triton"
    REQUIRES: ClassVar[tuple[str, ...]] = ("triton",)
    CAPABILITIES: ClassVar[Mapping[str, Capability]] = {
        "segment_attention": Capability(devices=("cuda",), dtypes=_KERNEL_DTYPES, head_dims=_HEAD_DIMS),
        "segment_log_mass": Capability(devices=("cuda",), dtypes=(torch.float32,), head_dims=_HEAD_DIMS),
        "slot_attention": Capability(devices=("cuda",), dtypes=_KERNEL_DTYPES, head_dims=_HEAD_DIMS),
        "dense": Capability(devices=("cuda",), dtypes=_KERNEL_DTYPES, head_dims=_HEAD_DIMS),
        "bound_scores": Capability(devices=("cuda",), dtypes=(torch.float32,), head_dims=_HEAD_DIMS),
    }

    def __post_init__(self) -> None:
        if self.block_n < 16 or self.block_n & (self.block_n - 1):
            raise ValueError(f"TritonBackend.block_n must be a power of two >= 16, got {self.block_n}")
        if self.num_splits is not None and not 1 <= self.num_splits <= MAX_SPLITS:
            raise ValueError(f"TritonBackend.num_splits must be in 1..{MAX_SPLITS} or None, got {self.num_splits}")
        if self.num_warps < 1 or self.num_warps & (self.num_warps - 1):
            raise ValueError(f"TritonBackend.num_warps must be a power of two, got {self.num_warps}")
        if not isinstance(self.programs_per_sm, int) or self.programs_per_sm < 1:
            raise ValueError(f"TritonBackend.programs_per_sm must be an int >= 1, got {self.programs_per_sm!r}")
        if not isinstance(self.union, bool):
            raise ValueError(f"TritonBackend.union must be True or False, got {self.union!r}")

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
        if op in ("segment_log_mass", "bound_scores"):  # float32 queries over keys or summaries of a storage dtype
            if keys.dtype not in _KERNEL_DTYPES:
                return f"the {'keys' if op == 'segment_log_mass' else 'summaries'} are {keys.dtype}; the kernel reads float16, bfloat16 or float32"
        elif keys.dtype != q.dtype:
            return f"q is {q.dtype} but keys are {keys.dtype}; the kernel needs one dtype for q, keys and values"
        return None

    def run_segment_attention(self, q, keys, values, layout, segments, scale, softcap, workspace):
        """``[B, H_kv, G, D]`` float32. ``workspace`` is unused."""
        return self._attend(q, keys, values, layout, segments, None, scale, softcap)[0]

    # The optional ops of base.EXTENSION_OPS: their arguments are typed once, in their protocols (as the op
    # methods' are in AttentionBackend). Unchecked: the decode state had ``segment_attention`` accept these
    # inputs.

    def segment_attention_masked(self, q, keys, values, layout, segments, valid, scale=None, softcap=None):
        """:class:`~sparseattn.backends.base.MaskedSegmentAttention`: the listed segments not flagged in ``valid``
        are masked in the kernel and not read."""
        return self._attend(q, keys, values, layout, segments, valid, scale, softcap)[0]

    def segment_attention_lse(self, q, keys, values, layout, segments, valid=None, scale=None, softcap=None):
        """:class:`~sparseattn.backends.base.SegmentAttentionLSE`: the output and each query head's log-sum-exp
        ``[B, H_kv, G]`` (the merge of the splits computes it)."""
        return self._attend(q, keys, values, layout, segments, valid, scale, softcap)

    def _attend(self, q, keys, values, layout, segments, valid, scale, softcap) -> tuple[torch.Tensor, torch.Tensor]:
        B, H, G, D = q.shape
        interpret = interpreting()
        count = None
        if self.union and 1 < segments.shape[2] <= MAX_UNION_ROWS:  # one selection per query head: their union, read once
            segments, valid, count = union_selection(segments, valid, layout.n_segments)
        n_virtual = layout.sink_end + segments.shape[-1] * layout.segment_size + layout.tail_size
        S = self.splits(B * H * segments.shape[2], math.ceil(n_virtual / self.block_n), q.device, interpret)
        out = torch.empty(B, H, G, S, D, dtype=torch.float32, device=q.device)
        lse = torch.empty(B, H, G, S, dtype=torch.float32, device=q.device)
        segment_decode_partials(
            q, keys, values, layout, segments, out, lse,
            scale=scale, softcap=softcap, valid=valid, count=count, block_n=self.block_n, num_warps=self.num_warps,
        )  # fmt: skip
        if S == 1:
            return out.view(B, H, G, D), lse.view(B, H, G)
        return merge_partials(out, lse)

    def run_dense(self, q, keys, values, scale, softcap):
        """Float32 out: the split kernel with every token a sink."""
        every, none = every_token_a_sink(q, keys)
        return self._attend(q, keys, values, every, none, None, scale, softcap)[0]

    def run_segment_log_mass(self, segment_keys, queries, index):
        """Float32 out, the keys read in place."""
        return segment_log_mass_triton(segment_keys.raw, segment_keys.factor, queries, index)

    def run_bound_scores(self, low, high, queries):
        """Float32 out."""
        return bound_scores_triton(low, high, queries)

    def run_slot_attention(self, q, keys, values, den_weight, num_weight, scale, softcap, floor_weight):
        """:func:`sparseattn.ops.slots.slot_attention` by one kernel: ``(out [B, H, G, T, D], probs [B, H, G, T, S])``
        float32. Blocks of 64 slots, 4 warps (not the backend's ``block_n`` and ``num_warps``)."""
        B, H, G, T, D = q.shape
        S = keys.shape[2]
        scale = D**-0.5 if scale is None else scale
        out = torch.empty(B, H, G, T, D, dtype=torch.float32, device=q.device)
        probs = torch.empty(B, H, G, T, S, dtype=torch.float32, device=q.device)
        weighted = den_weight is not None or num_weight is not None or floor_weight is not None
        ones = None
        if weighted and (den_weight is None or num_weight is None):
            ones = torch.ones(B, H, S, dtype=torch.float32, device=q.device)
        a = den_weight if den_weight is not None else ones
        b = num_weight if num_weight is not None else ones
        weights = [w.to(torch.float32).contiguous() if w is not None else None for w in (a, b, floor_weight)]
        a, b, f = (w if w is not None else keys for w in weights)  # a stand-in pointer for an unused weight: never read
        w_stride = a.stride() if weighted else (0, 0, 0)
        rows = G * T
        q2, out2, probs2 = q.reshape(B, H, rows, D), out.view(B, H, rows, D), probs.view(B, H, rows, S)
        block_m = triton_block(rows, 16) if rows <= 64 else 64
        with on_device(q.device):
            kernels(interpreting()).slot_attention[(B * H, -(-rows // block_m))](
                q2, keys, values, a, b, f, out2, probs2,
                *q2.stride(), *keys.stride(), *values.stride(), *w_stride, *out2.stride(), *probs2.stride(),
                H, rows, T, S, D, float(scale), float(softcap or 0.0),
                WEIGHTED=weighted, HAS_FLOOR=floor_weight is not None, HAS_SOFTCAP=softcap is not None,
                BLOCK_M=block_m, BLOCK_S=64, BLOCK_D=triton_block(D, 16), num_warps=4,
            )  # fmt: skip
        return out, probs

    def splits(self, programs: int, n_blocks: int, device: torch.device, interpret: bool) -> int:
        """How many splits to cut ``n_blocks`` blocks into, so that no split is empty."""
        if self.num_splits is not None:
            want = self.num_splits
        elif interpret or device.type != "cuda":
            want = 1  # the interpreter runs programs one after another: splitting only adds work
        else:
            sms = multiprocessors(device.index if device.index is not None else torch.cuda.current_device())
            want = math.ceil(self.programs_per_sm * sms / programs)
        want = max(1, min(want, n_blocks, MAX_SPLITS))
        return math.ceil(n_blocks / math.ceil(n_blocks / want))
