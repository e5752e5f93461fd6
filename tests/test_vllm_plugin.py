"""The vLLM plugin end to end on the default model, in bfloat16 (needs vLLM: ``bash scripts/vllm-venv.sh``).

One engine per configuration (stock vLLM, the plugin's dense path, quest at a budget covering the
context), each generating once for every test; eager (an eager engine starts in ~20 s, a compiled one
compiles for a minute). In bfloat16 two kernels that sum in another order flip near-tied greedy tokens, so
the outputs are compared as vLLM's own tests compare them: equal up to each sequence's first difference,
and there each engine's token among the other's 5 most likely (exact float32 equality is in
test_vllm_e2e.py). ``max_num_batched_tokens=256`` makes the long prompts prefill in chunks while the short
one decodes: the batches mix prefill and decode.
"""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from vllm_engine import HOST, first_divergences_are_near_ties, greedy_outputs, skip_unless_vllm_cpu

skip_unless_vllm_cpu()

REPO = Path(__file__).resolve().parents[1]
NEW_TOKENS = 16
TOP = 5
ENGINE = {"dtype": "bfloat16", "max_model_len": 4096, "max_num_batched_tokens": 256, "enable_chunked_prefill": True,
          "seed": 0, "enforce_eager": True}  # fmt: skip


def prompts() -> list[str]:
    text = (REPO / "README.md").read_text()
    return ["The capital of France is", text[:2500] + "\nIn short,", text[:6000] + "\nThe main idea is"]


def generate(tmp: Path, label: str, **extra) -> tuple[list, str]:
    """Greedy outputs (tokens, top-5 ids per position) of every prompt from a fresh engine, and its log."""
    return greedy_outputs(tmp / f"{label}.log", prompts(), {**ENGINE, **extra}, NEW_TOKENS, top=TOP, ignore_eos=True)


@pytest.fixture(scope="module")
def tmp(tmp_path_factory):
    return tmp_path_factory.mktemp("vllm")


@pytest.fixture(scope="module")
def stock(tmp):
    return generate(tmp, "stock")


@pytest.fixture(scope="module")
def dense(tmp):
    return generate(tmp, "dense", additional_config={"sparseattn": {"method": "dense"}})


@pytest.fixture(scope="module")
def quest_full(tmp):
    return generate(tmp, "quest", additional_config={"sparseattn": {"method": "quest", "budget": 4096}})


def test_stock_engine_does_not_use_the_paged_engine(stock):
    outputs, log = stock
    assert all(len(tokens) == NEW_TOKENS and len(top) == NEW_TOKENS for tokens, top in outputs)
    assert "sparseattn:" not in log


def test_plugin_dense_equals_stock_up_to_bfloat16_near_ties(stock, dense):
    outputs, log = dense
    assert "first decode step answered by the paged engine (dense)" in log, log[-3000:]
    assert first_divergences_are_near_ties(outputs, stock[0]) == []


@pytest.mark.slow  # a third engine (~40 s) CI cannot spare; radar+ at a full budget is compared in float32 (test_vllm_e2e.py)
def test_quest_at_full_budget_equals_stock_up_to_bfloat16_near_ties(stock, quest_full):
    outputs, log = quest_full
    assert "first decode step answered by the paged engine (quest:budget=4096)" in log, log[-3000:]
    assert first_divergences_are_near_ties(outputs, stock[0]) == []


START = textwrap.dedent(
    """
    from vllm import LLM
    from sparseattn.hf.models import local_model_dir
    if __name__ == "__main__":
        LLM(model=str(local_model_dir()), dtype="float32", max_model_len=512, **{host}, **{extra})
    """
)


