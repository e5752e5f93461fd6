"""One shared prefill gives every method exactly the cache its own prefill would (the main job relies on it)."""

from __future__ import annotations

import pytest
import torch

from sparseattn import H2O, Dense, Quest, RadarPlus, SnapKV, StreamingLLM, SubGen, registry
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
    # the always part observes the prompt's attention; a prefill method hands over to a decode method
    "radar-with-h2o": registry.parse("radar-with-h2o", 32).method,
    "snapkv-then-radar": registry.parse("snapkv-then-radar", 40).method,
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


def test_a_shared_prefill_computes_the_prompt_attention_once(monkeypatch):
    """The fan-out answers with its first state's output; the others only observe the block, so the
    ``T x t`` prefill attention is computed once per layer, not once per method (each method's cache is
    still its own prefill's: the test above)."""
    import sparseattn.methods.base as base

    calls = []
    real = base.causal_block_attention
    monkeypatch.setattr(base, "causal_block_attention", lambda *a, **k: calls.append(1) or real(*a, **k))
    model = tiny_model("llama", seed=3)
    ids = torch.randint(3, 97, (1, 50), generator=torch.Generator().manual_seed(4))
    prefill_together(model, {label: METHODS[label] for label in ("dense", "h2o", "snapkv", "radar+")}, ids,
                     progress=False)  # fmt: skip
    assert len(calls) == model.config.num_hidden_layers


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


def _storages(cache: SparseCache) -> dict[int, int]:
    """Bytes of every distinct storage behind the keys and values of ``cache``'s layers, by address."""
    out = {}
    for layer in cache.sparse_layers:
        for tensor in (layer.state.keys, layer.state.values):
            out[tensor.untyped_storage().data_ptr()] = tensor.untyped_storage().nbytes()
    return out


def test_shared_prefill_stores_the_prompt_once_for_the_methods_that_keep_it_whole():
    """The memory regression of issue ``compare`` (11.4 GB at batch 8 x 4k): every method that keeps the whole
    prompt held its own copy (1.5 GB each in float32). Dense, the segment searches share one storage; an
    evicting method keeps only its budget, in storage of its own."""
    model = tiny_model("llama", seed=3)
    ids = torch.randint(3, 97, (2, 70), generator=torch.Generator().manual_seed(5))
    methods = {"dense": Dense(), "quest": Quest(budget=32, page_size=4), "radar+": RadarPlus(budget=32),
               "streamingllm": StreamingLLM(budget=24)}  # fmt: skip
    caches = prefill_together(model, methods, ids[:, :64], progress=False)
    whole = [_storages(caches[label]) for label in ("dense", "quest", "radar+")]
    assert whole[0] == whole[1] == whole[2], "the methods that keep the whole prompt hold copies of it"
    assert not set(_storages(caches["streamingllm"])) & set(whole[0])
    prompt_bytes = caches["dense"].nbytes()["kv"]
    assert sum(whole[0].values()) <= prompt_bytes * 9 // 8 + 2 * 16 * 64 * len(caches["dense"].sparse_layers)  # + headroom
    # Decoding some of them (not all) leaves the others' prompt and decode tokens as they were.
    with apply(model, Dense()), torch.no_grad():
        _decode(model, caches["quest"], ids[:, :66], 64)
    assert _storages(caches["dense"]) == whole[0] and caches["dense"].get_seq_length() == 64


