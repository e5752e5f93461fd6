"""``sparseattn ppl``: perplexity under each method, as in the Radar paper's section 4.1.

``--engine transformers`` (the default) decodes with the research engine
(:mod:`sparseattn.evaluation.ppl`); ``--engine vllm`` feeds the same tokens through vLLM's own decode
steps with the method served by the sparseattn plugin (:mod:`sparseattn.evaluation.vllm_ppl`; run from the
vLLM venv, docs/serving.md). Every option is checked before any work, vLLM's presence and the paged
engine's acceptance of each method included.
"""

from __future__ import annotations

from pathlib import Path

import typer

from sparseattn.cli.checks import bad, check_decoding, check_range, refuse
from sparseattn.cli.consoles import console
from sparseattn.cli.inputs import inspect_model, text_tokens
from sparseattn.cli.method_specs import parse_methods
from sparseattn.cli.options import BUDGET, DTYPE, METHOD, MODEL, OUT, QUICK
from sparseattn.cli.outputs import check_out, plan_runs, run_name, slug, wrote

#: The ``--engine`` values.
ENGINES = ("transformers", "vllm")


def ppl(
    model: str = MODEL,
    method: list[str] = METHOD,
    budget: int | None = BUDGET,
    text: str = typer.Option("pydecimal", help="a text name (`sparseattn data list`) or a file"),
    prefill: int = typer.Option(2048, help="prompt tokens prefilled densely (>= 0; 0: generation without prompts; "
                                "--engine vllm: >= 1)"),
    steps: int = typer.Option(256, help=f"decode steps (>= 1; {QUICK}; the paper: prefill 16384 + the whole text)"),
    out: Path = OUT,
    dtype: str = DTYPE,
    engine: str = typer.Option("transformers", help="transformers (the research engine) or vllm (vLLM's own decode steps, "
                               "the method served by the sparseattn plugin, teacher-forced; run from the vLLM venv)"),
    block_size: int | None = typer.Option(None, help="vLLM's page size, the paged engine's segment: a multiple of 32 "
                                          "(default 128); only with --engine vllm"),
    kv_cache_gib: int | None = typer.Option(None, help="vLLM's KV cache in GiB (VLLM_CPU_KVCACHE_SPACE, >= 1, default 2); "
                                            "only with --engine vllm"),
) -> None:
    """Perplexity as in the paper's section 4.1: prefill a prompt, then feed the text token by token with the method."""
    check_engine(engine, prefill, block_size, kv_cache_gib)
    torch_dtype = check_decoding(dtype, prefill, steps)
    resolved = parse_methods(method, budget)
    vllm = engine == "vllm"
    if vllm:
        from sparseattn.evaluation import vllm_ppl
        from sparseattn.evaluation.vllm_engine import vllm_unavailable_reason

        plugin = plugin_configs(resolved)
        block_size = block_size or vllm_ppl.DEFAULT_BLOCK_SIZE
        kv_cache_gib = kv_cache_gib or vllm_ppl.DEFAULT_KV_CACHE_GIB
        reason = vllm_unavailable_reason()  # not installed: refused before the text is read (the import is checked last)
        if reason:
            raise refuse(reason)
    check_out(out)
    info = inspect_model(model)
    ids = text_tokens(info, text, prefill, steps, extra=1)  # the last step's target too
    parts = [slug(text), f"p{prefill}", f"s{steps}"] + (["vllm", f"b{block_size}"] if vllm else [])
    root = out / run_name("ppl", dtype, *parts)
    common = {"command": "ppl", "model": model, "text": text, "prefill": prefill, "steps": steps, "dtype": dtype}
    if vllm:  # a vLLM run never meets a transformers run (nor one of another page size) in one directory
        common.update(engine="vllm", block_size=block_size)
    runs = plan_runs(root, resolved, common)

    from sparseattn.evaluation.plots import ppl_table
    from sparseattn.evaluation.runs import RunDir

    if vllm:
        reason = vllm_unavailable_reason(import_it=True)
        if reason:
            raise refuse(reason)
        dirs = {label: (plugin[label], RunDir(path, config)) for label, _, path, config in runs}
        summaries = vllm_ppl.run_ppl_vllm(
            str(info.directory), dirs, ids.tolist(), prefill, steps, dtype=dtype, block_size=block_size, kv_cache_gib=kv_cache_gib,
            say=lambda line: console.print(line, markup=False, highlight=False),
        )  # fmt: skip
        for label, (_, run) in dirs.items():
            summary = summaries[label]
            fell = summary["fallback_layer_steps"]
            console.print(f"{label}: ppl {summary['ppl']:.3f} through vLLM, {summary['tokens_per_second']:.2f} decode tokens/s"
                          + (f", {fell} decode layer-steps left to vLLM's dense kernel" if fell else "") + f" -> {run.path}",
                          markup=False)  # fmt: skip
        paths = [run.path for _, run in dirs.values()]
    else:
        from sparseattn.evaluation.ppl import run_ppl

        hf_model = info.load(torch_dtype)
        paths = []
        for label, sparse_method, path, config in runs:
            run = RunDir(path, config)
            summary = run_ppl(hf_model, sparse_method, ids, prefill, steps, run, label=label)
            console.print(f"{label}: ppl {summary['ppl']:.3f}, {summary['tokens_per_second']:.2f} tokens/s, "
                          f"{summary['mean_attended_tokens']:.0f} KV tokens attended per step -> {run.path}", markup=False)
            paths.append(run.path)
    console.print(ppl_table(paths), markup=False)
    wrote(paths, "config.json, tokens.jsonl, summary.json in each")


def check_engine(engine: str, prefill: int, block_size: int | None, kv_cache_gib: int | None) -> None:
    """Refuse an unknown ``--engine``, vLLM's options without ``--engine vllm``, a page size vLLM's CPU kernels lack,
    and a vLLM run without a prompt."""
    if engine not in ENGINES:
        raise bad("--engine", f"{engine!r} is not one of {', '.join(ENGINES)}")
    if engine != "vllm":
        for option, value in (("--block-size", block_size), ("--kv-cache-gib", kv_cache_gib)):
            if value is not None:
                raise bad(option, f"{value} is given with --engine {engine}; allowed: only with --engine vllm")
        return
    if block_size is not None and (block_size < 32 or block_size % 32):
        raise bad("--block-size", f"{block_size} is not allowed; allowed: a multiple of 32 (vLLM's CPU attention backend takes MultipleOf(32))")
    check_range("--kv-cache-gib", kv_cache_gib, 1)
    if prefill < 1:
        raise bad("--prefill", f"{prefill} is out of range with --engine vllm; allowed: >= 1 (vLLM scores after a prompt; "
                  "--prefill 0 runs with --engine transformers)")


def plugin_configs(resolved) -> dict[str, dict]:
    """``label -> additional_config["sparseattn"]`` for every resolved method, refused unless vLLM's paged engine runs it
    (:class:`~sparseattn.vllm.paged.PagedPolicy` says why not: an eviction method, an always-kept part, ...)."""
    from sparseattn.vllm.paged import PagedPolicy

    configs = {}
    for label, built, given in resolved:
        try:
            PagedPolicy(built, label)
        except ValueError as err:
            raise bad("--method", str(err)) from None
        configs[label] = {"method": label.partition(":")[0], **given}
    return configs
