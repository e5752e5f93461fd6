"""The quality report (issue 49): its intervals against known distributions, a planted failure, and the command
end to end on a tiny random model (files, resume, refusals)."""

from __future__ import annotations

import json
import math
import shutil
from statistics import NormalDist

import numpy as np
import torch
import pytest
from typer.testing import CliRunner

from sparseattn.evaluation.intervals import Interval, bootstrap_mean, compare, stratified_bootstrap_mean
from sparseattn.evaluation.report_output import REFERENCE_GAP_FLOOR
from sparseattn.testing import save_tiny_checkpoint

runner = CliRunner()


def binomial_bounds(trials: int, p: float, alpha: float = 1e-3) -> tuple[int, int]:
    """The counts a Binomial(trials, p) falls outside with probability below ``alpha`` (normal approximation,
    two-sided): a coverage count outside them refutes coverage ``p`` at level ``alpha``."""
    z = NormalDist().inv_cdf(1 - alpha / 2)
    sd = math.sqrt(trials * p * (1 - p))
    return math.floor(trials * p - z * sd), math.ceil(trials * p + z * sd)


def coverage(level: float, repetitions: int = 400, n: int = 100, p: float = 0.3, resamples: int = 1000) -> int:
    """How many of ``repetitions`` seeded Bernoulli(p) samples of size ``n`` get an interval that covers ``p``."""
    rng = np.random.default_rng(12345)
    hits = 0
    for r in range(repetitions):
        sample = (rng.random(n) < p).astype(float)
        hits += p in bootstrap_mean(sample, resamples=resamples, level=level, seed=r)
    return hits


def test_bernoulli_interval_covers_p_as_often_as_its_level():
    # The percentile bootstrap's coverage of a Bernoulli mean at n = 100 is within a percent of nominal; 400
    # repetitions give a count whose binomial spread (sd 4.4) is what the bounds allow (alpha = 1e-3).
    low, high = binomial_bounds(400, 0.95)
    assert low <= coverage(0.95) <= high


def test_the_coverage_check_rejects_an_interval_of_the_wrong_level():
    # The same check fails an interval that is too narrow (a 80% interval passed off as 95%): it can fail.
    low, high = binomial_bounds(400, 0.95)
    assert not low <= coverage(0.80) <= high


def test_normal_interval_width_is_two_z_sigma_over_root_n():
    # For normal samples the interval's width is 2 z sigma / sqrt(n). The tolerance is 4 standard errors of the
    # mean ratio over the repetitions: the sample sd varies by 1 / sqrt(2 n) relative, and each endpoint's
    # Monte Carlo error is sqrt(q (1 - q) / B) / phi(z) standard errors of the mean.
    n, sigma, reps, resamples = 400, 2.0, 40, 4000
    z = NormalDist().inv_cdf(0.975)
    expected = 2 * z * sigma / math.sqrt(n)
    rng = np.random.default_rng(7)
    ratios = [bootstrap_mean(rng.normal(5.0, sigma, n), resamples=resamples, seed=r).width / expected for r in range(reps)]
    endpoint = math.sqrt(0.025 * 0.975 / resamples) / NormalDist().pdf(z)  # in standard errors of the mean
    relative_sd = math.sqrt(1 / (2 * n) + 2 * endpoint**2 / (2 * z) ** 2)
    assert abs(np.mean(ratios) - 1) <= 4 * relative_sd / math.sqrt(reps)


def test_intervals_are_seeded_float64_and_degenerate_where_nothing_varies():
    scores = list(np.random.default_rng(0).normal(50.0, 20.0, 30))  # continuous: the quantiles move with the draws
    assert bootstrap_mean(scores, seed=3) == bootstrap_mean(scores, seed=3)
    assert bootstrap_mean(scores, seed=3) != bootstrap_mean(scores, seed=4)
    assert bootstrap_mean(scores).mean == pytest.approx(np.mean(np.asarray(scores, dtype=np.float64)), abs=0)
    assert bootstrap_mean([42.0]).width == 0 and bootstrap_mean([7.0] * 9).width == 0
    with pytest.raises(ValueError, match="no scores"):
        bootstrap_mean([])
    with pytest.raises(ValueError, match="finite"):
        bootstrap_mean([1.0, float("nan")])
    with pytest.raises(ValueError, match="resamples"):
        bootstrap_mean([1.0], resamples=0)


