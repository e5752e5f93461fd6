"""A running engine switched between methods, and teacher forcing through decode steps: what the serving
benchmark rests on (sparseattn.vllm.switch, sparseattn.vllm.forcing; needs vLLM, run by scripts/test.sh in
its venv).

One eager float32 engine started with radar+ at a budget well below the prompts (so radar+ and dense
answer differently), with the worker extension and the forcing logits processor. Every comparison is
made between requests whose prompts are already in the prefix cache (a cached prompt's last page is
computed apart from the rest, which moves float results by rounding: a fresh and a cached run are not
compared).
"""

import os

import pytest

from vllm_engine import HOST, fd_log, skip_unless_vllm_cpu

skip_unless_vllm_cpu()

from sparseattn.hf.models import local_model_dir  # noqa: E402

NEW_TOKENS = 24
RADAR = {"method": "radar+", "budget": 256}


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    from transformers import AutoTokenizer
    from vllm import LLM

    from sparseattn.evaluation.serving_workload import workload

    tok = AutoTokenizer.from_pretrained(str(local_model_dir()))
    rows = workload(tok, 3, 1500, NEW_TOKENS)
    log = tmp_path_factory.mktemp("switch") / "engine.log"
    with fd_log(log):
        llm = LLM(model=str(local_model_dir()), **HOST, dtype="float32", max_model_len=2048, enable_prefix_caching=True, seed=0,
                  enforce_eager=True, additional_config={"sparseattn": dict(RADAR)},
                  worker_extension_cls="sparseattn.vllm.switch.MethodSwitch", logits_processors=["sparseattn.vllm.forcing:ForcedTokens"])  # fmt: skip
    prompts = [r.ids for r in rows]
    greedy(llm, prompts)  # the prompts into the prefix cache
    yield llm, prompts, rows
    llm.llm_engine.engine_core.shutdown()


def greedy(llm, prompts, tokens=NEW_TOKENS, **extra):
    from vllm import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=tokens, min_tokens=tokens, ignore_eos=True, logprobs=1, **extra)
    return [o.outputs[0] for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)]


def tokens(outs):
    return [list(o.token_ids) for o in outs]


def test_a_method_switched_to_answers_as_the_method_the_engine_started_with(engine):
    from sparseattn.vllm.switch import use_method

    llm, prompts, _ = engine
    started = tokens(greedy(llm, prompts))
    assert use_method(llm, {"method": "dense"}) == "dense"
    dense = tokens(greedy(llm, prompts))
    assert dense != started  # budget 256 of 1500 tokens: radar+ is not dense here, or this test could not fail
    assert use_method(llm, "radar+:budget=256") == "radar+:budget=256"
    assert tokens(greedy(llm, prompts)) == started
    use_method(llm, {"method": "dense"})
    assert tokens(greedy(llm, prompts)) == dense


def test_a_method_the_paged_engine_cannot_run_is_refused_and_the_engine_keeps_its_method(engine):
    from sparseattn.vllm.switch import use_method

    llm, prompts, _ = engine
    use_method(llm, dict(RADAR))
    before = tokens(greedy(llm, prompts))
    with pytest.raises(Exception, match="h2o.*cannot run in vLLM"):
        use_method(llm, "h2o:budget=256")
    assert tokens(greedy(llm, prompts)) == before
    assert llm.collective_rpc("sparseattn_fallbacks") == [0]


def test_forced_tokens_are_generated_and_their_logprobs_are_the_free_runs(engine):
    from sparseattn.vllm.forcing import FORCED

    llm, prompts, _ = engine
    free = greedy(llm, prompts)
    forced = greedy(llm, prompts, extra_args={FORCED: list(free[0].token_ids)})  # every row fed row 0's tokens
    assert tokens(forced) == [list(free[0].token_ids)] * len(prompts)
    # Row 0 was fed its own greedy tokens: the same computation, the same logprobs, each its step's top-1.
    for step, token in enumerate(free[0].token_ids):
        assert forced[0].logprobs[step][token].logprob == pytest.approx(free[0].logprobs[step][token].logprob, abs=1e-4)
        assert forced[0].logprobs[step][token].rank == 1
    # Other rows were fed tokens their prompts do not predict: some are not their top-1.
    ranks = [forced[1].logprobs[step][t].rank for step, t in enumerate(free[0].token_ids)]
    assert max(ranks) > 1


def test_teacher_forcing_scores_the_held_continuation_better_than_a_shuffled_one(engine):
    import random

    from sparseattn.evaluation.vllm_engine import Forced, generate

    llm, _, rows = engine
    _, outs = generate(llm, [r.ids for r in rows], NEW_TOKENS, forced=[r.held for r in rows], logprobs=1)
    true = Forced.from_outputs(outs, [r.held for r in rows])
    shuffled = [r.__class__(r.ids, random.Random(0).sample(r.held, len(r.held)), r.question, r.key, r.depth, r.source) for r in rows]
    _, outs = generate(llm, [r.ids for r in shuffled], NEW_TOKENS, forced=[r.held for r in shuffled], logprobs=1)
    assert true.ppl() < Forced.from_outputs(outs, [r.held for r in shuffled]).ppl()
    assert true.top1_agreement(true) == 1.0


def test_a_bad_forced_list_is_refused_when_the_request_is_added(engine):
    from vllm import SamplingParams
    from vllm.exceptions import VLLMValidationError

    from sparseattn.vllm.forcing import FORCED

    llm, prompts, _ = engine
    with pytest.raises(VLLMValidationError, match="list of token ids"):
        llm.generate([{"prompt_token_ids": prompts[0]}], SamplingParams(max_tokens=2, extra_args={FORCED: [1, -2]}), use_tqdm=False)
