"""One vLLM engine in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``), for tests that must reach inside it.

Run as a script by tests/test_vllm_robustness.py, one fresh process per engine (vLLM's plugins and
``sparseattn.vllm.backend``'s classes load once per process): ``python tests/vllm_inprocess.py CONFIG``
with a JSON config:

``engine``
    keyword arguments of ``vllm.LLM`` (the default model is the model);
``batches``
    lists of prompts (token ids), generated one batch after another in the same engine (a second batch
    of the same prompt finds it in the prefix cache); each batch may set ``fail``: before it, the paged
    engine's decode step is made to raise for its next ``fail`` calls (-1: every call), as a bug or an
    unforeseen shape would;
``fake_isa``
    the ISA vLLM's CPU backend is told it picked on this CPU (vLLM's ``_get_attn_isa`` replaced);
``new_tokens``, ``logprobs``
    per request.

Prints one JSON line last: per batch, each request's tokens and its first token's logprob; and the
process's :data:`sparseattn.vllm.backend.FALLBACKS` counts.
"""

from __future__ import annotations

import json
import os
import sys

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")


class Injected(RuntimeError):
    """The failure a test injects into the paged engine's decode step."""


def main(config: dict) -> dict:
    from vllm import LLM, SamplingParams

    import sparseattn.vllm.backend as backend
    import sparseattn.vllm.paged as paged
    import sparseattn.vllm.paged_kernel as paged_kernel
    from sparseattn.hf.models import local_model_dir

    if config.get("fake_isa"):
        import vllm.v1.attention.backends.cpu_attn as cpu_attn

        cpu_attn._get_attn_isa = lambda *args, **kwargs: config["fake_isa"]
    failing = {"left": 0}

    def failing_step(real):
        def step(*args, **kwargs):
            if failing["left"]:
                failing["left"] -= 1 if failing["left"] > 0 else 0
                raise Injected("injected failure (test): the paged engine's decode step raised")
            return real(*args, **kwargs)

        return step

    # Replaced before the backend's classes are built (they import these on first use, in this process).
    paged_kernel.fused_decode = failing_step(paged_kernel.fused_decode)
    paged.select_pages = failing_step(paged.select_pages)
    llm = LLM(model=str(local_model_dir()), **config["engine"])
    params = SamplingParams(temperature=0, max_tokens=config.get("new_tokens", 8), ignore_eos=True, logprobs=config.get("logprobs", 1))
    results = []
    for batch in config["batches"]:
        failing["left"] = batch.get("fail", 0)
        outs = llm.generate([{"prompt_token_ids": p} for p in batch["prompts"]], params)
        results.append([
            {"tokens": list(o.outputs[0].token_ids),
             "first_logprob": o.outputs[0].logprobs[0][o.outputs[0].token_ids[0]].logprob if o.outputs[0].logprobs else None}
            for o in outs
        ])  # fmt: skip
    counts = backend.FALLBACKS
    return {"batches": results, "fallbacks": counts.total, "answered": counts.answered_steps, "causes": counts.causes}


if __name__ == "__main__":
    print(json.dumps(main(json.loads(sys.argv[1]))), flush=True)
