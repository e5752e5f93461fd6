"""``sparseattn ppl``: perplexity under each method, as in the Radar paper's section 4.1."""

from __future__ import annotations

from pathlib import Path

import typer

from sparseattn.cli.common import (BUDGET, DTYPE, METHOD, MODEL, OUT, QUICK, check_decoding, check_out, inspect_model,
                                   parse_methods, plan_runs, run_name, slug, text_tokens, wrote)
from sparseattn.cli.consoles import console


def ppl(
    model: str = MODEL,
    method: list[str] = METHOD,
    budget: int | None = BUDGET,
    text: str = typer.Option("pydecimal", help="a text name (`sparseattn data list`) or a file"),
    prefill: int = typer.Option(2048, help="prompt tokens prefilled densely (>= 0; 0: generation without prompts)"),
    steps: int = typer.Option(256, help=f"decode steps (>= 1; {QUICK}; the paper: prefill 16384 + the whole text)"),
    out: Path = OUT,
    dtype: str = DTYPE,
) -> None:
    """Perplexity as in the paper's section 4.1: prefill a prompt, then feed the text token by token with the method."""
    torch_dtype = check_decoding(dtype, prefill, steps)
    resolved = parse_methods(method, budget)
    check_out(out)
    info = inspect_model(model)
    ids = text_tokens(info, text, prefill, steps, extra=1)  # the last step's target too
    root = out / run_name("ppl", dtype, slug(text), f"p{prefill}", f"s{steps}")
    runs = plan_runs(root, resolved, {"command": "ppl", "model": model, "text": text, "prefill": prefill, "steps": steps,
                                      "dtype": dtype})  # fmt: skip

    from sparseattn.evaluation.plots import ppl_table
    from sparseattn.evaluation.ppl import run_ppl
    from sparseattn.evaluation.runs import RunDir

    hf_model = info.load(torch_dtype)
    dirs = []
    for label, sparse_method, path, config in runs:
        run = RunDir(path, config)
        summary = run_ppl(hf_model, sparse_method, ids, prefill, steps, run, label=label)
        console.print(f"{label}: ppl {summary['ppl']:.3f}, {summary['tokens_per_second']:.2f} tokens/s, "
                      f"{summary['mean_attended_tokens']:.0f} KV tokens attended per step -> {run.path}", markup=False)
        dirs.append(run.path)
    console.print(ppl_table(dirs), markup=False)
    wrote(dirs, "config.json, tokens.jsonl, summary.json in each")
