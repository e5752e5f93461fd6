"""End-to-end decode speed of a whole model, always reported with the perplexity of the same tokens.

CPU (default): the embedded SmolLM2-135M-Instruct, prompts of 2k, 4k and 8k tokens of CPython's
``_pydecimal.py``; then ``--steps`` ground-truth tokens are fed one at a time (the perplexity
protocol of ``sparseattn ppl``), timing each decode step and scoring each next token; the methods'
steps are interleaved (one step of each in turn), so that the machine's drift hits them alike. Methods: dense
(the toolkit's dense state: the same storage, SDPA over everything), dense on the cpu backend's kernel
(the same kernel the sparse methods attend with), Radar with the paper's defaults (k = 64, n = 2048),
Radar at a budget of 1024 tokens (one selection per query head, and shared by a KV group), radar+
(issue 7) at the same budget, and StreamingLLM at a budget of 64 tokens: almost no attention at all,
so its speed is the ceiling any sparse attention can reach on this model (its ppl is not a contender).

``--batch B`` decodes B sequences together (windows of B stdlib modules: pydecimal, inspect, typing,
tarfile, doctest, argparse, pyio, then further windows of the same): the K/V a step reads grows with B
while the weights it reads do not, which is where sparse attention pays on a small model.

GPU (``--device cuda``): additionally a randomly initialised Llama-3-8B-shaped model (timing does
not depend on weight values; its perplexity is meaningless and not reported) at 32k and 128k.

    python benchmarks/e2e.py                     # CPU, default model
    python benchmarks/e2e.py --lengths 2048 --steps 16 --threads 1
    python benchmarks/e2e.py --batch 8 --lengths 8127   # 8 sequences at once
    python benchmarks/e2e.py --device cuda --llama3-shaped

Writes ``benchmarks/results/e2e-<device>[-b<batch>].json``; reuses finished runs under ``--runs``.
"""

from __future__ import annotations

import argparse
import json
import platform
from pathlib import Path

import torch

from sparseattn import Dense, RadarAlg1, RadarPlus, StreamingLLM
from sparseattn.evaluation.batches import stdlib_rows
from sparseattn.evaluation.ppl import run_ppl_together
from sparseattn.evaluation.runs import RunDir, environment
from sparseattn.hf import load_model

METHODS = {
    "dense": Dense(),
    "dense (cpu kernel)": Dense(backend="cpu"),
    "radar-alg1 (k=64, n=2048)": RadarAlg1(top_k=64, n_features=2048),
    "radar-alg1 (budget 1024)": RadarAlg1(budget=1024, n_features=2048),
    "radar-alg1 (budget 1024, shared)": RadarAlg1(budget=1024, n_features=2048, shared_kv_selection=True),
    "radar+ (budget 1024)": RadarPlus(budget=1024),
    # Attends 64 tokens: what a step costs with (almost) no attention, the ceiling of every sparse row.
    "streamingllm (budget 64)": StreamingLLM(budget=64),
}


def slug(text: str) -> str:
    return "".join(ch if ch.isalnum() else "-" for ch in text).strip("-")


