"""Top-p selection (``TopP``, Twilight's rule) as a part: statements, checked as hypothesis properties.

* The selected set's estimated mass, the sinks' and the tail's included, reaches ``p`` (unless the cap binds:
  then the set is the whole cap).
* It is the smallest such set: it is made of the largest estimates, and without its smallest member it falls
  short of ``p``.
* The cap (the ``k`` segments the budget buys a head) is honoured: a head never attends more than ``budget``.
* With exact scores (``ExactScore``) the step attends exactly the top-p set a float64 greedy computes from the
  keys, and its output is dense attention over what it reports.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import sparseattn as sa
from sparseattn import registry
from sparseattn.allocations import TopP, top_p_mask

PROPERTY = settings(max_examples=200, deadline=None, derandomize=True)


def _draw(seed: int, rows: int, w: int, spread: float):
    g = torch.Generator().manual_seed(seed)
    estimates = torch.randn(rows, w, generator=g, dtype=torch.float64) * spread
    always = torch.randn(rows, generator=g, dtype=torch.float64) * spread
    unlisted = torch.randn(rows, generator=g, dtype=torch.float64) * spread + math.log(w)  # segments beyond the cap
    total = torch.logsumexp(torch.cat([estimates, always[:, None], unlisted[:, None]], dim=-1), dim=-1)
    return estimates, always, total


@PROPERTY
@given(seed=st.integers(0, 2**31 - 1), w=st.integers(1, 40), p=st.floats(0.01, 0.99), spread=st.floats(0.1, 6.0))
def test_the_set_reaches_p_is_the_smallest_such_and_made_of_the_largest_estimates(seed, w, p, spread):
    estimates, always, total = _draw(seed, 7, w, spread)
    keep = top_p_mask(estimates, always, total, p)
    shares = (estimates - total[:, None]).exp()
    base = (always - total).exp()
    reached = base + (shares * keep).sum(-1)
    for row in range(keep.shape[0]):
        taken = keep[row]
        assert bool((reached[row] >= p - 1e-12) | taken.all()), "short of p with the cap not binding"
        if taken.any():
            smallest = shares[row][taken].min()
            assert reached[row] - smallest < p, "not the smallest set: its smallest member was not needed"
            if not taken.all():
                assert estimates[row][taken].min() >= estimates[row][~taken].max(), "not the largest estimates"
        else:
            assert base[row] >= p, "nothing taken although the sinks and tail fall short of p"


def test_the_rule_has_teeth():
    # Shares 0.5, 0.3, 0.1, 0.05, 0.05 of a total of 1 (nothing always attended): p = 0.75 takes the first two.
    estimates = torch.tensor([[0.05, 0.3, 0.05, 0.5, 0.1]], dtype=torch.float64).log()
    keep = top_p_mask(estimates, torch.tensor([-1e9], dtype=torch.float64), torch.zeros(1, dtype=torch.float64), 0.75)
    assert keep.tolist() == [[False, True, False, True, False]]
    # Negative controls: one fewer falls short; the smallest estimates first is another set; counting the
    # always-attended share (0.5 here) takes fewer.
    assert float(estimates[0, 3].exp()) < 0.75
    assert not torch.equal(keep, top_p_mask(-estimates, torch.tensor([-1e9], dtype=torch.float64), torch.zeros(1, dtype=torch.float64), 0.75))
    assert top_p_mask(estimates, torch.tensor([0.5], dtype=torch.float64).log(), torch.zeros(1, dtype=torch.float64), 0.75).sum() == 1


@pytest.mark.parametrize("shared", [False, True])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_exact_scores_attend_exactly_the_greedy_top_p_set_within_the_budget(shared, seed):
    B, H, G, D, t, size, budget, p = 2, 2, 3, 16, 700, 8, 200, 0.8
    method = sa.SegmentSearch(
        sa.ExactScore(), sa.TopK(), sa.FixedSchedule(size), sinks=4, window=8, budget=budget,
        shared_kv_selection=shared, allocation=TopP(p),
    )  # fmt: skip
    torch.manual_seed(seed)
    state = method.new_state(B, H, D)
    keys = torch.randn(B, H, t, D) * torch.linspace(0.5, 3.0, H)[None, :, None, None]  # heads from diffuse to peaked
    state.append(keys, torch.randn(B, H, t, D))
    q = torch.randn(B, H * G, D) * 2
    out, info = state.attend(q)
    lay = info.layout
    k = method.segments_for(lay)
    # float64 greedy from the keys: per selection, segments by exact mass, taken until the share reaches p.
    logits = torch.einsum("bhgd,bhtd->bhgt", q.double().view(B, H, G, D), state.keys.double()) * D**-0.5
    seg = logits[..., lay.sink_end : lay.segment_end].unflatten(-1, (lay.n_segments, size)).logsumexp(-1)  # [B,H,G,S]
    fixed = torch.cat([logits[..., : lay.sink_end], logits[..., lay.tail_start : lay.length]], dim=-1).logsumexp(-1)
    if shared:  # one selection per KV group: the group's summed masses
        seg, fixed = seg.logsumexp(2, keepdim=True), fixed.logsumexp(2, keepdim=True)
    total = torch.logaddexp(seg.logsumexp(-1), fixed)
    chosen = torch.zeros_like(seg, dtype=torch.bool)
    for idx in torch.cartesian_prod(*(torch.arange(n) for n in seg.shape[:3])):
        b, h, g = idx.tolist()
        reached = float((fixed[b, h, g] - total[b, h, g]).exp())
        for s in seg[b, h, g].argsort(descending=True)[:k].tolist():
            if reached >= p:
                break
            chosen[b, h, g, s] = True
            reached += float((seg[b, h, g, s] - total[b, h, g]).exp())
    attended_segments = info.to_mask().view(B, H, G, -1)[..., lay.sink_end : lay.segment_end].unflatten(-1, (lay.n_segments, size)).all(-1)
    assert torch.equal(attended_segments, chosen.expand(B, H, G, -1))
    assert int(info.attended.max()) <= budget
    assert chosen.sum(-1).min() < chosen.sum(-1).max(), "the heads should differ (else the rule is untested)"
    ref = sa.attention_ref(q.view(B, H, G, D), state.keys, state.values, info.to_mask().view(B, H, G, -1)).view(B, H * G, D)
    assert (out.double() - ref).abs().max() < 1e-5


def test_top_p_is_a_split_option_of_radar_plus_and_the_token_oracle():
    spec = registry.parse("radar+:split=topp,p=0.9", budget=512)
    assert spec.method.allocation == TopP(0.9)
    assert registry.parse("oracle-tokens:split=topp", budget=512).method.allocation == TopP(0.95)
    for bad, words in [("radar+:p=0.9", "p shapes the 'topp' split"), ("radar+:split=topp,cap=2", "cap and floor"),
                       ("radar+:split=topp,p=1", "out of range")]:  # fmt: skip
        with pytest.raises(ValueError, match=words):
            registry.parse(bad)
    with pytest.raises(ValueError, match=r"TopP.p must be a number in \(0, 1\)"):
        TopP(0.0)
