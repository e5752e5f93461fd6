"""``sparseattn ppl --engine vllm`` refuses what cannot run before any work, and its protocol's bookkeeping,
without vLLM (the measurement itself, against the transformers engine, is tests/test_vllm_ppl.py, in the vLLM venv).

The refusals run in one subprocess through the console script's entry point, as in test_cli_serving.py;
the case that needs vLLM's absence is left out where it is installed (it would start an engine).
"""

from __future__ import annotations

import importlib.util
import json
import math

import pytest

from cli_driver import assert_one_error_line, run_cli_cases
from tiny_checkpoint import save_tiny_checkpoint

VLLM_INSTALLED = importlib.util.find_spec("vllm") is not None
TEXT = "".join(f"def f{i}(x):\n    return x * {i} + {i % 7}\n\n" for i in range(200))


def refusals(model: str, text: str) -> dict[str, tuple[list[str], list[str]]]:
    """name -> (command line, what its one ``Error:`` line must say)."""
    ppl = ["ppl", "--model", model, "--text", text, "--prefill", "100", "--steps", "4", "--out", "runs"]
    cases = {
        "unknown engine": (ppl + ["--engine", "bogus"], ["'--engine'", "'bogus' is not one of transformers, vllm"]),
        "block size without vllm": (ppl + ["--block-size", "32"],
                                    ["'--block-size'", "32 is given with --engine transformers", "only with --engine vllm"]),
        "kv cache without vllm": (ppl + ["--engine", "transformers", "--kv-cache-gib", "2"],
                                  ["'--kv-cache-gib'", "2 is given with --engine transformers", "only with --engine vllm"]),
        "block size not a multiple of 32": (ppl + ["--engine", "vllm", "--block-size", "48"],
                                            ["'--block-size'", "48 is not allowed", "a multiple of 32"]),
        "block size below 32": (ppl + ["--engine", "vllm", "--block-size", "16"], ["'--block-size'", "16 is not allowed", "a multiple of 32"]),
        "kv cache 0": (ppl + ["--engine", "vllm", "--kv-cache-gib", "0"], ["'--kv-cache-gib'", "0 is out of range", ">= 1"]),
        "no prompt for vllm": (ppl[:5] + ["--prefill", "0", "--steps", "4", "--engine", "vllm"],
                               ["'--prefill'", "0 is out of range with --engine vllm", ">= 1", "--engine transformers"]),
        "eviction method in vllm": (ppl + ["--engine", "vllm", "-m", "dense", "-m", "h2o", "--budget", "64"],
                                    ["'--method'", "'h2o:budget=64' (H2O) cannot run in vLLM", "eviction"]),
        "always-kept part in vllm": (ppl + ["--engine", "vllm", "-m", "radar-with-h2o", "--budget", "512"],
                                     ["'--method'", "always-kept", "not supported in vLLM"]),
    }
    if not VLLM_INSTALLED:
        hint = ["vLLM is not installed for", "docs/serving.md#install", "VENV/bin/sparseattn"]
        cases["vllm not installed"] = (ppl + ["--engine", "vllm", "-m", "dense"], hint)
    return cases


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    root = tmp_path_factory.mktemp("cli-ppl-engine")
    text = root / "text.txt"
    text.write_text(TEXT)
    return root, str(save_tiny_checkpoint(root / "model")), str(text)


@pytest.fixture(scope="module")
def results(workspace):
    root, model, text = workspace
    return run_cli_cases({name: args for name, (args, _) in refusals(model, text).items()}, root)


@pytest.mark.parametrize("name", list(refusals("m", "t")))
def test_a_bad_engine_combination_is_one_line_with_exit_status_2_before_any_work(workspace, results, name):
    root, model, text = workspace
    result = results[name]
    assert_one_error_line(result, refusals(model, text)[name][1])
    assert result["stdout"] == ""
    assert not (root / "runs").exists()  # nothing written


def test_the_vllm_module_imports_without_vllm():
    import sparseattn.evaluation.vllm_ppl as vllm_ppl

    assert vllm_ppl.DEFAULT_BLOCK_SIZE % 16 == 0


def test_the_forced_request_scores_the_tokens_the_transformers_steps_score():
    # transformers: step i feeds token prefill + i and scores token prefill + i + 1 (i < steps). vLLM: output 0 is
    # predicted by prefill (dropped), output k >= 1 by the decode step that fed output k - 1 = ids[prefill + k - 1].
    from sparseattn.evaluation.vllm_ppl import forced_request, records

    ids, prefill, steps = list(range(100, 117)), 5, 11
    prompt, forced = forced_request(ids, prefill, steps)
    assert prompt == ids[:prefill] and len(forced) == steps + 1
    fed = [prompt[-1]] + forced[:-1]  # output k is computed with this token as the newest input
    logprobs = [-float(token) for token in forced]  # a stand-in that names the token it scores
    rows = records(ids, prefill, steps, logprobs, forced)
    assert len(rows) == steps
    for i, row in enumerate(rows):
        assert fed[i + 1] == ids[prefill + i]  # the token transformers' step i feeds
        assert row["token"] == ids[prefill + i + 1] == row["nll"]  # the token it scores
        assert row["position"] == row["context"] == prefill + i + 1
        assert math.isnan(row["attended"]) and math.isnan(row["seconds"])


@pytest.mark.parametrize("prefill, steps, n", [(0, 4, 10), (5, 0, 10), (5, 5, 10)])
def test_a_forced_request_without_a_prompt_or_its_tokens_is_refused(prefill, steps, n):
    from sparseattn.evaluation.vllm_ppl import forced_request

    with pytest.raises(ValueError, match="prefill|token ids"):
        forced_request(list(range(n)), prefill, steps)


def test_finished_vllm_runs_are_skipped_without_starting_an_engine(tmp_path):
    from sparseattn.evaluation.runs import RunDir
    from sparseattn.evaluation.vllm_ppl import run_ppl_vllm

    run = RunDir(tmp_path / "dense", {"engine": "vllm", "method": "dense"})
    run.finish({"ppl": 3.0})
    said = []
    got = run_ppl_vllm("/no/such/model", {"dense": ({"method": "dense"}, run)}, list(range(20)), 8, 4, say=said.append)
    assert got == {"dense": {"ppl": 3.0}} and said == []


def test_the_table_shows_a_figure_vllm_does_not_report_as_a_dash(tmp_path):
    from sparseattn.evaluation.plots import ppl_table
    from sparseattn.evaluation.runs import RunDir

    run = RunDir(tmp_path / "r", {"method": "radar+"})
    run.appender("tokens.jsonl").close()
    run.finish({"method": "radar+", "text": "t", "prefill": 8, "n_tokens": 4, "ppl": 2.5, "tokens_per_second": 10.0,
                "mean_attended_tokens": float("nan"), "mean_context_tokens": 10.0})  # fmt: skip
    assert math.isnan(json.loads((run.path / "summary.json").read_text())["mean_attended_tokens"])  # NaN in the JSON
    row = ppl_table([run.path]).splitlines()[-1]
    assert row == "| radar+ | t | 8 | 4 | 2.500 | 10.00 | - | 10 |"