def test_stratified_mean_weighs_tasks_equally_and_resamples_within_each():
    # Task a has 2 prompts, b has 8: the mean over tasks is (mean a + mean b) / 2, not the pooled mean.
    strata = {"a": [100.0, 100.0], "b": [0.0] * 4 + [100.0] * 4}
    interval = stratified_bootstrap_mean(strata, seed=1)
    assert interval.mean == 75.0 and interval.n == 10
    # a never varies (both 100), so the spread is b's halved: b's own interval's half-width over 2.
    alone = bootstrap_mean(strata["b"], seed=1)
    assert interval.width == pytest.approx(alone.width / 2, rel=0.15)


def planted(task_scores: dict[str, list[float]]) -> dict[str, dict[int, float]]:
    return {task: dict(enumerate(scores)) for task, scores in task_scores.items()}


def test_a_method_that_fails_a_whole_task_shows_outside_dense_interval():
    rng = np.random.default_rng(0)
    tasks = {f"task{i}": list(np.where(rng.random(25) < 0.7, 100.0, 0.0)) for i in range(4)}
    dense = planted(tasks)
    same = planted({t: list(s) for t, s in tasks.items()})
    failing = planted({**tasks, "task2": [0.0] * 25})  # answers wrong on every prompt of one task
    assert compare(same, dense).verdict == "within" and compare(same, dense).paired
    verdict = compare(failing, dense)
    assert verdict.paired and not verdict.within_reference and verdict.worse and verdict.verdict == "worse"
    assert verdict.difference.high < 0 < verdict.reference.mean - verdict.method.mean
    # One cell alone: the failed task's interval excludes dense's mean on it.
    cell = bootstrap_mean(failing["task2"].values())
    assert np.mean(tasks["task2"]) not in cell


def test_paired_difference_is_narrower_than_unpaired_when_prompts_share_difficulty():
    rng = np.random.default_rng(5)
    difficulty = rng.random(30)
    dense = {"t": {i: 100.0 * (d < 0.6) for i, d in enumerate(difficulty)}}
    method = {"t": {i: 100.0 * (d < 0.5) for i, d in enumerate(difficulty)}}  # loses the prompts of middle difficulty
    paired = compare(method, dense, seed=2)
    unpaired = compare({"t": {i + 100: s for i, s in method["t"].items()}}, dense, seed=2)
    assert paired.paired and not unpaired.paired
    assert paired.difference.mean == unpaired.difference.mean == pytest.approx(-100 * np.mean((difficulty >= 0.5) & (difficulty < 0.6)))
    assert paired.difference.width < unpaired.difference.width
    with pytest.raises(ValueError, match="must be the same"):
        compare({"t": {0: 1.0}}, {"u": {0: 1.0}})


def test_interval_to_dict_round_trips():
    interval = bootstrap_mean([1.0, 2.0, 3.0], resamples=500)
    assert Interval(**interval.to_dict()) == interval


# -- the report end to end on a tiny random model ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("report")
    model = save_tiny_checkpoint(root / "model")
    bare = root / "bare"  # unreadable weights: a refused command never gets to loading them
    shutil.copytree(model, bare)
    for weights in bare.glob("*.safetensors"):
        weights.write_bytes(b"not weights")
    prose = root / "prose.txt"
    prose.write_text("Of man's first disobedience, and the fruit of that forbidden tree. " * 60)
    code = root / "code.py"
    code.write_text("def add(a, b):\n    return a + b\n\n" * 80)
    return root, str(model), str(bare), str(prose), str(code)


def run_report(*args: str):
    from sparseattn.cli import app

    return runner.invoke(app, ["report", *args], catch_exceptions=False)


def tiny_args(tiny, out) -> list[str]:
    root, model, _, prose, code = tiny
    return ["--model", model, "--out", str(out), "-m", "dense", "-m", "streamingllm", "-m", "radar+adaptive", "--budgets", "1/8",
            "--contexts", "1024", "--task", "niah_single_1", "--prompts", "3", "--passkey-prompts", "1",
            "--ppl-steps", "8", "--prose", prose, "--code", code, "--answer-tokens", "4"]  # fmt: skip


