"""vLLM's CPU attention backend with sparseattn's paged engine answering the decode tokens.

:class:`SparseCPUAttentionBackend` is vLLM's ``CPUAttentionBackend`` (same name ``CPU_ATTN``, metadata
builder, KV-cache shape and layout) with its own impl: prefill and chunked prefill run vLLM's kernel
unchanged; every request with exactly one query token this step (a decode token) is answered by
:func:`sparseattn.vllm.paged.paged_decode` under the method the engine was configured with
(:mod:`sparseattn.vllm.config`). A step made only of decode tokens does not call vLLM's kernel; a
mixed step runs vLLM's kernel over the batch and then overwrites the decode rows.

The plugin (:mod:`sparseattn.vllm.plugin`) points vLLM's ``CPU_ATTN`` entry at :data:`CPU_ATTN`,
which resolves, each time vLLM looks it up, to vLLM's own class when the config being built asks for
no sparse method, and to :class:`SparseCPUAttentionBackend` when it does.

vLLM is imported on first attribute access, not on import: ``import sparseattn.vllm.backend`` works
without vLLM (the main test suite imports every module for its doctests).
"""

from __future__ import annotations

import functools
import re
from typing import Any

__all__ = ["CPU_ATTN", "SUPPORTED_ISAS", "SparseCPUAttentionBackend", "SparseCPUAttentionImpl"]  # noqa: F822 (the classes are built on first access, see __getattr__)

#: vLLM CPU kernel ISAs whose cache layout (keys transposed per page) the paged engine reads; the
#: ``amx``/``neon``/... layouts are not verified here and are refused.
SUPPORTED_ISAS = ("vec", "vec16")


def _layer_index(name: str) -> int:
    found = re.findall(r"\.(\d+)\.", f".{name}.")
    return int(found[0]) if found else 0


def _rank_kv_heads(local_kv_heads: int) -> tuple[list[int] | None, int]:
    """The model's KV heads this tensor-parallel rank holds (None without TP), and the model's total.

    vLLM gives rank ``r`` of ``tp`` the heads from ``r * total // tp`` on (``total / tp`` of them, or one
    replicated head when ``tp > total``); the paged engine draws its random parameters for all heads
    and keeps these rows, so a head's selection is the same at every TP size.
    """
    from vllm.config import get_current_vllm_config
    from vllm.distributed import (
        get_tensor_model_parallel_rank,
        get_tensor_model_parallel_world_size,
    )

    tp = get_tensor_model_parallel_world_size()
    if tp == 1:
        return None, local_kv_heads
    total = get_current_vllm_config().model_config.get_total_num_kv_heads()
    first = get_tensor_model_parallel_rank() * total // tp
    return list(range(first, first + local_kv_heads)), total


