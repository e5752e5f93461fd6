"""Greedy generation under a method, and the generation benchmarks built on it: retrieval (needle)
tasks, RULER's synthetic tasks for several methods over one prefill per prompt, and LongBench v1.
All are resumable: one JSONL record per finished sample."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from sparseattn.data.needle import (
    NeedleSample,
    RetrievalTask,
    clean_prediction,
    string_match_all,
)
from sparseattn.evaluation import longbench as lb
from sparseattn.evaluation.runs import RunDir
from sparseattn.hf import apply, cache_kwargs
from sparseattn.progress import progress as show_progress


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
    ``verbose=False``: transformers warns of "indexing errors" for a text longer than the tokenizer's
    maximum length, but the callers fit or refuse a prompt against the model's window themselves.
    """
    if not chat:
        return tokenizer(prompt + answer_prefix, return_tensors="pt", verbose=False)["input_ids"]
    if getattr(tokenizer, "chat_template", None) is None:
        raise ValueError("--chat needs a tokenizer with a chat template")
    text = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=False)
    return tokenizer(text + answer_prefix, return_tensors="pt", add_special_tokens=False, verbose=False)["input_ids"]


def check_window(model, prompt_tokens: int, max_new_tokens: int) -> None:
    """Refuse a prompt whose answer would run past the model's positions (ValueError)."""
    window = getattr(model.config, "max_position_embeddings", None)
    if window is not None and prompt_tokens + max_new_tokens > window:
        raise ValueError(f"prompt of {prompt_tokens} tokens + {max_new_tokens} new tokens exceeds the model's {window} positions")


def generate_greedy(model, tokenizer, cache, ids: torch.Tensor, max_new_tokens: int, **options) -> torch.Tensor:
    """``model.generate`` without sampling from ``ids: [1, n]`` through ``cache``: ``[1, n + new]`` ids.

    ``options`` go to ``generate`` as they are (``eos_token_id``, ``streamer``, ...).
    """
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    with torch.no_grad():
        return model.generate(
            ids.to(model.device),
            attention_mask=torch.ones_like(ids).to(model.device),
            **cache_kwargs(model, cache),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            pad_token_id=pad if pad is not None else 0,
            **options,
        )


def greedy(model, tokenizer, sparse, ids: torch.Tensor, max_new_tokens: int, stop_at_newline: bool = False) -> Generation:
    """Greedy decoding of ``ids: [1, n]`` with a fresh cache from ``sparse`` (an applied method)."""
    check_window(model, int(ids.shape[1]), max_new_tokens)
    cache = sparse.new_cache()
    eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    if stop_at_newline:
        eos += [i for i in (tokenizer.convert_tokens_to_ids(t) for t in ("\n", "Ċ")) if isinstance(i, int) and i >= 0]
    start = time.perf_counter()
    out = generate_greedy(model, tokenizer, cache, ids, max_new_tokens, eos_token_id=eos or None)
    seconds = time.perf_counter() - start
    new = out[0, ids.shape[1] :]
    return Generation(
        text=tokenizer.decode(new, skip_special_tokens=True),
        new_tokens=int(new.numel()),
        prompt_tokens=int(ids.shape[1]),
        seconds=seconds,
        mean_attended=cache.mean_attended(),
    )


def continue_greedy(model, tokenizer, cache, logits: torch.Tensor, prompt_tokens: int, max_new_tokens: int) -> Generation:
    """Greedy decoding from a prefilled ``cache`` whose prompt's next-token ``logits: [1, vocab]`` are known.

    The tokens :func:`greedy` generates for the same prompt and method: the first is the argmax of
    the (dense) prefill's logits, each next one the argmax of a decode step through the cache's
    method; it stops after the end-of-sequence token or at ``max_new_tokens``. ``seconds`` counts the
    decode steps only (the prefill was shared). The model must have a method applied.
    """
    check_window(model, prompt_tokens, max_new_tokens)
    eos = tokenizer.eos_token_id
    token = logits.argmax(-1, keepdim=True)  # [1, 1]
    new = [int(token)]
    start = time.perf_counter()
    with torch.no_grad():
        while len(new) < max_new_tokens and new[-1] != eos:
            out = model(token.to(model.device), **cache_kwargs(model, cache), use_cache=True)
            token = out.logits[:, -1].argmax(-1, keepdim=True)
            new.append(int(token))
    return Generation(
        text=tokenizer.decode(new, skip_special_tokens=True),
        new_tokens=len(new),
        prompt_tokens=prompt_tokens,
        seconds=time.perf_counter() - start,
        mean_attended=cache.mean_attended(),
    )


#: The depth recorded for tasks with several needles, whose depths RULER spreads over the haystack, and
#: for one-needle tasks run without a depth (RULER's random depth).
SPREAD = -1.0
#: The depth recorded for tasks whose answer has no depth (``cwe``, ``fwe``: spread over the whole text).
NO_DEPTH = -2.0

#: A planned sample: ``(length, depth, seed)``.
Key = tuple[int, float, int]


