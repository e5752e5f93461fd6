"""Speed and quality in vLLM, compared as a user would: stock vLLM vs the plugin's dense path vs sparse methods.

The workload (:mod:`sparseattn.evaluation.serving_workload`): ``batch`` *distinct* prompts, each ``context``
tokens of a different CPython stdlib module (no shared prefix), with a pass-key comment line hidden in each at
its own depth (10% to 90%), and the file's true next tokens held back. A second, labelled workload (``shared``)
has every row read row 0's prompt followed by its own short line: what prefix caching makes of a shared document.

The engines (vLLM's ``LLM``, greedy, ``ignore_eos``, prefix caching on, as vLLM defaults):

* ``stock``: vLLM with no plugin involvement, in ``dtype`` (bfloat16 by default: what a user serves
  in on a CPU with bf16 support; vLLM picks its attention ISA itself, ``amx`` where the CPU has AMX):
  the reference every ratio divides by;
* ``stock float32`` (optional, labelled): the same in float32;
* one plugin engine that runs the plugin's ``dense`` path (every page through the paged engine: the
  kernel's gain over stock is ``dense / stock``) and each sparse method (its sparsity's gain is
  ``method / dense``), switched between measurements (:mod:`sparseattn.vllm.switch`): every method
  reads the same prefilled pages, so the prompts are prefilled once per engine, not once per method.

Speed: all engines are started and the prompts prefilled first; then ``rounds`` rounds, the runs in
alternating order (ABCD DCBA ...) so that the machine's drift meets every run alike. One measurement:
the batch generates 1 token (``t1``: prefill of each prompt's last, uncached page) and ``steps + 1``
tokens (``tN``); decode time per step is ``(tN - t1) / steps`` and throughput ``batch * steps / (tN -
t1)`` over all sequences. After a switch the plugin engine generates 2 tokens before it is timed, so
that page summaries (built at a prompt's first decode step, then kept with its cached pages) are
built outside the timing for every method alike. The median over rounds is reported with the
min and max.

Quality, at the same configuration (same prompts, batch, budget, dtype):

* ``prefix``: the share of the greedy tokens equal to stock's before the first difference (mean over
  prompts; compounds: one early near-tie ends it);
* ``top-1`` and ``ppl``: teacher forcing through the engine's decode steps
  (:mod:`sparseattn.vllm.forcing`): each prompt's true next ``held`` tokens are fed, one per decode step;
  ``ppl`` is the perplexity of those tokens (the first is predicted by prefill, vLLM's own kernel in
  every engine, so it is left out), ``top-1`` how often the engine's most likely next token is stock's
  at the same step (does not compound);
* ``passkey``: each prompt followed by a question about its pass key, the share of answers that
  contain it.

Run by ``sparseattn serving-bench``, ``benchmarks/serving.py`` and ``scripts/demo.sh``; vLLM is imported
only when :func:`run` is called (docs/serving.md, the venv). This module runs the measurements (:func:`run`, in
named steps); the runs and what they measured are :mod:`~sparseattn.evaluation.serving_runs`, the rows, table and
JSON :mod:`~sparseattn.evaluation.serving_results`, the step's profile :mod:`~sparseattn.evaluation.serving_profile`,
and the engine itself :mod:`~sparseattn.evaluation.vllm_engine`.
"""

from __future__ import annotations

import gc
import json
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from sparseattn.evaluation.serving_profile import profile_difference, step_profile
from sparseattn.evaluation.serving_results import result_rows
from sparseattn.evaluation.serving_runs import DISTINCT, SHARED, STOCK, STOCK_F32, Measured, Run
from sparseattn.evaluation.serving_workload import (ANSWER_TOKENS, MARGIN, Prompt, passkey_found, positions_needed, shared_prompts,
                                                    workload)  # fmt: skip
from sparseattn.evaluation.vllm_engine import (DEFAULT_BLOCK_SIZE, Forced, attention_isas, generate, machine_info, start_engine,
                                               stop_engine)  # fmt: skip

#: Where a step of :func:`run` says what it is doing (one line at a time).
Say = Callable[[str], None]


