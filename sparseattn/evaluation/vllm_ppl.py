"""Perplexity through vLLM's own decode steps: ``sparseattn ppl --engine vllm``, the protocol of :mod:`sparseattn.evaluation.ppl`.

The same ids, prefill and steps as :func:`sparseattn.evaluation.ppl.run_ppl`, decoded by a vLLM engine
whose decode attention is the sparseattn plugin's paged engine running the method (docs/serving.md),
teacher-forced (:mod:`sparseattn.vllm.forcing`). One request per method:

* prompt ``ids[:prefill]``, prefilled by vLLM's own kernel (dense, as the transformers engine prefills);
* forced tokens ``ids[prefill : prefill + steps + 1]``, ``max_tokens = steps + 1``, ``logprobs=1``.

Alignment. vLLM's prefill computes the logits at position ``prefill - 1``, which predict output 0
(forced to ``ids[prefill]``): that logprob comes from prefill, not from a decode step, and is dropped.
Output ``k >= 1`` comes from the decode step that fed output ``k - 1``, that is ``ids[prefill + k - 1]``,
at position ``prefill + k - 1``, and scores ``ids[prefill + k]``: the transformers engine's step
``i = k - 1`` (feeds token ``prefill + i``, scores token ``prefill + i + 1``). So outputs ``1 ..
steps`` are the ``steps`` records, the NLLs of tokens ``prefill + 1 .. prefill + steps``
(:func:`forced_request`, :func:`records`). ``prefill`` must be >= 1: vLLM needs a prompt.

One engine serves every method of a call (one dtype, one block size): it starts with the first
method and is switched between requests (:mod:`sparseattn.vllm.switch`). The prompt is prefilled once
and then found in vLLM's prefix cache, so every method decodes over the same prefilled pages.

What is recorded per step is what a completed request holds: the NLL and the engine's top-1 token.
vLLM returns a request's tokens together, so a step's time and the KV tokens a step attended are not
seen: ``seconds``, ``elapsed`` and ``attended`` are NaN in every record, and the summary's
``tokens_per_second`` is the request's decode rate (its time less a one-token request's, as the serving
benchmark times: both read the cached prompt), after one forced step of warm-up per engine (the engine's
first forced request runs 5x slower than the next ones; a quality measurement, not a benchmark:
``sparseattn serving-bench`` times). The summary also holds ``fallback_layer_steps``: decode
layer steps the plugin left to vLLM's dense kernel (0 when the method ran every step).

Run directories are those of :class:`~sparseattn.evaluation.runs.RunDir`: a finished run is skipped
(no engine is started when all are); an unfinished one is redone from scratch (its records are cut and
written anew: the request is one unit, there are no steps to replay).

vLLM is imported only inside the functions that start or drive an engine, so this module imports
without it.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from sparseattn.evaluation.runs import RunDir, environment
from sparseattn.evaluation.vllm_engine import DEFAULT_BLOCK_SIZE, Forced, generate, start_engine, stop_engine

#: The KV cache (GiB, ``VLLM_CPU_KVCACHE_SPACE``) when ``--kv-cache-gib`` is not given: one sequence of a few
#: thousand tokens needs far less.
DEFAULT_KV_CACHE_GIB = 2
#: Teacher forcing needs no compiled graphs: an eager engine skips the compile minute (it started in 37 s on
#: 2 cores, compiled ones in 65-81 s) and runs the reference code path.
ENFORCE_EAGER = True

__all__ = ["DEFAULT_BLOCK_SIZE", "DEFAULT_KV_CACHE_GIB", "forced_request", "records", "run_ppl_vllm"]


def forced_request(ids: Sequence[int], prefill: int, steps: int) -> tuple[list[int], list[int]]:
    """``(prompt, forced)``: ``ids[:prefill]`` and the ``steps + 1`` tokens forced after it (module docstring).

    >>> forced_request([10, 11, 12, 13, 14, 15], prefill=2, steps=3)
    ([10, 11], [12, 13, 14, 15])
    """
    if prefill < 1:
        raise ValueError(f"prefill {prefill} is out of range; allowed: >= 1 (vLLM needs a prompt)")
    if steps < 1 or len(ids) < prefill + steps + 1:
        raise ValueError(f"need prefill + steps + 1 = {prefill + steps + 1} token ids and steps >= 1, got {len(ids)} ids, steps {steps}")
    return [int(t) for t in ids[:prefill]], [int(t) for t in ids[prefill : prefill + steps + 1]]


def records(ids: Sequence[int], prefill: int, steps: int, logprobs: Sequence[float], top1: Sequence[int]) -> list[dict[str, Any]]:
    """One record per decode step from a forced request's ``steps + 1`` logprobs and top-1 tokens.

    Output 0 (predicted by prefill) is dropped; output ``k`` is step ``k - 1``, scoring token ``prefill + k``:

    >>> rs = records([10, 11, 12, 13, 14, 15], 2, 3, [-9.0, -1.0, -2.0, -3.0], [12, 13, 7, 15])
    >>> [(r["position"], r["token"], r["nll"], r["top1"], r["context"]) for r in rs]
    [(3, 13, 1.0, 13, 3), (4, 14, 2.0, 7, 4), (5, 15, 3.0, 15, 5)]
    """
    if len(logprobs) != steps + 1 or len(top1) != steps + 1:
        raise ValueError(f"a forced request of {steps} steps returns {steps + 1} logprobs, got {len(logprobs)} and {len(top1)} top-1 tokens")
    nan = float("nan")
    return [
        {"position": prefill + k, "token": int(ids[prefill + k]), "nll": -float(logprobs[k]), "top1": int(top1[k]),
         "context": prefill + k, "seconds": nan, "elapsed": nan, "attended": nan}
        for k in range(1, steps + 1)
    ]  # fmt: skip


def run_ppl_vllm(
    model: str,
    runs: Mapping[str, tuple[Mapping[str, Any], RunDir]],
    ids: Sequence[int],
    prefill: int,
    steps: int,
    *,
    dtype: str = "float32",
    block_size: int = DEFAULT_BLOCK_SIZE,
    kv_cache_gib: int = DEFAULT_KV_CACHE_GIB,
    llm: Any = None,
    say: Callable[[str], None] = print,
) -> dict[str, dict[str, Any]]:
    """Run (or skip) one perplexity measurement per method through vLLM; returns the summaries by label.

    Args:
        model: a local HF directory.
        runs: ``label -> (plugin config, run directory)``; the config is ``additional_config["sparseattn"]``
            (``{"method": "radar+", "budget": 512}``), checked beforehand by
            :class:`~sparseattn.vllm.paged.PagedPolicy` (the CLI does).
        ids: ``[prefill + steps + 1]`` token ids, the ground truth.
        prefill: prompt tokens (>= 1), prefilled by vLLM's kernel.
        steps: decode steps; step i feeds token ``prefill + i`` and scores token ``prefill + i + 1``.
        dtype, block_size, kv_cache_gib: the engine's (started here, one for all methods, shut down after).
        llm: an engine to use instead (started with :func:`sparseattn.evaluation.vllm_engine.start_engine` and a
            ``method``, so that it switches; the caller's dtype and block size, left running).
    """
    ids = [int(t) for t in ids]
    forced_request(ids, prefill, steps)  # the sizes checked before an engine starts
    pending = {label: (config, run) for label, (config, run) in runs.items() if not run.finished}
    if pending:
        _measure(model, pending, ids, prefill, steps, dtype=dtype, block_size=block_size,
                 kv_cache_gib=kv_cache_gib, llm=llm, say=say)  # fmt: skip
    return {label: run.summary() for label, (_, run) in runs.items()}


def _measure(model, pending, ids, prefill, steps, *, dtype, block_size, kv_cache_gib, llm, say) -> None:
    """Start (or use) the engine, prefill the prompt once, then one forced request per method; finish each run."""
    import vllm

    from sparseattn.vllm.switch import use_method

    prompt, forced = forced_request(ids, prefill, steps)
    own = llm is None
    if own:
        first = next(iter(pending.values()))[0]
        say(f"starting vLLM ({dtype}, block size {block_size}, KV cache {kv_cache_gib} GiB, eager) ...")
        begin = time.perf_counter()
        llm = start_engine(model, dtype=dtype, kv_cache_gib=kv_cache_gib, max_model_len=prefill + steps + 1,
                           block_size=block_size, method=first, enforce_eager=ENFORCE_EAGER)  # fmt: skip
        say(f"vLLM started in {time.perf_counter() - begin:.0f} s")
    try:
        prefill_seconds, _ = generate(llm, [prompt], 1)  # the prompt into the prefix cache, for every method
        generate(llm, [prompt], 2, forced=[forced[:2]], logprobs=1)  # a first forced decode step: its one-time warm-up untimed
        say(f"prompt of {prefill} tokens prefilled in {prefill_seconds:.1f} s")
        for label, (config, run) in pending.items():
            say(f"{label}: {steps} teacher-forced decode steps ...")
            use_method(llm, dict(config))
            before = sum(llm.collective_rpc("sparseattn_fallbacks"))
            one, _ = generate(llm, [prompt], 1)  # the cached prompt's own cost, taken off the forced request's
            seconds, outs = generate(llm, [prompt], steps + 1, forced=[forced], logprobs=1)
            fallbacks = sum(llm.collective_rpc("sparseattn_fallbacks")) - before
            result = Forced.from_outputs(outs, [forced])
            rows = records(ids, prefill, steps, result.logprobs[0], result.top1[0])
            (run.path / "tokens.jsonl").write_text("")  # an unfinished run is redone from scratch
            with run.appender("tokens.jsonl") as out:
                for row in rows:
                    out.write(row)
            nlls = [r["nll"] for r in rows]
            decode = seconds - one
            run.finish({
                **run.config, "ppl": math.exp(sum(nlls) / len(nlls)), "mean_nll": sum(nlls) / len(nlls), "n_tokens": len(nlls),
                "seconds": decode, "batch": 1, "tokens_per_second": steps / decode if decode > 0 else float("nan"),
                "prefill_seconds": prefill_seconds, "mean_attended_tokens": float("nan"),
                "mean_context_tokens": sum(r["context"] for r in rows) / len(rows),
                "top1_is_target": sum(r["top1"] == r["token"] for r in rows) / len(rows), "fallback_layer_steps": fallbacks,
                "kv_cache_gib": kv_cache_gib if own else None, "enforce_eager": ENFORCE_EAGER if own else None,
                "vllm": vllm.__version__, "environment": environment(),
            })  # fmt: skip
    finally:
        if own:
            stop_engine(llm)
