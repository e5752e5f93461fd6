"""The serving benchmark's results: one row per run and workload, the terminal's table, and the JSON.

A row holds the run's speed (median, min and max over rounds), its ratios to stock vLLM and to the
plugin's dense path, the bytes a step reads by the byte model (:func:`step_bytes`), and the quality of the
same configuration (greedy agreement with stock, teacher-forced ppl and top-1, pass keys, per prompt too).
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from sparseattn.evaluation.serving_runs import DENSE, DISTINCT, STOCK, STOCK_F32, Measured, Run
from sparseattn.evaluation.serving_workload import Prompt


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """Tokens equal before the first difference.

    >>> common_prefix([1, 2, 3], [1, 2, 4]), common_prefix([1], [1])
    (2, 1)
    """
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def prefix_share(tokens: Sequence[Sequence[int]], ref: Sequence[Sequence[int]]) -> float:
    """Mean over sequences of the common prefix with ``ref`` as a share of ``ref``'s length."""
    return statistics.fmean(common_prefix(a, b) / len(b) for a, b in zip(tokens, ref))


def step_bytes(config: Any, batch: int, attended: int, dtype_bytes: int, kv_bytes: int | None = None) -> dict[str, float]:
    """What one decode step must read, in MB: the weights (once per step) and the keys and values attended.

    A byte model, not a measurement: the floor a memory-bound step cannot go below. ``config``: the
    model's HF config (layers, KV heads, head size, vocabulary for the logits' weights); ``kv_bytes``: bytes per
    cached number (an fp8 cache's 1; None: the weights' ``dtype_bytes``).
    """
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    layers, kv_heads, hidden, inter = config.num_hidden_layers, config.num_key_value_heads, config.hidden_size, config.intermediate_size
    per_layer = hidden * (config.num_attention_heads * head_dim) * 2 + hidden * kv_heads * head_dim * 2 + 3 * hidden * inter
    weights = (layers * per_layer + config.vocab_size * hidden) * dtype_bytes
    kv = batch * attended * layers * kv_heads * head_dim * 2 * (dtype_bytes if kv_bytes is None else kv_bytes)
    return {"weights_mb": weights / 1e6, "kv_mb": kv / 1e6}


def result_rows(runs: Sequence[Run], measured: Mapping[tuple[str, str], Measured], workloads: Sequence[str], hf_config: Any, *,
                batch: int, context: int, steps: int, dtype: str, started: Mapping[str, float], prefilled: Mapping[str, float],
                block_size: int | None, hf_overrides: Mapping[str, Any] | None, kv_cache_dtype: str = "auto",
                prompts: Sequence[Prompt] = ()) -> list[dict[str, Any]]:  # fmt: skip
    """One row per run and workload measured so far (the JSON's ``rows``; :func:`table` shows them).

    ``measured``: ``(run label, workload) -> Measured``; ``started`` and ``prefilled``: each engine's start-up and
    prefill seconds; ``prompts``: the distinct workload's, for the per-prompt quality (``by_prompt``).
    """
    rows = []
    stock = {w: measured[STOCK, w] for w in workloads}
    dense = {w: measured.get((DENSE, w)) for w in workloads}
    for w in workloads:
        for r in runs:
            m = measured[r.label, w]
            if not m.tok_s:
                continue
            tok_s = statistics.median(m.tok_s)
            attended = context if r.attended is None else min(r.attended, context)
            engine_dtype = "float32" if r.engine == STOCK_F32 else dtype
            row: dict[str, Any] = {
                "run": r.label, "workload": w, "engine": r.engine, "method": dict(r.method) if r.method else None, "dtype": engine_dtype,
                "batch": batch, "context": context, "steps": steps, "block_size": block_size, "hf_overrides": dict(hf_overrides) if hf_overrides else None,
                "tok_s": tok_s, "tok_s_min": min(m.tok_s), "tok_s_max": max(m.tok_s), "tok_s_all": m.tok_s,
                "ms_step": statistics.median(m.ms_step), "attended": attended, "engine_start_s": started.get(r.engine),
                "prefill_s": prefilled.get(r.engine), "kv_cache_dtype": kv_cache_dtype,
                "fallback_steps": m.fallback_steps, **({"profile": m.profile} if m.profile else {}),
                **step_bytes(hf_config, batch, attended, 4 if engine_dtype == "float32" else 2,
                             1 if kv_cache_dtype.startswith("fp8") else None),
            }  # fmt: skip
            if stock[w].tok_s:
                row["vs_stock"] = tok_s / statistics.median(stock[w].tok_s)
            if r.engine == "plugin" and dense[w] is not None and dense[w].tok_s:
                d = statistics.median(dense[w].tok_s)
                row["kernel_gain"] = d / statistics.median(stock[w].tok_s)
                row["sparsity_gain"] = tok_s / d
            row.update(quality_columns(m, stock[w], prompts))
            rows.append(row)
    return rows


