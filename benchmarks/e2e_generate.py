"""End to end through ``model.generate``: decode tokens/s and GPU memory of dense and sparse attention.

A model of a real architecture with random weights (decode speed does not depend on the weights'
values; nothing is downloaded), bfloat16 on CUDA:

* ``llama-3.1-8b``: 32 layers, hidden 4096, 32 query / 8 KV heads of 128, MLP 14336, vocab 128256;
* ``tiny``: 2 layers, hidden 64, 4 query / 2 KV heads of 16 (the CPU check of this script).

For each context length and batch: one prompt of random token ids is prefilled once by the model
with transformers' own ``sdpa`` attention and ``DynamicCache`` (what a user runs); each sparse
method's cache is then built from that cache's keys and values (a segment search builds its
segments from the keys alone, so this is the state its own prefill would give: asserted below). With
``--own-prefill`` each method prefills its own cache instead, one after another, and no dense copy is kept
beside it (the row says ``prefill: own``): what fits 128k tokens x 4 of the 8B shape on a 141 GB H200
(about 97 GB against 166 with the shared prefill), a row that is skipped without it; its four prefills of
512k tokens take minutes, so ``scripts/gpu-check.sh`` leaves it to a run of its own. Then
``model.generate`` continues the prompt for ``--new-tokens`` tokens with each cache in turn: dense
(transformers' ``sdpa`` over a ``DynamicCache``, the baseline), then the sparse methods through
``sparseattn.apply``. ``Dense()`` (the toolkit's own dense state, SDPA over capacity-doubling storage) runs as a sparse
method does, so the gain of not concatenating the cache at every step (transformers' ``DynamicCache``
does) is apart from the gain of attending fewer tokens. A first short ``generate`` of each compiles its
kernels (untimed); then
``--rounds`` timed ``generate`` calls per method, in turn. Reported per method: decode tokens/s
(every row's tokens), speedup over dense, the peak GPU memory allocated during its timed calls, the
bytes its cache holds, and the byte model's ceiling for the speedup: a step must read the weights
once whatever the attention does, so ``(weights + dense KV) / (weights + attended KV)`` bounds it.

    python benchmarks/e2e_generate.py --device cuda                       # 32k and 128k, batch 1 and 4
    python benchmarks/e2e_generate.py --device cpu --shape tiny --lengths 256 --batches 1 --new-tokens 4

Writes ``benchmarks/results/e2e-generate-<device>.json`` (or ``--out``), after every row.
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

import torch

from sparseattn import Dense, Quest, RadarPlus, apply
from sparseattn.hf import SparseCache, cache_kwargs
from sparseattn.methods.base import LayerSpec
from sparseattn.methods.segment_search import SegmentSearch

SHAPES = {
    "llama-3.1-8b": dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                         num_attention_heads=32, num_key_value_heads=8, rope_theta=500000.0),
    "tiny": dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2),
}  # fmt: skip


def random_model(shape: str, device: torch.device, dtype: torch.dtype, max_positions: int):
    """A Llama of ``shape`` with random weights, made directly in ``dtype`` on ``device`` (no float32 copy)."""
    import transformers as tf

    config = tf.LlamaConfig(**SHAPES[shape], max_position_embeddings=max_positions, pad_token_id=0, eos_token_id=None)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = tf.LlamaForCausalLM(config).eval()
    finally:
        torch.set_default_dtype(previous)
    return model


def sparse_cache_from(model, dense_cache, method: SegmentSearch | Dense) -> SparseCache:
    """``method``'s cache holding the keys and values of ``dense_cache`` (a prefilled ``DynamicCache``).

    Only for a segment search without an always-kept part, or ``Dense``: their states are built from
    the stored keys alone (appending them is what their own prefill does, apart from attending), so the
    cache is the one a prefill with the method would leave (tests/test_gpu_check.py checks it). Methods
    that learn from the prompt's queries (H2O, SnapKV, heavy hitters) must prefill themselves.
    """
    if not (isinstance(method, Dense) or (isinstance(method, SegmentSearch) and method.always is None)):
        raise ValueError(f"{method!r}: only a segment search without an always-kept part (or Dense) builds from stored keys alone")
    cache = SparseCache(method, config=model.config)
    n_layers = len(cache.layers)
    for index, (layer, source) in enumerate(zip(cache.layers, dense_cache.layers)):
        keys, values = source.keys, source.values
        B, H, L, D = keys.shape
        spec = LayerSpec(B, H, D, index, keys.device, keys.dtype, model.config.head_dim**-0.5, None, 0, H, n_layers)
        layer.state = method.new_state(spec)
        layer.state.append(keys, values)
        layer.lazy_initialization(keys, values)
        layer.seen = L
    return cache


def weight_bytes(model) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def cache_bytes(cache) -> int:
    if isinstance(cache, SparseCache):
        return sum(cache.nbytes().values())
    return sum(layer.keys.numel() * layer.keys.element_size() * 2 for layer in cache.layers if layer.keys is not None)


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed_generate(model, ids: torch.Tensor, cache, new_tokens: int, device: torch.device) -> tuple[torch.Tensor, float]:
    """``generate`` ``new_tokens`` greedy tokens after ``ids`` (their last token not yet cached); seconds taken."""
    synchronize(device)
    begin = time.perf_counter()
    out = model.generate(
        ids, **cache_kwargs(model, cache), max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
        attention_mask=torch.ones_like(ids),
    )  # fmt: skip
    synchronize(device)
    return out, time.perf_counter() - begin


def needed_bytes(model, batch: int, length: int, shared: bool, chunk: int = 0) -> int:
    """A rough peak for one row: weights, prefill activations (of ``chunk`` tokens at a time; 0: the whole prompt), and
    the caches held at once: a sparse cache (the prompt and an eighth more: its storage's first block,
    :class:`~sparseattn.ops.buffers.GrowableBuffer`), and with ``shared`` the dense prefill's cache beside it (each
    sparse cache built from it)."""
    c = model.config
    kv = 2 * c.num_hidden_layers * c.num_key_value_heads * c.head_dim * 2 * batch * length
    activations = 4 * batch * (min(chunk, length) if chunk else length) * c.intermediate_size * 2
    return weight_bytes(model) + kv * 9 // 8 + (kv if shared else 0) + activations


def prefill(model, prompt: torch.Tensor, cache, device: torch.device, chunk: int = 0) -> float:
    """Fill ``cache`` with the prompt's keys and values but its last token's (``generate`` feeds that one), ``chunk``
    tokens per forward pass (0: one pass; a chunk's MLP activations are what a long prompt's peak is made of); seconds."""
    synchronize(device)
    begin = time.perf_counter()
    fed = prompt[:, :-1]
    step = chunk or fed.shape[1]
    with torch.no_grad():
        for start in range(0, fed.shape[1], step):
            model(fed[:, start : start + step], **cache_kwargs(model, cache), use_cache=True, logits_to_keep=1)
    synchronize(device)
    return time.perf_counter() - begin


def run_row(
    model, methods: dict, batch: int, length: int, new_tokens: int, rounds: int, device: torch.device, own_prefill: bool = False,
    chunk: int = 0,
) -> list[dict]:  # fmt: skip
    """One context length and batch: prefill once (``own_prefill``: once per method, into its own cache; ``chunk``
    tokens a pass), then every method's warm-up and timed ``generate`` calls."""
    from transformers import DynamicCache

    gen = torch.Generator().manual_seed(length + batch)
    prompt = torch.randint(1, model.config.vocab_size, (batch, length), generator=gen).to(device)
    dense_cache = None
    if not own_prefill:
        dense_cache = DynamicCache(config=model.config)
        prefill_s = prefill(model, prompt, dense_cache, device, chunk)
    rows = []
    attended_kv = {}
    # The sparse methods first, each built from the prefilled cache (or prefilled into its own) and freed after its calls;
    # dense last, on that cache (or on its own prefill, once no sparse cache is held).
    for name, method in [*((n, m) for n, m in methods.items()), ("dense (transformers sdpa)", None)]:
        if own_prefill:
            cache = DynamicCache(config=model.config) if method is None else SparseCache(method, config=model.config)
            prefill_s = prefill(model, prompt, cache, device, chunk)
        else:
            cache = dense_cache if method is None else sparse_cache_from(model, dense_cache, method)
        ids = prompt
        ids, _ = timed_generate(model, ids, cache, 2, device)  # compiles the kernels; untimed
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        seconds = []
        for _ in range(rounds):
            ids, s = timed_generate(model, ids, cache, new_tokens, device)
            seconds.append(s)
        row = {
            "method": name, "params": repr(method) if method is not None else "DynamicCache + sdpa",
            "batch": batch, "context": length, "new_tokens": new_tokens, "rounds": rounds,
            "prefill": "own" if own_prefill else "shared", "prefill_chunk": chunk, "prefill_s": prefill_s, "seconds": seconds,
            "tokens_per_second": batch * new_tokens * rounds / sum(seconds),
            "cache_bytes": cache_bytes(cache), "weight_bytes": weight_bytes(model),
        }  # fmt: skip
        if isinstance(cache, SparseCache):
            row["mean_attended_tokens"] = cache.mean_attended()
            attended_kv[name] = cache.mean_attended()
        else:
            row["mean_attended_tokens"] = float(ids.shape[1])
        if device.type == "cuda":
            row["peak_memory_bytes"] = torch.cuda.max_memory_allocated(device)
        rows.append(row)
        if cache is not dense_cache:
            del cache
            if device.type == "cuda":
                torch.cuda.empty_cache()  # the next method's own prefill needs this one's memory
    dense = rows[-1]
    c = model.config
    kv_per_token = 2 * c.num_hidden_layers * c.num_key_value_heads * c.head_dim * 2 * batch  # bytes one token adds
    for row in rows:
        row["speedup"] = row["tokens_per_second"] / dense["tokens_per_second"]
        # Bytes a step must read: the weights once, and the KV it attends (dense: all of it).
        dense_step = row["weight_bytes"] + kv_per_token * dense["mean_attended_tokens"]
        step = row["weight_bytes"] + kv_per_token * row["mean_attended_tokens"]
        row["byte_model_ceiling"] = dense_step / step
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--shape", choices=sorted(SHAPES), default="llama-3.1-8b")
    parser.add_argument("--lengths", type=int, nargs="+", default=[32768, 131072 - 128])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--budget", type=int, default=4096, help="the sparse methods' token budget")
    parser.add_argument("--new-tokens", type=int, default=32, help="tokens per timed generate call")
    parser.add_argument("--rounds", type=int, default=2, help="timed generate calls per method")
    parser.add_argument("--own-prefill", action="store_true", help="every method prefills its own cache (else only "
                        "where the dense cache and a sparse one do not fit together)")
    parser.add_argument("--prefill-chunk", type=int, default=None, help="prompt tokens per prefill pass (0: the whole "
                        "prompt at once; default: 8192 on CUDA, 0 on the CPU)")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    for name in ("budget", "new_tokens", "rounds"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.prefill_chunk is not None and args.prefill_chunk < 0:
        parser.error(f"--prefill-chunk must be >= 0 (0: one pass), got {args.prefill_chunk}")
    device = torch.device(args.device)
    chunk = args.prefill_chunk if args.prefill_chunk is not None else (8192 if device.type == "cuda" else 0)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda but no CUDA device is available")
    dtype = torch.bfloat16
    model = random_model(args.shape, device, dtype, max(args.lengths) + args.new_tokens * (args.rounds + 1) + 8)
    methods = {
        f"radar+ (budget {args.budget})": RadarPlus(budget=args.budget),
        f"quest (budget {args.budget})": Quest(budget=args.budget),
        # The toolkit's own dense state (capacity-doubling storage, SDPA over every token): beside transformers'
        # DynamicCache, which concatenates the whole cache at every step, it separates storage from sparsity.
        "dense (sparseattn Dense)": Dense(),
    }
    info = {"device": str(device), "torch": torch.__version__, "platform": platform.platform(), "shape": args.shape, "dtype": str(dtype)}
    if device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(device)
        info["memory_bytes"] = torch.cuda.get_device_properties(device).total_memory
    print(f"machine: {json.dumps(info)}")
    out = args.out or Path(__file__).parent / "results" / f"e2e-generate-{device.type}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    header = f"{'method':<28}{'batch':>6}{'context':>9}{'tok/s':>9}{'speedup':>9}{'ceiling':>9}{'attended':>10}{'peak GB':>9}{'cache GB':>10}"
    print(header)
    print("-" * len(header))
    rows, skipped = [], []
    with apply(model, next(iter(methods.values()))):  # routes attention through sparseattn; a DynamicCache stays dense sdpa
        for length in args.lengths:
            for batch in args.batches:
                own = args.own_prefill
                need = needed_bytes(model, batch, length, shared=not own, chunk=chunk)
                if device.type == "cuda" and need > 0.92 * info["memory_bytes"]:
                    hint = "" if own else f" (about {needed_bytes(model, batch, length, shared=False, chunk=chunk) / 1e9:.0f} GB with --own-prefill)"
                    skipped.append({"batch": batch, "context": length, "reason": f"needs about {need / 1e9:.0f} GB of {info['memory_bytes'] / 1e9:.0f}{hint}"})
                    print(f"skipped batch {batch} at {length}: {skipped[-1]['reason']}", flush=True)
                    continue
                try:
                    measured = run_row(model, methods, batch, length, args.new_tokens, args.rounds, device, own_prefill=own, chunk=chunk)
                except Exception as error:  # noqa: BLE001 (reported; the next row still runs)
                    skipped.append({"batch": batch, "context": length, "reason": f"failed: {type(error).__name__}: {str(error)[:400]}"})
                    print(f"batch {batch} at {length} failed: {skipped[-1]['reason']}", flush=True)
                    measured = []
                    if device.type == "cuda":
                        torch.cuda.empty_cache()
                for row in measured:
                    rows.append(row)
                    peak = row.get("peak_memory_bytes", float("nan")) / 1e9
                    print(f"{row['method']:<28}{batch:>6}{length:>9}{row['tokens_per_second']:>9.2f}{row['speedup']:>9.2f}"
                          f"{row['byte_model_ceiling']:>9.2f}{row['mean_attended_tokens']:>10.0f}{peak:>9.1f}{row['cache_bytes'] / 1e9:>10.2f}",
                          flush=True)  # fmt: skip
                out.write_text(json.dumps({"machine": info, "rows": rows, "skipped": skipped}, indent=2))
                if device.type == "cuda":
                    torch.cuda.empty_cache()
    out.write_text(json.dumps({"machine": info, "rows": rows, "skipped": skipped}, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
