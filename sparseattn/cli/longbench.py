"""``sparseattn longbench``: LongBench v1 predictions under each method (``run``) and their official scores (``score``)."""

from __future__ import annotations

import json
from pathlib import Path

import typer
from rich.markup import escape
from rich.table import Table

from sparseattn.cli.checks import bad, check_dtype, check_range
from sparseattn.cli.consoles import console
from sparseattn.cli.inputs import check_positions, inspect_model
from sparseattn.cli.method_specs import parse_methods
from sparseattn.cli.options import BUDGET, DTYPE, METHOD, MODEL, OUT
from sparseattn.cli.outputs import check_out, plan_runs, run_name, wrote
from sparseattn.evaluation.longbench import score_directory

app = typer.Typer(
    no_args_is_help=True, add_completion=False, help="LongBench v1: score predictions with the official metrics."
)


@app.callback()
def main() -> None:
    """LongBench v1 (English and code tasks): score prediction files with the official metrics."""


@app.command()
def score(
    pred_dir: Path = typer.Argument(..., help="directory of {task}.jsonl files (pred, answers, all_classes)"),
    out: Path | None = typer.Option(None, help="JSON result file [default: PRED_DIR/result_sparseattn.json]"),
) -> None:
    """Score every {task}.jsonl in PRED_DIR as LongBench's eval.py does, print a table and write JSON."""
    try:
        result = score_directory(pred_dir)
    except (ValueError, OSError) as err:
        console.print(f"[red]error:[/] {escape(str(err))}", soft_wrap=True)
        raise typer.Exit(1) from None
    table = Table(title=f"LongBench v1: {escape(str(pred_dir))}")
    for column in ("task", "category", "metric"):
        table.add_column(column)
    for column in ("n", "score"):
        table.add_column(column, justify="right")
    for task, row in result["tasks"].items():
        table.add_row(task, row["category"], row["metric"], str(row["n"]), f"{row['score']:.2f}")
    console.print(table)
    categories = ", ".join(f"{name} {value:.2f}" for name, value in result["category_means"].items())
    console.print(f"category means: {categories}", soft_wrap=True)
    if result["complete"]:
        console.print(f"16-task mean: {result['task_mean']:.2f}")
        console.print(f"category mean (mean of the 6 category means): {result['category_mean']:.2f}")
    else:
        missing = ", ".join(result["missing_tasks"])
        console.print(f"incomplete: {len(result['missing_tasks'])} of 16 tasks missing ({missing})", soft_wrap=True)
        console.print(f"mean of the {result['n_tasks']} tasks scored: {result['task_mean']:.2f}")
        n_categories = len(result["category_means"])
        console.print(f"category mean (mean of {n_categories} category means): {result['category_mean']:.2f}")
    out = out if out is not None else pred_dir / "result_sparseattn.json"
    out.write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    wrote([out])


@app.command("run")
def longbench_run(
    data_dir: Path = typer.Option(..., help="directory of LongBench v1 {task}.jsonl files (local; nothing is downloaded)"),
    model: str = MODEL,
    method: list[str] = METHOD,
    budget: int | None = BUDGET,
    task: list[str] = typer.Option(None, "--task", help="tasks to run (default: every {task}.jsonl present)"),
    max_length: int = typer.Option(7500, help="middle-truncate prompts to this many tokens (the model's window minus room)"),
    limit: int | None = typer.Option(None, help="first N examples per task (>= 1; quick runs)"),
    chat: bool = typer.Option(True, help="chat template (except the tasks LongBench runs without one)"),
    out: Path = OUT,
    dtype: str = DTYPE,
) -> None:
    """LongBench v1 predictions under each method (pred.py's protocol), then scored with the official metrics."""
    from sparseattn.evaluation import longbench as lb

    torch_dtype = check_dtype(dtype)
    if not data_dir.is_dir():
        raise bad("--data-dir", f"{data_dir} is not a directory")
    for name in task or []:
        try:
            lb.check_task(name)
        except ValueError as err:
            raise bad("--task", str(err)) from None
        if not (data_dir / f"{name}.jsonl").is_file():
            raise bad("--task", f"{name}: there is no {data_dir / f'{name}.jsonl'}")
    tasks = task or [t for t in lb.TASKS if (data_dir / f"{t}.jsonl").exists()]
    if not tasks:
        raise bad("--data-dir", f"no LongBench task files ({', '.join(lb.TASKS)}.jsonl) in {data_dir}")
    check_range("--max-length", max_length, 1)
    check_range("--limit", limit, 1)
    resolved = parse_methods(method, budget)
    check_out(out)
    info = inspect_model(model)
    answer = max(lb.MAX_NEW_TOKENS[t] for t in tasks)
    check_positions(info, "--max-length", max_length + answer, f"--max-length {max_length} + {answer} answer tokens",
                    f"--max-length <= {(info.window or 0) - answer} for these tasks")
    # The tasks and --limit say how much of the experiment to run, not which one: more of either extends it.
    runs = plan_runs(out / run_name("longbench", dtype), resolved, {
        "command": "longbench", "model": model, "data_dir": str(data_dir), "max_length": max_length, "chat": chat,
        "dtype": dtype,
    })  # fmt: skip

    from sparseattn.evaluation.generation import run_longbench
    from sparseattn.evaluation.runs import RunDir, write_json

    tokenizer = info.tokenizer()
    hf_model = info.load(torch_dtype)
    dirs = []
    for label, sparse_method, path, config in runs:
        run = RunDir(path, config)
        run_longbench(hf_model, tokenizer, sparse_method, data_dir, tasks, max_length, run, limit=limit, chat=chat)
        result = lb.score_directory(run.path)
        write_json(run.path / "result.json", {**result, "limit": limit})
        console.print(f"{label}: {json.dumps(result.get('scores', result))}", markup=False)
        dirs.append(run.path)
    wrote(dirs, "config.json, {task}.jsonl predictions, result.json in each")
