"""Bytes a segment search's decode step must read on real text, counted from the segments it selects.

The default model decodes a few greedy steps after a prompt of each text through a ``SparseCache``; every layer's
step reports its selection (``SparseLayer.record_step``), and the byte model of docs/performance.md is evaluated on
it: the summaries of every segment (centroids: ``d`` numbers each), the shortlist's keys (a :class:`Rerank`'s
``shortlist_size`` segments per KV group), the keys and values of each KV group's **union** of its query heads'
segments, and the sinks and tail; against dense's keys and values of every token. With the model's weights (read
once per step whatever the attention does) it gives the end-to-end ceiling of the speedup over dense at a batch.
Nothing is timed.

    python benchmarks/read_bytes.py                               # radar+ at budget 1024, 4096 tokens, batch 8
    python benchmarks/read_bytes.py -m quest:budget=1024 --texts cymbeline difflib
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

import sparseattn as sa
from sparseattn import registry
from sparseattn.data.sources import load_text
from sparseattn.hf import cache_kwargs, load_model
from sparseattn.summaries.rerank import Rerank


def step_bytes(state, info) -> tuple[float, float]:
    """``(sparse, dense)`` bytes of one layer's step for the batch's first row."""
    lay, segments = info.layout, info.segments  # [B, H, G', k]
    H, D = state.kv_heads, state.head_dim
    token = D * state.dtype.itemsize  # one key (or one value)
    union = sum(len(set(segments[0, h].flatten().tolist())) for h in range(H))  # segments each group reads
    summary = state.method.summary
    summaries = sum(buf.view()[0].numel() * buf.view().element_size() for buf in state._summaries)
    shortlist = 0
    if isinstance(summary, Rerank):
        k = segments.shape[-1]
        shortlist = H * summary.shortlist_size(state.method.reach(k, lay.n_segments), lay.n_segments) * lay.segment_size * token
    sparse = summaries + shortlist + 2 * token * (union * lay.segment_size + H * (lay.sink_end + lay.tail_size))
    return sparse, 2 * token * H * lay.length


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("-m", "--method", default="radar+:budget=1024")
    parser.add_argument("--texts", nargs="+", default=["difflib", "pickle", "cymbeline", "henry-v"])
    parser.add_argument("--length", type=int, default=4096)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--batch", type=int, default=8, help="rows per step, for the weights' share of the ceiling")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "read-bytes.json")
    args = parser.parse_args()
    method = registry.parse(args.method).method
    model, tokenizer = load_model()
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    rows = []
    for name in args.texts:
        ids = tokenizer(load_text(name), return_tensors="pt").input_ids[:, : args.length]
        counted: list[tuple[float, float]] = []
        with sa.apply(model, method) as sparse, torch.no_grad():
            cache = sparse.new_cache()
            for layer in cache.sparse_layers:  # each step's selection, counted as the layer records it
                layer.record_step = lambda info, layer=layer: counted.append(step_bytes(layer.state, info))
            token = model(ids, logits_to_keep=1, **cache_kwargs(model, cache)).logits[:, -1].argmax(-1, keepdim=True)
            for _ in range(args.steps):
                token = model(token, logits_to_keep=1, **cache_kwargs(model, cache)).logits[:, -1].argmax(-1, keepdim=True)
        sparse_kv, dense_kv = (sum(x) / args.steps for x in zip(*counted))  # per step, summed over layers, one row
        ceiling = (weights + args.batch * dense_kv) / (weights + args.batch * sparse_kv)
        rows.append({"text": name, "method": args.method, "length": ids.shape[1], "sparse_bytes": sparse_kv, "dense_bytes": dense_kv,
                     "fraction": sparse_kv / dense_kv, "weights": weights, "batch": args.batch, "ceiling": ceiling})  # fmt: skip
        print(f"{name:<12} {ids.shape[1]:>6} tokens: {sparse_kv / 1e6:7.2f} of {dense_kv / 1e6:7.2f} MB a step and row "
              f"({sparse_kv / dense_kv:.3f}); end-to-end ceiling at batch {args.batch}: {ceiling:.2f}x", flush=True)  # fmt: skip
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"rows": rows}, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
