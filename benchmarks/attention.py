"""One decode step of one attention layer: dense SDPA vs Radar, against the memory-bandwidth floor.

Llama-3-8B head shape (32 query heads, 8 KV heads, d = 128). For each batch size and context length
t: dense attention (torch SDPA over the whole cache, a KV group's query heads as rows; the flash path
on GPU), Radar with the paper's defaults (k = 64 segments, n = 2048 features) and Radar at a fixed
budget of 4096 tokens, each with per-query-head selections and with one selection shared by a KV group,
and radar+ at the same budget. The methods run on the backend ``auto`` picks (on the CPU the C kernel
of the ``cpu`` backend); a second dense row runs that same kernel over every token, so that the sparse
rows can be compared with SDPA (the baseline) and with dense attention on the same kernel. Rows that
force the torch backend (gather + SDPA) are available with ``--methods``. Before any timing, each
method's output is checked against its float64 reference (on the batch's first sequence); a failed
check is reported and no speed is claimed for that row.

Per row: median step time over many runs after warm-up (CUDA events on GPU), timed in rounds that
alternate the row's step with the dense baselines' steps on the same K/V (a shared machine's speed drifts;
alternation exposes a method and its baselines to the same drift), the speedup over dense (SDPA) and
over the cpu kernel run densely,
the bytes the step must read (dense: the whole K/V; Radar: the K/V of the union of the selections of a
KV group's query heads, gathered once per KV head, plus the segment summaries and the projection;
radar+: plus the keys of every query head's, or KV group's, rerank shortlist), the bandwidth floor (bytes / measured memory
bandwidth, measured in the same run) and the fraction of it achieved. The restructure (Algorithm 1's
O(t) rebuild at perfect squares) is timed separately and shown amortised over the ~2 sqrt(t) steps
between rebuilds. The growth exponent of per-step time over t is fitted on the rows t >= 8k, raw and
drift-corrected (the step over the dense step of the same rounds, times t: dense reads all t tokens).
With ``--against METHOD`` that method's step joins every row's rounds too, and each row reports its
time over that method's (``vs against``): the ratio of two methods under the same drift; when the
method is also a row, each ratio is divided by that row's own (two states of one method measured
0.93-0.98 apart: the calibration cancels what is the state's, not the method's). With
``--flush-mb N`` every timed step follows an untimed write of N MB, so that none finds another's data
cached (compare against a row of the same method: its ``vs against`` should be 1).

    python benchmarks/attention.py                       # CPU defaults: t in 4k..128k, batch 1 and 8
    python benchmarks/attention.py --lengths 4096 16384 --batches 1 --repeats 20
    python benchmarks/attention.py --lengths 131072 --batches 1 --methods "radar+pooled (budget 4096)" \
        --against "radar+ (budget 4096)"
    python benchmarks/attention.py --device cuda --dtype bfloat16 --lengths 4096 ... 1048576

Writes ``benchmarks/results/attention-<device>.json`` (or ``--out``).
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import math
import platform
import random
import statistics
import time
from pathlib import Path

import torch

from sparseattn.ops.merged import merged_attention_ref
from sparseattn import Dense, PooledMass, Quest, Radar, RadarAlg1, RadarPlus, RadarPlusMerged, RadarPlusPooled, RadarPlusTokens, Rerank
from sparseattn.backends.registry import get_backend
from sparseattn.backends.triton_backend import TritonBackend
from sparseattn.machine import cpu_model
from sparseattn.ops.attention import attention_ref, segment_attention_ref

Q_HEADS, KV_HEADS, HEAD_DIM = 32, 8, 128


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def median_ms(fn, device: torch.device, repeats: int, warmup: int) -> float:
    """Median wall time of ``fn()`` in ms (CUDA events on GPU)."""
    for _ in range(warmup):
        fn()
    synchronize(device)
    return statistics.median(timed_ms(fn, device) for _ in range(repeats))


def timed_ms(fn, device: torch.device) -> float:
    """Wall time of one ``fn()`` in ms (CUDA events on GPU)."""
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize(device)
        return start.elapsed_time(end)
    begin = time.perf_counter()
    fn()
    return 1e3 * (time.perf_counter() - begin)


def interleaved_medians(fns: dict, device: torch.device, repeats: int, warmup: int, flush=None) -> dict:
    """Median ms of each ``fns[name]()``, timed round-robin (one call of each per round).

    A shared machine's speed drifts over seconds; timing a method and its baselines in alternation
    exposes them to the same drift, so their ratio is steadier than that of separate runs. The order
    within a round is shuffled (seeded): a fixed order measured the same method 6-10% apart from itself
    by position alone. ``flush`` (untimed) runs before every timed call: each then starts from the same
    cold cache, whatever ran before it (without it a step right after another method's step can find its
    segments cached).
    """
    for _ in range(warmup):
        for fn in fns.values():
            fn()
    synchronize(device)
    times = {name: [] for name in fns}
    order, shuffle = list(fns), random.Random(0)
    for _ in range(repeats):
        shuffle.shuffle(order)  # no step always follows the same one, nor always runs first in its round
        for name in order:
            fn = fns[name]
            if flush is not None:
                flush()
                synchronize(device)
            times[name].append(timed_ms(fn, device))
    return {name: statistics.median(ts) for name, ts in times.items()}


def memory_bandwidth(device: torch.device, gib: float = 1.0) -> float:
    """Read bandwidth in GB/s: the best of several full reductions over a ``gib`` GiB buffer."""
    x = torch.ones(int(gib * 2**30 / 4), device=device)
    ms = min(median_ms(lambda: x.sum(), device, repeats=3, warmup=1) for _ in range(3))
    return x.numel() * 4 / (ms / 1e3) / 1e9


def machine(device: torch.device) -> dict:
    info = {
        "device": str(device),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "threads": torch.get_num_threads(),
    }
    if device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(device)
    else:
        info["cpu"] = cpu_model()["cpu"]
    return info


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


def random_cache(batch: int, t: int, dtype, device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Keys, values ``[batch, 8, t, 128]`` and a query ``[batch, 32, 128]``, drawn per (batch, t) and shared by the rows."""
    # Drawn where they live: a CPU generator would take seconds per gigabyte of a GPU's cache.
    gen = torch.Generator(device=device).manual_seed(t + batch)
    shape = (batch, KV_HEADS, t, HEAD_DIM)
    keys = torch.empty(shape, dtype=dtype, device=device)
    values = torch.empty(shape, dtype=dtype, device=device)
    for b in range(batch):  # one sequence at a time: no float32 copy of the whole batch on the side
        keys[b] = torch.randn(shape[1:], generator=gen, device=device).to(dtype)
        values[b] = torch.randn(shape[1:], generator=gen, device=device).to(dtype)
    query = torch.randn(batch, Q_HEADS, HEAD_DIM, generator=gen, device=device).to(dtype)
    return keys, values, query


