"""One vLLM engine in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``), for tests that must reach inside it.

Run as a script by tests/test_vllm_robustness.py, one fresh process per engine (vLLM's plugins and
its choice of attention backend load once per process): ``python tests/vllm_inprocess.py CONFIG``
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
engine's fallback counts (its metadata builders' :class:`sparseattn.vllm.step.Fallbacks`).
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

    # Replaced where the backend's impl looks them up (the engine runs in this process).
    backend.fused_decode = failing_step(backend.fused_decode)
    backend.choose_pages = failing_step(backend.choose_pages)
    from vllm_engine import HOST  # this script's folder is on sys.path: it runs as `python tests/vllm_inprocess.py`

    llm = LLM(model=str(local_model_dir()), **{**HOST, **config["engine"]})
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
    return {"batches": results, **llm.collective_rpc(fallback_counts)[0]}


def fallback_counts(worker) -> dict:
    """The worker's fallback counts, summed over its sparse metadata builders (none in a stock engine)."""
    from sparseattn.vllm.backend import sparse_builders

    counts = [builder.fallbacks for builder in sparse_builders(worker.model_runner)]
    causes: dict[str, int] = {}
    for count in counts:
        for cause, n in count.causes.items():
            causes[cause] = causes.get(cause, 0) + n
    return {"fallbacks": sum(c.total for c in counts), "answered": sum(c.answered_steps for c in counts), "causes": causes}


if __name__ == "__main__":
    print(json.dumps(main(json.loads(sys.argv[1]))), flush=True)
