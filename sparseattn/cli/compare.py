"""``sparseattn compare``: dense vs sparse decoding of a batch of long prompts, side by side, in transformers.

The research view of the main job (scripts/demo.sh runs ``serving-bench``, the same question in vLLM).

Every method decodes the same ``[batch, prefill + steps + 1]`` tokens (windows of CPython stdlib
modules, one per row): the prompt is prefilled once for all methods (see
:mod:`sparseattn.evaluation.shared_prefill`), then the ground-truth tokens are fed one step at a time,
the methods' steps interleaved (one step of each in turn, the order rotating) so that the machine's
drift meets them alike. Each step is timed and scores the next token, so speed and quality come from
the same tokens: decode tokens/s (all rows), speed against dense attention (torch's SDPA, and the
cpu kernel's dense step, the like-for-like baseline), perplexity of the continuation, and how often
the method's most likely next token is dense attention's.

Why a batch of long prompts: a decode step of a 135M-parameter model reads its 0.54 GB of weights
once for the whole batch but every row's keys and values (about 47 KB per token in float32), so
attention is a small part of a batch-1 step and the larger part of a batch-8 step at 4k tokens.
That is where attending fewer tokens can pay off on this machine, and where it is measured here.
"""

from __future__ import annotations

import math
import platform
import time
from pathlib import Path

import torch
import typer
from rich.table import Table

from sparseattn.cli.checks import bad, check_dtype
from sparseattn.cli.consoles import console
from sparseattn.cli.inputs import check_positions, inspect_model
from sparseattn.cli.method_specs import parse_methods
from sparseattn.cli.options import MODEL
from sparseattn.cli.outputs import check_out, wrote
from sparseattn.methods import Dense
from sparseattn.progress import progress


#: The baselines every comparison has: torch's SDPA over every token, and the cpu kernel's dense step.
DENSE, KERNEL_DENSE = "dense (SDPA)", "dense (cpu kernel)"


