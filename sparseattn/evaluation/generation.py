"""Greedy generation under a method, and the two generation benchmarks built on it: retrieval
(needle) tasks and LongBench v1. Both are resumable: one JSONL record per finished sample."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

from sparseattn.data.needle import RetrievalTask, clean_prediction, string_match_all
from sparseattn.evaluation import longbench as lb
from sparseattn.evaluation.runs import RunDir
from sparseattn.hf import apply


@dataclass(frozen=True)
class Generation:
    """The continuation of one prompt, with what it cost."""

    text: str
    new_tokens: int
    prompt_tokens: int
    seconds: float
    mean_attended: float


def encode_prompt(tokenizer, prompt: str, chat: bool, answer_prefix: str = "") -> torch.Tensor:
    """``[1, n]`` ids: plain text, or one user turn of the chat template followed by ``answer_prefix``.

    In chat mode the prefix is written as the beginning of the assistant's reply (RULER's convention).
    """
    if not chat:
        return tokenizer(prompt + answer_prefix, return_tensors="pt")["input_ids"]
    if getattr(tokenizer, "chat_template", None) is None:
        raise ValueError("--chat needs a tokenizer with a chat template")
    text = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=False)
    return tokenizer(text + answer_prefix, return_tensors="pt", add_special_tokens=False)["input_ids"]


def greedy(model, tokenizer, sparse, ids: torch.Tensor, max_new_tokens: int, stop_at_newline: bool = False) -> Generation:
    """Greedy decoding of ``ids: [1, n]`` with a fresh cache from ``sparse`` (an applied method)."""
    window = getattr(model.config, "max_position_embeddings", None)
    if window is not None and ids.shape[1] + max_new_tokens > window:
        raise ValueError(f"prompt of {ids.shape[1]} tokens + {max_new_tokens} new tokens exceeds the model's {window} positions")
    cache = sparse.new_cache()
    eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    if stop_at_newline:
        eos += [i for i in (tokenizer.convert_tokens_to_ids(t) for t in ("\n", "Ċ")) if isinstance(i, int) and i >= 0]
    start = time.perf_counter()
    with torch.no_grad():
        out = model.generate(
            ids.to(model.device),
            attention_mask=torch.ones_like(ids).to(model.device),
            past_key_values=cache,
            max_new_tokens=max_new_tokens,
            do_sample=False,
            eos_token_id=eos or None,
            pad_token_id=tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (eos[0] if eos else 0),
        )
    seconds = time.perf_counter() - start
    new = out[0, ids.shape[1] :]
    return Generation(
        text=tokenizer.decode(new, skip_special_tokens=True),
        new_tokens=int(new.numel()),
        prompt_tokens=int(ids.shape[1]),
        seconds=seconds,
        mean_attended=cache.mean_attended(),
    )


def _bar(total: int, done: int, label: str) -> tuple[Progress, Any]:
    bar = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn(), transient=True)
    task = bar.add_task(label, total=total, completed=done)
    return bar, task


def run_needle(
    model,
    tokenizer,
    method,
    task: RetrievalTask,
    lengths: Sequence[int],
    depths: Sequence[float],
    samples: int,
    run: RunDir,
    *,
    max_new_tokens: int = 32,
    haystack_text: str | None = None,
    chat: bool = False,
    seed: int = 0,
    progress: bool = True,
) -> list[dict[str, Any]]:
    """Generate and score ``samples`` prompts per (length, depth); returns the records of that grid.

    Each prompt is fitted to ``length`` tokens including its ``max_new_tokens`` answer budget and has
    its needle at ``depth`` percent (tasks with several needles spread them as RULER does and record
    depth :data:`SPREAD`); scored with RULER's ``string_match_all`` (percent).
    """
    records = run.records("samples.jsonl")
    if _needles(task) > 1:
        depths = [SPREAD]  # several needles: RULER's spread of depths, one column
    done = {(r["length"], r["depth"], r["seed"]) for r in records}
    # A distinct seed per sample, so cells do not share needles.
    plan = [
        (n, d, seed + i + samples * (li * len(depths) + di))
        for li, n in enumerate(lengths)
        for di, d in enumerate(depths)
        for i in range(samples)
    ]
    counter = tokenizer if chat is False else (lambda s: len(encode_prompt(tokenizer, s, True)[0]))
    bar, bar_task = _bar(len(plan), len(done), f"{task.name}") if progress else (None, None)
    with apply(model, method) as sparse, run.appender("samples.jsonl") as out:
        if bar:
            bar.start()
        try:
            for length, depth, s in plan:
                if (length, depth, s) in done:
                    continue
                sample = task.sample(length, counter, seed=s, depths=None if depth == SPREAD else [depth],
                                     haystack_text=haystack_text, reserve_tokens=max_new_tokens)
                prompt = sample.prompt[: len(sample.prompt) - len(sample.answer_prefix)] if chat else sample.prompt
                ids = encode_prompt(tokenizer, prompt, chat, sample.answer_prefix if chat else "")
                gen = greedy(model, tokenizer, sparse, ids, max_new_tokens)
                prediction = clean_prediction(gen.text)
                record = {
                    "length": length, "depth": depth, "seed": s, "task": task.name, "prediction": prediction,
                    "answers": sample.answers, "score": string_match_all([prediction], [sample.answers]),
                    "prompt_tokens": gen.prompt_tokens, "seconds": gen.seconds, "attended": gen.mean_attended,
                }
                out.write(record)
                records.append(record)
                if bar:
                    bar.advance(bar_task)
        finally:
            if bar:
                bar.stop()
    planned = set(plan)  # earlier runs may hold more of the grid than asked for now
    return [r for r in records if (r["length"], r["depth"], r["seed"]) in planned]


#: The depth recorded for tasks with several needles, whose depths RULER spreads over the haystack.
SPREAD = -1.0


def _needles(task: RetrievalTask) -> int:
    """How many depths a task's sample takes (one per inserted needle)."""
    return int(getattr(task, "num_needles", 1) or 1)


