"""Bytes one decode step must read, per layer and sequence, for the two Radar forms and their neighbours.

The byte model of docs/performance.md evaluated on each method's real layout: the segment grid its
schedule plans after a prompt of ``t`` tokens, the segments its budget rule attends, the summary
bytes its summary really stores per segment (measured on a small state), the projection, the keys a
rerank reads and the attended keys and values. Under grouped-query attention a selection per query
head may read up to ``G`` times the segments (``worst``); ``shared`` is one selection per KV group.
Nothing is timed: this is the memory traffic a step cannot avoid, which is what bounds a CPU decode.

    python benchmarks/bytes.py                                # the default model's shape, bf16 cache
    python benchmarks/bytes.py --heads 8 --group 4 --head-dim 128 --cache-bytes 2   # Llama-3-8B

Writes ``benchmarks/results/bytes-h<H>g<G>d<d>.json``.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

from sparseattn import SegmentSearch, registry
from sparseattn.ops.layout import SegmentLayout
from sparseattn.summaries import Rerank

METHODS = (("dense", {}), ("radar", {}), ("radar-alg1", {}), ("radar", {"budget": 1024}),
           ("radar-alg1", {"budget": 1024}), ("radar+", {"budget": 1024}), ("quest", {"budget": 1024}))  # fmt: skip
LENGTHS = (4096, 8192, 16384, 131072)


def summary_bytes_per_segment(method: SegmentSearch, head_dim: int) -> tuple[int, int]:
    """``(bytes of one segment's summary, bytes of the per-layer parameters)`` per KV head, measured on a small state."""
    state = method.new_state(1, 1, head_dim)
    state.append(torch.randn(1, 1, 6000, head_dim), torch.randn(1, 1, 6000, head_dim))
    held = state.nbytes()
    return held["summaries"] // max(1, state.layout.n_segments), held.get("projection", 0)


def layout_after_prompt(method: SegmentSearch, t: int) -> SegmentLayout:
    """The layout a state has after a prompt of ``t`` tokens (the schedule's plan from nothing)."""
    segmentable = max(0, t - min(method.sinks, t) - method.held_back)
    grid = method.schedule.plan(segmentable, None)
    return SegmentLayout(length=t, sinks=method.sinks, segment_size=grid.segment_size, n_segments=grid.n_segments, window=method.window)


def step_bytes(method, t: int, heads: int, group: int, head_dim: int, cache_bytes: int) -> dict:
    """Bytes one decode step reads for one sequence and layer, by kind, with the tokens attended."""
    kv_token = 2 * head_dim * cache_bytes  # one token's key and value, one KV head
    if not isinstance(method, SegmentSearch):
        return {"attended": t, "kv": heads * t * kv_token, "kv_worst": heads * t * kv_token, "structure": 0}
    lay = layout_after_prompt(method, t)
    k = method.segments_for(lay)
    per_segment, params = summary_bytes_per_segment(method, head_dim)
    structure = heads * (lay.n_segments * per_segment) + heads * params
    if isinstance(method.summary, Rerank):  # the shortlisted segments' keys are read to rescore them
        shortlist = min(lay.n_segments, max(method.summary.shortlist, int(method.summary.factor * k)))
        structure += heads * shortlist * lay.segment_size * head_dim * cache_bytes
    always = lay.sink_end + lay.tail_size
    attended = lay.max_attended(k)
    worst = always + min(lay.n_segments, group * k) * lay.segment_size
    return {"attended": attended, "segments": lay.n_segments, "segment_size": lay.segment_size, "k": k,
            "kv": heads * attended * kv_token, "kv_worst": heads * worst * kv_token, "structure": structure}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--heads", type=int, default=3, help="KV heads (default model: 3)")
    parser.add_argument("--group", type=int, default=3, help="query heads per KV head (default model: 3)")
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--cache-bytes", type=int, default=2, help="bytes per cached number (2: bf16/fp16)")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = parser.parse_args()
    rows = []
    for t in LENGTHS:
        dense = None
        for name, options in METHODS:
            method = registry.build(name, **options)
            b = step_bytes(method, t, args.heads, args.group, args.head_dim, args.cache_bytes)
            total, worst = b["kv"] + b["structure"], b["kv_worst"] + b["structure"]
            dense = total if name == "dense" else dense
            label = name + "".join(f" {k}={v}" for k, v in options.items())
            rows.append({"t": t, "method": label, **b, "total": total, "total_worst": worst, "vs_dense": total / dense, "vs_dense_worst": worst / dense})
    table = Table(title=f"bytes one decode step reads per layer and sequence (H={args.heads}, G={args.group}, d={args.head_dim}, {args.cache_bytes}-byte cache)")
    for col in ("t", "method", "c x S", "k", "attended", "K/V MB", "summaries+proj MB", "total MB", "vs dense", "worst vs dense"):
        table.add_column(col, justify="right" if col not in ("method",) else "left")
    for r in rows:
        grid = f"{r.get('segment_size', '-')} x {r.get('segments', '-')}" if "segments" in r else "-"
        table.add_row(str(r["t"]), r["method"], grid, str(r.get("k", "-")), str(r["attended"]), f"{r['kv'] / 1e6:.2f}",
                      f"{r['structure'] / 1e6:.2f}", f"{r['total'] / 1e6:.2f}", f"{r['vs_dense']:.2f}", f"{r['vs_dense_worst']:.2f}")  # fmt: skip
    Console(width=200).print(table)
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"bytes-h{args.heads}g{args.group}d{args.head_dim}.json"
    path.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "rows": rows}, indent=1))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
