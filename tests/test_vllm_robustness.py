"""The served engine on every CPU vLLM serves on, never ended by a step, and a prompt's last token as prefill
(needs vLLM: ``bash scripts/vllm-venv.sh``; scripts/test.sh runs this module there).

Each engine runs in its own process, in-process mode (tests/vllm_inprocess.py), so a test can reach
inside it: tell vLLM's CPU backend it picked another ISA, or make the paged engine's decode step raise.
float32, eager, the default model, prefix caching and chunked prefill in chunks of 1024 tokens:

* a stock engine (no sparse method): the reference;
* radar+ at budget 256 on a CPU where vLLM "picks" ``amx`` (the ISA of bfloat16 on Intel CPUs with AMX):
  the engine must say so and run the ``vec`` layout; and the first token of a 1025-token prompt (computed
  as a one-token last chunk, then again after a prefix-cache hit of 1024 tokens) must be stock's, with
  stock's logprob: the prompt's last token is prefill, not a decode step of the sparse method;
* radar+ whose decode step raises at every call: vLLM's kernel answers every step (stock's tokens), the
  cause is logged once and counted; then, failures off, the paged engine answers again;
* a CPU where vLLM "picks" ``neon``: the engine refuses to start, naming the ISA, the dtype and what to do.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from vllm_engine import skip_unless_vllm_cpu

skip_unless_vllm_cpu()

from sparseattn.hf.models import local_model_dir  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
ENGINE = {"dtype": "float32", "max_model_len": 2048, "enforce_eager": True, "seed": 0, "enable_prefix_caching": True,
          "enable_chunked_prefill": True, "max_num_batched_tokens": 1024}  # fmt: skip
SPARSE = {**ENGINE, "additional_config": {"sparseattn": {"method": "radar+", "budget": 256}}}
NEW_TOKENS = 12


def token_prompts() -> tuple[list[int], list[list[int]]]:
    """A 1025-token prompt (a prefix-cache hit leaves it one token; in chunks of 1024 its last chunk is one token)
    and three prompts of 400-700 tokens (over the budget: the sparse method selects)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(local_model_dir()))
    ids = [tok.encode((REPO / "docs" / name).read_text(), add_special_tokens=False) for name in ("methods.md", "theory.md", "api.md")]
    return ids[0][:1025], [ids[1][:400], ids[2][:550], ids[1][1000:1700]]


def run(tmp: Path, label: str, config: dict, *, must_start: bool = True) -> tuple[dict | None, str]:
    """One engine in a fresh process: its JSON result (None when it did not start) and its log."""
    done = subprocess.run(
        [sys.executable, str(REPO / "tests" / "vllm_inprocess.py"), json.dumps(config)], cwd=REPO, capture_output=True,
        text=True, timeout=900, env={**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1"}, check=False,
    )  # fmt: skip
    log = done.stdout + done.stderr
    (tmp / f"{label}.log").write_text(log)
    if done.returncode != 0:
        assert not must_start, f"{label}: the engine failed (exit {done.returncode}): {log[-4000:]}"
        return None, log
    return json.loads(done.stdout.strip().splitlines()[-1]), log


@pytest.fixture(scope="module")
def prompts():
    return token_prompts()


@pytest.fixture(scope="module")
def stock(prompts, tmp_path_factory):
    long, short = prompts
    batches = [{"prompts": [long]}, {"prompts": [long]}, {"prompts": short}]
    return run(tmp_path_factory.mktemp("stock"), "stock", {"engine": ENGINE, "batches": batches, "new_tokens": NEW_TOKENS})[0]


@pytest.fixture(scope="module")
def sparse_on_amx(prompts, tmp_path_factory):
    long, short = prompts
    batches = [{"prompts": [long]}, {"prompts": [long]}, {"prompts": short}]
    config = {"engine": SPARSE, "batches": batches, "new_tokens": NEW_TOKENS, "fake_isa": "amx"}
    return run(tmp_path_factory.mktemp("amx"), "sparse-amx", config)


def test_where_vllm_picks_amx_a_sparse_engine_runs_the_vec_layout_and_says_so(sparse_on_amx):
    result, log = sparse_on_amx
    # float32: the amx layout holds bfloat16 pages, so the engine runs vec (a bf16 engine whose method runs fused keeps
    # amx: tests/test_vllm_paged_split.py reads that layout, tests/test_vllm_plugin.py checks it against vLLM's op)
    assert "vLLM picked its 'amx' CPU attention kernel for float32 here; the paged engine does not read that cache layout " \
           "for 'radar+:budget=256' (the amx layout holds bfloat16 pages" in log and "so this engine runs vLLM's 'vec' kernel " \
           "and layout instead" in log  # fmt: skip
    assert result["answered"] > 0 and result["fallbacks"] == 0, result  # the paged engine answered the decode steps
    assert "first decode step answered by the paged engine" in log


def test_a_prompts_last_token_computed_alone_is_prefill_with_stocks_first_token_and_logprob(sparse_on_amx, stock):
    result, _ = sparse_on_amx
    for batch, how in ((0, "a one-token last chunk"), (1, "after a prefix-cache hit of 1024 tokens")):
        mine, theirs = result["batches"][batch][0], stock["batches"][batch][0]
        assert mine["tokens"][0] == theirs["tokens"][0], how
        assert abs(mine["first_logprob"] - theirs["first_logprob"]) < 1e-4, (how, mine["first_logprob"], theirs["first_logprob"])


def test_a_decode_step_that_fails_is_answered_by_vllms_kernel_and_the_engine_goes_on(prompts, stock, tmp_path):
    _, short = prompts
    batches = [{"prompts": short, "fail": -1}, {"prompts": short[:1], "fail": 0}]
    result, log = run(tmp_path, "failing", {"engine": SPARSE, "batches": batches, "new_tokens": NEW_TOKENS})
    # Every decode step failed: vLLM's own kernel answered them all, so the tokens are stock's, exactly.
    assert [r["tokens"] for r in result["batches"][0]] == [r["tokens"] for r in stock["batches"][2]]
    cause = "Injected: injected failure (test): the paged engine's decode step raised"
    assert log.count(f"fell back to vLLM's dense kernel: {cause}") == 1  # once per cause
    assert "sparseattn metrics: " in log and result["causes"] == {cause: result["fallbacks"]}
    assert result["fallbacks"] >= 30 * (NEW_TOKENS - 1)  # every layer of every decode step of the first batch
    # Failures off: the next request's decode steps are the paged engine's again, and the log says so.
    assert result["answered"] > 0 and "decode steps answered by the paged engine again" in log
    assert len(result["batches"][1][0]["tokens"]) == NEW_TOKENS


def test_a_cpu_whose_layout_the_engine_cannot_read_refuses_at_start_up(prompts, tmp_path):
    _, short = prompts
    config = {"engine": SPARSE, "batches": [{"prompts": short[:1]}], "new_tokens": 2, "fake_isa": "neon"}
    result, log = run(tmp_path, "neon", config, must_start=False)
    assert result is None
    assert "NotImplementedError: sparseattn's paged engine cannot run here: vLLM picks its 'neon' CPU attention kernel on " \
           "this CPU for float32" in log, log[-3000:]  # fmt: skip
    assert "serve this model without a sparseattn method (stock vLLM)" in log
    assert "Processed prompts" not in log  # refused before any request


def tensor_parallel_tokens(tmp: Path, tp: int, spec: dict) -> tuple[list[list[int]], str]:
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "|".join(["0", "1"][:tp]) if tp > 1 else "auto"}
    done = subprocess.run(
        [sys.executable, str(REPO / "tests" / "vllm_tensor_parallel.py"), str(tmp / "model"), str(tp), json.dumps(spec)],
        cwd=REPO, capture_output=True, text=True, timeout=900, env=env, check=False,
    )  # fmt: skip
    log = done.stdout + done.stderr
    (tmp / f"tp{tp}.log").write_text(log)
    assert done.returncode == 0, log[-4000:]
    line = [x for x in done.stdout.splitlines() if x.startswith("RESULT ")][-1]
    return json.loads(line.removeprefix("RESULT ")), log


