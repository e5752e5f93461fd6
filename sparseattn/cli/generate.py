"""``sparseattn generate``: stream a model's greedy continuation of a prompt under a sparse method."""

from __future__ import annotations

import contextlib
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import typer
from rich.markup import escape

from sparseattn import registry
from sparseattn.cli.checks import bad, check_dtype, check_range
from sparseattn.cli.consoles import err_console as console
from sparseattn.cli.inputs import inspect_model, read_text
from sparseattn.cli.method_specs import flag, range_problem
from sparseattn.cli.options import MODEL
from sparseattn.progress import forward_progress


def timed_streamer(tokenizer, echo: bool = True, on_first_token: Callable[[], None] | None = None):
    """A ``TextStreamer`` that prints new text as it is decoded and records when each new token arrived.

    ``on_first_token`` is called when the first new token arrives, i.e. when the prefill is over.
    Built on demand: importing transformers takes seconds that a mistyped option should not cost.
    """
    from transformers import TextStreamer

    class TimedStreamer(TextStreamer):
        def __init__(self) -> None:
            super().__init__(tokenizer, skip_prompt=True, skip_special_tokens=True)
            self.arrivals: list[float] = []
            self._prompt_seen = False

        def put(self, value: torch.Tensor) -> None:
            if self._prompt_seen:
                self.arrivals.append(time.perf_counter())
                if len(self.arrivals) == 1 and on_first_token is not None:
                    on_first_token()
            self._prompt_seen = True
            super().put(value)

        def on_finalized_text(self, text: str, stream_end: bool = False) -> None:
            if echo:
                sys.stdout.write(text + ("\n" if stream_end else ""))
                sys.stdout.flush()

    return TimedStreamer()


def read_prompt(prompt: str | None, prompt_file: Path | None, text: str | None) -> str:
    """The prompt from exactly one of ``--prompt``, ``--prompt-file`` and ``--text``; never empty."""
    sources = (("--prompt", prompt), ("--prompt-file", prompt_file), ("--text", text))
    given = [name for name, value in sources if value is not None]
    if len(given) != 1:
        raise bad(given or ["--prompt", "--prompt-file", "--text"], "give exactly one of --prompt, --prompt-file and --text")
    if prompt_file is not None:
        if not prompt_file.is_file():
            raise bad("--prompt-file", f"{prompt_file} is not a file")
        value = prompt_file.read_text(encoding="utf-8", errors="replace")
    elif text is not None:
        value = read_text(text)
    else:
        value = prompt
    if not value:
        raise bad(given, "the prompt is empty; give at least one character of text to continue")
    return value


def method_options(method: str, options: dict[str, object]) -> tuple[dict[str, object], str]:
    """The options given (not None) for ``--method``, refused where the method would ignore or misread them
    (:func:`sparseattn.registry.check`: an option the method does not take, a value out of its range,
    ``--top-k`` together with ``--budget``).

    ``--budget`` is the one option shared by every method, to compare them at one setting; a method
    without a budget (dense attends every past token) runs without it, and the returned note says so.
    """
    known = registry.names()
    if method not in known:
        raise bad("--method", f"unknown method {method!r}; known methods: {', '.join(known)}")
    given = {key: value for key, value in options.items() if value is not None}
    note = ""
    if "budget" in given and "budget" not in registry.get(method).option_names:
        note = f" ({method} has no budget: it attends every past token, --budget {given.pop('budget')} does not apply)"
    for key, value in given.items():
        problem = range_problem(key, value)
        if problem:
            raise bad(flag(key), problem)
    try:
        registry.check(method, given, flag)
    except registry.OptionError as err:
        raise bad([flag(key) for key in err.options], str(err)) from None
    return given, note


