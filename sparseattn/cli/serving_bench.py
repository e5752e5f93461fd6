"""``sparseattn serving-bench``: decode speed with quality in vLLM, stock vLLM vs the plugin's dense path vs
sparse methods on distinct prompts (:mod:`sparseattn.evaluation.serving`, docs/serving.md).

All input is checked before anything starts, as in every command: a bad method, option or size, or a
vLLM that this interpreter cannot import, ends with one ``Error: ...`` line and exit status 2. vLLM is
looked for only after the options are found good, and imported only by the benchmark itself.

The terminal shows the benchmark's progress lines and its tables; vLLM's own output (engine start-up,
compilation, warnings, shutdown) goes to ``<out>.vllm.log`` (:mod:`sparseattn.cli.vllm_log`), whose path is
printed first, unless ``--verbose`` shows it on the terminal.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import typer
from rich.console import Console

from sparseattn.cli.checks import bad, check_range, refuse, segment_choice
from sparseattn.cli.consoles import console, console_on
from sparseattn.cli.inputs import check_positions, inspect_model, read_text
from sparseattn.cli.method_specs import vllm_method
from sparseattn.cli.options import MODEL, SEGMENT_HELP
from sparseattn.cli.outputs import check_out, wrote
from sparseattn.cli.vllm_log import log_path, output_to_log


def serving_bench(
    method: list[str] = typer.Option(["radar+adaptive", "radar+", "quest"], "--method", "-m", help="sparse methods "
                                     "NAME[:key=value,...] run beside stock vLLM and the plugin's dense path (repeatable; the "
                                     "default's first is what `sparseattn serve` runs); a suffix @seg<N> or @page sets that "
                                     "method's segment (else --segment's)"),
    budget: int = typer.Option(1024, help="past KV tokens a decode step may attend, for every method whose spec sets "
                               "neither budget nor top_k"),
    model: str = MODEL,
    context: int = typer.Option(8000, help="prompt tokens per sequence (each a different stdlib file)"),
    batch: int = typer.Option(8, "--batch", "-b", help="sequences decoded together, each its own prompt"),
    steps: int = typer.Option(64, help="timed decode steps per measurement"),
    runs: int = typer.Option(3, help="rounds of alternating measurements (median, min and max reported)"),
    held: int = typer.Option(32, help="true tokens after each prompt fed through decode steps (teacher-forced ppl, top-1)"),
    texts: list[str] | None = typer.Option(None, "--text", help="texts the prompts cycle through (`sparseattn data list`; "
                                          "repeatable; default: 7 CPython stdlib modules), e.g. --text hamlet --text pydecimal"),
    dtype: str = typer.Option("bfloat16", help="the engines' dtype: bfloat16 (what vLLM serves in on a CPU with bf16) or "
                              "float32 (AVX2-only x86, whose bf16 matmuls take a slow path)"),
    float32: bool = typer.Option(True, "--float32/--no-float32", help="also time stock vLLM in float32 (a labelled extra row)"),
    shared: bool = typer.Option(True, "--shared/--no-shared", help="also time a workload whose sequences share one prompt "
                                "(prefix caching; a labelled extra row per run)"),
    kv_cache_gib: int = typer.Option(3, help="KV cache per engine in GiB (VLLM_CPU_KVCACHE_SPACE; twice this for stock float32)"),
    block_size: int | None = typer.Option(None, help="vLLM's page size (default: vLLM's, 128 on CPU): the paged engine's segment"),
    segment: str = typer.Option("auto", help=SEGMENT_HELP + ", for every --method (as `sparseattn serve` runs it)"),
    yarn: float | None = typer.Option(None, help="stretch the model's RoPE window this many times by YaRN (> 1; vLLM "
                                      "hf_overrides), for contexts beyond the trained window: untrained, every row is labelled so"),
    out: Path | None = typer.Option(None, help="the JSON, rewritten after every round (default: results/serving-c<context>-b<batch>.json)"),
    kv_cache_dtype: str = typer.Option("auto", help="every engine's KV cache: auto (the model's dtype) or fp8, fp8_e4m3, "
                                       "fp8_e5m2 (vLLM's one-byte memory tier; the plugin reads it in its fused step)"),
    profile: bool = typer.Option(False, "--profile", help="after the rounds, time one more measurement of each plugin run "
                                 "part by part (the fused step's phases with the bytes they read, the plan, the Python around "
                                 "them, and the rest of the step) and print where a decode step goes"),
    verbose: bool = typer.Option(False, "--verbose", help="show vLLM's own output (engine start-up, compilation, warnings) "
                                 "on the terminal, instead of writing it to <out>.vllm.log beside the JSON"),
) -> None:
    """Decode speed with quality in vLLM: stock vLLM vs the plugin's dense path vs sparse methods, distinct prompts.

    Two engines (three with --float32) are started and the prompts prefilled once each, then every run is timed in
    alternating rounds and its quality measured at the same configuration: greedy agreement with stock,
    teacher-forced top-1 and perplexity of the files' true continuations, and pass keys hidden in the prompts.
    A few minutes per engine on 2 cores (an 8k prompt prefills in about 15 s on one core).
    """
    from sparseattn.evaluation import serving, serving_results, serving_runs, serving_workload, vllm_engine

    for option, problem in serving.option_problems(context, batch, steps, runs, held):
        raise bad(option.split(" / "), problem)
    check_range("--budget", budget, 1)
    check_range("--kv-cache-gib", kv_cache_gib, 1)
    for name in texts or ():
        if Path(name).expanduser().is_file():
            raise bad("--text", f"{name!r} is a file; allowed: a name from `sparseattn data list` (the prompts are its windows)")
        read_text(name, "--text")  # an unknown name refused (with close matches), a known one fetched now, not mid-run
    if dtype not in ("bfloat16", "float32"):
        raise bad("--dtype", f"{dtype!r} is not allowed; allowed: bfloat16, float32")
    if kv_cache_dtype not in ("auto", "fp8", "fp8_e4m3", "fp8_e5m2"):
        raise bad("--kv-cache-dtype", f"{kv_cache_dtype!r} is not allowed; allowed: auto, fp8, fp8_e4m3, fp8_e5m2")
    if block_size is not None and (block_size < 32 or block_size % 32):
        raise bad("--block-size", f"{block_size} is not allowed; allowed: a multiple of 32 (vLLM's CPU attention backend takes MultipleOf(32))")
    from sparseattn.vllm.config import AUTO, CONFIG_KEY, request_from
    from sparseattn.vllm.paged import own_segment

    page = block_size or vllm_engine.DEFAULT_BLOCK_SIZE  # vLLM's CPU default
    chosen = segment_choice(segment)
    if isinstance(chosen, int) and page % chosen:
        raise bad("--segment", f"{chosen} does not divide the block size {page}; allowed: a divisor of --block-size")
    if yarn is not None and not yarn > 1:
        raise bad("--yarn", f"{yarn} is out of range; allowed: > 1")
    methods: dict[str, dict] = {}
    for given_spec in method:
        spec, at, suffix = given_spec.partition("@")
        own_choice = chosen
        if at:
            if suffix == "page":
                own_choice = None
            elif suffix.startswith("seg") and suffix[3:].isdigit() and int(suffix[3:]) > 0 and page % int(suffix[3:]) == 0:
                own_choice = int(suffix[3:])
            else:
                raise bad("--method", f"{given_spec!r}: the suffix @{suffix} is not allowed; allowed: @page, or @seg<N> with N "
                                      f"a divisor of the block size {page}")  # fmt: skip
        label, config = vllm_method(spec, budget)
        if config["method"] == serving_runs.DENSE:
            raise bad("--method", f"{spec!r}: the plugin's dense path is always run (the reference); give sparse methods")
        if config == {"method": config["method"], "budget": budget}:
            label = f"{config['method']} ({budget})"
        own = own_choice
        if own == AUTO:  # resolved here, as the engine would (its page, its longest sequence), so the label can say it
            own = own_segment(request_from({CONFIG_KEY: config}, {}).build(), serving_workload.positions_needed(context, steps, held), page)
        if own is not None:  # the paged engine's setting beside the method, as `sparseattn serve --segment`
            config["segment"] = own
            label = f"{label}, {own}-token segments"
        elif at:  # asked for whole pages
            label = f"{label}, {page}-token pages"
        if label in methods:
            raise bad("--method", f"{label} given twice; each method once")
        methods[label] = config
    plan = serving_runs.plan_runs(methods, float32=float32 and dtype != "float32")
    out = out or Path("results") / f"serving-c{context}-b{batch}{'-yarn' if yarn else ''}.json"
    if out.suffix != ".json":
        raise bad("--out", f"{out} is not a .json file; allowed: a path ending in .json")
    check_out(out.parent)
    info = inspect_model(model)
    overrides = None
    if yarn is not None:
        try:
            overrides = vllm_engine.yarn_overrides(info.directory, yarn)
        except ValueError as err:
            raise bad("--yarn", str(err)) from None
        stretched = copy.copy(info.config)  # the window YaRN gives, for the positions check below
        stretched.max_position_embeddings = overrides["max_position_embeddings"]
        info = dataclasses.replace(info, config=stretched)
    needed = serving_workload.positions_needed(context, steps, held)
    margin = serving_workload.MARGIN
    check_positions(info, ["--context", "--steps"], needed,
                    f"--context {context} + max(--steps {steps} + 1, --held {held}) + {margin} (the pass-key question)",
                    f"--context + max(--steps + 1, --held) <= {(info.window or 0) - margin}")  # fmt: skip
    reason = vllm_engine.vllm_unavailable_reason()  # not installed: refused before anything is written
    if reason:
        raise refuse(reason)

    args = {"model": model, "method": method, "budget": budget, "context": context, "batch": batch, "steps": steps, "runs": runs,
            "held": held, "texts": texts, "dtype": dtype, "float32": float32, "shared": shared, "kv_cache_gib": kv_cache_gib,
            "block_size": block_size, "segment": segment, "yarn": yarn, "out": out, "profile": profile,
            "kv_cache_dtype": kv_cache_dtype}  # fmt: skip

    def checkpoint(machine, rows, complete=False):
        serving_results.write(out, machine, str(info.directory), args, rows, complete=complete)

    log = None if verbose else log_path(out)
    if log is not None:
        console.print(f"vLLM's own output (engine start-up, compilation, warnings) goes to {log}; --verbose shows it here",
                      markup=False, highlight=False)  # fmt: skip
    with contextlib.nullcontext(sys.stdout) if log is None else output_to_log(log) as terminal:
        screen = console if log is None else console_on(terminal)
        reason = vllm_engine.vllm_unavailable_reason(import_it=True)  # a broken install (the import's own output logged)
        if reason is None:
            machine, rows = serving.run(
                str(info.directory), plan, context=context, batch=batch, steps=steps, rounds=runs, held=held, shared=shared, dtype=dtype,
                kv_cache_gib=kv_cache_gib, block_size=block_size, hf_overrides=overrides, say=lambda line: screen.print(line, markup=False, highlight=False),
                checkpoint=checkpoint, texts=texts, profile=profile, kv_cache_dtype=kv_cache_dtype,
            )  # fmt: skip
            checkpoint(machine, rows, complete=True)
            print_tables(screen, machine, rows, rounds=runs, profile=profile, yarn=yarn is not None)
    if reason:
        raise refuse(reason)
    wrote([out] if log is None else [out, log])


def print_tables(screen: Console, machine: Mapping[str, Any], rows: Sequence[Mapping[str, Any]], *, rounds: int, profile: bool,
                 yarn: bool) -> None:  # fmt: skip
    """The results table, with ``profile`` where a decode step goes, and the note that says how to read them."""
    from sparseattn.evaluation import serving_profile, serving_results

    screen.print(serving_results.table(rows, rounds=rounds))
    if profile:
        one_thread = next((b["median_gbps"] for b in machine.get("bandwidth", ()) if b["threads"] == 1 and b["chunk"] == 4096), None)
        screen.print(serving_profile.profile_table(rows, one_thread))
    weights = rows[0]["weights_mb"] if rows else 0
    screen.print(serving_results.NOTE.format(weights=weights) + (" Beyond the model's trained window (YaRN, untrained)." if yarn else ""))
