"""vLLM's own output in a log file, so that a command that runs vLLM shows only its progress lines and its table.

vLLM writes from three places: its ``vllm`` logger (a handler on ``sys.stdout``, set up once a process starts an
engine: vllm/logger.py, ``VLLM_LOGGING_STREAM``), Python warnings (``sys.stderr``), and the engine core process it
spawns, which inherits this process's file descriptors 1 and 2 and writes to them directly (its own logger,
torch.compile, the C++ runtime, its shutdown). Setting ``VLLM_LOGGING_LEVEL`` or ``VLLM_CONFIGURE_LOGGING`` would
quiet the first only, and replacing ``sys.stdout`` does not reach another process: :func:`output_to_log` moves
the descriptors themselves (``os.dup2``), which catches all three, and hands the command a stream on the
terminal for its own lines. An engine process started inside keeps writing to the log after the block ends.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import TextIO


def log_path(out: Path) -> Path:
    """Where vLLM's output goes for a run whose result is ``out``: beside it, ``<out>.vllm.log``.

    >>> log_path(Path("results/demo.json"))
    PosixPath('results/demo.vllm.log')
    """
    return out.with_suffix(".vllm.log")


@contextlib.contextmanager
def output_to_log(log: Path) -> Iterator[TextIO]:
    """Send everything written to file descriptors 1 and 2 to ``log`` while the block runs (by this process and by
    the processes it starts); yields a text stream on the former stdout, for what the command itself prints.

    ``sys.stdout`` and ``sys.stderr`` write to the descriptors for the block, whatever they were (a test's capture, a
    notebook), and so does a ``vllm`` logger configured there; one configured before is pointed at the log for the
    block. The descriptors are restored when the block ends, also by an exception, whose traceback then reaches the
    terminal. ``log`` is written anew.
    """
    log.parent.mkdir(parents=True, exist_ok=True)
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    try:
        with open(log, "w", buffering=1) as file, text_on(os.dup(saved[0])) as terminal:
            os.dup2(file.fileno(), 1)
            os.dup2(file.fileno(), 2)
            handlers = [h for h in logging.getLogger("vllm").handlers  # a log file of the user's own is left as it is
                        if isinstance(h, logging.StreamHandler) and not isinstance(h, logging.FileHandler)]  # fmt: skip
            streams = [h.setStream(file) for h in handlers]
            # Never closed (descriptors 1 and 2 stay open): a logger configured in the block writes on after it, to
            # whatever the descriptors then are.
            stdout, stderr = text_on(1, closefd=False), text_on(2, closefd=False)
            try:
                with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
                    yield terminal
            finally:
                for handler, stream in zip(handlers, streams):
                    handler.setStream(stream)
                for buffered in (stdout, stderr, sys.stdout, sys.stderr):  # to the log, not to the terminal after the restore
                    buffered.flush()
                os.dup2(saved[0], 1)
                os.dup2(saved[1], 2)
    finally:
        for fd in saved:
            os.close(fd)


def text_on(fd: int, closefd: bool = True) -> TextIO:
    """A line-buffered text stream on descriptor ``fd``, in stdout's encoding."""
    return open(fd, "w", buffering=1, encoding=getattr(sys.stdout, "encoding", None) or "utf-8", closefd=closefd)
