"""benchmarks/gpu_quality.py, the GPU's quality check against the CPU's reference, run on the CPU at toy size: the same
machine meets every verdict, a reference that differs misses them, and the carried halves join only to their file."""

from __future__ import annotations

import hashlib
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
import gpu_quality  # noqa: E402
from test_models import save_tiny_llama  # noqa: E402

CONFIG = {"prefill": 40, "steps": 8, "new_tokens": 6, "budget": 24, "methods": ["dense", "radar+adaptive"]}


@pytest.fixture(scope="module")
def carried(tmp_path_factory):
    """A tiny model, two texts' random ids and the reference measured here, laid out as ``prepare`` lays them out."""
    root = tmp_path_factory.mktemp("quality")
    model = save_tiny_llama(root / "model")
    gen = torch.Generator().manual_seed(0)
    ids = {name: torch.randint(3, model.config.vocab_size, (60,), generator=gen).tolist() for name in ("prose", "code")}
    results = gpu_quality.measure(model, ids, CONFIG, torch.device("cpu"), graphs=False)
    (root / "carry" / "a").mkdir(parents=True)
    (root / "carry" / "a" / "ids.json").write_text(json.dumps(ids))
    reference = {"machine": gpu_quality.machine(), "config": CONFIG, "gguf": {"name": "x.gguf", "sha256": ""}, "results": results}
    return root, reference


def _check(root, reference, monkeypatch) -> dict:
    (root / "carry" / "a" / "reference.json").write_text(json.dumps(reference))
    out = root / "report.json"
    argv = ["gpu_quality.py", "check", "--device", "cpu", "--model", str(root / "model"), "--carry", str(root / "carry"),
            "--dtypes", "float32", "--out", str(out)]  # fmt: skip
    monkeypatch.setattr(sys, "argv", argv)
    gpu_quality.main()
    return json.loads(out.read_text())


def test_the_same_machine_meets_every_verdict(carried, monkeypatch):
    root, reference = carried
    report = _check(root, reference, monkeypatch)
    assert [v["met"] for v in report["verdicts"]] == [True] * 4, report["verdicts"]  # ppl and tokens, two methods
    for text, by_method in reference["results"].items():
        for method, want in by_method.items():
            got = report["runs"]["float32"][text][method]
            assert got["tokens"] == want["tokens"] and got["ppl"] == pytest.approx(want["ppl"], rel=1e-5)


def test_a_reference_that_differs_misses_its_verdicts(carried, monkeypatch):
    root, reference = carried
    moved = json.loads(json.dumps(reference))
    moved["results"]["code"]["radar+adaptive"]["ppl"] *= 1.01  # 1% off: over float32's 0.1%
    moved["results"]["prose"]["dense"]["tokens"][3] += 1  # the fourth token differs
    report = _check(root, moved, monkeypatch)
    met = {v["target"]: v["met"] for v in report["verdicts"]}
    assert met == {
        "float32, dense: ppl within 0.1% of the CPU's on every text": True,
        "float32, dense: the eager loop's greedy tokens equal the CPU's": False,
        "float32, radar+adaptive: ppl within 0.1% of the CPU's on every text": False,
        "float32, radar+adaptive: the eager loop's greedy tokens equal the CPU's": True,
    }
    assert "prose 3/6" in next(v["value"] for v in report["verdicts"] if v["target"].startswith("float32, dense: the eager"))


def test_the_halves_join_only_to_the_file_they_were_cut_from(tmp_path):
    data = bytes(range(256)) * 41
    gguf = {"name": "m.gguf", "sha256": hashlib.sha256(data).hexdigest()}
    with pytest.raises(ValueError, match="model.gguf.0, .*model.gguf.1 missing"):
        gpu_quality.joined_model(tmp_path / "carry", gguf, tmp_path)
    (tmp_path / "carry" / "a").mkdir(parents=True)
    (tmp_path / "carry" / "b").mkdir()
    (tmp_path / "carry" / "a" / "model.gguf.0").write_bytes(data[:5000])
    (tmp_path / "carry" / "b" / "model.gguf.1").write_bytes(data[5000:])
    assert gpu_quality.joined_model(tmp_path / "carry", gguf, tmp_path).read_bytes() == data
    (tmp_path / "carry" / "b" / "model.gguf.1").write_bytes(data[5001:])
    with pytest.raises(ValueError, match="sha256 differs"):
        gpu_quality.joined_model(tmp_path / "carry", gguf, tmp_path)


def test_bad_input_is_refused_before_any_work(tmp_path):
    """An unknown text, or a carry folder without what prepare wrote, is refused in one line with exit 2."""
    script = str(Path(gpu_quality.__file__))
    for argv, message in (
        (["prepare", "--texts", "nosuchtext"], "--texts: unknown text 'nosuchtext'"),
        (["check", "--device", "cpu", "--carry", str(tmp_path)], "reference.json, .*ids.json missing"),
    ):
        done = subprocess.run([sys.executable, script, *argv], capture_output=True, text=True)
        assert done.returncode == 2 and re.search(message, done.stderr), done.stderr
