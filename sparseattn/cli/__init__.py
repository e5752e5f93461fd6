"""The ``sparseattn`` command line: ``generate``, ``demo``, ``methods``, and the evaluation sub-commands."""

from __future__ import annotations

import platform

import torch
import typer
from rich.console import Console
from rich.table import Table

import sparseattn
from sparseattn.cli.demo import demo
from sparseattn.cli.evaluate import diagnose, longbench_run, needle, plot, ppl, sweep
from sparseattn.cli.generate import generate
from sparseattn.cli.methods import METHODS
from sparseattn.data.cli import app as data_app
from sparseattn.evaluation.longbench_cli import app as longbench_app

app = typer.Typer(no_args_is_help=True, add_completion=False, help=__doc__)
console = Console()


@app.callback()
def main() -> None:
    """sparseattn: composable sparse attention for long-context decoding."""


@app.command()
def version() -> None:
    """Print the package, torch and transformers versions."""
    import transformers

    console.print(
        f"sparseattn {sparseattn.__version__}, torch {torch.__version__}, transformers {transformers.__version__}, "
        f"python {platform.python_version()}"
    )


@app.command("methods")
def list_methods() -> None:
    """List the method names ``--method`` accepts, with their options and a one-line description."""
    table = Table(title="methods")
    for column in ("name", "options", "description"):
        table.add_column(column)
    for spec in METHODS.values():
        table.add_row(spec.name, ", ".join(f"--{o.replace('_', '-')}" for o in spec.options) or "-", spec.description)
    console.print(table)


app.command()(demo)
app.command()(generate)
for command in (ppl, plot, needle, diagnose, sweep):
    app.command()(command)
longbench_app.command("run")(longbench_run)
app.add_typer(data_app, name="data")
app.add_typer(longbench_app, name="longbench")
