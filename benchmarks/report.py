"""The quality report as a benchmark script: ``sparseattn report``'s runner with the same options (issue 49).

    python benchmarks/report.py --quick                                    # the first look (minutes on 2 cores)
    python benchmarks/report.py --out benchmarks/results/report            # the full run (see --help for its size)
    python benchmarks/report.py --contexts 4096 --prompts 5 --budgets 1/8 -m dense -m radar+adaptive

Prints a table per engine and context (score and 95% bootstrap interval per cell, the RULER mean against
dense's) and the perplexity table (gap ratio and ceiling-relative gap), and writes ``report.md``,
``report.json`` (with the machine and versions) and ``report.png`` under ``--out``; each cell is a run
directory there, so an interrupted run resumes (:mod:`sparseattn.evaluation.report`).
"""

from __future__ import annotations

import typer

from sparseattn.cli import Command
from sparseattn.cli.report import report


def main() -> None:
    app = typer.Typer(add_completion=False)
    app.command(cls=Command, help=report.__doc__)(report)
    app()


if __name__ == "__main__":
    main()
