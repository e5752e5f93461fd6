"""Attention backends for one decode step of segment-sparse attention, and dispatch between them.

``select_backend("auto", q=..., keys=..., layout=..., segments=...)`` returns the first backend in
priority order (triton, xformers, cpu, torch) that accepts the call, or raises with each refusal. Triton
is imported only when the Triton backend runs, so this package imports without it; the cpu backend's C
kernel is compiled on its first use (a refusal, not an import error, where no compiler is found).
"""

from sparseattn.backends.base import AttentionBackend, check_inputs, default_backends, select_backend
from sparseattn.backends.cpu_backend import CpuBackend
from sparseattn.backends.naive import merge_partials_ref
from sparseattn.backends.torch_backend import TorchBackend
from sparseattn.backends.triton_backend import TritonBackend, merge_partials
from sparseattn.backends.xformers_backend import XformersBackend

__all__ = [
    "AttentionBackend",
    "CpuBackend",
    "TorchBackend",
    "TritonBackend",
    "XformersBackend",
    "check_inputs",
    "default_backends",
    "merge_partials",
    "merge_partials_ref",
    "select_backend",
]
