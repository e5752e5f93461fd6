"""The prepared GPU check runs end to end on the CPU at toy sizes, so it cannot rot before a GPU is lent.

``scripts/gpu-check.sh --cpu`` runs the same five steps as on a GPU (kernel tests, the method contract,
one layer's decode step, ``model.generate`` end to end, the fixed-shape loop) with toy sizes and the kernels in Triton's
interpreter, and writes the same report. Beside it, the end-to-end benchmark's shortcut is checked:
a segment search's cache built from a dense prefill is the cache its own prefill gives.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

HAS_TRITON = importlib.util.find_spec("triton") is not None


@pytest.mark.skipif(not HAS_TRITON, reason="needs triton (pip install -e '.[dev]'): the kernel step runs Triton's interpreter")
def test_the_gpu_check_runs_every_step_on_the_cpu_and_writes_its_report(tmp_path):
    done = subprocess.run(
        ["bash", str(ROOT / "scripts" / "gpu-check.sh"), "--cpu", "--out", str(tmp_path)],
        capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    report = json.loads((tmp_path / "report.json").read_text())
    assert [s["step"] for s in report["steps"]] == ["kernels", "contract", "attention", "generate", "loop"]
    assert all(s["status"] == "passed" for s in report["steps"]), [(s["step"], s["status"], s["tail"][-5:]) for s in report["steps"]]
    assert " passed" in report["steps"][0]["summary"] and " failed" not in report["steps"][0]["summary"]
    methods = {r["method"] for r in report["attention_rows"]}
    assert {"dense", "dense (cpu kernel)", "radar (budget 4096)", "radar+ (budget 4096)", "quest (budget 4096)"} <= methods
    assert all(r["correct"] for r in report["attention_rows"])  # every row checked against its float64 reference
    assert {r["method"] for r in report["generate_rows"]} == {"dense (transformers sdpa)", "dense (sparseattn Dense)", "radar+ (budget 64)", "quest (budget 64)"}
    assert {(r["method"], r["mode"]) for r in report["loop_rows"]} == {
        (m, mode) for m in ("dense (cpu kernel)", "radar+ (budget 64)", "radar+adaptive (budget 64)", "quest (budget 64)")
        for mode in ("generate", "loop")
    }
    assert all(r["tokens_equal_generate"] for r in report["loop_rows"])  # the loop decodes model.generate's tokens
    assert all(t["met"] is not None for t in report["targets"])  # every target measured (at toy sizes)
    text = (tmp_path / "report.md").read_text()
    assert "| target | measured | met |" in text and "| radar+ (budget 4096) | 1 | 12288 |" in text


def test_the_gpu_check_refuses_unknown_steps_with_the_choices():
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_check.py"), "--cpu", "--steps", "speed"], capture_output=True, text=True)
    assert done.returncode == 2 and "unknown --steps ['speed']; choose from kernels, contract, attention, generate, loop" in done.stderr


def test_a_segment_search_cache_built_from_a_dense_prefill_is_its_own_prefills_cache():
    from e2e_generate import random_model, sparse_cache_from
    from transformers import DynamicCache

    from sparseattn import Quest, RadarPlus, apply
    from sparseattn.hf import cache_kwargs

    model = random_model("tiny", torch.device("cpu"), torch.float32, 512)
    ids = torch.randint(1, model.config.vocab_size, (2, 200), generator=torch.Generator().manual_seed(0))
    dense = DynamicCache(config=model.config)
    with torch.no_grad():
        model(ids[:, :-1], **cache_kwargs(model, dense), use_cache=True)
    for method in (RadarPlus(budget=48), Quest(budget=40)):
        with apply(model, method) as sparse, torch.no_grad():
            own = sparse.new_cache()
            model(ids[:, :-1], **cache_kwargs(model, own), use_cache=True)
            built = sparse_cache_from(model, dense, method)
            for a, b in zip(own.sparse_layers, built.sparse_layers):
                assert a.seen == b.seen and torch.equal(a.state.keys, b.state.keys)
                assert [s.view().shape for s in a.state._summaries] == [s.view().shape for s in b.state._summaries]
                assert all(torch.allclose(x.view(), y.view()) for x, y in zip(a.state._summaries, b.state._summaries))
            out_own = model.generate(ids, **cache_kwargs(model, own), max_new_tokens=6, min_new_tokens=6, do_sample=False)
            out_built = model.generate(ids, **cache_kwargs(model, built), max_new_tokens=6, min_new_tokens=6, do_sample=False)
            assert torch.equal(out_own, out_built)
            assert own.mean_attended() < 199  # sparse steps: the budget was in force


def test_building_from_a_dense_prefill_refuses_a_method_that_learns_from_the_prompts_queries():
    from e2e_generate import random_model, sparse_cache_from

    from sparseattn import H2O

    model = random_model("tiny", torch.device("cpu"), torch.float32, 64)
    with pytest.raises(ValueError, match=r"only a segment search without an always-kept part \(or Dense\)"):
        sparse_cache_from(model, None, H2O(budget=16))


def test_rows_too_large_to_share_a_dense_prefill_prefill_each_method_into_its_own_cache():
    """Issue 48, memory: where the dense prefill's cache and a sparse one do not fit together, each method prefills its
    own cache (no dense copy beside it); its rows attend as the shared prefill's do, and the estimate drops by the dense cache."""
    from e2e_generate import needed_bytes, random_model, run_row

    from sparseattn import Dense, RadarPlus, apply

    model = random_model("tiny", torch.device("cpu"), torch.float32, 512)
    methods = {"radar+": RadarPlus(budget=48), "dense (sparseattn Dense)": Dense()}
    with apply(model, methods["radar+"]):
        shared = run_row(model, methods, 2, 200, 3, 1, torch.device("cpu"))
        own = run_row(model, methods, 2, 200, 3, 1, torch.device("cpu"), own_prefill=True)
    assert [r["prefill"] for r in shared] == ["shared"] * 3 and [r["prefill"] for r in own] == ["own"] * 3
    assert [r["method"] for r in own] == [r["method"] for r in shared]
    assert [r["mean_attended_tokens"] for r in own] == [r["mean_attended_tokens"] for r in shared]
    c = model.config
    kv = 2 * c.num_hidden_layers * c.num_key_value_heads * c.head_dim * 2 * 4 * 1000
    assert needed_bytes(model, 4, 1000, shared=True) - needed_bytes(model, 4, 1000, shared=False) == kv
