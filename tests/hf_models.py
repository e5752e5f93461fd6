"""Tiny randomly initialised decoder models of several architectures, built offline in the tests."""

from __future__ import annotations

import torch
import transformers as tf

from sparseattn.hf import cache_kwargs

COMMON = dict(
    vocab_size=97,
    hidden_size=48,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=6,
    num_key_value_heads=2,
    max_position_embeddings=1024,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
)

# name -> (model class, config): GQA everywhere (6 query heads, 2 KV heads), head dims 8 to 24.
ARCHITECTURES = {
    "llama": (tf.LlamaForCausalLM, lambda: tf.LlamaConfig(**COMMON)),
    "mistral": (tf.MistralForCausalLM, lambda: tf.MistralConfig(**COMMON, sliding_window=None)),
    "mistral-sliding": (tf.MistralForCausalLM, lambda: tf.MistralConfig(**COMMON, sliding_window=24)),
    "qwen2": (tf.Qwen2ForCausalLM, lambda: tf.Qwen2Config(**COMMON)),
    "qwen3": (tf.Qwen3ForCausalLM, lambda: tf.Qwen3Config(**COMMON, head_dim=16)),
    "phi3": (tf.Phi3ForCausalLM, lambda: tf.Phi3Config(**COMMON)),
    "gemma": (tf.GemmaForCausalLM, lambda: tf.GemmaConfig(**COMMON, head_dim=24)),
    # Gemma-2: attention logit soft-capping, alternating sliding/full layers, query_pre_attn_scalar.
    "gemma2": (
        tf.Gemma2ForCausalLM,
        lambda: tf.Gemma2Config(**{**COMMON, "num_hidden_layers": 4}, head_dim=16, sliding_window=24, query_pre_attn_scalar=20),
    ),
    # Gemma-3: 5 sliding layers per full one.
    "gemma3": (
        tf.Gemma3ForCausalLM,
        lambda: tf.Gemma3TextConfig(**{**COMMON, "num_hidden_layers": 6}, head_dim=16, sliding_window=24),
    ),
}


def tiny_model(name: str, seed: int = 0, attn_implementation: str = "sdpa"):
    """A fresh tiny model in eval mode; Gemma-2 uses eager attention (sdpa refuses soft-capping)."""
    cls, make_config = ARCHITECTURES[name]
    torch.manual_seed(seed)
    config = make_config()
    if name == "gemma2" and attn_implementation == "sdpa":
        attn_implementation = "eager"
    config._attn_implementation = attn_implementation
    model = cls(config).eval()
    # Random init leaves logits nearly flat; widen them so greedy decoding is decisive and comparable.
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(8.0)
    return model


def prompts(batch: int, lengths: list[int], vocab: int = 97, seed: int = 0) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (1, n), generator=gen) for n in lengths[:batch]]


def left_pad(rows: list[torch.Tensor], pad_id: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Stack ``[1, n_b]`` prompts into ``[B, max n]`` with left padding, and its attention mask."""
    longest = max(r.shape[1] for r in rows)
    ids = torch.full((len(rows), longest), pad_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for b, r in enumerate(rows):
        ids[b, longest - r.shape[1] :] = r[0]
        mask[b, longest - r.shape[1] :] = 1
    return ids, mask


def greedy(model, ids, mask, cache=None, new_tokens: int = 64, **kwargs):
    """Greedy ``generate`` of exactly ``new_tokens`` tokens, with logits (the tests' common call)."""
    return model.generate(
        ids,
        attention_mask=mask,
        max_new_tokens=new_tokens,
        min_new_tokens=new_tokens,
        do_sample=False,
        **cache_kwargs(model, cache),
        output_logits=True,
        return_dict_in_generate=True,
        pad_token_id=0,
        **kwargs,
    )
