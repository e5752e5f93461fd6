"""Backends for the hot-path ops (segment attention, exact segment masses, slot attention, dense decode), and dispatch.

``select_backend("auto", op, q=..., keys=...)`` returns the first registered backend in priority
order (triton, xformers, cpu, torch) that declares ``op``, is installed, declares the tensors' device
and accepts the call, or raises with each refusal. The interface is in :mod:`.base`, the registry in
:mod:`.registry`, the float64 references of every op (:data:`OPS` and the optional
:data:`EXTENSION_OPS`) in :mod:`.naive`. Triton is imported only when the Triton backend runs, so this
package imports without it; the cpu backend's C kernel is compiled on its first use (a refusal, not an
import error, where no compiler is found).
"""

from sparseattn.backends.base import EXTENSION_OPS, OPS, AttentionBackend, BackendBase, Capability, check_inputs
from sparseattn.backends.cpu_backend import CpuBackend
from sparseattn.backends.naive import REFERENCES, merge_partials_ref
from sparseattn.backends.registry import (
    BACKENDS,
    backend_names,
    check_backend_name,
    default_backends,
    get_backend,
    select_backend,
)
from sparseattn.backends.torch_backend import TorchBackend
from sparseattn.backends.triton_backend import TritonBackend, merge_partials
from sparseattn.backends.xformers_backend import XformersBackend

__all__ = [
    "BACKENDS",
    "EXTENSION_OPS",
    "OPS",
    "REFERENCES",
    "AttentionBackend",
    "BackendBase",
    "Capability",
    "CpuBackend",
    "TorchBackend",
    "TritonBackend",
    "XformersBackend",
    "backend_names",
    "check_backend_name",
    "check_inputs",
    "default_backends",
    "get_backend",
    "merge_partials",
    "merge_partials_ref",
    "select_backend",
]
