"""What an attention backend declares, the input checks every backend shares, and dispatch.

A backend runs one decode step of segment-sparse attention (the op of
:func:`sparseattn.ops.attention.segment_attention`) and declares what it supports, xformers-style:
``SUPPORTED_DEVICES``, ``SUPPORTED_DTYPES``, ``SUPPORTED_HEAD_DIMS`` and a :meth:`refusal` that says
in words why it cannot run a given call (``None`` when it can). :func:`select_backend` walks a
priority list and, when nothing fits, raises with every backend tried and its reason: there is no
silent fallback to a slower path.

Shapes (as in :mod:`sparseattn.ops.attention`): ``q: [B, H_kv, G, D]``,
``keys, values: [B, H_kv, t_cap, D]`` (usually a view of a larger capacity buffer),
``segments: [B, H_kv, G', k]`` with ``G'`` in ``{1, G}``.
"""

from __future__ import annotations

from collections.abc import Container, Sequence
from typing import Protocol, runtime_checkable

import torch

from sparseattn.ops.layout import SegmentLayout


@runtime_checkable
class AttentionBackend(Protocol):
    """One implementation of ``segment_attention``; see the module docstring for the shapes."""

    name: str
    SUPPORTED_DEVICES: tuple[str, ...]
    SUPPORTED_DTYPES: tuple[torch.dtype, ...]
    SUPPORTED_HEAD_DIMS: Container[int]

    def refusal(
        self, q: torch.Tensor, keys: torch.Tensor, layout: SegmentLayout, segments: torch.Tensor, softcap: float | None = None
    ) -> str | None:
        """Why this backend cannot run the call, in words; ``None`` when it can."""
        ...

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
        """``[B, H_kv, G, D]`` in float32 (float64 for float64 inputs); raises ValueError when it refuses."""
        ...


def describe(x: torch.Tensor) -> str:
    """``[2, 2, 3, 64] torch.float16 on cpu``: how an error message shows a tensor."""
    return f"{list(x.shape)} {x.dtype} on {x.device.type}"


def head_dim_range(dims: range) -> str:
    return f"{dims.start}..{dims.stop - 1}"


def declared_refusal(
    backend: AttentionBackend, q: torch.Tensor, devices: tuple[str, ...] | None = None
) -> str | None:
    """The refusals that follow from a backend's declarations alone (device, dtype, head dim).

    ``devices`` overrides ``SUPPORTED_DEVICES`` (the Triton interpreter also runs on CPU).
    """
    devices = backend.SUPPORTED_DEVICES if devices is None else devices
    if q.device.type not in devices:
        return f"tensors are on {q.device.type}; it supports {', '.join(devices) or 'no device'}"
    if q.dtype not in backend.SUPPORTED_DTYPES:
        names = ", ".join(str(d).removeprefix("torch.") for d in backend.SUPPORTED_DTYPES)
        return f"dtype {q.dtype} is not supported (supported: {names})"
    dims = backend.SUPPORTED_HEAD_DIMS
    if q.shape[-1] not in dims:
        shown = head_dim_range(dims) if isinstance(dims, range) else ", ".join(map(str, dims))
        return f"head dim {q.shape[-1]} is not supported (supported: {shown})"
    return None


def check_inputs(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    layout: SegmentLayout,
    segments: torch.Tensor,
    softcap: float | None = None,
) -> None:
    """Raise ValueError for a call no backend could run (bad shapes), whatever the backend.

    Segment indices must be distinct and in ``[0, n_segments)``; that is not checked here (it would
    cost a device sync per step): the decode state guarantees it, as for the torch op.
    """
    if q.dim() != 4:
        raise ValueError(f"q must be [B, H_kv, G, D], got shape {tuple(q.shape)}")
    B, H, G, D = q.shape
    for name, x in (("keys", keys), ("values", values)):
        if x.dim() != 4 or x.shape[0] != B or x.shape[1] != H or x.shape[3] != D:
            raise ValueError(f"{name} must be [B={B}, H_kv={H}, t, D={D}] like q {tuple(q.shape)}, got {tuple(x.shape)}")
        if x.shape[2] < layout.length:
            raise ValueError(f"{name} hold {x.shape[2]} tokens, fewer than the layout's length {layout.length}")
        if x.device != q.device:
            raise ValueError(f"{name} are on {x.device} but q is on {q.device}")
    if values.dtype != keys.dtype:
        raise ValueError(f"keys are {keys.dtype} but values are {values.dtype}")
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
    if softcap is not None and not softcap > 0:
        raise ValueError(f"softcap must be > 0 (or None), got {softcap}")


