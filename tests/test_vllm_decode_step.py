"""Which rows of a vLLM step are decode tokens (sparseattn.vllm.backend.decode_step), found once per step.

No vLLM needed: the function reads the metadata's ``query_start_loc``, ``seq_lens`` and ``block_table``.
"""

from types import SimpleNamespace

import torch

from sparseattn.vllm.backend import decode_step


def metadata(query_lengths, seq_lens, blocks=6):
    starts = torch.zeros(len(query_lengths) + 1, dtype=torch.int32)
    starts[1:] = torch.tensor(query_lengths, dtype=torch.int32).cumsum(0)
    table = torch.randint(0, 1000, (len(query_lengths), blocks), dtype=torch.int32)
    return SimpleNamespace(query_start_loc=starts, seq_lens=torch.tensor(seq_lens, dtype=torch.int32), block_table=table)


def test_a_decode_only_step_reads_rows_0_to_b_without_gathering():
    meta = metadata([1, 1, 1], [300, 77, 1000])
    step = decode_step(meta)
    assert step.rows is None and not step.mixed
    assert torch.equal(step.table, meta.block_table) and torch.equal(step.lens, meta.seq_lens)
    assert step.requests.tolist() == [0, 1, 2]


def test_a_mixed_step_names_the_decode_requests_and_their_token_rows():
    meta = metadata([1, 5, 1, 3, 1], [300, 40, 1000, 600, 9])
    step = decode_step(meta)
    assert step.mixed
    assert step.requests.tolist() == [0, 2, 4]
    assert step.rows.tolist() == [0, 6, 10]  # token rows: 1 + 5, then 1 + 5 + 1 + 3
    assert torch.equal(step.table, meta.block_table[[0, 2, 4]])
    assert step.lens.tolist() == [300, 1000, 9]


def test_a_prefill_only_step_has_no_decode_step():
    assert decode_step(metadata([4, 7], [4, 7])) is None


def test_every_layer_of_a_step_shares_one_computation_and_the_next_step_gets_its_own():
    meta = metadata([1, 1], [300, 77])
    first = decode_step(meta)
    assert decode_step(meta) is first  # the other layers of the step
    meta.seq_lens += 1  # vLLM refilling the same object's buffers for the next step
    after = decode_step(meta)
    assert after is not first and after.lens.tolist() == [301, 78]
    other = metadata([1, 1], [301, 78])  # a new object with equal lengths: its own table
    assert torch.equal(decode_step(other).table, other.block_table)
