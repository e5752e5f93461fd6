"""The backend interface: the hot-path ops, what a backend declares for each, and the checks they share.

A backend implements some of the hot-path ops (:data:`OPS`) and declares, per op, the devices,
dtypes and head dims it accepts (a :class:`Capability`, xformers-style), the packages it needs
(``REQUIRES``), and a :meth:`~AttentionBackend.refusal` that says in words why it cannot run a given
call (``None`` when it can). Dispatch (:mod:`sparseattn.backends.registry`) walks the registered
backends in priority order and, when nothing fits, raises with every backend tried and its reason:
there is no silent fallback to a slower path.

This module imports no backend: the backends import it, and the registry imports them.

The ops, their shapes, and their float64 references (:data:`sparseattn.backends.naive.REFERENCES` lists
them, and those of the optional ops of :data:`EXTENSION_OPS`):

* ``segment_attention``: one decode step over sinks, selected segments and tail.
  ``q: [B, H_kv, G, D]``, ``keys, values: [B, H_kv, t_cap, D]`` (usually a view of a larger
  capacity buffer), ``segments: [B, H_kv, G', k]`` with ``G'`` in ``{1, G}`` -> ``[B, H_kv, G, D]``.
* ``segment_log_mass``: exact log masses ``logsumexp_{j in segment} q . k_j`` of listed segments.
  A :class:`~sparseattn.ops.segments.SegmentKeys` view of the segments' keys ``[B, H, S, c, D]``,
  ``queries: [B, H, R, D]`` (pre-scaled, compute dtype), ``index: [B, H, R', m]`` with ``R'`` in
  ``{1, R}`` -> ``[B, H, R, m]``. Dispatch sees ``q = queries`` and ``keys = segment_keys.raw``.
* ``slot_attention``: attention over weighted slots (the evicting methods).
  ``q: [B, H_kv, G, T, D]``, ``keys, values: [B, H_kv, S, D]`` -> ``(out, probs)``.
* ``dense``: one decode step over every stored token. ``q: [B, H_kv, G, D]``,
  ``keys, values: [B, H_kv, t, D]`` -> ``[B, H_kv, G, D]``.
* ``bound_scores``: Quest's bound ``sum_i max(q_i low_i, q_i high_i)`` of every segment.
  ``low, high: [B, H, S, D]`` each segment's channel-wise key minima and maxima, ``queries:
  [B, H, G, D]`` (pre-scaled, compute dtype) -> ``[B, H, G, S]``. Dispatch sees ``q = queries`` and
  ``keys = low``.

Every op method takes ``checked``: with ``checked=True`` (the default) it validates the inputs and
raises ValueError with the backend's reason if it refuses (:class:`BackendBase` does both, for every
backend that subclasses it); a decode state that had the backend accept its inputs once
(:func:`~sparseattn.backends.registry.select_backend`) passes ``checked=False`` on every later step,
so the hot path pays for no checks.
"""

from __future__ import annotations

import functools
import importlib.util
import sys
from collections.abc import Container, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar, Protocol, runtime_checkable

import torch

from sparseattn.ops.layout import SegmentLayout
from sparseattn.ops.segments import check_segment_lists

if TYPE_CHECKING:  # the op's argument type only; ops never import backends at run time
    from sparseattn.ops.buffers import Workspace
    from sparseattn.ops.segments import RestSums, SegmentKeys

#: The hot-path ops, in the order the docs list them; a backend's method for each has the op's name.
OPS = ("segment_attention", "segment_log_mass", "slot_attention", "dense", "bound_scores")

#: Every head dim (the default of :class:`Capability`).
ANY_HEAD_DIM = range(1, sys.maxsize)


@dataclass(frozen=True)
class Capability:
    """What a backend accepts for one op: the query's device and dtype, and the head dim.

    A backend's :meth:`~AttentionBackend.refusal` may refuse more (a cache dtype, a stride, a missing
    compiler); ``auto`` takes a backend only on the devices it declares here.
    """

    devices: tuple[str, ...]
    dtypes: tuple[torch.dtype, ...]
    head_dims: Container[int] = ANY_HEAD_DIM


