"""Every registered method decodes through ``model.generate``: dense tokens at full budget, within budget otherwise."""

from __future__ import annotations

import pytest
import torch

import hf_models
from hf_models import left_pad, prompts, tiny_model
from sparseattn import registry
from sparseattn.hf import apply, cache_kwargs
from sparseattn.methods.layers import FirstLayers, layer_budgets

NEW_TOKENS = 12
PROMPT_LENGTHS = [43, 29]  # odd, different: the batch is left-padded
FULL = 4096  # more than prompt + new tokens: nothing is evicted or skipped
SMALL = 48  # less than the longer prompt: every method evicts or selects


def method_at(name: str, budget: int):
    return registry.build(name, **registry.get(name).takes(budget=budget, n_features=32))


def greedy(model, ids, mask, cache=None, new_tokens=NEW_TOKENS, **kwargs):
    return hf_models.greedy(model, ids, mask, cache, new_tokens, **kwargs)


@pytest.fixture(scope="module", params=["llama", "gemma2"])
def arch(request):
    model = tiny_model(request.param)
    ids, mask = left_pad(prompts(2, PROMPT_LENGTHS))
    return request.param, model, ids, mask, greedy(model, ids, mask)


@pytest.mark.parametrize("name", registry.names())
def test_every_method_generates_the_dense_tokens_at_full_budget(arch, name):
    arch_name, model, ids, mask, reference = arch
    with apply(model, method_at(name, FULL)) as sparse:
        cache = sparse.new_cache()
        out = greedy(model, ids, mask, cache)
    assert torch.equal(out.sequences, reference.sequences), f"{arch_name}/{name}: tokens differ from dense attention"
    assert max(float((x - y).abs().max()) for x, y in zip(out.logits, reference.logits)) <= 1e-4
    assert cache.mean_attended() == pytest.approx(cache.mean_stored())


@pytest.mark.parametrize("name", [n for n in registry.names() if n != "dense"])
def test_every_method_generates_within_its_budget(name):
    model = tiny_model("llama")
    ids, mask = left_pad(prompts(2, [70, 53]))
    with apply(model, method_at(name, SMALL)) as sparse:
        cache = sparse.new_cache()
        out = greedy(model, ids, mask, cache)
    assert out.sequences.shape == (2, 70 + NEW_TOKENS)
    method = method_at(name, SMALL)
    n_layers = model.config.num_hidden_layers
    limits = layer_budgets(method, n_layers) if isinstance(method, FirstLayers) else [SMALL] * n_layers
    for layer in cache.sparse_layers:  # per layer: its own budget (a per-layer split gives the first layers more)
        assert max(layer.stats.history) <= limits[layer.layer_idx], f"{name}: layer {layer.layer_idx} attended {max(layer.stats.history)}"
    assert cache.mean_attended() <= SMALL < 70  # over the layers: the budget


@pytest.mark.parametrize("name", ["h2o", "snapkv", "subgen", "snapkv-then-radar"])
def test_beam_search_with_an_evicting_method(name):
    model = tiny_model("llama")
    ids = prompts(1, [40])[0]
    kwargs = dict(attention_mask=torch.ones_like(ids), max_new_tokens=8, num_beams=3, do_sample=False, pad_token_id=0)
    reference = model.generate(ids, **kwargs)
    with apply(model, method_at(name, FULL)) as sparse:
        assert torch.equal(model.generate(ids, **cache_kwargs(model, sparse.new_cache()), **kwargs), reference)
    with apply(model, method_at(name, 42)) as sparse:  # SubGen needs 41: a 32-token window, 8 samples, 1 value
        assert model.generate(ids, **cache_kwargs(model, sparse.new_cache()), **kwargs).shape == (1, 48)
