"""The CPU kernel of the ``cpu`` backend: built from ``cpu_kernels.c`` on first use, called through ctypes.

The build (:func:`build_library`) serves every C kernel of the package: this one and the paged engine's
(:mod:`sparseattn.vllm.paged_kernel`), both including ``kernel_common.h`` (:data:`HEADER`), the code they share.

No library offers decode attention over a list of token ranges read in place on the CPU (torch's
SDPA needs the tokens as one tensor, so the torch backend gathers a copy first; FlexAttention's CPU
template skips blocks but measured 3x slower per byte here), so the kernel is ours: C with OpenMP,
compiled once per machine with the system C compiler (``$CC``, else ``cc``/``gcc``/``clang``) for the
host CPU (``-march=native``) and cached in :func:`sparseattn.paths.kernel_cache_dir`
(``$SPARSEATTN_HOME/kernels``, default ``~/.cache/sparseattn/kernels``; ``$SPARSEATTN_CACHE/kernels``
where that older variable is set). The shared library links the ``libgomp.so.1`` that torch has
already loaded, so the kernel runs on torch's own OpenMP threads (``torch.get_num_threads()``).

A cached library is not trusted by its name: the build writes a manifest beside it
(``cpu_kernels-<key>.json``: the build key over source, header, compiler, flags and CPU, and the library's
sha256), and a library whose manifest is missing or does not match is rebuilt (to a temporary name,
then renamed), under a file lock so that two processes build once. After loading, the entry points
are looked up; a library without them is refused.

Nothing here raises at import: :func:`cpu_kernel_refusal` says in words why the kernel cannot be
built or loaded (no compiler, a failed compile, a library without the kernel's symbols), and the
backend reports that as its refusal, so ``auto`` falls back to the torch backend and says why.
The reference is :func:`sparseattn.ops.attention.segment_attention_ref`.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import json
import os
import platform
import shutil
import subprocess
import tempfile
from collections.abc import Callable, Mapping
from importlib import resources
from pathlib import Path

import torch

from sparseattn.machine import cpu_flags
from sparseattn.ops.layout import SegmentLayout
from sparseattn.ops.segments import RestSums
from sparseattn.paths import file_lock, kernel_cache_dir
from sparseattn.progress import progress

#: Compile flags: vectorised for this CPU, fast math (libmvec's vector expf), OpenMP.
CFLAGS = ("-O3", "-march=native", "-ffast-math", "-fopenmp", "-fPIC", "-std=c11")
#: Link flags: -lm brings glibc's libmvec (the vector expf/tanhf that -ffast-math calls). The link
#: step has no -ffast-math: with it, gcc < 13 links crtfastmath.o into the library, whose constructor
#: sets flush-to-zero for the whole process when the library loads (hypothesis caught that).
LDFLAGS = ("-shared", "-fopenmp")
LIBS = ("-lm",)

#: Storage dtypes the kernel reads, as the codes ``cpu_kernels.c`` uses.
DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}

#: Most query heads per KV head: the kernel keeps one bit per query head in a 64-bit mask.
MAX_GROUP = 64

_ERRORS = {
    1: "a segment index is outside [0, n_segments)",
    2: "the kernel could not allocate its scratch memory",
    3: "a query head attends no token",
    4: "the kernel was built without this storage dtype",
    5: f"more than {MAX_GROUP} query rows per KV head",
    6: "per_block (segments per merged block) must be >= 1",
}


class KernelBuildError(RuntimeError):
    """The C kernel could not be built or loaded; the message says why."""


#: The entry points the library must export; a library without one of them is not this kernel.
SYMBOLS = ("sa_segment_attention", "sa_segment_log_mass", "sa_merged_rest", "sa_float16_supported")

#: The header every C kernel of the package includes (dtype and status codes, loaders, the online-softmax
#: step), a file of this package: each build copies it beside the kernel's source.
HEADER = "kernel_common.h"


def cache_dir() -> Path:
    """Where the kernel is cached: see :func:`sparseattn.paths.kernel_cache_dir`."""
    return kernel_cache_dir()


def find_compiler() -> str | None:
    """``$CC`` if set, else the first of cc, gcc, clang on the PATH."""
    if os.environ.get("CC"):
        return os.environ["CC"]
    for name in ("cc", "gcc", "clang"):
        path = shutil.which(name)
        if path:
            return path
    return None


def _host_signature() -> str:
    """What ``-march=native`` compiles for: the CPU's feature flags (Linux), else the machine."""
    flags = cpu_flags()
    return platform.machine() + (" " + flags if flags else platform.processor())


