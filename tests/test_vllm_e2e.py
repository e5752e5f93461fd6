"""The vLLM plugin on the workloads issue 16 names: long mixed batches, prefix caching on and off, requests
arriving while others decode, passkey retrieval at 6k (needs vLLM: see docs/serving.md for the venv).

Slow (about 9 minutes on 2 cores: five engine starts and ~80k tokens of float32 prefill), so excluded
from the default run; run in the vLLM venv with ``-m slow``:

    .venv-vllm/bin/python -m pytest -m slow tests/test_vllm_e2e.py

Greedy tokens are compared in float32 (bfloat16 near-ties flip tokens between any two kernels, see
docs/serving.md). The prompts are token ids cut from this repository's docs, so their lengths are exact.
"""

import asyncio
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed: install sparseattn[vllm] in its own venv, see docs/serving.md")

from sparseattn.data.needle import PasskeyTask, string_match_all
from sparseattn.hf.models import local_model_dir
from vllm_engine import greedy_tokens

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[1]
NEW_TOKENS = 64
#: The model's 8k context; prefill in chunks of 1024 tokens, so long prompts prefill while short ones decode.
ENGINE = {"dtype": "float32", "max_model_len": 8192, "max_num_batched_tokens": 1024, "enable_chunked_prefill": True, "seed": 0}
#: Eight prompts of mixed lengths, three over 4k tokens; the two of 4300 share their first 4290 tokens
#: (with prefix caching on, their pages are shared, and so are the plugin's page summaries).
LENGTHS = (5, 250, 1200, 2500, 4300, 4300, 4800, 5200)


def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(local_model_dir()))


def prompts() -> list[list[int]]:
    tok = tokenizer()
    docs = [(REPO / "docs" / name).read_text() for name in ("methods.md", "api.md", "performance.md", "serving.md", "theory.md")]
    ids = [tok.encode(text, add_special_tokens=False) for text in docs]
    shared = ids[0][:4290]
    out = [tok.encode("The capital of France is", add_special_tokens=False)]
    for n, source in zip(LENGTHS[1:4], (ids[2], ids[3], ids[4])):
        out.append(source[:n])
    for question in ("\nQuestion: in one sentence, what is Radar and why is it fast? Answer:",
                     "\nQuestion: in one sentence, what does the budget of a method count? Answer:"):
        out.append(shared + tok.encode(question, add_special_tokens=False)[: 4300 - 4290])
    out.append(ids[1][:4800])
    out.append((ids[3] + ids[4])[:5200])
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

    engine = AsyncLLM.from_engine_args(AsyncEngineArgs(model=str(local_model_dir()), **{**ENGINE, **extra}))
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    tokens: dict[int, list[int]] = {}
    progress = {i: 0 for i in range(len(token_prompts))}

    async def run(i: int) -> None:
        async for out in engine.generate({"prompt_token_ids": token_prompts[i]}, params, request_id=f"r{i}"):
            tokens[i] = list(out.outputs[0].token_ids)
            progress[i] = len(tokens[i])

    try:
        early = [asyncio.create_task(run(i)) for i in range(0, len(token_prompts), 2)]
        seen_at_arrival = []
        for i in range(1, len(token_prompts), 2):
            while min(progress[j] for j in range(0, len(token_prompts), 2)) < 1 + i:  # the early ones are decoding
                await asyncio.sleep(0.05)
            seen_at_arrival.append(min(progress[j] for j in range(0, len(token_prompts), 2)))
            early.append(asyncio.create_task(run(i)))
        await asyncio.gather(*early)
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
    return generate(tmp, "stock", token_prompts)


@pytest.mark.parametrize(
    "label, extra",
    [
        ("dense-prefix-caching", {"additional_config": {"sparseattn": {"method": "dense"}}, "enable_prefix_caching": True}),
        ("radar+-full-budget-no-prefix-caching", {"additional_config": {"sparseattn": {"method": "radar+", "budget": 8192}}, "enable_prefix_caching": False}),
    ],
)
def test_eight_mixed_prompts_in_one_batch_give_stock_tokens(tmp, token_prompts, stock, label, extra):
    """At a budget covering the context, 64 greedy tokens of 8 prompts (5 to 5200 tokens, two sharing a
    4290-token prefix) equal stock vLLM's, with prefix caching on (shared pages) and off, chunked prefill on
    (mixed steps: vLLM's kernel attends the prefill requests only, the paged engine the decode tokens)."""
    tokens, log = generate(tmp, label, token_prompts, **extra)
    assert "first decode step answered by the paged engine" in log, log[-3000:]
    # chunks of 1024 tokens: the short prompts decode while the long ones prefill, in the same steps
    assert "a mixed step's prefill requests attended by vLLM's kernel alone" in log, log[-3000:]
    assert all(len(t) == NEW_TOKENS for t in stock[0])
    assert tokens == stock[0]


