"""A tiny random Llama with a character tokenizer, saved as a local HF directory (safetensors) for CLI tests."""

from __future__ import annotations

import string
from pathlib import Path

import tokenizers
import torch
import transformers as tf

SPECIALS = ["<pad>", "<s>", "</s>", "<unk>"]
CHARS = list(string.printable)


def char_tokenizer() -> tf.PreTrainedTokenizerFast:
    vocab = {tok: i for i, tok in enumerate(SPECIALS + CHARS)}
    model = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<unk>"))
    model.pre_tokenizer = tokenizers.pre_tokenizers.Split(tokenizers.Regex(r"[\s\S]"), behavior="isolated")
    model.decoder = tokenizers.decoders.Fuse()
    return tf.PreTrainedTokenizerFast(
        tokenizer_object=model, pad_token="<pad>", bos_token="<s>", eos_token="</s>", unk_token="<unk>", model_max_length=4096
    )


def save_tiny_checkpoint(path: Path, seed: int = 0) -> Path:
    tokenizer = char_tokenizer()
    torch.manual_seed(seed)
    config = tf.LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=48, intermediate_size=96, num_hidden_layers=2, num_attention_heads=6,
        num_key_value_heads=2, max_position_embeddings=4096, pad_token_id=0, bos_token_id=1, eos_token_id=2,
    )
    model = tf.LlamaForCausalLM(config).eval()
    model.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    return path