def accuracy_grid(records: Sequence[dict[str, Any]], lengths: Sequence[int], depths: Sequence[float]) -> list[list[float]]:
    """Mean score (percent) per length (rows) x depth (columns); NaN where nothing was run."""
    grid = []
    for n in lengths:
        row = []
        for d in depths:
            scores = [r["score"] for r in records if r["length"] == n and r["depth"] == d]
            row.append(sum(scores) / len(scores) if scores else float("nan"))
        grid.append(row)
    return grid


def run_longbench(
    model,
    tokenizer,
    method,
    data_dir: Path,
    tasks: Sequence[str],
    max_length: int,
    run: RunDir,
    *,
    limit: int | None = None,
    chat: bool = True,
    progress: bool = True,
) -> dict[str, int]:
    """LongBench v1 predictions in its own format (``{task}.jsonl`` in the run directory), resumable.

    As LongBench's ``pred.py``: the official template, middle truncation of the prompt to
    ``max_length`` tokens, the chat template except for the few-shot and code tasks, greedy decoding of
    the task's official maximum length; samsum stops at the first newline. Returns predictions per task.
    """
    counts = {}
    with apply(model, method) as sparse:
        for task in tasks:
            lb.check_task(task)
            examples = lb.load_task(data_dir, task)[:limit]
            name = f"{task}.jsonl"
            done = len(run.records(name))
            bar, bar_task = _bar(len(examples), done, task) if progress else (None, None)
            with run.appender(name) as out:
                if bar:
                    bar.start()
                try:
                    for example in examples[done:]:
                        prompt = lb.truncate_prompt(lb.build_prompt(task, example), tokenizer, max_length)
                        use_chat = chat and task not in lb.NO_CHAT_TEMPLATE_TASKS and getattr(tokenizer, "chat_template", None)
                        ids = encode_prompt(tokenizer, prompt, bool(use_chat))
                        gen = greedy(model, tokenizer, sparse, ids, lb.MAX_NEW_TOKENS[task], stop_at_newline=task == "samsum")
                        out.write({"pred": gen.text, "answers": example["answers"], "all_classes": example.get("all_classes"),
                                   "length": example.get("length"), "_id": example.get("_id"), "prompt_tokens": gen.prompt_tokens,
                                   "seconds": gen.seconds, "attended": gen.mean_attended})
                        if bar:
                            bar.advance(bar_task)
                finally:
                    if bar:
                        bar.stop()
            counts[task] = len(run.records(name))
    return counts
