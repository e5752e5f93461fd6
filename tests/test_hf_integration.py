"""transformers integration: any composed method decodes through generate, exactly at full budget, on every architecture."""

from __future__ import annotations

import pytest
import torch
import transformers as tf

import hf_models
from hf_models import ARCHITECTURES, left_pad, prompts, tiny_model
from sparseattn import (
    Centroid,
    Dense,
    DoublingSchedule,
    ExactScore,
    FixedSchedule,
    MinMaxBound,
    Radar,
    RadarAlg1,
    Random,
    Recent,
    SegmentSearch,
    TopK,
)
from sparseattn.hf import SparseCache, SparseLayer, apply, cache_kwargs

FULL = 10**6  # a top_k that covers every segment
FULL_BUDGET_METHODS = {
    "dense": Dense(),
    "radar": Radar(top_k=FULL, n_features=64, sinks=1, window=3),
    "quest-like": SegmentSearch(MinMaxBound(), TopK(), FixedSchedule(5), top_k=FULL),
    "centroid-random-doubling": SegmentSearch(Centroid(), Random(seed=1), DoublingSchedule(), top_k=FULL),
    "exact-recent-sqrt": SegmentSearch(ExactScore(), Recent(), top_k=FULL, shared_kv_selection=True),
}
NEW_TOKENS = 64
PROMPT_LENGTHS = [43, 29]  # odd, different: the batch is left-padded


def greedy(model, ids, mask, cache=None, new_tokens=NEW_TOKENS, **kwargs):
    return hf_models.greedy(model, ids, mask, cache, new_tokens, **kwargs)


def max_logit_difference(a, b) -> float:
    return max(float((x - y).abs().max()) for x, y in zip(a.logits, b.logits))


@pytest.fixture(scope="module", params=list(ARCHITECTURES))
def arch(request):
    name = request.param
    model = tiny_model(name)
    ids, mask = left_pad(prompts(2, PROMPT_LENGTHS))
    return name, model, ids, mask, greedy(model, ids, mask)


@pytest.mark.parametrize("method_name", list(FULL_BUDGET_METHODS))
def test_full_budget_generation_equals_dense_attention(arch, method_name):
    name, model, ids, mask, reference = arch
    with apply(model, FULL_BUDGET_METHODS[method_name]) as sparse:
        cache = sparse.new_cache()
        out = greedy(model, ids, mask, cache)
    assert torch.equal(out.sequences, reference.sequences), f"{name}: tokens differ from dense attention"
    assert max_logit_difference(out, reference) <= 1e-4
    # Every full-attention layer decoded sparsely; sliding-window layers stayed transformers' own.
    assert len(cache.layers) == model.config.num_hidden_layers
    assert all(isinstance(layer, SparseLayer) != sliding for layer, sliding in zip(cache.layers, cache.is_sliding))
    if cache.sparse_layers:
        assert cache.mean_attended() == pytest.approx(cache.mean_stored())  # full budget: everything attended


def test_a_left_padded_batch_decodes_each_row_as_it_would_alone_at_a_small_budget(arch):
    name, model, ids, mask, _ = arch
    method = Radar(top_k=2, n_features=32)
    rows = prompts(2, PROMPT_LENGTHS)
    with apply(model, method) as sparse:
        batched = greedy(model, ids, mask, sparse.new_cache(), new_tokens=24)
        for b, row in enumerate(rows):
            alone = greedy(model, row, torch.ones_like(row), sparse.new_cache(), new_tokens=24)
            assert torch.equal(batched.sequences[b, ids.shape[1] :], alone.sequences[0, row.shape[1] :]), f"{name} row {b}"
            assert max(float((x[b] - y[0]).abs().max()) for x, y in zip(batched.logits, alone.logits)) <= 1e-4


def test_sparse_decoding_at_a_small_budget_attends_fewer_tokens_and_still_generates():
    model = tiny_model("llama")
    ids = prompts(1, [300])[0]
    with apply(model, RadarAlg1(top_k=2, n_features=32)) as sparse:
        cache = sparse.new_cache()
        out = greedy(model, ids, torch.ones_like(ids), cache, new_tokens=20)
    assert out.sequences.shape[1] == 320
    # t in [300, 320): 17 segments of 17 tokens, 2 of them, plus a buffer < 2 * 17
    assert cache.mean_attended() <= 2 * 17 + 2 * 18
    assert cache.mean_stored() > 300