def option_problems(context: int, batch: int, steps: int, rounds: int, held: int, window: int | None = None) -> list[tuple[str, str]]:
    """``(option, problem)`` for every size that cannot run (empty: all can); ``window``: the model's positions."""
    problems = []
    if context < 64:
        problems.append(("--context", f"{context} is out of range; allowed: >= 64"))
    if not 1 <= batch <= 64:
        problems.append(("--batch", f"{batch} is out of range; allowed: 1 to 64"))
    if steps < 1:
        problems.append(("--steps", f"{steps} is out of range; allowed: >= 1 (timed decode steps)"))
    if rounds < 1:
        problems.append(("--runs", f"{rounds} is out of range; allowed: >= 1"))
    if held < 2:
        problems.append(("--held", f"{held} is out of range; allowed: >= 2 (the first is predicted by prefill, not scored)"))
    needed = positions_needed(context, steps, held)
    if window is not None and not problems and needed > window:
        problems.append((
            "--context / --steps",
            (f"--context {context} + max(--steps {steps} + 1, --held {held}) + {MARGIN} (the pass-key question) = {needed} "
             f"positions, beyond the model's {window}; allowed: --context + max(--steps + 1, --held) <= {window - MARGIN}"),
        ))
    return problems


@dataclass
class Engines:
    """The started engines by name (``stock``, ``stock float32``, ``plugin``), with the workloads they have prefilled.

    The plugin engine runs one method at a time: :meth:`switch` changes it between measurements.
    """

    workloads: Mapping[str, list[list[int]]]  #: workload name -> its prompts' token ids
    llms: dict[str, Any] = field(default_factory=dict)  #: engine name -> ``vllm.LLM``
    started: dict[str, float] = field(default_factory=dict)  #: engine start-up, seconds
    prefilled: dict[str, float] = field(default_factory=dict)  #: the workloads' prefill (and two decode steps), seconds
    plugin_label: str | None = None  #: the run whose method the plugin engine runs now

    def switch(self, run_: Run) -> Any:
        """The engine of ``run_``, the plugin's switched to its method (page summaries built outside the timing)."""
        from sparseattn.vllm.switch import use_method

        llm = self.llms[run_.engine]
        if run_.engine == "plugin" and self.plugin_label != run_.label:
            use_method(llm, dict(run_.method))
            self.plugin_label = run_.label
            for prompts in self.workloads.values():  # page summaries built outside the timing (module docstring)
                generate(llm, prompts, 2)
        return llm

    def fallbacks(self, run_: Run) -> int:
        """Decode layer-steps the plugin engine has left to vLLM's kernel so far (0 for stock engines)."""
        if run_.engine != "plugin":
            return 0
        return sum(self.llms["plugin"].collective_rpc("sparseattn_fallbacks"))

    def stop(self) -> None:
        """Shut every engine down and free its memory."""
        for llm in self.llms.values():
            stop_engine(llm)
        self.llms.clear()
        gc.collect()


def prompt_workloads(prompts: Sequence[Prompt], tokenizer, *, shared: bool, steps: int, max_model_len: int) -> dict[str, list[list[int]]]:
    """The token ids of each workload: the distinct prompts and, with ``shared``, the shared-prefix ones.

    Refused where the longest prompt with what is generated after it does not fit ``max_model_len``.
    """
    workloads = {DISTINCT: [r.ids for r in prompts]}
    if shared:
        workloads[SHARED] = shared_prompts(prompts, tokenizer)
    longest = max(len(p) for ids in workloads.values() for p in ids)
    if longest + max(steps + 1, len(prompts[0].question) + ANSWER_TOKENS) > max_model_len:
        raise ValueError(f"a prompt of {longest} tokens does not fit {max_model_len} positions: the margin is too small")
    return workloads


def describe_machine(runs: Sequence[Run], hf_config: Any, *, dtype: str, block_size: int | None, say: Say) -> dict[str, Any]:
    """The machine (:func:`~sparseattn.evaluation.vllm_engine.machine_info`), its read bandwidth (measured before any
    engine starts) and the attention ISA of each dtype the runs use, stock's and the plugin's."""
    info = machine_info()
    from sparseattn.bandwidth import machine_bandwidth

    say("measuring the machine's read bandwidth (1 and 2 threads; sequential and scattered chunks) ...")
    info["bandwidth"] = machine_bandwidth(repeats=3)
    page = block_size or DEFAULT_BLOCK_SIZE
    head = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads
    info["attention_isa"] = {d: attention_isas(d, page, head) for d in sorted({dtype, *(["float32"] if any(r.engine == STOCK_F32 for r in runs) else [])})}
    say(f"machine: {info.get('cpu')} ({', '.join(info.get('isa', []))}); vLLM {info['vllm']}; attention ISA {json.dumps(info['attention_isa'])}")
    return info


