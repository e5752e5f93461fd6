"""The ``sparseattn`` command line: ``compare`` (the research view of the main job), ``generate``, ``demo``, ``methods``, the evaluation
sub-commands, and ``serve`` / ``serving-bench`` (a method inside vLLM)."""

from __future__ import annotations

import platform
import sys

import torch
import typer
from rich.table import Table
from typer.core import TyperCommand, TyperGroup

import sparseattn
from sparseattn import registry
from sparseattn.cli.compare import compare
from sparseattn.cli.consoles import console
from sparseattn.cli.demo import demo
from sparseattn.cli.evaluate import diagnose, longbench_run, needle, plot, ppl, ruler, sweep
from sparseattn.cli.generate import generate
from sparseattn.cli.serving import serve, serving_bench
from sparseattn.data.cli import app as data_app
from sparseattn.evaluation.longbench_cli import app as longbench_app


class _Layout:
    """What every command and group of the CLI shares: how its help and its errors are laid out.

    * Typer 0.29 vendors its own copy of click (``typer._click``; the installed click is not used)
      and prints every option's type in help, flags included, so ``--help`` read ``--help <bool>``
      as if it took a value. A flag takes none: its type column is left empty.
    * Rich's boxes are for a terminal. In a log or a pipe they wrap at 80 columns and split an error
      message from its values, so there help and errors are plain click text: an error is then the
      usage and one ``Error: ...`` line.
    """

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        if not (sys.stdout.isatty() and sys.stderr.isatty()):
            self.rich_markup_mode = None

    def get_params(self, ctx):
        params = super().get_params(ctx)
        for param in params:
            if getattr(param, "is_flag", False) and param.metavar is None:
                param.metavar = ""  # shown instead of the type: nothing
        return params


class Command(_Layout, TyperCommand):
    """A ``sparseattn`` command (see :class:`_Layout`)."""


class Group(_Layout, TyperGroup):
    """A ``sparseattn`` command group (see :class:`_Layout`)."""


app = typer.Typer(
    no_args_is_help=True, add_completion=False, cls=Group,
    help="sparseattn: composable sparse attention for long-context decoding.",
)


@app.callback()
def main() -> None:
    """sparseattn: composable sparse attention for long-context decoding."""


@app.command(cls=Command)
def version() -> None:
    """Print the package, torch and transformers versions."""
    import transformers

    console.print(
        f"sparseattn {sparseattn.__version__}, torch {torch.__version__}, transformers {transformers.__version__}, "
        f"python {platform.python_version()}"
    )


@app.command("methods", cls=Command)
def list_methods() -> None:
    """List the method names --method accepts, with the options each takes and a one-line description."""
    table = Table(title="methods")
    for column in ("name", "options", "description"):
        table.add_column(column)
    for name in registry.names():
        entry = registry.get(name)
        table.add_row(name, ", ".join(f"--{o.replace('_', '-')}" for o in entry.option_names) or "-", entry.description)
    console.print(table)


for command in (compare, demo, generate, ppl, plot, needle, ruler, diagnose, sweep):
    app.command(cls=Command)(command)
app.command(cls=Command)(serve)
app.command("serving-bench", cls=Command)(serving_bench)
longbench_app.command("run", cls=Command)(longbench_run)
for sub_app in (data_app, longbench_app):
    for info in sub_app.registered_commands:
        info.cls = info.cls or Command  # registered in their own modules, which cannot import this one
app.add_typer(data_app, name="data", cls=Group)
app.add_typer(longbench_app, name="longbench", cls=Group)