@pytest.mark.slow  # two engines (one process, then two ranks): 72 s of CI's 20 minutes; `-m slow` runs it
def test_tensor_parallel_2_decodes_each_ranks_heads_as_one_process_does(tmp_path):
    # Two ranks of one KV head each (vLLM's CPU workers, gloo, one core each): each rank selects pages over
    # its own head's cache with its own parameter rows; the greedy tokens are one process's, in float32.
    spec = {"method": "radar", "budget": 128}  # under the prompts' 300 and 520 tokens: the selection decides; per-head random features
    one, _ = tensor_parallel_tokens(tmp_path, 1, spec)
    two, log = tensor_parallel_tokens(tmp_path, 2, spec)
    assert two == one
    assert "Worker_TP0" in log and "first decode step answered by the paged engine (radar:budget=128)" in log


def test_an_fp8_kv_cache_serves_and_finds_the_passkey_as_stock_vllm_with_fp8_does(tmp_path):
    # The memory tier: one byte a cached number (vLLM's kv_cache_dtype="fp8", e4m3 with the layer's scales).
    # radar+ at budget 256 reads the fp8 pages in its fused step (each byte times its layer's scale, in place);
    # the passkey, ~2000 tokens deep, must be found as stock finds it.
    from transformers import AutoTokenizer

    from sparseattn.data.needle import PasskeyTask

    tok = AutoTokenizer.from_pretrained(str(local_model_dir()))
    samples = [PasskeyTask().sample(2000, tok, seed=i, depths=[d], reserve_tokens=16) for i, d in enumerate((10.0, 50.0, 90.0))]
    prompts = [tok.encode(s.prompt) for s in samples]
    fp8 = {**ENGINE, "dtype": "bfloat16", "kv_cache_dtype": "fp8"}
    found = {}
    for label, engine in (("stock", fp8), ("radar+", {**fp8, "additional_config": SPARSE["additional_config"]})):
        result, log = run(tmp_path, f"fp8-{label}", {"engine": engine, "batches": [{"prompts": prompts}], "new_tokens": 12})
        texts = [tok.decode(r["tokens"]) for r in result["batches"][0]]
        found[label] = [s.answers[0] in text for s, text in zip(samples, texts)]
        if label == "radar+":
            assert result["answered"] > 0 and result["fallbacks"] == 0, result  # the paged engine read the fp8 pages
            assert "the fused kernel cannot run" not in log and "the fused kernel" in log  # not the generic path
    assert found["radar+"] == found["stock"] == [True, True, True], found