def needle_plan(task: RetrievalTask, lengths: Sequence[int], depths: Sequence[float], samples: int, seed: int) -> list[Key]:
    """The ``(length, depth, seed)`` of every sample of a length x depth grid, in order.

    A distinct seed per sample, so cells do not share needles. Tasks with several needles (and, when
    no depth is given, every task) have one depth, :data:`SPREAD`: the task draws its depths as RULER
    does; tasks without needle depths (``cwe``, ``fwe``: the answer is spread over the whole text)
    have :data:`NO_DEPTH`.
    """
    if task.num_needles == 0:
        depths = [NO_DEPTH]
    elif task.num_needles > 1 or not depths:
        depths = [SPREAD]
    return [
        (n, d, seed + i + samples * (li * len(depths) + di))
        for li, n in enumerate(lengths)
        for di, d in enumerate(depths)
        for i in range(samples)
    ]


def _task_depths(depth: float) -> list[float] | None:
    """The ``depths`` argument of a task's ``sample`` for a planned depth (None: the task's own rule)."""
    return None if depth in (SPREAD, NO_DEPTH) else [depth]


def depth_label(task: RetrievalTask, depth: float) -> str:
    """A heatmap column's name: ``50%``, ``spread`` (several needles), ``random`` (one, RULER's draw) or ``no depth``."""
    if depth == NO_DEPTH:
        return "no depth"
    if depth == SPREAD:
        return "spread" if task.num_needles > 1 else "random"
    return f"{depth:g}%"


def _key(record: dict[str, Any]) -> Key:
    return record["length"], record["depth"], record["seed"]


@dataclass(frozen=True)
class RetrievalPrompts:
    """How a retrieval task's prompts are built for one tokenizer.

    A planned ``(length, depth, seed)`` becomes a prompt of ``length`` tokens less ``max_new_tokens``
    (the answer's room), with its needles at ``depth`` percent, its haystack from ``haystack_text``
    where the task's haystack is prose, and, with ``chat``, as one user turn of the chat template.
    """

    task: RetrievalTask
    tokenizer: Any
    max_new_tokens: int
    haystack_text: str | None = None
    chat: bool = False

    def _counter(self) -> Callable[[str], int] | Any:
        """What the task counts prompt tokens with: the tokenizer, or the length of the chat prompt."""
        if not self.chat:
            return self.tokenizer
        return lambda s: len(encode_prompt(self.tokenizer, s, True)[0])

    def shortest_lengths(self, plan: Sequence[Key]) -> dict[int, int]:
        """Per planned length, the fewest tokens its samples need: a prompt without haystack + the answer.

        A shorter length cannot be built (:meth:`RetrievalTask.sample` refuses it); the needles and keys
        drawn from each sample's seed change the count by a few tokens, so every planned sample is counted.
        """
        count = self._counter()
        shortest: dict[int, int] = {}
        for length, depth, s in plan:
            bare = self.task.render(0, count, seed=s, depths=_task_depths(depth), haystack_text=self.haystack_text,
                                    target_tokens=length)  # fmt: skip
            shortest[length] = max(shortest.get(length, 0), bare.num_tokens + self.max_new_tokens)
        return shortest

    def sample(self, key: Key, counter: Callable[[str], int] | Any = None) -> NeedleSample:
        """The sample of a planned key; raises the task's ValueError for a length it cannot build."""
        length, depth, seed = key
        counter = self._counter() if counter is None else counter
        return self.task.sample(length, counter, seed=seed, depths=_task_depths(depth), haystack_text=self.haystack_text,
                                reserve_tokens=self.max_new_tokens)

    def samples(self, plan: Sequence[Key]) -> list[tuple[Key, NeedleSample]]:
        """Every planned key with its sample: cheap (the tokenizer only), so a command builds them all before
        it loads the model, and a length a task cannot be built at fails first."""
        counter = self._counter()
        return [(key, self.sample(key, counter)) for key in plan]

    def ids(self, sample: NeedleSample) -> torch.Tensor:
        """A sample's prompt ids ``[1, n]``; with ``chat`` the answer prefix goes after the chat template."""
        prompt = sample.prompt[: len(sample.prompt) - len(sample.answer_prefix)] if self.chat else sample.prompt
        return encode_prompt(self.tokenizer, prompt, self.chat, sample.answer_prefix if self.chat else "")

    def record(self, key: Key, sample: NeedleSample, gen: Generation) -> dict[str, Any]:
        """The record of one answer, scored with RULER's ``string_match_all`` (percent)."""
        length, depth, seed = key
        prediction = clean_prediction(gen.text)
        return {
            "length": length, "depth": depth, "seed": seed, "task": self.task.name, "prediction": prediction,
            "answers": sample.answers, "score": string_match_all([prediction], [sample.answers]),
            "prompt_tokens": gen.prompt_tokens, "seconds": gen.seconds, "attended": gen.mean_attended,
        }  # fmt: skip


