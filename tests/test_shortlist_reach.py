"""A rerank's shortlist is sized by the step's reach (the most segments one head may attend), in both engines.

Sized by the uniform ``k`` instead, a head that :class:`PooledMass` gives ``cap x k`` segments attended the whole
``factor x k`` shortlist of its KV group: nothing was left for the exact rerank to correct, and on the default model
that was most of what radar+adaptive lost against the exact pooled oracle (``benchmarks/selection_gap.py``).
"""

import pytest
import torch

from sparseattn import Centroid, PooledMass, Rerank, SegmentSearch, SqrtSchedule, TopK, registry
from sparseattn.allocations import TopP, Uniform
from sparseattn.methods.base import LayerSpec
from sparseattn.refine.tokens import TopTokens
from sparseattn.vllm.paged_kernel import step_plan
from sparseattn.vllm.policy import PagedPolicy


def search(allocation=None, refine=None, factor=2.0) -> SegmentSearch:
    return SegmentSearch(Rerank(Centroid(), 4, factor, per_group=True), TopK(), SqrtSchedule(aspect=4), budget=256, sinks=4,
                         allocation=allocation or Uniform(), refine=refine)  # fmt: skip


@pytest.mark.parametrize(
    ("allocation", "refine", "reach"),
    [(None, None, 10), (PooledMass(cap=2.0), None, 20), (PooledMass(cap=3.0), None, 30), (PooledMass(cap=9.0), None, 40),
     (TopP(), None, 10), (None, TopTokens(factor=2.0), 10)],  # a refine passes its own shortlist
)  # fmt: skip
def test_reach_is_the_select_stages_width(allocation, refine, reach):
    assert search(allocation, refine).reach(10, 40) == reach


@pytest.mark.parametrize("cap", [1.0, 2.0, 4.0])
def test_the_decode_state_shortlists_factor_times_the_reach(cap, monkeypatch):
    method = search(PooledMass(cap=cap))
    asked = []
    original = Rerank.shortlist_size
    monkeypatch.setattr(Rerank, "shortlist_size", lambda self, top_k, n: asked.append((top_k, n)) or original(self, top_k, n))
    state = method.new_state(LayerSpec(batch=1, kv_heads=2, head_dim=8, layer_idx=0))
    gen = torch.Generator().manual_seed(int(10 * cap))
    state.append(torch.randn(1, 2, 2000, 8, generator=gen), torch.randn(1, 2, 2000, 8, generator=gen))
    state.attend(torch.randn(1, 6, 8, generator=gen))
    lay = state.layout
    k = method.segments_for(lay)
    assert k < lay.n_segments and asked
    assert {top_k for top_k, _ in asked} == {method.reach(k, lay.n_segments)}
    assert method.reach(k, lay.n_segments) == min(lay.n_segments, max(k, -(-int(cap * k * 1000) // 1000)))


def test_the_paged_engine_sizes_the_same_shortlist():
    """vLLM's step plan (the C step's shortlist) uses the rule the decode state uses, for the preset's pooled split."""
    policy = PagedPolicy(registry.parse("radar+:split=pooled,aspect=16", 512).method, "radar+")
    m = policy.method
    lengths = torch.tensor([4096, 2000, 8000])
    plan = step_plan(policy, lengths, 32).plan
    assert ((plan[:, 2] > 0) & (plan[:, 2] < plan[:, 1])).all()  # every sequence selects
    for row, length in zip(plan.tolist(), lengths.tolist()):
        _, n, k, short = row
        if 0 < k < n:
            assert short == m.summary.shortlist_size(m.reach(k, n), n)
            assert short >= min(n, 2 * m.reach(k, n)) and m.reach(k, n) == min(n, 2 * k)
