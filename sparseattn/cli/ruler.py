"""``sparseattn ruler``: RULER's synthetic tasks under several methods, one prefill per prompt for all of them."""

from __future__ import annotations

import difflib
from collections.abc import Sequence
from pathlib import Path

import typer
from rich.table import Table

from sparseattn.cli.checks import bad, check_dtype, check_grid
from sparseattn.cli.consoles import console
from sparseattn.cli.inputs import check_buildable, retrieval_inputs
from sparseattn.cli.options import BUDGET, DTYPE, METHOD, MODEL, OUT
from sparseattn.cli.outputs import plan_runs, run_name, wrote


def _ruler_tasks(names: Sequence[str]) -> list[str]:
    """``--task`` values resolved to RULER task names, in RULER's order, each once (``all``: the 11 offline tasks)."""
    from sparseattn.data.ruler import RULER_QA, RULER_TASKS

    allowed = f"all, {', '.join(RULER_TASKS)}"
    chosen: set[str] = set()
    for name in names:
        if name in RULER_QA:
            raise bad("--task", f"{name} needs the {RULER_QA[name]} data set, which cannot be fetched offline, so it is "
                      f"not generated; allowed: {allowed}")
        if name != "all" and name not in RULER_TASKS:
            close = difflib.get_close_matches(name, list(RULER_TASKS), n=2)
            hint = f" (did you mean {' or '.join(close)}?)" if close else ""
            raise bad("--task", f"unknown task {name!r}{hint}; allowed: {allowed}")
        chosen |= set(RULER_TASKS) if name == "all" else {name}
    return [name for name in RULER_TASKS if name in chosen]


