"""Rerank's ``unit``: the shortlist made of whole units of consecutive segments (a paged cache's line of keys).

Checked against a loop that states the rule: units of ``n = unit // c`` segments are ranked by the log-sum-exp of
their segments' ranked scores (per KV group: the group's log-sum-exp over its query heads first); the shortlist
takes every segment of the units in that order until ``m`` are listed, the last unit's best segments first.
Ties go to the earlier unit and segment.
"""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from sparseattn import Centroid, Rerank, registry
from sparseattn.summaries.rerank import unit_order
from sparseattn.vllm.policy import PagedPolicy
from sparseattn.vllm.route import route
from tests.test_rerank_prefilter import shortlist_of

F64 = torch.float64


def unit_rule(row, n, m):
    """The listed segments of one row of ranked scores (a list of floats)."""
    units = [list(range(j, min(len(row), j + n))) for j in range(0, len(row), n)]
    mass = [math.log(sum(math.exp(row[s]) for s in u)) for u in units]
    listed = []
    for j in sorted(range(len(units)), key=lambda j: (-mass[j], j)):
        for s in sorted(units[j], key=lambda s: (-row[s], s)):
            if len(listed) < m:
                listed.append(s)
    return set(listed)


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), c=st.sampled_from([1, 2, 4]), unit=st.sampled_from([4, 8, 16]),
       top_k=st.integers(1, 5), S=st.integers(2, 23))  # fmt: skip
def test_the_shortlist_is_whole_units_ranked_by_their_mass(seed, c, unit, top_k, S):
    gen = torch.Generator().manual_seed(seed)
    keys = torch.randn(2, 2, S, c, 8, generator=gen, dtype=F64)
    queries = torch.randn(2, 2, 3, 8, generator=gen, dtype=F64)
    rerank = Rerank(Centroid(), shortlist=2, factor=1.0, per_group=True, unit=unit)
    step = shortlist_of(rerank, keys, queries, top_k)
    m = step.index.shape[-1]
    assert m == rerank.shortlist_size(top_k, S)
    n = max(1, unit // c)
    group = torch.logsumexp(step.coarse, dim=2)  # [B, H, S]: the KV group's ranked scores
    for b in range(2):
        for h in range(2):
            assert set(step.index[b, h, 0].tolist()) == unit_rule(group[b, h].tolist(), n, m)


def test_units_of_one_segment_are_the_plain_shortlist():
    gen = torch.Generator().manual_seed(1)
    keys = torch.randn(1, 3, 19, 8, 8, generator=gen, dtype=F64)
    queries = torch.randn(1, 3, 3, 8, generator=gen, dtype=F64)
    plain = shortlist_of(Rerank(Centroid(), shortlist=4, per_group=True), keys, queries, 3)
    units = shortlist_of(Rerank(Centroid(), shortlist=4, per_group=True, unit=8), keys, queries, 3)  # 8 tokens: 1 segment
    assert torch.equal(plain.index.sort(-1).values, units.index.sort(-1).values)


def test_a_unit_shortlist_lies_in_few_units():
    """A control: the rule is not a no-op (m = 8 segments in units of 4: two whole units, where the plain list is spread)."""
    gen = torch.Generator().manual_seed(7)
    keys = torch.randn(1, 2, 64, 2, 8, generator=gen, dtype=F64)
    queries = torch.randn(1, 2, 3, 8, generator=gen, dtype=F64)
    plain = shortlist_of(Rerank(Centroid(), shortlist=8, per_group=True), keys, queries, 2)
    units = shortlist_of(Rerank(Centroid(), shortlist=8, per_group=True, unit=8), keys, queries, 2)
    assert all(len({int(s) // 4 for s in units.index[0, h, 0]}) == 2 for h in range(2))
    assert any(len({int(s) // 4 for s in plain.index[0, h, 0]}) > 2 for h in range(2))


def test_unit_order_breaks_ties_to_the_earlier_unit_and_segment():
    assert unit_order(torch.zeros(6), 2).topk(3).indices.tolist() == [0, 1, 2]
    assert unit_order(torch.tensor([0.0, float("nan"), 1.0, 1.0]), 2).topk(2).indices.tolist() == [2, 3]


def test_bad_units_are_refused_and_vllm_runs_them_on_its_generic_path():
    with pytest.raises(ValueError, match="unit"):
        Rerank(Centroid(), unit=-1)
    policy = PagedPolicy(registry.parse("radar+:unit=32", 512).method, "radar+")
    assert "unit=32" in route(policy).refusal
