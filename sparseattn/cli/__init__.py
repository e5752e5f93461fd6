"""The ``sparseattn`` command line: ``compare`` (the research view of the main job), ``generate``, ``demo``,
``methods``, the evaluation commands (``ppl``, ``plot``, ``needle``, ``ruler``, ``report``, ``diagnose``, ``sweep``,
``longbench``), and ``serve`` / ``serving-bench`` (a method inside vLLM).

Each command is a module of its own, named after it. What several commands share is split by what it serves:
their options (:mod:`sparseattn.cli.options`), the checks of option values (:mod:`sparseattn.cli.checks`), the
model and texts they read (:mod:`sparseattn.cli.inputs`), method specs (:mod:`sparseattn.cli.method_specs`),
where results go (:mod:`sparseattn.cli.outputs`), and their consoles (:mod:`sparseattn.cli.consoles`)."""

from __future__ import annotations

import platform
import sys

import torch
import typer
from typer.core import TyperCommand, TyperGroup

import sparseattn
from sparseattn.cli import catalogue, compare, demo, diagnose, generate, longbench, needle, plot, ppl, report, ruler, serve, serving_bench, sweep
from sparseattn.cli.consoles import console
from sparseattn.data.cli import app as data_app


class _Layout:
    """What every command and group of the CLI shares: how its help and its errors are laid out.

    * Typer 0.29 vendors its own copy of click (``typer._click``; the installed click is not used)
      and prints every option's type in help, flags included, so that ``--help`` would read ``--help <bool>``
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


app.command("methods", cls=Command)(catalogue.list_methods)


for command in (compare.compare, demo.demo, generate.generate, ppl.ppl, plot.plot, needle.needle, ruler.ruler,
                report.report, diagnose.diagnose, sweep.sweep, serve.serve):
    app.command(cls=Command)(command)
app.command("serving-bench", cls=Command)(serving_bench.serving_bench)
for sub_app in (data_app, longbench.app):
    for info in sub_app.registered_commands:
        if info.cls in (None, TyperCommand):  # typer's default: their modules cannot import this one to name Command
            info.cls = Command
app.add_typer(data_app, name="data", cls=Group)
app.add_typer(longbench.app, name="longbench", cls=Group)
