"""The quality report's vLLM panel: the same cells through the plugin's paged engine (:mod:`sparseattn.vllm`).

One engine serves the whole panel (float32, as the transformers panel, so the engines differ only in how they
select: pages, a 32-token sink page, the method's own segment grid inside pages); each cell's method is switched
in between batches (:func:`~sparseattn.vllm.switch.use_method`) and a part's pending prompts go as one batch.
vLLM's prefix cache holds the prompts' pages, so a prompt is prefilled once for every cell, as the transformers
panel shares its prefill; prefill is vLLM's dense kernel in every method, so the first answer token is dense's.

Answers are greedy, stopped at the end-of-sequence token or the part's answer budget, scored as in transformers.
Perplexity is teacher-forced through vLLM's own decode steps (:mod:`sparseattn.evaluation.vllm_ppl`), every
text in one batch. The paged engine does not count the tokens a step attends, so a cell's ``fraction`` here is
its budget over the context (nominal; ``attended_measured: false`` in its records): the method's own budget
for ``default``, 1 for dense.

vLLM is imported only when the panel runs (it runs from vLLM's venv: docs/serving.md#install).
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Mapping
from typing import Any

from sparseattn import registry
from sparseattn.evaluation.generation import Generation
from sparseattn.evaluation.report_output import finish_cells
from sparseattn.evaluation.report_plan import Cell, Part, Plan, PplPart, part_pending, part_runs, ppl_runs, record_key
from sparseattn.evaluation.runs import environment

#: The panel's engine: float32 like the transformers panel; 32-token pages with each method's own segment grid
#: inside them (``segment="auto"``, what ``sparseattn serve`` asks for), as the quality measurements of
#: docs/methods.md; eager (no graph compile: the reference code path, a minute less to start on 2 cores).
DTYPE, BLOCK_SIZE, SEGMENT, ENFORCE_EAGER = "float32", 32, "auto", True
#: The KV cache (GiB): a part's prompts in one batch, their pages kept for the next cell by the prefix cache.
KV_CACHE_GIB = 8


def vllm_spec(cell: Cell) -> dict[str, Any]:
    """The plugin's ``additional_config["sparseattn"]`` for a cell: its method, options and budget in tokens.

    >>> from sparseattn.evaluation.report_plan import plan_cells
    >>> vllm_spec(plan_cells(["radar+adaptive"], ["1/8"], 4096)[0])
    {'method': 'radar+adaptive', 'budget': 512, 'segment': 'auto'}
    """
    parsed = registry.parse(cell.method)
    options = dict(parsed.options)
    if cell.budget_tokens is not None:
        options["budget"] = cell.budget_tokens
    return {"method": parsed.name, **options, "segment": SEGMENT}


def nominal_fraction(cell: Cell, context: float) -> float:
    """A cell's budget over ``context`` tokens, at most 1 (dense: 1; ``default``: the method's own budget)."""
    budget = cell.budget_tokens if cell.budget_tokens is not None else getattr(cell.sparse, "budget", None)
    return 1.0 if budget is None else min(1.0, budget / context)


class Engine:
    """The panel's one engine, started on first use with the first cell's method and shut down by :meth:`close`."""

    def __init__(self, model_dir: str, max_model_len: int, say=print) -> None:
        self.model_dir, self.max_model_len, self.say, self.llm = model_dir, max_model_len, say, None

    def use(self, cell: Cell) -> Any:
        from sparseattn.evaluation.vllm_engine import start_engine
        from sparseattn.vllm.switch import use_method

        spec = vllm_spec(cell)
        if self.llm is None:
            self.say(f"starting vLLM for the report's vllm panel ({DTYPE}, block size {BLOCK_SIZE}, eager) ...")
            begin = time.perf_counter()
            self.llm = start_engine(self.model_dir, dtype=DTYPE, kv_cache_gib=KV_CACHE_GIB, max_model_len=self.max_model_len,
                                    block_size=BLOCK_SIZE, method=spec, enforce_eager=ENFORCE_EAGER)  # fmt: skip
            self.say(f"vLLM started in {time.perf_counter() - begin:.0f} s")
        else:
            use_method(self.llm, spec)
        return self.llm

    def close(self) -> None:
        if self.llm is not None:
            from sparseattn.evaluation.vllm_engine import stop_engine

            stop_engine(self.llm)
            self.llm = None


def run_vllm_part(engine: Engine, plan: Plan, part: Part) -> None:
    """Answer a retrieval part's pending prompts in every cell through vLLM (a batch per cell), then write each
    cell's summary, as :func:`~sparseattn.evaluation.report.run_part` does for transformers."""
    from vllm import SamplingParams

    cells = {cell.label: cell for cell in part.cells}
    tokenizer = part.prompts.tokenizer
    for label, (_, run) in part_runs(plan, part).items():
        done = {record_key(r) for r in run.records("samples.jsonl")}
        todo = [(key, sample) for key, sample in part.samples if key not in done]
        if todo:
            llm = engine.use(cells[label])
            prompts = [part.prompts.ids(sample)[0].tolist() for _, sample in todo]
            params = SamplingParams(temperature=0, max_tokens=part.prompts.max_new_tokens)  # stops at the EOS token
            begin = time.perf_counter()
            before = sum(llm.collective_rpc("sparseattn_fallbacks"))
            outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
            seconds = time.perf_counter() - begin
            fallbacks = sum(llm.collective_rpc("sparseattn_fallbacks")) - before
            with run.appender("samples.jsonl") as appender:
                for (key, sample), prompt, out in zip(todo, prompts, outs):
                    tokens = list(out.outputs[0].token_ids)
                    context = len(prompt) + (len(tokens) - 1) / 2  # a decode step's mean context, as transformers counts
                    gen = Generation(text=tokenizer.decode(tokens, skip_special_tokens=True), new_tokens=len(tokens),
                                     prompt_tokens=len(prompt), seconds=seconds / len(todo),
                                     mean_attended=nominal_fraction(cells[label], context) * context)  # fmt: skip
                    appender.write({**part.prompts.record(key, sample, gen), "new_tokens": len(tokens),
                                    "attended_measured": False, "batch": len(todo), "fallback_layer_steps": fallbacks,
                                    "needle_depths": sample.depths})  # fmt: skip
    finish_cells(plan, part)


