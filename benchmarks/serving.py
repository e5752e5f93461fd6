"""Decode speed inside vLLM: stock vLLM's dense kernel vs the sparseattn plugin's paged engine (issue 16, item 7).

Every sequence of a batch reads one shared document (the repository's README and docs, cut to
``--context`` tokens) followed by its own short question; four engines (stock vLLM, the plugin's
dense path, quest and radar+ at each of ``--budgets``) are started first and measured in alternation; each
run's greedy tokens are compared with stock's before any speed is reported. The method and its
details are in :mod:`sparseattn.evaluation.serving`; ``sparseattn serving-bench`` runs the same
comparison from the command line.

    .venv-vllm/bin/python benchmarks/serving.py --context 2048 --batches 1 8 --new-tokens 32 --runs 2

Writes ``benchmarks/results/serving-cpu-c<context>.json``. Needs vLLM (docs/serving.md, the venv).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from sparseattn.evaluation import serving

REPO = Path(__file__).resolve().parents[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--context", type=int, default=2048, help="tokens of the shared document")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--runs", type=int, default=2, help="rounds of alternating measurements (median reported)")
    parser.add_argument("--budgets", type=int, nargs="+", default=[1024], help="each method runs at each budget")
    parser.add_argument("--only", nargs="+", default=None, help="run labels to keep (default: all)")
    parser.add_argument("--kv-cache-gib", type=int, default=1, help="VLLM_CPU_KVCACHE_SPACE per engine")
    parser.add_argument("--block-size", type=int, default=None, help="vLLM's page size for every engine (default: vLLM's, 128 "
                        "on CPU; its CPU kernels take multiples of 16): the paged engine's segment size")
    parser.add_argument("--yarn", type=float, default=None, help="stretch the model's RoPE window this many times by YaRN "
                        "(vLLM hf_overrides): contexts beyond the trained 8k, e.g. --yarn 4 --context 32000")
    parser.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16", help="the engines' dtype (float32 "
                        "where the CPU has no fast bf16 matmul: AVX2-only x86 runs bf16 GEMMs on a slow fallback)")
    parser.add_argument("--methods", nargs="+", default=["quest", "radar+"], help="sparse methods run beside stock and dense")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    # The sizes first; the model's window once the model is found (below).
    for option, problem in serving.option_problems(args.context, args.batches, args.new_tokens, args.runs):
        parser.error(f"{option}: {problem}")
    for budget in args.budgets:
        if budget < 1:
            parser.error(f"--budgets: {budget} is out of range; allowed: >= 1")
    if args.block_size is not None and (args.block_size < 16 or args.block_size % 16):
        parser.error(f"--block-size: {args.block_size} is not allowed; allowed: a multiple of 16 (vLLM's CPU kernels: multiples of 32 through vec, of 16 through vec16)")
    if args.kv_cache_gib < 1:
        parser.error(f"--kv-cache-gib: {args.kv_cache_gib} is out of range; allowed: >= 1")
    if args.yarn is not None and not args.yarn > 1:
        parser.error(f"--yarn: {args.yarn} is out of range; allowed: > 1")
    runs = serving.runs_for(args.budgets, args.methods)
    if args.only:
        runs = {k: v for k, v in runs.items() if k in args.only}
    if serving.STOCK not in runs:
        parser.error("the stock run is the reference: keep it in --only")
    reason = serving.vllm_unavailable_reason()
    if reason:
        parser.error(reason)

    from rich.console import Console
    from transformers import AutoConfig

    from sparseattn.hf.models import local_model_dir

    model = str(local_model_dir())
    overrides = serving.yarn_overrides(model, args.yarn) if args.yarn else None
    window = overrides["max_position_embeddings"] if overrides else getattr(AutoConfig.from_pretrained(model), "max_position_embeddings", None)
    for option, problem in serving.option_problems(args.context, args.batches, args.new_tokens, args.runs, window):
        parser.error(f"{option}: {problem}")
    console = Console(width=160)
    machine, rows = serving.run(
        model, runs, context=args.context, batches=args.batches, new_tokens=args.new_tokens, rounds=args.runs,
        kv_cache_gib=args.kv_cache_gib, block_size=args.block_size, hf_overrides=overrides, dtype=args.dtype, say=console.print,
    )  # fmt: skip
    console.print(serving.table(rows, args.context, args.new_tokens, args.runs))
    out = args.out or REPO / "benchmarks" / "results" / f"serving-cpu-c{args.context}{'-yarn' if args.yarn else ''}{'-f32' if args.dtype == 'float32' else ''}.json"
    serving.write(out, machine, model, vars(args), rows)
    console.print(f"wrote {out}")


if __name__ == "__main__":
    main()
