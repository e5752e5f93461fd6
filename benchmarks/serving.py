"""Decode speed inside vLLM: stock vLLM's dense kernel vs the sparseattn plugin's paged engine (issue 16, item 7).

Every sequence of a batch reads one shared document (the repository's README and docs, cut to
``--context`` tokens) followed by its own short question, so prefix caching prefills the document
once per engine while decode still reads every sequence's pages. Runs (vLLM's ``LLM``, bfloat16,
greedy, ``ignore_eos``):

* ``stock``: vLLM's CPU backend, no plugin involvement (no ``additional_config``);
* ``dense``: the plugin's paged engine over every page (its reference path);
* ``quest``, ``radar+``: the plugin at ``--budget`` tokens.

All engines are started first and kept (one engine process each); measurements then alternate
between them, in the order of ``--runs`` rounds reversed every other round (ABCD DCBA ...), so that
the machine's drift hits every engine alike. One measurement: the batch's prompts generate 1 token
(``t1``: the questions' prefill, the document being cached) and ``--new-tokens`` tokens (``tN``); the
decode time is ``tN - t1`` for ``N - 1`` steps: time per output token ``(tN - t1) / (N - 1)`` and
throughput ``batch * (N - 1) / (tN - t1)`` (tokens/s over all sequences). The median over rounds is
reported.

Correctness first: each run's greedy tokens are compared with stock vLLM's (``same``: sequences
whose ``N`` tokens all equal stock's; ``first diff``: the earliest step where any differs). The
plugin's dense path should equal stock up to bfloat16 near-ties (docs/serving.md); a sparse run
below the context may differ. No speed-up is printed for a dense run that disagrees with stock.

    /work/venv-vllm/bin/python benchmarks/serving.py --context 2048 --batches 1 8 --new-tokens 32 --runs 2

Writes ``benchmarks/results/serving-cpu-c<context>.json``. Needs vLLM (docs/serving.md, the venv).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import statistics
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
QUESTIONS = [
    "What is this project for?", "Which methods does it offer?", "How is a method chosen?", "What does a budget mean?",
    "How are results checked?", "Which models are supported?", "What runs on the CPU?", "What does radar+ add?",
    "How is a benchmark run?", "What is a segment?", "What is a sink?", "What is the window?",
    "How is quality measured?", "What does the CLI do?", "How is vLLM used?", "What is still missing?",
]


def runs_for(budget: int) -> dict[str, dict]:
    """Run label -> extra ``LLM`` arguments."""
    return {
        "stock": {},
        "dense": {"additional_config": {"sparseattn": {"method": "dense"}}},
        f"quest ({budget})": {"additional_config": {"sparseattn": {"method": "quest", "budget": budget}}},
        f"radar+ ({budget})": {"additional_config": {"sparseattn": {"method": "radar+", "budget": budget}}},
    }


def document(tokenizer, tokens: int) -> str:
    """The README and docs/*.md, repeated if need be, cut to ``tokens`` tokens."""
    text = "\n\n".join(p.read_text() for p in [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))])
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    while len(ids) < tokens:
        ids = ids + ids
    return tokenizer.decode(ids[:tokens])


def prompts(doc: str, batch: int) -> list[str]:
    return [f"{doc}\n\nQuestion: {QUESTIONS[i % len(QUESTIONS)]} (#{i})\nAnswer:" for i in range(batch)]


def timed(llm, batch_prompts: list[str], tokens: int) -> tuple[float, list[list[int]]]:
    from vllm import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=tokens, min_tokens=tokens, ignore_eos=True)
    start = time.perf_counter()
    outs = llm.generate(batch_prompts, params, use_tqdm=False)
    return time.perf_counter() - start, [list(o.outputs[0].token_ids) for o in outs]


def measure(llm, batch_prompts: list[str], new_tokens: int) -> dict:
    t1, _ = timed(llm, batch_prompts, 1)
    tn, tokens = timed(llm, batch_prompts, new_tokens)
    decode = max(tn - t1, 1e-9)
    steps = new_tokens - 1
    return {"t1_s": t1, "tN_s": tn, "tpot_ms": 1e3 * decode / steps, "tok_s": len(batch_prompts) * steps / decode, "tokens": tokens}


def compare(tokens: list[list[int]], ref: list[list[int]]) -> tuple[int, int | None]:
    """Sequences equal to ``ref``, and the first step where any differs (None: none)."""
    same = sum(a == b for a, b in zip(tokens, ref))
    diffs = [next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None) for a, b in zip(tokens, ref)]
    found = [d for d in diffs if d is not None]
    return same, (min(found) if found else None)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--context", type=int, default=2048, help="tokens of the shared document")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--runs", type=int, default=2, help="rounds of alternating measurements (median reported)")
    parser.add_argument("--budget", type=int, default=1024)
    parser.add_argument("--only", nargs="+", default=None, help="run labels to keep (default: all)")
    parser.add_argument("--kv-cache-gib", type=int, default=1, help="VLLM_CPU_KVCACHE_SPACE per engine")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    if args.new_tokens < 2:
        parser.error(f"--new-tokens must be >= 2, got {args.new_tokens}")

    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(args.kv_cache_gib))
    import torch
    import vllm
    from rich.console import Console
    from rich.table import Table
    from transformers import AutoTokenizer
    from vllm import LLM

    from sparseattn.evaluation.runs import environment
    from sparseattn.hf.models import local_model_dir

    model = str(local_model_dir())
    runs = runs_for(args.budget)
    if args.only:
        runs = {k: v for k, v in runs.items() if k in args.only}
    if "stock" not in runs:
        parser.error("the stock run is the reference: keep it in --only")
    doc = document(AutoTokenizer.from_pretrained(model), args.context)
    max_len = args.context + args.new_tokens + 64
    info = {**environment(), "vllm": vllm.__version__, "cpu_count": os.cpu_count(), "platform": platform.platform()}
    console = Console(width=160)
    console.print(f"machine: {json.dumps(info)}")

    engines, start_s = {}, {}
    for label, extra in runs.items():
        t = time.perf_counter()
        engines[label] = LLM(model=model, dtype="bfloat16", max_model_len=max_len, enable_prefix_caching=True, seed=0, **extra)
        start_s[label] = time.perf_counter() - t
        for batch in args.batches:  # fills the prefix cache with the document (and warms the engine)
            timed(engines[label], prompts(doc, batch), 2)
        console.print(f"{label}: engine started in {start_s[label]:.0f} s")

    samples: dict[tuple[str, int], list[dict]] = {(label, b): [] for label in runs for b in args.batches}
    order = list(runs)
    for r in range(args.runs):
        for batch in args.batches:
            for label in order if r % 2 == 0 else order[::-1]:
                samples[label, batch].append(measure(engines[label], prompts(doc, batch), args.new_tokens))
    for llm in engines.values():
        llm.llm_engine.engine_core.shutdown()
    del engines
    gc.collect()

    rows = []
    for batch in args.batches:
        ref = samples["stock", batch][0]["tokens"]
        stock_tok_s = statistics.median(s["tok_s"] for s in samples["stock", batch])
        for label in runs:
            got = samples[label, batch]
            same, first = compare(got[0]["tokens"], ref)
            tok_s = statistics.median(s["tok_s"] for s in got)
            rows.append({
                "run": label, "batch": batch, "context": args.context, "new_tokens": args.new_tokens,
                "tok_s": tok_s, "tpot_ms": statistics.median(s["tpot_ms"] for s in got),
                "tok_s_all": [s["tok_s"] for s in got], "vs_stock": tok_s / stock_tok_s,
                "same_as_stock": same, "first_diff_step": first, "engine_start_s": start_s[label],
            })

    table = Table(title=f"vLLM decode, bf16, shared {args.context}-token document, {args.new_tokens} new tokens, median of {args.runs}")
    for col in ("run", "batch", "tok/s (all seqs)", "ms / output token", "vs stock", "same as stock", "first diff"):
        table.add_column(col, justify="left" if col == "run" else "right")
    for row in rows:
        dense_wrong = row["run"] == "dense" and row["same_as_stock"] < row["batch"]
        table.add_row(
            row["run"], str(row["batch"]), f"{row['tok_s']:.1f}", f"{row['tpot_ms']:.1f}",
            "-" if dense_wrong else f"{row['vs_stock']:.2f}x", f"{row['same_as_stock']}/{row['batch']}",
            "-" if row["first_diff_step"] is None else str(row["first_diff_step"]),
        )
    console.print(table)
    out = args.out or REPO / "benchmarks" / "results" / f"serving-cpu-c{args.context}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"machine": info, "model": model, "threads_main": torch.get_num_threads(), "args": {
        k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}, "rows": rows}, indent=2) + "\n")
    console.print(f"wrote {out}")


if __name__ == "__main__":
    main()
