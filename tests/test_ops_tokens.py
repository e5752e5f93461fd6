"""Attention over listed tokens and the token list of a segment selection, against float64 references."""

from __future__ import annotations

import pytest
import torch

from sparseattn.ops.attention import segment_mask
from sparseattn.ops.layout import SegmentLayout
from sparseattn.ops.tokens import segment_index, token_attention, token_attention_ref
from sparseattn.testing import assert_close


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("sets", [1, 3])
@pytest.mark.parametrize("softcap", [None, 5.0])
@pytest.mark.parametrize("seed", range(3))
def test_token_attention_is_dense_attention_under_the_listed_mask(dtype, sets, softcap, seed):
    g = torch.Generator().manual_seed(seed)
    B, H, G, D, t, L = 2, 2, 3, 16, 50, 12
    q, k, v = (torch.randn(*shape, generator=g).to(dtype) for shape in ((B, H, G, D), (B, H, t, D), (B, H, t, D)))
    index = torch.stack([torch.randperm(t, generator=g)[:L] for _ in range(B * H)]).view(B, H, L)
    valid = torch.rand(B, H, sets, L, generator=g) < 0.7
    valid[..., 0] = True  # every head attends something
    out, probs = token_attention(q, k, v, index, valid, 0.3, softcap)
    ref = token_attention_ref(q, k, v, index, valid, 0.3, softcap)
    assert_close(out, ref, dtype)
    assert torch.all(probs.masked_select(~valid.expand(B, H, G, L)) == 0)
    assert torch.allclose(probs.sum(-1).double(), torch.ones(B, H, G, dtype=torch.float64), atol=1e-5)


@pytest.mark.parametrize("window", [0, 5, 40])
@pytest.mark.parametrize("sets", [1, 3])
@pytest.mark.parametrize("seed", range(4))
def test_segment_index_lists_exactly_the_tokens_of_the_segment_mask(window, sets, seed):
    g = torch.Generator().manual_seed(seed)
    B, H, G = 2, 2, 3
    lay = SegmentLayout(length=70, sinks=2, segment_size=6, n_segments=10, window=window)
    k = int(torch.randint(0, 5, (1,), generator=g))
    segments = torch.stack([torch.randperm(10, generator=g)[:k] for _ in range(B * H * sets)]).view(B, H, sets, k)
    index, mask = segment_index(lay, segments)
    listed = torch.zeros(B, H, G, lay.length, dtype=torch.bool)
    m = torch.ones(B, H, 1, index.shape[-1], dtype=torch.bool) if mask is None else mask
    for b in range(B):
        for h in range(H):
            for q in range(G):
                rows = m[b, h, q if m.shape[2] == G else 0]
                assert len(set(index[b, h][rows].tolist())) == int(rows.sum())  # no token twice
                listed[b, h, q, index[b, h][rows]] = True
    assert torch.equal(listed, segment_mask(lay, segments, G))