def test_report_writes_its_files_and_a_rerun_skips_finished_cells(tiny):
    root = tiny[0]
    out = root / "out"
    result = run_report(*tiny_args(tiny, out))
    assert result.exit_code == 0, result.output
    report = json.loads((out / "report.json").read_text())
    assert (out / "report.png").read_bytes()[:4] == b"\x89PNG"
    text = (out / "report.md").read_text()
    assert "RULER mean [95%]" in text and "gap ratio, prose: mean (worst)" in text and "ceiling-relative, code" in text
    labels = {c["label"] for c in report["cells"]}
    assert labels == {"dense@full", "streamingllm@1/8", "radar+adaptive@1/8"}
    cell = out / "transformers" / "niah_single_1-c1024" / "radar+adaptive-at-1of8"
    records = [json.loads(line) for line in (cell / "samples.jsonl").read_text().splitlines()]
    assert len(records) == 3 and all(r["prefilled_with"] == 3 for r in records)  # one prefill for the three cells
    summary = json.loads((cell / "summary.json").read_text())
    assert summary["budget_tokens"] == 128 and summary["n_prompts"] == 3 and 0 < summary["fraction"] < 0.5
    assert summary["score"]["low"] <= summary["score"]["mean"] <= summary["score"]["high"]
    passkey = [c for c in report["cells"] if c["task"] == "passkey" and c["label"] == "dense@full"][0]
    assert len(passkey["by_depth"]) == 10  # the full grid's 10 depths x 1 prompt
    ppl = {r["label"]: r for r in report["ppl"]}
    # the references run at the budget even though the oracle was not asked for; dense has no ratio
    assert set(ppl) == {"dense@full", "streamingllm@1/8", "radar+adaptive@1/8", "oracle-tokens:split=pooled@1/8"}
    for reference, key, text in (("streamingllm@1/8", "gap_ratio", tiny[3]), ("oracle-tokens:split=pooled@1/8",
                                                                              "ceiling_relative", tiny[4])):  # fmt: skip
        # its own ratio is 1, unless its gap is below the floor a ratio divides by
        gap, dense = ppl[reference]["ppl"][text] - ppl["dense@full"]["ppl"][text], ppl["dense@full"]["ppl"][text]
        assert ppl[reference][key][text] == pytest.approx(gap / max(gap, REFERENCE_GAP_FLOOR * dense))
    assert "gap_ratio" not in ppl["dense@full"]
    means = [m for m in report["means"] if m["group"] == "ruler"]
    assert {m["versus_dense"]["verdict"] for m in means if m["label"] == "dense@full"} == {"within"}
    # Again: every cell is finished, so nothing is prefilled or decoded; the records are untouched.
    before = {p: p.stat().st_mtime_ns for p in out.rglob("samples.jsonl")}
    ppl_before = {p: p.read_text() for p in (out / "transformers").glob("ppl-*/*/summary.json")}
    result = run_report(*tiny_args(tiny, out))
    assert result.exit_code == 0, result.output
    assert {p: p.stat().st_mtime_ns for p in out.rglob("samples.jsonl")} == before
    assert {p: p.read_text() for p in ppl_before} == ppl_before
    assert json.loads((out / "report.json").read_text())["cells"] == report["cells"]
    # One more prompt per task: only the new prompt runs, for every cell of the part.
    result = run_report(*[a if a != "3" else "4" for a in tiny_args(tiny, out)])
    assert result.exit_code == 0, result.output
    records = [json.loads(line) for line in (cell / "samples.jsonl").read_text().splitlines()]
    assert len(records) == 4 and records[-1]["prefilled_with"] == 3
    # A planted failure: the random model scores 0 everywhere, so let dense answer every niah_single_1 prompt right;
    # the report rebuilt from the cells' files then puts the other cells outside dense's interval, worse.
    dense = out / "transformers" / "niah_single_1-c1024" / "dense-at-full" / "samples.jsonl"
    dense.write_text("".join(json.dumps({**json.loads(line), "score": 100.0}) + "\n" for line in dense.read_text().splitlines()))
    result = run_report(*[a if a != "3" else "4" for a in tiny_args(tiny, out)])
    assert result.exit_code == 0, result.output
    means = {m["label"]: m for m in json.loads((out / "report.json").read_text())["means"] if m["group"] == "ruler"}
    assert means["dense@full"]["score"]["mean"] == 100.0  # one task, all right
    for label in ("streamingllm@1/8", "radar+adaptive@1/8"):
        versus = means[label]["versus_dense"]
        assert versus["paired"] and versus["verdict"] == "worse" and not versus["within_reference"], versus
    # The recommended preset's RULER target is missed, and the report says where: every prompt dense answered
    ruler = [t for t in json.loads((out / "report.json").read_text())["targets"] if t["target"] == "ruler 1024"][0]
    assert ruler["verdict"] == "missed" and ruler["by_task"] == {
        "niah_single_1": {"prompts": 4, "selection_lost": 4, "model_fails": 0}}
    assert "**transformers, ruler 1024**: missed" in (out / "report.md").read_text()


