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

The engine dimension is in every cell and figure panel; only ``transformers`` runs here so far.
"""

from __future__ import annotations

import math
import re
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from fractions import Fraction
from pathlib import Path
from typing import Any

import torch

from sparseattn import registry
from sparseattn.data.needle import PasskeyTask
from sparseattn.data.ruler import RULER_TASKS, tokens_to_generate
from sparseattn.evaluation.intervals import RESAMPLES, compare, stratified_bootstrap_mean
from sparseattn.evaluation.runs import RunDir, environment, write_json

#: The methods a report compares by default: dense, the baselines, Radar and this toolkit's radar+ family,
#: and the pooled exact-token oracle (the ceiling-relative gap's reference).
DEFAULT_METHODS = ("dense", "streamingllm", "snapkv", "quest", "radar", "radar+", "radar+adaptive", "oracle-tokens:split=pooled")
#: Budgets: fractions of the context, and each method's own default.
DEFAULT_BUDGETS = ("1/16", "1/8", "1/4", "default")
#: The engines a report knows; vLLM's paged engine is the next panel (issue 49).
ENGINES = ("transformers",)
#: The gap ratio's reference and the ceiling-relative gap's.
STREAMING, ORACLE = "streamingllm", "oracle-tokens:split=pooled"
#: Passkey depths of the full report: 10, evenly spaced from 0% to 100%.
PASSKEY_DEPTHS = tuple(float(round(i * 100 / 9)) for i in range(10))
#: Answer tokens of the passkey (a number up to 50000 and its period fit in 16 of any tokenizer here).
PASSKEY_ANSWER = 16


def parse_budget(text: str) -> str:
    """A budget's canonical label: ``1/N`` (a fraction of the context, N >= 1) or ``default``; ValueError otherwise.

    >>> parse_budget(" 1/8 "), parse_budget("default"), parse_budget("2/16")
    ('1/8', 'default', '1/8')
    """
    word = text.strip().lower()
    if word == "default":
        return word
    try:
        value = Fraction(word)
    except (ValueError, ZeroDivisionError):
        value = None
    if value is None or "/" not in word or not 0 < value <= 1:
        raise ValueError(f"{text!r} is not a budget; allowed: a fraction of the context 1/N (e.g. 1/16, 1/8, 1/4) or default")
    return f"{value.numerator}/{value.denominator}"


def budget_tokens(budget: str, context: int) -> int | None:
    """The past KV tokens a decode step may attend for a budget label at a context (None: the method's own).

    >>> budget_tokens("1/16", 4096), budget_tokens("default", 4096)
    (256, None)
    """
    if budget in ("default", "full", "spec"):
        return None
    return max(1, int(Fraction(budget) * context))


@dataclass(frozen=True)
class Cell:
    """One column of the report at one context: a method at one budget, in one engine.

    Attributes:
        engine: ``transformers`` (vLLM's paged engine to come).
        method: the method's label without its budget (``radar+adaptive``, ``oracle-tokens:split=pooled``).
        budget: ``1/16``..., ``default``, ``full`` (no budget: dense) or ``spec`` (the spec fixes it).
        budget_tokens: the budget in tokens at this context (None: the method's own).
        sparse: the method instance.
    """

    engine: str
    method: str
    budget: str
    budget_tokens: int | None
    sparse: Any = field(compare=False, repr=False)

    @property
    def label(self) -> str:
        return f"{self.method}@{self.budget}"


def method_label(spec: str) -> tuple[str, bool]:
    """``(label, has_budget)``: the registry's label of ``spec`` (ValueError for a bad one), and whether
    the budgets apply to it (it takes a budget and its spec sets neither ``budget`` nor ``top_k``)."""
    parsed = registry.parse(spec)
    entry = registry.get(parsed.name)
    return parsed.label, "budget" in entry.option_names and not {"budget", "top_k"} & set(parsed.options)


def plan_cells(methods: Sequence[str], budgets: Sequence[str], context: int, engine: str = "transformers") -> list[Cell]:
    """Every cell of ``methods`` x ``budgets`` at ``context`` (a method without a budget: one cell); ValueError
    (the registry's message) where a spec, or a spec at a budget, is refused."""
    cells: dict[str, Cell] = {}
    for spec in methods:
        label, has_budget = method_label(spec)
        if not has_budget:
            fixed = "full" if "budget" not in registry.get(registry.parse(spec).name).option_names else "spec"
            cell = Cell(engine, label, fixed, None, registry.parse(spec).method)
            cells.setdefault(cell.label, cell)
            continue
        for budget in budgets:
            tokens = budget_tokens(budget, context)
            cell = Cell(engine, label, budget, tokens, registry.parse(spec, tokens).method)
            cells.setdefault(cell.label, cell)
    return list(cells.values())


@dataclass(frozen=True)
class ReportConfig:
    """What a report measures (the full run's sizes by default; :data:`QUICK` is the first look).

    Attributes:
        methods: method specs (``NAME[:key=value,...]``, ``sparseattn methods``).
        budgets: ``1/N`` fractions of the context and/or ``default``.
        contexts: prompt lengths in tokens, answer included.
        tasks: RULER task names (:data:`~sparseattn.data.ruler.RULER_TASKS`).
        prompts: seeded prompts per RULER task and context.
        passkey_depths, passkey_prompts: the passkey grid per context (no passkey when ``passkey_prompts`` is 0).
        prose, code: perplexity texts (names from ``sparseattn data list`` or paths), at least one of each.
        ppl_steps: teacher-forced decode steps per text (0: no perplexity).
        ppl_context: tokens per perplexity text, the budgets' fractions taken of it (None: ``min(contexts)``).
        answer_tokens: the most answer tokens generated (RULER's own budget where it is smaller).
        haystack: the prose haystack of the NIAH tasks that take one.
        seed: the first prompt's seed; resamples: bootstrap draws per interval.
        engines: the engines run (``transformers``).
    """

    methods: tuple[str, ...] = DEFAULT_METHODS
    budgets: tuple[str, ...] = DEFAULT_BUDGETS
    contexts: tuple[int, ...] = (4096, 8192)
    tasks: tuple[str, ...] = tuple(RULER_TASKS)
    prompts: int = 25
    passkey_depths: tuple[float, ...] = PASSKEY_DEPTHS
    passkey_prompts: int = 5
    prose: tuple[str, ...] = ("king-lear", "paradise-regained")
    code: tuple[str, ...] = ("pyio", "subprocess")
    ppl_steps: int = 256
    ppl_context: int | None = None
    answer_tokens: int = 32
    haystack: str = "paradise-lost"
    seed: int = 0
    resamples: int = RESAMPLES
    engines: tuple[str, ...] = ENGINES

    def __post_init__(self) -> None:
        def need(ok: bool, name: str, value: object, allowed: str) -> None:
            if not ok:
                raise ValueError(f"ReportConfig.{name}: {value!r} is not allowed; allowed: {allowed}")

        need(bool(self.methods), "methods", self.methods, "at least one method spec")
        need(bool(self.budgets), "budgets", self.budgets, "at least one of 1/N and default")
        for budget in self.budgets:
            need(parse_budget(budget) == budget, "budgets", budget, "canonical labels (parse_budget)")
        need(bool(self.contexts) and all(isinstance(c, int) and c >= 64 for c in self.contexts), "contexts", self.contexts,
             "integers >= 64")  # fmt: skip
        need(all(t in RULER_TASKS for t in self.tasks), "tasks", self.tasks, ", ".join(RULER_TASKS))
        need(self.prompts >= 1, "prompts", self.prompts, ">= 1")
        need(self.passkey_prompts >= 0, "passkey_prompts", self.passkey_prompts, ">= 0")
        need(all(0 <= d <= 100 for d in self.passkey_depths), "passkey_depths", self.passkey_depths, "0 to 100 percent")
        need(self.ppl_steps >= 0, "ppl_steps", self.ppl_steps, ">= 0")
        need(self.ppl_context is None or self.ppl_context > self.ppl_steps + 1, "ppl_context", self.ppl_context,
             f"None or more than ppl_steps + 1 = {self.ppl_steps + 1} tokens")  # fmt: skip
        need(self.ppl_steps == 0 or (bool(self.prose) and bool(self.code)), "prose/code", (self.prose, self.code),
             "at least one text of each kind")  # fmt: skip
        need(self.answer_tokens >= 1, "answer_tokens", self.answer_tokens, ">= 1")
        need(self.resamples >= 1, "resamples", self.resamples, ">= 1")
        need(all(e in ENGINES for e in self.engines), "engines", self.engines, ", ".join(ENGINES))

    @property
    def ppl_tokens(self) -> int:
        """Tokens of each perplexity text (prefill + steps + the last target): ``ppl_context`` or the smallest context."""
        return self.ppl_context or min(self.contexts)

    def answer(self, task: str) -> int:
        """Answer tokens generated for ``task`` (``passkey`` or a RULER task)."""
        own = PASSKEY_ANSWER if task == "passkey" else tokens_to_generate(task)
        return min(own, self.answer_tokens)

    def to_dict(self) -> dict[str, Any]:
        return {k: list(v) if isinstance(v, tuple) else v for k, v in self.__dict__.items()}


#: The first look (``sparseattn report --quick``): 3 methods at budget 1/8; at 2048 tokens niah_single_1 and
#: niah_multikey_1 x 4 prompts and passkey at 3 depths, answers of at most 12 tokens; perplexity of 2 + 2 texts
#: of 1024 tokens over their last 16 (with StreamingLLM's and the pooled oracle's at 1/8 as references).
QUICK = ReportConfig(
    methods=("dense", "streamingllm", "radar+adaptive"), budgets=("1/8",), contexts=(2048,),
    tasks=("niah_single_1", "niah_multikey_1"), prompts=4, passkey_depths=(10.0, 50.0, 90.0), passkey_prompts=1,
    ppl_steps=16, ppl_context=1024, answer_tokens=12,
)  # fmt: skip


# -- planning: every prompt built with the tokenizer alone, before any weight is loaded ---------------------------


@dataclass
class Part:
    """One task at one context for one engine: its prompts, and the cells that answer them."""

    engine: str
    task: str
    context: int
    prompts: Any  # RetrievalPrompts
    samples: list  # [(key, NeedleSample)]
    cells: list[Cell]

    @property
    def name(self) -> str:
        return f"{self.task}-c{self.context}"


@dataclass
class PplPart:
    """The perplexity texts at one context for one engine: ``ids: [texts, context]`` and the cells."""

    engine: str
    context: int
    steps: int
    texts: list[str]
    kinds: list[str]
    ids: torch.Tensor
    cells: list[Cell]

    @property
    def name(self) -> str:
        return f"ppl-c{self.context}-s{self.steps}"

    @property
    def prefill(self) -> int:
        return self.context - self.steps - 1


@dataclass
class Plan:
    """Everything a report will run, built and checked before the model is loaded (:func:`plan_report`)."""

    config: ReportConfig
    model: str
    out: Path
    parts: list[Part]
    ppl: list[PplPart]


def read_named_text(name: str) -> str:
    """A text by name (``sparseattn data list``) or a path to a file."""
    from sparseattn.data.sources import load_text

    path = Path(name).expanduser()
    return path.read_text(encoding="utf-8", errors="replace") if path.is_file() else load_text(name)


def plan_report(config: ReportConfig, tokenizer, out: Path, model: str = "default", window: int | None = None) -> Plan:
    """Every part and cell of a report, its prompts built and its texts tokenized (the tokenizer only).

    Raises ValueError naming what cannot be built: a method spec at a budget, a context a task cannot
    fill or the model cannot hold (``window``: its positions), a text too short.
    """
    from sparseattn.evaluation.generation import RetrievalPrompts, needle_plan
    from sparseattn.evaluation.ppl import tokenize

    for context in config.contexts:
        if window is not None and context > window:
            raise ValueError(f"context {context} is beyond the model's {window} positions")
    haystack_text = None
    parts = []
    for engine in config.engines:
        for context in config.contexts:
            cells = plan_cells(config.methods, config.budgets, context, engine)
            jobs = [(name, RULER_TASKS[name], []) for name in config.tasks]
            if config.passkey_prompts:
                jobs.append(("passkey", PasskeyTask(), list(config.passkey_depths)))
            for name, task, depths in jobs:
                prose = getattr(task, "haystack", None) == "prose"
                if prose and haystack_text is None:
                    haystack_text = read_named_text(config.haystack)
                prompts = RetrievalPrompts(task, tokenizer, config.answer(name), haystack_text if prose else None)
                samples = config.passkey_prompts if name == "passkey" else config.prompts
                plan = needle_plan(task, [context], depths, samples, config.seed)
                try:
                    built = prompts.samples(plan)
                except ValueError as err:
                    raise ValueError(f"{name} at context {context}: {err}") from None
                parts.append(Part(engine, name, context, prompts, built, cells))
    ppl = []
    if config.ppl_steps:
        context = config.ppl_tokens
        if window is not None and context > window:
            raise ValueError(f"perplexity texts of {context} tokens are beyond the model's {window} positions")
        if context - config.ppl_steps - 1 < 1:
            raise ValueError(f"perplexity at context {context} with {config.ppl_steps} steps leaves no prefill; "
                             f"allowed: steps < {context - 1}")  # fmt: skip
        texts = [*config.prose, *config.code]
        kinds = ["prose"] * len(config.prose) + ["code"] * len(config.code)
        ids = torch.stack([tokenize(tokenizer, read_named_text(t), context, name=t) for t in texts])  # [texts, context]
        references = [STREAMING, ORACLE]
        for engine in config.engines:
            cells = plan_cells(["dense", *config.methods], config.budgets, context, engine)
            fractions = [b for b in config.budgets if b != "default"]
            for cell in plan_cells(references, fractions, context, engine):
                if cell.label not in {c.label for c in cells}:
                    cells.append(cell)
            ppl.append(PplPart(engine, context, config.ppl_steps, texts, kinds, ids, cells))
    return Plan(config, model, Path(out), parts, ppl)


# -- running ------------------------------------------------------------------------------------------------------


def _cell_config(plan: Plan, cell: Cell, **more: Any) -> dict[str, Any]:
    return {"command": "report", "engine": cell.engine, "model": plan.model, "method": cell.method, "budget": cell.budget,
            "budget_tokens": cell.budget_tokens, "params": repr(cell.sparse), "seed": plan.config.seed, **more}  # fmt: skip


def _slug(label: str) -> str:
    """A cell's directory name: ``radar+adaptive@1/8`` -> ``radar+adaptive-at-1of8`` (other odd characters: ``_``)."""
    return re.sub(r"[^A-Za-z0-9_.=+-]+", "_", label.replace("@", "-at-").replace("/", "of"))


def part_runs(plan: Plan, part: Part) -> dict[str, tuple[Any, RunDir]]:
    """The run directory of every cell of a retrieval part (``out/<engine>/<task>-c<context>/<cell>``)."""
    root = plan.out / part.engine / part.name
    haystack = plan.config.haystack if part.prompts.haystack_text is not None else None
    return {
        cell.label: (cell.sparse, RunDir(root / _slug(cell.label), _cell_config(
            plan, cell, task=part.task, context=part.context, task_params=repr(part.prompts.task),
            answer_tokens=part.prompts.max_new_tokens, haystack=haystack)))
        for cell in part.cells
    }  # fmt: skip


def ppl_runs(plan: Plan, part: PplPart) -> dict[str, tuple[Any, RunDir]]:
    """The run directory of every cell of a perplexity part (``out/<engine>/ppl-c<context>-s<steps>/<cell>``)."""
    root = plan.out / part.engine / part.name
    return {
        cell.label: (cell.sparse, RunDir(root / _slug(cell.label), _cell_config(
            plan, cell, texts=part.texts, kinds=part.kinds, context=part.context, steps=part.steps)))
        for cell in part.cells
    }  # fmt: skip


def check_plan(plan: Plan) -> None:
    """Refuse (ValueError) a plan whose cells' directories hold runs of another config; writes nothing."""
    for part in plan.parts:
        root = plan.out / part.engine / part.name
        haystack = plan.config.haystack if part.prompts.haystack_text is not None else None
        for cell in part.cells:
            RunDir.check(root / _slug(cell.label), _cell_config(
                plan, cell, task=part.task, context=part.context, task_params=repr(part.prompts.task),
                answer_tokens=part.prompts.max_new_tokens, haystack=haystack))  # fmt: skip
    for part in plan.ppl:
        for cell in part.cells:
            RunDir.check(plan.out / part.engine / part.name / _slug(cell.label), _cell_config(
                plan, cell, texts=part.texts, kinds=part.kinds, context=part.context, steps=part.steps))  # fmt: skip


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


def _fraction(record: dict[str, Any]) -> float:
    """The share of the context a retrieval answer's decode steps attended (NaN: no decode step)."""
    steps_context = record["prompt_tokens"] + (record.get("new_tokens", 1) - 1) / 2
    return record["attended"] / steps_context


def summarize_cell(cell_records: Sequence[dict[str, Any]], resamples: int, seed: int) -> dict[str, Any]:
    """A retrieval cell's summary: the mean score with its bootstrap interval, the attended fraction, per-depth means."""
    from sparseattn.evaluation.intervals import bootstrap_mean

    scores = [r["score"] for r in cell_records]
    fractions = [f for f in map(_fraction, cell_records) if not math.isnan(f)]
    depths: dict[str, list[float]] = {}
    for r in cell_records:
        depths.setdefault(f"{r['depth']:g}", []).append(r["score"])
    return {
        "score": bootstrap_mean(scores, resamples=resamples, seed=seed).to_dict(),
        "fraction": sum(fractions) / len(fractions) if fractions else float("nan"),
        "by_depth": {d: sum(v) / len(v) for d, v in depths.items()},
        "n_prompts": len(cell_records),
        "decode_seconds": sum(r["seconds"] for r in cell_records),
    }


def _key(record: dict[str, Any]) -> tuple:
    return record["length"], record["depth"], record["seed"]


def run_part(model, plan: Plan, part: Part, *, progress: bool = True) -> None:
    """Answer a retrieval part's prompts in every cell not done yet (one shared prefill per prompt), then
    write each cell's summary."""
    from sparseattn.evaluation.generation import run_shared

    runs = part_runs(plan, part)
    planned = {key for key, _ in part.samples}
    pending = {label: pair for label, pair in runs.items()
               if not planned <= {_key(r) for r in pair[1].records("samples.jsonl")}}  # fmt: skip
    if pending:
        run_shared(model, pending, part.prompts, part.samples, progress=progress)
    for label, (_, run) in runs.items():
        records = [r for r in run.records("samples.jsonl") if _key(r) in planned]
        run.finish({**run.config, **summarize_cell(records, plan.config.resamples, plan.config.seed)})


def run_report(model, plan: Plan, *, progress: bool = True) -> dict[str, Any]:
    """Run (or resume) every part of ``plan`` on ``model`` (transformers), then :func:`assemble` the report."""
    from sparseattn.progress import progress as show_progress

    check_plan(plan)
    total = len(plan.parts) + len(plan.ppl)
    with show_progress(f"report: {total} parts (task x context, perplexity)", total=total, unit="parts",
                       enabled=progress) as bar:  # fmt: skip
        for part in plan.parts:
            run_part(model, plan, part, progress=progress)
            bar.advance()
        for part in plan.ppl:
            ppl_shared(model, ppl_runs(plan, part), part.ids, part.prefill, part.steps, progress=progress)
            bar.advance()
    return assemble(plan)


# -- the report: tables, JSON and the figure, from the cells' files ---------------------------------------------------


def _ratio(value: float, dense: float, reference: float | None) -> float | None:
    if reference is None or reference == dense:
        return None
    return (value - dense) / (reference - dense)


def _kind_summary(values: Sequence[float | None], kinds: Sequence[str]) -> dict[str, dict[str, float] | None]:
    """Mean and worst (largest) of ``values`` over the texts of each kind (None: a ratio undefined on some text)."""
    out: dict[str, dict[str, float] | None] = {}
    for kind in dict.fromkeys(kinds):
        mine = [v for v, k in zip(values, kinds) if k == kind]
        out[kind] = None if any(v is None for v in mine) else {"mean": sum(mine) / len(mine), "worst": max(mine)}
    return out


def assemble(plan: Plan) -> dict[str, Any]:
    """The report from the cells' files: ``report.json``, ``report.md`` and ``report.png`` under ``plan.out``.

    Per retrieval cell its interval; per (engine, context, method, budget) the RULER mean over tasks
    (stratified bootstrap) compared with dense's at that context (paired: the same prompts); per
    perplexity cell each text's perplexity, gap ratio and ceiling-relative gap.
    """
    config = plan.config
    cells, records = [], {}
    for part in plan.parts:
        for label, (_, run) in part_runs(plan, part).items():
            summary = run.summary()
            planned = {key for key, _ in part.samples}
            records[(part.engine, part.context, label, part.task)] = {
                _key(r): r["score"] for r in run.records("samples.jsonl") if _key(r) in planned}  # fmt: skip
            cells.append({"engine": part.engine, "context": part.context, "task": part.task, "label": label,
                          "method": summary["method"], "budget": summary["budget"],
                          "budget_tokens": summary["budget_tokens"], "score": summary["score"],
                          "fraction": summary["fraction"], "by_depth": summary["by_depth"]})  # fmt: skip
    means = []
    for engine in config.engines:
        for context in config.contexts:
            labels = list(dict.fromkeys(c["label"] for c in cells if c["engine"] == engine and c["context"] == context))
            for group, tasks in (("ruler", list(config.tasks)), ("passkey", ["passkey"] if config.passkey_prompts else [])):
                if not tasks:
                    continue
                dense = next((lab for lab in labels if lab.startswith("dense@")), None)
                for label in labels:
                    mine = {t: records[(engine, context, label, t)] for t in tasks}
                    row = {"engine": engine, "context": context, "group": group, "label": label,
                           "tasks": tasks}  # fmt: skip
                    own = [c for c in cells if c["engine"] == engine and c["context"] == context and c["label"] == label
                           and c["task"] in tasks]  # fmt: skip
                    row.update(method=own[0]["method"], budget=own[0]["budget"], budget_tokens=own[0]["budget_tokens"])
                    fractions = [c["fraction"] for c in own if not math.isnan(c["fraction"])]
                    row["fraction"] = sum(fractions) / len(fractions) if fractions else float("nan")
                    if dense is not None:
                        versus = compare(mine, {t: records[(engine, context, dense, t)] for t in tasks},
                                         resamples=config.resamples, seed=config.seed)  # fmt: skip
                        row["score"], row["versus_dense"] = versus.method.to_dict(), versus.to_dict()
                    else:
                        row["score"] = stratified_bootstrap_mean({t: list(mine[t].values()) for t in tasks},
                                                                 resamples=config.resamples, seed=config.seed).to_dict()
                    means.append(row)
    ppl_rows = []
    for part in plan.ppl:
        summaries = {label: run.summary() for label, (_, run) in ppl_runs(plan, part).items()}
        dense = summaries.get("dense@full")
        for label, s in summaries.items():
            row = {"engine": part.engine, "context": part.context, "steps": part.steps, "label": label,
                   "method": s["method"], "budget": s["budget"], "budget_tokens": s["budget_tokens"],
                   "fraction": s["fraction"], "ppl": dict(zip(part.texts, s["row_ppl"]))}  # fmt: skip
            if dense is not None and s["budget"] not in ("full", "default", "spec"):
                streaming = summaries.get(f"{STREAMING}@{s['budget']}")
                oracle = summaries.get(f"{ORACLE}@{s['budget']}")
                gap = [_ratio(p, d, None if streaming is None else r)
                       for p, d, r in zip(s["row_ppl"], dense["row_ppl"], (streaming or s)["row_ppl"])]
                ceiling = [_ratio(p, d, None if oracle is None else r)
                           for p, d, r in zip(s["row_ppl"], dense["row_ppl"], (oracle or s)["row_ppl"])]
                row["gap_ratio"] = dict(zip(part.texts, gap))
                row["ceiling_relative"] = dict(zip(part.texts, ceiling))
                row["gap_ratio_by_kind"] = _kind_summary(gap, part.kinds)
                row["ceiling_relative_by_kind"] = _kind_summary(ceiling, part.kinds)
            ppl_rows.append(row)
    report = {"config": config.to_dict(), "model": plan.model, "environment": environment(), "cells": cells,
              "means": means, "ppl": ppl_rows,
              "ppl_texts": [{"text": t, "kind": k} for part in plan.ppl[:1] for t, k in zip(part.texts, part.kinds)]}  # fmt: skip
    plan.out.mkdir(parents=True, exist_ok=True)
    write_json(plan.out / "report.json", report)
    (plan.out / "report.md").write_text(markdown(report) + "\n")
    from sparseattn.evaluation.plots import save

    save(draw_report(report), plan.out / "report.png")
    return report


def _interval_text(score: dict[str, float]) -> str:
    return f"{score['mean']:.1f} [{score['low']:.1f}, {score['high']:.1f}]"


def _number(value: float | None, digits: int = 2) -> str:
    return "-" if value is None or (isinstance(value, float) and math.isnan(value)) else f"{value:.{digits}f}"


def retrieval_tables(report: dict[str, Any]) -> list[tuple[str, list[str], list[list[str]]]]:
    """``(title, header, rows)`` per engine and context: a row per cell, a column per task, the RULER mean
    with its interval and its verdict against dense (the markdown and the console print these)."""
    config = report["config"]
    tasks = [*config["tasks"], *(["passkey"] if config["passkey_prompts"] else [])]
    tables = []
    for engine in config["engines"]:
        for context in config["contexts"]:
            cells = {(c["label"], c["task"]): c for c in report["cells"] if c["engine"] == engine and c["context"] == context}
            means = {(m["label"], m["group"]): m for m in report["means"] if m["engine"] == engine and m["context"] == context}
            labels = list(dict.fromkeys(label for label, _ in cells))
            header = ["method", "budget", "attended", *tasks]
            if config["tasks"]:
                header += ["RULER mean [95%]", "vs dense"]
            rows = []
            for label in labels:
                first = next(c for (lab, _), c in cells.items() if lab == label)
                budget = first["budget"] + (f" ({first['budget_tokens']})" if first["budget_tokens"] else "")
                fractions = [c["fraction"] for (lab, _), c in cells.items() if lab == label and not math.isnan(c["fraction"])]
                row = [first["method"], budget, _number(sum(fractions) / len(fractions) if fractions else None, 3)]
                row += [_interval_text(cells[(label, t)]["score"]) for t in tasks]
                if config["tasks"]:
                    mean = means[(label, "ruler")]
                    versus = mean.get("versus_dense")
                    verdict = "-" if versus is None or label.startswith("dense@") else (
                        f"{versus['verdict']} (diff {_interval_text(versus['difference'])})")
                    row += [_interval_text(mean["score"]), verdict]
                rows.append(row)
            title = (f"Retrieval, {engine}, {context} tokens: score (%) [95% bootstrap interval], {config['prompts']} prompts "
                     f"per RULER task, passkey {len(config['passkey_depths'])} depths x {config['passkey_prompts']}")
            tables.append((title, header, rows))
    return tables


def ppl_tables(report: dict[str, Any]) -> list[tuple[str, list[str], list[list[str]]]]:
    """``(title, header, rows)`` per engine: perplexity per text, gap ratio and ceiling-relative gap per kind."""
    texts = report["ppl_texts"]
    tables = []
    for engine in report["config"]["engines"]:
        rows_in = [r for r in report["ppl"] if r["engine"] == engine]
        if not rows_in:
            continue
        kinds = list(dict.fromkeys(t["kind"] for t in texts))
        header = ["method", "budget", "attended", *(Path(t["text"]).name for t in texts),
                  *(f"gap ratio, {k}: mean (worst)" for k in kinds), *(f"ceiling-relative, {k}: mean (worst)" for k in kinds)]
        rows = []
        for r in rows_in:
            budget = r["budget"] + (f" ({r['budget_tokens']})" if r["budget_tokens"] else "")
            row = [r["method"], budget, _number(r["fraction"], 3), *(f"{r['ppl'][t['text']]:.3f}" for t in texts)]
            for key in ("gap_ratio_by_kind", "ceiling_relative_by_kind"):
                for k in kinds:
                    s = (r.get(key) or {}).get(k)
                    row.append("-" if s is None else f"{s['mean']:.3f} ({s['worst']:.3f})")
            rows.append(row)
        first = rows_in[0]
        title = (f"Perplexity, {engine}: {first['context']} tokens per text, the last {first['steps']} decoded; gap ratio = "
                 "(ppl - dense) / (StreamingLLM's - dense), ceiling-relative = (ppl - dense) / (oracle-tokens:split=pooled's "
                 "- dense), both at the same budget")
        tables.append((title, header, rows))
    return tables


def markdown(report: dict[str, Any]) -> str:
    """The report as markdown: its setup, a retrieval table per engine and context, a perplexity table per engine."""
    config = report["config"]
    env = report["environment"]
    lines = [
        "# Quality report",
        "",
        f"Model `{report['model']}`; engines {', '.join(config['engines'])}; methods {', '.join(config['methods'])}; budgets "
        f"{', '.join(config['budgets'])} (fractions of the context: past KV tokens per decode step); seed {config['seed']}; "
        f"answers of at most {config['answer_tokens']} tokens; torch {env['torch']}, transformers {env['transformers']}, "
        f"{env['threads']} threads on {env['processor']}.",
        "",
        f"Intervals: 95% percentile bootstrap over the prompts ({config['resamples']} resamples; the RULER mean: "
        "stratified by task, each task weighing the same). `vs dense`: *within* = the mean lies inside dense's "
        "interval; *worse* = the paired difference's interval is below 0; *outside* = neither. `attended`: the KV "
        "tokens a decode step attended over those it could attend (measured).",
        "",
        "Perplexity ratios divide by the reference's own gap to dense: where that gap is near 0 (StreamingLLM or the "
        "oracle about as good as dense on a text, or better) a text's ratio is large or of either sign; read each text's "
        "perplexities beside its ratios.",
    ]
    for title, header, rows in [*retrieval_tables(report), *ppl_tables(report)]:
        lines += ["", f"## {title}", "", "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
        lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def draw_report(report: dict[str, Any]):
    """Quality against the fraction of tokens attended: a panel per engine, a line per method (and context), its
    95% interval shaded; dense is a point with its interval as a band across the panel."""
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter

    config = report["config"]
    group = "ruler" if config["tasks"] else "passkey"
    engines = list(config["engines"])
    fig, axes = plt.subplots(1, len(engines), figsize=(8 * len(engines), 5.5), squeeze=False, sharey=True)
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    styles = ["-", "--", ":", "-."]
    for ax, engine in zip(axes[0], engines):
        rows = [m for m in report["means"] if m["engine"] == engine and m["group"] == group]
        methods = list(dict.fromkeys(r["method"] for r in rows))
        for i, method in enumerate(methods):
            colour = colours[i % len(colours)]
            for j, context in enumerate(config["contexts"]):
                points = sorted((r["fraction"], r["score"]) for r in rows if r["method"] == method and r["context"] == context
                                and not math.isnan(r["fraction"]))  # fmt: skip
                if not points:
                    continue
                x = [p[0] for p in points]
                label = f"{method}, {context} tokens" if len(config["contexts"]) > 1 else method
                if method == "dense":
                    s = points[0][1]
                    ax.axhspan(s["low"], s["high"], color=colour, alpha=0.08)
                    ax.errorbar(x, [s["mean"]], yerr=[[s["mean"] - s["low"]], [s["high"] - s["mean"]]], fmt="s",
                                color=colour, linestyle=styles[j % len(styles)], label=label, capsize=3)  # fmt: skip
                    continue
                y = [p[1]["mean"] for p in points]
                ax.plot(x, y, marker="o", color=colour, linestyle=styles[j % len(styles)], label=label)
                ax.fill_between(x, [p[1]["low"] for p in points], [p[1]["high"] for p in points], color=colour, alpha=0.15)
                # a line of one budget has no area to shade: its interval shows as a bar at the point too
                ax.errorbar(x, y, yerr=[[m - p[1]["low"] for m, p in zip(y, points)], [p[1]["high"] - m for m, p in zip(y, points)]],
                            fmt="none", ecolor=colour, alpha=0.6, capsize=3)  # fmt: skip
        ax.set_xscale("log", base=2)
        ax.xaxis.set_major_formatter(FuncFormatter(lambda x, _: "1" if x >= 1 else f"1/{round(1 / x):d}"))
        ax.set_ylim(-3, 103)
        ax.set_xlabel("fraction of the context's KV tokens attended per decode step (measured, log scale)")
        ax.set_title(f"{engine}")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
    what = f"RULER mean over {len(config['tasks'])} tasks" if group == "ruler" else "passkey accuracy"
    axes[0][0].set_ylabel(f"{what} (%), 95% interval shaded")
    fig.suptitle(f"Quality against tokens attended ({report['model']}, {config['prompts']} prompts per task)")
    fig.tight_layout()
    return fig


def with_overrides(base: ReportConfig, **changes: Any) -> ReportConfig:
    """``base`` with the changes that are not None (a command's options over a preset)."""
    return replace(base, **{k: v for k, v in changes.items() if v is not None})
