"""One shared prefill gives every method exactly the cache its own prefill would (the main job relies on it)."""

from __future__ import annotations

import pytest
import torch

from sparseattn import H2O, Dense, Quest, RadarPlus, SnapKV, StreamingLLM, SubGen
from sparseattn.evaluation.shared_prefill import Fanout, prefill_together
from sparseattn.hf import apply, cache_kwargs
from sparseattn.hf.cache import SparseCache
from sparseattn.methods.segment_search import SegmentSearch
from tests.hf_models import tiny_model

METHODS = {
    "dense": Dense(),
    "streamingllm": StreamingLLM(budget=24),
    "h2o": H2O(budget=24),
    "snapkv": SnapKV(budget=40, observation_window=8),  # keeps prompt tokens by the prefill queries' votes
    "subgen": SubGen(budget=48, window=8),
    "quest": Quest(budget=32, page_size=4),
    "radar+": RadarPlus(budget=32),
    "segments": SegmentSearch(top_k=2),
}


def _decode(model, cache, ids: torch.Tensor, prefill: int) -> torch.Tensor:
    """Logits ``[steps, B, vocab]`` of feeding ``ids[:, prefill:]`` one token at a time into ``cache``."""
    out = []
    for position in range(prefill, ids.shape[1]):
        out.append(model(ids[:, position : position + 1], **cache_kwargs(model, cache), use_cache=True).logits[:, -1])
    return torch.stack(out)


@pytest.mark.parametrize("architecture", ["llama", "gemma2"])  # gemma2: sliding layers and softcap
def test_shared_prefill_decodes_exactly_as_separate_prefills(architecture):
    model = tiny_model(architecture, seed=3)
    ids = torch.randint(3, 97, (2, 77), generator=torch.Generator().manual_seed(5))  # batch 2, odd length
    prefill = 61
    caches = prefill_together(model, METHODS, ids[:, :prefill], progress=False)
    for label, method in METHODS.items():
        with apply(model, method), torch.no_grad():
            alone = SparseCache(method, config=model.config)
            model(ids[:, :prefill], **cache_kwargs(model, alone), use_cache=True)
            expected = _decode(model, alone, ids, prefill)
            got = _decode(model, caches[label], ids, prefill)
        torch.testing.assert_close(got, expected, rtol=0, atol=0, msg=f"{label}: shared prefill decodes differently")
        assert caches[label].mean_attended() == alone.mean_attended(), label


def test_shared_prefill_caches_are_independent():
    """Decoding one method's cache leaves another's untouched (no state is shared between them)."""
    model = tiny_model("llama", seed=1)
    ids = torch.randint(3, 97, (1, 40), generator=torch.Generator().manual_seed(2))
    caches = prefill_together(model, {"a": Dense(), "b": Dense()}, ids[:, :30], progress=False)
    with apply(model, Dense()), torch.no_grad():
        _decode(model, caches["a"], ids, 30)
    assert caches["a"].get_seq_length() == 40 and caches["b"].get_seq_length() == 30


def test_fanout_and_prefill_together_refuse_empty_input():
    with pytest.raises(ValueError, match="at least one method"):
        Fanout(())
    model = tiny_model("llama")
    with pytest.raises(ValueError, match="at least one method"):
        prefill_together(model, {}, torch.ones(1, 4, dtype=torch.long))
    with pytest.raises(ValueError, match=r"\[batch, tokens\]"):
        prefill_together(model, {"dense": Dense()}, torch.ones(4, dtype=torch.long))
