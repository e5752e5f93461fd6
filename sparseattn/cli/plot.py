"""``sparseattn plot``: the perplexity runs' curves (the Radar paper's Figure 3 layout) and a markdown table."""

from __future__ import annotations

from pathlib import Path

import typer

from sparseattn.cli.checks import bad
from sparseattn.cli.consoles import console
from sparseattn.cli.outputs import check_out, wrote


def plot(
    runs: list[Path] = typer.Argument(..., help="perplexity run directories (or parents of them)"),
    out: Path = typer.Option(
        Path("ppl.png"), help="the picture to write (.png, .pdf, .svg, ...); a markdown table goes beside it (.md)"
    ),
    title: str | None = typer.Option(None),
) -> None:
    """Perplexity and cumulative time vs position (the paper's Figure 3 layout) and a markdown table."""
    missing = [str(path) for path in runs if not path.exists()]
    if missing:
        raise bad("RUNS", f"{', '.join(missing)} does not exist")
    from matplotlib.backend_bases import FigureCanvasBase

    formats = FigureCanvasBase.get_supported_filetypes()
    if out.suffix.lstrip(".").lower() not in formats:
        raise bad("--out", f"{out}: {out.suffix or 'no suffix'} is not a picture format; allowed: "
                  f"{', '.join('.' + f for f in sorted(formats))}")
    check_out(out.parent)
    found = []
    for path in runs:
        found += [path] if (path / "summary.json").exists() else sorted(p.parent for p in path.glob("*/summary.json"))
    if not found:
        raise bad("RUNS", f"no finished run (a directory with summary.json) in or under {', '.join(map(str, runs))}")

    from sparseattn.evaluation.plots import ppl_figure, ppl_table

    out.parent.mkdir(parents=True, exist_ok=True)
    ppl_figure(found, out, title)
    table = ppl_table(found)
    out.with_suffix(".md").write_text(table + "\n")
    console.print(table, markup=False)
    wrote([out, out.with_suffix(".md")])