@runtime_checkable
class AttentionBackend(Protocol):
    """One implementation of some of the hot-path ops; see the module docstring for the ops and shapes."""

    name: str
    #: Packages that must be importable for the backend to run; ``auto`` does not walk it otherwise.
    REQUIRES: tuple[str, ...]
    #: The ops it implements, and what it accepts for each.
    CAPABILITIES: Mapping[str, Capability]

    def refusal(self, op: str, q: torch.Tensor, keys: torch.Tensor, softcap: float | None = None) -> str | None:
        """Why this backend cannot run ``op`` for query ``q`` over ``keys``, in words; ``None`` when it can."""
        ...

    def segment_attention(
        self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, layout: SegmentLayout,
        segments: torch.Tensor, scale: float | None = None, softcap: float | None = None, *,
        workspace: Workspace | None = None, checked: bool = True,
    ) -> torch.Tensor:  # fmt: skip
        """``[B, H_kv, G, D]`` float32 (float64 for float64 inputs). ``workspace``: scratch a backend may reuse."""
        ...

    def segment_log_mass(
        self, segment_keys: SegmentKeys, queries: torch.Tensor, index: torch.Tensor, *, checked: bool = True
    ) -> torch.Tensor:
        """``[B, H, R, m]`` in the queries' dtype (float32 from a kernel)."""
        ...

    def slot_attention(
        self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, den_weight: torch.Tensor | None = None,
        num_weight: torch.Tensor | None = None, scale: float | None = None, softcap: float | None = None,
        floor_weight: torch.Tensor | None = None, *, checked: bool = True,
    ) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        """``(out [B, H_kv, G, T, D], probs [B, H_kv, G, T, S])`` in the compute dtype."""
        ...

    def dense(
        self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float | None = None,
        softcap: float | None = None, *, checked: bool = True,
    ) -> torch.Tensor:  # fmt: skip
        """``[B, H_kv, G, D]`` float32 (float64 for float64 inputs)."""
        ...

    def bound_scores(self, low: torch.Tensor, high: torch.Tensor, queries: torch.Tensor, *, checked: bool = True) -> torch.Tensor:
        """``[B, H, G, S]`` in the queries' dtype (float32 from a kernel)."""
        ...


@runtime_checkable
class MaskedSegmentAttention(Protocol):
    """Optional capability: ``segment_attention`` where each selection attends only some of its listed segments.

    ``valid: [B, H_kv, G', k]`` bool: selection ``(b, h, s)`` attends sinks, tail and the segments
    ``segments[b, h, s, i]`` with ``valid[b, h, s, i]`` (a budget allocation gives heads different
    numbers); the others are not read (any index). A decode state asks with ``isinstance``; without
    it, it gathers the tokens (torch). The float64 reference:
    :func:`~sparseattn.ops.attention.segment_attention_masked_ref`.
    """

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
    ) -> torch.Tensor: ...


@runtime_checkable
class SegmentAttentionLSE(Protocol):
    """Optional capability: masked segment attention that also returns each query head's normaliser.

    ``lse: [B, H_kv, G]`` float32 is ``log sum_j exp(logit_j)`` over the tokens the query head attends
    (soft-capped logits, as the output's softmax), so a caller can add more tokens to the softmax by
    log-sum-exp without reading the attended ones again (a merged rest,
    :class:`~sparseattn.methods.rest.MergedRest`). ``valid`` as :class:`MaskedSegmentAttention` (None:
    every listed segment). The float64 reference: :func:`~sparseattn.ops.attention.segment_attention_lse_ref`.
    """

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
    ) -> tuple[torch.Tensor, torch.Tensor]: ...


@runtime_checkable
class MergedRestAttention(Protocol):
    """Optional capability: masked segment attention with the merged rest of
    :class:`~sparseattn.methods.rest.MergedRest` joined to each query head's softmax, in one call.

    ``sums``: the segments' and blocks' key and value sums and the block size, as the decode state keeps
    them (:class:`~sparseattn.ops.segments.RestSums`). Only for a layout whose window reaches into no
    segment (``layout.tail_start >= layout.segment_end``, as a segment search's state always has it); the
    caller checks. The torch form is :func:`~sparseattn.methods.rest.add_merged_rest` over
    :class:`SegmentAttentionLSE`'s output, the float64 reference
    :func:`~sparseattn.backends.naive.segment_attention_merged_ref` (the op's arguments handed to
    :func:`~sparseattn.ops.merged.merged_attention_ref`).
    """

    def segment_attention_merged(
        self,
        q: torch.Tensor,
        keys: torch.Tensor,
        values: torch.Tensor,
        layout: SegmentLayout,
        segments: torch.Tensor,
        valid: torch.Tensor | None,
        sums: RestSums,
        scale: float,
        softcap: float | None = None,
    ) -> torch.Tensor: ...


