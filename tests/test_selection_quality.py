"""The selection-quality parts (issue 7): what each still guarantees, checked against brute force."""

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from sparseattn import CenteredFeatures, Centroid, ExactScore, PerformerFeatures, Rerank, SegmentSearch, TopK
from sparseattn.ops.buffers import Workspace
from sparseattn.summaries.base import SegmentKeys

CPU = torch.device("cpu")
F64 = torch.float64


def exact_log_mass(queries, keys):
    """Brute force: ``logsumexp_j q . k_j`` per segment, ``[B, H, G, D], [B, H, S, c, D] -> [B, H, G, S]``."""
    return torch.logsumexp(torch.einsum("bhgd,bhscd->bhgsc", queries, keys), dim=-1)


def score(summary, keys, queries):
    params = summary.prepare(keys.shape[1], keys.shape[-1], layer_idx=0, device=CPU, dtype=keys.dtype)
    seg = SegmentKeys(keys, 1.0, keys.dtype) if summary.reads_keys else None
    return summary.score(params, summary.summarize(params, keys), queries, seg, keys.shape[-2])


def random_segments(seed: int, spread: float, B=2, H=2, G=3, S=9, c=5, D=8):
    """Keys ``[B, H, S, c, D]`` and queries ``[B, H, G, D]`` in float64, scaled by ``spread``."""
    gen = torch.Generator().manual_seed(seed)
    keys = spread * torch.randn(B, H, S, c, D, generator=gen, dtype=F64)
    return keys, spread * torch.randn(B, H, G, D, generator=gen, dtype=F64)


def shortlist_then_coarse(listed, exact_row, coarse_row, k):
    """The brute-force rerank: ``listed`` segments by exact mass, then the others by coarse score."""
    ranked = listed[exact_row[listed].argsort(descending=True)].tolist()
    rest = [s for s in coarse_row.argsort(descending=True).tolist() if s not in ranked]
    return set((ranked + rest)[:k])


@given(seed=st.integers(0, 2**31 - 1), shortlist=st.integers(0, 9), k=st.integers(1, 4), spread=st.floats(0.1, 3.0))
def test_rerank_selects_the_exact_top_k_among_its_shortlist(seed, shortlist, k, spread):
    keys, queries = random_segments(seed, spread)
    B, H, G, S = *queries.shape[:3], keys.shape[2]
    coarse = Centroid()
    picked = TopK().select(score(Rerank(coarse, shortlist), keys, queries), k, None)
    coarse_scores = score(coarse, keys, queries)
    exact = exact_log_mass(queries, keys)
    m = min(shortlist, S)
    short = coarse_scores.topk(m, dim=-1).indices if m else None
    for idx in torch.cartesian_prod(torch.arange(B), torch.arange(H), torch.arange(G)).tolist():
        b, h, g = idx
        got = set(picked[b, h, g].tolist())
        if m == 0:  # no rerank: the coarse ranking
            want = set(coarse_scores[b, h, g].topk(k).indices.tolist())
        else:
            want = shortlist_then_coarse(short[b, h, g], exact[b, h, g], coarse_scores[b, h, g], k)
        assert got == want


def test_rerank_with_a_full_shortlist_is_exact_search():
    gen = torch.Generator().manual_seed(1)
    keys = torch.randn(1, 2, 12, 4, 8, generator=gen, dtype=F64)
    queries = torch.randn(1, 2, 3, 8, generator=gen, dtype=F64)
    full = TopK().select(score(Rerank(PerformerFeatures(16, feature_dtype=F64), shortlist=12), keys, queries), 3, None)
    exact = TopK().select(score(ExactScore(), keys, queries), 3, None)
    assert torch.equal(full.sort(-1).values, exact.sort(-1).values)


