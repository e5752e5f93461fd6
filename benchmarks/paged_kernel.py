"""One layer's decode attention over vLLM's paged CPU cache: stock vLLM's kernel vs the paged engine's paths.

What a serving step spends in attention, without an engine: a cache in vLLM's CPU layout
(``[N, H_kv, bs, 2 D]``, keys transposed per page) holding ``--batch`` sequences of ``--length``
tokens (with ``--shared`` all of them on the same blocks, as prefix caching gives the serving
benchmark's shared document), one decode query per sequence, the default model's heads (9 query,
3 KV, head dim 64). Rows, each timed per call and interleaved round by round (the machine drifts):

* ``vllm kernel (all pages)``: ``cpu_attention_with_kv_cache`` over each sequence's block table,
  what stock vLLM runs for decode (needs vLLM; skipped without it);
* ``fused <method>``: :func:`sparseattn.vllm.paged_kernel.fused_decode` (one C call: scoring,
  selection, attention), page summaries kept between calls as the serving engine keeps them;
* ``generic <method>``: :func:`~sparseattn.vllm.paged.choose_pages` (the policy's own parts in torch)
  then vLLM's kernel over the listed pages (a merged rest: :func:`~sparseattn.vllm.paged.attend_pages`
  with its tokens), the path any other policy takes (needs vLLM; ``--fused-only`` leaves them out);
* ``fused <method> (segment rows)`` (``--segment-rows``): the same step on a page store that keeps every
  segment's sums row, where the method's own store keeps page totals only (the same output, more memory).

The table gives each fused run's page store in MiB (what the engine holds beside vLLM's cache for one layer).

``--kv-cache-dtype fp8`` (or ``fp8_e4m3``, ``fp8_e5m2``) stores the pages as vLLM's fp8 cache (one byte a number, scale
1; the queries stay ``--dtype``); ``--layout amx`` writes them in vLLM's amx kernel's layout (bfloat16), which the fused
step reads in place (the vLLM row then runs only on a CPU with AMX).

Each call reads the next of ``--caches`` caches (each with its own page stores), round robin, as a serving
step's layers do: one 8k x 8 cache (49 MB in bf16) would stay partly in the last-level cache from call to
call, which a model's 30 layers never allow. ``--profile`` adds, per fused run, where one call's time goes
(:class:`sparseattn.vllm.profile.StepProfile`: each phase's microseconds, the megabytes it reads counted
in 64-byte lines, its GB/s and share of the machine's read bandwidth, measured at the start with
:func:`sparseattn.bandwidth.read_bandwidth`) and the call's byte floor: its bytes over that bandwidth.

``--keys text`` fills the caches with the default model's own keys and values instead of random ones: the
serving benchmark's 8 stdlib prompts (its pass keys included), one cache per layer from ``--layer`` on, each with
the query of its sequences' last token. Random keys scatter a shortlist over a sequence; real ones cluster, and
a segment's keys are read by whole 32-token units, so the bytes a step reads differ (the demo's: 63% of the keys
for the preset's rerank, ~88% with random keys). The keys are computed once (a forward pass through the layers
needed) and kept in ``$SPARSEATTN_HOME/bench``.

Methods are specs (``radar+:split=pooled,rest=merged``); a per-layer method (``radar+adaptive``) runs
the method of layer ``--layer`` of the default model's 30.

    python benchmarks/paged_kernel.py --length 8000 --batch 8 --shared --dtype bfloat16

Prints a table (median microseconds per call, and the ratio to vLLM's kernel) and writes JSON
(``benchmarks/results/paged-kernel-<dtype>-b<batch>-L<length>.json``). One thread unless ``--threads``,
as vLLM's CPU worker runs on this 2-core machine.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import platform
import statistics
import time
from pathlib import Path

import torch

from sparseattn.machine import cpu_flags, cpu_model
from sparseattn.cli.method_specs import parse_method
from sparseattn.vllm.paged import KVFormat, PagedPolicy, amx_layout, attend_pages, choose_pages, page_views
from sparseattn.bandwidth import read_bandwidth
from sparseattn.vllm.paged_kernel import PageStore, fused_decode, step_plan
from sparseattn.vllm.route import route
from sparseattn.vllm.profile import PHASE_WHAT, StepProfile

REPO = Path(__file__).resolve().parents[1]
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def block_table(batch: int, pages: int, shared: bool, g: torch.Generator) -> torch.Tensor:
    """``[batch, pages]`` int32: each sequence's blocks, scattered over the cache's first blocks (the last one spare);
    with ``shared`` every sequence on the same ones."""
    order = torch.randperm(pages * (1 if shared else batch), generator=g).to(torch.int32)
    return torch.stack([order[:pages] if shared else order[i * pages : (i + 1) * pages] for i in range(batch)]).contiguous()


def make_cache(batch: int, length: int, bs: int, H: int, D: int, dtype: torch.dtype, shared: bool, seed: int = 0):
    """A random cache and block table: ``batch`` sequences of ``length`` tokens (shared: on the same blocks).

    Keys have a per-page offset so that pages differ in how much attention they draw (random keys
    alone make every page look alike to a centroid).
    """
    g = torch.Generator().manual_seed(seed)
    pages = math.ceil(length / bs)
    n_blocks = pages * (1 if shared else batch) + 1
    cache = torch.randn(n_blocks, H, bs, 2 * D, generator=g)
    keys_t, _ = page_views(cache)
    keys_t += torch.randn(n_blocks, H, D, 1, generator=g) * 0.5
    return cache.to(dtype), block_table(batch, pages, shared, g)


def model_keys(batch: int, length: int, layers: range, shared: bool) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """The default model's keys and values ``[B, H_kv, length, D]`` (after RoPE, as a cache holds them) and its last
    token's queries ``[B, H_q, D]`` at each of ``layers``, over ``batch`` of the serving benchmark's prompts (one,
    repeated, when ``shared``); float32, computed once and kept on disk."""
    from sparseattn.paths import cache_dir

    path = cache_dir("bench") / f"paged-model-keys-b{batch}-L{length}-layers{layers.start}-{layers.stop}{'-shared' if shared else ''}.pt"
    if path.exists():
        return torch.load(path)
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from sparseattn.evaluation.serving_workload import workload
    from sparseattn.hf.models import load_model

    model, tokenizer = load_model("default")
    rows = workload(tokenizer, 1 if shared else batch, length, 2)
    ids = torch.tensor([row.ids for row in rows] * (batch if shared else 1))
    captured = {}

    class Enough(Exception):  # the last layer needed is captured: the rest of the forward pass is not run
        pass

    def capture(module, query, key, value, attention_mask, **kwargs):
        if module.layer_idx in layers:
            captured[module.layer_idx] = (key.float().clone(), value.float().clone(), query[:, :, -1].float().clone())
        if module.layer_idx == layers[-1]:
            raise Enough
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)

    AttentionInterface.register("sparseattn_bench_capture", capture)
    model.set_attn_implementation("sparseattn_bench_capture")
    try:
        with torch.no_grad():
            model(input_ids=ids, use_cache=False)
    except Enough:
        pass
    out = [captured[layer] for layer in layers]
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save(out, path)
    return out


def fill_cache(keys: torch.Tensor, values: torch.Tensor, bs: int, shared: bool, seed: int = 0):
    """``keys, values [B, H, length, D]`` laid out as :func:`make_cache` lays out its random ones (the same table)."""
    B, H, length, D = keys.shape
    g = torch.Generator().manual_seed(seed)
    pages = math.ceil(length / bs)
    n_blocks = pages * (1 if shared else B) + 1
    cache = torch.zeros(n_blocks, H, bs, 2 * D)
    keys_t, vals = page_views(cache)
    table = block_table(B, pages, shared, g)
    pad = pages * bs - length
    k = torch.nn.functional.pad(keys, (0, 0, 0, pad)).view(B, H, pages, bs, D)
    v = torch.nn.functional.pad(values, (0, 0, 0, pad)).view(B, H, pages, bs, D)
    for i in range(1 if shared else B):
        blocks = table[i].long()
        keys_t[blocks] = k[i].permute(1, 0, 3, 2)  # [pages, H, D, bs]
        vals[blocks] = v[i].permute(1, 0, 2, 3)  # [pages, H, bs, D]
    return cache, table


def fp8_cache(cache: torch.Tensor, fmt: KVFormat) -> torch.Tensor:
    """``cache`` as vLLM's fp8 cache (uint8 bytes of float8 numbers, each key / k_scale and value / v_scale)."""
    out = torch.empty(cache.shape, dtype=torch.uint8)
    keys_t, values = page_views(cache)
    stored_k, stored_v = page_views(out, fmt)
    stored_k.copy_((keys_t.float() / fmt.k_scale).to(fmt.fp8))
    stored_v.copy_((values.float() / fmt.v_scale).to(fmt.fp8))
    return out


