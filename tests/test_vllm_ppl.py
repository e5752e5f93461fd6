"""``sparseattn ppl --engine vllm`` measures what ``sparseattn ppl`` measures: the same tokens' NLLs, through vLLM's
own decode steps (sparseattn.evaluation.vllm_ppl; needs vLLM, run by scripts/test.sh in its venv).

One eager float32 engine of the default model, started as ``run_ppl_vllm`` starts its own (the plugin's
method switchable, teacher forcing, pages of 32 tokens so that a small budget leaves most of a 700-token
context out), shared by every test; the transformers engine's dense NLLs on the same ids are the reference.

Tolerance. In float32 the two engines compute the same function with different kernels (vLLM's CPU
attention and GEMMs against torch's), so they differ only by the order of float32 sums: a relative
error of a few float32 ulps (6e-8) per sum, grown through 30 layers into logits that differ by ~1e-5
(measured here: the largest NLL difference was 2e-5). ``NLL_TOL = 1e-3`` nats (a 0.1% change of a
token's probability) leaves a 50x margin over that, and is still far below what a misalignment (the NLL
of the neighbouring token: nats) or a method that drops context (radar+ at budget 96 here: 1.6 nats on
one token) moves an NLL by.
"""

from pathlib import Path

import pytest

from vllm_engine import fd_log, skip_unless_vllm_cpu

skip_unless_vllm_cpu()

from sparseattn.hf.models import local_model_dir  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
PREFILL, STEPS, BLOCK = 700, 16, 32
#: The largest NLL difference (nats) two float32 engines may show on one token (module docstring).
NLL_TOL = 1e-3


@pytest.fixture(scope="module")
def ids():
    from transformers import AutoTokenizer

    from sparseattn.evaluation.ppl import tokenize

    tokenizer = AutoTokenizer.from_pretrained(str(local_model_dir()))
    return tokenize(tokenizer, (REPO / "docs" / "methods.md").read_text(), PREFILL + STEPS + 1, name="docs/methods.md").tolist()


@pytest.fixture(scope="module")
def logs(tmp_path_factory) -> tuple[Path, Path]:
    """``(terminal, engine log)``: what the engine's start wrote to the terminal, and to the log it was sent to."""
    folder = tmp_path_factory.mktemp("vllm-ppl")
    return folder / "terminal.txt", folder / "engine.log"


@pytest.fixture(scope="module")
def engine(logs):
    from sparseattn.cli.vllm_log import output_to_log
    from sparseattn.evaluation.vllm_engine import start_engine, stop_engine
    from sparseattn.evaluation.vllm_ppl import ENFORCE_EAGER

    terminal_file, log = logs
    with fd_log(terminal_file), output_to_log(log) as terminal:  # as `sparseattn serving-bench` starts its engines
        print("starting vLLM", file=terminal)
        llm = start_engine(str(local_model_dir()), dtype="float32", kv_cache_gib=2, max_model_len=PREFILL + STEPS + 1,
                           block_size=BLOCK, method={"method": "dense"}, enforce_eager=ENFORCE_EAGER)  # fmt: skip
    yield llm
    stop_engine(llm)


def test_the_engines_output_goes_to_the_log_and_the_terminal_has_only_the_progress_line(engine, logs):
    """The quiet mode of ``sparseattn serving-bench`` (sparseattn.cli.vllm_log): vLLM's banner, from this process's
    ``vllm`` logger and from the engine core process it spawned, is in the log, not on the terminal."""
    terminal_file, log = logs
    assert terminal_file.read_text() == "starting vLLM\n"
    text = log.read_text()
    assert "(MainProcess" in text and "(EngineCore" in text, text[-2000:]


@pytest.fixture(scope="module")
def dense_transformers(ids, tmp_path_factory):
    """The transformers engine's dense NLLs on the same ids (``sparseattn ppl``'s records)."""
    import torch

    from sparseattn.evaluation.ppl import run_ppl
    from sparseattn.evaluation.runs import RunDir
    from sparseattn.hf import load_model
    from sparseattn.methods.dense import Dense

    model = load_model("default", dtype=torch.float32)[0]
    run = RunDir(tmp_path_factory.mktemp("transformers") / "dense", {"engine": "transformers", "method": "dense"})
    run_ppl(model, Dense(), torch.tensor(ids), PREFILL, STEPS, run, progress=False)
    return run.records("tokens.jsonl")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return tmp_path_factory.mktemp("vllm-runs")


def through_vllm(engine, runs: Path, ids, label: str, config: dict) -> tuple[dict, list[dict]]:
    from sparseattn.evaluation.runs import RunDir
    from sparseattn.evaluation.vllm_ppl import run_ppl_vllm

    run = RunDir(runs / label, {"engine": "vllm", "block_size": BLOCK, "method": label})
    summary = run_ppl_vllm(str(local_model_dir()), {label: (config, run)}, ids, PREFILL, STEPS, llm=engine, say=lambda _: None)[label]
    return summary, run.records("tokens.jsonl")


def largest_difference(records: list[dict], reference: list[dict]) -> float:
    assert [(r["position"], r["token"]) for r in records] == [(r["position"], r["token"]) for r in reference]
    return max(abs(a["nll"] - b["nll"]) for a, b in zip(records, reference))


def test_a_record_per_step_scoring_the_tokens_the_transformers_steps_score(engine, runs, ids, dense_transformers):
    summary, records = through_vllm(engine, runs, ids, "dense", {"method": "dense"})
    assert len(records) == STEPS == summary["n_tokens"]
    assert [r["position"] for r in records] == list(range(PREFILL + 1, PREFILL + STEPS + 1))
    assert [r["token"] for r in records] == ids[PREFILL + 1 :]
    assert [(r["position"], r["token"]) for r in records] == [(r["position"], r["token"]) for r in dense_transformers]


def test_dense_through_vllm_gives_the_transformers_nlls(engine, runs, ids, dense_transformers):
    summary, records = through_vllm(engine, runs, ids, "dense", {"method": "dense"})  # finished above: read back
    assert largest_difference(records, dense_transformers) <= NLL_TOL
    assert summary["fallback_layer_steps"] == 0  # every decode step ran in the plugin's paged engine


def test_a_budget_covering_the_context_gives_the_dense_nlls(engine, runs, ids, dense_transformers):
    summary, records = through_vllm(engine, runs, ids, "radar+ full", {"method": "radar+", "budget": PREFILL + STEPS + 1})
    assert largest_difference(records, dense_transformers) <= NLL_TOL
    assert summary["fallback_layer_steps"] == 0


def test_a_small_budget_gives_other_nlls(engine, runs, ids, dense_transformers):
    summary, records = through_vllm(engine, runs, ids, "radar+ 96", {"method": "radar+", "budget": 96})  # 3 of 22 pages
    assert largest_difference(records, dense_transformers) > 10 * NLL_TOL
    assert summary["fallback_layer_steps"] == 0  # the method ran, not vLLM's dense kernel


def test_an_unfinished_run_is_redone_from_scratch(engine, runs, ids, dense_transformers):
    from sparseattn.evaluation.runs import RunDir

    run = RunDir(runs / "interrupted", {"engine": "vllm", "block_size": BLOCK, "method": "interrupted"})
    (run.path / "tokens.jsonl").write_text('{"position": 1, "nll": 99.0}\n{"position": 2, "nl')  # two torn records, no summary
    _, records = through_vllm(engine, runs, ids, "interrupted", {"method": "dense"})
    assert len(records) == STEPS
    assert largest_difference(records, dense_transformers) <= NLL_TOL