@dataclasses.dataclass(frozen=True)
class OnBackend:
    """A row's method whose state's backend is set otherwise (``dataclasses.replace`` of it with ``options``): an A/B
    of one backend choice on the same method, e.g. the Triton kernel's per-head programs against its union."""

    method: object
    options: dict


def bench_row(method_name, method, keys, values, query, repeats, warmup, tolerance, baselines, flush=None) -> dict:
    """One row: build, check against the float64 reference, then time ``method`` interleaved with ``baselines``."""
    backend_options = {}
    if isinstance(method, OnBackend):
        method, backend_options = method.method, method.options
    batch, _, t, _ = keys.shape
    device = keys.device
    group = Q_HEADS // KV_HEADS
    row = {"method": method_name, "batch": batch, "t": t}
    itemsize = keys.element_size()
    if method is None:  # dense
        # GQA decode as flash-decoding does it: a KV group's query heads are the rows of one SDPA call
        # over that KV head's cache (on CPU ~3x faster than SDPA's enable_gqa, which expands K/V).
        q_rows = query.view(batch, KV_HEADS, group, HEAD_DIM)

        def step():
            return torch.nn.functional.scaled_dot_product_attention(q_rows, keys, values)

        out = step().view(batch, KV_HEADS, group, HEAD_DIM)
        # The float64 reference is checked on the first sequence (sequences are independent): the
        # whole batch in float64 would not fit in memory at batch 8, t = 128k.
        ref = attention_ref(query.view(batch, KV_HEADS, group, HEAD_DIM)[:1], keys[:1], values[:1])
        row["rel_error"] = relative_error(out[:1], ref)
        row["attended"] = t
        row["bytes"] = 2 * batch * KV_HEADS * t * HEAD_DIM * itemsize
        row["rebuild_ms"] = 0.0
    elif isinstance(method, (Dense, TritonBackend)):  # a dense kernel over every token, on the shared K/V (no copy)
        kernel = method if isinstance(method, TritonBackend) else get_backend(method.backend)
        q_rows = query.view(batch, KV_HEADS, group, HEAD_DIM)

        def step():
            return kernel.dense(q_rows, keys, values, checked=False)

        ref = attention_ref(q_rows[:1], keys[:1], values[:1])
        row["rel_error"] = relative_error(step()[:1], ref)
        row["attended"] = t
        row["bytes"] = 2 * batch * KV_HEADS * t * HEAD_DIM * itemsize
        row["rebuild_ms"] = 0.0
    else:
        state = method.new_state(batch, KV_HEADS, HEAD_DIM, device=device, dtype=keys.dtype)
        synchronize(device)
        begin = time.perf_counter()
        state.append(keys, values)  # one O(t) build: the cost of a restructure at this t
        synchronize(device)
        row["rebuild_ms"] = 1e3 * (time.perf_counter() - begin)
        if backend_options:  # the state chooses its backend on its first step: then set the row's options on it
            state.attend(query)
            chosen = state._backend
            fields = {f.name for f in dataclasses.fields(chosen)} if dataclasses.is_dataclass(chosen) else set()
            if not set(backend_options) <= fields:
                raise ValueError(f"this row sets {sorted(backend_options)} of its backend; the state runs "
                                 f"{getattr(chosen, 'name', 'the torch gather path')}, which has no such option (a GPU runs triton)")
            state._backend = dataclasses.replace(chosen, **backend_options)
        out, info = state.attend(query)
        row["backend"] = state._backend.name if state._backend is not None else "torch (gather)"
        if info.extra is None and info.valid is None:
            ref = segment_attention_ref(
                query.view(batch, KV_HEADS, group, HEAD_DIM)[:1], state.keys[:1], state.values[:1], info.layout, info.segments[:1]
            )
        elif info.n_merged:  # the reported mask plus the merged rest of every block (float64)
            lay, mask = info.layout, info.to_mask()[:1].view(1, KV_HEADS, group, -1)
            ref = merged_attention_ref(
                query.view(batch, KV_HEADS, group, HEAD_DIM)[:1], state.keys[:1], state.values[:1], mask.cpu(),
                lay.sink_end, lay.segment_end, min(method.rest.per_block, lay.n_segments) * lay.segment_size, state.scale,
            )  # fmt: skip
        else:  # tokens on top of (or instead of) segments, or segments per head: the reported mask, in float64
            mask = info.to_mask()[:1].view(1, KV_HEADS, group, -1)
            ref = attention_ref(query.view(batch, KV_HEADS, group, HEAD_DIM)[:1], state.keys[:1], state.values[:1], mask)
        row["rel_error"] = relative_error(out.view(batch, KV_HEADS, group, HEAD_DIM)[:1], ref)
        row["attended"] = float(info.attended.float().mean())
        lay = info.layout
        # Each KV head reads the union of its query heads' selected segments, once.
        chosen = torch.zeros(batch, KV_HEADS, lay.n_segments, dtype=torch.bool, device=device)
        if info.segments.shape[-1] and lay.n_segments:
            index = info.segments.reshape(batch, KV_HEADS, -1)
            listed = torch.ones_like(index) if info.valid is None else info.valid.expand(*info.segments.shape).reshape(batch, KV_HEADS, -1).long()
            # Counted, not scattered as flags: a segment one head attends and another only lists must count
            # (a bool scatter keeps whichever write lands last).
            chosen = torch.zeros(batch, KV_HEADS, lay.n_segments, dtype=torch.long, device=device).scatter_add_(-1, index, listed) > 0
        union_tokens = int(chosen.sum()) * lay.segment_size
        if info.extra_valid is not None:  # refined tokens: the union over a KV group's query heads
            union_tokens += int(info.extra_valid.any(2).sum())
        if info.segments.shape[-1] == lay.n_segments:  # full selection: one dense pass
            union_tokens = lay.n_segments * lay.segment_size
        kv_read = (union_tokens + batch * KV_HEADS * (lay.sink_end + lay.tail_size)) * HEAD_DIM * 2 * itemsize
        row["union_tokens_per_kv_head"] = union_tokens / (batch * KV_HEADS) + lay.sink_end + lay.tail_size
        structure = state.nbytes()
        row["bytes"] = kv_read + structure.get("summaries", 0) + structure.get("projection", 0)
        summary = method.summary
        if method.refine is not None:  # the shortlist's keys are read for the exact token logits
            k = method.segments_for(lay)
            shortlist = method.refine.shortlist(k, lay.n_segments)
            lists = KV_HEADS if method.shared_kv_selection else Q_HEADS
            row["rerank_bytes"] = batch * lists * shortlist * lay.segment_size * HEAD_DIM * itemsize
            row["bytes"] += row["rerank_bytes"]
        if isinstance(summary, Rerank):  # each query head's shortlist: keys only, from the cache
            k = info.segments.shape[-1]
            shortlist = min(max(summary.shortlist, math.ceil(summary.factor * k)), lay.n_segments)
            lists = KV_HEADS if summary.per_group else Q_HEADS
            row["rerank_bytes"] = batch * lists * shortlist * lay.segment_size * HEAD_DIM * itemsize
            row["bytes"] += row["rerank_bytes"]
        if info.n_merged:  # the merged rest reads a row of key and value sums per listed segment and the blocks' sums
            # (float32 segment sums, float64 block sums; a KV group's heads read the union of their listings)
            row["rest_bytes"] = int(chosen.sum()) * 2 * HEAD_DIM * 4 + batch * KV_HEADS * info.n_merged * 2 * HEAD_DIM * 8
            row["bytes"] += row["rest_bytes"]
        row["segments"] = lay.n_segments

        def step():
            return state.attend(query)

    row["correct"] = row["rel_error"] <= tolerance
    if row["correct"]:
        medians = interleaved_medians({"method": step, **baselines}, device, repeats, warmup, flush)
        row["ms"] = medians.pop("method")
        row.update({f"{name}_ms": ms for name, ms in medians.items()})  # dense_ms, kernel_dense_ms: same rounds
        if device.type == "cuda":  # what the launches cost: the step replayed as one CUDA graph, and its kernel count
            row.update(graph_timing(step, device, repeats))
            row.update(kernel_profile(step))
    else:
        row["ms"] = float("nan")
    between_rebuilds = 2 * math.isqrt(t) + 1
    row["rebuild_amortised_ms"] = row["rebuild_ms"] / between_rebuilds
    return row