def start_engines(model: str, runs: Sequence[Run], workloads: Mapping[str, list[list[int]]], *, dtype: str, kv_cache_gib: int,
                  max_model_len: int, block_size: int | None, hf_overrides: Mapping[str, Any] | None, kv_cache_dtype: str,
                  say: Say) -> Engines:  # fmt: skip
    """Every engine the runs need, one after another, each with the workloads prefilled into its prefix cache.

    Stock float32 gets twice the KV cache (its numbers take twice the bytes); the plugin engine starts with the
    first plugin run's method.
    """
    engines = Engines(workloads)
    for name in dict.fromkeys(r.engine for r in runs):
        engine_dtype = "float32" if name == STOCK_F32 else dtype
        gib = kv_cache_gib * (2 if engine_dtype == "float32" and dtype != "float32" else 1)
        method = next(r.method for r in runs if r.engine == "plugin") if name == "plugin" else None
        say(f"{name}: starting vLLM ({engine_dtype}, KV cache {gib} GiB) and prefilling {sum(len(p) for p in workloads[DISTINCT])} prompt tokens ...")
        begin = time.perf_counter()
        engines.llms[name] = start_engine(
            model, dtype=engine_dtype, kv_cache_gib=gib, max_model_len=max_model_len, block_size=block_size, method=method,
            hf_overrides=hf_overrides, gpu_memory_utilization=0.2,  # host memory on the CPU platform: engines run side by side
            **({"kv_cache_dtype": kv_cache_dtype} if kv_cache_dtype != "auto" else {}),
        )  # fmt: skip
        ready = time.perf_counter()
        for prompts in workloads.values():
            generate(engines.llms[name], prompts, 2)  # prefill into the prefix cache, and a first decode step
        engines.started[name] = ready - begin
        engines.prefilled[name] = time.perf_counter() - ready
        say(f"{name}: started in {ready - begin:.0f} s, prompts prefilled in {time.perf_counter() - ready:.0f} s")
    return engines


def time_decode(llm, prompts: Sequence[Sequence[int]], steps: int) -> tuple[float, float, list[list[int]]]:
    """``(tokens/s over all sequences, ms per decode step, greedy tokens)`` of ``steps`` timed decode steps."""
    t1, _ = generate(llm, prompts, 1)
    tn, outs = generate(llm, prompts, steps + 1)
    decode = max(tn - t1, 1e-9)
    return len(prompts) * steps / decode, 1e3 * decode / steps, [list(o.token_ids) for o in outs]


def time_round(engines: Engines, order: Sequence[Run], measured: Mapping[tuple[str, str], Measured], steps: int, *,
               name: str, say: Say) -> None:  # fmt: skip
    """One round (``name``): each run in ``order`` timed on every workload, its fallbacks counted on the distinct one."""
    for run_ in order:
        llm = engines.switch(run_)
        before = engines.fallbacks(run_)
        for workload_name, prompts in engines.workloads.items():
            tok_s, ms, tokens = time_decode(llm, prompts, steps)
            m = measured[run_.label, workload_name]
            m.tok_s.append(tok_s)
            m.ms_step.append(ms)
            if m.tokens is None:
                m.tokens = tokens
            say(f"{name} {run_.label} [{workload_name}]: {tok_s:.1f} tok/s ({ms:.1f} ms/step)")
        measured[run_.label, DISTINCT].fallback_steps += engines.fallbacks(run_) - before


def profile_runs(engines: Engines, runs: Sequence[Run], measured: Mapping[tuple[str, str], Measured], steps: int, *, say: Say) -> None:
    """One more measurement of every plugin run on the distinct prompts, its decode steps timed part by part."""
    for run_ in runs:
        if run_.engine != "plugin":
            continue
        llm = engines.switch(run_)
        # As time_decode times it: the 1-token run (the prompts' uncached last pages prefilled) and the run of steps + 1
        # tokens, each profiled; the difference is the decode steps' (a mixed step's prefill included in both).
        timed = []
        for tokens in (1, steps + 1):
            llm.collective_rpc("sparseattn_profile", args=(True,))
            try:
                seconds, _ = generate(llm, engines.workloads[DISTINCT], tokens)
            finally:
                timed.append((seconds, llm.collective_rpc("sparseattn_profile", args=(False,))[0]))
        (t1, one), (tn, many) = timed
        m = measured[run_.label, DISTINCT]
        m.profile = step_profile(profile_difference(many, one), 1e3 * max(tn - t1, 1e-9) / steps, steps)
        say(f"profile {run_.label}: " + ", ".join(f"{p['part']} {p['ms']:.1f}" for p in m.profile["parts"]) + " ms/step")


