"""What the vLLM backend decides without vLLM: a step's decode requests, the cache layout it reads, its fallback counts.

:mod:`sparseattn.vllm.backend` (which imports vLLM) builds on these; they are plain torch and Python,
tested in the main suite (tests/test_vllm_decode_step.py):

* :func:`decode_step`: which requests of a step are decode tokens (one query token, past their
  prompt), found once per step by the backend's metadata builder and read by every layer;
* :func:`readable_isa`: the CPU attention kernel (and so the KV cache layout) a sparse engine runs
  where vLLM picked another, or why it cannot run on this CPU;
* :class:`Fallbacks`: the decode layer-steps the paged engine answered and those it left to vLLM's
  kernel, by cause, with their log lines.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["SUPPORTED_ISAS", "DecodeStep", "Fallbacks", "decode_step", "readable_isa"]

#: vLLM CPU kernel ISAs whose cache layout (keys transposed per page) every path of the paged engine reads; the
#: fused step reads ``amx``'s too (:func:`readable_isa`).
SUPPORTED_ISAS = ("vec", "vec16")

#: What to do on a CPU whose layout the engine does not read, by the ISA vLLM picks there.
_INSTEAD = {
    "neon": "serve this model without a sparseattn method (stock vLLM) on this Arm CPU, where vLLM picks 'neon' for every dtype, "
    "or use an x86-64 CPU",
}


def readable_isa(isa: str, dtype: str, block_size: int, amx_refusal: str | None = "not asked") -> str:
    """The CPU attention ISA a sparse engine runs where vLLM picked ``isa`` for ``dtype`` and ``block_size``.

    ``vec``/``vec16``: as picked. ``amx`` (bfloat16 on Intel CPUs with AMX): kept where the fused step reads the
    method's pages in that layout (``amx_refusal`` None: :func:`~sparseattn.vllm.paged_kernel.amx_refusal`, the
    method's every layer fused, a bfloat16 cache), so vLLM prefills at its AMX speed; else ``vec`` (``vec16`` for a
    block size vLLM's ``vec`` kernel does not take), the AVX-512 kernel and layout vLLM runs on x86-64 CPUs without
    AMX, which every path of the paged engine reads; vLLM then prefills with that kernel too (slower than AMX).
    Any other (``neon``, ``vsx``, ``vxe``, ``rvv``): NotImplementedError naming the ISA, the dtype and what
    to do, raised when the engine builds its attention metadata, at start-up.

    Example:
        >>> readable_isa("amx", "bfloat16", 128), readable_isa("vec16", "float32", 16)
        ('vec', 'vec16')
        >>> readable_isa("amx", "bfloat16", 128, amx_refusal=None)
        'amx'
    """
    if isa in SUPPORTED_ISAS:
        return isa
    if isa == "amx":
        if amx_refusal is None:
            return "amx"
        return "vec" if block_size % 32 == 0 else "vec16"
    instead = _INSTEAD.get(isa, "set a block size that is not a multiple of 32 (e.g. --block-size 16), for which vLLM "
                                "picks its 'vec16' kernel, or serve this model without a sparseattn method (stock vLLM)")  # fmt: skip
    raise NotImplementedError(
        f"sparseattn's paged engine cannot run here: vLLM picks its {isa!r} CPU attention kernel on this CPU for {dtype} "
        f"with blocks of {block_size} tokens, and the engine reads only the KV cache layouts of vLLM's "
        f"{' and '.join(map(repr, SUPPORTED_ISAS))} kernels; {instead} (docs/serving.md)"
    )


@dataclass(frozen=True)
class DecodeStep:
    """The decode requests of one step (one query token each, past their prompt), as every layer's forward reads them.

    ``requests``: their indices in the batch; ``rows``: their token rows, None when the step is
    decode tokens only (then they are rows ``0..B-1``: the query and output rows are sliced, not
    gathered); ``table``, ``lens``: their block-table rows and lengths (the current token included);
    ``mixed``: other requests of the step are prefilling (chunks, or a prompt's last token alone).
    """

    requests: torch.Tensor
    rows: torch.Tensor | None
    table: torch.Tensor
    lens: torch.Tensor
    mixed: bool


def decode_step(
    query_start_loc: torch.Tensor, seq_lens: torch.Tensor, block_table: torch.Tensor, prefilling: torch.Tensor | None = None
) -> DecodeStep | None:
    """The step's :class:`DecodeStep` (None: no decode token), from its metadata's tensors.

    A decode request has one query token and has computed its whole prompt: ``prefilling[i]`` (vLLM's
    ``is_prefilling``, ``computed tokens < prompt tokens``) marks a request whose one query token is its
    prompt's last (a prefix-cache hit leaving one token, or a chunked prefill's one-token last chunk):
    that token is prefill, attended by vLLM's kernel, and its output is the first generated token's.
    Without ``prefilling`` every one-token request is taken for a decode token. The backend's metadata
    builder calls this once per step; every layer reads the result.
    """
    starts = query_start_loc
    lengths = starts[1:] - starts[:-1]
    decoding = lengths == 1
    if prefilling is not None:
        decoding &= ~prefilling[: lengths.numel()].to(device=decoding.device, dtype=torch.bool)
    requests = decoding.nonzero().flatten()
    n = requests.numel()
    if n == 0:
        return None
    if n == lengths.numel():  # decode tokens only: request i is token row i
        return DecodeStep(requests, None, block_table[:n], seq_lens[:n], False)
    return DecodeStep(requests, starts[requests].long(), block_table[requests], seq_lens[requests], True)


class Fallbacks:
    """Decode layer-steps the paged engine answered, and those it could not (answered by vLLM's kernel), by cause.

    :meth:`failed` logs a cause the first time it is seen, with the reason, and a metrics line (at most
    every ``every`` seconds); :meth:`answered` logs once when the paged engine answers again after a
    fallback. The backend keeps one per metadata builder (one per engine for a model with one KV cache
    group) and hands it to every layer with the step's metadata; a worker's counts are read through
    ``collective_rpc("sparseattn_fallbacks")`` (:class:`sparseattn.vllm.switch.MethodSwitch`).
    """

    def __init__(self, every: float = 30.0) -> None:
        self.every = every
        self.answered_steps = 0
        self.causes: dict[str, int] = {}
        self._last_metrics = float("-inf")
        self._falling_back = False

    @property
    def total(self) -> int:
        return sum(self.causes.values())

    def metrics(self) -> str:
        causes = "; ".join(f"{n} x {cause}" for cause, n in self.causes.items()) or "none"
        return (f"sparseattn metrics: {self.answered_steps} decode layer-steps answered by the paged engine, "
                f"{self.total} by vLLM's dense kernel after a failure ({causes})")  # fmt: skip

    def failed(self, error: BaseException, layer: int, logger: Any) -> None:
        cause = f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"[:300]
        first = cause not in self.causes
        self.causes[cause] = self.causes.get(cause, 0) + 1
        self._falling_back = True
        if first:
            logger.warning("sparseattn: a decode step (layer %d) fell back to vLLM's dense kernel: %s (logged once per "
                           "cause, counted in the metrics line)", layer, cause)  # fmt: skip
        now = time.monotonic()
        if first or now - self._last_metrics >= self.every:
            self._last_metrics = now
            logger.warning(self.metrics())

    def answered(self, logger: Any) -> None:
        self.answered_steps += 1
        if self._falling_back:
            self._falling_back = False
            logger.info("sparseattn: decode steps answered by the paged engine again; %s", self.metrics())
