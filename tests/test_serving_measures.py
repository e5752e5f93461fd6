"""The serving benchmark's workload and quality measures (sparseattn.evaluation.serving and the modules beside it), without vLLM."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
from hypothesis import given
from hypothesis import strategies as st

from sparseattn.evaluation import serving, serving_profile, serving_results, serving_workload, vllm_engine


@pytest.fixture(scope="module")
def tokenizer():
    from sparseattn.hf import default_model_unavailable_reason

    reason = default_model_unavailable_reason()
    if reason:
        pytest.skip(reason)
    from transformers import AutoTokenizer

    from sparseattn.hf.models import local_model_dir

    return AutoTokenizer.from_pretrained(str(local_model_dir()))


@pytest.mark.parametrize("batch", [1, 3, 8])
def test_the_workload_is_distinct_prompts_of_exact_length_with_the_files_next_tokens_held(tokenizer, batch):
    from sparseattn.data.sources import load_text
    from sparseattn.evaluation.batches import STDLIB_TEXTS
    from sparseattn.evaluation.ppl import tokenize

    rows = serving_workload.workload(tokenizer, batch, 2000, 16)
    assert [len(r.ids) for r in rows] == [2000] * batch and [len(r.held) for r in rows] == [16] * batch
    assert len({tuple(r.ids[:64]) for r in rows}) == batch  # no shared prefix
    assert len({r.key for r in rows}) == batch
    for row, depth in zip(rows, serving_workload.depths(batch)):
        assert serving_workload.NEEDLE.format(key=row.key).strip() in tokenizer.decode(row.ids)
        assert abs(row.depth - depth) < 10
        # Around the needle the prompt is the file's own tokens, and the held tokens are the file's next ones.
        name, window = row.source.rstrip("]").split("[")
        span = 2000 + 16
        own = tokenize(tokenizer, load_text(name), (int(window) + 1) * span, name=name).tolist()[int(window) * span :]
        at = next(i for i, (a, b) in enumerate(zip(row.ids, own)) if a != b)
        n = next(n for n in range(1, 64) if row.ids[at + n :] == own[at : 2000 - n])  # the needle's tokens
        assert row.ids == own[:at] + row.ids[at : at + n] + own[at : 2000 - n]
        assert row.held == own[2000 - n : 2000 - n + 16]
    assert {r.source.split("[")[0] for r in rows} == set(STDLIB_TEXTS[: min(batch, len(STDLIB_TEXTS))])


def test_the_shared_workload_shares_row_zeros_prompt(tokenizer):
    rows = serving_workload.workload(tokenizer, 3, 512, 4)
    shared = serving_workload.shared_prompts(rows, tokenizer)
    assert all(p[:512] == rows[0].ids for p in shared) and len({tuple(p) for p in shared}) == 3


@given(st.lists(st.integers(0, 3), min_size=1, max_size=12), st.lists(st.integers(0, 3), min_size=1, max_size=12))
def test_the_common_prefix_is_the_longest_equal_start(a, b):
    n = serving_results.common_prefix(a, b)
    assert a[:n] == b[:n] and (n == min(len(a), len(b)) or a[n] != b[n])


def test_the_prefix_share_is_the_mean_over_sequences_of_the_matched_part_of_the_reference():
    assert serving_results.prefix_share([[1, 2, 3, 4], [5, 6, 0, 0]], [[1, 2, 3, 4], [5, 0, 0, 0]]) == pytest.approx((1 + 0.25) / 2)


def _output(tokens, steps):
    """A vLLM completion with ``logprobs=1``: per step {token: (logprob, rank)}."""
    return SimpleNamespace(token_ids=tokens, logprobs=[{t: SimpleNamespace(logprob=lp, rank=r) for t, (lp, r) in s.items()} for s in steps])


def test_forced_ppl_leaves_out_the_token_prefill_predicted_and_top1_compares_decode_steps():
    held = [[7, 8, 9]]
    mine = vllm_engine.Forced.from_outputs([_output([7, 8, 9], [{7: (-5.0, 3), 1: (-0.1, 1)}, {8: (-1.0, 1)}, {9: (-3.0, 2), 4: (-0.5, 1)}])], held)
    assert mine.ppl() == pytest.approx(math.exp((1.0 + 3.0) / 2))
    assert mine.top1 == [[1, 8, 4]]
    ref = vllm_engine.Forced([[0.0, 0.0, 0.0]], [[2, 8, 5]])  # differs at step 0 (not scored) and step 2
    assert mine.top1_agreement(ref) == 0.5


def test_a_forced_request_that_generated_other_tokens_is_an_error():
    with pytest.raises(RuntimeError, match="not its forced"):
        vllm_engine.Forced.from_outputs([_output([7, 2], [{7: (-1.0, 1)}, {2: (-1.0, 1)}])], [[7, 8]])


def test_the_step_byte_model_counts_weights_once_and_keys_and_values_per_attended_token():
    config = SimpleNamespace(hidden_size=576, num_attention_heads=9, num_key_value_heads=3, num_hidden_layers=30,
                             intermediate_size=1536, vocab_size=49152, head_dim=64)  # SmolLM2-135M
    full, sparse = serving_results.step_bytes(config, 8, 8000, 2), serving_results.step_bytes(config, 8, 1000, 2)
    assert full["kv_mb"] == pytest.approx(8 * 8000 * 30 * 3 * 64 * 2 * 2 / 1e6)  # 1.47 GB: the issue's ~1.5 GB
    assert sparse["kv_mb"] == pytest.approx(full["kv_mb"] / 8)
    assert 250 < full["weights_mb"] < 280  # 135M parameters in bfloat16 (the embedding read once, for the logits)
    fp8 = serving_results.step_bytes(config, 8, 8000, 2, kv_bytes=1)  # an fp8 cache: one byte a number, the weights still bf16
    assert fp8["kv_mb"] == pytest.approx(full["kv_mb"] / 2) and fp8["weights_mb"] == full["weights_mb"]


@pytest.mark.parametrize(("args", "option"), [
    ((10, 8, 64, 3, 32), "--context"), ((8000, 0, 64, 3, 32), "--batch"), ((8000, 8, 0, 3, 32), "--steps"),
    ((8000, 8, 64, 0, 32), "--runs"), ((8000, 8, 64, 3, 1), "--held"),
])  # fmt: skip
def test_each_bad_size_names_its_option(args, option):
    assert [o for o, _ in serving.option_problems(*args)] == [option]
    assert serving.option_problems(8000, 8, 64, 3, 32, window=8192) == []
    assert serving.option_problems(8100, 8, 64, 3, 32, window=8192)[0][0] == "--context / --steps"


def test_a_profile_per_step_is_the_long_run_less_the_one_token_run():
    """``--profile`` times the 1-token run and the run of steps + 1 tokens as the measurement does: the decode steps'
    parts are the difference, per step, and 'other' is the step's time the parts do not account for."""
    one = {"steps": 1, "calls": 30, "parts": {"score": {"ns": 1e6, "bytes": 1e6}, "prefill in mixed steps": {"ns": 5e6, "bytes": 0}}}
    many = {"steps": 5, "calls": 150, "parts": {"score": {"ns": 9e6, "bytes": 5e6}, "prefill in mixed steps": {"ns": 5e6, "bytes": 0},
                                                "plan": {"ns": 4e5, "bytes": 0}}}  # fmt: skip
    diff = serving_profile.profile_difference(many, one)
    assert diff["steps"] == 4 and diff["calls"] == 120
    assert diff["parts"]["score"] == {"ns": 8e6, "bytes": 4e6} and diff["parts"]["prefill in mixed steps"]["ns"] == 0
    assert diff["parts"]["plan"]["ns"] == 4e5  # a part the short run lacks counts 0 there
    prof = serving_profile.step_profile(diff, 5.0, steps=4)
    by = {p["part"]: p for p in prof["parts"]}
    assert by["score"]["ms"] == 2.0 and by["score"]["mb"] == 1.0 and by["plan"]["ms"] == 0.1
    assert prof["other_ms"] == pytest.approx(5.0 - 2.0 - 0.1)
    rows = [{"run": "radar+", "profile": prof}, {"run": "stock"}]
    from rich.console import Console

    console = Console(width=200, record=True)
    console.print(serving_profile.profile_table(rows, 12.0))
    text = console.export_text()
    assert "radar+" in text and "2.00 (1 MB, 0.5 GB/s)" in text and "other" in text and "stock" not in text

