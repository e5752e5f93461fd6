"""ExactScore + TopK picks exactly the brute-force top-k segments by attention mass."""

import pytest
import torch

from sparseattn import ExactScore, SegmentSearch, SqrtSchedule, TopK


def brute_force_masses(query, keys, layout, scale):
    """Float64 attention mass of every segment: [B, H_kv, G, S]."""
    B, H, G, D = query.shape
    seg = keys[:, :, layout.sink_end : layout.segment_end].double().view(B, H, layout.n_segments, layout.segment_size, D)
    logits = torch.einsum("bhgd,bhscd->bhgsc", query.double(), seg) * scale
    return logits.exp().sum(-1)


@pytest.mark.parametrize("shared", [False, True], ids=["per-query-head", "shared-per-kv-head"])
@pytest.mark.parametrize("top_k", [1, 3, 7])
@pytest.mark.parametrize("seed", range(4))
def test_exact_segment_search_selects_the_segments_with_the_largest_attention_mass(top_k, seed, shared):
    torch.manual_seed(seed)
    B, H, G, D = 2, 2, 3, 16
    method = SegmentSearch(ExactScore(), TopK(), SqrtSchedule(), top_k=top_k, sinks=1, shared_kv_selection=shared)
    state = method.new_state(B, H, D)
    state.prefill(torch.randn(B, H, 150, D) * 2, torch.randn(B, H, 150, D))
    for _ in range(5):
        q = torch.randn(B, H * G, D) * 2
        _, info = state.step(q, torch.randn(B, H, D) * 2, torch.randn(B, H, D))
        masses = brute_force_masses(q.view(B, H, G, D), state.keys, info.layout, D**-0.5)
        if shared:
            masses = masses.sum(2, keepdim=True)
        expected = masses.topk(top_k, dim=-1).indices.sort(-1).values
        assert torch.equal(info.segments.sort(-1).values, expected)