def run_vllm_ppl(engine: Engine, part: PplPart, runs: Mapping[str, tuple[Any, Any]]) -> None:
    """Each unfinished perplexity cell through vLLM: every text teacher-forced in one batch (its prefill from the
    prefix cache after the first cell); the summary as :func:`~sparseattn.evaluation.report.ppl_shared` writes it."""
    import vllm

    from sparseattn.evaluation.vllm_engine import Forced, generate
    from sparseattn.evaluation.vllm_ppl import forced_request, records

    cells = {cell.label: cell for cell in part.cells}
    rows = [[int(t) for t in row] for row in part.ids]
    requests = [forced_request(row, part.prefill, part.steps) for row in rows]
    for label, (_, run) in runs.items():
        if run.finished:
            continue
        llm = engine.use(cells[label])
        before = sum(llm.collective_rpc("sparseattn_fallbacks"))
        seconds, outs = generate(llm, [p for p, _ in requests], part.steps + 1, forced=[f for _, f in requests], logprobs=1)
        fallbacks = sum(llm.collective_rpc("sparseattn_fallbacks")) - before
        result = Forced.from_outputs(outs, [f for _, f in requests])
        nlls = [[r["nll"] for r in records(row, part.prefill, part.steps, lp, top)]
                for row, lp, top in zip(rows, result.logprobs, result.top1)]  # fmt: skip
        mean_nll = [sum(n) / len(n) for n in nlls]
        context = part.prefill + (part.steps + 1) / 2
        fraction = nominal_fraction(cells[label], context)
        run.finish({
            **run.config, "row_mean_nll": mean_nll, "row_ppl": [math.exp(n) for n in mean_nll],
            "mean_attended_tokens": fraction * context, "mean_context_tokens": context, "fraction": fraction,
            "attended_measured": False, "decode_seconds": seconds, "fallback_layer_steps": fallbacks,
            "vllm": vllm.__version__, "environment": environment(),
        })  # fmt: skip


def run_vllm_panel(plan: Plan, model_dir: str, *, say=print, output=None) -> None:
    """Every vLLM part and perplexity part of ``plan`` (resumable per cell), on one engine started on first need.

    ``output``: a context manager factory that takes vLLM's own output while the panel runs and yields a
    stream for the panel's progress lines (``sparseattn report`` sends vLLM's to ``<out>.vllm.log``); None: ``say``.
    """
    parts = [p for p in plan.parts if p.engine == "vllm"]
    ppl = [p for p in plan.ppl if p.engine == "vllm"]
    if not any(part_pending(plan, p) for p in parts) and all(r.finished for p in ppl for _, r in ppl_runs(plan, p).values()):
        for part in parts:  # nothing to ask vLLM: no engine started, the summaries rewritten
            finish_cells(plan, part)
        return
    longest = max([p.context for p in parts] + [p.context for p in ppl])
    with contextlib.nullcontext(None) if output is None else output() as terminal:
        tell = say if terminal is None else (lambda line: print(line, file=terminal, flush=True))
        engine = Engine(model_dir, longest, tell)
        try:
            for part in parts:
                tell(f"vllm: {part.name}, {len(part.samples)} prompts x {len(part.cells)} cells")
                run_vllm_part(engine, plan, part)
            for part in ppl:
                tell(f"vllm: perplexity, {len(part.texts)} texts x {part.steps} steps x {len(part.cells)} cells")
                run_vllm_ppl(engine, part, ppl_runs(plan, part))
        finally:
            engine.close()
