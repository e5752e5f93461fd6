"""The vLLM plugin on the workloads issue 16 names: a long mixed batch, prefix caching on and off, chunked
prefill, requests arriving while others decode, the page summaries when vLLM reuses freed blocks (needs vLLM:
``bash scripts/vllm-venv.sh``; scripts/test.sh runs this module there). Passkey retrieval at 6k with
radar+ at budget 512 is asked of the real server, in test_vllm_server.py.

Greedy tokens are compared in float32 (bfloat16 near-ties flip tokens between any two kernels: the bfloat16
comparison, with vLLM's logprobs, is in test_vllm_plugin.py). Four engines, eager (a compiled engine spends
a minute compiling, an eager one starts in ~20 s; the compiled path is the benchmarks');
about four minutes on 2 cores, most of it float32 prefill. The prompts are token ids cut from this
repository's docs, so their lengths are exact.
"""

import asyncio
from pathlib import Path

import pytest

from vllm_engine import HOST, fd_log, greedy_tokens, skip_unless_vllm_cpu

skip_unless_vllm_cpu()

from sparseattn.hf.models import local_model_dir  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
NEW_TOKENS = 64
#: The model's 8k context; prefill in chunks of 1024 tokens, so long prompts prefill while short ones decode.
ENGINE = {"dtype": "float32", "max_model_len": 8192, "max_num_batched_tokens": 1024, "enable_chunked_prefill": True,
          "seed": 0, "enforce_eager": True}  # fmt: skip
#: Eight prompts of mixed lengths, two over 4k tokens sharing their first 4090 (with prefix caching on, their
#: pages are shared, and so are the plugin's page summaries).
LENGTHS = (5, 100, 300, 600, 1200, 2000, 4100, 4100)
SHARED = 4090


def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(local_model_dir()))


def prompts() -> list[list[int]]:
    tok = tokenizer()
    docs = [(REPO / "docs" / name).read_text() for name in ("methods.md", "api.md", "performance.md", "serving.md", "theory.md")]
    ids = [tok.encode(text, add_special_tokens=False) for text in docs]
    out = [tok.encode("The capital of France is", add_special_tokens=False)]
    for n, source in zip(LENGTHS[1:6], (ids[2], ids[3], ids[4], ids[1], ids[3] + ids[4])):
        out.append(source[:n])
    for question in ("\nQuestion: in one sentence, what is Radar and why is it fast? Answer:",
                     "\nQuestion: in one sentence, what does the budget of a method count? Answer:"):
        out.append(ids[0][:SHARED] + tok.encode(question, add_special_tokens=False)[: LENGTHS[-1] - SHARED])
    assert [len(p) for p in out][1:] == list(LENGTHS[1:]), [len(p) for p in out]
    return out


def generate(tmp: Path, label: str, token_prompts: list[list[int]], new_tokens: int = NEW_TOKENS, **extra) -> tuple[list[list[int]], str]:
    """Greedy tokens of every prompt, all in one batch, from a fresh engine, and its log."""
    prompts = [{"prompt_token_ids": p} for p in token_prompts]
    return greedy_tokens(tmp / f"{label}.log", prompts, {**ENGINE, **extra}, new_tokens, ignore_eos=True, cache_gib="4")


async def _arriving(token_prompts: list[list[int]], extra: dict) -> tuple[list[list[int]], list[int]]:
    """Half the requests first; the other half each once the first ones are decoding. Returns every
    request's tokens and, for each late request, how many tokens the early ones had when it arrived."""
    from vllm import SamplingParams
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    engine = AsyncLLM.from_engine_args(AsyncEngineArgs(model=str(local_model_dir()), **{**HOST, **ENGINE, **extra}))
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    tokens: dict[int, list[int]] = {}
    progress = {i: 0 for i in range(len(token_prompts))}
    early_ones = range(0, len(token_prompts), 2)

    async def run(i: int) -> None:
        async for out in engine.generate({"prompt_token_ids": token_prompts[i]}, params, request_id=f"r{i}"):
            tokens[i] = list(out.outputs[0].token_ids)
            progress[i] = len(tokens[i])

    try:
        tasks = [asyncio.create_task(run(i)) for i in early_ones]
        seen_at_arrival = []
        for i in range(1, len(token_prompts), 2):
            while min(progress[j] for j in early_ones) < 1 + i:  # the early ones are decoding
                await asyncio.sleep(0.05)
            seen_at_arrival.append(min(progress[j] for j in early_ones))
            tasks.append(asyncio.create_task(run(i)))
        await asyncio.gather(*tasks)
    finally:
        engine.shutdown()
    return [tokens[i] for i in range(len(token_prompts))], seen_at_arrival


@pytest.fixture(scope="module")
def tmp(tmp_path_factory):
    return tmp_path_factory.mktemp("vllm-e2e")


@pytest.fixture(scope="module")
def token_prompts():
    return prompts()


