"""``sparseattn report``'s vLLM panel: the same cells through the plugin's paged engine, beside the transformers
panel (sparseattn.evaluation.report_vllm; needs vLLM, run by scripts/test.sh in its venv).

The default model, small: 1024-token prompts of one RULER task, 512-token perplexity texts. Both engines run in
float32, so dense is the same function in both: the same greedy answers, and perplexities within 1e-3 relative
(tests/test_vllm_ppl.py explains the tolerance: float32 sums in another order).
"""

import json
import math
from pathlib import Path

import pytest

from vllm_engine import skip_unless_vllm_cpu

skip_unless_vllm_cpu()

from typer.testing import CliRunner  # noqa: E402

REPO = Path(__file__).resolve().parents[1]


def report(out: Path):
    from sparseattn.cli import app

    args = ["report", "--out", str(out), "--engines", "transformers,vllm", "-m", "dense", "-m", "radar+", "-m", "snapkv",
            "--budgets", "1/8", "--contexts", "1024", "--task", "niah_single_1", "--prompts", "2", "--passkey-prompts", "0",
            "--ppl-steps", "8", "--ppl-context", "512", "--prose", str(REPO / "docs" / "methods.md"), "--code",
            str(REPO / "sparseattn" / "registry.py"), "--answer-tokens", "8"]  # fmt: skip
    return CliRunner().invoke(app, args, catch_exceptions=False)


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    out = tmp_path_factory.mktemp("vllm-report") / "out"
    result = report(out)
    assert result.exit_code == 0, result.output
    return out, result.output


def test_the_vllm_panel_runs_the_methods_its_engine_runs(finished):
    out, _ = finished
    data = json.loads((out / "report.json").read_text())
    cells = {(c["engine"], c["label"]) for c in data["cells"]}
    assert cells == {("transformers", "dense@full"), ("transformers", "radar+@1/8"), ("transformers", "snapkv@1/8"),
                     ("vllm", "dense@full"), ("vllm", "radar+@1/8")}  # no SnapKV in the paged engine  # fmt: skip
    ppl = {(r["engine"], r["label"]) for r in data["ppl"]}
    # the oracle is on vLLM's generic path: not in its panel (so no ceiling-relative gap there)
    assert ("vllm", "streamingllm@1/8") in ppl and ("vllm", "oracle-tokens:split=pooled@1/8") not in ppl
    # the recommended preset did not run here: its targets are said to be not measured, not met or missed
    assert {t["verdict"] for t in data["targets"]} == {"not measured"}
    # the x of a vLLM point is its budget over the context (the paged engine counts nothing), and says so
    radar = out / "vllm" / "niah_single_1-c1024" / "radar+-at-1of8"
    records = [json.loads(line) for line in (radar / "samples.jsonl").read_text().splitlines()]
    assert len(records) == 2 and all(r["attended_measured"] is False for r in records)
    assert json.loads((radar / "summary.json").read_text())["fraction"] == pytest.approx(128 / 1024, rel=0.02)
    assert (out / "report.png").read_bytes()[:4] == b"\x89PNG" and "Retrieval, vllm, 1024 tokens" in (out / "report.md").read_text()


def test_dense_is_the_same_in_both_engines(finished):
    out, _ = finished
    answers = {}
    for engine in ("transformers", "vllm"):
        cell = out / engine / "niah_single_1-c1024" / "dense-at-full" / "samples.jsonl"
        answers[engine] = [json.loads(line)["prediction"] for line in cell.read_text().splitlines()]
    assert answers["vllm"] == answers["transformers"]
    data = json.loads((out / "report.json").read_text())
    dense = {r["engine"]: r["ppl"] for r in data["ppl"] if r["label"] == "dense@full"}
    for text, value in dense["transformers"].items():
        assert math.isclose(dense["vllm"][text], value, rel_tol=1e-3), text


def test_vllm_output_goes_to_its_log_and_a_rerun_starts_no_engine(finished):
    out, _ = finished
    log = out.with_suffix(".vllm.log")  # beside the report, as serving-bench's
    assert "EngineCore" in log.read_text()
    before = {p: p.stat().st_mtime_ns for p in [log, *out.rglob("samples.jsonl")]}
    result = report(out)
    assert result.exit_code == 0, result.output
    assert {p: p.stat().st_mtime_ns for p in before} == before  # no engine started: its log not even opened
