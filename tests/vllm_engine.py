"""Running the default model in vLLM for the end-to-end tests: one fresh engine per call, its log kept."""

import contextlib
import gc
import os
import sys
from pathlib import Path

from sparseattn.hf.models import local_model_dir

#: Engine arguments every test engine takes. On the CPU platform ``gpu_memory_utilization`` is the share of
#: NUMA node 0's memory the worker insists is free at start (vLLM's default 0.92 fails once the page cache
#: holds a few GiB there); the KV cache itself is sized by ``VLLM_CPU_KVCACHE_SPACE``.
HOST = {"gpu_memory_utilization": 0.5}


def skip_unless_vllm_cpu() -> None:
    """Skip the calling module unless vLLM is installed and runs on its CPU platform (the one the plugin
    serves so far), saying which is missing."""
    import pytest

    pytest.importorskip("vllm", reason="vLLM is not installed: run `bash scripts/vllm-venv.sh` and use .venv-vllm (docs/serving.md)")
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        pytest.skip(f"needs vLLM's CPU platform: sparseattn's vLLM backend is CPU-only so far, this is {current_platform.device_name} "
                    "(a GPU backend is not built: no GPU was lent to develop it)", allow_module_level=True)


@contextlib.contextmanager
def fd_log(path: Path):
    """Send this process's stdout/stderr (and those of the engine processes it spawns) to ``path``."""
    saved = [os.dup(1), os.dup(2)]
    with open(path, "w") as log:
        sys.stdout.flush(), sys.stderr.flush()
        os.dup2(log.fileno(), 1), os.dup2(log.fileno(), 2)
        try:
            yield
        finally:
            sys.stdout.flush(), sys.stderr.flush()
            os.dup2(saved[0], 1), os.dup2(saved[1], 2)
            for fd in saved:
                os.close(fd)


def greedy_tokens(log: Path, prompts: list, engine: dict, new_tokens: int, *, ignore_eos: bool = False, cache_gib: str = "2") -> tuple[list[list[int]], str]:
    """Greedy tokens of every prompt (text, or ``{"prompt_token_ids": [...]}``), all in one batch, from a
    fresh ``LLM(model=<default model>, **engine)`` shut down after, and the engine's log (kept at ``log``)."""
    outs, text = greedy_outputs(log, prompts, engine, new_tokens, ignore_eos=ignore_eos, cache_gib=cache_gib)
    return [tokens for tokens, _ in outs], text


def greedy_outputs(log: Path, prompts: list, engine: dict, new_tokens: int, *, top: int = 0, ignore_eos: bool = False,
                   cache_gib: str = "2") -> tuple[list[tuple[list[int], list[set[int]]]], str]:
    """As :func:`greedy_tokens`, each prompt's tokens with, at every position, the ``top`` most likely token
    ids (vLLM's ``logprobs``; empty sets when ``top`` is 0)."""
    from vllm import LLM, SamplingParams

    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", cache_gib)
    params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=ignore_eos, logprobs=top or None)
    with fd_log(log):
        llm = LLM(model=str(local_model_dir()), **{**HOST, **engine})
        outs = llm.generate(prompts, params)
        del llm
        gc.collect()
    result = []
    for o in outs:
        tokens = list(o.outputs[0].token_ids)
        ranked = [set(position) for position in o.outputs[0].logprobs] if top else [set() for _ in tokens]
        result.append((tokens, ranked))
    return result, log.read_text()


def first_divergences_are_near_ties(a: list[tuple[list[int], list[set[int]]]], b: list[tuple[list[int], list[set[int]]]]) -> list[str]:
    """Greedy outputs of two engines compared as bfloat16 allows (vLLM's own tests do the same): equal up to
    each sequence's first differing position, and there each engine's token is among the other's most likely
    ones (a near-tie flipped by rounding, not a wrong attention). Every sequence that breaks this, described;
    sequences are not compared after their first divergence (they continue from different text)."""
    problems = []
    for row, ((tokens_a, top_a), (tokens_b, top_b)) in enumerate(zip(a, b, strict=True)):
        if len(tokens_a) != len(tokens_b):
            problems.append(f"sequence {row}: {len(tokens_a)} tokens against {len(tokens_b)}")
            continue
        for i, (x, y) in enumerate(zip(tokens_a, tokens_b)):
            if x != y:
                if x not in top_b[i] or y not in top_a[i]:
                    problems.append(f"sequence {row}, token {i}: {x} (top {sorted(top_a[i])}) against {y} (top {sorted(top_b[i])})")
                break
    return problems
