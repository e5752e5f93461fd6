"""The command line's two consoles, made once: results on stdout, progress and notes on stderr; and a console on
another stream (:func:`console_on`).

Not a terminal (a log, a pipe): no 80-column default, so table cells and long lines are never split
(200 columns, long lines left whole).
"""

from __future__ import annotations

import sys
from typing import TextIO

from rich.console import Console

__all__ = ["console", "console_on", "err_console"]


def _console(stderr: bool) -> Console:
    stream = sys.stderr if stderr else sys.stdout
    return Console(stderr=stderr) if stream.isatty() else Console(stderr=stderr, soft_wrap=True, width=200)


def console_on(stream: TextIO) -> Console:
    """A console like :data:`console` that writes to ``stream`` (the terminal, while stdout goes to vLLM's log)."""
    return Console(file=stream) if stream.isatty() else Console(file=stream, soft_wrap=True, width=200)


#: Tables and results (stdout).
console = _console(stderr=False)
#: Progress and notes beside a result that goes to stdout (``sparseattn generate`` streams its text there).
err_console = _console(stderr=True)