def generate(
    model: str = MODEL,
    method: str = typer.Option("radar", help="method name (see `sparseattn methods`)"),
    prompt: str | None = typer.Option(None, help="the prompt text"),
    prompt_file: Path | None = typer.Option(None, help="read the prompt from this file"),
    text: str | None = typer.Option(
        None, help="the prompt is this text: a name from `sparseattn data list` (e.g. pydecimal) or a file"
    ),
    max_new_tokens: int = typer.Option(64, help="tokens to generate (>= 1)"),
    max_prompt_tokens: int | None = typer.Option(
        None, help="keep only the last N prompt tokens (>= 1; default: refuse prompts longer than the model's window)"
    ),
    chat: bool = typer.Option(False, help="wrap the prompt as one user turn of the tokenizer's chat template"),
    top_k: int | None = typer.Option(None, help="segments attended per step (Radar family; not with --budget)"),
    n_features: int | None = typer.Option(None, help="random features n (Radar family; default: the method's own)"),
    sinks: int | None = typer.Option(None, help="first tokens always attended (default: the method's own)"),
    window: int | None = typer.Option(None, help="last tokens always attended (default: the method's own)"),
    seed: int | None = typer.Option(None, help="seed of the methods that draw at random (default 0)"),
    budget: int | None = typer.Option(
        None, help="past KV tokens a decode step may attend, sinks and window included (default: each method's own)"
    ),
    heavy_ratio: float | None = typer.Option(None, help="share of the budget for heavy hitters (H2O, default 0.5)"),
    observation_window: int | None = typer.Option(None, help="prompt queries that vote (SnapKV, default 32)"),
    page_size: int | None = typer.Option(None, help="tokens per page (Quest, default 16)"),
    prefill_budget: int | None = typer.Option(
        None, help="tokens the prompt is compressed to (snapkv-then-radar, default 4 x budget)"
    ),
    dtype: str = typer.Option("float32", help="float32, bfloat16 or float16"),
    quiet: bool = typer.Option(False, help="do not stream the generated text"),
) -> None:
    """Greedy generation under a sparse method, streamed; ends with tokens/s and KV tokens attended per step.

    Only the options the method takes are accepted (`sparseattn methods` lists them), except --budget,
    which a method without a budget (dense) ignores, so that one command line compares every method.
    """
    torch_dtype = check_dtype(dtype)
    check_range("--max-new-tokens", max_new_tokens, 1)
    check_range("--max-prompt-tokens", max_prompt_tokens, 1)
    options, note = method_options(method, {
        "top_k": top_k, "n_features": n_features, "sinks": sinks, "window": window, "seed": seed, "budget": budget,
        "heavy_ratio": heavy_ratio, "observation_window": observation_window, "page_size": page_size,
        "prefill_budget": prefill_budget,
    })  # fmt: skip
    prompt_text = read_prompt(prompt, prompt_file, text)
    info = inspect_model(model)
    window_size = info.window
    if window_size is not None and max_new_tokens >= window_size:
        raise bad("--max-new-tokens", f"{max_new_tokens} is out of range; allowed: from 1 to {window_size - 1} "
                  f"(the model has {window_size} positions, and the prompt needs one)")
    if window_size is not None and max_prompt_tokens is not None and max_prompt_tokens + max_new_tokens > window_size:
        raise bad(["--max-prompt-tokens", "--max-new-tokens"],
                  f"{max_prompt_tokens} + {max_new_tokens} = {max_prompt_tokens + max_new_tokens} positions, beyond the "
                  f"model's {window_size}; allowed: --max-prompt-tokens + --max-new-tokens <= {window_size}")
    tokenizer = info.tokenizer()

    from sparseattn.evaluation.generation import encode_prompt

    try:
        ids = encode_prompt(tokenizer, prompt_text, chat)
    except ValueError as err:
        raise bad("--chat", str(err)) from None
    if ids.shape[1] == 0:
        raise bad("--prompt", "the prompt has no tokens; give text to continue")
    if max_prompt_tokens is not None:
        ids = ids[:, -max_prompt_tokens:]
    if window_size is not None and ids.shape[1] + max_new_tokens > window_size:
        raise bad(
            "--max-prompt-tokens",
            f"the prompt has {ids.shape[1]} tokens and {max_new_tokens} new tokens would make {ids.shape[1] + max_new_tokens}, "
            f"beyond the model's {window_size} positions; pass --max-prompt-tokens {window_size - max_new_tokens} to keep "
            "the end of the prompt",
        )
    sparse_method = registry.build(method, **options)

    from sparseattn.evaluation.generation import generate_greedy
    from sparseattn.hf import apply

    hf_model = info.load(torch_dtype)
    console.print(f"[bold]{method}[/]: {escape(repr(sparse_method))}{escape(note)}\nprompt: {ids.shape[1]} tokens; "
                  f"model: {escape(str(hf_model.config.name_or_path))}")
    with contextlib.ExitStack() as prefilling:
        # The prompt's prefill is the long silent wait: show its layers until the first new token.
        prefilling.enter_context(forward_progress(hf_model, f"prefill {ids.shape[1]} tokens"))
        streamer = timed_streamer(tokenizer, echo=not quiet, on_first_token=prefilling.close)
        with apply(hf_model, sparse_method) as sparse:
            cache = sparse.new_cache()
            start = time.perf_counter()
            out = generate_greedy(hf_model, tokenizer, cache, ids, max_new_tokens, streamer=streamer)
    new_tokens = out.shape[1] - ids.shape[1]
    first = streamer.arrivals[0] - start if streamer.arrivals else float("nan")
    decode_s = streamer.arrivals[-1] - streamer.arrivals[0] if len(streamer.arrivals) > 1 else float("nan")
    decode_tps = (len(streamer.arrivals) - 1) / decode_s if decode_s and decode_s > 0 else float("nan")
    console.print(
        f"[bold]{new_tokens} tokens[/]; prefill + first token {first:.2f} s; decode {decode_tps:.2f} tokens/s; "
        f"KV tokens attended per step {cache.mean_attended():.0f} of {cache.mean_stored():.0f} stored "
        "(mean over layers, heads and decode steps)"
    )
