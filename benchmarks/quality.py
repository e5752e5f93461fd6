"""Perplexity of every baseline and both Radar forms at equal budgets, on a prose and a code text at once.

The two texts are decoded as the two rows of one batch (the decode step of a small model costs about
the same for 1 and 2 rows), every method's steps interleaved with the others' (see
``run_ppl_together``), and each row's perplexity is read off the per-row NLLs the records keep. The
gap ratio is ``(ppl - dense) / (ppl(StreamingLLM) - dense)`` at the same budget: the share of
StreamingLLM's loss a method keeps (0: as good as dense, 1: no better than a sliding window).

    python benchmarks/quality.py                                  # areopagitica + argparse, 4096 + 1024
    python benchmarks/quality.py --prose hamlet --code inspect --steps 256

Resumable: each method's run directory lives under ``--runs``; a rerun skips finished methods and
replays unfinished ones. Writes ``benchmarks/results/quality-<prose>-<code>-p<prefill>-s<steps>.json``.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import torch

from sparseattn import Dense, registry
from sparseattn.data.sources import load_text
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prose", default="areopagitica")
    parser.add_argument("--code", default="argparse")
    parser.add_argument("--prefill", type=int, default=4096)
    parser.add_argument("--steps", type=int, default=1024)
    parser.add_argument("--budgets", type=int, nargs="+", default=[512, 1024])
    parser.add_argument("--runs", type=Path, default=Path(__file__).parent / "results" / "quality-runs")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    for name, value in (("--prefill", args.prefill), ("--steps", args.steps), *(("--budgets", b) for b in args.budgets)):
        if value < 1:
            raise SystemExit(f"{name} must be >= 1, got {value}")
    model, tokenizer = load_model("default")
    n = args.prefill + args.steps + 1
    if n > model.config.max_position_embeddings:
        raise SystemExit(f"--prefill + --steps + 1 = {n} exceeds the model's {model.config.max_position_embeddings} positions")
    texts = [args.prose, args.code]
    ids = torch.stack([tokenize(tokenizer, load_text(t), n, name=t) for t in texts])  # [2, n]
    methods = {"dense": Dense()}
    for budget in args.budgets:
        methods.update({f"{name}@{budget}": registry.build(name, budget=budget) for name in SPARSE})
    where = args.runs / f"{args.prose}+{args.code}-p{args.prefill}-s{args.steps}"
    runs = {}
    for label, method in methods.items():
        config = {"command": "quality", "texts": texts, "prefill": args.prefill, "steps": args.steps, "method": label,
                  "params": repr(method), "interleaved": sorted(methods)}  # fmt: skip
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
    out = args.out or Path(__file__).parent / "results" / f"quality-{args.prose}-{args.code}-p{args.prefill}-s{args.steps}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"environment": environment(), "texts": texts, "prefill": args.prefill,
                               "steps": args.steps, "rows": rows}, indent=2) + "\n")  # fmt: skip
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
