"""Numerics: log-space features never overflow, whatever the dtype and key norms."""

import math

import pytest
import torch

from parts import SUMMARIES, part_id
from sparseattn import ExactScore, PerformerFeatures, SegmentSearch


def vectors_with_norms(shape, max_norm, gen):
    """Random directions with norms spread uniformly over [0, max_norm]."""
    x = torch.randn(*shape, generator=gen, dtype=torch.float64)
    norms = torch.rand(*shape[:-1], 1, generator=gen, dtype=torch.float64) * max_norm
    return x / x.norm(dim=-1, keepdim=True) * norms


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("max_norm", [1.0, 10.0, 100.0])
@pytest.mark.parametrize("summary", SUMMARIES, ids=part_id)
def test_scores_are_finite_for_any_dtype_and_norms_up_to_100(summary, dtype, max_norm):
    gen = torch.Generator().manual_seed(7)
    B, H, G, D, T = 2, 2, 3, 64, 300
    state = SegmentSearch(summary, top_k=2).new_state(B, H, D, dtype=dtype)
    keys = vectors_with_norms((B, H, T, D), max_norm, gen).to(dtype)
    state.prefill(keys, keys.clone())
    query = vectors_with_norms((B, H * G, D), max_norm, gen).to(dtype)
    scores = state.scores(query.view(B, H, G, D))
    assert torch.isfinite(scores).all()
    out, _ = state.attend(query)
    assert torch.isfinite(out).all()


def performer_against_its_definition(max_norm, G, seed):
    """Performer's fp32 summaries of random keys/queries with norms up to ``max_norm``, and the float64 terms.

    Returns ``(summary, omega, summaries, queries, c, terms)``: ``terms[b, h, g, s, j, i] = log phi_i(q_g)
    + log phi_i(k_sj)``, whose logsumexp over (j, i) is the definition of a segment's score.
    """
    gen = torch.Generator().manual_seed(seed)
    B, H, S, c, D = 1, 2, 6, 5, 32
    keys = vectors_with_norms((B, H, S, c, D), max_norm, gen) * D**-0.25
    queries = vectors_with_norms((B, H, G, D), max_norm, gen) * D**-0.25
    summary = PerformerFeatures(n_features=256)
    omega = summary.prepare(H, D, layer_idx=0, device=torch.device("cpu"), dtype=torch.float32)
    log_k = summary.log_features(omega.double(), keys)  # [B, H, S, c, n]
    log_q = summary.log_features(omega.double(), queries)  # [B, H, G, n]
    terms = log_q[:, :, :, None, None, :] + log_k[:, :, None]
    return summary, omega, summary.summarize(omega, keys.float()), queries.float(), c, terms


def log_domain_tolerance(max_norm, D=32):
    # fp32 rounding of exponents of size ~max_norm^2 / sqrt(D): absolute error in the log domain
    return 1e-5 * max(1.0, max_norm**2 / math.sqrt(D))


@pytest.mark.parametrize("max_norm", [1.0, 30.0, 100.0])
def test_performer_scores_equal_their_float64_definition_even_when_the_fast_product_underflows(max_norm):
    # Definition: log(c * phi(q) . mean_j phi(k_j)) computed directly with float64 logsumexp.
    summary, omega, summaries, queries, c, terms = performer_against_its_definition(max_norm, G=2, seed=3)
    got = summary.score(omega, summaries, queries, None, c)
    want = torch.logsumexp(terms, dim=(-1, -2))
    assert torch.isfinite(got).all()
    assert (got.double() - want).abs().max() <= log_domain_tolerance(max_norm)


@pytest.mark.parametrize("max_norm", [1.0, 30.0, 100.0])
def test_performer_group_scores_equal_their_float64_definition_even_when_the_fast_product_underflows(max_norm):
    # Definition: log sum_g (c * phi(q_g) . mean_j phi(k_j)), the KV group's summed mass, in float64.
    summary, omega, summaries, queries, c, terms = performer_against_its_definition(max_norm, G=4, seed=4)
    got = summary.score_group(omega, summaries, queries, None, c)
    want = torch.logsumexp(terms, dim=(2, -1, -2)).unsqueeze(2)
    assert got.shape == want.shape == (1, 2, 1, 6) and torch.isfinite(got).all()
    assert (got.double() - want).abs().max() <= log_domain_tolerance(max_norm)


