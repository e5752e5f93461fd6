"""Perplexity with decode-time attention: the Radar paper's Sec. 4.1 protocol (and StreamingLLM's).

Prefill the first ``prefill`` tokens densely as a prompt, then feed the ground-truth tokens one by
one through the method's decode path, recording each next-token NLL and the elapsed decode time.
``prefill = 0`` is the paper's "generation without prompts": every token is a decode step.

``ids`` may hold several rows (``[B, T]``, no padding: equal lengths) decoded as one batch; a step's
record then holds every row's NLL, and tokens/s counts the tokens of all rows.

Records go to ``tokens.jsonl`` in the run directory as they are computed. An interrupted run resumes
by replaying the recorded steps (decode is deterministic; each replayed NLL is checked against the
record) and continuing; a finished run is skipped.
"""

from __future__ import annotations

import contextlib
import inspect
import math
import time
from typing import Any

import torch

from sparseattn.evaluation.runs import RunDir, environment
from sparseattn.hf import apply, cache_kwargs
from sparseattn.hf.cache import SparseCache
from sparseattn.progress import forward_progress
from sparseattn.progress import progress as show_progress

#: A replayed step must reproduce its recorded NLL this closely (same machine, same threads).
REPLAY_TOLERANCE = 1e-3


def tokenize(tokenizer, text: str, n_tokens: int, name: str = "text") -> torch.Tensor:
    """The first ``n_tokens`` token ids of ``text`` as ``[n_tokens]``; an error if the text is shorter."""
    # Tokenize a prefix when it is surely enough (books are long); the whole text otherwise.
    for chunk in (text[: 16 * n_tokens], text):
        ids = tokenizer(chunk, return_tensors="pt", add_special_tokens=True, verbose=False)["input_ids"][0]
        if ids.numel() >= n_tokens or len(chunk) == len(text):
            break
    if ids.numel() < n_tokens:
        raise ValueError(f"{name} has {ids.numel()} tokens, fewer than the {n_tokens} this run needs")
    return ids[:n_tokens]


def step_attended(cache: SparseCache) -> float:
    """The KV tokens the last decode step attended, mean over the layers that decoded (NaN before any step)."""
    layers = [layer for layer in cache.sparse_layers if layer.stats.history]
    return sum(layer.stats.history[-1] for layer in layers) / len(layers) if layers else float("nan")


def run_ppl(
    model,
    method,
    ids: torch.Tensor,
    prefill: int,
    steps: int,
    run: RunDir,
    *,
    label: str = "ppl",
    progress: bool = True,
) -> dict[str, Any]:
    """Run (or resume, or skip) one perplexity measurement; returns the summary.

    Args:
        model: a transformers causal LM.
        method: the sparse method (``Dense()`` for vanilla attention).
        ids: ``[prefill + steps + 1]`` token ids (the ground truth), or ``[B, prefill + steps + 1]`` for
            B sequences decoded together (ppl is then over every row's tokens).
        prefill: prompt tokens prefilled densely (0: every token is decoded).
        steps: decode steps; step i feeds token ``prefill + i`` and scores token ``prefill + i + 1``.
        run: the run directory (its config must describe all of the above).
    """
    return run_ppl_together(model, {label: (method, run)}, ids, prefill, steps, progress=progress)[label]