def llama3_shaped(device: torch.device, layers: int, max_positions: int):
    import transformers as tf

    config = tf.LlamaConfig(
        vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=layers, num_attention_heads=32,
        num_key_value_heads=8, max_position_embeddings=max_positions, rope_theta=500000.0,
    )
    with torch.device(device):
        model = tf.LlamaForCausalLM(config).to(torch.bfloat16).eval()
    return model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--lengths", type=int, nargs="+", default=None)
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--batch", type=int, default=1, help="sequences decoded together")
    parser.add_argument("--methods", nargs="+", default=None, help=f"only these rows (dense always runs); from {list(METHODS)}")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--llama3-shaped", action="store_true", help="(GPU) a random Llama-3-8B-shaped model instead")
    parser.add_argument("--layers", type=int, default=32, help="layers of the Llama-3-8B-shaped model")
    parser.add_argument("--runs", type=Path, default=Path(__file__).parent / "results" / "e2e-runs")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda but no CUDA device is available")
    if args.threads:
        torch.set_num_threads(args.threads)
    methods = dict(METHODS)
    if device.type != "cpu":
        del methods["dense (cpu kernel)"]
    if args.methods:
        unknown = set(args.methods) - set(methods)
        if unknown:
            raise SystemExit(f"unknown --methods {sorted(unknown)}; choose from {list(methods)}")
        methods = {name: m for name, m in methods.items() if name == "dense" or name in args.methods}
    if args.llama3_shaped:
        lengths = args.lengths or [32768, 131072]
        model = llama3_shaped(device, args.layers, max(lengths) + args.steps + 1)
        ids = torch.randint(0, 128256, (args.batch, max(lengths) + args.steps + 1), generator=torch.Generator().manual_seed(0))
        model_name = f"llama3-8b-shaped-random-{args.layers}-layers"
    else:
        lengths = args.lengths or [2048, 4096, 8192 - args.steps - 1]
        model, tokenizer = load_model("default", dtype=getattr(torch, args.dtype), device=device)
        ids = stdlib_rows(tokenizer, args.batch, max(lengths) + args.steps + 1)
        model_name = "default"
    info = environment()
    info["platform"] = platform.platform()
    print(f"machine: {json.dumps(info)}")
    print(f"batch {args.batch}, {args.steps} decode steps after each prompt; tokens/s counts every row's tokens")
    header = f"{'method':<30}{'context':>9}{'tokens/s':>10}{'speedup':>9}{'ppl':>9}{'ppl vs dense':>14}{'attended':>10}"
    print(header)
    print("-" * len(header))
    rows = []
    for length in lengths:
        # All methods decode the same tokens with their steps interleaved (see run_ppl_together): on a
        # shared machine, methods timed one after the other meet different drifts and do not compare.
        runs = {}
        for name, method in methods.items():
            config = {"command": "e2e", "model": model_name, "prefill": length, "steps": args.steps, "method": name,
                      "params": repr(method), "dtype": args.dtype, "device": device.type, "threads": torch.get_num_threads(),
                      "interleaved": sorted(methods)}  # fmt: skip
            where = f"{model_name}-{device.type}-t{torch.get_num_threads()}"
            if args.batch > 1:
                config["batch"] = args.batch
                where += f"-b{args.batch}"
            runs[name] = (method, RunDir(args.runs / where / f"p{length}" / slug(name), config))
        rows_ids = ids[:, : length + args.steps + 1]
        summaries = run_ppl_together(model, runs, rows_ids if args.batch > 1 else rows_ids[0], length, args.steps)
        dense = None
        for name in methods:
            summary = summaries[name]
            row = {"method": name, "context": length, "batch": args.batch,
                   **{k: summary[k] for k in ("tokens_per_second", "ppl", "mean_attended_tokens")}}
            if dense is None:
                dense = row
            row["speedup"] = row["tokens_per_second"] / dense["tokens_per_second"]
            row["ppl_ratio"] = row["ppl"] / dense["ppl"]
            rows.append(row)
            ppl = "-" if args.llama3_shaped else f"{row['ppl']:.3f}"
            ratio = "-" if args.llama3_shaped else f"{100 * (row['ppl_ratio'] - 1):+.1f}%"
            print(f"{name:<30}{length:>9}{row['tokens_per_second']:>10.2f}{row['speedup']:>9.2f}{ppl:>9}{ratio:>14}"
                  f"{row['mean_attended_tokens']:>10.0f}", flush=True)
    suffix = f"-b{args.batch}" if args.batch > 1 else ""
    out = args.out or Path(__file__).parent / "results" / f"e2e-{device.type}{suffix}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"machine": info, "model": model_name, "steps": args.steps, "batch": args.batch, "rows": rows}, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
