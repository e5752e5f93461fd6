"""The machine's measured read bandwidth: the floor every speed figure of a memory-bound step is held to.

A decode step that attends a long context reads keys, values and summaries once each; its time can be
no lower than those bytes over what the machine can read per second. That rate is measured here, not
assumed: ``sa_read_chunks`` (``backends/bandwidth.c``, built like the other C kernels) streams a buffer
of ``mib`` MiB (far above the last-level cache, touched first so no page is the shared zero page) in
chunks of ``chunk`` bytes at shuffled offsets, prefetching the next chunk as the paged kernels do, on
``threads`` OpenMP threads. ``chunk=None`` reads the buffer in order in 1 MiB chunks (the sequential
figure). The paged cache's reads are scattered pages (8 KB of keys and values per page and KV head at
32-token bf16 pages, 4 KB of keys, 256 B - 2 KB of a page's summaries), so :func:`machine_bandwidth`
measures those sizes too.

>>> bw = read_bandwidth(threads=1, chunk=4096, mib=64, repeats=1)
>>> bw.threads, bw.chunk, bw.best_gbps > 0
(1, 4096, True)
"""

from __future__ import annotations

import ctypes
import functools
import statistics
import time
from dataclasses import asdict, dataclass

import torch

from sparseattn.backends.cpu_kernels import build_library

__all__ = ["Bandwidth", "CHUNKS", "machine_bandwidth", "read_bandwidth"]

#: Chunk sizes :func:`machine_bandwidth` measures: sequential, a page's keys and values (32 bf16 tokens, head dim 64),
#: its keys, a segment's values, a centroid row.
CHUNKS: tuple[int | None, ...] = (None, 8192, 4096, 1024, 256)


@dataclass(frozen=True)
class Bandwidth:
    """One measurement: ``threads``, ``chunk`` bytes (None: sequential), the median and best GB/s (1e9 bytes/s) of ``repeats``."""

    threads: int
    chunk: int | None
    median_gbps: float
    best_gbps: float
    mib: int
    repeats: int


@functools.cache
def _library() -> ctypes.CDLL:
    lib = build_library("sparseattn.backends", "bandwidth.c", ("sa_read_chunks",))
    lib.sa_read_chunks.restype = ctypes.c_double
    lib.sa_read_chunks.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int]
    return lib


@functools.cache
def _buffer(mib: int) -> torch.Tensor:
    return torch.ones(mib * 2**20, dtype=torch.uint8)  # written once: every page backed by its own memory


def read_bandwidth(threads: int = 1, chunk: int | None = None, mib: int = 512, repeats: int = 5, seed: int = 0) -> Bandwidth:
    """Read ``mib`` MiB in chunks of ``chunk`` bytes (None: in order, 1 MiB chunks) on ``threads`` threads, ``repeats`` times."""
    for name, value, least in (("threads", threads, 1), ("mib", mib, 1), ("repeats", repeats, 1)):
        if not isinstance(value, int) or value < least:
            raise ValueError(f"read_bandwidth: {name}={value!r}; allowed: an integer >= {least}")
    if chunk is not None and (not isinstance(chunk, int) or chunk < 64 or chunk % 64 or chunk > mib * 2**20):
        raise ValueError(f"read_bandwidth: chunk={chunk!r}; allowed: None (sequential) or a multiple of 64 bytes up to the buffer")
    buf = _buffer(mib)
    size = 2**20 if chunk is None else chunk
    n = buf.numel() // size
    offsets = torch.arange(n, dtype=torch.int64) * size
    if chunk is not None:  # scattered, as a block table scatters pages
        offsets = offsets[torch.randperm(n, generator=torch.Generator().manual_seed(seed))]
    lib = _library()
    ahead = max(2, -(-8192 // size))  # chunks prefetched ahead: at least 8 KB in flight (fewer leaves small chunks latency-bound)
    lib.sa_read_chunks(buf.data_ptr(), size, offsets.data_ptr(), n, ahead, threads)  # warm: library, TLB
    rates = []
    for _ in range(repeats):
        start = time.perf_counter()
        lib.sa_read_chunks(buf.data_ptr(), size, offsets.data_ptr(), n, ahead, threads)
        rates.append(n * size / (time.perf_counter() - start) / 1e9)
    return Bandwidth(threads, chunk, statistics.median(rates), max(rates), mib, repeats)


@functools.cache
def machine_bandwidth(threads: tuple[int, ...] = (1, 2), chunks: tuple[int | None, ...] = CHUNKS, mib: int = 512,
                      repeats: int = 5) -> list[dict]:  # fmt: skip
    """Every (threads, chunk) of :func:`read_bandwidth`, as JSON-ready rows (measured once per process)."""
    return [asdict(read_bandwidth(t, c, mib, repeats)) for t in threads for c in chunks]
