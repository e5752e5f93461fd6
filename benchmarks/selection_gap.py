"""Where a method's selection loses against the exact pooled oracle, per layer, head and position (issue 49, item 4).

Each text is prefilled once per method and decoded along the dense trajectory (``Probe``, ``follow="dense"``):
every step and layer, float64 dense attention beside the method's selection gives the mass the method keeps and
the chain of ceilings of :mod:`sparseattn.evaluation.selection_gap`: the pooled token oracle at the method's
budget, each head's exact top tokens at the method's split, the exact top segments of its grid at that split,
and the method. The table splits the mass the method loses against the pooled oracle into the split (between
heads, and the merged rest's share of the budget), the grid, and the ranking; and prints the mass it misses by
where it lies (sinks, last 64, next 448, older), the output errors of the method and of the oracle, and the
layers that lose most.

    python benchmarks/selection_gap.py                       # radar+adaptive at 512, the report's four texts
    python benchmarks/selection_gap.py -m radar+adaptive -m "radar+adaptive:cap=4" --texts cymbeline,difflib

Writes ``benchmarks/results/selection-gap-<label>.json`` (per text, method, layer and head); each (text,
method) cell is kept under ``--runs`` and a rerun skips it.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from sparseattn import registry
from sparseattn.data import load_text
from sparseattn.evaluation.diagnose import Probe, summarize_probes
from sparseattn.evaluation.ppl import tokenize
from sparseattn.evaluation.runs import RunDir
from sparseattn.evaluation.selection_gap import WHERE
from sparseattn.hf import apply, cache_kwargs, load_model

RESULTS = Path(__file__).parent / "results"
PARTS = (("split", "pooled", "per_head"), ("grid", "per_head", "grid_per_head"), ("ranking", "grid_per_head", "method"))


def probe_text(model, method, ids: torch.Tensor, prefill: int, steps: int) -> dict:
    """One method's probe summary on one text: prefill ``prefill`` tokens, ``steps`` probed decode steps."""
    with apply(model, Probe(method)) as sparse, torch.no_grad():
        cache = sparse.new_cache()
        model(ids[None, :prefill], **cache_kwargs(model, cache), use_cache=True)
        for i in range(steps):
            model(ids[None, prefill + i : prefill + i + 1], **cache_kwargs(model, cache), use_cache=True)
    return summarize_probes([layer.state for layer in cache.sparse_layers])


def layer_means(summary: dict) -> list[dict[str, float]]:
    """Per layer: the head-mean mass each ceiling keeps, what the method misses by where, and both output errors."""
    def mean(values: list[float]) -> float:
        return float(torch.tensor(values, dtype=torch.float64).nanmean())

    rows = []
    for row in summary["per_layer"]:
        kept = {name: mean(values) for name, values in row["ceilings"].items()}
        means = {**kept, **{f"missed:{w}": mean(v) for w, v in row["missed"].items()},
                 "rel_error": mean(row["rel_error"]), "oracle_error": mean(row["oracle_error"])}
        rows.append({key: round(value, 5) for key, value in means.items()})
    return rows


#: The ceilings kept per head in the JSON (those the split, grid and ranking losses are differences of).
PER_HEAD = ("pooled", "per_head", "grid_per_head", "method")


def per_head(summary: dict) -> list[dict]:
    """Per layer, each query head's mass under the ceilings of :data:`PER_HEAD` and both output errors (3 decimals:
    the JSON stays small; the pooled ceiling is the layer's, shared between its heads as the oracle shared it)."""
    def rounded(values: list[float]) -> list[float]:
        return [round(v, 3) for v in values]

    return [{"layer": row["layer"], "kept": {name: rounded(row["ceilings"][name]) for name in PER_HEAD},
             "rel_error": rounded(row["rel_error"]), "oracle_error": rounded(row["oracle_error"])}
            for row in summary["per_layer"]]  # fmt: skip


