"""Rerank's prefilter: groups of segments (a paged cache's pages) scored first, then the segments of the best groups.

Checked against a float64 loop that states the rule: a group's score is ``log n + q . mean`` over its tokens;
the best ``ceil(keep x m / fan)`` groups (per KV group by their log-sum-exp over its query heads) are kept; a
kept group's segments keep their own centroid scores, another group's are ``log c + q . group mean``; the
shortlist is the best ``m`` kept segments, reranked exactly.
"""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from sparseattn import Centroid, PerformerFeatures, Rerank
from sparseattn.methods.radar_plus import RadarPlus
from sparseattn.summaries.base import SegmentKeys

CPU = torch.device("cpu")
F64 = torch.float64


def shortlist_of(rerank, keys, queries, top_k):
    params = rerank.prepare(keys.shape[1], keys.shape[-1], layer_idx=0, device=CPU, dtype=keys.dtype)
    return rerank.score_shortlist(params, rerank.summarize(params, keys), queries, SegmentKeys(keys, 1.0, keys.dtype),
                                  keys.shape[-2], top_k)  # fmt: skip


def prefilter_ref(keys, queries, fan, keep_factor, m, per_group):
    """The rule, one loop per (batch, KV head): ``(scores [B, H, G, S], kept groups per (b, h, row))``."""
    B, H, S, c, D = keys.shape
    G = queries.shape[2]
    means = keys.mean(3)  # [B, H, S, D]
    n_groups = math.ceil(S / fan)
    keep = min(n_groups, max(1, math.ceil(keep_factor * m / fan), math.ceil(m / fan)))
    scores = torch.empty(B, H, G, S, dtype=F64)
    kept_sets = {}
    for b in range(B):
        for h in range(H):
            groups = [list(range(j * fan, min(S, (j + 1) * fan))) for j in range(n_groups)]
            group_mean = [means[b, h, grp].mean(0) for grp in groups]
            group_score = torch.tensor([[math.log(len(grp) * c) + float(queries[b, h, g] @ gm) for grp, gm in zip(groups, group_mean)]
                                        for g in range(G)], dtype=F64)  # fmt: skip
            rows = [torch.logsumexp(group_score, 0)] if per_group else list(group_score)
            for r, row in enumerate(rows):
                best = set(sorted(range(n_groups), key=lambda j: -float(row[j]))[:keep])
                for g in range(G) if per_group else [r]:
                    kept_sets[b, h, g] = best
                    for j, grp in enumerate(groups):
                        for s in grp:
                            mean = means[b, h, s] if j in best else group_mean[j]
                            scores[b, h, g, s] = math.log(c) + float(queries[b, h, g] @ mean)
    return scores, kept_sets


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), fan=st.integers(2, 5), keep=st.floats(1.0, 3.0), top_k=st.integers(1, 4),
       per_group=st.booleans(), S=st.integers(3, 17))  # fmt: skip