def test_exact_score_is_finite_with_huge_logits():
    summary = ExactScore()
    keys = torch.full((1, 1, 2, 3, 4), 300.0)
    queries = torch.full((1, 1, 1, 4), 300.0)
    scores = summary.score(None, (), queries, keys, 3)
    assert torch.isfinite(scores).all()
    assert torch.allclose(scores, torch.full_like(scores, 4 * 300.0**2 + math.log(3)))


@pytest.mark.parametrize("max_norm", [1.0, 30.0, 100.0])
def test_antithetic_scores_equal_their_float64_definition(max_norm):
    # The authors' features: m Gaussian draws used as +-omega, n = 2m features
    # phi_i(x) = exp(+-omega_i . x - ||x||^2 / 2) / sqrt(n). Definition written out here in float64
    # (not through log_positive_features): log(phi(q) . sum_j phi(k_j)) as a logsumexp over (j, i).
    gen = torch.Generator().manual_seed(5)
    B, H, G, S, c, D, n = 1, 2, 3, 6, 5, 32, 256
    keys = vectors_with_norms((B, H, S, c, D), max_norm, gen) * D**-0.25
    queries = vectors_with_norms((B, H, G, D), max_norm, gen) * D**-0.25
    summary = PerformerFeatures(n_features=n, antithetic=True)
    omega = summary.prepare(H, D, layer_idx=0, device=torch.device("cpu"), dtype=torch.float32)
    assert omega.shape == (H, n // 2, D)  # n / 2 draws
    pairs = torch.cat([omega, -omega], dim=1).double()  # [H, n, D]
    log_k = torch.einsum("bhscd,hnd->bhscn", keys, pairs) - 0.5 * (keys * keys).sum(-1, keepdim=True) - 0.5 * math.log(n)
    log_q = torch.einsum("bhgd,hnd->bhgn", queries, pairs) - 0.5 * (queries * queries).sum(-1, keepdim=True) - 0.5 * math.log(n)
    want = torch.logsumexp(log_q[:, :, :, None, None, :] + log_k[:, :, None], dim=(-1, -2))  # [B, H, G, S]
    summaries = summary.summarize(omega, keys.float())
    got = summary.score(omega, summaries, queries.float(), None, c)
    assert torch.isfinite(got).all()
    assert (got.double() - want).abs().max() <= log_domain_tolerance(max_norm)
    group = summary.score_group(omega, summaries, queries.float(), None, c)
    assert (group.double() - torch.logsumexp(want, dim=2, keepdim=True)).abs().max() <= log_domain_tolerance(max_norm)


@pytest.mark.parametrize("feature_dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_antithetic_features_never_overflow_in_half_precision(dtype, feature_dtype):
    # Keys and queries of norm up to 100 in fp16/bf16, summaries stored in fp16/bf16: the exponents
    # are max-shifted in float32 before exp, so nothing overflows (exp(100^2 / 8) would).
    gen = torch.Generator().manual_seed(9)
    B, H, G, D, T = 2, 2, 3, 64, 300
    summary = PerformerFeatures(n_features=128, antithetic=True, feature_dtype=feature_dtype)
    state = SegmentSearch(summary, top_k=2).new_state(B, H, D, dtype=dtype)
    keys = vectors_with_norms((B, H, T, D), 100.0, gen).to(dtype)
    state.prefill(keys, keys.clone())
    query = vectors_with_norms((B, H * G, D), 100.0, gen).to(dtype)
    assert torch.isfinite(state.scores(query.view(B, H, G, D))).all()
    out, _ = state.attend(query)
    assert torch.isfinite(out).all()
