"""The lm-eval adapter (``--model sparseattn``) on local YAML tasks over JSONL files the test writes, offline.

Dense through the adapter (prefill + one decode step per scored token, through a ``SparseCache``) must
give lm-eval's own ``hf`` model's answers: the same generations, the same multiple-choice choices, and
per-choice log-likelihoods equal within float32 rounding. A sparse method at a budget far under the
prompts must run and score every document.
"""

from __future__ import annotations

import json
import math
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch

lm_eval = pytest.importorskip("lm_eval", reason="lm-eval is not installed: pip install 'sparseattn[eval]'")

from sparseattn.testing import RELATIVE_TOLERANCE, save_tiny_checkpoint

OFFLINE = {
    "HF_HUB_OFFLINE": "1",
    "HF_DATASETS_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
}
N_DOCS = 5
#: Prompts of 126-261 characters (one token each) against a budget of 32: most of the context is skipped.
SPARSE_ARGS = "method=quest,budget=32,page_size=8"


@pytest.fixture(autouse=True)
def offline(monkeypatch):
    for key, value in OFFLINE.items():
        monkeypatch.setenv(key, value)


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    """A tiny checkpoint, two JSONL files and their two task YAMLs (generation, multiple choice)."""
    root = tmp_path_factory.mktemp("lm_eval")
    save_tiny_checkpoint(root / "model")
    rng = random.Random(0)
    letters = "abcdefghij"
    tasks = root / "tasks"
    tasks.mkdir()
    gen, mc = [], []
    for i in range(N_DOCS):
        filler = " ".join("".join(rng.choices(letters, k=5)) for _ in range(20 + 5 * i))
        key = "".join(rng.choices(letters, k=4))
        gen.append({"question": f"key {key}. {filler}. the key is", "answer": f" {key}"})
        choices = [" " + "".join(rng.choices(letters, k=3 + (j % 2))) for j in range(4)]
        mc.append({"question": f"{filler}. pick:", "choices": choices, "label": i % 4})
    for name, rows in (("gen", gen), ("mc", mc)):
        (root / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    common = {
        "dataset_path": "json",
        "test_split": "test",
        "doc_to_text": "{{question}}",
    }
    (tasks / "sa_gen.yaml").write_text(json.dumps({
        **common, "task": "sa_gen", "dataset_kwargs": {"data_files": {"test": str(root / "gen.jsonl")}},
        "output_type": "generate_until", "doc_to_target": "{{answer}}",
        "generation_kwargs": {"until": ["\n"], "max_gen_toks": 6, "do_sample": False},
        "metric_list": [{"metric": "exact_match", "aggregation": "mean", "higher_is_better": True}],
    }))  # fmt: skip
    (tasks / "sa_mc.yaml").write_text(json.dumps({
        **common, "task": "sa_mc", "dataset_kwargs": {"data_files": {"test": str(root / "mc.jsonl")}},
        "output_type": "multiple_choice", "doc_to_choice": "{{choices}}", "doc_to_target": "{{label}}",
        "metric_list": [{"metric": "acc"}, {"metric": "acc_norm"}],
    }))  # fmt: skip
    return root


def evaluate(workdir: Path, model: str, model_args: str, batch_size: int = 1) -> dict:
    from lm_eval.tasks import TaskManager

    import sparseattn.evaluation.lm_eval_model  # noqa: F401  (registers --model sparseattn)

    return lm_eval.simple_evaluate(
        model=model, model_args=f"pretrained={workdir / 'model'},{model_args}", tasks=["sa_gen", "sa_mc"],
        task_manager=TaskManager(include_path=str(workdir / "tasks")), device="cpu", batch_size=batch_size, log_samples=True,
    )  # fmt: skip


@pytest.fixture(scope="module")
def hf_results(workdir):
    return evaluate(workdir, "hf", "dtype=float32")


def _loglikelihoods(results: dict) -> list[float]:
    """Every choice's log-likelihood, document by document (a sample's ``resps``: ``[[(ll, is_greedy)], ...]``)."""
    return [float(choice[0][0]) for sample in results["samples"]["sa_mc"] for choice in sample["resps"]]


def test_dense_adapter_matches_hf(workdir, hf_results):
    # Batches of 3 left-pad the prompts of unequal lengths: the prefill must place them as generate does.
    ours = evaluate(workdir, "sparseattn", "method=dense,dtype=float32", batch_size=3)
    for task in ("sa_gen", "sa_mc"):
        assert ours["results"][task] == hf_results["results"][task], task
    generated = [s["filtered_resps"] for s in ours["samples"]["sa_gen"]]
    assert generated == [s["filtered_resps"] for s in hf_results["samples"]["sa_gen"]]
    assert any(g[0].strip() for g in generated), "the generations are empty: the comparison would prove nothing"
    # Prefill + decode steps sum their logits in another order than one forward: float32 rounding apart.
    mine, theirs = _loglikelihoods(ours), _loglikelihoods(hf_results)
    assert len(mine) == len(theirs) == 4 * N_DOCS
    for a, b in zip(mine, theirs):
        assert math.isclose(a, b, rel_tol=RELATIVE_TOLERANCE[torch.float32]), (a, b)
    assert ours["config"]["model_args"] and "dense" in ours["config"]["sparseattn_method"]


def test_sparse_method_runs(workdir, hf_results):
    ours = evaluate(workdir, "sparseattn", SPARSE_ARGS)
    assert ours["config"]["sparseattn_method"] == "quest:budget=32,page_size=8"
    assert 0 <= ours["results"]["sa_gen"]["exact_match,none"] <= 1
    assert 0 <= ours["results"]["sa_mc"]["acc,none"] <= 1
    assert len(ours["samples"]["sa_mc"]) == len(ours["samples"]["sa_gen"]) == N_DOCS
    # Sparse decoding over prompts 4-6x the budget changes the scores (else the method never applied).
    assert _loglikelihoods(ours) != _loglikelihoods(hf_results)


@pytest.mark.parametrize(
    ("model_args", "message"),
    [
        ("dtype=float32", "model_args need method=NAME"),
        ("method=nope", "unknown method 'nope'"),
        ("method=quest,page_size=0", "page_size"),
        ("method=quest,heavy_ratio=0.5", "quest does not take heavy_ratio"),
    ],
    ids=["no-method", "unknown", "out-of-range", "not-taken"],
)
def test_bad_method_refused_with_registry_message(workdir, model_args, message):
    from sparseattn.evaluation.lm_eval_model import SparseAttnLM

    with pytest.raises(ValueError, match=message):
        SparseAttnLM.create_from_arg_string(f"pretrained={workdir / 'model'},{model_args}", {"device": "cpu"})


def test_cli_runner(workdir, tmp_path):
    """The runner takes lm_eval's own arguments and writes lm-eval's results file."""
    command = [
        sys.executable, "-m", "sparseattn.evaluation.lm_eval_model", "--model", "sparseattn",
        "--model_args", f"pretrained={workdir / 'model'},{SPARSE_ARGS}", "--tasks", "sa_mc",
        "--include_path", str(workdir / "tasks"), "--device", "cpu", "--output_path", str(tmp_path / "out"),
    ]  # fmt: skip
    done = subprocess.run(
        command,
        check=False,
        capture_output=True,
        text=True,
        env={**os.environ, **OFFLINE},
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "sa_mc" in done.stdout and "acc" in done.stdout
    (results,) = (tmp_path / "out").rglob("results_*.json")
    assert json.loads(results.read_text())["config"]["sparseattn_method"] == "quest:budget=32,page_size=8"


def test_the_runner_refuses_a_bad_method_in_one_line_with_exit_status_2(capsys):
    from sparseattn.evaluation.lm_eval_model import main

    with pytest.raises(SystemExit) as exit_:
        main(["--model", "sparseattn", "--model_args", "pretrained=default,method=quest,budget=0", "--tasks", "x"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "budget 0 is out of range; allowed: an integer in [1, 2147483647]" in err
