"""``sparseattn generate``: stream a model's greedy continuation of a prompt under a sparse method."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch
import typer
from rich.console import Console
from transformers import TextStreamer

from sparseattn.cli.methods import MethodOptions, build_method
from sparseattn.hf import DEFAULT_MODEL, apply, load_model

console = Console(stderr=True)


class TimedStreamer(TextStreamer):
    """Prints new text as it is decoded and records when each new token arrived."""

    def __init__(self, tokenizer, echo: bool = True) -> None:
        super().__init__(tokenizer, skip_prompt=True, skip_special_tokens=True)
        self.echo = echo
        self.arrivals: list[float] = []
        self._prompt_seen = False

    def put(self, value: torch.Tensor) -> None:
        if self._prompt_seen:
            self.arrivals.append(time.perf_counter())
        self._prompt_seen = True
        super().put(value)

    def on_finalized_text(self, text: str, stream_end: bool = False) -> None:
        if self.echo:
            sys.stdout.write(text + ("\n" if stream_end else ""))
            sys.stdout.flush()


def read_prompt(prompt: str | None, prompt_file: Path | None) -> str:
    if (prompt is None) == (prompt_file is None):
        raise typer.BadParameter("give exactly one of --prompt or --prompt-file")
    if prompt_file is not None:
        if not prompt_file.is_file():
            raise typer.BadParameter(f"--prompt-file {prompt_file} is not a file")
        return prompt_file.read_text(encoding="utf-8", errors="replace")
    return prompt


def generate(
    model: str = typer.Option(DEFAULT_MODEL, help="'default' (SmolLM2-135M-Instruct), a local HF directory or a .gguf file"),
    method: str = typer.Option("radar", help="method name (see `sparseattn methods`)"),
    prompt: str | None = typer.Option(None, help="the prompt text"),
    prompt_file: Path | None = typer.Option(None, help="read the prompt from this file"),
    max_new_tokens: int = typer.Option(64, min=1),
    max_prompt_tokens: int | None = typer.Option(
        None, help="keep only the last N prompt tokens (default: refuse prompts longer than the model's window)"
    ),
    chat: bool = typer.Option(False, help="wrap the prompt as one user turn of the tokenizer's chat template"),
    top_k: int | None = typer.Option(None, help="segments attended per step (Radar family)"),
    n_features: int = typer.Option(2048, help="random features n (Radar)"),
    sinks: int | None = typer.Option(None, help="first tokens always attended (default: 0; StreamingLLM 4)"),
    window: int | None = typer.Option(None, help="last tokens always attended (default: 0; SubGen 32)"),
    seed: int = typer.Option(0),
    budget: int | None = typer.Option(
        None, help="past KV tokens a decode step may attend, sinks and window included (default: each method's own)"
    ),
    heavy_ratio: float | None = typer.Option(None, help="share of the budget for heavy hitters (H2O, default 0.5)"),
    observation_window: int | None = typer.Option(None, help="prompt queries that vote (SnapKV, default 32)"),
    page_size: int | None = typer.Option(None, help="tokens per page (Quest, default 16)"),
    prefill_budget: int | None = typer.Option(
        None, help="tokens the prompt is compressed to (snapkv+radar, default 4 x budget)"
    ),
    dtype: str = typer.Option("float32", help="float32, bfloat16 or float16"),
    quiet: bool = typer.Option(False, help="do not stream the generated text"),
) -> None:
    """Greedy generation under a sparse method, streamed; ends with tokens/s and KV tokens attended per step."""
    options = MethodOptions(
        top_k=top_k,
        n_features=n_features,
        sinks=sinks,
        window=window,
        seed=seed,
        budget=budget,
        heavy_ratio=heavy_ratio,
        observation_window=observation_window,
        page_size=page_size,
        prefill_budget=prefill_budget,
    )
    try:
        sparse_method = build_method(method, options)
    except ValueError as err:
        raise typer.BadParameter(str(err), param_hint="--method") from None
    text = read_prompt(prompt, prompt_file)
    torch_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}.get(dtype)
    if torch_dtype is None:
        raise typer.BadParameter(f"--dtype must be float32, bfloat16 or float16, got {dtype!r}")
    hf_model, tokenizer = load_model(model, dtype=torch_dtype)
    if chat:
        ids = tokenizer.apply_chat_template(
            [{"role": "user", "content": text}], add_generation_prompt=True, return_tensors="pt", return_dict=True
        )["input_ids"]
    else:
        ids = tokenizer(text, return_tensors="pt")["input_ids"]
    window_size = getattr(hf_model.config, "max_position_embeddings", None)
    if max_prompt_tokens is not None:
        ids = ids[:, -max_prompt_tokens:]
    if window_size is not None and ids.shape[1] + max_new_tokens > window_size:
        raise typer.BadParameter(
            f"the prompt has {ids.shape[1]} tokens and {max_new_tokens} new tokens would make {ids.shape[1] + max_new_tokens}, "
            f"beyond the model's {window_size} positions; pass --max-prompt-tokens {window_size - max_new_tokens} to keep "
            "the end of the prompt"
        )
    console.print(f"[bold]{method}[/]: {sparse_method!r}\nprompt: {ids.shape[1]} tokens; model: {hf_model.config.name_or_path}")
    streamer = TimedStreamer(tokenizer, echo=not quiet)
    with apply(hf_model, sparse_method) as sparse:
        cache = sparse.new_cache()
        start = time.perf_counter()
        with torch.no_grad():
            out = hf_model.generate(
                ids.to(hf_model.device),
                attention_mask=torch.ones_like(ids).to(hf_model.device),
                max_new_tokens=max_new_tokens,
                do_sample=False,
                past_key_values=cache,
                streamer=streamer,
                pad_token_id=tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id,
            )
    new_tokens = out.shape[1] - ids.shape[1]
    first = streamer.arrivals[0] - start if streamer.arrivals else float("nan")
    decode_s = streamer.arrivals[-1] - streamer.arrivals[0] if len(streamer.arrivals) > 1 else float("nan")
    decode_tps = (len(streamer.arrivals) - 1) / decode_s if decode_s and decode_s > 0 else float("nan")
    console.print(
        f"[bold]{new_tokens} tokens[/]; prefill + first token {first:.2f} s; decode {decode_tps:.2f} tokens/s; "
        f"KV tokens attended per step {cache.mean_attended():.0f} of {cache.mean_stored():.0f} stored "
        "(mean over layers, heads and decode steps)"
    )
