"""Progress for every wait longer than a few seconds: a live bar in a terminal, periodic lines in logs.

In a terminal a rich bar (or spinner, when the total is unknown) is drawn on stderr and removed when
the work ends. When stderr is not a terminal (CI logs, pipes) a bar would print nothing useful, so a
line is written when the work starts, then every ``$SPARSEATTN_PROGRESS_SECONDS`` seconds (default 10)
while it runs, from a background thread, so that a single blocking call (a pip download, one long
prefill layer) still shows it is alive, and a last line when it ends. Each line names the work, how far
it is and the seconds elapsed, e.g. ``prefill 4096 tokens: 12/30 layers, 21 s``.

>>> with progress("counting", total=3, unit="items") as bar:
...     for _ in range(3):
...         bar.advance()
>>> bar.completed
3
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import time
from collections.abc import Iterator

import torch

#: Seconds between two progress lines when stderr is not a terminal.
DEFAULT_INTERVAL = 10.0


def _interval() -> float:
    raw = os.environ.get("SPARSEATTN_PROGRESS_SECONDS", "")
    try:
        value = float(raw) if raw else DEFAULT_INTERVAL
    except ValueError:
        raise ValueError(f"SPARSEATTN_PROGRESS_SECONDS must be a number of seconds, got {raw!r}") from None
    if value <= 0:
        raise ValueError(f"SPARSEATTN_PROGRESS_SECONDS must be > 0, got {raw!r}")
    return value


class Tracker:
    """How far one piece of work is; :func:`progress` hands one out and shows it."""

    def __init__(self, description: str, total: int | None, unit: str) -> None:
        self.description = description
        self.total = total
        self.unit = unit
        self.completed = 0
        self.started = time.perf_counter()
        self._on_change = None

    def advance(self, n: int = 1) -> None:
        self.completed += n
        if self._on_change is not None:
            self._on_change()

    def line(self) -> str:
        """One plain line: the work, how far it is, seconds elapsed."""
        elapsed = time.perf_counter() - self.started
        done = f"{self.completed}/{self.total} {self.unit}".rstrip() if self.total is not None else "working"
        return f"{self.description}: {done}, {elapsed:.0f} s"


@contextlib.contextmanager
def progress(description: str, total: int | None = None, unit: str = "", *, enabled: bool = True) -> Iterator[Tracker]:
    """Show the progress of the work inside the ``with`` block (see the module docstring).

    Args:
        description: what is being waited for, e.g. ``"prefill 4096 tokens"``.
        total: how many units the work has (None: unknown, a spinner / elapsed time only).
        unit: what is counted, e.g. ``"layers"``.
        enabled: False shows nothing (the tracker still counts).
    """
    tracker = Tracker(description, total, unit)
    if not enabled:
        yield tracker
        return
    if sys.stderr.isatty():
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

        columns = [SpinnerColumn(), TextColumn("{task.description}")]
        if total is not None:
            columns += [BarColumn(), MofNCompleteColumn(), TextColumn(unit)]
        columns.append(TimeElapsedColumn())
        with Progress(*columns, console=Console(stderr=True), transient=True) as bar:
            task = bar.add_task(description, total=total)
            tracker._on_change = lambda: bar.update(task, completed=tracker.completed)
            yield tracker
        return
    interval = _interval()
    stop = threading.Event()

    def heartbeat() -> None:
        while not stop.wait(interval):
            print(tracker.line(), file=sys.stderr, flush=True)

    print(f"{description}: started", file=sys.stderr, flush=True)
    thread = threading.Thread(target=heartbeat, name="sparseattn-progress", daemon=True)
    thread.start()
    try:
        yield tracker
    finally:
        stop.set()
        thread.join()
    print(f"{tracker.line()} (done)", file=sys.stderr, flush=True)


def decoder_layers(model: torch.nn.Module) -> torch.nn.ModuleList | None:
    """The decoder's list of layers (``model.model.layers`` and its relatives), None when not found."""
    for path in ("model.layers", "model.language_model.layers", "transformer.h", "model.decoder.layers", "layers"):
        module = model
        for name in path.split("."):
            module = getattr(module, name, None)
            if module is None:
                break
        if isinstance(module, torch.nn.ModuleList) and len(module) > 0:
            return module
    return None


@contextlib.contextmanager
def forward_progress(model: torch.nn.Module, description: str, *, enabled: bool = True) -> Iterator[Tracker]:
    """Progress of one long forward pass (a prefill), counted in decoder layers finished.

    Forward hooks on the decoder layers count them; nothing in the computation changes, and the hooks
    are removed on exit, also after an exception. A model whose layers are not found shows elapsed time.
    """
    layers = decoder_layers(model)
    with progress(description, total=None if layers is None else len(layers), unit="layers", enabled=enabled) as tracker:
        handles = [] if layers is None else [layer.register_forward_hook(lambda *_: tracker.advance()) for layer in layers]
        try:
            yield tracker
        finally:
            for handle in handles:
                handle.remove()