def test_the_prefilter_scores_and_shortlists_as_the_rule_says(seed, fan, keep, top_k, per_group, S):
    gen = torch.Generator().manual_seed(seed)
    B, H, G, c, D = 2, 2, 3, 4, 8
    keys = torch.randn(B, H, S, c, D, generator=gen, dtype=F64)
    keys += torch.randn(B, H, S, 1, D, generator=gen, dtype=F64)  # segments that differ in mass
    queries = torch.randn(B, H, G, D, generator=gen, dtype=F64)
    rerank = Rerank(Centroid(), shortlist=2, factor=2.0, per_group=per_group, prefilter=fan, prefilter_keep=keep)
    step = shortlist_of(rerank, keys, queries, top_k)
    m = step.exact.shape[-1]
    assert m == min(max(2, math.ceil(2.0 * top_k)), S)
    want, kept = prefilter_ref(keys, queries, fan, keep, m, per_group)
    torch.testing.assert_close(step.coarse, want, rtol=1e-12, atol=1e-12)
    index = step.index.expand_as(step.exact)
    exact = torch.logsumexp(torch.einsum("bhgd,bhscd->bhgsc", queries, keys), -1)
    torch.testing.assert_close(step.exact, exact.gather(-1, index), rtol=1e-12, atol=1e-12)
    for (b, h, g), groups in kept.items():
        members = {s for s in range(S) if s // fan in groups}
        listed = set(index[b, h, g].tolist())
        if len(members) >= m:  # the shortlist is the best m kept segments by their own centroid scores
            by_score = sorted(members, key=lambda s: -float(torch.logsumexp(want[b, h, :, s], 0) if per_group else want[b, h, g, s]))
            assert listed == set(by_score[:m])


def test_a_dropped_groups_segments_share_its_bound():
    """log-sum-exp over a dropped group's segments is the group scored as one segment, log n + q . mean."""
    gen = torch.Generator().manual_seed(3)
    keys = torch.randn(1, 1, 12, 4, 8, generator=gen, dtype=F64) + 2 * torch.randn(1, 1, 12, 1, 8, generator=gen, dtype=F64)
    queries = torch.randn(1, 1, 2, 8, generator=gen, dtype=F64)
    step = shortlist_of(Rerank(Centroid(), shortlist=2, factor=1.0, per_group=True, prefilter=4, prefilter_keep=1.0), keys, queries, 2)
    kept_groups = {int(s) // 4 for s in step.index.flatten()}
    assert len(kept_groups) == 1  # keep ceil(1 x 2 / 4) = 1 group of 3
    for j in set(range(3)) - kept_groups:
        group = keys[0, 0, 4 * j : 4 * j + 4].reshape(16, 8)
        bound = math.log(16) + queries[0, 0] @ group.mean(0)
        torch.testing.assert_close(torch.logsumexp(step.coarse[0, 0, :, 4 * j : 4 * j + 4], -1), bound)


def test_keeping_every_group_is_the_plain_rerank():
    gen = torch.Generator().manual_seed(5)
    keys = torch.randn(2, 3, 20, 4, 8, generator=gen, dtype=F64)
    queries = torch.randn(2, 3, 3, 8, generator=gen, dtype=F64)
    plain = shortlist_of(Rerank(Centroid(), shortlist=4, per_group=True), keys, queries, 3)
    every = shortlist_of(Rerank(Centroid(), shortlist=4, per_group=True, prefilter=4, prefilter_keep=1024.0), keys, queries, 3)
    assert torch.equal(plain.coarse, every.coarse)
    assert torch.equal(plain.index.sort(-1).values, every.index.sort(-1).values)


def test_a_prefilter_that_keeps_few_groups_changes_the_shortlist():
    """A control: the rule is not a no-op (with one group kept, the shortlist lies in that group)."""
    gen = torch.Generator().manual_seed(7)
    keys = torch.randn(1, 2, 32, 4, 8, generator=gen, dtype=F64) + torch.randn(1, 2, 32, 1, 8, generator=gen, dtype=F64)
    queries = torch.randn(1, 2, 3, 8, generator=gen, dtype=F64)
    plain = shortlist_of(Rerank(Centroid(), shortlist=4, per_group=True), keys, queries, 2)
    few = shortlist_of(Rerank(Centroid(), shortlist=4, per_group=True, prefilter=8, prefilter_keep=1.0), keys, queries, 2)
    assert all(len({int(s) // 8 for s in few.index[0, h, 0]}) == 1 for h in range(2))
    assert not torch.equal(plain.index.sort(-1).values, few.index.sort(-1).values)


def test_bad_prefilter_options_are_refused_naming_them():
    with pytest.raises(ValueError, match="prefilter=4 needs a Centroid"):
        Rerank(PerformerFeatures(16), prefilter=4)
    with pytest.raises(ValueError, match="prefilter_keep"):
        Rerank(Centroid(), prefilter=4, prefilter_keep=0.5)
    with pytest.raises(ValueError, match="prefilter"):
        Rerank(Centroid(), prefilter=-1)
    with pytest.raises(ValueError, match="prefilter_keep=2.0 changes nothing without prefilter"):
        RadarPlus(prefilter_keep=2.0)


def test_the_prefilter_shows_in_repr_only_when_set():
    assert repr(Rerank(Centroid(), 16, 2.0, True)) == "Rerank(coarse=Centroid(), shortlist=16, factor=2.0, per_group=True)"
    assert "prefilter=8, prefilter_keep=4.0" in repr(Rerank(Centroid(), 16, 2.0, True, prefilter=8))
