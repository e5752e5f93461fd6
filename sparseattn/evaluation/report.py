"""The quality report: methods x budgets x engines on RULER's offline tasks, passkey and perplexity, with intervals.

One call (:func:`run_report`) measures, for every *cell* (engine, method, budget, task, context):

* **retrieval**: RULER's offline tasks (:data:`~sparseattn.data.ruler.RULER_TASKS`) and passkey retrieval
  at each context, ``prompts`` seeded prompts per task (passkey: a grid of ``passkey_depths`` x
  ``passkey_prompts``), greedy answers scored with RULER's ``string_match_all`` (0-100 per prompt);
  each prompt is prefilled once for every method and budget
  (:func:`~sparseattn.evaluation.generation.run_shared`), then each cell decodes its answer from its own
  cache. A cell's number is the mean over its prompts with a 95% percentile bootstrap interval; the
  RULER mean (over tasks, each task weighing the same) has a stratified one and, against dense at the
  same context, a paired difference interval and a verdict (:mod:`sparseattn.evaluation.intervals`).
* **perplexity** on ``prose`` and ``code`` texts (the rows of one batch), ``ppl_context`` tokens each (default:
  the smallest context): the first ``ppl_context - ppl_steps - 1`` prefilled once for every cell
  (:func:`ppl_shared`), then ``ppl_steps``
  teacher-forced decode steps per cell, as ``sparseattn ppl`` measures (:mod:`sparseattn.evaluation.ppl`).
  From them, per text: the **gap ratio** ``(ppl - dense) / (ppl(StreamingLLM) - dense)`` at the same
  budget (0: dense, 1: a sliding window; docs/methods.md) and the **ceiling-relative gap**
  ``(ppl - dense) / (ppl(oracle-tokens:split=pooled) - dense)`` (1: as good as the exact top tokens
  with pooled head budgets; below 1: closer to dense than that ceiling). StreamingLLM and the oracle always run
  at each fractional budget, as the ratios' references. The ``default`` budget (each method's own) has no
  equal-budget reference, so no ratio.

Budgets are fractions of the context (``1/16``, ``1/8``, ``1/4``: ``context // 16`` ... past KV tokens per
decode step, the toolkit's one meaning of budget) and ``default`` (the method's own). A method without a
budget (dense) has one cell, ``full``; a spec that sets ``budget`` or ``top_k`` itself has one, ``spec``.
Every point's x is *measured*: the KV tokens a decode step attended over the tokens it could attend.

Resumable per cell: each cell is a run directory (:class:`~sparseattn.evaluation.runs.RunDir`) under
``out/<engine>/``; a retrieval cell appends one fsynced record per prompt and a perplexity cell writes its
summary when its steps are done, so an interrupt loses at most the prompt (or the perplexity cell) in
flight; a rerun skips what is recorded. The report itself (``report.md``, ``report.json``,
``report.png``) is rebuilt from the cells' files at the end (:func:`assemble`).

Two engines, a panel each: ``transformers`` (this module) and ``vllm``, the plugin's paged engine
(:mod:`sparseattn.evaluation.report_vllm`: one engine, each cell's method switched in, the prompts' prefill
shared through vLLM's prefix cache; its x is the nominal budget fraction, the paged engine counting nothing).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import Any

import torch

from sparseattn.evaluation.runs import RunDir, environment
from sparseattn.evaluation.report_output import assemble, finish_cells
from sparseattn.evaluation.report_plan import Part, Plan, check_plan, part_pending, part_runs, ppl_runs, record_key


def ppl_shared(model, runs: dict[str, tuple[Any, RunDir]], ids: torch.Tensor, prefill: int, steps: int, *,
               progress: bool = True) -> dict[str, dict[str, Any]]:  # fmt: skip
    """``sparseattn ppl``'s measurement for several methods over one shared prefill; returns each run's summary.

    ``ids: [B, prefill + steps + 1]``: the first ``prefill`` tokens of every row are prefilled once for
    every unfinished run (:func:`~sparseattn.evaluation.shared_prefill.prefill_shared`: each method's
    cache is the one its own prefill gives); then, one run after the other, step ``i`` feeds token
    ``prefill + i`` through the run's method and scores token ``prefill + i + 1``, as
    :func:`~sparseattn.evaluation.ppl.run_ppl` does. A run's summary (per-row perplexities, attended
    tokens) is written when its steps are done; finished runs are skipped.
    """
    from sparseattn.evaluation.ppl import step_attended
    from sparseattn.evaluation.shared_prefill import prefill_shared
    from sparseattn.hf import apply, cache_kwargs
    from sparseattn.progress import progress as show_progress

    if ids.dim() != 2 or ids.shape[1] < prefill + steps + 1 or prefill < 1 or steps < 1:
        raise ValueError(f"need ids [B, prefill + steps + 1] = [B, {prefill + steps + 1}] with prefill, steps >= 1, "
                         f"got shape {tuple(ids.shape)}")  # fmt: skip
    pending = {label: pair for label, pair in runs.items() if not pair[1].finished}
    if pending:
        rows = ids.to(model.device)
        prefilled = prefill_shared(model, {label: method for label, (method, _) in pending.items()}, rows[:, :prefill],
                                   progress=progress)  # fmt: skip
        with show_progress(f"perplexity: {len(pending)} cells x {steps} steps", total=len(pending) * steps, unit="steps",
                           enabled=progress) as bar:  # fmt: skip
            for label, (method, run) in pending.items():
                cache = prefilled.caches.pop(label)  # freed once decoded
                nlls = torch.zeros(rows.shape[0], steps, dtype=torch.float64)  # [B, steps]
                attended, contexts, start = [], [], time.perf_counter()
                with apply(model, method), torch.no_grad():
                    for i in range(steps):
                        position = prefill + i
                        logits = model(rows[:, position : position + 1], **cache_kwargs(model, cache), use_cache=True).logits
                        nlls[:, i] = torch.nn.functional.cross_entropy(logits[:, -1].float(), rows[:, position + 1],
                                                                       reduction="none").double()  # fmt: skip
                        attended.append(step_attended(cache))
                        contexts.append(position + 1)
                        bar.advance()
                del cache
                seconds = time.perf_counter() - start
                finite = [a for a in attended if not math.isnan(a)]
                mean_attended = sum(finite) / len(finite) if finite else float("nan")
                run.finish({
                    **run.config, "row_mean_nll": nlls.mean(1).tolist(), "row_ppl": nlls.mean(1).exp().tolist(),
                    "mean_attended_tokens": mean_attended, "mean_context_tokens": sum(contexts) / len(contexts),
                    "fraction": mean_attended / (sum(contexts) / len(contexts)), "decode_seconds": seconds,
                    "prefilled_with": len(pending), "environment": environment(),
                })  # fmt: skip
    return {label: run.summary() for label, (_, run) in runs.items()}


def run_part(model, plan: Plan, part: Part, *, progress: bool = True) -> None:
    """Answer a retrieval part's prompts in every cell not done yet (one shared prefill per prompt), then
    write each cell's summary."""
    from sparseattn.evaluation.generation import run_shared

    planned = {key for key, _ in part.samples}
    pending = {label: pair for label, pair in part_runs(plan, part).items()
               if not planned <= {record_key(r) for r in pair[1].records("samples.jsonl")}}  # fmt: skip
    if pending:
        run_shared(model, pending, part.prompts, part.samples, progress=progress)
    finish_cells(plan, part)