def start_fails(extra: str, env: dict[str, str]) -> str:
    """Start an engine in a fresh process (plugins load once per process); it must fail: its output."""
    run = subprocess.run(
        [sys.executable, "-c", START.format(host=HOST, extra=extra)], env={**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", **env},
        capture_output=True, text=True, timeout=600, cwd=REPO, check=False,
    )
    assert run.returncode != 0, run.stdout[-2000:] + run.stderr[-2000:]
    return run.stdout + run.stderr


def test_bad_method_from_environment_fails_at_start():
    out = start_fails("{}", {"SPARSEATTN_VLLM_METHOD": "qwest:budget=64"})
    assert "ValueError: unknown method 'qwest'; known methods: dense" in out, out[-3000:]


def test_bad_option_from_additional_config_fails_before_any_engine_work():
    """Refused as vLLM makes the engine's config (the platform's check of additional_config), in the front end:
    no engine process is started and no weight is read."""
    out = start_fails('{"additional_config": {"sparseattn": {"method": "quest", "budget": 0}}}', {})
    assert "budget 0 is out of range; allowed: an integer in [1, 2147483647]" in out, out[-3000:]
    assert "EngineCore" not in out and "Starting to load model" not in out, out[-3000:]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("name, options", [("dense", {}), ("quest", {"budget": 300}), ("radar+", {"budget": 300}), ("radar", {"budget": 300}), ("streamingllm", {"budget": 300})])
@pytest.mark.parametrize("softcap", [None, 30.0])
def test_vllm_kernel_attends_the_listed_pages_as_the_torch_path_does(dtype, name, options, softcap):
    """kernel_attend_pages (vLLM's paged kernel over per-head page lists) == attend_pages, on shuffled pages."""
    import dataclasses

    from test_vllm_paged import paged_cache, sequences

    from sparseattn import registry
    from sparseattn.vllm.backend import kernel_attend_pages
    from sparseattn.vllm.paged import PagedPolicy, attend_pages, select_pages

    bs, H, G, D, lengths = 32, 3, 3, 64, (700, 1000, 333, 5, 900, 64)
    keys, values = sequences(lengths, H, D, dtype)
    cache, table = paged_cache(keys, values, bs)
    query = torch.randn(len(lengths), H * G, D, generator=torch.Generator().manual_seed(4)).to(dtype)
    method = registry.build(name, **options)
    if name == "radar":  # one page list per KV group (G' = 1)
        method = dataclasses.replace(method, shared_kv_selection=True)
    policy = PagedPolicy(method, name)
    params, gen = policy.prepare(H, D, layer_idx=2)
    seq_lens = torch.tensor(lengths)
    pages = select_pages(policy, params, gen, cache, query, table, seq_lens, D**-0.5)
    expected = attend_pages(query, cache, table, pages, seq_lens, D**-0.5, softcap)
    got = kernel_attend_pages(query, cache, table, pages, seq_lens, D**-0.5, softcap, "vec")
    assert got.dtype == dtype
    tol = 1e-5 if dtype == torch.float32 else 1e-2  # bf16: the outputs' own rounding
    assert torch.allclose(got.float(), expected.float(), atol=tol, rtol=tol), float((got.float() - expected.float()).abs().max())


# --- the cache layouts, checked against vLLM's own cache-update op -----------------------------------------


def written_by_vllm(isa: str, block_size: int, dtype, kv_cache_dtype: str = "auto", k_scale: float = 1.0, v_scale: float = 1.0,
                    seed: int | None = None):
    """Random tokens written by vLLM's ``cpu_attn_reshape_and_cache`` at random slots of a fresh cache: ``(cache, keys, values, slots)``."""
    from vllm import _custom_ops as ops

    H, D, T = 2, 64, 150
    N = -(-T // block_size) + 3  # more slots than tokens: some pages stay empty
    gen = torch.Generator().manual_seed(block_size + len(isa) if seed is None else seed)
    storage = torch.uint8 if kv_cache_dtype != "auto" else dtype
    cache = torch.zeros(N, H, block_size, 2 * D, dtype=storage)
    key_cache, value_cache = cache.view(N, H, 2 * block_size, D).chunk(2, dim=2)
    keys, values = (torch.randn(T, H, D, generator=gen) * 3).to(dtype), (torch.randn(T, H, D, generator=gen) * 3).to(dtype)
    slots = torch.randperm(N * block_size, generator=gen)[:T]
    ops.cpu_attn_reshape_and_cache(keys, values, key_cache, value_cache, slots, isa, k_scale=k_scale, v_scale=v_scale,
                                   kv_cache_dtype=kv_cache_dtype)  # fmt: skip
    return cache, keys, values, slots


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("isa, block_size", [("vec", 32), ("vec", 128), ("vec16", 16), ("vec16", 48)])
def test_page_views_read_back_what_vllms_cache_update_wrote(isa, block_size, dtype):
    from sparseattn.vllm.paged import page_views

    cache, keys, values, slots = written_by_vllm(isa, block_size, dtype)
    keys_t, pages = page_views(cache)
    block, offset = slots // block_size, slots % block_size
    assert torch.equal(keys_t[block, :, :, offset], keys) and torch.equal(pages[block, :, offset], values)


@pytest.mark.parametrize("block_size", [32, 128])
def test_the_amx_layout_is_what_vllms_amx_cache_update_writes(block_size):
    """vLLM's cache-update op for its amx kernel (it runs on any AVX-512 CPU, AMX or not) writes exactly what
    ``amx_layout`` makes of the vec layout of the same tokens: the layout the fused step reads in place on AMX CPUs,
    where the engine keeps vLLM's amx kernel (and its prefill speed)."""
    from sparseattn.vllm.paged import amx_layout, vec_layout

    amx, *_ = written_by_vllm("amx", block_size, torch.bfloat16, seed=7)
    vec, *_ = written_by_vllm("vec", block_size, torch.bfloat16, seed=7)  # the same tokens at the same slots
    assert vec.abs().sum() > 0 and torch.equal(amx, amx_layout(vec)) and torch.equal(vec_layout(amx), vec)


def toward_zero_fp8(x: torch.Tensor, fp8) -> torch.Tensor:
    """``x`` rounded toward zero to ``fp8`` (vLLM's CPU conversion; torch's ``.to`` rounds to nearest), as float32."""
    nearest = x.to(fp8).float()
    over = nearest.abs() > x.abs()
    if not bool(over.any()):
        return nearest
    # the next float8 number toward zero: step the byte's magnitude down by one (sign-magnitude encoding)
    below = (nearest.to(fp8).view(torch.uint8) - 1).view(fp8).float()
    return torch.where(over, below, nearest)


@pytest.mark.parametrize("name, k_scale, v_scale", [("fp8", 0.5, 0.25), ("fp8_e4m3", 1.0, 1.0), ("fp8_e5m2", 2.0, 0.5)])
def test_fp8_pages_hold_each_number_divided_by_its_scale_rounded_toward_zero(name, k_scale, v_scale):
    """The fp8 cache's layout is the vec layout in one byte a number: read as float8, times the scale, is the token."""
    from sparseattn.vllm.paged import KVFormat, page_views

    fmt = KVFormat(name, k_scale, v_scale)
    cache, keys, values, slots = written_by_vllm("vec", 32, torch.bfloat16, name, k_scale, v_scale)
    assert cache.dtype == torch.uint8
    keys_t, pages = page_views(cache, fmt)
    block, offset = slots // 32, slots % 32
    assert torch.equal(keys_t[block, :, :, offset].float(), toward_zero_fp8(keys.float() / k_scale, fmt.fp8))
    assert torch.equal(pages[block, :, offset].float(), toward_zero_fp8(values.float() / v_scale, fmt.fp8))


@pytest.mark.parametrize("name", ["radar+", "quest", "dense"])
def test_vllm_kernel_attends_fp8_pages_as_the_torch_path_does(name):
    """kernel_attend_pages over an fp8 cache (with its scales) == attend_pages over the same bytes, dequantised."""
    from sparseattn import registry
    from sparseattn.vllm.backend import kernel_attend_pages
    from sparseattn.vllm.paged import KVFormat, PagedPolicy, attend_pages, select_pages

    fmt = KVFormat("fp8", 0.5, 0.25)
    bs, H, G, D, lengths = 32, 2, 3, 64, (300, 1000, 77)
    T = sum(lengths)
    from vllm import _custom_ops as ops

    cache = torch.zeros(-(-T // bs) + 4, H, bs, 2 * D, dtype=torch.uint8)  # spare blocks stay zero

    gen = torch.Generator().manual_seed(9)
    order = torch.randperm(cache.shape[0], generator=gen)
    table = torch.zeros(len(lengths), max(-(-n // bs) for n in lengths), dtype=torch.int32)
    key_cache, value_cache = cache.view(cache.shape[0], H, 2 * bs, D).chunk(2, dim=2)
    used = 0
    for i, n in enumerate(lengths):
        pages = -(-n // bs)
        table[i, :pages] = order[used : used + pages].to(torch.int32)
        used += pages
        slot = (table[i].long()[torch.arange(n) // bs] * bs + torch.arange(n) % bs)
        k, v = (torch.randn(n, H, D, generator=gen) * 2).bfloat16(), (torch.randn(n, H, D, generator=gen) * 2).bfloat16()
        ops.cpu_attn_reshape_and_cache(k, v, key_cache, value_cache, slot, "vec", k_scale=fmt.k_scale, v_scale=fmt.v_scale,
                                       kv_cache_dtype="fp8")  # fmt: skip
    query = torch.randn(len(lengths), H * G, D, generator=gen).bfloat16()
    policy = PagedPolicy(registry.build(name, **({} if name == "dense" else {"budget": 256})), name)
    params, generator = policy.prepare(H, D, layer_idx=0)
    seq_lens = torch.tensor(lengths)
    pages = select_pages(policy, params, generator, cache, query, table, seq_lens, D**-0.5, fmt=fmt)
    expected = attend_pages(query.float(), cache, table, pages, seq_lens, D**-0.5, fmt=fmt)
    got = kernel_attend_pages(query, cache, table, pages, seq_lens, D**-0.5, None, "vec", fmt)
    assert got.dtype == torch.bfloat16
    assert torch.allclose(got.float(), expected, atol=2e-2, rtol=2e-2), float((got.float() - expected).abs().max())
