"""The numbers a restructure must keep (issue 36, "Keep"): recorded before, compared after, bit for bit.

1. **Transformers**: the perplexity of every registered method (budget 512 where it has one) on one
   prose and one code text, 2048 prompt tokens prefilled densely and 256 decode steps teacher-forced,
   float32, the default model. All methods share one prefill per text
   (:func:`sparseattn.evaluation.shared_prefill.prefill_together`, tested equal to separate prefills).
2. **The paged engine** (vLLM's cache layout, no vLLM needed): the outputs of dense, streamingllm, quest
   and radar+ on a fixed random cache (3 sequences of 700-2100 tokens, 32-token pages, GQA 3x2, d 64),
   through the generic path (``paged_decode``) and, where it builds, the fused C step (``fused_decode``);
   kept as SHA-256 of the float32 bytes, so "equal" means bit-identical.

    python benchmarks/keep_numbers.py --out benchmarks/results/keep-numbers-before.json       # ~25 min on 2 cores
    python benchmarks/keep_numbers.py --out /tmp/after.json --against benchmarks/results/keep-numbers-before.json

With ``--against`` it prints every number that moved and exits 1 if any did. Methods that are
registered on one side only are listed, not failed (a restructure may add aliases).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import sys
import time
import warnings
from pathlib import Path

import torch

TEXTS = {"prose": "hamlet", "code": "pydecimal"}
PREFILL, STEPS, BUDGET = 2048, 256, 512
PAGED_METHODS = ("dense", "streamingllm", "quest", "radar+")


def build(name: str):
    from sparseattn import registry

    entry = registry.get(name)
    return registry.build(name, **({"budget": BUDGET} if "budget" in entry.option_names else {}))


def transformers_ppl(say) -> dict[str, dict[str, float]]:
    from sparseattn import registry
    from sparseattn.data.sources import load_text
    from sparseattn.evaluation.ppl import tokenize
    from sparseattn.evaluation.shared_prefill import prefill_together
    from sparseattn.hf import apply, cache_kwargs
    from sparseattn.hf.models import load_model
    from sparseattn.methods import Dense

    model, tokenizer = load_model("default")
    with warnings.catch_warnings():  # the former names are aliases now, and measured as such
        warnings.simplefilter("ignore", FutureWarning)
        methods = {name: build(name) for name in [*registry.names(), *registry.aliases()]}
    out: dict[str, dict[str, float]] = {}
    for kind, text in TEXTS.items():
        ids = tokenize(tokenizer, load_text(text), PREFILL + STEPS + 1, name=text)[None, : PREFILL + STEPS + 1]
        begin = time.perf_counter()
        caches = prefill_together(model, methods, ids[:, :PREFILL], progress=False)
        nll = dict.fromkeys(methods, 0.0)
        with apply(model, Dense()), torch.no_grad():
            for name, cache in caches.items():
                for i in range(STEPS):
                    token, target = ids[:, PREFILL + i : PREFILL + i + 1], ids[:, PREFILL + i + 1]
                    logits = model(token, **cache_kwargs(model, cache), use_cache=True).logits[:, -1].double()
                    nll[name] += float(torch.nn.functional.cross_entropy(logits, target, reduction="sum"))
                caches[name] = None  # free each method's cache once scored
        out[f"{kind}:{text}"] = {name: math.exp(total / STEPS) for name, total in nll.items()}
        say(f"{kind} ({text}): {len(methods)} methods in {time.perf_counter() - begin:.0f} s")
    return out


def _digest(tensor: torch.Tensor) -> str:
    return hashlib.sha256(tensor.detach().to(torch.float32).contiguous().numpy().tobytes()).hexdigest()


def paged_outputs() -> dict[str, str]:
    from sparseattn.vllm.paged import PagedPolicy, page_views, paged_decode
    from sparseattn.vllm.paged_kernel import PageStore, fused_decode, kernel_refusal
    from sparseattn.vllm.route import route

    lengths, bs, kv_heads, group, dim = (700, 1500, 2100), 32, 3, 2, 64
    g = torch.Generator().manual_seed(36)
    pages = [-(-n // bs) for n in lengths]
    blocks = sum(pages) + 5
    cache = torch.randn(blocks, kv_heads, bs, 2 * dim, generator=g)
    order = torch.randperm(blocks, generator=g)
    table = torch.zeros(len(lengths), max(pages), dtype=torch.int32)
    used = 0
    for i, n in enumerate(pages):
        table[i, :n] = order[used : used + n].to(torch.int32)
        used += n
    page_views(cache)  # the layout check
    query = torch.randn(len(lengths), kv_heads * group, dim, generator=g)
    seq_lens = torch.tensor(lengths)
    out = {}
    for name in PAGED_METHODS:
        policy = PagedPolicy(build(name), name)
        params, gen = policy.prepare(kv_heads, dim, layer_idx=0)
        out[f"{name} generic"] = _digest(paged_decode(policy, params, gen, cache, query, table, seq_lens, dim**-0.5))
        way = route(policy, kernel_refusal())
        if way.fused:
            store = PageStore(blocks, kv_heads, dim, way.mode) if way.keeps_store else None
            result, _ = fused_decode(policy, way.mode, store, cache, query, table, seq_lens, dim**-0.5)
            out[f"{name} fused"] = _digest(result)
    return out


def compare(now: dict, before: dict) -> list[str]:
    moved = []
    for section in ("ppl", "paged"):
        old, new = before.get(section, {}), now.get(section, {})
        if section == "ppl":
            for text in sorted(set(old) | set(new)):
                a, b = old.get(text, {}), new.get(text, {})
                for name in sorted(set(a) | set(b)):
                    if name not in a or name not in b:
                        print(f"  {text} {name}: only {'after' if name in b else 'before'}")
                    elif a[name] != b[name]:
                        moved.append(f"ppl {text} {name}: {a[name]!r} -> {b[name]!r}")
        else:
            for key in sorted(set(old) | set(new)):
                if old.get(key) != new.get(key):
                    moved.append(f"paged {key}: {old.get(key)} -> {new.get(key)}")
    return moved


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="the JSON written")
    parser.add_argument("--against", type=Path, default=None, help="a JSON written before: print what moved, exit 1 if anything did")
    parser.add_argument("--paged-only", action="store_true", help="skip the transformers perplexities (seconds instead of minutes)")
    args = parser.parse_args()
    if args.against is not None and not args.against.is_file():
        parser.error(f"--against: {args.against} is not a file")
    torch.manual_seed(0)
    now = {"config": {"texts": TEXTS, "prefill": PREFILL, "steps": STEPS, "budget": BUDGET, "torch": torch.__version__,
                      "threads": torch.get_num_threads()}}  # fmt: skip
    now["paged"] = paged_outputs()
    print(f"paged engine: {len(now['paged'])} outputs", flush=True)
    if not args.paged_only:
        now["ppl"] = transformers_ppl(lambda line: print(line, flush=True))
        for text, values in now["ppl"].items():
            print(text, json.dumps({k: round(v, 4) for k, v in values.items()}), flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(now, indent=1) + "\n")
    print(f"wrote {args.out}")
    if args.against is not None:
        moved = compare(now, json.loads(args.against.read_text()))
        print("\n".join(moved) if moved else f"every number equal to {args.against}'s")
        sys.exit(1 if moved else 0)


if __name__ == "__main__":
    main()
