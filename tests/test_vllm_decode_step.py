"""Which rows of a vLLM step are decode tokens (sparseattn.vllm.step.decode_step), what a sparse engine runs on
each CPU (readable_isa), and how a decode step the paged engine cannot answer is counted (Fallbacks).

No vLLM needed: ``decode_step`` reads the metadata's ``query_start_loc``, ``seq_lens``, ``block_table`` and
vLLM's ``is_prefilling``. The backend module itself (which imports vLLM) is read as source: it keeps no
module-level state. The engine-level checks are in tests/test_vllm_robustness.py.
"""

import ast
import logging
from pathlib import Path

import pytest
import torch

from sparseattn.vllm.step import SUPPORTED_ISAS, Fallbacks, decode_step, readable_isa


def step_of(query_lengths, seq_lens, prefilling=None, blocks=6):
    starts = torch.zeros(len(query_lengths) + 1, dtype=torch.int32)
    starts[1:] = torch.tensor(query_lengths, dtype=torch.int32).cumsum(0)
    table = torch.randint(0, 1000, (len(query_lengths), blocks), dtype=torch.int32)
    flags = None if prefilling is None else torch.tensor(prefilling)
    return decode_step(starts, torch.tensor(seq_lens, dtype=torch.int32), table, flags), table


def test_a_decode_only_step_reads_rows_0_to_b_without_gathering():
    step, table = step_of([1, 1, 1], [300, 77, 1000])
    assert step.rows is None and not step.mixed
    assert torch.equal(step.table, table) and step.lens.tolist() == [300, 77, 1000]
    assert step.requests.tolist() == [0, 1, 2]


def test_a_mixed_step_names_the_decode_requests_and_their_token_rows():
    step, table = step_of([1, 5, 1, 3, 1], [300, 40, 1000, 600, 9])
    assert step.mixed
    assert step.requests.tolist() == [0, 2, 4]
    assert step.rows.tolist() == [0, 6, 10]  # token rows: 1 + 5, then 1 + 5 + 1 + 3
    assert torch.equal(step.table, table[[0, 2, 4]])
    assert step.lens.tolist() == [300, 1000, 9]


def test_a_prefill_only_step_has_no_decode_step():
    assert step_of([4, 7], [4, 7])[0] is None


def test_a_prompts_last_token_computed_alone_is_prefill_not_decode():
    # Request 1 has one query token but is still prefilling (a prefix-cache hit left its prompt's last token,
    # or its chunked prefill's last chunk is one token): vLLM's kernel answers it, not the paged engine.
    step, table = step_of([1, 1, 1], [300, 1025, 9], prefilling=[False, True, False])
    assert step.mixed and step.requests.tolist() == [0, 2] and step.rows.tolist() == [0, 2]
    assert step_of([1], [1025], prefilling=[True])[0] is None
    # vLLM pads is_prefilling to its padded batch: the flags past the requests are ignored.
    step, _ = step_of([1, 1], [30, 40], prefilling=[False, False, True, True])
    assert step.rows is None and step.requests.tolist() == [0, 1]


def test_a_sparse_engine_runs_a_layout_it_reads_or_refuses_naming_the_isa_the_dtype_and_what_to_do():
    for isa in SUPPORTED_ISAS:
        assert readable_isa(isa, "bfloat16", 128) == isa
    assert readable_isa("amx", "bfloat16", 128) == "vec" and readable_isa("amx", "bfloat16", 48) == "vec16"
    with pytest.raises(NotImplementedError, match=r"picks its 'neon' CPU attention kernel on this CPU for bfloat16 .*stock vLLM"):
        readable_isa("neon", "bfloat16", 128)
    with pytest.raises(NotImplementedError, match=r"'vsx' .* for float32 .*--block-size 16"):
        readable_isa("vsx", "float32", 128)


def test_fallbacks_log_each_cause_once_and_count_every_one(caplog):
    logger = logging.getLogger("test.sparseattn.fallbacks")
    counts = Fallbacks(every=3600)
    with caplog.at_level(logging.INFO, logger=logger.name):
        counts.answered(logger)
        counts.failed(RuntimeError("plan does not fit\nmore"), 3, logger)
        counts.failed(RuntimeError("plan does not fit\nmore"), 4, logger)
        counts.failed(ValueError("kernel refused"), 3, logger)
        counts.answered(logger)
        counts.answered(logger)
    text = caplog.text
    assert text.count("fell back to vLLM's dense kernel: RuntimeError: plan does not fit") == 1
    assert text.count("fell back to vLLM's dense kernel: ValueError: kernel refused") == 1
    assert counts.total == 3 and counts.answered_steps == 3
    assert text.count("answered by the paged engine again") == 1  # once per return, not per step
    assert "3 decode layer-steps answered by the paged engine, 3 by vLLM's dense kernel after a failure" in counts.metrics()
    assert "2 x RuntimeError: plan does not fit; 1 x ValueError: kernel refused" in counts.metrics()


def test_the_backend_keeps_no_module_state_and_defines_its_classes_at_module_level():
    """Per-step and per-engine state lives on the builder, the metadata and the impls, never in module globals."""
    tree = ast.parse((Path(__file__).resolve().parents[1] / "sparseattn" / "vllm" / "backend.py").read_text())
    assigned = {target.id for node in tree.body if isinstance(node, (ast.Assign, ast.AnnAssign))
                for target in (node.targets if isinstance(node, ast.Assign) else [node.target])}  # fmt: skip
    assert assigned == {"__all__", "logger"}
    assert not [node for node in ast.walk(tree) if isinstance(node, ast.Global)]
    classes = {node.name for node in tree.body if isinstance(node, ast.ClassDef)}
    assert {"SparseCPUAttentionBackend", "SparseCPUAttentionMetadataBuilder", "SparseCPUAttentionMetadata",
            "SparseCPUAttentionImpl"} <= classes  # fmt: skip
