"""``sparseattn demo``: one attention layer on a synthetic retrieval stream, dense vs Radar."""

from __future__ import annotations

import json
import platform
import statistics
import time
from pathlib import Path

import torch
import typer
from rich.table import Table

from sparseattn import RadarAlg1, Recent, SegmentSearch, attention_ref
from sparseattn.cli.consoles import console
from sparseattn.cli.outputs import wrote


def _retrieval_stream(length: int, steps: int, heads: int, kv_heads: int, head_dim: int, seed: int):
    """Keys/values of a long context, and decode queries that each look up one earlier token.

    A stand-in for retrieval in a real model: every query is a noisy, scaled copy of a random past
    key, so most of its attention mass sits on that key's segment, somewhere in the middle.
    """
    gen = torch.Generator().manual_seed(seed)
    total = length + steps
    keys = torch.randn(1, kv_heads, total, head_dim, generator=gen)
    values = torch.randn(1, kv_heads, total, head_dim, generator=gen)
    group = heads // kv_heads
    targets = torch.randint(0, length, (steps, kv_heads, group), generator=gen)
    queries = []
    for i in range(steps):
        picked = keys[0, torch.arange(kv_heads)[:, None], targets[i]]  # [H_kv, G, D]
        noise = torch.randn(kv_heads, group, head_dim, generator=gen)
        queries.append((1.5 * picked + 0.5 * noise).reshape(1, heads, head_dim))
    return keys, values, queries


def demo(
    length: int = typer.Option(16384, help="context length t before decoding"),
    steps: int = typer.Option(16, help="decode steps"),
    heads: int = typer.Option(9, help="query heads"),
    kv_heads: int = typer.Option(3, help="KV heads (grouped-query attention)"),
    head_dim: int = typer.Option(64),
    top_k: int = typer.Option(8, help="segments attended per step"),
    n_features: int = typer.Option(2048, help="random features n"),
    seed: int = typer.Option(0),
    out: Path | None = typer.Option(None, help="write the results as JSON here"),
) -> None:
    """Decode one attention layer on a synthetic retrieval stream: dense vs Radar vs recent segments.

    Reports, per method: attention-mass recall (the share of dense attention mass on the attended
    tokens), relative error of the output vs float64 dense attention, tokens attended per step and
    the measured time per step on this machine.
    """
    if heads % kv_heads:
        raise typer.BadParameter(f"--heads {heads} must be a multiple of --kv-heads {kv_heads}")
    torch.manual_seed(seed)
    keys, values, queries = _retrieval_stream(length, steps, heads, kv_heads, head_dim, seed)
    group = heads // kv_heads
    methods = {
        "radar (Algorithm 1)": RadarAlg1(top_k=top_k, n_features=n_features, seed=seed),
        "recent segments": SegmentSearch(selector=Recent(), top_k=top_k),
    }
    console.print(
        f"[bold]sparseattn demo[/]: t = {length}, {steps} decode steps, {heads} query / {kv_heads} KV heads, "
        f"d = {head_dim}, k = {top_k}, n = {n_features}; torch {torch.__version__} on {platform.processor() or platform.machine()}"
        f" ({torch.get_num_threads()} threads)"
    )
    rows = []
    dense_times = []
    for i, q in enumerate(queries):
        t = length + i + 1
        k_all, v_all = keys[:, :, :t], values[:, :, :t]
        start = time.perf_counter()
        torch.nn.functional.scaled_dot_product_attention(
            q.view(1, heads, 1, head_dim), k_all, v_all, enable_gqa=True
        )
        dense_times.append(time.perf_counter() - start)
    rows.append(
        {"method": "dense (SDPA)", "recall": 1.0, "rel_error": 0.0, "attended": float(length + steps / 2),
         "ms_per_step": 1e3 * statistics.median(dense_times), "build_s": 0.0}
    )
    for name, method in methods.items():
        state = method.new_state(1, kv_heads, head_dim)
        start = time.perf_counter()
        state.prefill(keys[:, :, :length], values[:, :, :length])
        build = time.perf_counter() - start
        times, recalls, errors, attended = [], [], [], []
        for i, q in enumerate(queries):
            t = length + i + 1
            start = time.perf_counter()
            output, info = state.step(q, keys[:, :, t - 1], values[:, :, t - 1])
            times.append(time.perf_counter() - start)
            grouped = q.view(1, kv_heads, group, head_dim)
            logits = torch.einsum("bhgd,bhtd->bhgt", grouped.double(), keys[:, :, :t].double()) * head_dim**-0.5
            probs = torch.softmax(logits, -1).reshape(1, heads, t)
            recalls.append(float((probs * info.to_mask()).sum(-1).mean()))
            ref = attention_ref(grouped, keys[:, :, :t], values[:, :, :t]).reshape(1, heads, head_dim)
            errors.append(float((output.double() - ref).norm() / ref.norm()))
            attended.append(float(info.attended.float().mean()))
        rows.append(
            {"method": name, "recall": statistics.mean(recalls), "rel_error": statistics.mean(errors),
             "attended": statistics.mean(attended), "ms_per_step": 1e3 * statistics.median(times), "build_s": build}
        )
    table = Table(title="one layer, synthetic retrieval stream (median time per step)")
    for col in ("method", "mass recall", "rel. error", "tokens attended", "ms / step", "prefill build s"):
        table.add_column(col, justify="right")
    for r in rows:
        table.add_row(
            r["method"], f"{r['recall']:.3f}", f"{r['rel_error']:.3f}", f"{r['attended']:.0f}",
            f"{r['ms_per_step']:.2f}", f"{r['build_s']:.2f}",
        )
    console.print(table)
    console.print(
        "Timings are this machine's, for one layer in eager PyTorch; Radar's per-step time includes its "
        "scoring and any restructure that fell on a measured step."
    )
    if out is not None:
        out.write_text(json.dumps({"config": {"length": length, "steps": steps, "heads": heads, "kv_heads": kv_heads,
                                              "head_dim": head_dim, "top_k": top_k, "n_features": n_features},
                                   "rows": rows}, indent=2))
        wrote([out])