def measure_quality(engines: Engines, runs: Sequence[Run], prompts: Sequence[Prompt], tokenizer, measured: Mapping[tuple[str, str], Measured],
                    held: int, *, say: Say) -> None:  # fmt: skip
    """Every run's quality on the distinct prompts: the held tokens teacher-forced, then the pass-key question."""
    for run_ in runs:
        llm = engines.switch(run_)
        before = engines.fallbacks(run_)
        m = measured[run_.label, DISTINCT]
        _, outs = generate(llm, [r.ids for r in prompts], held, forced=[r.held for r in prompts], logprobs=1)
        m.forced = Forced.from_outputs(outs, [r.held for r in prompts])
        _, outs = generate(llm, [r.ids + r.question for r in prompts], ANSWER_TOKENS)
        m.answers = [tokenizer.decode(o.token_ids) for o in outs]
        m.passkey = passkey_found(m.answers, prompts)
        m.fallback_steps += engines.fallbacks(run_) - before
        say(f"quality {run_.label}: ppl {m.forced.ppl():.3f}, pass keys {m.passkey:.0%} ({', '.join(repr(a) for a in m.answers)})")


def run(
    model: str,
    runs: Sequence[Run],
    *,
    context: int,
    batch: int,
    steps: int,
    rounds: int,
    held: int = 32,
    shared: bool = False,
    dtype: str = "bfloat16",
    kv_cache_gib: int = 3,
    block_size: int | None = None,
    hf_overrides: Mapping[str, Any] | None = None,
    say: Say = print,
    checkpoint: Callable[[dict[str, Any], list[dict[str, Any]]], None] | None = None,
    texts: Sequence[str] | None = None,
    profile: bool = False,
    kv_cache_dtype: str = "auto",
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """Start the engines, time every run on every workload in alternation, then measure quality: ``(machine, rows)``.

    ``model``: a local HF directory. ``runs``: :func:`~sparseattn.evaluation.serving_runs.plan_runs`.
    ``checkpoint(machine, rows)`` is called with the rows so far after every round and at the end (results are
    written as they come). ``profile``: after the rounds, one more measurement of every plugin run with its decode
    steps timed part by part (:func:`~sparseattn.evaluation.serving_profile.step_profile`). The machine's read
    bandwidth is measured before any engine starts (:func:`sparseattn.bandwidth.machine_bandwidth`) and recorded with
    the machine. ``kv_cache_dtype``: every engine's KV cache (vLLM's ``kv_cache_dtype``: ``"auto"``, the model's
    dtype, or ``"fp8"`` ... : the memory tier).
    """
    if not runs or runs[0].label != STOCK:
        raise ValueError(f"the first run must be {STOCK!r}, the reference; got {[r.label for r in runs]}")
    from transformers import AutoConfig, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model)
    hf_config = AutoConfig.from_pretrained(model)
    prompts = workload(tokenizer, batch, context, held, texts=texts)
    max_model_len = positions_needed(context, steps, held)
    workloads = prompt_workloads(prompts, tokenizer, shared=shared, steps=steps, max_model_len=max_model_len)
    info = describe_machine(runs, hf_config, dtype=dtype, block_size=block_size, say=say)
    say(f"workload: {batch} distinct prompts of {context} tokens ({', '.join(r.source for r in prompts)}), pass keys at depths "
        f"{', '.join(f'{r.depth:.0f}%' for r in prompts)}" + ("; plus the shared-prefix workload" if shared else ""))
    engines = start_engines(model, runs, workloads, dtype=dtype, kv_cache_gib=kv_cache_gib, max_model_len=max_model_len,
                            block_size=block_size, hf_overrides=hf_overrides, kv_cache_dtype=kv_cache_dtype, say=say)  # fmt: skip
    measured = {(r.label, w): Measured() for r in runs for w in workloads}

    def rows_now() -> list[dict[str, Any]]:
        return result_rows(runs, measured, workloads, hf_config, batch=batch, context=context, steps=steps, dtype=dtype,
                           started=engines.started, prefilled=engines.prefilled, block_size=block_size, hf_overrides=hf_overrides,
                           prompts=prompts, kv_cache_dtype=kv_cache_dtype)  # fmt: skip

    for r in range(rounds):  # in alternating order (module docstring)
        time_round(engines, runs if r % 2 == 0 else runs[::-1], measured, steps, name=f"round {r + 1}/{rounds}", say=say)
        if checkpoint:
            checkpoint(info, rows_now())
    if profile:
        profile_runs(engines, runs, measured, steps, say=say)
    measure_quality(engines, runs, prompts, tokenizer, measured, held, say=say)
    engines.stop()
    rows = rows_now()
    if checkpoint:
        checkpoint(info, rows)
    return info, rows