def manual_greedy(model, cache, chunks: list[torch.Tensor], new_tokens: int) -> torch.Tensor:
    """Prefill ``chunks`` one forward call each, then decode token by token with plain forward calls."""
    with torch.no_grad():
        for chunk in chunks:
            logits = model(chunk, **cache_kwargs(model, cache), use_cache=True).logits
        tokens = []
        for _ in range(new_tokens):
            nxt = logits[:, -1].argmax(-1, keepdim=True)
            tokens.append(nxt)
            logits = model(nxt, **cache_kwargs(model, cache), use_cache=True).logits
    return torch.cat(tokens, 1)


@pytest.mark.parametrize("name", ["llama", "gemma2"])
def test_chunked_prefill_equals_one_prefill_and_generate(name):
    model = tiny_model(name)
    ids = prompts(1, [61])[0]
    method = Radar(top_k=3, n_features=32)
    with apply(model, method) as sparse:
        one = manual_greedy(model, sparse.new_cache(), [ids], 16)
        chunked = manual_greedy(model, sparse.new_cache(), [ids[:, :20], ids[:, 20:45], ids[:, 45:]], 16)
        generated = greedy(model, ids, torch.ones_like(ids), sparse.new_cache(), new_tokens=16)
    assert torch.equal(one, chunked)
    assert torch.equal(one, generated.sequences[:, 61:])


def test_a_sparse_cache_without_the_sparse_attention_implementation_is_an_error():
    model = tiny_model("llama")
    ids = prompts(1, [20])[0]
    with pytest.raises(RuntimeError, match="attention implementation is not 'sparseattn'"):
        greedy(model, ids, torch.ones_like(ids), SparseCache(Radar(top_k=1), config=model.config), new_tokens=3)


def test_apply_is_reversible_even_when_generation_raises():
    model = tiny_model("llama")
    assert model.config._attn_implementation == "sdpa"
    with pytest.raises(ZeroDivisionError):
        with apply(model, Radar()):
            assert model.config._attn_implementation == "sparseattn"
            raise ZeroDivisionError
    assert model.config._attn_implementation == "sdpa"


def test_without_a_sparse_cache_the_implementation_is_plain_dense_attention():
    model = tiny_model("qwen2")
    ids, mask = left_pad(prompts(2, PROMPT_LENGTHS))
    reference = greedy(model, ids, mask, new_tokens=8)
    with apply(model, Radar(top_k=1)):
        out = greedy(model, ids, mask, new_tokens=8)  # a DynamicCache: dense, no error
    assert torch.equal(out.sequences, reference.sequences)


def test_right_padding_is_refused_with_a_clear_error():
    model = tiny_model("llama")
    ids = torch.cat(prompts(2, [12, 12]))
    mask = torch.ones_like(ids)
    mask[1, -3:] = 0
    with apply(model, Radar(top_k=1)) as sparse, pytest.raises(ValueError, match="left padding"):
        model(ids, attention_mask=mask, **cache_kwargs(model, sparse.new_cache()))


def test_models_outside_the_attention_registry_are_refused_by_name():
    config = tf.BloomConfig(vocab_size=50, hidden_size=16, n_layer=1, n_head=2)
    with pytest.raises(ValueError, match="bloom.*attention registry"):
        apply(tf.BloomForCausalLM(config), Radar())


def test_beam_search_reorders_the_sparse_states():
    model = tiny_model("llama")
    ids = prompts(1, [40])[0]
    kwargs = dict(attention_mask=torch.ones_like(ids), max_new_tokens=12, num_beams=3, do_sample=False, pad_token_id=0)
    reference = model.generate(ids, **kwargs)
    with apply(model, Radar(top_k=FULL, n_features=32)) as sparse:
        out = model.generate(ids, **cache_kwargs(model, sparse.new_cache()), **kwargs)
    assert torch.equal(out, reference)


def test_summaries_add_order_sqrt_t_bytes_not_a_second_cache():
    model = tiny_model("llama")
    sizes = {}
    # 400 and 1600 past tokens (the newest token is never segmented): perfect squares, 20 and 40 segments
    for t in (401, 1601):
        ids = prompts(1, [t])[0]  # the prefill stores t tokens; the one generated token is never fed back
        with apply(model, RadarAlg1(top_k=2, n_features=64)) as sparse:
            cache = sparse.new_cache()
            greedy(model, ids, torch.ones_like(ids), cache, new_tokens=1)
        sizes[t] = cache.nbytes()
        kv_bytes = 2 * t * 2 * 8 * 4 * model.config.num_hidden_layers  # K and V, 2 KV heads, head_dim 8, fp32
        assert sizes[t]["kv"] == pytest.approx(kv_bytes, rel=0.01)
    assert sizes[1601]["summaries"] == 2 * sizes[401]["summaries"]  # segments grow like sqrt(t)
    assert sizes[1601]["summaries"] < sizes[1601]["kv"]
