"""The evaluation commands run end to end on a tiny local checkpoint, write what they promise, and resume."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from sparseattn.cli import app
from sparseattn.cli.method_specs import parse_method
from tiny_checkpoint import save_tiny_checkpoint

runner = CliRunner()
TEXT = "".join(f"def f{i}(x):\n    return x * {i} + {i % 7}\n\n" for i in range(400))


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    root = tmp_path_factory.mktemp("eval")
    model = save_tiny_checkpoint(root / "model")
    text = root / "text.txt"
    text.write_text(TEXT)
    return root, str(model), str(text)


def invoke(*args: str):
    result = runner.invoke(app, list(args), catch_exceptions=False)
    assert result.exit_code == 0, result.output
    return result


def test_ppl_writes_records_and_summary_then_skips_and_resumes(workspace):
    root, model, text = workspace
    out = root / "ppl"
    invoke("ppl", "--model", model, "-m", "dense", "-m", "radar:top_k=2,n_features=32,window=16", "--text", text,
           "--prefill", "300", "--steps", "12", "--out", str(out))
    runs = sorted(p.parent for p in out.glob("*/*/summary.json"))
    assert len(runs) == 2
    for run in runs:
        summary = json.loads((run / "summary.json").read_text())
        records = [json.loads(line) for line in (run / "tokens.jsonl").read_text().splitlines()]
        assert summary["n_tokens"] == len(records) == 12
        assert [r["position"] for r in records] == list(range(301, 313))
        assert summary["ppl"] > 1 and summary["tokens_per_second"] > 0
        assert {"method", "params", "ppl", "n_tokens", "seconds", "tokens_per_second", "mean_attended_tokens"} <= set(summary)
    radar = json.loads((runs[1] / "summary.json").read_text())
    assert radar["method"].startswith("radar") and radar["mean_attended_tokens"] < radar["mean_context_tokens"]
    # An interrupted run (summary gone, last records lost or torn) resumes to the same numbers.
    tokens = runs[1] / "tokens.jsonl"
    lines = tokens.read_text().splitlines(keepends=True)
    tokens.write_text("".join(lines[:5]) + lines[5][:7])
    (runs[1] / "summary.json").unlink()
    invoke("ppl", "--model", model, "-m", "radar:top_k=2,n_features=32,window=16", "--text", text, "--prefill", "300", "--steps", "12",
           "--out", str(out))
    resumed = json.loads((runs[1] / "summary.json").read_text())
    assert resumed["ppl"] == pytest.approx(radar["ppl"], rel=1e-6)
    # A different config in the same directory (here: the same model named by another spec) is refused, not mixed;
    # before anything runs, as a usage error.
    result = runner.invoke(app, ["ppl", "--model", model + "/", "-m", "dense", "--text", text, "--prefill", "300", "--steps", "12",
                                 "--out", str(out)])
    assert result.exit_code == 2 and "different config" in result.output


def test_plot_draws_the_figure_and_the_table(workspace):
    root, model, text = workspace
    out = root / "plotted"
    invoke("ppl", "--model", model, "-m", "dense", "-m", "radar:top_k=2,n_features=32,window=16", "--text", text,
           "--prefill", "0", "--steps", "40", "--out", str(out))
    png = root / "ppl.png"
    result = invoke("plot", str(next(out.iterdir())), "--out", str(png))
    assert png.stat().st_size > 10_000 and png.read_bytes()[:4] == b"\x89PNG"
    table = png.with_suffix(".md").read_text()
    assert "| dense |" in table and "radar" in table
    assert "dense" in result.output


def test_needle_runs_scores_and_draws_a_heatmap(workspace):
    root, model, _ = workspace
    out = root / "needle"
    invoke("needle", "--model", model, "-m", "dense", "--task", "passkey", "--length", "600", "--depth", "50",
           "--samples", "2", "--max-new-tokens", "4", "--out", str(out))
    run = out / "needle-passkey" / "dense"
    records = [json.loads(line) for line in (run / "samples.jsonl").read_text().splitlines()]
    assert len(records) == 2 and all(r["prompt_tokens"] <= 600 for r in records)
    assert len({r["answers"][0] for r in records}) == 2  # distinct needles per sample
    assert (run / "heatmap.png").exists() and json.loads((run / "summary.json").read_text())["n_samples"] == 2


def test_diagnose_reports_hit_rates_and_the_exact_oracle_always_hits(workspace):
    root, model, text = workspace
    out = root / "diagnose"
    result = invoke("diagnose", "--model", model, "-m", "radar:top_k=2,n_features=32,window=16", "-m", "radar-exact:top_k=2",
                    "--text", text, "--prefill", "400", "--steps", "4", "--head", "0", "--out", str(out))
    runs = {p.parent.name: json.loads(p.read_text()) for p in out.glob("*/*/summary.json")}
    exact = next(v for k, v in runs.items() if k.startswith("radar-exact"))
    assert exact["overall"]["hit@1"] == pytest.approx(1.0)
    assert len(exact["per_layer"]) == 2 and len(exact["per_layer"][0]["hit@1"]) == 6  # 2 layers x 6 query heads
    assert any(out.glob("*/*/attention.png"))
    assert "hit@1" in result.output and "pooled oracle" in result.output
    kept = exact["overall"]
    # the exact segments are the grid's best at their own counts, below the pooled token oracle at the same budget
    assert kept["kept:grid_per_head"] == pytest.approx(kept["kept:method"])
    assert kept["kept:pooled"] >= kept["kept:per_head"] - 1e-9 >= kept["kept:method"] - 2e-9
    assert set(exact["per_layer"][0]["missed"]) == {"sinks", "recent", "near", "far"}


def test_method_specs_parse_options_and_reject_unknown_ones():
    label, method, given = parse_method("radar:top_k=3,n_features=16", budget=None)
    assert given == {"top_k": 3, "n_features": 16} and method.top_k == 3 and method.summary.n_features == 16
    assert parse_method("radar", budget=100)[2] == {"budget": 100}
    with pytest.raises(Exception, match="unknown method"):
        parse_method("nope")
    with pytest.raises(Exception, match="bad option"):
        parse_method("radar:bogus=1")


def longbench_example(task: str, i: int) -> dict:
    return {"input": f"What is item {i}?", "context": "Some context. " * 50, "answers": [f"item {i}"], "length": 100,
            "dataset": task, "language": "en", "all_classes": None, "_id": f"{task}-{i}"}


def test_longbench_run_writes_predictions_in_longbench_format_scores_them_and_resumes(workspace):
    root, model, _ = workspace
    data = root / "longbench-data"
    data.mkdir()
    for task in ("hotpotqa", "lcc"):
        (data / f"{task}.jsonl").write_text("".join(json.dumps(longbench_example(task, i)) + "\n" for i in range(3)))
    out = root / "lb"
    args = ["longbench", "run", "--data-dir", str(data), "--model", model, "-m", "radar:top_k=2,n_features=16",
            "--max-length", "300", "--no-chat", "--out", str(out)]
    invoke(*args, "--limit", "2")
    run = next((out / "longbench").iterdir())
    for task in ("hotpotqa", "lcc"):
        lines = [json.loads(line) for line in (run / f"{task}.jsonl").read_text().splitlines()]
        assert len(lines) == 2 and {"pred", "answers", "all_classes", "length"} <= set(lines[0])
        assert lines[0]["prompt_tokens"] <= 300 + 5  # middle-truncated (the template adds a few)
    result = json.loads((run / "result.json").read_text())
    assert set(result["scores"]) == {"hotpotqa", "lcc"} and result["n_tasks"] == 2
    before = (run / "hotpotqa.jsonl").read_text()
    invoke(*args, "--limit", "3")  # a longer limit resumes after line 2
    assert (run / "hotpotqa.jsonl").read_text().startswith(before)
    assert len((run / "hotpotqa.jsonl").read_text().splitlines()) == 3


def test_sweep_runs_every_panel_and_draws_it(workspace):
    root, model, text = workspace
    out = root / "sweep"
    result = invoke("sweep", "--model", model, "--text", text, "--prefill", "200", "--steps", "4", "--n", "16", "--n", "32",
                    "--k", "1", "--k", "2", "--fixed-n", "16", "--fixed-k", "2", "--out", str(out))
    root_dir = next(out.iterdir())
    sweep = json.loads((root_dir / "sweep.json").read_text())
    assert [len(points) for points in sweep["panels"].values()] == [2, 2, 5]
    assert (root_dir / "sweep.png").exists() and "selection" in result.output


@pytest.mark.parametrize("method", ["dense", "radar:top_k=2,n_features=32,window=16"])
def test_a_batch_of_rows_scores_each_row_as_its_own_run_does(workspace, tmp_path, method):
    # run_ppl on [B, T] ids decodes the rows together; each row's NLLs must be those of its own run.
    import torch

    from sparseattn.evaluation.ppl import run_ppl
    from sparseattn.evaluation.runs import RunDir
    from sparseattn.hf import load_model

    _, model_dir, _ = workspace
    model, tokenizer = load_model(model_dir)
    ids = torch.stack([tokenizer(TEXT[a : a + 400], return_tensors="pt")["input_ids"][0][:161] for a in (0, 977)])
    spec = parse_method(method)[1]
    batch = run_ppl(model, spec, ids, 150, 10, RunDir(tmp_path / "batch", {"m": method, "b": 2}), progress=False)
    assert batch["batch"] == 2 and batch["n_tokens"] == 10
    records = RunDir(tmp_path / "batch", {"m": method, "b": 2}).records("tokens.jsonl")
    for row in range(2):
        alone = run_ppl(model, spec, ids[row], 150, 10, RunDir(tmp_path / f"row{row}", {"m": method, "r": row}), progress=False)
        want = [r["nll"] for r in RunDir(tmp_path / f"row{row}", {"m": method, "r": row}).records("tokens.jsonl")]
        got = [r["nlls"][row] for r in records]
        assert got == pytest.approx(want, abs=1e-4)
        assert alone["batch"] == 1


def test_methods_decoded_together_score_as_they_do_alone(workspace, tmp_path):
    # run_ppl_together interleaves the methods' steps (for fair timing); the NLLs must not change.

    from sparseattn.evaluation.ppl import run_ppl, run_ppl_together
    from sparseattn.evaluation.runs import RunDir
    from sparseattn.hf import load_model

    _, model_dir, _ = workspace
    model, tokenizer = load_model(model_dir)
    ids = tokenizer(TEXT[:400], return_tensors="pt")["input_ids"][0][:141]
    methods = {name: parse_method(name)[1] for name in ("dense", "radar:top_k=2,n_features=32,window=16", "streamingllm:budget=40")}
    together = run_ppl_together(model, {n: (m, RunDir(tmp_path / "t" / str(i), {"m": n})) for i, (n, m) in enumerate(methods.items())},
                                ids, 120, 12, progress=False)
    for i, (name, method) in enumerate(methods.items()):
        alone = run_ppl(model, method, ids, 120, 12, RunDir(tmp_path / "a" / str(i), {"m": name}), progress=False)
        got = [r["nll"] for r in RunDir(tmp_path / "t" / str(i), {"m": name}).records("tokens.jsonl")]
        want = [r["nll"] for r in RunDir(tmp_path / "a" / str(i), {"m": name}).records("tokens.jsonl")]
        assert got == pytest.approx(want, abs=1e-4)
        assert together[name]["ppl"] == pytest.approx(alone["ppl"], rel=1e-4)
        assert together[name]["interleaved_with"] == sorted(set(methods) - {name})
    # Finished runs are skipped: the same call returns the saved summaries.
    again = run_ppl_together(model, {n: (m, RunDir(tmp_path / "t" / str(i), {"m": n})) for i, (n, m) in enumerate(methods.items())},
                             ids, 120, 12, progress=False)
    assert {n: s["ppl"] for n, s in again.items()} == {n: s["ppl"] for n, s in together.items()}