#: The optional ops beyond :data:`OPS`: each is the one method of a protocol above, which a backend has
#: or not (a decode state asks with ``isinstance``); they are unchecked, for inputs ``segment_attention``
#: accepted. Their references are in :data:`~sparseattn.backends.naive.REFERENCES` with the others'.
EXTENSION_OPS: Mapping[str, type] = {
    "segment_attention_masked": MaskedSegmentAttention,
    "segment_attention_lse": SegmentAttentionLSE,
    "segment_attention_merged": MergedRestAttention,
}


def describe(x: torch.Tensor) -> str:
    """``[2, 2, 3, 64] torch.float16 on cpu``: how an error message shows a tensor."""
    return f"{list(x.shape)} {x.dtype} on {x.device.type}"


def head_dim_range(dims: range) -> str:
    return f"{dims.start}..{dims.stop - 1}"


@functools.cache
def package_missing(package: str) -> bool:
    """Whether ``package`` cannot be imported (looked up once per process, without importing it)."""
    return importlib.util.find_spec(package) is None


def not_installed(backend: AttentionBackend) -> str | None:
    """``"triton is not installed"`` when a package the backend needs is missing; None otherwise."""
    missing = [p for p in backend.REQUIRES if package_missing(p)]
    return f"{', '.join(missing)} {'is' if len(missing) == 1 else 'are'} not installed" if missing else None


def declared_refusal(
    backend: AttentionBackend, op: str, q: torch.Tensor, devices: tuple[str, ...] | None = None
) -> str | None:
    """The refusals that follow from a backend's declarations alone: the op, the device, dtype and head dim.

    ``devices`` overrides the declared ones (the Triton interpreter also runs on CPU, when named).
    """
    capability = backend.CAPABILITIES.get(op)
    if capability is None:
        implemented = ", ".join(backend.CAPABILITIES) or "none"
        return f"it does not implement {op} (it implements: {implemented})"
    devices = capability.devices if devices is None else devices
    if q.device.type not in devices:
        return f"tensors are on {q.device.type}; it supports {', '.join(devices) or 'no device'}"
    if q.dtype not in capability.dtypes:
        names = ", ".join(str(d).removeprefix("torch.") for d in capability.dtypes)
        return f"dtype {q.dtype} is not supported (supported: {names or 'none'})"
    dims = capability.head_dims
    if q.shape[-1] not in dims:
        shown = head_dim_range(dims) if isinstance(dims, range) else ", ".join(map(str, dims))
        return f"head dim {q.shape[-1]} is not supported (supported: {shown or 'none'})"
    return None


def check_inputs(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, layout: SegmentLayout, segments: torch.Tensor,
    softcap: float | None = None,
) -> None:  # fmt: skip
    """Raise ValueError for a ``segment_attention`` call no backend could run (bad shapes), whatever the backend.

    Segment indices must be distinct and in ``[0, n_segments)``; that is not checked here (it would
    cost a device sync per step): the decode state guarantees it, as for the torch op.
    """
    check_cache(q, keys, values, layout.length, softcap)
    B, H, G, _ = q.shape
    if segments.dim() != 4 or segments.shape[:2] != (B, H) or segments.shape[2] not in (1, G):
        raise ValueError(f"segments must be [B={B}, H_kv={H}, 1 or {G}, k], got shape {tuple(segments.shape)}")
    if segments.dtype.is_floating_point or segments.dtype.is_complex or segments.dtype == torch.bool:
        raise ValueError(f"segments must hold integer indices, got {segments.dtype}")
    if segments.device != q.device:
        raise ValueError(f"segments are on {segments.device} but q is on {q.device}")
    if segments.shape[-1] > layout.n_segments:
        raise ValueError(f"{segments.shape[-1]} segments selected but the layout has only {layout.n_segments}")
    if layout.sink_end + layout.tail_size == 0 and segments.shape[-1] == 0:
        raise ValueError(f"nothing to attend: the layout {layout} has no sink and no tail, and no segment is selected")


