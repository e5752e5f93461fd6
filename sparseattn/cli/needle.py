"""``sparseattn needle``: retrieval accuracy (passkey or one RULER NIAH task) by prompt length and needle depth."""

from __future__ import annotations

from pathlib import Path

import typer
from rich.table import Table

from sparseattn.cli.checks import bad, check_dtype, check_grid
from sparseattn.cli.consoles import console
from sparseattn.cli.inputs import check_buildable, retrieval_inputs
from sparseattn.cli.options import BUDGET, DTYPE, METHOD, MODEL, OUT, QUICK
from sparseattn.cli.outputs import plan_runs, run_name, wrote


def needle(
    model: str = MODEL,
    method: list[str] = METHOD,
    budget: int | None = BUDGET,
    task: str = typer.Option("passkey", help="passkey or a RULER task (niah_single_1, niah_multikey_1, ...)"),
    lengths: list[int] = typer.Option([4096], "--length", help="target prompt lengths in tokens, answer included (repeatable)"),
    depths: list[float] = typer.Option([10.0, 50.0, 90.0], "--depth", help="needle depths in percent, 0 to 100 (repeatable)"),
    samples: int = typer.Option(2, help=f"samples per length x depth (>= 1; {QUICK})"),
    haystack: str = typer.Option("paradise-lost", help="text for RULER's prose haystack (tasks with haystack='prose')"),
    max_new_tokens: int = typer.Option(16, help="answer tokens generated (>= 1)"),
    chat: bool = typer.Option(False, help="wrap prompts in the tokenizer's chat template"),
    seed: int = typer.Option(0),
    out: Path = OUT,
    dtype: str = DTYPE,
) -> None:
    """Retrieval accuracy (passkey / RULER NIAH) by length x depth: a table, JSON and a heatmap per method."""
    from sparseattn.data.needle import RULER_NIAH, PasskeyTask

    torch_dtype = check_dtype(dtype)
    if task == "passkey":
        retrieval = PasskeyTask()
    elif task in RULER_NIAH:
        retrieval = RULER_NIAH[task]
    else:
        raise bad("--task", f"unknown task {task!r}; known: passkey, {', '.join(RULER_NIAH)}")
    check_grid(lengths, depths, samples, max_new_tokens)
    prose = getattr(retrieval, "haystack", None) == "prose"
    resolved, info, haystack_text, tokenizer = retrieval_inputs(model, method, budget, out, lengths, haystack if prose else None, chat)

    from sparseattn.evaluation.generation import RetrievalPrompts, needle_plan

    prompts = RetrievalPrompts(retrieval, tokenizer, max_new_tokens, haystack_text, chat)
    plan = needle_plan(retrieval, lengths, depths, samples, seed)
    check_buildable(prompts, plan, info.window, f"--max-new-tokens {max_new_tokens}")
    # Lengths, depths and samples say how much of the grid to run: more of them extends the run.
    runs = plan_runs(out / run_name(f"needle-{task}", dtype), resolved, {
        "command": "needle", "model": model, "task": task, "max_new_tokens": max_new_tokens, "chat": chat, "seed": seed,
        "dtype": dtype, "haystack": haystack if haystack_text else None,
    })  # fmt: skip

    from sparseattn.evaluation.generation import finish_grid, run_needle
    from sparseattn.evaluation.plots import heatmap
    from sparseattn.evaluation.runs import RunDir, write_json

    hf_model = info.load(torch_dtype)
    table = Table(title=f"{task}: accuracy (%) by length and depth")
    table.add_column("method")
    table.add_column("length", justify="right")
    shown_depths = depths if getattr(retrieval, "num_needles", 1) == 1 else [-1.0]
    columns = ["spread" if d < 0 else f"{d:g}%" for d in shown_depths]
    for column in columns:
        table.add_column(column, justify="right")
    table.add_column("mean", justify="right")
    dirs = []
    for label, sparse_method, path, config in runs:
        run = RunDir(path, config)
        records = run_needle(hf_model, sparse_method, prompts, plan, run)
        grid = finish_grid(run, records, lengths, shown_depths, samples)
        for n, row in zip(lengths, grid):
            table.add_row(label, str(n), *(f"{v:.0f}" for v in row), f"{sum(row) / len(row):.0f}")
        heatmap(grid, [str(n) for n in lengths], columns, run.path / "heatmap.png", f"{task}, {label}", "needle depth",
                "prompt tokens")
        write_json(run.path / "grid.json", {"lengths": lengths, "depths": shown_depths, "accuracy": grid})
        dirs.append(run.path)
    console.print(table)
    wrote(dirs, "config.json, samples.jsonl, summary.json, grid.json, heatmap.png in each")
