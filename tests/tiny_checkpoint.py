"""A tiny random Llama with a character tokenizer, saved as a local HF directory (safetensors) for CLI tests."""

from sparseattn.testing import char_tokenizer, save_tiny_checkpoint

__all__ = ["char_tokenizer", "save_tiny_checkpoint"]