def ruler(
    model: str = MODEL,
    method: list[str] = METHOD,
    budget: int | None = BUDGET,
    task: list[str] = typer.Option(
        ["all"], "--task", help="RULER tasks (repeatable): niah_single_1..3, niah_multikey_1..3, niah_multivalue, "
        "niah_multiquery, vt, cwe, fwe, or all (qa_1/qa_2 need SQuAD/HotpotQA, not available offline)"
    ),
    lengths: list[int] = typer.Option([4096], "--length", help="target prompt lengths in tokens, answer included (repeatable)"),
    depths: list[float] = typer.Option(
        None, "--depth", help="needle depths in percent, 0 to 100, for the one-needle NIAH tasks (repeatable; default: "
        "RULER's random depth per sample); the other tasks spread their needles or have no depth"
    ),
    samples: int = typer.Option(1, help="samples per task x length x depth (>= 1; RULER: 500)"),
    haystack: str = typer.Option("paradise-lost", help="text for the prose haystack (RULER's essays) of NIAH tasks"),
    max_new_tokens: int | None = typer.Option(
        None, help="answer tokens generated, for every task (>= 1; default: RULER's, 128 NIAH, 30 vt, 120 cwe, 50 fwe)"
    ),
    chat: bool = typer.Option(False, help="wrap prompts in the tokenizer's chat template"),
    seed: int = typer.Option(0),
    out: Path = OUT,
    dtype: str = DTYPE,
) -> None:
    """RULER's synthetic tasks (NIAH, vt, cwe, fwe) for several methods, one prefill per prompt: heatmaps and a table."""
    from sparseattn.data.ruler import RULER_TASKS, tokens_to_generate

    names = _ruler_tasks(task)
    torch_dtype = check_dtype(dtype)
    depths = list(depths or [])
    check_grid(lengths, depths, samples, max_new_tokens)
    if depths and not any(RULER_TASKS[name].num_needles == 1 for name in names):
        raise bad("--depth", f"none of the tasks {', '.join(names)} has one needle to place (vt and the multi-needle "
                  "tasks spread theirs as RULER does, cwe and fwe have no depth); allowed: --depth with niah_single_1..3, "
                  "niah_multikey_2 or niah_multikey_3")
    prose = any(getattr(RULER_TASKS[name], "haystack", None) == "prose" for name in names)
    resolved, info, haystack_text, tokenizer = retrieval_inputs(model, method, budget, out, lengths, haystack if prose else None, chat)

    from sparseattn.evaluation.generation import RetrievalPrompts, needle_plan

    # Every prompt is built before the weights load: a length a task cannot be built at fails in seconds.
    root = out / run_name("ruler", dtype)
    jobs = []
    for name in names:
        retrieval, answer = RULER_TASKS[name], max_new_tokens or tokens_to_generate(name)
        text = haystack_text if getattr(retrieval, "haystack", None) == "prose" else None
        prompts = RetrievalPrompts(retrieval, tokenizer, answer, text, chat)
        plan = needle_plan(retrieval, lengths, depths, samples, seed)
        check_buildable(prompts, plan, info.window, f"{answer} answer tokens")
        try:
            built = prompts.samples(plan)
        except ValueError as err:
            raise bad("--length", str(err)) from None
        runs = plan_runs(root / name, resolved, {
            "command": "ruler", "model": model, "task": name, "task_params": repr(retrieval), "max_new_tokens": answer,
            "chat": chat, "seed": seed, "dtype": dtype, "haystack": haystack if text else None,
        })  # fmt: skip
        jobs.append((name, prompts, plan, built, runs))

    from sparseattn.evaluation.generation import depth_label, finish_grid, run_shared
    from sparseattn.evaluation.plots import heatmap, ruler_markdown, ruler_rows
    from sparseattn.evaluation.runs import RunDir, write_json

    hf_model = info.load(torch_dtype)
    labels = [label for label, _, _ in resolved]
    scores: dict[str, dict[str, dict[int, float]]] = {}
    for name, prompts, plan, built, runs in jobs:
        retrieval = prompts.task
        dirs = {label: (sparse_method, RunDir(path, config)) for label, sparse_method, path, config in runs}
        records = run_shared(hf_model, dirs, prompts, built)
        shown = list(dict.fromkeys(d for _, d, _ in plan))
        columns = [depth_label(retrieval, d) for d in shown]
        xlabel = "no needle depth: the answer words are spread over the whole text" if retrieval.num_needles == 0 \
            else "needle depth"
        scores[name] = {}
        for label, (_, run) in dirs.items():
            grid = finish_grid(run, records[label], lengths, shown, samples)
            scores[name][label] = {n: sum(row) / len(row) for n, row in zip(lengths, grid)}
            heatmap(grid, [str(n) for n in lengths], columns, run.path / "heatmap.png", f"{name}, {label}", xlabel,
                    "prompt tokens")
            write_json(run.path / "grid.json", {"lengths": lengths, "depths": shown, "columns": columns, "accuracy": grid})
    rows = ruler_rows(scores, lengths)
    table = Table(title=f"RULER accuracy (%), {samples} sample(s) per cell; mean: over the tasks")
    for column in ("task", "length", *labels):
        table.add_column(column, justify="right")
    for row in rows:
        table.add_row(row["task"], str(row["length"]), *("-" if row.get(m) is None else f"{row[m]:.1f}" for m in labels))
    console.print(table)
    root.mkdir(parents=True, exist_ok=True)
    write_json(root / "summary.json", {"tasks": names, "methods": labels, "lengths": lengths, "samples": samples,
                                       "scores": scores, "rows": rows})
    (root / "summary.md").write_text(ruler_markdown(rows, labels) + "\n")
    matrix = [[float("nan") if r.get(m) is None else r[m] for m in labels] for r in rows]
    heatmap(matrix, [f"{r['task']} @ {r['length']}" for r in rows], labels, root / "summary.png",
            f"RULER accuracy (%), {samples} sample(s) per cell", "method", "task @ length")
    wrote([root / "summary.md", root / "summary.json", root / "summary.png"],
          "and per task and method: config.json, samples.jsonl, summary.json, grid.json, heatmap.png")
