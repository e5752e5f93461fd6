"""vLLM's CPU worker sizing its KV cache with the paged engine's page stores counted in.

The fused C step keeps a :class:`~sparseattn.vllm.paged_kernel.PageStore` per attention layer beside
vLLM's cache, one entry per cache block: the centroids of a page's segments and, with a merged rest,
its value sums (about 0.28x the cache's bytes for ``radar+adaptive`` on its own grid at 8k, 0.03x for
``radar+`` on whole pages). vLLM sizes its cache from the memory it was given
(``VLLM_CPU_KVCACHE_SPACE`` or ``kv_cache_memory_bytes``; else ``gpu_memory_utilization`` of the
host's memory less what the process holds) and knows nothing of the stores: a cache sized to fill
that memory would take 1.28x of it for the preset at 8k (1.53x on its 2-token grid at 2k) once
every block had a summary.

:class:`SparseCPUWorker` is vLLM's CPU worker whose :meth:`~SparseCPUWorker.determine_available_memory`
hands vLLM the memory less the stores' share, so that ``blocks x (KV page + stores)`` fits what vLLM
was given; it logs the split. It is vLLM's declared worker hook (``worker_cls``:
``vllm serve --worker-cls sparseattn.vllm.worker.SparseCPUWorker``, ``LLM(..., worker_cls=...)``);
``sparseattn serve`` and :func:`sparseattn.evaluation.vllm_engine.start_engine` pass it. Sized for the
method the engine starts with (a method switched to later keeps its store beside the cache uncounted);
the generic path's summaries (methods the fused step does not run) are not counted. Without this
worker the engine runs as before and its first decode step logs the store's share, uncounted.

This module imports vLLM (its worker is vLLM's); :func:`~sparseattn.vllm.paged_kernel.cache_share` needs none.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from vllm.logger import init_logger
from vllm.v1.worker.cpu_worker import CPUWorker

from sparseattn.vllm.backend import DecodeMethod, fused_refusal
from sparseattn.vllm.config import WORKER_CLS, count_stores, layer_index, request_from
from sparseattn.vllm.paged_kernel import PageStore, cache_share

__all__ = ["WORKER_CLS", "SparseCPUWorker", "store_bytes"]

logger = init_logger("vllm.sparseattn")

def store_bytes(vllm_config: Any, kv_cache_spec: Mapping[str, Any]) -> dict[str, int]:
    """Bytes per cache block of each attention layer's page store under the engine's configured method (none when it
    asks for none, and for layers the fused step does not run); ``kv_cache_spec``: vLLM's, layer name -> spec."""
    request = request_from(vllm_config.additional_config)
    if request is None or not kv_cache_spec:
        return {}
    sizes: dict[str, int] = {}
    n_layers = vllm_config.model_config.get_total_num_hidden_layers()
    refusal = fused_refusal(vllm_config.cache_config.cache_dtype)
    methods: dict[int, DecodeMethod] = {}  # per page size (one in a plain decoder; the method's grid depends on it)
    for name, spec in kv_cache_spec.items():
        block_size, kv_heads, head_dim = spec.block_size, spec.num_kv_heads, spec.head_size
        if block_size not in methods:
            methods[block_size] = DecodeMethod.of(request.policy(block_size, vllm_config.model_config.max_model_len), n_layers, refusal)
        method = methods[block_size]
        leaf, way = method.variants[method.variant(layer_index(name))]
        sizes[name] = PageStore.bytes_per_block(leaf, kv_heads, head_dim, block_size) if way.keeps_store else 0
    return sizes


class SparseCPUWorker(CPUWorker):
    """vLLM's CPU worker; the memory it reports for the KV cache leaves room for the paged engine's stores."""

    def determine_available_memory(self) -> int:
        available = super().determine_available_memory()
        spec = self.model_runner.get_kv_cache_spec()
        store = store_bytes(self.vllm_config, spec)
        if any(store.values()):
            page_bytes = {name: s.page_size_bytes for name, s in spec.items()}
            share = cache_share(page_bytes, store)
            kept = int(available * share)
            logger.info(
                "sparseattn: the KV cache gets %.2f of %.2f GiB, its page stores the rest (%.0f%% of the cache's bytes, "
                "%d of %d layers): together within what vLLM was given", kept / 2**30, available / 2**30,
                100 * (1 / share - 1), sum(1 for v in store.values() if v), len(spec),
            )  # fmt: skip
            available = kept
        count_stores()
        return available
