"""The options several commands take, each with one spelling, one default and one help text."""

from __future__ import annotations

from pathlib import Path

import typer

#: The spec of the embedded default model: ``sparseattn.hf.DEFAULT_MODEL``, repeated rather than
#: imported because importing ``sparseattn.hf`` loads transformers (seconds), which a mistyped
#: option should not wait for.
DEFAULT_MODEL = "default"

#: Said in the help of the sizes whose defaults are small.
QUICK = "quick defaults finish in minutes on a 2-core CPU; raise them for full-size runs"

# The options several commands take, with one spelling and one help text.
MODEL = typer.Option(DEFAULT_MODEL, help="'default' (SmolLM2-135M-Instruct), a local HF directory or a .gguf file")
METHOD = typer.Option(["dense", "radar"], "--method", "-m", help="NAME[:key=value,...]; repeat for several methods")
BUDGET = typer.Option(
    None,
    help="past KV tokens a decode step may attend (>= 1, sinks and window included), for every method with a budget "
    "whose spec sets neither budget nor top_k",
)
DTYPE = typer.Option("float32", help="float32, bfloat16 or float16")
OUT = typer.Option(Path("results"), help="root directory of the runs")

#: ``--segment``'s help, for ``serve`` and ``serving-bench``.
SEGMENT_HELP = ("the paged engine's segments inside vLLM's pages: auto (the method's own grid at the longest sequence, e.g. "
                "radar+adaptive's 4 tokens at 8k), page (a page is a segment: fastest, coarser), or a number of tokens "
                "dividing the block size")