def run_report(plan: Plan, load: Callable[[], Any], *, model_dir: str | None = None, progress: bool = True,
               say: Callable[[str], None] = print, vllm_output: Callable[[], Any] | None = None) -> dict[str, Any]:  # fmt: skip
    """Run (or resume) every part of ``plan``, then :func:`assemble` the report.

    ``load()`` gives the transformers model, called only if a transformers cell is unfinished; ``model_dir``
    (the model's local directory) is what vLLM's panel starts its engine on
    (:func:`~sparseattn.evaluation.report_vllm.run_vllm_panel`; ``vllm_output``: where vLLM's own output goes),
    needed only with that engine in the plan.
    """
    from sparseattn.progress import progress as show_progress

    check_plan(plan)
    parts = [p for p in plan.parts if p.engine == "transformers"]
    ppl = [p for p in plan.ppl if p.engine == "transformers"]
    model = None
    total = len(parts) + len(ppl)
    with show_progress(f"report: {total} transformers parts (task x context, perplexity)", total=total, unit="parts",
                       enabled=progress) as bar:  # fmt: skip
        for part in parts:
            if model is None and part_pending(plan, part):
                model = load()
            run_part(model, plan, part, progress=progress)  # a finished part: its summaries only
            bar.advance()
        for part in ppl:
            runs = ppl_runs(plan, part)
            if model is None and any(not run.finished for _, run in runs.values()):
                model = load()
            ppl_shared(model, runs, part.ids, part.prefill, part.steps, progress=progress)
            bar.advance()
    if any(p.engine == "vllm" for p in [*plan.parts, *plan.ppl]):
        from sparseattn.evaluation.report_vllm import run_vllm_panel

        if model_dir is None:
            raise ValueError("the plan has vLLM cells: run_report needs model_dir, the model's local directory")
        run_vllm_panel(plan, str(model_dir), say=say, output=vllm_output)
    return assemble(plan)