def test_shared_prefill_perplexity_equals_separate_runs(tiny, tmp_path):
    import torch

    from sparseattn import Dense, RadarPlus, StreamingLLM
    from sparseattn.evaluation.ppl import run_ppl
    from sparseattn.evaluation.report import ppl_shared
    from sparseattn.evaluation.runs import RunDir
    from sparseattn.hf import load_model

    model, _ = load_model(tiny[1])
    ids = torch.randint(3, 90, (2, 300), generator=torch.Generator().manual_seed(0))
    methods = {"dense": Dense(), "streamingllm": StreamingLLM(budget=64), "radar+": RadarPlus(budget=64)}
    shared = ppl_shared(model, {k: (m, RunDir(tmp_path / "shared" / k, {"m": k})) for k, m in methods.items()}, ids, 280, 12,
                        progress=False)  # fmt: skip
    for label, method in methods.items():
        alone = run_ppl(model, method, ids, 280, 12, RunDir(tmp_path / "alone" / label, {"m": label}), progress=False)
        assert math.exp(shared[label]["row_mean_nll"][0] / 2 + shared[label]["row_mean_nll"][1] / 2) == pytest.approx(
            alone["ppl"], rel=1e-5), label


@pytest.mark.parametrize("args, option, says", [
    (["--budgets", "1/0"], "--budgets", "'1/0' is not a budget; allowed: a fraction of the context 1/N"),
    (["--budgets", "512"], "--budgets", "'512' is not a budget; allowed"),
    (["--contexts", "5000"], "--contexts", "5000 is out of range; allowed: from 64 to 4096"),
    (["--contexts", "4k"], "--contexts", "'4k' is not a number of tokens"),
    (["--contexts", "300"], "--contexts", "niah_single_1 at context 300"),
    (["--prompts", "0"], "--prompts", "0 is out of range; allowed: >= 1"),
    (["--task", "vtt"], "--task", "unknown task 'vtt' (did you mean vt?)"),
    (["--task", "qa_1"], "--task", "qa_1 needs the SQuAD data set"),
    (["-m", "radarr"], "--method", "unknown method 'radarr'"),
    (["--prose", "no-such-book"], "--prose", "'no-such-book' is neither a file nor a known text"),
    (["--code", "king-lear"], "--code", "'king-lear' is a prose text; allowed: code texts"),
    (["--ppl-steps", "1500"], "--ppl-context", "1024 is not allowed; allowed: None or more than ppl_steps + 1 = 1501"),
    (["--ppl-context", "8000"], "--ppl-context", "8000 is out of range; allowed: from 64 to 4096"),
    (["--retrieval-budgets", "1/8,3"], "--retrieval-budgets", "'3' is not a budget; allowed"),
    (["--wide"], "--wide", "both given; allowed: one of them"),
    (["--engines", "transformers,sglang"], "--engines", "unknown engine 'sglang'; allowed: transformers, vllm"),
])  # fmt: skip
def test_report_refuses_bad_options_in_one_line_before_loading_the_model(tiny, args, option, says):
    root, _, bare, _, _ = tiny
    result = run_report("--model", bare, "--out", str(root / "refused"), "--quick", *args)
    errors = [line for line in result.output.splitlines() if line.startswith("Error")]
    assert result.exit_code == 2, result.output
    assert len(errors) == 1 and f"'{option}" in errors[0] and says in errors[0], result.output
    assert not (root / "refused").exists()


def test_an_engine_without_the_oracle_is_measured_against_transformers_oracle_on_the_same_texts():
    """vLLM's panel runs no oracle (its generic path only): its ceiling-relative gap divides by the transformers
    engine's oracle on the same texts, context and steps (dense decodes the same perplexities in both), and says so."""
    from sparseattn.evaluation.report_output import _oracle_for
    from sparseattn.evaluation.report_plan import PplPart

    def part(engine, steps=8, texts=("a", "b")):
        return PplPart(engine, 1024, steps, list(texts), ["prose", "code"], torch.zeros(2, 1024), [])

    tf, vllm, other = part("transformers"), part("vllm"), part("vllm", steps=16)
    oracle = {"row_ppl": [1.0, 2.0]}
    by_part = [(tf, {"oracle-tokens:split=pooled@1/8": oracle}), (vllm, {}), (other, {})]
    assert _oracle_for(tf, "1/8", by_part) == (oracle, "transformers")
    assert _oracle_for(vllm, "1/8", by_part) == (oracle, "transformers")
    assert _oracle_for(other, "1/8", by_part) == (None, None)  # other steps: not the same measurement
    assert _oracle_for(vllm, "1/4", by_part) == (None, None)