def compare(
    model: str = MODEL,
    method: list[str] = typer.Option(
        ["radar+", "quest", "streamingllm"], "--method", "-m", help="sparse methods NAME[:key=value,...] (repeatable)"
    ),
    budget: int = typer.Option(1024, min=1, help="past KV tokens a decode step may attend, for every sparse method"),
    batch: int = typer.Option(8, min=1, max=64, help="sequences decoded together (one stdlib module each)"),
    prefill: int = typer.Option(4096, min=1, help="prompt tokens per sequence"),
    steps: int = typer.Option(32, min=2, help="decode steps (the first is a warm-up: scored, not timed)"),
    out: Path = typer.Option(Path("results") / "compare.json", help="the JSON written at the end"),
    dtype: str = typer.Option("float32", help="float32 or bfloat16"),
) -> None:
    """Dense vs sparse decoding of a batch of long prompts: tokens/s, speed vs dense, ppl and agreement, one table."""
    # transformers is imported only when a command runs, so that every refusal before it is quick.
    from sparseattn.evaluation.batches import stdlib_rows
    from sparseattn.evaluation.ppl import step_attended
    from sparseattn.evaluation.runs import environment, write_json
    from sparseattn.evaluation.shared_prefill import prefill_together
    from sparseattn.hf import apply, cache_kwargs

    # Every check comes before the weights load: a mistake costs seconds, not a prefill.
    torch_dtype = check_dtype(dtype, ("float32", "bfloat16"))
    # parse_methods refuses a name given twice; a row is labelled with the name as given (the budget is in the title).
    sparse = {spec: built for spec, (_, built, _) in zip(method, parse_methods(method, budget))}
    methods = {DENSE: Dense(), KERNEL_DENSE: Dense(backend="cpu"), **sparse}
    check_out(out.parent)
    info = inspect_model(model)
    check_positions(info, ["--prefill", "--steps"], prefill + steps + 1, f"--prefill {prefill} + --steps {steps} + 1",
                    "a sum within the model's positions")  # fmt: skip
    tokenizer = info.tokenizer()
    hf_model = info.load(torch_dtype)
    try:
        ids = stdlib_rows(tokenizer, batch, prefill + steps + 1)  # [B, T]
    except ValueError as err:
        raise bad(["--batch", "--prefill"], f"{err}; use a smaller batch or fewer tokens") from None
    console.print(
        f"[bold]compare[/]: {batch} sequences x {prefill} prompt tokens, {steps} decode steps, budget {budget} "
        f"for the sparse methods; {platform.processor() or platform.machine()}, {torch.get_num_threads()} threads, {dtype}"
    )
    caches = prefill_together(hf_model, methods, ids[:, :prefill])
    labels = list(methods)
    seconds = dict.fromkeys(labels, 0.0)
    nll = {label: [] for label in labels}
    agree = {label: [] for label in labels}
    attended = {label: [] for label in labels}
    with apply(hf_model, methods[DENSE]), torch.no_grad(), progress("decode", total=steps * len(labels), unit="steps") as bar:
        for i in range(steps):
            position = prefill + i
            token, target = ids[:, position : position + 1], ids[:, position + 1]
            top1 = {}
            # The order rotates so that no method always runs right after another (caches stay warm alike).
            for label in labels[i % len(labels) :] + labels[: i % len(labels)]:
                begin = time.perf_counter()
                logits = hf_model(token, **cache_kwargs(hf_model, caches[label]), use_cache=True).logits[:, -1].float()
                if i > 0:  # the first step allocates workspaces: a warm-up
                    seconds[label] += time.perf_counter() - begin
                nll[label] += torch.nn.functional.cross_entropy(logits, target, reduction="none").tolist()
                top1[label] = logits.argmax(-1)
                attended[label].append(step_attended(caches[label]))
                bar.advance()
            for label in labels:
                agree[label] += (top1[label] == top1[DENSE]).tolist()
    rows = []
    for label in labels:
        tokens_per_second = batch * (steps - 1) / seconds[label]
        rows.append({
            "method": label, "params": repr(methods[label]),
            "attended": sum(attended[label]) / len(attended[label]),
            "context": prefill + steps / 2,
            "tokens_per_second": tokens_per_second,
            "ppl": math.exp(sum(nll[label]) / len(nll[label])),
            "top1_agrees_with_dense": sum(agree[label]) / len(agree[label]),
        })  # fmt: skip
    base = {r["method"]: r for r in rows}
    for r in rows:
        r["speed_vs_dense"] = r["tokens_per_second"] / base[DENSE]["tokens_per_second"]
        r["speed_vs_kernel_dense"] = r["tokens_per_second"] / base[KERNEL_DENSE]["tokens_per_second"]
        r["ppl_vs_dense"] = r["ppl"] / base[DENSE]["ppl"] - 1
    table = Table(title=f"batch {batch}, {prefill}-token prompts, {steps} steps (interleaved); budget {budget}")
    for column in ("method", "KV tokens attended", "decode tok/s", "vs dense", "vs kernel dense", "ppl", "ppl vs dense",
                   "top-1 = dense"):  # fmt: skip
        table.add_column(column, justify="right")
    for r in rows:
        table.add_row(
            r["method"], f"{r['attended']:.0f}", f"{r['tokens_per_second']:.2f}", f"{r['speed_vs_dense']:.2f}x",
            f"{r['speed_vs_kernel_dense']:.2f}x", f"{r['ppl']:.3f}", f"{100 * r['ppl_vs_dense']:+.1f}%",
            f"{100 * r['top1_agrees_with_dense']:.1f}%",
        )
    console.print(table)
    console.print(
        "tok/s counts every row's tokens; 'vs dense' divides by torch SDPA's rate, 'vs kernel dense' by the same C "
        "kernel attending every token; ppl is of the true continuation; 'top-1 = dense' is how often the method's most "
        "likely next token is dense attention's. Speeds are this machine's, now: a shared machine drifts, ratios hold."
    )
    payload = {"config": {"model": model, "batch": batch, "prefill": prefill, "steps": steps, "budget": budget,
                          "dtype": dtype, "methods": {label: repr(m) for label, m in methods.items()}},
               "environment": environment(), "rows": rows}  # fmt: skip
    out.parent.mkdir(parents=True, exist_ok=True)
    write_json(out, payload)
    wrote([out])
