"""What a command reads before it runs: the model (its config, positions and tokenizer, weights last) and its texts.

Each is checked as it is read: a model that cannot be found, a text that is not known, or a run that needs more
positions than the model has ends with the option's one-line error (:func:`sparseattn.cli.checks.bad`).
"""

from __future__ import annotations

import difflib
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import typer
from rich.markup import escape

from sparseattn.cli.checks import bad
from sparseattn.cli.consoles import console
from sparseattn.cli.method_specs import parse_methods
from sparseattn.cli.outputs import check_out
from sparseattn.progress import progress


@dataclass(frozen=True)
class ModelInfo:
    """A model spec resolved to its local directory and config, its weights not loaded."""

    spec: str
    directory: Path
    config: Any

    @property
    def window(self) -> int | None:
        """The positions the model was trained for (``max_position_embeddings``), None if unknown."""
        return getattr(self.config, "max_position_embeddings", None)

    def tokenizer(self):
        from transformers import AutoTokenizer

        try:
            return AutoTokenizer.from_pretrained(self.directory, local_files_only=True)
        except (OSError, ValueError) as err:
            raise bad("--model", f"{self.spec!r}: no tokenizer that transformers can load in {self.directory}: {err}") from None

    def load(self, dtype: torch.dtype):
        """The model's weights, in eval mode (the last step of every command: checks come first)."""
        from sparseattn.hf import load_model

        return load_model(self.spec, dtype=dtype)[0]


def inspect_model(model: str) -> ModelInfo:
    """Resolve ``--model`` and read its config, without loading weights (a GGUF spec converts once)."""
    from transformers import AutoConfig

    from sparseattn.hf.models import ModelSourceError, local_model_dir

    try:
        directory = local_model_dir(model)
    except ModelSourceError as err:
        raise bad("--model", str(err)) from None
    try:
        config = AutoConfig.from_pretrained(directory, local_files_only=True)
    except (OSError, ValueError) as err:
        raise bad("--model", f"{model!r}: cannot read the config in {directory}: {err}") from None
    return ModelInfo(model, directory, config)


def check_positions(info: ModelInfo, options: str | Sequence[str], needed: int, how: str, allowed: str) -> None:
    """Refuse a run that needs more positions than the model has: ``how`` says how ``needed`` adds up."""
    if info.window is not None and needed > info.window:
        raise bad(options, f"{how} = {needed} positions, beyond the model's {info.window}; allowed: {allowed}")


def check_lengths(info: ModelInfo, lengths: Sequence[int]) -> None:
    """Refuse a ``--length`` (a prompt with its answer) beyond the model's positions."""
    for length in lengths:
        if info.window is not None and length > info.window:
            raise bad("--length", f"{length} is beyond the model's {info.window} positions; allowed: up to {info.window}")


def chat_tokenizer(info: ModelInfo, chat: bool):
    """The model's tokenizer; with ``--chat``, refused unless it has a chat template."""
    tokenizer = info.tokenizer()
    if chat and getattr(tokenizer, "chat_template", None) is None:
        raise bad("--chat", f"the tokenizer of {info.spec!r} has no chat template")
    return tokenizer


def check_buildable(prompts, plan: Sequence[tuple[int, float, int]], window: int | None, answer: str) -> None:
    """Refuse a ``--length`` of the ``plan`` shorter than its prompt without any haystack, plus the answer.

    ``prompts`` is a :class:`sparseattn.evaluation.generation.RetrievalPrompts`; ``answer`` says where
    the answer's tokens come from (``--max-new-tokens 16``).
    """
    shortest = prompts.shortest_lengths(plan)
    for length in dict.fromkeys(length for length, _, _ in plan):
        if length < shortest[length]:
            raise bad("--length", f"{length} is too short for {prompts.task.name}: its prompt without any haystack has "
                      f"{shortest[length] - prompts.max_new_tokens} tokens, and {answer} come on top; "
                      f"allowed: {shortest[length]} to {window}")


def retrieval_inputs(model: str, method: Sequence[str], budget: int | None, out: Path, lengths: Sequence[int],
                     haystack: str | None, chat: bool):  # fmt: skip
    """What a retrieval command (``needle``, ``ruler``) checks and reads before any prompt is built:
    ``(methods, model info, haystack text or None, tokenizer)``; ``haystack`` None when no task needs one."""
    resolved = parse_methods(method, budget)
    check_out(out)
    info = inspect_model(model)
    check_lengths(info, lengths)
    haystack_text = None if haystack is None else read_text(haystack, "--haystack")
    return resolved, info, haystack_text, chat_tokenizer(info, chat)


def read_text(name: str, option: str = "--text") -> str:
    """A text by name (``sparseattn data list``) or a file; a text not fetched yet is fetched (with progress)."""
    from sparseattn.data.sources import TEXTS, FetchError, get_text, load_text

    path = Path(name).expanduser()
    if path.is_file():
        return path.read_text(encoding="utf-8", errors="replace")
    try:
        entry = get_text(name)
    except ValueError:
        close = difflib.get_close_matches(name, TEXTS, n=3)
        hint = f"did you mean {', '.join(close)}? " if close else ""
        raise bad(option, f"{name!r} is neither a file nor a known text; {hint}allowed: a file or a name from "
                  "`sparseattn data list`") from None
    try:
        if entry.fetched:
            return load_text(name)
        with progress(f"fetching the text {name} (once)"):
            return load_text(name)
    except FetchError as err:
        console.print(f"[red]error:[/] {escape(str(err))}")
        raise typer.Exit(1) from None


def text_tokens(info: ModelInfo, text: str, prefill: int, steps: int, extra: int = 0) -> torch.Tensor:
    """The first ``prefill + steps + extra`` tokens of the text ``--text`` names: ``[prefill + steps + extra]``.

    Refused where the model has fewer positions or the text fewer tokens (``extra``: the tokens a run
    reads beyond its steps, such as the target of the last one).
    """
    from sparseattn.evaluation.ppl import tokenize

    needed = prefill + steps + extra
    how = f"--prefill {prefill} + --steps {steps}" + (f" + {extra}" if extra else "")
    allowed = f"--prefill + --steps <= {(info.window or 0) - extra}"
    check_positions(info, ["--prefill", "--steps"], needed, how, allowed)
    tokenizer, content = info.tokenizer(), read_text(text)
    try:
        return tokenize(tokenizer, content, needed, name=text)
    except ValueError as err:
        raise bad("--text", f"{err} ({how}); use a longer text or fewer steps") from None
