"""Passkey retrieval in vLLM: stock vs a sparse method at a few budgets, one sample per depth (10, 50, 90%).

float32, greedy 16 tokens, chunked prefill (1024 tokens a chunk by default), 32-token pages by default; run in the vLLM venv
from the repository root (it uses the engine helper of the vLLM tests, tests/vllm_engine.py):

    PYTHONPATH=. .venv-vllm/bin/python benchmarks/vllm_passkey.py                      # ~8k: the model's limit
    PYTHONPATH=. .venv-vllm/bin/python benchmarks/vllm_passkey.py --length 32000 --yarn 4 --budgets 1024 \
        --prefill-chunk 8192 --kv-cache-gib 6

Beyond the model's window (``--yarn F``) every engine, stock included, runs with YaRN's RoPE stretched
F times (:func:`sparseattn.evaluation.vllm_engine.yarn_overrides`): no training, so stock's score there is
what YaRN gives this model, the reference a sparse method is compared with. Writes
``benchmarks/results/vllm-passkey-<k>k-block<B>[-yarn<F>].json``: per run, (depth, answer, references, score),
rewritten after each run; a rerun skips the runs already there (delete the file to measure again).
"""

import argparse
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))

from vllm_engine import greedy_tokens  # noqa: E402

from sparseattn.data.needle import PasskeyTask, string_match_all  # noqa: E402
from sparseattn.evaluation.serving_workload import positions_needed  # noqa: E402
from sparseattn.evaluation.vllm_engine import yarn_overrides  # noqa: E402
from sparseattn.hf.models import local_model_dir  # noqa: E402

NEW_TOKENS = 16
DEPTHS = (10.0, 50.0, 90.0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--length", type=int, default=8000, help="prompt tokens (default 8000)")
    parser.add_argument("--yarn", type=float, default=None, help="stretch RoPE this many times by YaRN (> 1), for lengths beyond 8k")
    parser.add_argument("--method", default="radar+", help="the sparse method (a registry name the vLLM plugin runs)")
    parser.add_argument("--budgets", type=int, nargs="+", default=[512, 1024])
    parser.add_argument("--block-size", type=int, default=32, help="vLLM's page size in tokens (default 32)")
    parser.add_argument("--segment", type=int, default=None, help="the paged engine's segment inside a page (a divisor of "
                        "--block-size; default: the page); labels the runs '<method><budget>-seg<N>'")
    parser.add_argument("--prefill-chunk", type=int, default=1024,
                        help="vLLM's max_num_batched_tokens (chunked prefill); at 32k, 8192 prefills ~4x faster than 1024 on 2 cores")
    parser.add_argument("--kv-cache-gib", type=int, default=4, help="vLLM's KV cache (VLLM_CPU_KVCACHE_SPACE): 3 prompts of 32k in float32 take ~4.4 GiB")
    args = parser.parse_args()
    for option, value in (("--length", args.length), ("--block-size", args.block_size), ("--prefill-chunk", args.prefill_chunk),
                          ("--kv-cache-gib", args.kv_cache_gib), *(("--budgets", b) for b in args.budgets)):  # fmt: skip
        if value < 1:
            parser.error(f"{option} must be >= 1, got {value}")
    model = str(local_model_dir())
    try:
        overrides = yarn_overrides(model, args.yarn) if args.yarn is not None else None
    except ValueError as error:
        parser.error(f"--yarn {args.yarn}: {error}")
    window = (overrides or {}).get("max_position_embeddings") or json.loads(Path(model, "config.json").read_text())["max_position_embeddings"]
    max_len = positions_needed(args.length, NEW_TOKENS)
    if max_len > window:
        parser.error(f"--length {args.length} needs {max_len} positions; the model has {window} (stretch it with --yarn)")
    engine = {"dtype": "float32", "max_model_len": max_len, "max_num_batched_tokens": args.prefill_chunk, "enable_chunked_prefill": True,
              "seed": 0, "block_size": args.block_size, **({"hf_overrides": overrides} if overrides else {})}  # fmt: skip

    import tempfile

    from transformers import AutoTokenizer

    logs = Path(tempfile.mkdtemp(prefix="vllm-passkey-"))
    tok = AutoTokenizer.from_pretrained(model)
    samples = [PasskeyTask().sample(args.length, tok, seed=i, depths=d, reserve_tokens=NEW_TOKENS) for i, d in enumerate(DEPTHS)]
    ids = [tok.encode(s.prompt) for s in samples]
    print("lengths", [len(i) for i in ids], "engine logs in", logs, flush=True)
    segment = {} if args.segment is None else {"segment": args.segment}
    tag = "" if args.segment is None else f"-seg{args.segment}"
    runs = {"stock": {}} | {f"{args.method}{b}{tag}": {"additional_config": {"sparseattn": {"method": args.method, "budget": b, **segment}}}
                            for b in args.budgets}  # fmt: skip
    name = f"vllm-passkey-{round(args.length / 1000)}k-block{args.block_size}{f'-yarn{args.yarn:g}' if args.yarn else ''}.json"
    path = REPO / "benchmarks" / "results" / name
    out = json.loads(path.read_text()) if path.exists() else {}  # resumable: runs already written are kept
    for label, extra in runs.items():
        if label in out:
            print(label, "(from", path.name + ")", out[label], flush=True)
            continue
        prompts = [{"prompt_token_ids": p} for p in ids]
        tokens, _ = greedy_tokens(logs / f"{label}.log", prompts, {**engine, **extra}, NEW_TOKENS, ignore_eos=True, cache_gib=str(args.kv_cache_gib))
        answers = [tok.decode(t) for t in tokens]
        out[label] = [(d, a, s.answers, string_match_all([a], [s.answers])) for d, a, s in zip(DEPTHS, answers, samples)]
        print(label, out[label], flush=True)
        path.write_text(json.dumps(out, indent=1))  # after every run: a run that dies keeps the others
    print("wrote", path)


if __name__ == "__main__":
    main()
