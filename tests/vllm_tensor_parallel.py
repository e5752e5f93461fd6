"""A tensor-parallel vLLM engine over a small random Llama, for tests/test_vllm_robustness.py (a script: vLLM's
plugins load once per process, and each engine needs its own).

``python tests/vllm_tensor_parallel.py MODEL_DIR TP SPEC_JSON``: writes a random Llama (4 query / 2 KV heads
of 64, 2 layers, float32; its output layer scaled so that greedy tokens are far from ties) to ``MODEL_DIR``
if it is not there, generates 16 greedy tokens for two prompts of random ids (300 and 520 tokens) with
``tensor_parallel_size=TP`` and the sparseattn method ``SPEC_JSON`` (``additional_config``), and prints
``RESULT <json token lists>``. With TP=2 each rank holds one KV head (the default model's 9 query heads
cannot be split in two: vLLM refuses TP=2 for it).
"""

from __future__ import annotations

import json
import os
import sys

import torch


def write_model(path: str) -> None:
    import transformers as tf

    torch.manual_seed(0)
    config = tf.LlamaConfig(
        vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=64, max_position_embeddings=2048, bos_token_id=1, eos_token_id=2, pad_token_id=0,
    )  # fmt: skip
    model = tf.LlamaForCausalLM(config)
    with torch.no_grad():
        model.lm_head.weight.mul_(30.0)
    model.save_pretrained(path, safe_serialization=True)


if __name__ == "__main__":
    path, tp, spec = sys.argv[1], int(sys.argv[2]), json.loads(sys.argv[3])
    if not os.path.exists(os.path.join(path, "config.json")):
        write_model(path)
    from vllm import LLM, SamplingParams

    gen = torch.Generator().manual_seed(1)
    prompts = [{"prompt_token_ids": torch.randint(3, 512, (n,), generator=gen).tolist()} for n in (300, 520)]
    from vllm_engine import HOST  # this script's folder is on sys.path: it runs as `python tests/vllm_tensor_parallel.py`

    llm = LLM(model=path, **HOST, skip_tokenizer_init=True, dtype="float32", tensor_parallel_size=tp, max_model_len=1024,
              enforce_eager=True, seed=0, additional_config={"sparseattn": spec})  # fmt: skip
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, detokenize=False))
    print("RESULT", json.dumps([list(o.outputs[0].token_ids) for o in outs]), flush=True)
