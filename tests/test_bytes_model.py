"""benchmarks/bytes.py: the byte model on the methods' real layouts (the numbers docs/performance.md quotes)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from sparseattn import registry

spec = importlib.util.spec_from_file_location("bytes_model", Path(__file__).parents[1] / "benchmarks" / "bytes.py")
bytes_model = importlib.util.module_from_spec(spec)
spec.loader.exec_module(bytes_model)


def test_dense_reads_every_key_and_value():
    b = bytes_model.step_bytes(registry.build("dense"), 4096, heads=3, group=3, head_dim=64, cache_bytes=2)
    assert b["kv"] == 2 * 3 * 4096 * 64 * 2 and b["structure"] == 0


@pytest.mark.parametrize("name", ["radar", "radar-alg1", "radar+", "quest"])
@pytest.mark.parametrize("t", [4096, 16384])
def test_a_budgeted_step_attends_at_most_its_budget_and_reads_its_summaries(name, t):
    method = registry.build(name, budget=1024)
    b = bytes_model.step_bytes(method, t, heads=3, group=3, head_dim=64, cache_bytes=2)
    assert b["attended"] <= 1024 and b["kv"] == 3 * b["attended"] * 2 * 64 * 2
    per_segment, params = bytes_model.summary_bytes_per_segment(method, 64)
    assert b["structure"] >= 3 * b["segments"] * per_segment + 3 * params > 0


def test_radar_as_run_stores_n_features_floats_per_segment():
    # Radar as its authors ran it: 4096 features (2048 antithetic draws) per segment, float32.
    per_segment, params = bytes_model.summary_bytes_per_segment(registry.build("radar"), 64)
    assert 4096 * 4 <= per_segment <= 4096 * 4 + 8 and params == 2048 * 64 * 4  # features (+ one float per segment)
