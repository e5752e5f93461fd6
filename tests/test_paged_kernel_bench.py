"""benchmarks/paged_kernel.py's caches of given keys (``--keys text``): laid out as vLLM's pages hold them, so the
fused dense step over them is attention over the keys and values as given."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import paged_kernel  # noqa: E402

from sparseattn.testing import assert_close  # noqa: E402
from sparseattn.vllm.paged import page_views  # noqa: E402


@pytest.mark.parametrize("shared", [False, True], ids=["own blocks", "shared blocks"])
@pytest.mark.parametrize("length, bs", [(100, 32), (64, 16), (33, 32)])
def test_given_keys_land_in_each_sequence_s_pages_in_order(length, bs, shared):
    B, H, D = 3, 2, 8
    g = torch.Generator().manual_seed(length + bs)
    keys = torch.randn(B, H, length, D, generator=g)
    values = torch.randn(B, H, length, D, generator=g)
    if shared:
        keys, values = keys[:1].expand(B, -1, -1, -1), values[:1].expand(B, -1, -1, -1)
    cache, table = paged_kernel.fill_cache(keys, values, bs, shared)
    pages_k, pages_v = page_views(cache)
    for b in range(B):
        got_k = torch.cat([pages_k[block].transpose(-1, -2) for block in table[b].tolist()], dim=1)[:, :length]
        got_v = torch.cat([pages_v[block] for block in table[b].tolist()], dim=1)[:, :length]
        assert torch.equal(got_k, keys[b]) and torch.equal(got_v, values[b])
    assert len(set(table.flatten().tolist())) == table.numel() // (B if shared else 1)  # own blocks unless shared


def test_the_fused_dense_step_over_given_keys_is_their_attention():
    from sparseattn.vllm.paged_kernel import kernel_refusal

    if kernel_refusal() is not None:
        pytest.skip(f"the fused paged kernel cannot be built here: {kernel_refusal()}")
    from sparseattn import registry
    from sparseattn.vllm.paged_kernel import fused_decode
    from sparseattn.vllm.policy import PagedPolicy
    from sparseattn.vllm.route import route

    B, H, G, D, length, bs = 2, 3, 3, 64, 200, 32
    g = torch.Generator().manual_seed(5)
    keys, values = torch.randn(B, H, length, D, generator=g), torch.randn(B, H, length, D, generator=g)
    query = torch.randn(B, H * G, D, generator=g)
    cache, table = paged_kernel.fill_cache(keys, values, bs, False)
    policy = PagedPolicy(registry.parse("dense").method, "dense")
    lens = torch.full((B,), length, dtype=torch.int32)
    out, _ = fused_decode(policy, route(policy).mode, None, cache, query, table, lens, D**-0.5)
    q = query.double().view(B, H, G, D)
    weights = torch.softmax(q @ keys.double().transpose(-1, -2) * D**-0.5, dim=-1)
    assert_close(out, (weights @ values.double()).view(B, H * G, D).float(), torch.float32)