def test_rerank_rescues_what_a_wrong_coarse_ranking_misses():
    # A coarse summary that ranks backwards never finds the top segment; a shortlist as wide as the
    # segment count always does (the control shows the test can fail).
    class Backwards(Centroid):
        def score(self, *args):
            return -super().score(*args)

    gen = torch.Generator().manual_seed(2)
    keys = torch.randn(1, 1, 10, 4, 8, generator=gen, dtype=F64)
    queries = torch.randn(1, 1, 1, 8, generator=gen, dtype=F64)
    top = int(exact_log_mass(queries, keys).argmax())
    assert int(TopK().select(score(Backwards(), keys, queries), 1, None)) != top
    assert int(TopK().select(score(Rerank(Backwards(), shortlist=10), keys, queries), 1, None)) == top


# Unbiasedness of the centred estimator: exp(score) averaged over independent Omega draws equals the
# segment mass. Tolerance: Z standard errors from the per-feature variance of property 5 (App. B)
# applied to the centred keys, as in tests/test_theory.py.
Z = 5.0


def centred_segment_variance(keys, q):
    """Per-feature variance of ``sum_j f_{k_j - mu} f_q`` (times exp(2 q.mu): the centroid factor is exact)."""
    mu = keys.mean(-2, keepdim=True)
    centred = keys - mu
    kq = centred @ q
    shifted = centred + q
    pair = torch.exp(kq.unsqueeze(-1) + kq.unsqueeze(-2)) * torch.expm1(shifted @ shifted.transpose(-1, -2))
    return pair.sum((-1, -2)) * torch.exp(2 * (mu.squeeze(-2) @ q))


@given(seed=st.integers(0, 2**31 - 1), c=st.integers(1, 6), shared=st.floats(0.0, 3.0))
def test_centred_features_stay_unbiased_for_the_segment_mass(seed, c, shared):
    # Keys share a large common component (what centring removes) plus a small spread.
    gen = torch.Generator().manual_seed(seed)
    d, draws, n = 4, 256, 64
    common = torch.randn(d, generator=gen, dtype=F64)
    common = shared * common / common.norm()
    keys = common + 0.25 * torch.randn(1, 1, 2, c, d, generator=gen, dtype=F64)
    q = 0.3 * torch.randn(d, generator=gen, dtype=F64)
    summary = CenteredFeatures(PerformerFeatures(n, seed=seed, feature_dtype=F64))
    omega = summary.prepare(draws, d, layer_idx=0, device=CPU, dtype=F64)  # draws independent heads
    keys_b = keys.expand(1, draws, 2, c, d)
    est = torch.exp(summary.score(omega, summary.summarize(omega, keys_b), q.expand(1, draws, 1, d), None, c))[0, :, 0]
    target = torch.exp(keys[0, 0] @ q).sum(-1)  # [2]
    se = torch.sqrt(centred_segment_variance(keys[0, 0], q) / n / draws)
    assert ((est.mean(0) - target).abs() <= Z * se + 1e-9 * target).all()


def test_centring_shrinks_the_estimators_spread_on_keys_with_a_shared_component():
    gen = torch.Generator().manual_seed(3)
    d, c, draws, n = 8, 16, 200, 64
    common = torch.zeros(d, dtype=F64)
    common[0] = 2.5  # an outlier channel, as real keys have
    keys = common + 0.3 * torch.randn(1, 1, 1, c, d, generator=gen, dtype=F64)
    q = torch.zeros(d, dtype=F64)
    q[0], q[1] = 0.8, 0.5
    truth = float(exact_log_mass(q.view(1, 1, 1, d), keys))

    def log_error_spread(summary):
        omega = summary.prepare(draws, d, layer_idx=0, device=CPU, dtype=F64)
        kb = keys.expand(1, draws, 1, c, d)
        s = summary.score(omega, summary.summarize(omega, kb), q.expand(1, draws, 1, d), None, c)
        return float((s - truth).abs().mean())

    plain = log_error_spread(PerformerFeatures(n, feature_dtype=F64))
    centred = log_error_spread(CenteredFeatures(PerformerFeatures(n, feature_dtype=F64)))
    assert centred < 0.5 * plain


