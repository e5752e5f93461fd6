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

import inspect
import math
import time
from typing import Any

import torch
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

from sparseattn.evaluation.runs import RunDir, environment
from sparseattn.hf import apply
from sparseattn.hf.cache import SparseCache

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


def _progress() -> Progress:
    return Progress(
        TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn(), transient=True
    )


def _step_attended(cache: SparseCache) -> float:
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
    if run.finished:
        return run.summary()
    if ids.dim() not in (1, 2) or ids.shape[-1] < prefill + steps + 1 or ids.numel() == 0:
        raise ValueError(f"need [prefill + steps + 1] = [{prefill + steps + 1}] token ids (or [B, {prefill + steps + 1}]), got shape {tuple(ids.shape)}")
    rows = ids.reshape(-1, ids.shape[-1])  # [B, T]
    window = getattr(model.config, "max_position_embeddings", None)
    if window is not None and prefill + steps + 1 > window:
        raise ValueError(
            f"prefill {prefill} + steps {steps} exceeds the model's {window} positions; use fewer steps or a shorter prefill"
        )
    device = model.device
    rows = rows.to(device)
    # Prefill logits are never scored: ask for the last position's only (a [B, T, vocab] tensor otherwise).
    keep_last = {"logits_to_keep": 1} if "logits_to_keep" in inspect.signature(model.forward).parameters else {}
    done = run.records("tokens.jsonl")
    if len(done) > steps:
        raise ValueError(f"{run.path}/tokens.jsonl has {len(done)} records, more than the {steps} steps configured")
    with apply(model, method) as sparse, torch.no_grad(), run.appender("tokens.jsonl") as out:
        cache = sparse.new_cache()
        start = time.perf_counter()
        logits = None
        if prefill:
            logits = model(rows[:, :prefill], past_key_values=cache, use_cache=True, **keep_last).logits
        prefill_seconds = time.perf_counter() - start
        elapsed = done[-1]["elapsed"] if done else 0.0
        bar = _progress() if progress else None
        task = bar.add_task(label, total=steps, completed=len(done)) if bar else None
        if bar:
            bar.start()
        try:
            for i in range(steps):
                position = prefill + i
                begin = time.perf_counter()
                logits = model(rows[:, position : position + 1], past_key_values=cache, use_cache=True).logits
                seconds = time.perf_counter() - begin
                row_nlls = torch.nn.functional.cross_entropy(logits[:, -1].float(), rows[:, position + 1], reduction="none")
                nll = float(row_nlls.mean())
                if i < len(done):
                    if abs(nll - done[i]["nll"]) > REPLAY_TOLERANCE:
                        raise RuntimeError(
                            f"resuming {run.path}: step {i} replays to NLL {nll:.5f} but {done[i]['nll']:.5f} was recorded; "
                            "the run is not reproducible here (different threads or machine?): delete the directory"
                        )
                    continue
                elapsed += seconds
                record = {"position": position + 1, "token": int(rows[0, position + 1]), "nll": nll, "elapsed": elapsed,
                          "seconds": seconds, "attended": _step_attended(cache), "context": position + 1}
                if rows.shape[0] > 1:
                    record["nlls"] = row_nlls.tolist()
                out.write(record)
                if bar:
                    bar.advance(task)
        finally:
            if bar:
                bar.stop()
    records = run.records("tokens.jsonl")
    nlls = [r["nll"] for r in records]
    seconds = sum(r["seconds"] for r in records)
    attended = [r["attended"] for r in records if not math.isnan(r["attended"])]
    summary = {
        **run.config,
        "ppl": math.exp(sum(nlls) / len(nlls)),
        "mean_nll": sum(nlls) / len(nlls),
        "n_tokens": len(nlls),
        "seconds": seconds,
        "batch": rows.shape[0],
        "tokens_per_second": rows.shape[0] * len(nlls) / seconds if seconds else float("nan"),
        "prefill_seconds": prefill_seconds,
        "mean_attended_tokens": sum(attended) / len(attended) if attended else float("nan"),
        "mean_context_tokens": sum(r["context"] for r in records) / len(records),
        "environment": environment(),
    }
    run.finish(summary)
    return summary