@functools.lru_cache(maxsize=1)
def _classes() -> dict[str, type]:
    import torch
    from vllm.logger import init_logger
    from vllm.v1.attention.backend import AttentionType
    from vllm.v1.attention.backends.cpu_attn import (
        CPUAttentionBackend,
        CPUAttentionBackendImpl,
    )

    from sparseattn.vllm.config import current_request
    from sparseattn.vllm.paged import PagedPolicy, PageSummaries, paged_decode

    logger = init_logger("vllm.sparseattn")  # under vLLM's logger, which has the handlers

    class SparseCPUAttentionImpl(CPUAttentionBackendImpl):
        """``CPUAttentionBackendImpl`` whose decode tokens run the configured sparseattn policy over the pages."""

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            request = current_request()
            if request is None:
                raise ValueError("SparseCPUAttentionImpl built with no sparseattn method requested (see sparseattn.vllm.config)")
            self.policy = PagedPolicy(request.build(), request.label)
            refused = [
                why
                for why, bad in (
                    ("ALiBi slopes", self.alibi_slopes is not None),
                    (f"a sliding window of {self.sliding_window}", self.sliding_window != -1),
                    ("attention sinks (s_aux)", self.sinks is not None),
                    (f"the {self.kv_cache_dtype} KV cache", self.is_fp8_kv_cache),
                )
                if bad and self.attn_type == AttentionType.DECODER
            ]
            if refused:
                raise ValueError(f"sparseattn method {request.label!r} cannot run on this layer: it uses {', '.join(refused)}")
            self._heads = _rank_kv_heads(self.num_kv_heads)
            self._prepared: tuple[Any, torch.Generator] | None = None
            self._summaries: PageSummaries | None = None  # this layer's page summaries, per physical block
            logger.info_once("sparseattn: decode tokens run %r in the paged engine (%r)", request.label, self.policy.method)

        def forward(self, layer, query, key, value, kv_cache, attn_metadata, output, output_scale=None, output_block_scale=None):
            if attn_metadata is None or self.attn_type != AttentionType.DECODER:
                return super().forward(layer, query, key, value, kv_cache, attn_metadata, output, output_scale, output_block_scale)
            isa = getattr(layer, "isa", None)
            if isa not in SUPPORTED_ISAS:
                raise NotImplementedError(
                    f"sparseattn's paged engine reads the CPU cache layouts of the {SUPPORTED_ISAS} kernels; this layer "
                    f"runs {isa!r}, whose key layout is not verified (see docs/serving.md)"
                )
            if self._prepared is None:
                heads, total = self._heads
                self._prepared = self.policy.prepare(total, self.head_size, _layer_index(layer.layer_name), heads=heads)
            starts = attn_metadata.query_start_loc
            lengths = starts[1:] - starts[:-1]
            decode = (lengths == 1).nonzero().flatten()
            if decode.numel() < lengths.numel():  # some prefill (chunk): vLLM's kernel for the batch, decode rows overwritten
                super().forward(layer, query, key, value, kv_cache, attn_metadata, output, output_scale, output_block_scale)
            if decode.numel() == 0:
                return output
            logger.info_once("sparseattn: first decode step answered by the paged engine (%s)", self.policy.name)
            rows = starts[decode].long()
            out = output.view(output.shape[0], self.num_heads, self.head_size)
            params, generator = self._prepared
            if self._summaries is None or self._summaries.valid.shape[0] != kv_cache.shape[0]:
                self._summaries = PageSummaries(kv_cache.shape[0], kv_cache.shape[2])
            out[rows] = paged_decode(
                self.policy, params, generator, kv_cache, query[rows].view(-1, self.num_heads, self.head_size),
                attn_metadata.block_table[decode], attn_metadata.seq_lens[decode], self.scale,
                self.logits_soft_cap or None, self._summaries,
            )
            return output

        def do_kv_cache_update(self, layer, key, value, kv_cache, slot_mapping) -> None:
            super().do_kv_cache_update(layer, key, value, kv_cache, slot_mapping)
            if self._summaries is not None:  # a block written to (reused, or still filling) is summarised afresh
                self._summaries.invalidate(slot_mapping)

    class SparseCPUAttentionBackend(CPUAttentionBackend):
        """vLLM's CPU backend (name, builder, cache shape unchanged) with :class:`SparseCPUAttentionImpl`."""

        @staticmethod
        def get_impl_cls() -> type:
            return SparseCPUAttentionImpl

    for cls in (SparseCPUAttentionImpl, SparseCPUAttentionBackend):  # importable (and picklable) by name
        cls.__module__, cls.__qualname__ = __name__, cls.__name__
    return {"SparseCPUAttentionImpl": SparseCPUAttentionImpl, "SparseCPUAttentionBackend": SparseCPUAttentionBackend}


def _resolve_cpu_attn() -> type:
    """vLLM's own CPU backend class when no sparse method is requested, else :class:`SparseCPUAttentionBackend`."""
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

    from sparseattn.vllm.config import current_request

    return CPUAttentionBackend if current_request() is None else _classes()["SparseCPUAttentionBackend"]


def __getattr__(name: str) -> Any:
    if name == "CPU_ATTN":
        return _resolve_cpu_attn()
    if name in ("SparseCPUAttentionBackend", "SparseCPUAttentionImpl"):
        return _classes()[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
