"""The main job, `sparseattn compare`, end to end on the default model (tiny sizes), in a subprocess."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from sparseattn.hf import default_model_unavailable_reason


def test_compare_prints_one_row_per_method_and_writes_matching_json(tmp_path):
    reason = default_model_unavailable_reason()
    if reason is not None:
        pytest.skip(f"`sparseattn compare` runs the default model, which is unavailable: {reason}")
    out = tmp_path / "compare.json"
    result = subprocess.run(
        [sys.executable, "-m", "sparseattn.cli", "compare", "--batch", "2", "--prefill", "96", "--steps", "4",
         "--budget", "48", "-m", "radar+", "-m", "streamingllm", "--out", str(out)],
        capture_output=True, text=True, timeout=300, env={**os.environ, "SPARSEATTN_PROGRESS_SECONDS": "1"},
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    rows = {row["method"]: row for row in json.loads(out.read_text())["rows"]}
    assert list(rows) == ["dense (SDPA)", "dense (cpu kernel)", "radar+", "streamingllm"]
    for label in rows:
        assert label in result.stdout, f"the table has no row {label!r}"
    # The dense baselines attend every token and agree with themselves; both sparse methods attend the budget.
    assert rows["dense (SDPA)"]["top1_agrees_with_dense"] == 1.0
    assert rows["dense (SDPA)"]["speed_vs_dense"] == 1.0
    assert rows["dense (cpu kernel)"]["ppl"] == pytest.approx(rows["dense (SDPA)"]["ppl"], rel=1e-4)
    assert rows["dense (SDPA)"]["attended"] > 96
    for label in ("radar+", "streamingllm"):
        assert rows[label]["attended"] <= 48
        assert rows[label]["tokens_per_second"] > 0
    assert "prefill 2 x 96 tokens for 4 methods" in result.stderr  # one shared prefill, with progress
    assert f"wrote {out}" in result.stdout