@pytest.fixture(scope="module")
def stock(tmp, token_prompts):
    """Stock vLLM (no method asked for: vLLM's own CPU attention), prefix caching on."""
    tokens, log = generate(tmp, "stock", token_prompts, enable_prefix_caching=True)
    assert "sparseattn:" not in log
    assert all(len(t) == NEW_TOKENS for t in tokens)
    return tokens


def test_eight_mixed_prompts_in_one_batch_give_stock_tokens_without_prefix_caching(tmp, token_prompts, stock):
    """radar+ at a budget covering the context: 64 greedy tokens of 8 prompts (5 to 4100 tokens) equal stock
    vLLM's, prefix caching off, chunked prefill on (mixed steps: vLLM's kernel attends the prefill requests
    only, the paged engine the decode tokens)."""
    extra = {"additional_config": {"sparseattn": {"method": "radar+", "budget": 8192}}, "enable_prefix_caching": False}
    tokens, log = generate(tmp, "radar+-full-budget-no-prefix-caching", token_prompts, **extra)
    assert "first decode step answered by the paged engine (radar+:budget=8192)" in log, log[-3000:]
    # chunks of 1024 tokens: the short prompts decode while the long ones prefill, in the same steps
    assert "a mixed step's prefill requests attended by vLLM's kernel alone" in log, log[-3000:]
    assert tokens == stock


def test_requests_arriving_while_others_decode_with_prefix_caching_give_stock_tokens(tmp, token_prompts, stock):
    """The async engine, the plugin's dense path, prefix caching on (the two prompts over 4k share 4090 tokens:
    their pages, and their page summaries, are shared): the late requests arrive while the early ones are
    decoding (their prefill chunks join decode batches); every request completes with stock vLLM's tokens."""
    extra = {"additional_config": {"sparseattn": {"method": "dense"}}, "enable_prefix_caching": True}
    log = tmp / "dense-arriving-prefix-caching.log"
    with fd_log(log):
        tokens, seen = asyncio.run(_arriving(token_prompts, extra))
    text = log.read_text()
    assert "first decode step answered by the paged engine (dense)" in text, text[-3000:]
    assert all(n >= 1 for n in seen), seen  # each late request arrived after the early ones had begun decoding
    assert tokens == stock


def test_page_summaries_follow_vllm_reusing_freed_blocks(tmp, token_prompts):
    """radar+ keeps page summaries per physical block (radar+adaptive also each page's key and value sums, for
    its merged rest). In a cache of 64 blocks of 32 tokens (65: vLLM keeps
    one as its null block; prefix caching off) one request of 1700 tokens runs, then one of 1500, then the first again: its second run must reuse
    at least 41 blocks the 1500-token request filled with its keys, and its tokens must be those of its first
    run (fresh blocks), not those of summaries left over from the other request. At budget 512 (16 pages of
    the ~55) the selection depends on every summary. radar+adaptive runs a method per layer (layer 0 without
    the merged rest), per-head page counts and the merged rest: every decode step answered, none fallen back;
    with ``segment`` "auto" (``sparseattn serve``'s default), its own grid at 2048 tokens: sqrt(2048) / 16 -> 2-token
    segments, sixteen per page, each with its own summary and sums. The three run in one engine, switched between
    (:mod:`sparseattn.vllm.switch`: a switch drops what the last method derived from the pages, so each method's
    first run fills its own stores afresh)."""
    from vllm import LLM, SamplingParams

    from sparseattn.vllm.switch import use_method

    again, other = token_prompts[5][:1700], token_prompts[4][:1500]
    methods = [("radar+", {}), ("radar+adaptive", {}), ("radar+adaptive", {"segment": "auto"})]
    overrides = {"additional_config": {"sparseattn": {"method": "radar+", "budget": 512}}, "enable_prefix_caching": False,
                 "num_gpu_blocks_override": 65, "block_size": 32, "max_model_len": 2048,
                 "worker_extension_cls": "sparseattn.vllm.switch.MethodSwitch"}  # fmt: skip
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    log = tmp / "block-reuse.log"
    results = {}
    with fd_log(log):
        llm = LLM(model=str(local_model_dir()), **{**HOST, **ENGINE, **overrides})
        for method, engine in methods:
            use_method(llm, {"method": method, "budget": 512, **engine})
            runs = [list(llm.generate([{"prompt_token_ids": p}], params)[0].outputs[0].token_ids) for p in (again, other, again)]
            results[method, bool(engine)] = runs
        del llm
    text = log.read_text()
    for method, engine in methods:
        assert f"first decode step answered by the paged engine ({method}:budget=512)" in text, text[-3000:]
        grid = "2-token segments" if engine else "whole pages"
        assert f"decode tokens run '{method}:budget=512' in the paged engine on {grid} of 32-token pages" in text, text[-3000:]
        runs = results[method, bool(engine)]
        assert runs[1] != runs[0]  # two different texts: a wrong reuse of the first one's summaries could show
        assert runs[2] == runs[0]
    assert "fell back to vLLM's dense kernel" not in text, text[-3000:]
