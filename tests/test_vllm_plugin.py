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

from vllm_engine import first_divergences_are_near_ties, greedy_outputs, skip_unless_vllm_cpu

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
        LLM(model=str(local_model_dir()), dtype="float32", max_model_len=512, **{extra})
    """
)


def start_fails(extra: str, env: dict[str, str]) -> str:
    """Start an engine in a fresh process (plugins load once per process); it must fail: its output."""
    run = subprocess.run(
        [sys.executable, "-c", START.format(extra=extra)], env={**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", **env},
        capture_output=True, text=True, timeout=600, cwd=REPO, check=False,
    )
    assert run.returncode != 0, run.stdout[-2000:] + run.stderr[-2000:]
    return run.stdout + run.stderr


def test_bad_method_from_environment_fails_at_start():
    out = start_fails("{}", {"SPARSEATTN_VLLM_METHOD": "qwest:budget=64"})
    assert "ValueError: unknown method 'qwest'; known methods: dense" in out, out[-3000:]


def test_bad_option_from_additional_config_fails_at_start():
    out = start_fails('{"additional_config": {"sparseattn": {"method": "quest", "budget": 0}}}', {})
    assert "budget 0 is out of range; allowed: an integer in [1, 2147483647]" in out, out[-3000:]


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
