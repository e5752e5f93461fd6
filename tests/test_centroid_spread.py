"""CentroidSpread: the mean key plus half the query-weighted per-channel variance, against its float64 formula and
the exact log mass it estimates."""

import math

import pytest
import torch

from sparseattn import Centroid, CentroidSpread, registry
from sparseattn.vllm.route import route
from sparseattn.vllm.policy import PagedPolicy

F64 = torch.float64


def score(summary, keys, queries):
    params = summary.prepare(keys.shape[1], keys.shape[-1], layer_idx=0, device=torch.device("cpu"), dtype=keys.dtype)
    return summary.score(params, summary.summarize(params, keys), queries, None, keys.shape[-2])


def exact_log_mass(queries, keys):
    return torch.logsumexp(torch.einsum("bhgd,bhscd->bhgsc", queries, keys), dim=-1)


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("dtype", [None, torch.float32, torch.bfloat16])
def test_score_is_the_second_order_formula(seed, dtype):
    gen = torch.Generator().manual_seed(seed)
    keys = torch.randn(2, 3, 7, 5, 8, generator=gen)  # [B, H, S, c, D]
    queries = torch.randn(2, 3, 4, 8, generator=gen)  # [B, H, G, D]
    mean, var = keys.double().mean(-2), keys.double().var(-2, unbiased=False)
    if dtype is not None:  # stored rounded once, scored in the query's dtype
        mean, var = mean.to(dtype).double(), var.to(dtype).double()
    q = queries.double()
    want = q @ mean.transpose(-1, -2) + 0.5 * (q * q) @ var.transpose(-1, -2) + math.log(5)
    got = score(CentroidSpread(dtype), keys, queries)
    assert got.dtype == queries.dtype
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)


def test_equal_keys_score_their_exact_mass_as_the_centroid_does():
    keys = torch.randn(1, 2, 6, 1, 8, dtype=F64).expand(1, 2, 6, 4, 8).contiguous()  # every segment: one key 4 times
    queries = torch.randn(1, 2, 3, 8, dtype=F64)
    exact = exact_log_mass(queries, keys)
    torch.testing.assert_close(score(CentroidSpread(), keys, queries), exact)
    torch.testing.assert_close(score(Centroid(), keys, queries), exact)


def test_spread_keys_are_estimated_closer_than_by_the_centroid():
    """Keys spread along the query's channels (Gaussian, small enough for the expansion): the centroid's Jensen bound
    misses the variance's share of the mass, the spread score keeps most of it."""
    gen = torch.Generator().manual_seed(0)
    keys = 0.3 * torch.randn(4, 2, 50, 16, 8, generator=gen, dtype=F64)
    queries = torch.randn(4, 2, 3, 8, generator=gen, dtype=F64)
    exact = exact_log_mass(queries, keys)
    centroid_error = (score(Centroid(), keys, queries) - exact).abs().mean()
    spread_error = (score(CentroidSpread(), keys, queries) - exact).abs().mean()
    assert spread_error < 0.5 * centroid_error


def test_bad_dtype_and_options_are_refused():
    with pytest.raises(ValueError, match="CentroidSpread.dtype"):
        CentroidSpread(torch.int8)
    with pytest.raises(ValueError, match="coarse"):
        registry.parse("radar+:coarse=median", 512)
    with pytest.raises(ValueError, match="prefilter"):
        registry.parse("radar+:coarse=spread,prefilter=8", 512)


def test_vllm_runs_it_on_the_generic_path_and_says_why():
    method = registry.parse("radar+:coarse=spread", 512).method
    assert route(PagedPolicy(method, "radar+:coarse=spread")).mode is None
    assert "CentroidSpread" in route(PagedPolicy(method, "radar+:coarse=spread")).refusal