def test_requests_arriving_while_others_decode_give_stock_tokens(token_prompts, stock):
    """The async engine: the late requests arrive while the early ones are decoding (their prefill
    chunks join decode batches); every request completes with stock vLLM's tokens."""
    extra = {"additional_config": {"sparseattn": {"method": "dense"}}}
    tokens, seen = asyncio.run(_arriving(token_prompts, extra))
    assert all(n >= 1 for n in seen), seen  # each late request arrived after the early ones had begun decoding
    assert tokens == stock[0]


DEPTHS = (10.0, 50.0, 90.0)
#: vLLM pages of 32 tokens: budget 512 buys 16 pages, sinks and tail included.
PASSKEY_BLOCK = 32


@pytest.fixture(scope="module", params=[PASSKEY_BLOCK])
def passkey_answers(tmp, request):
    """radar+ at budget 512: three 6000-token passkey prompts (depths 10, 50, 90%) in one batch."""
    tok = tokenizer()
    samples = [PasskeyTask().sample(6000, tok, seed=i, depths=depth, reserve_tokens=16) for i, depth in enumerate(DEPTHS)]
    tokens, log = generate(
        tmp, f"passkey-block{request.param}", [tok.encode(s.prompt) for s in samples], new_tokens=16,
        additional_config={"sparseattn": {"method": "radar+", "budget": 512}}, block_size=request.param,
    )  # fmt: skip
    assert "first decode step answered by the paged engine (radar+:budget=512)" in log, log[-3000:]
    return {depth: (tok.decode(t), s.answers) for depth, t, s in zip(DEPTHS, tokens, samples)}


@pytest.mark.parametrize("depth", DEPTHS)
def test_radar_plus_finds_the_passkey_at_6k_with_budget_512(passkey_answers, depth):
    """radar+ at budget 512 of a 6000-token prompt answers the passkey at every depth, with 32-token pages
    (with vLLM's default 128-token pages, 512 tokens are 4 pages: at depth 10% it answered 2524 for 25248)."""
    answer, references = passkey_answers[depth]
    assert string_match_all([answer], [references]) == 100.0, (answer, references)


def test_page_summaries_follow_vllm_reusing_freed_blocks(tmp, token_prompts):
    """radar+ keeps page summaries per physical block: when vLLM frees one request's blocks and hands them
    to the next (a cache of 56 blocks, prefix caching off), the second request's tokens are those it gets
    from a fresh engine, not those of summaries left over from the first request's keys."""
    from vllm import LLM, SamplingParams

    from vllm_engine import fd_log

    first, second = token_prompts[6], token_prompts[7]  # 4800 and 5200 tokens: 38 and 41 of the 56 blocks
    # 56 blocks hold 7168 tokens: vLLM refuses a max_model_len (8192 in ENGINE) one request could not fit in
    overrides = {"additional_config": {"sparseattn": {"method": "radar+", "budget": 512}}, "enable_prefix_caching": False,
                 "num_gpu_blocks_override": 56, "max_model_len": 6144}  # fmt: skip
    extra = {**ENGINE, **overrides}
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    with fd_log(tmp / "block-reuse.log"):
        llm = LLM(model=str(local_model_dir()), **extra)
        llm.generate([{"prompt_token_ids": first}], params)
        after_first = list(llm.generate([{"prompt_token_ids": second}], params)[0].outputs[0].token_ids)
        del llm
    log = (tmp / "block-reuse.log").read_text()
    assert "first decode step answered by the paged engine (radar+:budget=512)" in log, log[-3000:]
    alone, _ = generate(tmp, "block-reuse-fresh", [second], **overrides)
    assert after_first == alone[0]