def test_interleaved_decoding_of_shared_prompt_caches_is_exactly_separate_decoding():
    """``sparseattn compare`` decodes its methods one step each in turn: each cache still decodes as if alone."""
    model = tiny_model("llama", seed=3)
    ids = torch.randint(3, 97, (2, 72), generator=torch.Generator().manual_seed(6))
    prefill = 60
    methods = {"dense": Dense(), "dense2": Dense(), "quest": Quest(budget=32, page_size=4),
               "radar+": RadarPlus(budget=32), "streamingllm": StreamingLLM(budget=24)}  # fmt: skip
    caches = prefill_together(model, methods, ids[:, :prefill], progress=False)
    labels = list(methods)
    got = {label: [] for label in labels}
    with torch.no_grad():
        for i, position in enumerate(range(prefill, ids.shape[1])):
            for label in labels[i % len(labels) :] + labels[: i % len(labels)]:
                with apply(model, methods[label]):
                    logits = model(ids[:, position : position + 1], **cache_kwargs(model, caches[label]), use_cache=True).logits
                got[label].append(logits[:, -1])
    for label, method in methods.items():
        with apply(model, method), torch.no_grad():
            alone = SparseCache(method, config=model.config)
            model(ids[:, :prefill], **cache_kwargs(model, alone), use_cache=True)
            expected = _decode(model, alone, ids, prefill)
        torch.testing.assert_close(torch.stack(got[label]), expected, rtol=0, atol=0, msg=label)


def test_states_sharing_a_prompt_step_reindex_and_grow_as_separate_states():
    """The storage-level guarantee: two states handed one prompt storage answer like two that were not."""
    from sparseattn.evaluation.shared_prefill import PromptSharingBuffer, share_prompt

    gen = torch.Generator().manual_seed(0)
    k, v = torch.randn(3, 2, 20, 8, generator=gen), torch.randn(3, 2, 20, 8, generator=gen)
    shared = [Dense().new_state(3, 2, 8) for _ in range(2)] + [StreamingLLM(budget=8).new_state(3, 2, 8)]
    alone = [Dense().new_state(3, 2, 8) for _ in range(2)]
    for state in shared + alone:
        state.append(k, v)
    assert share_prompt(shared) == 2  # the evicting state is not an appends-only one
    assert isinstance(shared[0]._keys, PromptSharingBuffer) and shared[0].keys.data_ptr() == shared[1].keys.data_ptr()
    for step in range(6):  # past the shared capacity (20 + 20 // 8): the states then grow storage of their own
        for i in (step % 2, 1 - step % 2):
            q, kk, vv = (torch.randn(alone[i].batch, *shape, generator=gen) for shape in ((4, 8), (2, 8), (2, 8)))
            torch.testing.assert_close(shared[i].step(q, kk, vv)[0], alone[i].step(q, kk, vv)[0], rtol=0, atol=0)
        if step == 1:  # reindexing one leaves the other's rows alone
            shared[0].select_batch(torch.tensor([2, 0]))
            alone[0].select_batch(torch.tensor([2, 0]))
    for got, expected in zip(shared[:2], alone):
        assert torch.equal(got.keys, expected.keys) and torch.equal(got.values, expected.values)


def test_a_chunked_prompt_is_shared_again_after_each_block():
    """A second prompt block (chunked prefill) through the fan-out: still one storage, still exact."""
    from sparseattn.evaluation.shared_prefill import FanoutState

    gen = torch.Generator().manual_seed(1)
    methods = [Dense(), Quest(budget=8, page_size=2), StreamingLLM(budget=8), Dense()]
    fanout = FanoutState([method.new_state(2, 2, 8) for method in methods])
    alone = [method.new_state(2, 2, 8) for method in methods]
    for block in (12, 9):
        k, v, q = torch.randn(2, 2, block, 8, generator=gen), torch.randn(2, 2, block, 8, generator=gen), torch.randn(2, 4, block, 8, generator=gen)
        fanout.append(k, v)
        for state in alone:
            state.append(k, v)
        fanout.attend_block(q)
        for state in alone:
            state.attend_block(q)
    shared = [fanout.states[i] for i in (0, 1, 3)]
    assert len({state.keys.untyped_storage().data_ptr() for state in shared}) == 1
    for step in range(3):
        q, kk, vv = (torch.randn(2, *shape, generator=gen) for shape in ((4, 8), (2, 8), (2, 8)))
        for got, expected in zip(fanout.states, alone):
            torch.testing.assert_close(got.step(q, kk, vv)[0], expected.step(q, kk, vv)[0], rtol=0, atol=0)
