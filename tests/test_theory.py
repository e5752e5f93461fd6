"""Radar's theory as hypothesis properties (Hao et al., ICLR 2025: Sec. 2.3, App. B and C).

One property per statement, float64 on CPU, checked against the library's own feature code
(:func:`draw_projection`, :func:`log_positive_features`, :class:`PerformerFeatures`). Every tolerance
is derived from the variance or bound the statement itself gives, at a named z (or binomial level)
whose false-alarm probability is stated. Each property has a negative control: the same check,
applied to a plausible bug, must reject it, so no property passes vacuously.

Notation follows App. B: ``f_u(w) = exp(w.u - |u|^2/2)`` with ``w ~ N(0, I)``; ``u, v, z`` are
pre-scaled vectors (the paper's ``k' = k / d^(1/4)``), so logits are plain dot products. The plain
word "raw" marks unscaled vectors, whose logits are ``k.q / sqrt(d)``.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from sparseattn.ops.features import draw_projection, log_positive_features
from sparseattn.summaries import Centroid, ExactScore, MinMaxBound, PerformerFeatures

# 200 examples per property (derandomised, so a failure reproduces) unless a profile asks for more.
THEORY = settings(max_examples=max(200, settings.default.max_examples), deadline=None)

# Monte Carlo checks are z-tests. Two-sided false alarm per check: erfc(Z / sqrt 2) = 5.7e-7 under the
# normal approximation (one-sided: half that). The file makes about 2e3 such checks on CI (200 examples,
# about 10 checks each), so the chance that a correct property fails by bad luck is about 1e-3; with
# derandomize=True it is also the same draw every run.
Z = 5.0
# Theorem 1 counts mistakes among M draws; we reject "P(mistake) <= delta" when the exact binomial
# tail of the observed count is below this level (the false alarm of that check).
BINOMIAL_LEVEL = 1e-6
# Float64 allowance, relative to the size of the quantity tested: each sample is an exp of a rounded
# dot product (relative error <= (d + 2) u with d <= 9), reduced by pairwise summation (log2 N u more),
# and the closed-form central moments cancel terms of that size; 64 u = 32 eps covers all of it here.
ROUNDING = 32 * torch.finfo(torch.float64).eps

N_OMEGA = 2**14  # draws of w for one-feature moments
N_OMEGA_MOMENTS = 2**16  # more for second moments: their own standard error needs the 4th moment
F64 = torch.float64
CPU = torch.device("cpu")

seeds = st.integers(min_value=0, max_value=2**31 - 1)
dims = st.sampled_from([2, 3, 4, 7, 8])
cosines = st.floats(min_value=-1.0, max_value=1.0)
# |u|, |v| <= 1/2 keeps |u + v|^2 <= 1: a lognormal with log-variance <= 1 has skewness <= 6.2, so
# a mean of 2^14 draws has skewness <= 0.05 and the normal tail at Z is a fair approximation.
half_norms = st.floats(min_value=0.0, max_value=0.5)
# Second moments need lighter tails still: |u + v|^2 <= 0.49 keeps the excess kurtosis of f_u f_v below 18.
third_norms = st.floats(min_value=0.0, max_value=0.35)
# Property 5's closed-form E[(X-EX)^2 (Y-EY)^2] sums terms of order 1 that cancel down to Var X Var Y;
# a norm of 1e-10 leaves ~1e-20 of signal under ~1e-16 of rounding and the tolerance collapses. A floor
# of 0.05 keeps that product above 1e-6, ten orders of magnitude clear of float64 rounding.
floored_third_norms = st.floats(min_value=0.05, max_value=0.35)


def _log_moment(*terms: tuple[torch.Tensor, int]) -> float:
    """``log E[prod_k f_{x_k}(w)^{m_k}] = |sum_k m_k x_k|^2 / 2 - sum_k m_k |x_k|^2 / 2``.

    The Gaussian moment generating function ``E[exp(w.s)] = exp(|s|^2 / 2)``, from which every
    property of the lemma follows (property 2: one term, m = 1).
    """
    s = sum(m * x for x, m in terms)
    return 0.5 * float(s @ s) - 0.5 * sum(m * float(x @ x) for x, m in terms)


def _product_variance(u: torch.Tensor, v: torch.Tensor) -> float:
    """Property 4: ``Var[f_u f_v] = exp(2 u.v) (exp(|u + v|^2) - 1)``."""
    w = u + v
    return math.exp(2.0 * float(u @ v)) * math.expm1(float(w @ w))


def _product_covariance(u: torch.Tensor, v: torch.Tensor, z: torch.Tensor) -> float:
    """Property 5: ``Cov[f_u f_z, f_v f_z] = exp((u + v).z) (exp((u + z).(v + z)) - 1)``."""
    return math.exp(float((u + v) @ z)) * math.expm1(float((u + z) @ (v + z)))


def _segment_variance(keys: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """Variance of one feature's segment term ``sum_j f_{k_j}(w) f_q(w)``: ``[..., c, D], [D] -> [...]``.

    Sum of property 5 over pairs of keys (property 4 on the diagonal): this is the per-feature
    variance behind ``phi(q) . sum_j phi(k_j)`` (Radar Eq. 5) and behind Lemma "conf".
    """
    kq = keys @ q  # [..., c]
    kq_sum = kq.unsqueeze(-1) + kq.unsqueeze(-2)
    shifted = keys + q
    return (torch.exp(kq_sum) * torch.expm1(shifted @ shifted.transpose(-1, -2))).sum((-1, -2))


def _central_moment_4(u: torch.Tensor, v: torch.Tensor) -> float:
    """``E[(X - E X)^4]`` for ``X = f_u f_v``, from the raw moments ``E[X^m] = mu^m exp(m (m-1) |u+v|^2 / 2)``.

    The binomial coefficients sum to zero, so each ``exp`` is taken as ``expm1``: no cancellation
    when the variance is tiny.
    """
    log_mu = _log_moment((u, 1), (v, 1))
    return math.exp(4 * log_mu) * sum(
        math.comb(4, m) * (-1) ** (4 - m) * math.expm1(_log_moment((u, m), (v, m)) - m * log_mu) for m in range(5)
    )


def _mixed_central_moment_22(u: torch.Tensor, v: torch.Tensor, z: torch.Tensor) -> float:
    """``E[(X - E X)^2 (Y - E Y)^2]`` for ``X = f_u f_z``, ``Y = f_v f_z`` (``expm1`` as above)."""
    log_mx, log_my = _log_moment((u, 1), (z, 1)), _log_moment((v, 1), (z, 1))
    return math.exp(2 * log_mx + 2 * log_my) * sum(
        math.comb(2, a) * math.comb(2, b) * (-1) ** (a + b)
        * math.expm1(_log_moment((u, a), (v, b), (z, a + b)) - a * log_mx - b * log_my)
        for a in range(3)
        for b in range(3)
    )


def _mean_agrees(samples: torch.Tensor, mean: torch.Tensor | float, variance: torch.Tensor | float) -> bool:
    """z-test of ``E[X] = mean`` from i.i.d. ``samples: [..., N]`` of known per-sample ``variance``.

    Tolerance ``Z * sqrt(variance / N)``; ``mean`` and ``variance`` broadcast against ``[...]``.
    """
    n = samples.shape[-1]
    mean = torch.as_tensor(mean, dtype=F64)
    variance = torch.as_tensor(variance, dtype=F64)
    tolerance = Z * torch.sqrt(variance.clamp(min=0) / n) + ROUNDING * mean.abs()
    return bool(((samples.mean(-1) - mean).abs() <= tolerance).all())


def _variance_agrees(samples: torch.Tensor, variance: float, fourth_central: float) -> bool:
    """z-test of ``Var[X] = variance`` by the unbiased sample variance of ``samples: [N]``.

    Exact for i.i.d. samples: ``Var[s^2] = mu_4 / N - sigma^4 (N - 3) / (N (N - 1))``.
    """
    n = samples.shape[-1]
    se = math.sqrt(max(0.0, fourth_central / n - variance**2 * (n - 3) / (n * (n - 1))))
    return abs(float(samples.var()) - variance) <= Z * se + ROUNDING * float(samples.pow(2).mean())


def _covariance_agrees(x: torch.Tensor, y: torch.Tensor, covariance: float, mixed_22: float) -> bool:
    """z-test of ``Cov[X, Y] = covariance`` from paired samples; SE from ``E[(X-EX)^2 (Y-EY)^2]``."""
    n = x.shape[-1]
    sample = float(((x - x.mean()) * (y - y.mean())).sum()) / (n - 1)
    scale = math.sqrt(float(x.pow(2).mean()) * float(y.pow(2).mean()))
    return abs(sample - covariance) <= Z * math.sqrt(max(0.0, mixed_22 - covariance**2) / n) + ROUNDING * scale


def _variance_not_larger(a: torch.Tensor, b: torch.Tensor) -> bool:
    """One-sided z-test of ``Var[a] <= Var[b]`` (false alarm Phi(-Z) = 2.9e-7) from ``[R]`` samples each.

    Plug-in standard errors ``sqrt((m4 - s^4) / R)`` of the two sample variances (independent draws).
    """

    def var_and_se2(x: torch.Tensor) -> tuple[float, float]:
        centred = x - x.mean()
        s2 = float(centred.pow(2).mean())
        return s2, (float(centred.pow(4).mean()) - s2**2) / x.shape[-1]

    va, sea = var_and_se2(a)
    vb, seb = var_and_se2(b)
    return va - vb <= Z * math.sqrt(sea + seb)


def _binomial_consistent(mistakes: int, trials: int, delta: float) -> bool:
    """Is ``mistakes`` out of ``trials`` consistent with ``P(mistake) <= delta``?

    Exact binomial upper tail ``P(Bin(trials, delta) >= mistakes)`` against :data:`BINOMIAL_LEVEL`.
    """
    tail = sum(math.comb(trials, j) * delta**j * (1.0 - delta) ** (trials - j) for j in range(mistakes, trials + 1))
    return tail >= BINOMIAL_LEVEL


def _directions(gen: torch.Generator, d: int, k: int) -> torch.Tensor:
    """``[k, d]`` orthonormal random directions (k <= d)."""
    q, _ = torch.linalg.qr(torch.randn(d, k, generator=gen, dtype=F64))
    return q.T.contiguous()


def _pair(seed: int, d: int, norm_u: float, norm_v: float, cos: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Two vectors of the given norms at the given cosine, in a random orientation."""
    e = _directions(torch.Generator().manual_seed(seed), d, 2)
    return norm_u * e[0], norm_v * (cos * e[0] + math.sqrt(max(0.0, 1.0 - cos * cos)) * e[1])


