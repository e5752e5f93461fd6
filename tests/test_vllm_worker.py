"""vLLM's KV cache sized with the paged engine's page stores counted in (:mod:`sparseattn.vllm.worker`).

The worker hands vLLM the memory it was given times :func:`cache_share`; these tests hold the parts
that decide it: each layer's store bytes per block are what the engine then allocates per block under
that layer's method, and the cache they leave fits the memory with its stores. The worker itself runs
in ``tests/test_vllm_server.py`` (``sparseattn serve`` starts it; its log line is checked there).
"""

from types import SimpleNamespace

import pytest
import torch

from vllm_engine import skip_unless_vllm_cpu

skip_unless_vllm_cpu()

from sparseattn.vllm.paged_kernel import FIXED, PageStore, cache_share, kernel_refusal  # noqa: E402
from sparseattn.vllm.route import route  # noqa: E402
from sparseattn.vllm.worker import store_bytes  # noqa: E402

pytestmark = pytest.mark.skipif(kernel_refusal() is not None, reason=f"the fused paged kernel cannot be built here: {kernel_refusal()}")

BS, HEADS, D, LAYERS = 32, 3, 64, 4


def engine_config(method: dict | None, cache_dtype: str = "auto", max_len: int = 8192) -> SimpleNamespace:
    """What :func:`store_bytes` reads of vLLM's config."""
    return SimpleNamespace(
        additional_config={"sparseattn": method} if method else {},
        model_config=SimpleNamespace(get_total_num_hidden_layers=lambda: LAYERS, max_model_len=max_len),
        cache_config=SimpleNamespace(cache_dtype=cache_dtype),
    )


def kv_spec(bs: int = BS) -> dict[str, SimpleNamespace]:
    """vLLM's KV cache spec of a Llama's attention layers (bf16 pages of ``bs`` tokens)."""
    page = 2 * bs * HEADS * D * 2
    return {f"model.layers.{i}.self_attn.attn": SimpleNamespace(block_size=bs, num_kv_heads=HEADS, head_size=D,
                                                                dtype=torch.bfloat16, page_size_bytes=page)
            for i in range(LAYERS)}  # fmt: skip


@pytest.mark.parametrize("method, segment", [
    ({"method": "radar+adaptive", "budget": 512}, "auto"), ({"method": "radar+adaptive", "budget": 512}, None),
    ({"method": "radar+", "budget": 512}, "auto"), ({"method": "radar+", "budget": 512}, None),
    ({"method": "radar+", "budget": 512, "split": "pooled", "rest": "merged", "merge": 2}, 8),
    ({"method": "quest", "budget": 1024}, None),
])  # fmt: skip
def test_each_layers_store_per_block_is_what_the_engine_allocates_per_block(method, segment):
    """For every layer: the bytes counted per block, times a cache's blocks, are the bytes of the store the
    engine makes for that layer's method over that cache (so the memory counted is the memory held)."""
    from sparseattn.vllm.config import request_from

    spec = dict(method, **({} if segment is None else {"segment": segment}))
    config = engine_config(spec)
    sizes = store_bytes(config, kv_spec())
    policy = request_from(config.additional_config).policy(BS, config.model_config.max_model_len)
    for name, counted in sizes.items():
        layer = int(name.split(".")[2])
        leaf = policy.for_layer(layer, LAYERS) if policy.layered else policy
        mode = route(leaf).mode
        assert mode is not None and mode != FIXED
        for blocks in (1, 7, 130):
            assert PageStore.for_policy(leaf, blocks, HEADS, D, BS).nbytes == blocks * counted, (name, blocks)
    if method["method"] == "radar+adaptive":  # layer 0 drops the rest: no sums, a smaller store than layers 1..
        first, *rest = sizes.values()
        assert all(first < later for later in rest), sizes


@pytest.mark.parametrize("method, cache_dtype", [
    (None, "auto"), ({"method": "dense"}, "auto"), ({"method": "streamingllm", "budget": 512}, "auto"),
])  # fmt: skip
def test_no_store_is_counted_where_the_fused_step_keeps_none(method, cache_dtype):
    """No method: nothing to count; dense and StreamingLLM read whole pages without summaries."""
    sizes = store_bytes(engine_config(method, cache_dtype), kv_spec())
    assert sizes == {} if method is None else set(sizes.values()) == {0}, sizes


def test_an_fp8_cache_counts_the_fused_steps_store_as_any_cache():
    """An fp8 cache is read by the fused step (its bytes in place), so its page store is counted as a bf16 cache's is."""
    fp8 = store_bytes(engine_config({"method": "radar+", "budget": 512}, "fp8_e4m3"), kv_spec())
    plain = store_bytes(engine_config({"method": "radar+", "budget": 512}, "auto"), kv_spec())
    assert fp8 == plain and all(v > 0 for v in fp8.values()), (fp8, plain)


@pytest.mark.parametrize("given_gib", [0.5, 1.0, 3.0])
@pytest.mark.parametrize("method", [{"method": "radar+adaptive", "budget": 512, "segment": 4}, {"method": "radar+", "budget": 512}])
def test_the_cache_left_fits_the_memory_given_with_its_stores(given_gib, method):
    """The blocks vLLM makes of the memory the worker reports, with each layer's store beside every block,
    take no more than the memory vLLM was given, and at most one block's worth less."""
    spec = kv_spec()
    store = store_bytes(engine_config(method), spec)
    page = {name: s.page_size_bytes for name, s in spec.items()}
    given = int(given_gib * 2**30)
    blocks = int(given * cache_share(page, store)) // sum(page.values())  # what vLLM divides the reported memory into
    held = blocks * (sum(page.values()) + sum(store.values()))
    assert held <= given < held + sum(page.values()) + sum(store.values()), (held, given)
    assert blocks < given // sum(page.values())  # the stores took memory the cache would have had


def test_cache_share_refuses_a_cache_without_bytes():
    with pytest.raises(ValueError, match="page bytes sum to 0"):
        cache_share({}, {})
