"""The ctypes binding of the paged engine's C kernels (``paged_kernels.c``): built once, each entry point's types,
and why it cannot load. :mod:`sparseattn.vllm.paged_kernel` calls it for the fused step, :mod:`sparseattn.vllm.profile`
to switch the kernels' phase timers."""

from __future__ import annotations

import ctypes
import functools

from sparseattn.backends.cpu_kernels import build_library, build_refusal

__all__ = ["SYMBOLS", "kernel_refusal", "library"]

#: The entry points the library must export (a build without one of them is refused).
SYMBOLS = (
    "sa_paged_decode", "sa_paged_decode_layout", "sa_paged_invalidate", "sa_paged_float16_supported", "sa_paged_split",
    "sa_paged_split_layout",
    "sa_paged_profile", "sa_paged_top_k",
)  # fmt: skip


@functools.cache
def library() -> ctypes.CDLL:
    """``paged_kernels.c`` built (once, cached on disk) and loaded, each entry point's argument and result types set."""
    lib = build_library("sparseattn.vllm", "paged_kernels.c", SYMBOLS)
    i64, i32, ptr = ctypes.c_int64, ctypes.c_int, ctypes.c_void_p
    lib.sa_paged_decode.restype = ctypes.c_int
    lib.sa_paged_decode.argtypes = [ptr]
    lib.sa_paged_decode_layout.restype = i64
    lib.sa_paged_decode_layout.argtypes = [ptr]
    lib.sa_paged_split.restype = ctypes.c_int
    lib.sa_paged_split.argtypes = [ptr, i32]
    lib.sa_paged_split_layout.restype = i64
    lib.sa_paged_split_layout.argtypes = [ptr]
    lib.sa_paged_invalidate.restype = None
    lib.sa_paged_invalidate.argtypes = [ptr, i64, i64, ptr, i64]
    lib.sa_paged_float16_supported.restype = ctypes.c_int
    lib.sa_paged_top_k.restype = ctypes.c_int
    lib.sa_paged_top_k.argtypes = [ptr, i64, i64, ptr]
    lib.sa_paged_profile.restype = ctypes.c_int
    lib.sa_paged_profile.argtypes = [ctypes.c_int, ptr]
    return lib


@functools.cache
def kernel_refusal() -> str | None:
    """Why the fused kernel cannot be built or loaded here, in words; None when it loads."""
    return build_refusal(library)