def test_full_budget_segment_search_with_the_new_summaries_is_dense():
    from sparseattn import attention_ref

    for summary in (CenteredFeatures(PerformerFeatures(32)), Rerank(PerformerFeatures(32), 2)):
        state = SegmentSearch(summary, top_k=10**6).new_state(1, 2, 16)
        state.prefill(torch.randn(1, 2, 300, 16), torch.randn(1, 2, 300, 16))
        q = torch.randn(1, 4, 16)
        out, _ = state.attend(q)
        ref = attention_ref(q.view(1, 2, 2, 16), state.keys, state.values).view(1, 4, 16)
        assert torch.allclose(out.double(), ref, atol=1e-5)


@pytest.mark.parametrize("gapped", [False, True])
@pytest.mark.parametrize("use_workspace", [False, True])
@pytest.mark.parametrize("B,H,S,c,D,m", [(1, 2, 7, 5, 16, 3), (2, 3, 12, 1, 8, 12), (2, 1, 4, 9, 32, 1)])
def test_segment_keys_take_matches_indexing_of_a_cache_view(B, H, S, c, D, m, use_workspace, gapped):
    """``take`` (row gathers from the cache's storage) equals plain indexing of the segments, scaled;
    segments that are not one token axis (``gapped``: a token skipped between segments) take the
    indexing path instead of copying every key."""
    sinks, step = 3, c + 1 if gapped else c
    buffer = torch.randn(B, H, sinks + S * step + 11, D)  # a capacity buffer longer than what is sealed
    raw = buffer[:, :, sinks : sinks + S * step].view(B, H, S, step, D)[:, :, :, :c]  # the view a state hands over
    index = torch.stack([torch.randperm(S)[:m] for _ in range(B * H)]).view(B, H, m)
    workspace = Workspace() if use_workspace else None
    keys = SegmentKeys(raw, 0.5, torch.float64, workspace)
    for _ in range(2):  # a second step reuses the workspace buffer
        got = keys.take(index)
        b = torch.arange(B).view(B, 1, 1)
        h = torch.arange(H).view(1, H, 1)
        torch.testing.assert_close(got, raw[b, h, index].double() * 0.5, rtol=0, atol=0)
        index = index.flip(-1)


@given(seed=st.integers(0, 2**31 - 1), shortlist=st.integers(1, 9), k=st.integers(1, 4), spread=st.floats(0.1, 3.0))
def test_rerank_per_group_selects_the_exact_top_k_among_the_groups_shortlist(seed, shortlist, k, spread):
    """One shortlist per KV group (by the group's summed coarse mass); each head the exact top-k of it."""
    keys, queries = random_segments(seed, spread)
    B, H, G, S = *queries.shape[:3], keys.shape[2]
    coarse = Centroid()
    picked = TopK().select(score(Rerank(coarse, shortlist, per_group=True), keys, queries), k, None)
    coarse_scores = score(coarse, keys, queries)
    exact = exact_log_mass(queries, keys)
    short = coarse_scores.logsumexp(2).topk(min(shortlist, S), dim=-1).indices  # [B, H, m]
    for b, h, g in torch.cartesian_prod(torch.arange(B), torch.arange(H), torch.arange(G)).tolist():
        want = shortlist_then_coarse(short[b, h], exact[b, h, g], coarse_scores[b, h, g], k)
        assert set(picked[b, h, g].tolist()) == want


def test_rerank_per_group_with_a_full_shortlist_is_exact_search():
    gen = torch.Generator().manual_seed(3)
    keys = torch.randn(2, 2, 10, 4, 8, generator=gen, dtype=F64)
    queries = torch.randn(2, 2, 4, 8, generator=gen, dtype=F64)
    full = TopK().select(score(Rerank(Centroid(), shortlist=10, per_group=True), keys, queries), 3, None)
    exact = TopK().select(score(ExactScore(), keys, queries), 3, None)
    assert torch.equal(full.sort(-1).values, exact.sort(-1).values)