def default_backends() -> tuple[AttentionBackend, ...]:
    """The priority list ``auto`` walks: the fused kernels first (Triton on CUDA, C on the CPU), the torch op last."""
    # Imported here: the backend modules import this one.
    from sparseattn.backends.cpu_backend import CpuBackend
    from sparseattn.backends.torch_backend import TorchBackend
    from sparseattn.backends.triton_backend import TritonBackend
    from sparseattn.backends.xformers_backend import XformersBackend

    return (TritonBackend(), XformersBackend(), CpuBackend(), TorchBackend())


def select_backend(
    name: str = "auto",
    *,
    q: torch.Tensor,
    keys: torch.Tensor,
    layout: SegmentLayout,
    segments: torch.Tensor,
    softcap: float | None = None,
    backends: Sequence[AttentionBackend] | None = None,
) -> AttentionBackend:
    """The backend that will run this call: ``name``, or for ``"auto"`` the first in priority order that accepts.

    ``"auto"`` never picks Triton for CPU tensors (that would be its interpreter); name it to test it.

    Args:
        name: ``"auto"`` or a backend's ``name`` (``"triton"``, ``"xformers"``, ``"cpu"``, ``"torch"``).
        q, keys, layout, segments, softcap: the call to run (see the module docstring for shapes).
        backends: the priority list (default: :func:`default_backends`).
    Raises:
        ValueError: the name is unknown, or the named backend (for ``"auto"``: every backend)
            refuses; the message lists each backend tried and why it refused.

    Example:
        >>> from sparseattn.ops.layout import SegmentLayout
        >>> lay = SegmentLayout(length=10, sinks=1, segment_size=3, n_segments=3)
        >>> kw = dict(q=torch.randn(1, 1, 2, 8), keys=torch.randn(1, 1, 10, 8), layout=lay,
        ...           segments=torch.zeros(1, 1, 1, 1, dtype=torch.long))
        >>> select_backend("torch", **kw).name
        'torch'
        >>> select_backend("xformers", **kw)  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        ValueError: backend 'xformers' cannot run segment_attention for q [1, 1, 2, 8] torch.float32 on cpu, ...:
          - xformers: ...
    """
    backends = default_backends() if backends is None else tuple(backends)
    names = [b.name for b in backends]
    if name == "auto":
        candidates = backends
    elif name in names:
        candidates = tuple(b for b in backends if b.name == name)
    else:
        raise ValueError(f"unknown backend {name!r}; choose one of {', '.join(map(repr, ['auto', *names]))}")
    refusals = []
    for backend in candidates:
        if name == "auto" and backend.name == "triton" and q.device.type == "cpu":
            # On CPU the kernel could only run in the Triton interpreter, a test vehicle far slower than torch.
            refusals.append("  - triton: auto does not use the Triton interpreter on cpu (name 'triton' to test it)")
            continue
        reason = backend.refusal(q, keys, layout, segments, softcap)
        if reason is None:
            return backend
        refusals.append(f"  - {backend.name}: {reason}")
    call = f"segment_attention for q {describe(q)}, keys {describe(keys)}, softcap={softcap}"
    head = f"backend {name!r} cannot run {call}" if name != "auto" else f"no backend can run {call}; tried in priority order"
    raise ValueError(head + ":\n" + "\n".join(refusals))


def refuse_or_check(
    backend: AttentionBackend,
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    layout: SegmentLayout,
    segments: torch.Tensor,
    softcap: float | None,
) -> None:
    """Check the inputs, then raise ValueError with the backend's reason if it refuses (no fallback)."""
    check_inputs(q, keys, values, layout, segments, softcap)
    reason = backend.refusal(q, keys, layout, segments, softcap)
    if reason is not None:
        raise ValueError(f"the {backend.name} backend cannot run segment_attention for q {describe(q)}: {reason}")
