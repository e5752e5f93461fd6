"""``sparseattn sweep``: the Radar paper's sweeps of n (random features) and k (segments), and its selection ablation."""

from __future__ import annotations

from pathlib import Path

import typer
from rich.table import Table

from sparseattn.cli.checks import check_decoding, check_range
from sparseattn.cli.consoles import console
from sparseattn.cli.inputs import inspect_model, text_tokens
from sparseattn.cli.method_specs import parse_method
from sparseattn.cli.options import DTYPE, MODEL, OUT, QUICK
from sparseattn.cli.outputs import check_out, plan_runs, run_name, slug, wrote


def sweep(
    model: str = MODEL,
    text: str = typer.Option("pydecimal", help="a text name or a file"),
    prefill: int = typer.Option(2048, help="prompt tokens prefilled densely (>= 0)"),
    steps: int = typer.Option(128, help=f"decode steps per run (>= 1; {QUICK})"),
    n_features: list[int] = typer.Option([64, 256, 1024, 2048], "--n", help="random feature counts n (k fixed)"),
    top_k: list[int] = typer.Option([2, 4, 8, 16], "--k", help="segments k (n fixed)"),
    fixed_n: int = typer.Option(2048, help="n while sweeping k"),
    fixed_k: int = typer.Option(8, help="k while sweeping n and in the ablation"),
    window: int = typer.Option(0, help="recent window for every Radar run (>= 0)"),
    out: Path = OUT,
    dtype: str = DTYPE,
) -> None:
    """The paper's n and k sweeps and the selection ablation (lowest / random / recent / approximate / exact)."""
    torch_dtype = check_decoding(dtype, prefill, steps)
    for option, values in (("--n", n_features), ("--k", top_k), ("--fixed-n", [fixed_n]), ("--fixed-k", [fixed_k])):
        for value in values:
            check_range(option, value, 1)
    check_range("--window", window, 0)
    check_out(out)
    info = inspect_model(model)
    ids = text_tokens(info, text, prefill, steps, extra=1)  # the last step's target too
    root = out / run_name("sweep", dtype, slug(text), f"p{prefill}", f"s{steps}")
    # Algorithm 1's parts throughout: the ablation presets swap one part of radar-alg1, so the selection
    # panel compares them with radar-alg1 on the same segment grid.
    panels_specs = {
        "n (random features)": [(n, f"radar-alg1:n_features={n},top_k={fixed_k},window={window}") for n in n_features],
        "k (segments)": [(k, f"radar-alg1:n_features={fixed_n},top_k={k},window={window}") for k in top_k],
        "selection": [(name, f"{spec}:top_k={fixed_k},window={window}")
                      for name, spec in (("lowest", "radar-lowest"), ("random", "radar-random"), ("recent", "radar-recent"),
                                         ("radar", "radar-alg1"), ("exact", "radar-exact"))],
    }
    # Every point is a perplexity run; a spec in two panels (n = --fixed-n, k = --fixed-k) is one run.
    specs = list(dict.fromkeys(["dense"] + [spec for points in panels_specs.values() for _, spec in points]))
    planned = plan_runs(root, [parse_method(spec) for spec in specs], {
        "command": "ppl", "model": model, "text": text, "prefill": prefill, "steps": steps, "dtype": dtype,
    })  # fmt: skip
    runs = dict(zip(specs, planned))

    from sparseattn.evaluation.plots import sweep_figure
    from sparseattn.evaluation.ppl import run_ppl
    from sparseattn.evaluation.runs import RunDir, write_json

    hf_model = info.load(torch_dtype)

    def measure(spec: str) -> float:
        label, sparse_method, path, config = runs[spec]
        return run_ppl(hf_model, sparse_method, ids, prefill, steps, RunDir(path, config), label=label)["ppl"]

    dense = measure("dense")
    panels = {name: [(value, measure(spec)) for value, spec in points] for name, points in panels_specs.items()}
    write_json(root / "sweep.json", {"dense": dense, "panels": {k: [list(p) for p in v] for k, v in panels.items()}})
    sweep_figure(panels, root / "sweep.png", f"{text}: prefill {prefill}, {steps} steps", reference=dense)
    table = Table(title=f"sweep on {text} (dense ppl {dense:.3f})")
    for column in ("panel", "value", "ppl"):
        table.add_column(column)
    for name, points in panels.items():
        for value, metric in points:
            table.add_row(name, str(value), f"{metric:.3f}")
    console.print(table)
    wrote([root / "sweep.png", root / "sweep.json"], f"and one run directory per point under {root}")
