"""Perplexity of every baseline and both Radar forms at equal budgets, on prose and code texts at once.

The texts are decoded as the rows of one batch (the decode step of a small model costs about the
same for 1 and 6 rows), every method's steps interleaved with the others' (see
``run_ppl_together``), and each row's perplexity is read off the per-row NLLs the records keep. The
gap ratio is ``(ppl - dense) / (ppl(StreamingLLM) - dense)`` at the same budget: the share of
StreamingLLM's loss a method keeps (0: as good as dense, 1: no better than a sliding window).
``streamingllm`` always runs (it is the ratio's reference); the summary gives each method's mean and
worst gap ratio over the prose and over the code texts.

    python benchmarks/quality.py                                  # areopagitica + argparse, 4096 + 1024
    python benchmarks/quality.py --prose hamlet --code inspect --steps 256
    python benchmarks/quality.py --prose kjv-bible --prose hamlet --code typing --code tarfile \
        --methods oracle-tokens oracle-tokens-pooled radar+ --budgets 512

Resumable: each method's run directory lives under ``--runs``; a rerun skips finished methods and
replays unfinished ones. Writes ``benchmarks/results/quality-<texts>-p<prefill>-s<steps>.json``.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import torch

from sparseattn import Dense, registry
from sparseattn.cli.method_specs import parse_method
from sparseattn.data.sources import get_text, load_text
from sparseattn.evaluation.ppl import run_ppl_together, tokenize
from sparseattn.evaluation.runs import RunDir, environment
from sparseattn.hf import load_model

#: The registry's methods compared at each budget (dense runs once).
SPARSE = ["streamingllm", "h2o", "snapkv", "quest", "radar-alg1", "radar", "radar+"]


def row_ppls(run: RunDir, rows: int) -> list[float]:
    """Perplexity of each batch row, from the per-row NLLs of the run's records."""
    records = run.records("tokens.jsonl")
    per_row = [[r["nlls"][i] for r in records] for i in range(rows)]
    return [math.exp(sum(nlls) / len(nlls)) for nlls in per_row]


def check_texts(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Refuse (``parser.error``) an unknown ``--prose``/``--code`` text, or one of the other kind."""
    for kind in ("prose", "code"):
        for name in getattr(args, kind):
            try:
                found = get_text(name).kind
            except KeyError as error:
                parser.error(f"--{kind} {name!r}: {error.args[0]}")
            if found != kind:
                parser.error(f"--{kind} {name!r} is a {found} text; pass it as --{found}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prose", action="append", help="a prose text (repeatable; default: areopagitica)")
    parser.add_argument("--code", action="append", help="a code text (repeatable; default: argparse)")
    parser.add_argument("--methods", nargs="+", default=SPARSE, help="methods run at each budget: NAME[:key=value,...]")
    parser.add_argument("--prefill", type=int, default=4096)
    parser.add_argument("--steps", type=int, default=1024)
    parser.add_argument("--budgets", type=int, nargs="+", default=[512, 1024])
    parser.add_argument("--runs", type=Path, default=Path(__file__).parent / "results" / "quality-runs")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    args.prose, args.code = args.prose or ["areopagitica"], args.code or ["argparse"]
    check_texts(parser, args)
    methods_run = list(dict.fromkeys(["streamingllm", *args.methods]))
    for spec in methods_run:
        name = spec.partition(":")[0]
        if name not in registry.names() or "budget" not in registry.get(name).option_names:
            parser.error(f"--methods {spec!r}: not a registered method that takes a budget; see `sparseattn methods`")
    for name, value in (("--prefill", args.prefill), ("--steps", args.steps), *(("--budgets", b) for b in args.budgets)):
        if value < 1:
            parser.error(f"{name} must be >= 1, got {value}")
    methods = {"dense": Dense()}
    for budget in args.budgets:
        for spec in methods_run:
            try:
                methods[f"{spec}@{budget}"] = parse_method(spec, budget)[1]
            except Exception as error:  # the CLI's message: the option, the value, what is allowed
                parser.error(f"--methods {spec!r}: {getattr(error, 'message', error)}")
    model, tokenizer = load_model("default")
    n = args.prefill + args.steps + 1
    if n > model.config.max_position_embeddings:
        raise SystemExit(f"--prefill + --steps + 1 = {n} exceeds the model's {model.config.max_position_embeddings} positions")
    texts = [*args.prose, *args.code]
    ids = torch.stack([tokenize(tokenizer, load_text(t), n, name=t) for t in texts])  # [texts, n]
    where = args.runs / f"{'+'.join(texts)}-p{args.prefill}-s{args.steps}"
    runs = {}
    for label, method in methods.items():
        config = {"command": "quality", "texts": texts, "prefill": args.prefill, "steps": args.steps, "method": label,
                  "params": repr(method)}  # fmt: skip
        runs[label] = (method, RunDir(where / label.replace("@", "-b"), config))
    summaries = run_ppl_together(model, runs, ids, args.prefill, args.steps)
    rows = []
    for label, (_, run) in runs.items():
        ppl = row_ppls(run, len(texts))
        rows.append({"method": label, "ppl": dict(zip(texts, ppl)), "attended": summaries[label]["mean_attended_tokens"]})
    dense = rows[0]["ppl"]
    by_label = {r["method"]: r for r in rows}
    print(f"prefill {args.prefill}, {args.steps} steps; gap ratio = (ppl - dense) / (StreamingLLM's ppl - dense)")
    header = f"{'method':<22}{'attended':>9}" + "".join(f"{t + ' ppl':>20}{'gap ratio':>11}" for t in texts)
    print(header)
    print("-" * len(header))
    for r in rows:
        budget = r["method"].partition("@")[2]
        reference = by_label.get(f"streamingllm@{budget}")
        r["gap_ratio"] = {}
        cells = ""
        for t in texts:
            gap = None
            if reference is not None and reference["ppl"][t] != dense[t]:
                gap = (r["ppl"][t] - dense[t]) / (reference["ppl"][t] - dense[t])
            r["gap_ratio"][t] = gap
            cells += f"{r['ppl'][t]:>20.3f}{'-' if gap is None else f'{gap:.2f}':>11}"
        print(f"{r['method']:<22}{r['attended']:>9.0f}{cells}")
    print()
    print("gap ratio over the texts of each kind: mean (worst)")
    for r in rows[1:]:
        r["summary"] = {}
        cells = ""
        for kind in ("prose", "code"):
            gaps = [r["gap_ratio"][t] for t in getattr(args, kind) if r["gap_ratio"][t] is not None]
            if gaps:
                r["summary"][kind] = {"mean": sum(gaps) / len(gaps), "worst": max(gaps), "texts": len(gaps)}
                cells += f"   {kind} {sum(gaps) / len(gaps):.3f} ({max(gaps):.3f})"
        print(f"{r['method']:<22}{cells}")
    out = args.out or Path(__file__).parent / "results" / f"quality-{'-'.join(texts)}-p{args.prefill}-s{args.steps}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"environment": environment(), "texts": texts, "prose": args.prose, "code": args.code,
                               "prefill": args.prefill, "steps": args.steps, "rows": rows}, indent=2) + "\n")  # fmt: skip
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