def run_ppl_together(
    model,
    runs: dict[str, tuple[Any, RunDir]],
    ids: torch.Tensor,
    prefill: int,
    steps: int,
    *,
    progress: bool = True,
) -> dict[str, dict[str, Any]]:
    """:func:`run_ppl` for several methods on the same tokens, their decode steps interleaved.

    Every method gets its own cache and prefill; then each step is run for every method in turn (the
    order rotating from step to step). A shared machine's speed drifts over seconds to minutes, so
    methods measured one after the other are not comparable; interleaved, each meets the same drift.
    Each method keeps its own run directory (``runs[label] = (method, run)``): finished ones are
    skipped, unfinished ones resumed by replay, as :func:`run_ppl` does. Returns the summaries by label.
    """
    if ids.dim() not in (1, 2) or ids.shape[-1] < prefill + steps + 1 or ids.numel() == 0:
        raise ValueError(
            f"need [prefill + steps + 1] = [{prefill + steps + 1}] token ids (or [B, {prefill + steps + 1}]), "
            f"got shape {tuple(ids.shape)}"
        )
    rows = ids.reshape(-1, ids.shape[-1])  # [B, T]
    window = getattr(model.config, "max_position_embeddings", None)
    if window is not None and prefill + steps + 1 > window:
        raise ValueError(
            f"prefill {prefill} + steps {steps} exceeds the model's {window} positions; use fewer steps or a shorter prefill"
        )
    pending = {label: (method, run) for label, (method, run) in runs.items() if not run.finished}
    if pending:
        rows = rows.to(model.device)
        done = {label: run.records("tokens.jsonl") for label, (_, run) in pending.items()}
        for label, records in done.items():
            if len(records) > steps:
                raise ValueError(f"{pending[label][1].path}/tokens.jsonl has {len(records)} records, more than the {steps} steps configured")
        prefill_seconds = _decode_together(model, pending, done, rows, prefill, steps, progress)
    summaries = {}
    for label, (_, run) in runs.items():
        if run.finished:
            summaries[label] = run.summary()
            continue
        records = run.records("tokens.jsonl")
        nlls = [r["nll"] for r in records]
        seconds = sum(r["seconds"] for r in records)
        attended = [r["attended"] for r in records if not math.isnan(r["attended"])]
        summaries[label] = {
            **run.config,
            "ppl": math.exp(sum(nlls) / len(nlls)),
            "mean_nll": sum(nlls) / len(nlls),
            "n_tokens": len(nlls),
            "seconds": seconds,
            "batch": rows.shape[0],
            "tokens_per_second": rows.shape[0] * len(nlls) / seconds if seconds else float("nan"),
            "prefill_seconds": prefill_seconds[label],
            "mean_attended_tokens": sum(attended) / len(attended) if attended else float("nan"),
            "mean_context_tokens": sum(r["context"] for r in records) / len(records),
            "interleaved_with": sorted(set(runs) - {label}),
            "environment": environment(),
        }
        run.finish(summaries[label])
    return summaries


def _decode_together(model, pending, done, rows, prefill, steps, progress) -> dict[str, float]:
    """Prefill every pending method's cache, then decode step by step, one method after the other."""
    # Prefill logits are never scored: ask for the last position's only (a [B, T, vocab] tensor otherwise).
    keep_last = {"logits_to_keep": 1} if "logits_to_keep" in inspect.signature(model.forward).parameters else {}
    labels = list(pending)
    first_method = pending[labels[0]][0]
    with apply(model, first_method), torch.no_grad(), contextlib.ExitStack() as stack:
        outs = {label: stack.enter_context(run.appender("tokens.jsonl")) for label, (_, run) in pending.items()}
        caches, prefill_seconds = {}, {}
        for label, (method, _) in pending.items():  # each cache carries its own method
            caches[label] = SparseCache(method, config=model.config)
            start = time.perf_counter()
            if prefill:
                # A prefill of thousands of tokens takes a minute on a CPU: show it is moving (layers done).
                size = f"{prefill} tokens" if rows.shape[0] == 1 else f"{rows.shape[0]} x {prefill} tokens"
                with forward_progress(model, f"{label}: prefill {size}", enabled=progress):
                    model(rows[:, :prefill], **cache_kwargs(model, caches[label]), use_cache=True, **keep_last)
            prefill_seconds[label] = time.perf_counter() - start
        elapsed = {label: records[-1]["elapsed"] if records else 0.0 for label, records in done.items()}
        title = labels[0] if len(labels) == 1 else f"{len(labels)} methods"
        todo = steps * len(labels) - sum(map(len, done.values()))
        with show_progress(f"{title}: decode", total=todo, unit="steps", enabled=progress) as bar:
            for i in range(steps):
                position = prefill + i
                for label in labels[i % len(labels) :] + labels[: i % len(labels)]:
                    begin = time.perf_counter()
                    logits = model(rows[:, position : position + 1], **cache_kwargs(model, caches[label]), use_cache=True).logits
                    seconds = time.perf_counter() - begin
                    row_nlls = torch.nn.functional.cross_entropy(logits[:, -1].float(), rows[:, position + 1], reduction="none")
                    nll = float(row_nlls.mean())
                    records = done[label]
                    if i < len(records):
                        if abs(nll - records[i]["nll"]) > REPLAY_TOLERANCE:
                            raise RuntimeError(
                                f"resuming {pending[label][1].path}: step {i} replays to NLL {nll:.5f} but "
                                f"{records[i]['nll']:.5f} was recorded; the run is not reproducible here "
                                "(different threads or machine?): delete the directory"
                            )
                        continue
                    elapsed[label] += seconds
                    record = {"position": position + 1, "token": int(rows[0, position + 1]), "nll": nll,
                              "elapsed": elapsed[label], "seconds": seconds, "attended": step_attended(caches[label]),
                              "context": position + 1}  # fmt: skip
                    if rows.shape[0] > 1:
                        record["nlls"] = row_nlls.tolist()
                    outs[label].write(record)
                    bar.advance()
    return prefill_seconds
