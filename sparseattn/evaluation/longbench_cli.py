"""LongBench v1 commands (mounted as ``sparseattn longbench``)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from sparseattn.evaluation.longbench import score_directory

app = typer.Typer(
    no_args_is_help=True, add_completion=False, help="LongBench v1: score predictions with the official metrics."
)
# Not a terminal (a log, a pipe): nothing is wrapped at 80 columns, which splits values from their
# labels: lines stay whole (soft_wrap) and so do table cells (a wide width).
console = Console() if sys.stdout.isatty() else Console(soft_wrap=True, width=200)


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
    console.print(f"wrote {escape(str(out))}", soft_wrap=True)


if __name__ == "__main__":
    app()