def quality_columns(m: Measured, stock: Measured, prompts: Sequence[Prompt]) -> dict[str, Any]:
    """A row's quality against stock's on the same workload: what of it was measured (greedy, forced, pass keys)."""
    columns: dict[str, Any] = {}
    if m.tokens is not None and stock.tokens is not None:
        columns["greedy_prefix_vs_stock"] = prefix_share(m.tokens, stock.tokens)
        columns["greedy_same_as_stock"] = sum(a == b for a, b in zip(m.tokens, stock.tokens))
    if m.forced is not None:
        columns["ppl"] = m.forced.ppl()
        if stock.forced is not None:
            columns["top1_vs_stock"] = m.forced.top1_agreement(stock.forced)
    if m.passkey is not None:
        columns["passkey"] = m.passkey
        columns["answers"] = m.answers
    if m.forced is not None and prompts:  # per prompt: how much the quality moves between texts
        columns["by_prompt"] = [
            {"source": p.source, "ppl": m.forced.sequence(i).ppl(), "passkey": p.key in (m.answers or [""] * len(prompts))[i],
             **({"top1_vs_stock": m.forced.sequence(i).top1_agreement(stock.forced.sequence(i))} if stock.forced else {})}
            for i, p in enumerate(prompts)
        ]  # fmt: skip
    return columns


def table(rows: Sequence[Mapping[str, Any]], *, rounds: int):
    """The rows as one rich table: speed (median and range over rounds) with the quality of the same configuration."""
    from rich.table import Table

    first = rows[0] if rows else {}
    title = (f"vLLM decode: batch {first.get('batch')} x {first.get('context')}-token prompts, {first.get('steps')} timed steps, "
             f"median [min-max] of {rounds} rounds; quality vs stock {first.get('dtype')}")  # fmt: skip
    result = Table(title=title)
    columns = ("run", "prompts", "dtype", "tok/s (min-max)", "ms/step", "vs stock", "kernel", "sparsity", "KV tokens", "KV MB",
               "prefix", "top-1", "ppl", "pass keys", "start / prefill s")  # fmt: skip
    for col in columns:
        result.add_column(col, justify="left" if col in ("run", "prompts") else "right")

    def pct(value: Any) -> str:
        return "-" if value is None else f"{100 * value:.0f}%"

    for row in rows:
        flag = f" ({row['fallback_steps']} fallback layer-steps)" if row.get("fallback_steps") else ""
        result.add_row(
            row["run"] + flag, row["workload"], row["dtype"] + ("" if row.get("kv_cache_dtype", "auto") == "auto" else f", {row['kv_cache_dtype']} KV"), f"{row['tok_s']:.1f} ({row['tok_s_min']:.1f}-{row['tok_s_max']:.1f})",
            f"{row['ms_step']:.1f}", f"{row['vs_stock']:.2f}x" if "vs_stock" in row else "-",
            f"{row['kernel_gain']:.2f}x" if "kernel_gain" in row else "-", f"{row['sparsity_gain']:.2f}x" if "sparsity_gain" in row else "-",
            str(row["attended"]), f"{row['kv_mb']:.0f}", pct(row.get("greedy_prefix_vs_stock")), pct(row.get("top1_vs_stock")),
            "-" if row.get("ppl") is None else f"{row['ppl']:.3f}", pct(row.get("passkey")),
            "-" if row.get("prefill_s") is None or row["workload"] != DISTINCT or row["run"] not in (STOCK, STOCK_F32, DENSE)
            else f"{row['engine_start_s']:.0f} / {row['prefill_s']:.0f}",
        )  # fmt: skip
    return result


NOTE = (
    "tok/s counts every sequence's tokens; 'vs stock' divides by stock vLLM's median on the same prompts; 'kernel' is the "
    "plugin's dense path over stock (the engine's gain without sparsity), 'sparsity' the run over the plugin's dense path "
    "(the gain of attending fewer tokens). KV tokens / KV MB: past tokens a step attends per sequence, and the keys and "
    "values that makes a step read (a byte model; the weights add {weights:.0f} MB a step). Quality, on the distinct "
    "prompts: 'prefix' the share of stock's greedy tokens matched before the first difference; 'top-1' (how often the "
    "most likely next token is stock's) and 'ppl' by teacher forcing each file's true next tokens through decode steps; "
    "'pass keys' the share of prompts whose hidden key the answer contains. 'start / prefill s': the engine's start-up "
    "and the prefill of every prompt (the time to the first tokens), once per engine (the plugin's on its dense row)."
)


def write(out: Path, machine: Mapping[str, Any], model: str, args: Mapping[str, Any], rows: Sequence[Mapping[str, Any]], *, complete: bool) -> None:
    """The result JSON: the machine (CPU, ISA flags, vLLM's attention ISA), the arguments, the rows; rewritten as rows come."""
    import torch

    out.parent.mkdir(parents=True, exist_ok=True)
    payload = {"complete": complete, "machine": dict(machine), "model": model, "threads_main": torch.get_num_threads(),
               "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in args.items()}, "rows": list(rows)}  # fmt: skip
    tmp = out.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(payload, indent=2) + "\n")
    tmp.replace(out)
