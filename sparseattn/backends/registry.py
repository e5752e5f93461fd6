"""The registered backends, in priority order, and dispatch between them by declared capability.

This is the one place that lists the backends: :data:`BACKENDS` (their names are their own ``name``).
``auto`` walks it in order and takes the first backend that declares the op, is installed, declares
the tensors' device and accepts the call; the methods' ``backend`` fields are checked against it
(:func:`check_backend_name`). A new backend is registered by adding an instance here.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from sparseattn.backends.base import OPS, AttentionBackend, describe, not_installed
from sparseattn.backends.cpu_backend import CpuBackend
from sparseattn.backends.torch_backend import TorchBackend
from sparseattn.backends.triton_backend import TritonBackend
from sparseattn.backends.xformers_backend import XformersBackend

#: Every backend, in the priority order ``auto`` walks: the fused kernels first (Triton on CUDA, C on
#: the CPU), the torch ops last (they run everything).
BACKENDS: tuple[AttentionBackend, ...] = (TritonBackend(), XformersBackend(), CpuBackend(), TorchBackend())


def default_backends() -> tuple[AttentionBackend, ...]:
    """The priority list ``auto`` walks: :data:`BACKENDS`."""
    return BACKENDS


def backend_names(op: str | None = None) -> tuple[str, ...]:
    """Names of the registered backends, in priority order; only those that declare ``op`` when given."""
    return tuple(b.name for b in BACKENDS if op is None or op in b.CAPABILITIES)


def get_backend(name: str) -> AttentionBackend:
    """The registered backend called ``name``; ValueError naming the choices for an unknown name."""
    for backend in BACKENDS:
        if backend.name == name:
            return backend
    raise ValueError(f"unknown backend {name!r}; choose one of {', '.join(map(repr, backend_names()))}")


def check_backend_name(option: str, value: object, op: str, default: str, *, auto: bool) -> None:
    """Raise ValueError unless ``value`` names a backend that declares ``op`` (or is ``"auto"``, if ``auto``).

    For a method's ``backend`` field: ``option`` is how the message names it (``"Dense.backend"``);
    the allowed names are listed with the ``default`` first, then in priority order.

    Example:
        >>> check_backend_name("Dense.backend", "flash", "dense", "torch", auto=False)
        Traceback (most recent call last):
        ...
        ValueError: Dense.backend must be one of ('torch', 'triton', 'cpu'), got 'flash'
    """
    names = (("auto",) if auto else ()) + backend_names(op)
    allowed = (default, *(n for n in names if n != default))
    if not isinstance(value, str) or value not in allowed:
        raise ValueError(f"{option} must be one of {allowed}, got {value!r}")


def auto_refusal(backend: AttentionBackend, op: str, q: torch.Tensor, keys: torch.Tensor, softcap: float | None) -> str | None:
    """Why ``auto`` does not take ``backend`` for this call: undeclared op, missing package, undeclared device, or its refusal."""
    capability = backend.CAPABILITIES.get(op)
    if capability is None:
        return f"it does not implement {op}"
    missing = not_installed(backend)
    if missing is not None:
        return f"{missing} (auto walks only installed backends)"
    if q.device.type not in capability.devices:
        # A backend may run more when named (the Triton interpreter runs CPU tensors, for tests).
        declared = ", ".join(capability.devices) or "no device"
        return f"tensors are on {q.device.type}; auto takes it only on its declared devices ({declared}): name {backend.name!r} to try it"
    return backend.refusal(op, q, keys, softcap)


def select_backend(
    name: str = "auto",
    op: str = "segment_attention",
    *,
    q: torch.Tensor,
    keys: torch.Tensor,
    softcap: float | None = None,
    backends: Sequence[AttentionBackend] | None = None,
) -> AttentionBackend:
    """The backend that will run ``op`` for query ``q`` over ``keys``: ``name``, or for ``"auto"`` the first that accepts.

    A decode state calls this once, on its first step, then calls the backend's method for ``op``
    with ``checked=False`` on every step.

    Args:
        name: ``"auto"`` or a backend's ``name`` (:func:`backend_names`).
        op: one of :data:`~sparseattn.backends.base.OPS`.
        q, keys, softcap: the call to run (see :mod:`sparseattn.backends.base` for each op's shapes).
        backends: the priority list (default: :data:`BACKENDS`).
    Raises:
        ValueError: the name or op is unknown, or the named backend (for ``"auto"``: every backend)
            refuses; the message lists each backend tried and why it refused.

    Example:
        >>> q, keys = torch.randn(1, 1, 2, 8), torch.randn(1, 1, 10, 8)
        >>> select_backend("torch", "segment_attention", q=q, keys=keys).name
        'torch'
        >>> select_backend("auto", "slot_attention", q=q.unsqueeze(3), keys=keys).name
        'torch'
        >>> select_backend("xformers", q=q, keys=keys)  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        ValueError: backend 'xformers' cannot run segment_attention for q [1, 1, 2, 8] torch.float32 on cpu, ...:
          - xformers: ...
    """
    if op not in OPS:
        raise ValueError(f"unknown op {op!r}; the ops are {', '.join(map(repr, OPS))}")
    backends = BACKENDS if backends is None else tuple(backends)
    call = f"{op} for q {describe(q)}, keys {describe(keys)}, softcap={softcap}"
    if name != "auto":
        named = [b for b in backends if b.name == name]
        if not named:
            choices = ", ".join(map(repr, ["auto", *(b.name for b in backends)]))
            raise ValueError(f"unknown backend {name!r}; choose one of {choices}")
        reason = named[0].refusal(op, q, keys, softcap)
        if reason is None:
            return named[0]
        raise ValueError(f"backend {name!r} cannot run {call}:\n  - {name}: {reason}")
    refusals = []
    for backend in backends:
        reason = auto_refusal(backend, op, q, keys, softcap)
        if reason is None:
            return backend
        refusals.append(f"  - {backend.name}: {reason}")
    raise ValueError(f"no backend can run {call}; tried in priority order:\n" + "\n".join(refusals))