def run_needle(
    model, method, prompts: RetrievalPrompts, plan: Sequence[Key], run: RunDir, *, progress: bool = True
) -> list[dict[str, Any]]:
    """Generate and score the planned samples (:func:`needle_plan`) under ``method``; returns their records.

    Each prompt is generated by a prefill of its own (:func:`greedy`); records go to the run's
    ``samples.jsonl`` as they come, and the samples recorded there already are skipped.
    """
    records = run.records("samples.jsonl")
    done = {_key(r) for r in records}
    todo = [key for key in plan if key not in done]
    with apply(model, method) as sparse, run.appender("samples.jsonl") as out, \
            show_progress(f"{prompts.task.name} samples", total=len(todo), unit="samples", enabled=progress) as bar:
        for key in todo:
            sample = prompts.sample(key)
            gen = greedy(model, prompts.tokenizer, sparse, prompts.ids(sample), prompts.max_new_tokens)
            record = prompts.record(key, sample, gen)
            out.write(record)
            records.append(record)
            bar.advance()
    planned = set(plan)  # earlier runs may hold more of the grid than asked for now
    return [r for r in records if _key(r) in planned]


def run_shared(
    model,
    runs: dict[str, tuple[Any, RunDir]],
    prompts: RetrievalPrompts,
    samples: Sequence[tuple[Key, NeedleSample]],
    *,
    progress: bool = True,
) -> dict[str, list[dict[str, Any]]]:
    """Generate and score each of ``samples`` under every method of ``runs``, prefilling each prompt once.

    ``runs`` maps a label to ``(method, run directory)``; ``samples`` are ``(key, sample)`` pairs
    (:meth:`RetrievalPrompts.samples`). A prompt is prefilled once for the methods that have not yet
    recorded it (:func:`~sparseattn.evaluation.shared_prefill.prefill_shared`), then each method
    decodes its answer greedily from its own cache (:func:`continue_greedy`: the same tokens as a
    prefill of its own, tested); records go to each run's ``samples.jsonl`` as they come, so an
    interrupted run resumes. Returns each method's records of these samples.
    """
    from sparseattn.evaluation.shared_prefill import prefill_shared

    records = {label: run.records("samples.jsonl") for label, (_, run) in runs.items()}
    done = {label: {_key(r) for r in rs} for label, rs in records.items()}
    todo = [(key, sample) for key, sample in samples if any(key not in done[label] for label in runs)]
    appenders = {label: run.appender("samples.jsonl") for label, (_, run) in runs.items()}
    try:
        with show_progress(f"{prompts.task.name} samples", total=len(todo), unit="samples", enabled=progress) as bar:
            for key, sample in todo:
                labels = [label for label in runs if key not in done[label]]
                ids = prompts.ids(sample)
                begin = time.perf_counter()
                prefilled = prefill_shared(model, {label: runs[label][0] for label in labels}, ids, progress=progress)
                prefill_seconds = time.perf_counter() - begin
                for label in labels:
                    cache = prefilled.caches.pop(label)  # freed once decoded: one method's cache at a time grows
                    with apply(model, runs[label][0]):
                        gen = continue_greedy(model, prompts.tokenizer, cache, prefilled.logits, ids.shape[1],
                                              prompts.max_new_tokens)  # fmt: skip
                    del cache
                    record = {**prompts.record(key, sample, gen), "new_tokens": gen.new_tokens,
                              "prefill_seconds": prefill_seconds, "prefilled_with": len(labels),
                              "needle_depths": sample.depths}  # fmt: skip
                    appenders[label].write(record)
                    records[label].append(record)
                bar.advance()
    finally:
        for appender in appenders.values():
            appender.close()
    planned = {key for key, _ in samples}  # earlier runs may hold more of the grid than asked for now
    return {label: [r for r in rs if _key(r) in planned] for label, rs in records.items()}


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


def finish_grid(
    run: RunDir, records: Sequence[dict[str, Any]], lengths: Sequence[int], depths: Sequence[float], samples: int
) -> list[list[float]]:
    """The :func:`accuracy_grid` of a run's records, written with the run's config and means as its summary."""
    grid = accuracy_grid(records, lengths, depths)
    run.finish({**run.config, "lengths": list(lengths), "depths": list(depths), "samples": samples, "grid": grid,
                "accuracy": sum(r["score"] for r in records) / len(records), "n_samples": len(records),
                "mean_attended_tokens": sum(r["attended"] for r in records) / len(records)})  # fmt: skip
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
            todo = examples[done:]
            with run.appender(name) as out, \
                    show_progress(f"{task} examples", total=len(todo), unit="examples", enabled=progress) as bar:
                for example in todo:
                    prompt = lb.truncate_prompt(lb.build_prompt(task, example), tokenizer, max_length)
                    use_chat = chat and task not in lb.NO_CHAT_TEMPLATE_TASKS and getattr(tokenizer, "chat_template", None)
                    ids = encode_prompt(tokenizer, prompt, bool(use_chat))
                    gen = greedy(model, tokenizer, sparse, ids, lb.MAX_NEW_TOKENS[task], stop_at_newline=task == "samsum")
                    out.write({"pred": gen.text, "answers": example["answers"], "all_classes": example.get("all_classes"),
                               "length": example.get("length"), "_id": example.get("_id"), "prompt_tokens": gen.prompt_tokens,
                               "seconds": gen.seconds, "attended": gen.mean_attended})
                    bar.advance()
            counts[task] = len(run.records(name))
    return counts