def graph_timing(step, device: torch.device, repeats: int) -> dict:
    """``graph_ms``: the median time of ``step`` captured once as a CUDA graph and replayed (no Python, no launch
    gaps: what an engine that captures its decode step pays), or ``graph_error`` when it cannot be captured
    (a host sync inside it, e.g. ``.item()``: found first with torch's sync debug mode, so no capture is
    attempted and broken)."""
    try:
        torch.cuda.set_sync_debug_mode("error")
        try:
            step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    except RuntimeError as error:
        return {"graph_ms": float("nan"), "graph_error": f"the step synchronises with the host: {str(error).splitlines()[0][:200]}"}
    try:
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            for _ in range(3):  # warm-up off the capture stream, as torch's documentation asks
                step()
        torch.cuda.current_stream(device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            step()
        replay = graph.replay
        ms = median_ms(replay, device, repeats, warmup=3)
        del graph
        return {"graph_ms": ms}
    except Exception as error:  # noqa: BLE001 (any capture failure is reported, not raised)
        torch.cuda.synchronize(device)
        return {"graph_ms": float("nan"), "graph_error": f"{type(error).__name__}: {str(error).splitlines()[0][:200]}"}


def kernel_profile(step, steps: int = 5) -> dict:
    """``kernels_per_step``: GPU kernels one ``step`` launches, and ``kernel_us``: each kernel's GPU time per
    step (microseconds, the largest first), from torch's profiler over ``steps`` steps; {} where it cannot trace."""
    try:
        from collections import defaultdict

        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(steps):
                step()
            torch.cuda.synchronize()
        kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
        by_name: dict[str, float] = defaultdict(float)
        for e in kernels:
            by_name[e.name[:80]] += e.time_range.elapsed_us() / steps
        top = sorted(by_name.items(), key=lambda kv: -kv[1])
        return {"kernels_per_step": round(len(kernels) / steps), "kernel_us": [[name, round(us, 1)] for name, us in top[:10]],
                "kernel_us_total": round(sum(by_name.values()), 1)}  # fmt: skip
    except Exception:  # noqa: BLE001
        return {}


def fit_exponent(points: list[tuple[int, float]]) -> float:
    """Least-squares slope of log(ms) over log(t)."""
    xs = [math.log(t) for t, _ in points]
    ys = [math.log(ms) for _, ms in points]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default=None, help="float32 (CPU default) or bfloat16 (GPU default)")
    parser.add_argument("--lengths", type=int, nargs="+", default=None)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads (CPU)")
    parser.add_argument("--methods", nargs="+", default=None, help="only these rows (dense always runs: speedups need it)")
    parser.add_argument("--against", default=None, metavar="METHOD",
                        help="a row name timed in the same rounds as every row: each row's 'vs against' is its "
                             "ms over this method's, both under the same drift (e.g. \"radar+ (budget 4096)\")")
    parser.add_argument("--flush-mb", type=int, default=0, metavar="MB",
                        help="write a scratch buffer of this many MB (untimed) before every timed step, so that "
                             "every step starts cold (a model's other layers evict the cache between two layers' "
                             "steps); 0: no flush. Use more than the last-level cache (here 32 MB)")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    if args.flush_mb < 0:
        parser.error(f"--flush-mb must be >= 0 (MB written before each timed step), got {args.flush_mb}")
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda but no CUDA device is available")
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype) if args.dtype else (torch.bfloat16 if device.type == "cuda" else torch.float32)
    lengths = args.lengths or ([4096, 16384, 65536, 131072] if device.type == "cpu" else [4096, 16384, 65536, 131072, 262144, 1048576])
    tolerance = {torch.float32: 1e-4, torch.float64: 1e-8}.get(dtype, 2e-2)
    torch_backend = lambda m: dataclasses.replace(m, backend="torch")  # noqa: E731
    # The toolkit's own dense kernel (the C kernel on the CPU, the Triton kernel on CUDA) over every token.
    kernel_dense = Dense(backend="cpu" if device.type == "cpu" else "triton")
    methods = {
        "dense": None,
        f"dense ({kernel_dense.backend} kernel)": kernel_dense,
        "radar-alg1 (k=64, n=2048)": RadarAlg1(top_k=64, n_features=2048),
        # One selection per KV group: the group's 4 query heads read the same segments. Independent
        # per-head selections read up to 4x the segments of one head (their union) under GQA.
        "radar-alg1 (k=64, shared)": RadarAlg1(top_k=64, n_features=2048, shared_kv_selection=True),
        "radar-alg1 (budget 4096)": RadarAlg1(budget=4096, n_features=2048),
        "radar-alg1 (budget 4096, shared)": RadarAlg1(budget=4096, n_features=2048, shared_kv_selection=True),
        # issue 7's preset: centroid shortlist + exact rerank; its per-step cost against raw Radar's.
        "radar+ (budget 4096)": RadarPlus(budget=4096),
        # Radar as its authors ran it (2048 antithetic draws, segments of sqrt(t)/4) and Quest (pages of 16), at one budget.
        "radar (budget 4096)": Radar(budget=4096),
        "quest (budget 4096)": Quest(budget=4096),
    }
    if device.type == "cuda":  # the split heuristic's occupancy target against the earlier one, on the dense kernel
        methods["dense (triton kernel, 2 programs/SM)"] = TritonBackend(programs_per_sm=2)
    optional = {  # with --methods only
        "radar+ (budget 4096, per head)": RadarPlus(budget=4096, per_group=False),
        # issue 48: the same with the Triton kernel's program per query head (its default reads the heads' union once).
        "radar+ (budget 4096, per head, a program per head)": OnBackend(RadarPlus(budget=4096, per_group=False), {"union": False}),
        # issue 17: a 16x finer grid, then each head's best tokens among twice the budget's segments (torch path).
        "radar+tokens (budget 4096)": RadarPlusTokens(budget=4096),
        "radar+ (budget 4096, aspect 16)": RadarPlus(budget=4096, aspect=16.0),
        "radar+pooled (budget 4096, aspect 16)": RadarPlus(budget=4096, aspect=16.0, allocation=PooledMass()),
        # the radar+pooled preset: aspect 16, PooledMass(cap=2) read off the shortlist, bf16 centroids.
        "radar+pooled (budget 4096)": RadarPlusPooled(budget=4096),
        # radar+pooled plus the merged rest: the C kernel's selection and log-sum-exp, the rest from kept sums.
        "radar+merged (budget 4096)": RadarPlusMerged(budget=4096),
        "radar+merged (budget 4096, one merged token)": RadarPlusMerged(budget=4096, merge=0),
        # radar+merged-after's layers 1 on (its layer 0 is radar+pooled): blocks of 128 segments.
        "radar+merged (budget 4096, merge 128)": RadarPlusMerged(budget=4096, merge=128),
        # radar+adaptive's layers 1-29 (the recommended preset; its layer 0 drops the rest): pooled split, float32
        # centroids, one merged token per block of 128 segments.
        "radar+adaptive (budget 4096, layers 1-29)": RadarPlus(budget=4096, aspect=16.0, split="pooled", cap=2.0, floor=0.25,
                                                               rest="merged", merge=128),
        "radar+adaptive (budget 4096, layers 1-29, a program per head)": OnBackend(
            RadarPlus(budget=4096, aspect=16.0, split="pooled", cap=2.0, floor=0.25, rest="merged", merge=128), {"union": False}),
        # the same through the torch gather path (what the kernel path replaces).
        "radar+merged (budget 4096, torch backend)": torch_backend(RadarPlusMerged(budget=4096)),
        # The torch backend (gather a copy of the selected tokens, then SDPA): what the kernel replaces.
        "radar-alg1 (k=64, torch backend)": torch_backend(RadarAlg1(top_k=64)),
        "radar-alg1 (k=64, shared, torch backend)": torch_backend(RadarAlg1(top_k=64, shared_kv_selection=True)),
        "radar-alg1 (budget 4096, torch backend)": torch_backend(RadarAlg1(budget=4096)),
        "radar-alg1 (budget 4096, shared, torch backend)": torch_backend(RadarAlg1(budget=4096, shared_kv_selection=True)),
    }
    if args.methods:
        unknown = set(args.methods) - set(methods) - set(optional)
        if unknown:
            parser.error(f"unknown --methods {sorted(unknown)}; choose from {list(methods) + list(optional)}")
        methods = {name: m for name, m in {**methods, **optional}.items() if name == "dense" or name in args.methods}
    against = None
    if args.against is not None:
        known = {**methods, **optional}
        if args.against not in known or known[args.against] is None or isinstance(known[args.against], OnBackend):
            parser.error(f"unknown --against {args.against!r}; choose a sparse row without backend options from {[n for n, m in known.items() if m is not None and not isinstance(m, OnBackend)]}")
        against = known[args.against]
    info = machine(device)
    info["bandwidth_GBps"] = memory_bandwidth(device)
    print(f"machine: {json.dumps(info)}")
    print(f"shape: {Q_HEADS} query heads, {KV_HEADS} KV heads, d = {HEAD_DIM}, {dtype}; median of {args.repeats} after {args.warmup} warm-up")
    scratch = torch.empty(args.flush_mb * 2**20 // 4, device=device) if args.flush_mb else None
    flush = None if scratch is None else (lambda: scratch.fill_(1.0))
    info["flush_mb"] = args.flush_mb
    rows = []
    out = args.out or Path(__file__).parent / "results" / f"attention-{device.type}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    header = (f"{'method':<44}{'batch':>6}{'t':>9}{'attended':>10}{'ms/step':>10}{'speedup':>9}{'vs kernel':>10}"
              f"{'MB read':>10}{'floor ms':>10}{'of floor':>9}{'rebuild ms':>11}{'amortised':>10}{'rel.err':>10}"
              + (f"{'vs against':>12}" if args.against else "")
              + (f"{'graph ms':>10}{'kernels':>9}" if device.type == "cuda" else ""))
    print(header)
    print("-" * len(header))
    for batch in args.batches:
        for t in lengths:
            keys, values, query = random_cache(batch, t, dtype, device)
            # Every row is timed in rounds with the dense baselines on the same K/V: SDPA (the baseline)
            # and, on the CPU, the C kernel over every token (dense attention on the sparse rows' kernel).
            q_rows = query.view(batch, KV_HEADS, Q_HEADS // KV_HEADS, HEAD_DIM)
            sdpa = torch.nn.functional.scaled_dot_product_attention
            baselines = {"dense": lambda q=q_rows, k=keys, v=values: sdpa(q, k, v)}
            dense_kernel = get_backend(kernel_dense.backend)
            baselines["kernel_dense"] = lambda q=q_rows, k=keys, v=values, b=dense_kernel: b.dense(q, k, v, checked=False)
            against_state = None
            if against is not None:  # its own state on the same K/V, stepped once per round beside every row
                against_state = against.new_state(batch, KV_HEADS, HEAD_DIM, device=device, dtype=keys.dtype)
                against_state.append(keys, values)
                baselines["against"] = lambda s=against_state, q=query: s.attend(q)
            for name, method in methods.items():
                gc.collect()  # the previous row's state (reference cycles) must be gone before the next allocates
                try:
                    row = bench_row(name, method, keys, values, query, args.repeats, args.warmup, tolerance, baselines, flush)
                except Exception as error:  # noqa: BLE001 (a row that fails is reported; the others still run)
                    message = f"{type(error).__name__}: {str(error).splitlines()[0][:400] if str(error) else ''}"
                    rows.append({"method": name, "batch": batch, "t": t, "ms": float("nan"), "correct": False, "error": message})
                    print(f"{name:<44}{batch:>6}{t:>9}  FAILED: {message}", flush=True)
                    if device.type == "cuda":
                        torch.cuda.empty_cache()
                    continue
                measured = row["ms"] == row["ms"]
                row["speedup"] = row["dense_ms"] / row["ms"] if measured else float("nan")
                kernel = row.get("kernel_dense_ms")
                row["speedup_vs_kernel_dense"] = kernel / row["ms"] if measured and kernel else float("nan")
                row["floor_ms"] = row["bytes"] / (info["bandwidth_GBps"] * 1e9) * 1e3
                row["fraction_of_floor"] = row["floor_ms"] / row["ms"] if measured else float("nan")
                if against is not None:
                    row["against"] = args.against
                    row["vs_against"] = row["ms"] / row["against_ms"] if measured else float("nan")
                rows.append(row)
                # Written after every row: a run cut short (a time limit, a crash) keeps what it measured.
                out.write_text(json.dumps({"machine": info, "dtype": str(dtype), "rows": rows, "complete": False}, indent=2))
                flag = "" if row["correct"] else "  OUTPUT CHECK FAILED: no timing"
                print(f"{name:<44}{batch:>6}{t:>9}{row['attended']:>10.0f}{row['ms']:>10.3f}{row['speedup']:>9.2f}"
                      f"{row['speedup_vs_kernel_dense']:>10.2f}{row['bytes'] / 1e6:>10.1f}{row['floor_ms']:>10.3f}"
                      f"{row['fraction_of_floor']:>9.2f}{row['rebuild_ms']:>11.1f}{row['rebuild_amortised_ms']:>10.3f}"
                      f"{row['rel_error']:>10.1e}{flag}"
                      + (f"{row['vs_against']:>12.3f}" if against is not None else "")
                      + (f"{row.get('graph_ms', float('nan')):>10.3f}{row.get('kernels_per_step') or '-':>9}" if device.type == "cuda" else ""),
                      flush=True)
            del keys, values, query, q_rows, baselines, against_state  # free this t's K/V before the next is drawn
    if against is not None:  # the against method's own row, timed beside its twin: the calibration of the ratios
        print(f"\nper-step time over {args.against}'s in the same rounds, divided by its own row's (its twin state's):")
        for row in rows:
            twin = [r for r in rows if r["method"] == args.against and r["batch"] == row["batch"] and r["t"] == row["t"]]
            if twin and twin[0].get("vs_against", float("nan")) == twin[0].get("vs_against", float("nan")) and "vs_against" in row:
                row["vs_against_calibrated"] = row["vs_against"] / twin[0]["vs_against"]
                print(f"  {row['method']:<44} batch {row['batch']:>3} t {row['t']:>8}{row['vs_against_calibrated']:8.3f}")
    exponents, corrected = {}, {}
    for batch in args.batches:
        for name in methods:
            mine = [r for r in rows if r["method"] == name and r["batch"] == batch and r["t"] >= 8192 and r["ms"] == r["ms"]]
            if len(mine) >= 2:
                exponents[f"{name}, batch {batch}"] = fit_exponent([(r["t"], r["ms"]) for r in mine])
                # Drift-corrected: the step relative to the dense step timed in the same rounds, times t
                # (dense attention reads all t tokens: linear by construction). A shared machine's drift
                # between the rows of different t cancels in the ratio.
                base = "kernel_dense_ms" if device.type == "cpu" else "dense_ms"
                corrected[f"{name}, batch {batch}"] = fit_exponent([(r["t"], r["ms"] / r[base] * r["t"]) for r in mine])
    print("\ngrowth exponent of ms/step over t >= 8k (dense ~ 1, O(sqrt t) ~ 0.5); drift-corrected beside it:")
    for key, value in exponents.items():
        print(f"  {key:<56}{value:6.2f}{corrected[key]:8.2f}")
    out.write_text(json.dumps(
        {"machine": info, "dtype": str(dtype), "rows": rows, "exponents": exponents, "exponents_drift_corrected": corrected},
        indent=2,
    ))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
