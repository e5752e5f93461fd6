"""The embedded default model (SmolLM2-135M-Instruct) decodes exactly under Radar at full budget (slow)."""

import sysconfig
from pathlib import Path

import pytest
import torch

from sparseattn import Radar, RadarAlg1
from sparseattn.hf import apply, cache_kwargs, default_model_unavailable_reason, load_model

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def default_model():
    reason = default_model_unavailable_reason()
    if reason is not None:
        pytest.skip(f"default model unavailable: {reason}")
    return load_model("default")


def test_radar_at_full_budget_generates_the_same_32_tokens_as_dense(default_model):
    model, tokenizer = default_model
    text = Path(sysconfig.get_paths()["stdlib"], "_pydecimal.py").read_text()[:4000]
    ids = tokenizer(text, return_tensors="pt")["input_ids"]
    kwargs = dict(attention_mask=torch.ones_like(ids), max_new_tokens=32, min_new_tokens=32, do_sample=False,
                  output_logits=True, return_dict_in_generate=True, pad_token_id=tokenizer.eos_token_id)
    dense = model.generate(ids, **kwargs)
    with apply(model, Radar(top_k=10**6)) as sparse:
        cache = sparse.new_cache()
        radar = model.generate(ids, **cache_kwargs(model, cache), **kwargs)
    assert torch.equal(radar.sequences, dense.sequences)
    assert max(float((a - b).abs().max()) for a, b in zip(radar.logits, dense.logits)) <= 1e-3
    assert len(cache.sparse_layers) == 30


def test_radar_at_a_small_budget_attends_a_fraction_of_the_context(default_model):
    model, tokenizer = default_model
    text = Path(sysconfig.get_paths()["stdlib"], "_pydecimal.py").read_text()[:8000]
    ids = tokenizer(text, return_tensors="pt")["input_ids"]
    with apply(model, RadarAlg1(top_k=4)) as sparse:
        cache = sparse.new_cache()
        model.generate(ids, attention_mask=torch.ones_like(ids), **cache_kwargs(model, cache), max_new_tokens=8, do_sample=False,
                       pad_token_id=tokenizer.eos_token_id)
    assert cache.mean_attended() < 0.5 * cache.mean_stored()
