"""Segment-selection quality of summary variants at one budget, on the default model (issue 7's harness).

For each variant: top-1 / top-3 hit rate against the exact segment attention, attention-mass recall
and output error (the ``sparseattn diagnose`` probe, dense trajectory), per layer and overall; the
bytes one decode step reads per query head (summaries + selected K/V + reranked keys); and, with
``--ppl``, perplexity over ``--ppl-steps`` decode steps at the same budget.

    python benchmarks/selection.py --text paradise-lost --prefill 4096 --steps 8 --budget 512
    python benchmarks/selection.py --ppl --ppl-steps 256 --text pydecimal
    python benchmarks/selection.py --aspect 4       # on radar+'s grid: segments of sqrt(t) / 4 tokens

Writes ``benchmarks/results/selection-<text>-p<prefill>.json``.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import torch

from sparseattn import (
    CenteredFeatures,
    Centroid,
    ExactScore,
    MinMaxBound,
    PerformerFeatures,
    Recent,
    Rerank,
    SegmentSearch,
    SqrtSchedule,
    TopK,
)
from sparseattn.data import load_text
from sparseattn.evaluation.diagnose import Probe, summarize_probes
from sparseattn.evaluation.ppl import run_ppl, tokenize
from sparseattn.evaluation.runs import RunDir
from sparseattn.hf import apply, cache_kwargs, load_model


def variants(budget: int, sinks: int, shortlist: int, aspect: float = 1.0) -> dict[str, SegmentSearch]:
    def seg(summary, selector=None) -> SegmentSearch:
        return SegmentSearch(summary=summary, selector=selector or TopK(), schedule=SqrtSchedule(aspect=aspect),
                             budget=budget, sinks=sinks)

    return {
        "radar n=256": seg(PerformerFeatures(256)),
        "radar n=2048": seg(PerformerFeatures(2048)),
        "radar orthogonal n=256": seg(PerformerFeatures(256, orthogonal=True)),
        "centered n=256": seg(CenteredFeatures(PerformerFeatures(256))),
        "centered n=2048": seg(CenteredFeatures(PerformerFeatures(2048))),
        "centroid": seg(Centroid()),
        "minmax (quest bound)": seg(MinMaxBound()),
        f"rerank radar n=256, shortlist {shortlist}": seg(Rerank(PerformerFeatures(256), shortlist)),
        f"rerank centered n=256, shortlist {shortlist}": seg(Rerank(CenteredFeatures(PerformerFeatures(256)), shortlist)),
        f"rerank centroid, shortlist {shortlist}": seg(Rerank(Centroid(), shortlist)),
        f"rerank centroid per KV group, shortlist {shortlist}": seg(Rerank(Centroid(), shortlist, per_group=True)),
        "exact": seg(ExactScore()),
        "recent": seg(ExactScore(), Recent()),
    }


def step_bytes(method: SegmentSearch, t: int, head_dim: int, itemsize: int = 4, group: int = 1) -> dict[str, float]:
    """Bytes one decode step reads per query head at context ``t`` (SqrtSchedule grid, mid-buffer)."""
    root = math.isqrt(t)
    c = max(1, math.floor(root / method.schedule.aspect))
    segments = root * root // c
    tail = root  # the buffer averages sqrt(t) tokens between rebuilds, whatever the segment size
    k = max(1, (method.budget - method.sinks - tail) // c)
    summary = method.summary
    coarse = summary.coarse if isinstance(summary, Rerank) else summary
    base = coarse.features if isinstance(coarse, CenteredFeatures) else coarse
    per_segment = {PerformerFeatures: getattr(base, "n_features", 0), Centroid: head_dim, MinMaxBound: 2 * head_dim,
                   ExactScore: c * head_dim}.get(type(base), 0)
    if isinstance(coarse, CenteredFeatures):
        per_segment += head_dim
    if isinstance(method.selector, Recent):
        per_segment = 0
    rerank = max(summary.shortlist, math.ceil(summary.factor * k)) * c * head_dim if isinstance(summary, Rerank) else 0
    if isinstance(summary, Rerank) and summary.per_group:
        rerank /= group  # one shortlist's keys read for the group's query heads
    kv = (k * c + tail + method.sinks) * head_dim * 2
    return {"summaries": segments * per_segment * itemsize, "rerank_keys": rerank * itemsize, "kv": kv * itemsize,
            "total": (segments * per_segment + rerank + kv) * itemsize}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--text", default="paradise-lost")
    parser.add_argument("--prefill", type=int, default=4096)
    parser.add_argument("--steps", type=int, default=8, help="decode steps probed")
    parser.add_argument("--budget", type=int, default=512)
    parser.add_argument("--sinks", type=int, default=4)
    parser.add_argument("--shortlist", type=int, default=16)
    parser.add_argument("--aspect", type=float, default=1.0, help="segments of sqrt(t) / aspect tokens (radar+: 4)")
    parser.add_argument("--only", nargs="*", default=None, help="substrings of variant names to run")
    parser.add_argument("--ppl", action="store_true", help="also measure perplexity at the budget")
    parser.add_argument("--ppl-steps", type=int, default=256)
    parser.add_argument("--runs", type=Path, default=Path(__file__).parent / "results" / "selection-runs")
    args = parser.parse_args()
    model, tokenizer = load_model("default")
    ids = tokenize(tokenizer, load_text(args.text), args.prefill + max(args.steps, args.ppl_steps) + 1, name=args.text)
    head_dim = model.config.head_dim if hasattr(model.config, "head_dim") else model.config.hidden_size // model.config.num_attention_heads
    suffix = "" if args.aspect == 1.0 else f"-a{args.aspect:g}"
    results = {}
    dense_ppl = None
    if args.ppl:
        config = {"command": "ppl", "text": args.text, "prefill": args.prefill, "steps": args.ppl_steps, "method": "dense"}
        from sparseattn import Dense

        dense_ppl = run_ppl(model, Dense(), ids, args.prefill, args.ppl_steps, RunDir(args.runs / args.text / f"p{args.prefill}" / "dense", config))["ppl"]
        print(f"dense ppl {dense_ppl:.3f}")
    header = f"{'variant':<40}{'hit@1':>8}{'hit@3':>8}{'recall':>8}{'rel.err':>9}{'attended':>9}{'KB/step/head':>13}{'ppl':>9}"
    print(header)
    print("-" * len(header))
    for name, method in variants(args.budget, args.sinks, args.shortlist, args.aspect).items():
        if args.only and not any(s in name for s in args.only):
            continue
        with apply(model, Probe(method)) as sparse, torch.no_grad():
            cache = sparse.new_cache()
            model(ids[None, : args.prefill], **cache_kwargs(model, cache), use_cache=True)
            for i in range(args.steps):
                model(ids[None, args.prefill + i : args.prefill + i + 1], **cache_kwargs(model, cache), use_cache=True)
        summary = summarize_probes([layer.state for layer in cache.sparse_layers])
        o = summary["overall"]
        row = {**o, "per_layer_hit@1": [sum(r["hit@1"]) / len(r["hit@1"]) for r in summary["per_layer"]],
               "bytes": step_bytes(method, args.prefill, head_dim, group=model.config.num_attention_heads // model.config.num_key_value_heads), "repr": repr(method)}
        if args.ppl:
            slug = "".join(ch if ch.isalnum() else "-" for ch in name)
            config = {"command": "ppl", "text": args.text, "prefill": args.prefill, "steps": args.ppl_steps, "method": repr(method)}
            row["ppl"] = run_ppl(model, method, ids, args.prefill, args.ppl_steps, RunDir(args.runs / args.text / f"p{args.prefill}{suffix}" / slug, config), label=name)["ppl"]
        results[name] = row
        ppl = f"{row['ppl']:.3f}" if "ppl" in row else "-"
        print(f"{name:<40}{100 * o['hit@1']:>7.1f}%{100 * o['hit@3']:>7.1f}%{100 * o['recall']:>7.1f}%{o['rel_error']:>9.3f}"
              f"{o['attended']:>9.0f}{row['bytes']['total'] / 1024:>13.1f}{ppl:>9}")
    out = Path(__file__).parent / "results" / f"selection-{args.text}-p{args.prefill}{suffix}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "dense_ppl": dense_ppl, "variants": results}, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