def _compile(compiler: str, source: Path, target: Path, extra: tuple[str, ...]) -> str | None:
    """Compile to ``target`` atomically; the compiler's complaint on failure, else None."""
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    obj = tmp + ".o"
    try:
        for cmd in (
            [compiler, *CFLAGS, *extra, "-c", "-o", obj, str(source)],
            [compiler, *LDFLAGS, "-o", tmp, obj, *LIBS],
        ):
            result = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
            if result.returncode != 0:
                return (result.stderr or result.stdout).strip()[-2000:] or f"{compiler} exited with {result.returncode}"
        os.replace(tmp, target)
        return None
    finally:
        for path in (tmp, obj):
            if os.path.exists(path):
                os.remove(path)


def _file_sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _manifest_path(library: Path) -> Path:
    return library.with_suffix(".json")


def _is_verified(library: Path, key: str) -> bool:
    """Whether ``library`` is what this module's build wrote for ``key``: its manifest names the key and
    the library's sha256. A file merely carrying the right name (copied in, half written, another
    project's) fails, and is rebuilt."""
    try:
        manifest = json.loads(_manifest_path(library).read_text())
        return manifest.get("key") == key and manifest.get("library_sha256") == _file_sha256(library)
    except (OSError, ValueError, AttributeError):  # missing, unreadable, not JSON, not an object
        return False


def _write_manifest(library: Path, key: str, compiler: str, version: str, extra: tuple[str, ...]) -> None:
    """Record what built ``library`` beside it, atomically (written after the library is in place)."""
    manifest = {
        "key": key,
        "library": library.name,
        "library_sha256": _file_sha256(library),
        "compiler": compiler,
        "compiler_version": version.strip().splitlines()[0] if version.strip() else "",
        "flags": [*CFLAGS, *extra, *LDFLAGS, *LIBS],
    }
    fd, tmp = tempfile.mkstemp(suffix=".json.tmp", dir=library.parent)
    try:
        with os.fdopen(fd, "w") as stream:
            json.dump(manifest, stream, indent=2)
        os.replace(tmp, _manifest_path(library))
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _build(
    compiler: str, version: str, source_text: bytes, target: Path, key: str, name: str = "cpu_kernels.c",
    headers: Mapping[str, bytes] | None = None,
) -> None:  # fmt: skip
    """Compile ``source_text`` (the file ``name``, with ``headers`` beside it: file name -> text) to ``target``
    and write its manifest; raises :class:`KernelBuildError`."""
    with tempfile.TemporaryDirectory() as tmp, progress(f"compiling {name} with {Path(compiler).name}"):
        for header, text in (headers or {}).items():
            (Path(tmp) / header).write_bytes(text)
        source = Path(tmp) / name
        source.write_bytes(source_text)
        extra: tuple[str, ...] = ()
        complaint = _compile(compiler, source, target, extra)
        if complaint is not None:  # e.g. a compiler without _Float16: build without float16 storage
            extra = ("-DSA_NO_FLOAT16",)
            fallback = _compile(compiler, source, target, extra)
            if fallback is not None:
                raise KernelBuildError(f"compiling {name} with {compiler} failed:\n{fallback}")
    _write_manifest(target, key, compiler, version, extra)