def check_cache(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, length: int, softcap: float | None = None
) -> None:
    """Raise ValueError unless ``q: [B, H_kv, G, D]`` can attend ``keys, values: [B, H_kv, >= length, D]``."""
    if q.dim() != 4:
        raise ValueError(f"q must be [B, H_kv, G, D], got shape {tuple(q.shape)}")
    B, H, _, D = q.shape
    for name, x in (("keys", keys), ("values", values)):
        if x.dim() != 4 or x.shape[0] != B or x.shape[1] != H or x.shape[3] != D:
            raise ValueError(f"{name} must be [B={B}, H_kv={H}, t, D={D}] like q {tuple(q.shape)}, got {tuple(x.shape)}")
        if x.shape[2] < length:
            raise ValueError(f"{name} hold {x.shape[2]} tokens, fewer than the layout's length {length}")
        if x.device != q.device:
            raise ValueError(f"{name} are on {x.device} but q is on {q.device}")
    if values.dtype != keys.dtype:
        raise ValueError(f"keys are {keys.dtype} but values are {values.dtype}")
    if softcap is not None and not softcap > 0:
        raise ValueError(f"softcap must be > 0 (or None), got {softcap}")


def check_slots(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> None:
    """Raise ValueError unless ``q: [B, H_kv, G, T, D]`` can attend slots ``keys, values: [B, H_kv, S >= T, D]``."""
    if q.dim() != 5:
        raise ValueError(f"q must be [B, H_kv, G, T, D], got shape {tuple(q.shape)}")
    B, H, _, T, D = q.shape
    for name, x in (("keys", keys), ("values", values)):
        if x.dim() != 4 or x.shape[0] != B or x.shape[1] != H or x.shape[3] != D or x.shape[2] < T:
            raise ValueError(f"{name} must be [B={B}, H_kv={H}, S >= {T}, D={D}] like q {tuple(q.shape)}, got {tuple(x.shape)}")


def check_bounds(low: torch.Tensor, high: torch.Tensor, queries: torch.Tensor) -> None:
    """Raise ValueError unless ``queries: [B, H, G, D]`` can be bounded over ``low, high: [B, H, S, D]``."""
    if queries.dim() != 4:
        raise ValueError(f"queries must be [B, H, G, D], got shape {tuple(queries.shape)}")
    B, H, _, D = queries.shape
    if low.dim() != 4 or low.shape[:2] != (B, H) or low.shape[3] != D or high.shape != low.shape:
        raise ValueError(f"low and high must be [B={B}, H={H}, S, D={D}] alike, got {tuple(low.shape)} and {tuple(high.shape)}")
    if low.device != queries.device or high.device != queries.device:
        raise ValueError(f"the summaries are on {low.device} but the queries on {queries.device}")


def refuse(backend: AttentionBackend, op: str, q: torch.Tensor, keys: torch.Tensor, softcap: float | None = None) -> None:
    """Raise ValueError with the backend's reason if it refuses ``op`` for this call (no fallback)."""
    reason = backend.refusal(op, q, keys, softcap)
    if reason is not None:
        raise ValueError(f"the {backend.name} backend cannot run {op} for q {describe(q)}: {reason}")


def every_token_a_sink(q: torch.Tensor, keys: torch.Tensor) -> tuple[SegmentLayout, torch.Tensor]:
    """``dense`` as ``segment_attention``: a layout whose every stored token is a sink, and the empty
    selection ``[B, H_kv, 1, 0]`` (on ``q``'s device), for a backend whose dense op is its segment kernel."""
    every = SegmentLayout(length=keys.shape[2], sinks=keys.shape[2], segment_size=1, n_segments=0)
    return every, torch.zeros(*q.shape[:2], 1, 0, dtype=torch.long, device=q.device)


class BackendBase:
    """What every backend shares: the op methods, which check a call and hand it to the backend's ``run_<op>``.

    A backend subclasses this, declares ``name``, ``REQUIRES`` and ``CAPABILITIES``, writes
    :meth:`refusal` (usually :func:`declared_refusal` plus what only it knows) and, for each op it
    declares, ``run_<op>``: the op on inputs already checked, with the op method's arguments less
    ``checked``. With ``checked=True`` an op method first raises ValueError for shapes no backend could
    run, then with the backend's reason if it refuses; with ``checked=False`` it only runs. An op the
    backend does not run is refused either way.
    """

    name: ClassVar[str]
    REQUIRES: ClassVar[tuple[str, ...]] = ()
    CAPABILITIES: ClassVar[Mapping[str, Capability]] = {}

    def refusal(self, op: str, q: torch.Tensor, keys: torch.Tensor, softcap: float | None = None) -> str | None:
        return not_installed(self) or declared_refusal(self, op, q)

    def segment_attention(self, q, keys, values, layout, segments, scale=None, softcap=None, *, workspace=None, checked=True):
        """:class:`AttentionBackend`'s ``segment_attention``: the checks when ``checked``, then ``run_segment_attention``."""
        if checked:
            check_inputs(q, keys, values, layout, segments, softcap)
            refuse(self, "segment_attention", q, keys, softcap)
        return self.run_segment_attention(q, keys, values, layout, segments, scale, softcap, workspace)

    def segment_log_mass(self, segment_keys, queries, index, *, checked=True):
        """:class:`AttentionBackend`'s ``segment_log_mass``: the checks when ``checked``, then ``run_segment_log_mass``."""
        if checked:
            check_segment_lists(queries, index)
            refuse(self, "segment_log_mass", queries, segment_keys.raw)
        return self.run_segment_log_mass(segment_keys, queries, index)

    def slot_attention(self, q, keys, values, den_weight=None, num_weight=None, scale=None, softcap=None, floor_weight=None, *, checked=True):
        """:class:`AttentionBackend`'s ``slot_attention``: the checks when ``checked``, then ``run_slot_attention``."""
        if checked:
            check_slots(q, keys, values)
            refuse(self, "slot_attention", q, keys, softcap)
        return self.run_slot_attention(q, keys, values, den_weight, num_weight, scale, softcap, floor_weight)

    def dense(self, q, keys, values, scale=None, softcap=None, *, checked=True):
        """:class:`AttentionBackend`'s ``dense``: the checks when ``checked``, then ``run_dense``."""
        if checked:
            check_cache(q, keys, values, keys.shape[2] if keys.dim() == 4 else 0, softcap)
            refuse(self, "dense", q, keys, softcap)
        return self.run_dense(q, keys, values, scale, softcap)

    def bound_scores(self, low, high, queries, *, checked=True):
        """:class:`AttentionBackend`'s ``bound_scores``: the checks when ``checked``, then ``run_bound_scores``."""
        if checked:
            check_bounds(low, high, queries)
            refuse(self, "bound_scores", queries, low)
        return self.run_bound_scores(low, high, queries)

    # Where an op the backend does not run lands, checked or not: refused with its reason, never a fallback.

    def run_segment_attention(self, q, keys, values, layout, segments, scale, softcap, workspace):
        refuse(self, "segment_attention", q, keys, softcap)
        raise AssertionError(f"unreachable: the {self.name} backend declares segment_attention but does not define it")

    def run_segment_log_mass(self, segment_keys, queries, index):
        refuse(self, "segment_log_mass", queries, segment_keys.raw)
        raise AssertionError(f"unreachable: the {self.name} backend declares segment_log_mass but does not define it")

    def run_slot_attention(self, q, keys, values, den_weight, num_weight, scale, softcap, floor_weight):
        refuse(self, "slot_attention", q, keys, softcap)
        raise AssertionError(f"unreachable: the {self.name} backend declares slot_attention but does not define it")

    def run_dense(self, q, keys, values, scale, softcap):
        refuse(self, "dense", q, keys, softcap)
        raise AssertionError(f"unreachable: the {self.name} backend declares dense but does not define it")

    def run_bound_scores(self, low, high, queries):
        refuse(self, "bound_scores", queries, low)
        raise AssertionError(f"unreachable: the {self.name} backend declares bound_scores but does not define it")
