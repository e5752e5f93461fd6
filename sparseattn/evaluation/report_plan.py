"""The quality report's plan: budgets as fractions of the context, its cells, the configuration (and ``--quick``'s),
the prompts and texts of each part, and where each cell's run directory is (:mod:`sparseattn.evaluation.report`)."""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from fractions import Fraction
from pathlib import Path
from typing import Any

import torch

from sparseattn import registry
from sparseattn.data.needle import PasskeyTask
from sparseattn.data.ruler import RULER_TASKS, tokens_to_generate
from sparseattn.evaluation.intervals import RESAMPLES
from sparseattn.evaluation.runs import RunDir


#: The methods a report compares by default: dense, the baselines, Radar and this toolkit's radar+ family,
#: and the pooled exact-token oracle (the ceiling-relative gap's reference).
DEFAULT_METHODS = ("dense", "streamingllm", "snapkv", "quest", "radar", "radar+", "radar+adaptive", "oracle-tokens:split=pooled")
#: Budgets: fractions of the context, and each method's own default.
DEFAULT_BUDGETS = ("1/16", "1/8", "1/4", "default")
#: The retrieval parts' budgets by default: the targets' budget only (a retrieval cell costs a decoded answer per
#: prompt; a perplexity cell's steps run the texts as one batch).
DEFAULT_RETRIEVAL_BUDGETS = ("1/8",)
#: The engines a report knows: transformers (every method) and vLLM's paged engine (the methods it runs).
ENGINES = ("transformers", "vllm")
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
        engine: ``transformers`` or ``vllm`` (the plugin's paged engine).
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
    """Every cell of ``methods`` x ``budgets`` at ``context`` (a method without a budget: one cell) that ``engine``
    serves; ValueError (the registry's message) where a spec, or a spec at a budget, is refused.

    vLLM's panel holds the methods its paged engine runs in its fused step, what a server runs: not those the
    engine refuses (SnapKV, H2O) nor those on its generic torch path (the as-run Radar, the exact-token oracles),
    a reference for its tests whose memory grows with the batch (the as-run Radar's took 23 GB for four
    4k-token prompts, 2026-11-28).
    """
    cells: dict[str, Cell] = {}
    for spec in methods:
        if not serves(engine, spec):
            continue
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


def serves(engine: str, spec: str) -> bool:
    """Whether ``engine``'s panel holds the method ``spec`` (:func:`plan_cells`)."""
    parsed = registry.parse(spec)
    if engine not in registry.get(parsed.name).engines:
        return False
    if engine == "vllm":
        from sparseattn.vllm.route import generic_refusal

        return generic_refusal(parsed.method, parsed.label) is None
    return True


@dataclass(frozen=True)
class ReportConfig:
    """What a report measures (the full run's sizes by default, about an hour on 2 CPU cores; :data:`QUICK` is
    the first look; :data:`WIDE` the grid for a bigger machine).

    Attributes:
        methods: method specs (``NAME[:key=value,...]``, ``sparseattn methods``).
        budgets: ``1/N`` fractions of the context and/or ``default`` (the perplexity cells').
        retrieval_budgets: the retrieval cells' budgets (None: ``budgets``).
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
        engines: the engines run (``transformers``, ``vllm``: a panel each).
    """

    methods: tuple[str, ...] = DEFAULT_METHODS
    budgets: tuple[str, ...] = DEFAULT_BUDGETS
    retrieval_budgets: tuple[str, ...] | None = DEFAULT_RETRIEVAL_BUDGETS
    contexts: tuple[int, ...] = (4096,)
    tasks: tuple[str, ...] = tuple(RULER_TASKS)
    prompts: int = 4
    passkey_depths: tuple[float, ...] = PASSKEY_DEPTHS
    passkey_prompts: int = 1
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
        need(self.retrieval_budgets is None or bool(self.retrieval_budgets), "retrieval_budgets", self.retrieval_budgets,
             "None (the budgets) or at least one of 1/N and default")  # fmt: skip
        for budget in self.retrieval_budgets or ():
            need(parse_budget(budget) == budget, "retrieval_budgets", budget, "canonical labels (parse_budget)")
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
    def retrieval(self) -> tuple[str, ...]:
        """The retrieval cells' budgets: :attr:`retrieval_budgets`, or :attr:`budgets` where that is None."""
        return self.retrieval_budgets or self.budgets

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
    methods=("dense", "streamingllm", "radar+adaptive"), budgets=("1/8",), retrieval_budgets=None, contexts=(2048,),
    tasks=("niah_single_1", "niah_multikey_1"), prompts=4, passkey_depths=(10.0, 50.0, 90.0), passkey_prompts=1,
    ppl_steps=16, ppl_context=1024, answer_tokens=12,
)  # fmt: skip

#: The issue's whole grid, for a machine bigger than 2 CPU cores (``sparseattn report --wide``): every budget in
#: every part, 25 prompts per RULER task and passkey 10 depths x 5 at 4096 and 8192 tokens, 512 perplexity steps.
WIDE = ReportConfig(retrieval_budgets=None, contexts=(4096, 8192), prompts=25, passkey_prompts=5, ppl_steps=512)


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
            cells = plan_cells(config.methods, config.retrieval, context, engine)
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



def record_key(record: dict[str, Any]) -> tuple:
    """A retrieval record's key among a part's planned samples: (length, depth, seed)."""
    return record["length"], record["depth"], record["seed"]



def with_overrides(base: ReportConfig, **changes: Any) -> ReportConfig:
    """``base`` with the changes that are not None (a command's options over a preset)."""
    return replace(base, **{k: v for k, v in changes.items() if v is not None})


def part_pending(plan: Plan, part: Part) -> bool:
    """Whether some cell of a retrieval part has not recorded every planned prompt."""
    planned = {key for key, _ in part.samples}
    return any(not planned <= {record_key(r) for r in run.records("samples.jsonl")} for _, run in part_runs(plan, part).values())