def vllm_kernel(cache, table, lens, query, scale, fmt: KVFormat = KVFormat(), isa: str = "vec"):
    """Stock vLLM's decode: its CPU paged kernel over each sequence's own block table (an fp8 cache with its scales)."""
    from vllm import _custom_ops as ops

    N, H, bs, two_d = cache.shape
    B, H_q, D = query.shape
    key_cache, value_cache = cache.view(N, H, 2 * bs, D).chunk(2, dim=2)
    starts = torch.arange(B + 1, dtype=torch.int32)
    metadata = ops.cpu_attn_get_scheduler_metadata(
        num_reqs=B, num_heads=H_q, num_kv_heads=H, head_dim=D, seq_lens=lens, dtype=query.dtype, query_start_loc=starts,
        causal=True, sliding_window_size=-1, isa=isa, enable_kv_split=False, kv_cache_dtype=fmt.dtype,
    )  # fmt: skip
    out = torch.empty_like(query)

    def call():
        ops.cpu_attention_with_kv_cache(
            query=query, key_cache=key_cache, value_cache=value_cache, output=out, query_start_loc=starts, seq_lens=lens,
            scale=scale, causal=True, alibi_slopes=None, sliding_window=-1, block_table=table, softcap=0.0,
            scheduler_metadata=metadata, s_aux=None, k_scale=fmt.k_scale, v_scale=fmt.v_scale, kv_cache_dtype=fmt.dtype,
        )  # fmt: skip
        return out

    return call


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--length", type=int, default=8000, help="tokens per sequence (the current one included)")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--shared", action="store_true", help="every sequence on the same blocks (prefix caching)")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16")
    parser.add_argument("--layout", choices=["vec", "amx"], default="vec", help="the pages' layout: vLLM's vec kernel's, or "
                        "its amx kernel's (bfloat16; the vLLM row runs only on a CPU with AMX)")
    parser.add_argument("--kv-cache-dtype", choices=["auto", "fp8", "fp8_e4m3", "fp8_e5m2"], default="auto",
                        help="the cache's numbers: auto (--dtype) or vLLM's fp8 formats (one byte each, scale 1; queries in --dtype)")
    parser.add_argument("--block-size", type=int, default=128)
    parser.add_argument("--budget", type=int, default=1024)
    parser.add_argument("--methods", nargs="+", default=["dense", "quest", "radar+"], help="method specs NAME[:key=value,...]")
    parser.add_argument("--layer", type=int, default=1, help="the layer whose method a per-layer method runs (of 30)")
    parser.add_argument("--segment", type=int, default=None, help="tokens per segment inside a page (a divisor of --block-size; "
                        "default: the page) for every method; a spec's own '@seg<N>' suffix (radar+adaptive@seg4) sets it for that row")
    parser.add_argument("--segment-rows", action="store_true", help="also time each fused method whose store keeps page "
                        "totals only on a store that keeps every segment's sums (the former layout), as '<run> (segment rows)'")
    parser.add_argument("--fused-only", action="store_true", help="leave out the generic rows (a merged rest's take ~180 ms a call)")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--caches", type=int, default=4, help="caches read in turn (as a model's layers are), so that "
                        "each call reads from memory, not from the last-level cache")
    parser.add_argument("--profile", action="store_true", help="also time each fused run's phases and count their bytes")
    parser.add_argument("--keys", choices=["random", "text"], default="random", help="random keys and values, or the default "
                        "model's own over the serving benchmark's prompts (one cache per layer from --layer on)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    for option, value, least in (("--length", args.length, 2), ("--batch", args.batch, 1), ("--budget", args.budget, 1),
                                 ("--repeats", args.repeats, 1), ("--threads", args.threads, 1), ("--caches", args.caches, 1)):  # fmt: skip
        if value < least:
            parser.error(f"{option}: {value} is out of range; allowed: >= {least}")
    if args.block_size < 16 or args.block_size % 16:
        parser.error(f"--block-size: {args.block_size} is not allowed; allowed: a multiple of 16")
    built, segments = {}, {}
    for name in args.methods:
        spec, _, seg = name.partition("@seg")
        segments[name] = int(seg) if seg.isdigit() else args.segment
        try:
            built[name] = parse_method(spec, None if spec == "dense" else args.budget)[1]
        except Exception as err:  # noqa: BLE001 (the CLI's message: the option, the value, what is allowed)
            parser.error(f"--methods {name!r}: {getattr(err, 'message', err)}")
    torch.set_num_threads(args.threads)
    try:
        import vllm  # noqa: F401

        have_vllm = True
    except ImportError:
        have_vllm = False

    H, G, D, bs = 3, 3, 64, args.block_size
    dtype = DTYPES[args.dtype]
    if args.keys == "text":
        layers = range(args.layer, args.layer + args.caches)
        if layers[-1] >= 30:
            parser.error(f"--keys text: --layer {args.layer} + --caches {args.caches} pass the model's 30 layers; allowed: at most 30")
        found = model_keys(args.batch, args.length, layers, args.shared)
        caches = [(*fill_cache(k, v, bs, args.shared, seed=i), q) for i, (k, v, q) in enumerate(found)]
        caches = [(cache.to(dtype), table, q.to(dtype)) for cache, table, q in caches]
    else:
        query = torch.randn(args.batch, H * G, D, generator=torch.Generator().manual_seed(1)).to(dtype)
        caches = [(*make_cache(args.batch, args.length, bs, H, D, dtype, args.shared, seed=i), query) for i in range(args.caches)]
    fmt = KVFormat(args.kv_cache_dtype)
    if fmt.fp8 is not None:
        caches = [(fp8_cache(cache, fmt), table, q) for cache, table, q in caches]
    if args.layout == "amx":
        if dtype != torch.bfloat16 or fmt.fp8 is not None:
            parser.error("--layout amx: the amx layout holds bfloat16 pages (--dtype bfloat16, --kv-cache-dtype auto)")
        caches = [(amx_layout(cache), table, q) for cache, table, q in caches]
        have_vllm = have_vllm and "amx_tile" in cpu_flags().split()  # vLLM's amx kernel needs AMX
    lens = torch.full((args.batch,), args.length, dtype=torch.int32)
    scale = D**-0.5

    # Each run: one callable per cache (its own page store: a layer's), called in turn.
    calls: dict[str, list] = {}
    store_mib: dict[str, float] = {}
    fused_runs: set[str] = set()
    if have_vllm:
        calls["vllm kernel (all pages)"] = [vllm_kernel(cache, table, lens, q, scale, fmt, args.layout) for cache, table, q in caches]
    for name in args.methods:
        policy = PagedPolicy(built[name], name, segments[name]).for_layer(args.layer, 30)
        way = route(policy)
        mode = way.mode
        if way.fused:
            plan = step_plan(policy, lens, bs)
            variants = [(f"fused {name}", None)]
            if args.segment_rows and way.keeps_store and not PageStore.for_policy(policy, 1, H, D, bs).segment_sums:
                variants.append((f"fused {name} (segment rows)", True))
            for label, rows_layout in variants:
                runs = []
                for cache, table, query in caches:
                    if not way.keeps_store:
                        store = None
                    elif rows_layout:
                        store = PageStore(cache.shape[0], H, D, mode, sums=True, segments=policy.segments_per_page(bs),
                                          summary_dtype=way.summary_dtype, segment_sums=True)  # fmt: skip
                    else:
                        store = PageStore.for_policy(policy, cache.shape[0], H, D, bs)
                    runs.append(lambda p=policy, m=mode, s=store, pl=plan, c=cache, t=table, q=query: fused_decode(
                        p, m, s, c, q, t, lens, scale, plan=pl, fmt=fmt, layout=args.layout)[0])  # fmt: skip
                    store_mib[label] = 0.0 if store is None else store.nbytes / 2**20
                calls[label] = runs
                fused_runs.add(label)
        if have_vllm and name != "dense" and not args.fused_only and args.layout == "vec":
            from sparseattn.vllm.backend import kernel_attend_pages
            from sparseattn.vllm.paged import PageSummaries

            params, gen = policy.prepare(H, D, 0)
            runs = []
            for cache, table, query in caches:
                summaries = PageSummaries(cache.shape[0], bs)

                def generic(p=policy, pr=params, ge=gen, su=summaries, c=cache, t=table, query=query):
                    chosen = choose_pages(p, pr, ge, c, query, t, lens, scale, su, fmt)
                    if chosen.merged is not None:
                        return attend_pages(query, c, t, chosen.pages, lens, scale, None, fmt, merged=chosen.merged)
                    return kernel_attend_pages(query, c, t, chosen.pages, lens, scale, None, "vec", fmt)

                runs.append(generic)
            calls[f"generic {name}"] = runs
    times: dict[str, list[float]] = {label: [] for label in calls}
    for runs in calls.values():  # warm: kernels built, every cache's summaries computed
        for run in runs:
            run()
    turn = 0
    for r in range(args.repeats):
        for label in (list(calls) if r % 2 == 0 else list(calls)[::-1]):
            for _ in range(args.caches):  # one call per cache: each reads what the last call of this run did not
                start = time.perf_counter()
                calls[label][turn % args.caches]()
                times[label].append(time.perf_counter() - start)
                turn += 1
    profiles = {}
    bandwidth = None
    if args.profile:
        bandwidth = read_bandwidth(threads=args.threads, chunk=4096)
        for label in calls:
            if label not in fused_runs:
                continue
            with StepProfile() as prof:
                for i in range(args.repeats * args.caches):
                    calls[label][i % args.caches]()
            profiles[label] = prof
    reference = "vllm kernel (all pages)" if have_vllm else next(iter(calls))
    base = statistics.median(times[reference])
    dense = statistics.median(times["fused dense"]) if "fused dense" in times else None
    rows = []
    for label, t in times.items():
        row = {"run": label, "median_us": 1e6 * statistics.median(t), "min_us": 1e6 * min(t), "max_us": 1e6 * max(t),
               "vs_reference": base / statistics.median(t), "vs_fused_dense": dense / statistics.median(t) if dense else None,
               "store_mib": store_mib.get(label)}  # fmt: skip
        if label in profiles:
            prof = profiles[label]
            row["profile"] = prof.rows(bandwidth.median_gbps, calls=args.repeats * args.caches)
            row["mb_per_call"] = prof.total_bytes / (args.repeats * args.caches) / 1e6
            row["floor_us"] = row["mb_per_call"] / bandwidth.median_gbps * 1e3  # MB / (GB/s) = ms
            row["of_floor"] = row["floor_us"] / row["median_us"]
        rows.append(row)

    from rich.console import Console
    from rich.table import Table

    console = Console(width=160)
    shared = ("shared blocks" if args.shared else "own blocks") + (", the model's keys" if args.keys == "text" else ", random keys")
    kv_label = (args.dtype if fmt.fp8 is None else f"{args.kv_cache_dtype} cache, {args.dtype} queries") + f", {args.layout} layout"
    table_out = Table(title=f"one layer's decode attention: batch {args.batch} x {args.length} tokens ({shared}), {kv_label}, "
                            f"{bs}-token pages, budget {args.budget}, {args.threads} thread(s), {args.caches} caches in turn, "
                            f"median (min-max) of {args.repeats * args.caches} calls")  # fmt: skip
    against = [f"vs {reference}"] + (["vs fused dense"] if reference != "fused dense" else [])  # no column twice
    cols = ["run", "us / call", "min-max us", *against, "page store MiB"]
    if profiles:
        cols += ["MB read / call", "byte floor us", "of floor"]
    for col in cols:
        table_out.add_column(col, justify="left" if col == "run" else "right")
    for row in rows:
        mib = "" if row["store_mib"] is None else f"{row['store_mib']:.1f}"
        ratios = [f"{row['vs_reference']:.2f}x"] + (["" if row["vs_fused_dense"] is None else f"{row['vs_fused_dense']:.2f}x"] if len(against) > 1 else [])
        cells = [row["run"], f"{row['median_us']:.0f}", f"{row['min_us']:.0f}-{row['max_us']:.0f}", *ratios, mib]
        if profiles:
            cells += [f"{row['mb_per_call']:.1f}", f"{row['floor_us']:.0f}", f"{row['of_floor']:.2f}"] if "profile" in row else ["", "", ""]
        table_out.add_row(*cells)
    console.print(table_out)
    for row in rows:
        if "profile" not in row:
            continue
        part_table = Table(title=f"{row['run']}: where one call's {row['median_us']:.0f} us go (thread time; bandwidth "
                                 f"{bandwidth.median_gbps:.1f} GB/s: 4 KiB chunks scattered, {args.threads} thread(s), measured now)")
        for col in ("part", "us / call", "MB / call", "GB/s", "of bandwidth", "what"):
            part_table.add_column(col, justify="left" if col in ("part", "what") else "right")
        for part in row["profile"]:
            share = "" if part["of_bandwidth"] is None else f"{part['of_bandwidth']:.2f}"
            part_table.add_row(part["part"], f"{part['us']:.0f}", f"{part['mb']:.2f}", f"{part['gbps']:.1f}" if part["mb"] else "",
                               share, PHASE_WHAT.get(part["part"], ""))  # fmt: skip
        console.print(part_table)
    kv_name = (args.dtype if fmt.fp8 is None else args.kv_cache_dtype) + ("-amx" if args.layout == "amx" else "")
    out = args.out or REPO / "benchmarks" / "results" / f"paged-kernel-{kv_name}-b{args.batch}-L{args.length}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    machine = {"platform": platform.platform(), "processor": platform.processor(), "torch": torch.__version__,
               "cpu_capability": torch.backends.cpu.get_cpu_capability(), **cpu_model()}  # fmt: skip
    record = {"machine": machine, "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}, "rows": rows}
    if bandwidth is not None:
        record["bandwidth"] = dataclasses.asdict(bandwidth)
    out.write_text(json.dumps(record, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