def _ensure_built(
    compiler: str, version: str, source_text: bytes, target: Path, key: str, name: str = "cpu_kernels.c",
    headers: Mapping[str, bytes] | None = None,
) -> bool:  # fmt: skip
    """Make ``target`` a verified build of ``source_text`` (with ``headers``, as :func:`_build`); True when this call built it."""
    if _is_verified(target, key):
        return False
    # Another process may be building the same key right now: wait for it rather than build twice.
    with file_lock(target.with_suffix(".lock"), f"another process building the cpu kernel {target.name}"):
        if _is_verified(target, key):  # it finished while we waited
            return False
        _build(compiler, version, source_text, target, key, name, headers)
        return True


def _open(target: Path, symbols: tuple[str, ...] = SYMBOLS, name: str = "cpu_kernels.c") -> ctypes.CDLL:
    """Load ``target`` and check that it exports ``symbols``; raises :class:`KernelBuildError`."""
    try:
        lib = ctypes.CDLL(str(target))
    except OSError as err:
        raise KernelBuildError(f"loading the compiled kernel {target} failed: {err}") from err
    missing = [symbol for symbol in symbols if not hasattr(lib, symbol)]
    if missing:
        raise KernelBuildError(f"the library {target} does not export {', '.join(missing)}: it is not a build of {name}")
    return lib


def build_key(source_text: bytes, headers: Mapping[str, bytes], compiler_version: str) -> str:
    """The cache key of a build: sha256 over the source, its headers, the compiler, the flags and this CPU."""
    parts = [source_text, *headers.values(), compiler_version.encode(), " ".join(CFLAGS + LDFLAGS + LIBS).encode()]
    return hashlib.sha256(b"\0".join([*parts, _host_signature().encode()])).hexdigest()


def build_library(package: str, name: str, symbols: tuple[str, ...]) -> ctypes.CDLL:
    """Build (once per machine and source) and load the C file ``name`` of ``package``; raises :class:`KernelBuildError`.

    The same build for every C kernel of the package: compiled for this CPU with :data:`CFLAGS`, the
    shared :data:`HEADER` beside the source, cached under a key of source, header, compiler, flags and
    CPU with a manifest, built once under a file lock, and checked to export ``symbols`` after loading.
    """
    compiler = find_compiler()
    if compiler is None:
        raise KernelBuildError("no C compiler found (set CC, or install gcc or clang)")
    source_text = resources.files(package).joinpath(name).read_bytes()
    headers = {HEADER: resources.files(__package__).joinpath(HEADER).read_bytes()}
    try:
        version = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError) as err:
        raise KernelBuildError(f"the C compiler {compiler!r} does not run: {err}") from err
    key = build_key(source_text, headers, version)
    target = cache_dir() / f"{Path(name).stem}-{key[:16]}.so"
    built = _ensure_built(compiler, version, source_text, target, key, name, headers)
    try:
        return _open(target, symbols, name)
    except KernelBuildError as err:
        if built:  # a fresh build that does not load: rebuilding would give the same
            raise
        # A cached library with a matching manifest that still fails (the pair was copied in, or a
        # library it links changed). The process cannot load a rebuild under the same path (the
        # dynamic loader hands back the library it already opened by that name), so drop the
        # manifest: the next process rebuilds it.
        _manifest_path(target).unlink(missing_ok=True)
        raise KernelBuildError(f"{err}; its manifest was removed, so the next run rebuilds it") from err


@functools.cache
def load_library() -> ctypes.CDLL:
    """Build (once per machine and source) and load the kernel library; raises :class:`KernelBuildError`."""
    lib = build_library("sparseattn.backends", "cpu_kernels.c", SYMBOLS)
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    lib.sa_segment_attention.restype = ctypes.c_int
    lib.sa_segment_attention.argtypes = [
        ptr, ptr, ptr, ctypes.c_int, *[i64] * 6, *[i64] * 4, ptr, ptr, i64, i64, *[i64] * 5,
        ctypes.c_float, ctypes.c_float, ptr, ptr, ctypes.c_int,
    ]  # fmt: skip
    lib.sa_segment_log_mass.restype = ctypes.c_int
    lib.sa_segment_log_mass.argtypes = [
        ptr, ptr, ctypes.c_int, *[i64] * 4, *[i64] * 4, ptr, i64, i64, i64, i64, ctypes.c_float, ptr, ctypes.c_int,
    ]  # fmt: skip
    lib.sa_merged_rest.restype = ctypes.c_int
    lib.sa_merged_rest.argtypes = [
        ptr, ptr, ptr, ptr, ptr, i64, i64, ptr, i64, i64, ptr, i64, i64, ptr, i64, i64, *[i64] * 7, ctypes.c_float, ctypes.c_float, ctypes.c_int,
    ]  # fmt: skip
    lib.sa_float16_supported.restype = ctypes.c_int
    return lib