def losses(kept: dict[str, float]) -> dict[str, float]:
    """The mass lost against the pooled oracle, split into its parts (each: the step from one ceiling to the next)."""
    return {"total": kept["pooled"] - kept["method"], **{part: kept[hi] - kept[lo] for part, hi, lo in PARTS}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-m", "--method", action="append", help="method specs (default: radar+adaptive)")
    parser.add_argument("--budget", type=int, default=512, help="past KV tokens per step for specs without one")
    parser.add_argument("--texts", default="king-lear,paradise-regained,pyio,subprocess", help="comma-separated")
    parser.add_argument("--prefill", type=int, default=4096)
    parser.add_argument("--steps", type=int, default=32, help="probed decode steps per text")
    parser.add_argument("--label", default="report-texts", help="names the JSON file")
    parser.add_argument("--runs", type=Path, default=RESULTS / "selection-gap-runs")
    parser.add_argument("--worst", type=int, default=5, help="layers listed per method: those that lose most")
    args = parser.parse_args()
    specs = [registry.parse(spec, args.budget) for spec in (args.method or ["radar+adaptive"])]
    texts = [t.strip() for t in args.texts.split(",") if t.strip()]
    model, tokenizer = load_model("default", dtype=torch.float32)
    results: dict[str, dict] = {}
    for text in texts:
        ids = tokenize(tokenizer, load_text(text), args.prefill + args.steps, name=text)
        for spec in specs:
            config = {"text": text, "method": spec.label, "prefill": args.prefill, "steps": args.steps}
            run = RunDir(args.runs / text / f"p{args.prefill}-s{args.steps}" / spec.label.replace("/", "_"), config)
            if not run.finished:
                run.finish(probe_text(model, spec.method, ids, args.prefill, args.steps))
            summary = run.summary()
            layers = layer_means(summary)
            kept = {name: sum(r[name] for r in layers) / len(layers) for name in layers[0]}
            results.setdefault(spec.label, {})[text] = {"overall": kept, "losses": losses(kept), "per_layer": layers,
                                                        "per_head": per_head(summary)}  # fmt: skip
    width = max(len(label) for label in results) + 2
    header = (f"{'method':<{width}}{'text':<19}{'oracle':>8}{'method':>8}{'lost':>8}{'split':>8}{'grid':>8}{'ranking':>8}"
              + "".join(f"{'miss ' + w:>12}" for w in WHERE) + f"{'err':>8}{'oracle err':>11}")
    print("attention mass kept per query head (mean over layers, heads and steps); lost = oracle - method = split + grid + ranking")
    print(header)
    print("-" * len(header))
    for label, per_text in results.items():
        for text, r in per_text.items():
            k, lo = r["overall"], r["losses"]
            print(f"{label:<{width}}{text:<19}{k['pooled']:>8.3f}{k['method']:>8.3f}{lo['total']:>8.3f}{lo['split']:>8.3f}"
                  f"{lo['grid']:>8.3f}{lo['ranking']:>8.3f}" + "".join(f"{k['missed:' + w]:>12.3f}" for w in WHERE)
                  + f"{k['rel_error']:>8.3f}{k['oracle_error']:>11.3f}")
    for label, per_text in results.items():
        n_layers = len(next(iter(per_text.values()))["per_layer"])
        per_layer = [{key: sum(r["per_layer"][i][key] for r in per_text.values()) / len(per_text)
                      for key in per_text[next(iter(per_text))]["per_layer"][i]} for i in range(n_layers)]  # fmt: skip
        worst = sorted(range(n_layers), key=lambda i: -losses(per_layer[i])["total"])[: args.worst]
        print(f"\n{label}: the {len(worst)} layers that lose most (mean over texts)")
        for i in worst:
            lo = losses(per_layer[i])
            print(f"  layer {i:>2}: lost {lo['total']:.3f} (split {lo['split']:.3f}, grid {lo['grid']:.3f}, ranking "
                  f"{lo['ranking']:.3f}); err {per_layer[i]['rel_error']:.3f} vs oracle {per_layer[i]['oracle_error']:.3f}")
    out = RESULTS / f"selection-gap-{args.label}.json"
    out.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "methods": results}, separators=(",", ":")))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