def _random_vectors(gen: torch.Generator, shape: tuple[int, ...], d: int, max_norm: float) -> torch.Tensor:
    """``[*shape, d]`` uniformly random directions with norms uniform in ``[max_norm / 5, max_norm]``.

    The floor keeps every estimator's variance well above float64 rounding.
    """
    x = torch.randn(*shape, d, generator=gen, dtype=F64)
    norms = max_norm * (0.2 + 0.8 * torch.rand(*shape, 1, generator=gen, dtype=F64))
    return x / x.norm(dim=-1, keepdim=True) * norms


def _log_f(x: torch.Tensor, omega: torch.Tensor) -> torch.Tensor:
    """``log f_x(w_i)`` from the library: ``x: [D]``, ``omega: [1, N, D]`` -> ``[N]``."""
    return log_positive_features(x.view(1, 1, -1), omega)[0, 0]


def _without_half_norm(x: torch.Tensor, omega: torch.Tensor) -> torch.Tensor:
    """Bug: ``exp(w.x)``, the features with the ``-|x|^2 / 2`` term forgotten."""
    return _log_f(x, omega) + 0.5 * float(x @ x)


class _NoHalfNorm(PerformerFeatures):
    """Bug: Performer features without the ``-|x|^2 / 2`` term (the library's scoring otherwise)."""

    def log_features(self, omega: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return super().log_features(omega, x) + 0.5 * (x * x).sum(-1, keepdim=True)


class _NegatedAfterShift(PerformerFeatures):
    """Bug: antithetic features as ``-(w.x - |x|^2/2)``, negating after the shift instead of before."""

    def log_features(self, omega: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        shifted = log_positive_features(x, omega)
        return torch.cat([shifted, -shifted], dim=-1) - 0.5 * math.log(self.n_features)


def _segment_estimates(
    features: PerformerFeatures, keys: torch.Tensor, q: torch.Tensor, draws: int, *, omega: torch.Tensor | None = None
) -> torch.Tensor:
    """``exp`` of the library's segment score under ``draws`` independent Omega: ``[S, c, D], [D] -> [S, draws]``.

    Each Omega is one KV head of ``prepare`` (heads draw independent matrices), so one call is a
    batched Monte Carlo; ``omega`` overrides the draw (for controls).
    """
    s, c, d = keys.shape
    if omega is None:
        omega = features.prepare(draws, d, layer_idx=0, device=CPU, dtype=F64)
    keys_b = keys.expand(1, draws, s, c, d)
    q_b = q.expand(1, draws, 1, d)
    scores = features.score(omega, features.summarize(omega, keys_b), q_b, None, c)  # [1, draws, 1, S]
    return torch.exp(scores[0, :, 0, :]).T


def _performer(n: int, seed: int, **kw) -> PerformerFeatures:
    return PerformerFeatures(n_features=n, seed=seed, feature_dtype=F64, **kw)


def _lemma1_terms(u: torch.Tensor, v: torch.Tensor, seed: int, *, query_layer: int = 0) -> torch.Tensor:
    """``f_u(w_i) f_v(w_i)`` for ``N_OMEGA`` draws; ``query_layer != 0`` draws v's Omega elsewhere (a bug)."""
    d = u.shape[-1]
    omega = draw_projection(1, N_OMEGA, d, seed=seed)
    omega_v = omega if query_layer == 0 else draw_projection(1, N_OMEGA, d, seed=seed, layer_idx=query_layer)
    return torch.exp(_log_f(u, omega) + _log_f(v, omega_v))


@THEORY
@given(seed=seeds, d=dims, norm_u=half_norms, norm_v=half_norms, cos=cosines)
def test_lemma1_random_features_are_unbiased_for_the_softmax_kernel(seed, d, norm_u, norm_v, cos):
    """Lemma 1: ``E[f_u(w) f_v(w)] = exp(u.v)``, tolerance from property 4's variance."""
    u, v = _pair(seed, d, norm_u, norm_v, cos)
    assert _mean_agrees(_lemma1_terms(u, v, seed), math.exp(float(u @ v)), _product_variance(u, v))


def test_lemma1_check_rejects_query_features_from_another_omega():
    # Keys and queries must share Omega; a mismatched one (e.g. the wrong layer index) averages to 1.
    u, v = _pair(3, 4, 0.5, 0.5, 1.0)
    assert _mean_agrees(_lemma1_terms(u, v, 3), math.exp(float(u @ v)), _product_variance(u, v))
    assert not _mean_agrees(_lemma1_terms(u, v, 3, query_layer=1), math.exp(float(u @ v)), _product_variance(u, v))


def _raw_segments(seed: int, d: int, segments: int, c: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Raw keys ``[S, c, d]`` and query ``[d]`` with norms <= d^(1/4)/2, so every |k' + q'|^2 <= 1."""
    gen = torch.Generator().manual_seed(seed)
    return _random_vectors(gen, (segments, c), d, 0.5 * d**0.25), _random_vectors(gen, (), d, 0.5 * d**0.25)


def _raw_kernel_check(features: PerformerFeatures, keys: torch.Tensor, q: torch.Tensor, scale: float) -> bool:
    """Does ``exp(score)`` of the raw inputs times ``sqrt(scale)`` average to ``sum_j exp(k_j.q / sqrt d)``?"""
    d = q.shape[-1]
    draws = 64
    estimates = _segment_estimates(features, keys * math.sqrt(scale), q * math.sqrt(scale), draws)
    target = torch.exp(keys @ q / math.sqrt(d)).sum(-1)  # [S]
    # The target's variance is that of the correctly scaled inputs; one estimate averages n features.
    variance = _segment_variance(keys / d**0.25, q / d**0.25) / features.n_features
    return _mean_agrees(estimates, target, variance)


@THEORY
@given(seed=seeds, d=dims, segments=st.integers(1, 3), c=st.integers(1, 5))
def test_lemma1_performer_score_is_unbiased_for_raw_keys_scaled_by_inverse_sqrt_d(seed, d, segments, c):
    """Lemma 1 in the paper's raw form: ``E[phi(q) . sum_j phi(k_j)] = sum_j exp(k_j.q / sqrt d)``.

    ``PerformerFeatures`` receives ``k sqrt(1/sqrt d) = k / d^(1/4)`` (the Summary contract); the
    per-feature variance is property 5 summed over the segment's key pairs.
    """
    keys, q = _raw_segments(seed, d, segments, c)
    assert _raw_kernel_check(_performer(256, seed), keys, q, scale=1.0 / math.sqrt(d))


def test_lemma1_check_rejects_features_without_the_fourth_root_scaling():
    keys = torch.zeros(1, 1, 4, dtype=F64)
    keys[..., 0] = 0.8
    q = keys[0, 0].clone()
    assert _raw_kernel_check(_performer(256, 5), keys, q, scale=1.0 / math.sqrt(4))
    assert not _raw_kernel_check(_performer(256, 5), keys, q, scale=1.0)  # estimates exp(k.q), not exp(k.q / 2)


def _unit_mean_check(u: torch.Tensor, seed: int, log_f=_log_f) -> bool:
    omega = draw_projection(1, N_OMEGA, u.shape[-1], seed=seed)
    # Var[f_u] is property 4 with v = 0: exp(|u|^2) - 1.
    return _mean_agrees(torch.exp(log_f(u, omega)), 1.0, _product_variance(u, torch.zeros_like(u)))


@THEORY
@given(seed=seeds, d=dims, norm=st.floats(0.0, 1.0))
def test_lemma_properties_2_each_feature_has_mean_one(seed, d, norm):
    """Property 2: ``E[f_u(w)] = 1`` (and property 1, ``f_u >= 0``)."""
    u, _ = _pair(seed, d, norm, 0.0, 0.0)
    omega = draw_projection(1, 64, d, seed=seed)
    assert bool((torch.exp(_log_f(u, omega)) >= 0).all())
    assert _unit_mean_check(u, seed)


def test_lemma_properties_2_check_rejects_features_without_the_half_norm():
    u, _ = _pair(7, 4, 1.0, 0.0, 0.0)
    assert _unit_mean_check(u, 7)
    assert not _unit_mean_check(u, 7, log_f=_without_half_norm)  # mean exp(|u|^2 / 2)


def _product_variance_check(u: torch.Tensor, v: torch.Tensor, seed: int, log_f=_log_f) -> bool:
    omega = draw_projection(1, N_OMEGA_MOMENTS, u.shape[-1], seed=seed)
    terms = torch.exp(log_f(u, omega) + log_f(v, omega))
    return _variance_agrees(terms, _product_variance(u, v), _central_moment_4(u, v))


@THEORY
@given(seed=seeds, d=dims, norm_u=third_norms, norm_v=third_norms, cos=cosines)
def test_lemma_properties_4_feature_product_variance_is_exp_2uv_times_exp_norm_u_plus_v_squared_minus_one(
    seed, d, norm_u, norm_v, cos
):
    """Property 4: ``Var[f_u f_v] = exp(2 u.v) (exp(|u + v|^2) - 1)``.

    The standard error of the sample variance comes from the closed-form 4th moment
    ``E[(f_u f_v)^m] = exp(m u.v) exp(m (m - 1) |u + v|^2 / 2)``.
    """
    u, v = _pair(seed, d, norm_u, norm_v, cos)
    assert _product_variance_check(u, v, seed)


def test_lemma_properties_4_check_rejects_features_without_the_half_norm():
    u, v = _pair(11, 4, 0.35, 0.35, 0.0)
    assert _product_variance_check(u, v, 11)
    assert not _product_variance_check(u, v, 11, log_f=_without_half_norm)  # exp(|u|^2 + |v|^2) times larger


def _covariance_check(u: torch.Tensor, v: torch.Tensor, z: torch.Tensor, seed: int, *, z_layer: int = 0) -> bool:
    d = u.shape[-1]
    omega = draw_projection(1, N_OMEGA_MOMENTS, d, seed=seed)
    omega_z = omega if z_layer == 0 else draw_projection(1, N_OMEGA_MOMENTS, d, seed=seed, layer_idx=z_layer)
    log_z = _log_f(z, omega_z)
    x, y = torch.exp(_log_f(u, omega) + log_z), torch.exp(_log_f(v, omega) + log_z)
    return _covariance_agrees(x, y, _product_covariance(u, v, z), _mixed_central_moment_22(u, v, z))


@THEORY
@given(seed=seeds, d=st.sampled_from([3, 4, 7, 8]), norms=st.tuples(floored_third_norms, floored_third_norms, floored_third_norms))
def test_lemma_properties_5_two_keys_scored_by_one_query_covary_as_stated(seed, d, norms):
    """Property 5: ``Cov[f_u f_z, f_v f_z] = exp((u + v).z) (exp((u + z).(v + z)) - 1)``."""
    gen = torch.Generator().manual_seed(seed)
    directions = torch.nn.functional.normalize(torch.randn(3, d, generator=gen, dtype=F64), dim=-1)
    u, v, z = (r * x for r, x in zip(norms, directions))
    assert _covariance_check(u, v, z, seed)


def test_lemma_properties_5_check_rejects_a_query_omega_different_from_the_keys():
    u, v = _pair(13, 4, 0.35, 0.35, 1.0)
    z = u.clone()
    assert _covariance_check(u, v, z, 13)
    assert not _covariance_check(u, v, z, 13, z_layer=1)


def _single_pair_estimates(
    features: PerformerFeatures, u: torch.Tensor, v: torch.Tensor, draws: int, **kw
) -> torch.Tensor:
    """``[draws]`` estimates ``phi(v) . phi(u)`` of ``exp(u.v)`` (one segment holding the single key u)."""
    return _segment_estimates(features, u.view(1, 1, -1), v, draws, **kw)[0]


def _orthogonal_mean_check(
    u: torch.Tensor, v: torch.Tensor, features: PerformerFeatures, omega: torch.Tensor | None = None
) -> bool:
    draws = N_OMEGA // features.n_features if omega is None else omega.shape[0]
    estimates = _single_pair_estimates(features, u, v, draws, omega=omega)
    # The i.i.d. variance bounds the orthogonal one (Choromanski et al. 2021), so this tolerance is conservative.
    return _mean_agrees(estimates, math.exp(float(u @ v)), _product_variance(u, v) / features.n_features)


@THEORY
@given(seed=seeds, d=dims, norm_u=half_norms, norm_v=half_norms, cos=cosines, blocks=st.integers(1, 3))
def test_orthogonal_random_features_are_unbiased_for_the_softmax_kernel(seed, d, norm_u, norm_v, cos, blocks):
    """Orthogonal rows, each rescaled to a chi-distributed norm, are marginally N(0, I): still unbiased."""
    u, v = _pair(seed, d, norm_u, norm_v, cos)
    assert _orthogonal_mean_check(u, v, _performer(blocks * d, seed, orthogonal=True))


def test_orthogonal_check_rejects_unit_norm_rows():
    # Orthogonal rows left at unit norm (the chi rescaling forgotten) are not N(0, I): biased.
    u, v = _pair(17, 4, 0.5, 0.5, 1.0)
    features = _performer(4, 17, orthogonal=True)
    omega = features.prepare(N_OMEGA // 4, 4, layer_idx=0, device=CPU, dtype=F64)
    assert _orthogonal_mean_check(u, v, features, omega)
    assert not _orthogonal_mean_check(u, v, features, omega / omega.norm(dim=-1, keepdim=True))


def _orthogonal_variance_check(u: torch.Tensor, v: torch.Tensor, seed: int, *, duplicate_rows: bool = False) -> bool:
    d, draws = u.shape[-1], 4096
    orthogonal = _performer(d, seed, orthogonal=True)  # n = d: exactly one orthogonal block
    iid = _performer(d, seed)
    omega = orthogonal.prepare(draws, d, layer_idx=0, device=CPU, dtype=F64)
    if duplicate_rows:
        omega = omega[:, :1].expand(draws, d, d)
    # A different layer index, so the i.i.d. draws are independent of the orthogonal ones.
    omega_iid = iid.prepare(draws, d, layer_idx=1, device=CPU, dtype=F64)
    return _variance_not_larger(
        _single_pair_estimates(orthogonal, u, v, draws, omega=omega),
        _single_pair_estimates(iid, u, v, draws, omega=omega_iid),
    )


@THEORY
@given(seed=seeds, d=dims, norm_u=third_norms, norm_v=third_norms, cos=cosines)
def test_orthogonal_random_features_have_variance_no_larger_than_iid(seed, d, norm_u, norm_v, cos):
    """ORF (one block, n = d) estimates ``exp(u.v)`` with variance <= the i.i.d. estimator's."""
    u, v = _pair(seed, d, norm_u, norm_v, cos)
    assert _orthogonal_variance_check(u, v, seed)


def test_orthogonal_variance_check_rejects_one_row_repeated():
    # Perfectly correlated rows (one draw broadcast over the block) have n times the i.i.d. variance.
    u, v = _pair(19, 4, 0.35, 0.35, 1.0)
    assert _orthogonal_variance_check(u, v, 19)
    assert not _orthogonal_variance_check(u, v, 19, duplicate_rows=True)


def _antithetic_check(u: torch.Tensor, v: torch.Tensor, features: PerformerFeatures) -> bool:
    draws = N_OMEGA // features.n_features  # N_OMEGA features in all, as for Lemma 1
    estimates = _single_pair_estimates(features, u, v, draws)
    # Pair (w, -w): f_w(w) f_w(-w) = exp(-|w|^2) exactly, so the pair mean of f_u f_v has variance
    # exp(2u.v) (cosh |u + v|^2 - 1); an estimate averages n/2 independent pairs.
    w = u + v
    pair_variance = math.exp(2.0 * float(u @ v)) * (math.cosh(float(w @ w)) - 1.0)
    return _mean_agrees(estimates, math.exp(float(u @ v)), pair_variance / (features.n_features // 2))


@THEORY
@given(seed=seeds, d=dims, norm_u=half_norms, norm_v=half_norms, cos=cosines, pairs=st.integers(1, 40))
def test_antithetic_random_features_are_unbiased_for_the_softmax_kernel(seed, d, norm_u, norm_v, cos, pairs):
    """Features ``exp(+-w.x - |x|^2/2)``: -w is N(0, I) too, so the mean is unchanged (Lemma 1)."""
    u, v = _pair(seed, d, norm_u, norm_v, cos)
    assert _antithetic_check(u, v, _performer(2 * pairs, seed, antithetic=True))


def test_antithetic_check_rejects_negating_after_the_half_norm_shift():
    u, v = _pair(23, 4, 0.5, 0.5, 1.0)
    assert _antithetic_check(u, v, _performer(32, 23, antithetic=True))
    assert not _antithetic_check(u, v, _NegatedAfterShift(n_features=32, seed=23, antithetic=True, feature_dtype=F64))


def _theorem1_required_gap(c: int, zeta: float, d: int, delta: float, n: int) -> float:
    """Theorem 1's gap: ``(1/c) exp(zeta^2 / sqrt d) sqrt(8 log(2 (c - 1) / delta) / n)``."""
    return math.exp(zeta**2 / math.sqrt(d)) * math.sqrt(8.0 * math.log(2.0 * (c - 1) / delta) / n) / c


def _segment_masses(keys: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """Normalised segment attention ``a_l = beta_l / sum_m beta_m`` of raw ``keys: [S, c, d]``."""
    beta = torch.exp(keys @ q / math.sqrt(q.shape[-1])).sum(-1)
    return beta / beta.sum()


def _gap(keys: torch.Tensor, q: torch.Tensor) -> float:
    a = _segment_masses(keys, q)
    return float(a[0] - a[1:].max())


def _keys_at_cosines(gen: torch.Generator, q_hat: torch.Tensor, cos: torch.Tensor, zeta: float) -> torch.Tensor:
    """Raw keys of norm ``zeta`` at the given cosines to ``q_hat`` (random orthogonal parts)."""
    side = torch.randn(*cos.shape, q_hat.shape[-1], generator=gen, dtype=F64)
    side = torch.nn.functional.normalize(side - (side @ q_hat).unsqueeze(-1) * q_hat, dim=-1)
    return zeta * (cos.unsqueeze(-1) * q_hat + torch.sqrt(1.0 - cos * cos).unsqueeze(-1) * side)


def _theorem1_segments(seed: int, d: int, c: int, zeta: float, runner_up: float) -> tuple[torch.Tensor, torch.Tensor]:
    """c segments of c raw keys and a raw query, all of norm ``zeta``; segment 0 is the true top.

    Segment 0's keys lie within cosine [0.95, 1] of q, segment 1's at cosine ``runner_up``, the rest
    below it: the top segment is unique by construction and the gap is set by ``runner_up``.
    """
    gen = torch.Generator().manual_seed(seed)
    q_hat = torch.nn.functional.normalize(torch.randn(d, generator=gen, dtype=F64), dim=-1)
    cos = torch.empty(c, c, dtype=F64)
    cos[0] = 0.95 + 0.05 * torch.rand(c, generator=gen, dtype=F64)
    cos[1] = runner_up
    cos[2:] = -1.0 + (runner_up + 1.0) * torch.rand(c - 2, c, generator=gen, dtype=F64)
    return _keys_at_cosines(gen, q_hat, cos, zeta), zeta * q_hat


def _theorem1_mistakes(keys: torch.Tensor, q: torch.Tensor, n: int, draws: int, seed: int) -> int:
    """How many of ``draws`` independent Omega make the library's score miss segment 0."""
    d = q.shape[-1]
    estimates = _segment_estimates(_performer(n, seed), keys / d**0.25, q / d**0.25, draws)  # [S, draws]
    return int((estimates.argmax(0) != 0).sum())


THEOREM1_DRAWS = 100


@THEORY
@given(
    seed=seeds,
    d=st.sampled_from([4, 8]),
    c=st.sampled_from([2, 3, 4, 6]),
    zeta=st.floats(1.2, 2.0),
    runner_up=st.floats(-0.5, 0.5),
    delta=st.sampled_from([0.05, 0.1, 0.25]),
)
def test_theorem1_radar_finds_the_top_segment_with_probability_at_least_one_minus_delta(
    seed, d, c, zeta, runner_up, delta
):
    """Theorem 1: if ``a_1 - max_{l != 1} a_l >= (1/c) exp(zeta^2/sqrt d) sqrt(8 log(2(c-1)/delta)/n)``,
    then ``argmax_l phi(q) . mean phi(k_l)`` is segment 1 with probability >= 1 - delta.

    Segment 1 of the paper is index 0 here. n is the smallest feature count meeting the condition
    for the constructed segments (the theorem's boundary, where it says most); mistakes among M
    independent Omega must be consistent with P(mistake) <= delta by an exact binomial test.
    """
    keys, q = _theorem1_segments(seed, d, c, zeta, runner_up)
    zeta_max = max(float(keys.norm(dim=-1).max()), float(q.norm()))
    gap = _gap(keys, q)
    n = math.ceil(8.0 * math.log(2.0 * (c - 1) / delta) * (math.exp(zeta_max**2 / math.sqrt(d)) / (c * gap)) ** 2)
    assert gap > 0 and gap >= _theorem1_required_gap(c, zeta_max, d, delta, n)
    mistakes = _theorem1_mistakes(keys, q, n, THEOREM1_DRAWS, seed)
    assert _binomial_consistent(mistakes, THEOREM1_DRAWS, delta)


def test_theorem1_check_rejects_nearly_tied_segments_with_few_features():
    # Segment 1 is segment 0 with one key shortened by 1%: nearly tied, far from the condition.
    d, c, zeta, n, delta = 4, 4, 1.5, 16, 0.1
    keys, q = _theorem1_segments(29, d, c, zeta, runner_up=0.0)
    keys[1] = keys[0]
    keys[1, 0] *= 0.99  # its logit shrinks by 1% of a positive value: segment 0 stays the (barely) top one
    zeta_max = max(float(keys.norm(dim=-1).max()), float(q.norm()))
    assert 0 < _gap(keys, q) < _theorem1_required_gap(c, zeta_max, d, delta, n)
    mistakes = _theorem1_mistakes(keys, q, n, THEOREM1_DRAWS, 29)
    assert mistakes > 0
    assert not _binomial_consistent(mistakes, THEOREM1_DRAWS, delta)


def _rounding_slack(queries: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """Float64 rounding allowance ``[B, H, G, S]`` for comparing log-masses of one query and segment.

    A length-d dot product errs by <= gamma_d sum_i |q_i k_i| with gamma_d = d u / (1 - d u)
    (Higham, Thm 3.5), the mean over c keys and the logsumexp over c terms add O(c u) relative error;
    we allow gamma_{d + c + 4} times the largest such magnitude, for each side of the comparison.
    """
    d, c = keys.shape[-1], keys.shape[-2]
    unit = torch.finfo(F64).eps / 2
    k = d + c + 4
    gamma = k * unit / (1 - k * unit)
    magnitude = torch.einsum("bhgd,bhsd->bhgs", queries.abs(), keys.abs().amax(-2)) + math.log(c) + 1.0
    return 2.0 * gamma * magnitude


def _ordered(lower: torch.Tensor, middle: torch.Tensor, upper: torch.Tensor, slack: torch.Tensor) -> bool:
    return bool((lower <= middle + slack).all() and (middle <= upper + slack).all())


def _bounds_scores(keys: torch.Tensor, queries: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(Centroid, ExactScore, MinMaxBound) scores ``[B, H, G, S]`` of ``keys: [B, H, S, c, D]``."""
    c = keys.shape[-2]
    out = []
    for summary in (Centroid(), ExactScore(), MinMaxBound()):
        params = summary.prepare(keys.shape[1], keys.shape[-1], layer_idx=0, device=CPU, dtype=F64)
        seg = keys if summary.reads_keys else None
        out.append(summary.score(params, summary.summarize(params, keys), queries, seg, c))
    return out[0], out[1], out[2]


@THEORY
@given(
    seed=seeds,
    # (batch, kv heads, queries per head, segments, segment size, head dim)
    shape=st.tuples(*(st.integers(1, hi) for hi in (2, 3, 2, 5, 7, 9))),
    scale=st.floats(0.01, 4.0),
)
def test_centroid_lower_bounds_and_minmax_upper_bounds_the_log_attention_mass(seed, shape, scale):
    """Jensen: ``log c + q . mean_j k_j <= logsumexp_j q.k_j``.

    Quest: ``logsumexp_j q.k_j <= log c + sum_i max(q_i min_i, q_i max_i)``.
    """
    b, h, g, s, c, d = shape
    gen = torch.Generator().manual_seed(seed)
    keys = scale * torch.randn(b, h, s, c, d, generator=gen, dtype=F64)
    queries = scale * torch.randn(b, h, g, d, generator=gen, dtype=F64)
    lower, exact, upper = _bounds_scores(keys, queries)
    assert _ordered(lower, exact, upper, _rounding_slack(queries, keys))


def test_bounds_check_rejects_summed_centroids_and_sign_blind_minmax():
    gen = torch.Generator().manual_seed(31)
    keys = torch.randn(1, 2, 5, 7, 9, generator=gen, dtype=F64)
    queries = torch.randn(1, 2, 3, 9, generator=gen, dtype=F64)
    lower, exact, upper = _bounds_scores(keys, queries)
    slack = _rounding_slack(queries, keys)
    assert _ordered(lower, exact, upper, slack)
    summed_centroid = queries @ keys.sum(-2).transpose(-1, -2) + math.log(7)  # keys summed, not averaged
    assert not _ordered(summed_centroid, exact, upper, slack)
    sign_blind = torch.einsum("bhgd,bhsd->bhgs", queries, keys.amax(-2)) + math.log(7)  # q . max, ignoring q_i < 0
    assert not _ordered(lower, exact, sign_blind, slack)


CONVERGENCE_FEATURES = (16, 64, 256, 1024)
CHEBYSHEV_K = 2.0  # at most 1/4 of the draws may fall beyond K standard deviations


def _convergence_check(features_cls: type[PerformerFeatures], keys: torch.Tensor, q: torch.Tensor, seed: int) -> bool:
    """Is the log error ``|score - exact|`` below ``-log(1 - K tau / sqrt n)`` in all but a Chebyshev share of draws?

    The relative error ``r = exp(score - exact) - 1`` has ``E[r] = 0`` and ``E[r^2] = tau^2 / n`` exactly,
    with ``tau^2 = Var[sum_j f_{k_j} f_q] / beta^2`` per segment (property 5 summed; beta the true mass).
    Chebyshev: ``P(|r| >= K tau / sqrt n) <= 1 / K^2``, and ``|r| < x < 1`` implies
    ``|log(1 + r)| < -log(1 - x)``. So the number of draws whose log error exceeds ``-log(1 - K tau/sqrt n)``
    is at most Binomial(draws, 1/K^2), tested exactly per segment: no normal approximation needed.
    """
    draws = 64
    s, c, d = keys.shape
    exact = ExactScore().score(None, (), q.view(1, 1, 1, d), keys.view(1, 1, s, c, d), c)[0, 0, 0]  # [S]
    tau = torch.sqrt(_segment_variance(keys, q)) / torch.exp(exact)  # [S]
    for n in CONVERGENCE_FEATURES:
        features = features_cls(n_features=n, seed=seed, feature_dtype=F64)
        log_err = torch.log(_segment_estimates(features, keys, q, draws)) - exact.unsqueeze(-1)  # [S, draws]
        x = CHEBYSHEV_K * tau / math.sqrt(n)
        assert bool((x < 1).all()), "norms too large for the log-space bound"
        beyond = (log_err.abs() >= -torch.log1p(-x).unsqueeze(-1)).sum(-1)  # [S]
        if not all(_binomial_consistent(int(k), draws, 1.0 / CHEBYSHEV_K**2) for k in beyond):
            return False
    return True


@THEORY
@given(seed=seeds, d=dims, segments=st.integers(1, 3), c=st.integers(1, 6))
def test_performer_score_converges_to_the_exact_log_mass_like_one_over_sqrt_n(seed, d, segments, c):
    """Radar's score approaches ExactScore's: the log error's quantiles shrink like ``tau / sqrt n``."""
    gen = torch.Generator().manual_seed(seed)
    keys, q = _random_vectors(gen, (segments, c), d, 0.5), _random_vectors(gen, (), d, 0.5)
    assert _convergence_check(PerformerFeatures, keys, q, seed)


def test_convergence_check_rejects_a_biased_estimator():
    gen = torch.Generator().manual_seed(37)
    keys, q = _random_vectors(gen, (2, 4), 4, 0.5), _random_vectors(gen, (), 4, 0.5)
    assert _convergence_check(PerformerFeatures, keys, q, 37)
    assert not _convergence_check(_NoHalfNorm, keys, q, 37)  # its error tends to a constant, not to 0


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_centroids_score_within_their_rounding_of_the_float64_scores(seed, dtype):
    """Stored and multiplied in bf16/fp16, a centroid score differs from the float64 one by at most the
    inputs' rounding (relative ``eps`` on each of q and the mean key) plus the product's own rounding."""
    gen = torch.Generator().manual_seed(seed)
    keys = 2.0 * torch.randn(2, 3, 40, 6, 32, generator=gen)
    queries = 2.0 * torch.randn(2, 3, 4, 32, generator=gen)
    low, ref = Centroid(dtype), Centroid()
    score = low.score(None, low.summarize(None, keys), queries, None, 6)
    exact = ref.score(None, ref.summarize(None, keys.double()), queries.double(), None, 6)
    assert score.dtype == torch.float32 and low.summarize(None, keys)[0].dtype == dtype
    eps = torch.finfo(dtype).eps
    magnitude = torch.einsum("bhgd,bhsd->bhgs", queries.double().abs(), keys.double().mean(-2).abs())
    slack = 3 * eps * magnitude + eps * (exact - math.log(6)).abs() + 1e-5
    assert bool(((score.double() - exact).abs() <= slack).all())
    # and the rounding is there: not the float32 scores
    assert not torch.equal(score, ref.score(None, ref.summarize(None, keys), queries, None, 6))