def build_refusal(load: Callable[[], object]) -> str | None:
    """Why ``load`` (a library loader) fails on this machine, in words; None when it loads."""
    try:
        load()
    except KernelBuildError as err:
        return str(err)
    return None


@functools.cache
def cpu_kernel_refusal() -> str | None:
    """Why the kernel is unavailable on this machine, in words; None when it loads."""
    return build_refusal(load_library)


def supported_dtypes() -> tuple[torch.dtype, ...]:
    """Storage dtypes the built kernel reads (float16 only where the compiler has ``_Float16``)."""
    if cpu_kernel_refusal() is not None:
        return ()
    lib = load_library()
    return tuple(dt for dt, code in DTYPE_CODES.items() if code != 2 or lib.sa_float16_supported())


def kernel_operands(
    q: torch.Tensor, segments: torch.Tensor, valid: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """``q, segments, valid`` as the kernels read them: contiguous float32, int64 and uint8 (no copy when they are)."""
    flags = None if valid is None else valid.to(torch.uint8).contiguous()
    return q.to(torch.float32).contiguous(), segments.to(torch.int64).contiguous(), flags


def check_status(status: int, what: str) -> None:
    """Raise ValueError saying why the kernel ``what`` returned a nonzero ``status``."""
    if status:
        raise ValueError(f"cpu {what} failed: {_ERRORS.get(status, f'status {status}')}")


def segment_attention_cpu(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, layout: SegmentLayout, segments: torch.Tensor,
    scale: float | None = None, softcap: float | None = None, valid: torch.Tensor | None = None, lse: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """:func:`~sparseattn.ops.attention.segment_attention` by the C kernel, reading the cache in place.

    ``q: [B, H_kv, G, D]`` (any float dtype; converted to float32, it is small), ``keys, values:
    [B, H_kv, t_cap, D]`` float32/bfloat16/float16 CPU tensors whose last dimension is contiguous
    (views of a capacity buffer are fine), ``segments: [B, H_kv, G', k]`` integer indices with
    ``G'`` in ``{1, G}``. The caller checks shapes (the backend does, or the decode state guarantees
    them). ``valid: [B, H_kv, G', k]`` bool (optional): each selection attends only its listed segments
    flagged True (a budget allocation's split); the others are not read. Returns ``[B, H_kv, G, D]`` float32,
    and with ``lse`` also each query head's log-sum-exp of its attended logits ``[B, H_kv, G]`` float32.
    """
    lib = load_library()
    B, H, G, D = q.shape
    scale = D**-0.5 if scale is None else scale
    qf, seg, flags = kernel_operands(q, segments, valid)
    out = torch.empty(B, H, G, D, dtype=torch.float32)
    norm = torch.empty(B, H, G, dtype=torch.float32) if lse else None
    ks, vs = keys.stride(), values.stride()
    status = lib.sa_segment_attention(
        qf.data_ptr(), keys.data_ptr(), values.data_ptr(), DTYPE_CODES[keys.dtype],
        ks[0], ks[1], ks[2], vs[0], vs[1], vs[2], B, H, G, D,
        seg.data_ptr(), None if flags is None else flags.data_ptr(), seg.shape[2], seg.shape[3],
        layout.sink_end, layout.segment_size, layout.n_segments, layout.tail_start, layout.length,
        float(scale), float(softcap or 0.0), out.data_ptr(), None if norm is None else norm.data_ptr(),
        torch.get_num_threads(),
    )  # fmt: skip
    check_status(status, "segment attention")
    return (out, norm) if lse else out


def segment_log_mass_cpu(queries: torch.Tensor, segment_keys: torch.Tensor, factor: float, index: torch.Tensor) -> torch.Tensor:
    """Exact log masses ``logsumexp_j q . (factor k_j)`` of listed segments, the keys read in place.

    ``queries: [B, H, R, D]`` float32; ``segment_keys: [B, H, S, c, D]`` (a view of the cache, last dim
    contiguous, any strides otherwise: the cpu backend checks that); ``index: [B, H, R', m]`` integer
    segment indices with ``R'`` in ``{1, R}`` (one list shared by the R rows, each segment read once
    for all of them, or one per row). Returns ``[B, H, R, m]`` float32. Reference:
    :func:`sparseattn.ops.segments.segment_log_mass_ref`.
    """
    lib = load_library()
    B, H, R, D = queries.shape
    S, c = segment_keys.shape[2], segment_keys.shape[3]
    q = queries.to(torch.float32).contiguous()
    idx = index.to(torch.int64).contiguous()
    out = torch.empty(B, H, R, idx.shape[-1], dtype=torch.float32)
    st = segment_keys.stride()
    status = lib.sa_segment_log_mass(
        q.data_ptr(), segment_keys.data_ptr(), DTYPE_CODES[segment_keys.dtype], st[0], st[1], st[2], st[3],
        B, H, R, D, idx.data_ptr(), idx.shape[2], idx.shape[3], c, S, float(factor), out.data_ptr(), torch.get_num_threads(),
    )  # fmt: skip
    check_status(status, "segment log-mass")
    return out


def rows_in_place(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x [B, H, n, C]`` as ``dtype`` with contiguous rows of ``C`` (any strides over ``B, H``), copied only if not."""
    x = x.to(dtype)
    return x if x.stride(-1) == 1 and (x.shape[-2] <= 1 or x.stride(-2) == x.shape[-1]) else x.contiguous()


def merged_rest_cpu(
    out: torch.Tensor, lse: torch.Tensor, q: torch.Tensor, layout: SegmentLayout, segments: torch.Tensor,
    valid: torch.Tensor | None, sums: RestSums, scale: float, softcap: float | None = None,
) -> torch.Tensor:  # fmt: skip
    """:func:`~sparseattn.methods.rest.add_merged_rest` by the C kernel, for a layout whose window reaches
    into no segment (``layout.tail_start >= layout.segment_end``: the caller checks).

    ``out, lse``: :func:`segment_attention_cpu`'s output and log-sum-exp (``lse=True``) for the same
    ``q, segments, valid``; ``sums`` as ``add_merged_rest`` takes them, its tensors read in place when their
    rows are contiguous (views of the decode state's capacity buffers are: copying them would cost more
    than the step), else copied. Returns a new ``[B, H_kv, G, D]`` float32 tensor (``out`` is not
    written). Reference: :func:`~sparseattn.ops.merged.merged_attention_ref`.
    """
    lib = load_library()
    B, H, G, D = q.shape
    result = out.to(torch.float32).contiguous().clone()
    qf, seg, flags = kernel_operands(q, segments, valid)
    kv = rows_in_place(sums.seg_kv, torch.float32)
    bk, bv = rows_in_place(sums.block_k, torch.float64), rows_in_place(sums.block_v, torch.float64)
    norm = lse.to(torch.float32).contiguous()
    status = lib.sa_merged_rest(
        qf.data_ptr(), result.data_ptr(), norm.data_ptr(), seg.data_ptr(), None if flags is None else flags.data_ptr(),
        seg.shape[2], seg.shape[3], kv.data_ptr(), kv.stride(0), kv.stride(1),
        bk.data_ptr(), bk.stride(0), bk.stride(1), bv.data_ptr(), bv.stride(0), bv.stride(1), B, H, G, D,
        layout.n_segments, layout.segment_size, sums.per_block, float(scale), float(softcap or 0.0), torch.get_num_threads(),
    )  # fmt: skip
    check_status(status, "merged rest")
    return result
