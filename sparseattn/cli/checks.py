"""The checks of a command's options: a mistake ends with one line naming the option, the value and what is
allowed, and exit code 2.

Every command checks all of its input before any work starts (the model's weights are loaded last).
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

import torch
import typer

#: The ``--dtype`` values, and the torch dtypes they name.
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def bad(options: str | Sequence[str], message: str) -> typer.BadParameter:
    """A usage error (exit code 2) naming ``options``: ``Invalid value for '--steps': ...``."""
    return typer.BadParameter(message, param_hint=[options] if isinstance(options, str) else list(options))


def refuse(message: str) -> typer.Exit:
    """A refusal that is not about one option's value (vLLM missing): one ``Error:`` line, exit status 2."""
    sys.stdout.flush()
    sys.stderr.write(f"Error: {message}\n")
    sys.stderr.flush()
    return typer.Exit(2)


def check_range(option: str, value: float | None, low: float, high: float | None = None) -> None:
    """Refuse ``value`` outside ``[low, high]`` (no upper end when ``high`` is None); None passes."""
    if value is None or (low <= value and (high is None or value <= high)):
        return
    allowed = f">= {_number(low)}" if high is None else f"from {_number(low)} to {_number(high)}"
    raise bad(option, f"{_number(value)} is out of range; allowed: {allowed}")


def segment_choice(value: str, option: str = "--segment") -> int | str | None:
    """``--segment`` as the plugin's config takes it: ``"auto"``, None for ``"page"``, or a number of tokens (>= 1).

    >>> segment_choice("auto"), segment_choice("page"), segment_choice("4")
    ('auto', None, 4)
    """
    word = value.strip().lower()
    if word in ("auto", "page"):
        return None if word == "page" else word
    if not word.isdigit():
        raise bad(option, f"{value!r} is not allowed; allowed: auto, page or a number of tokens dividing the block size")
    check_range(option, int(word), 1)
    return int(word)


def _number(value: float) -> str:
    """``150`` for 150.0 and for 150 (however large), ``2.5`` for 2.5."""
    return str(int(value)) if float(value).is_integer() else f"{value:g}"


def check_dtype(dtype: str, allowed: Sequence[str] = tuple(DTYPES)) -> torch.dtype:
    """The torch dtype ``--dtype`` names, one of ``allowed``."""
    if dtype not in allowed:
        raise bad("--dtype", f"{dtype!r} is not one of {', '.join(allowed)}")
    return DTYPES[dtype]


def check_decoding(dtype: str, prefill: int, steps: int, min_prefill: int = 0) -> torch.dtype:
    """The torch dtype of a run that prefills a text and decodes on, after checking ``--prefill`` and ``--steps``."""
    torch_dtype = check_dtype(dtype)
    check_range("--prefill", prefill, min_prefill)
    check_range("--steps", steps, 1)
    return torch_dtype


def check_grid(lengths: Sequence[int], depths: Sequence[float], samples: int, max_new_tokens: int | None) -> None:
    """Refuse a retrieval grid's ``--length`` below 1, ``--depth`` outside 0 to 100 percent, ``--samples`` or
    ``--max-new-tokens`` below 1."""
    for length in lengths:
        check_range("--length", length, 1)
    for depth in depths:
        check_range("--depth", depth, 0, 100)
    check_range("--samples", samples, 1)
    check_range("--max-new-tokens", max_new_tokens, 1)
