"""RULER's other synthetic tasks, generated offline: variable tracking, common and frequent words.

RULER (Hsieh et al., 2024, "RULER: What's the Real Context Size of Your Long-Context Language
Models?", Sec. 3.2 and App. B) has 13 tasks. The eight needle tasks are :data:`RULER_NIAH`
(:mod:`sparseattn.data.needle`); this module adds the three others that need no data set, each a
small dataclass following the rules of RULER's generators (``scripts/data/synthetic/*.py``,
defaults from ``scripts/synthetic.yaml``) and their prompt templates word for word
(``scripts/data/synthetic/constants.py``):

* :class:`VariableTracking` (``vt``, multi-hop tracing): a chain ``VAR ABCDE = 12345``,
  ``VAR FGHIJ = VAR ABCDE``, ... (``num_hops=4``, so 5 variables) hidden at random lines of the
  noise haystack; the answer is every variable that holds the value. A one-shot example with
  3-letter variables, fitted to 500 tokens, comes first.
* :class:`CommonWords` (``cwe``, aggregation): a numbered list of words where ``num_cw=10`` common
  words appear ``freq_cw=30`` times each and every other word ``freq_ucw=3`` times (below 4096 tokens
  RULER uses 6 and 1); the answer is the 10 common words. One example list with its answer first.
* :class:`FrequentWords` (``fwe``, aggregation): coded 6-letter words whose counts follow a Zeta
  distribution (``alpha=2``): the word of rank ``k`` appears ``floor(N k^-alpha / zeta(alpha))``
  times; rank 1 is the noise word ``...``, ranks 2-4 are the answer.

All three are scored with RULER's :func:`~sparseattn.data.needle.string_match_all`. ``vt`` records
the depths of its chain (spread at random, as RULER places it); ``cwe`` and ``fwe`` have no depth:
the answer words are spread over the whole text (``num_needles == 0``). A sample is fitted to a
target length with the model's tokenizer by :func:`~sparseattn.data.needle.fit_units`, as the
needle tasks are; everything is deterministic given ``seed``.

RULER's two QA tasks (``qa_1``: SQuAD, ``qa_2``: HotpotQA) need those data sets, which cannot be
fetched here: :data:`RULER_QA` names them, and nothing generates them.

>>> words = lambda text: len(text.split())
>>> s = RULER_TASKS["vt"].sample(900, words, seed=2)
>>> len(s.answers), s.num_tokens <= 900, all(f"VAR {v} =" in s.prompt for v in s.answers)
(5, True, True)
"""

from __future__ import annotations

import itertools
import math
import random
import string
from collections.abc import Callable
from dataclasses import dataclass, replace
from functools import lru_cache
from typing import ClassVar

from sparseattn.data.needle import (
    NOISE,
    RULER_NIAH,
    RetrievalTask,
    PromptParts,
    fit_units,
    wonderwords_list,
)
from sparseattn.validation import check_int

#: RULER's variable-tracking template and answer prefix (``constants.py``, ``variable_tracking``).
VT_TEMPLATE = (
    "Memorize and track the chain(s) of variable assignment hidden in the following text.\n\n{context}\n"
    "Question: Find all variables that are assigned the value {query} in the text above."
)
VT_ANSWER_PREFIX = (
    " Answer: According to the chain(s) of variable assignment in the text above, {num_v} variables are assigned "
    "the value {query}, they are: "
)
#: RULER's common-words template and answer prefix (RULER writes the 10 literally; ``num_cw`` is 10 there).
CWE_TEMPLATE = (
    "Below is a numbered list of words. In these words, some appear more often than others. Memorize the ones that "
    "appear most often.\n{context}\nQuestion: What are the {num_cw} most common words in the above list?"
)
CWE_ANSWER_PREFIX = " Answer: The top {num_cw} words that appear most often in the list are:"
#: RULER's frequent-words template and answer prefix (its "dots '....'" are the noise word ``...``).
FWE_TEMPLATE = (
    "Read the following coded text and track the frequency of each coded word. Find the three most frequently "
    "appeared coded words. {context}\nQuestion: Do not provide any explanation. Please ignore the dots '....'. "
    "What are the three most frequently appeared words in the above coded text?"
)
FWE_ANSWER_PREFIX = " Answer: According to the coded text above, the three most frequently appeared words are:"

#: RULER's answer budget per task family (``tokens_to_generate``): reserved when fitting, and generated.
TOKENS_TO_GENERATE = {"niah": 128, "vt": 30, "cwe": 120, "fwe": 50}

#: RULER's QA tasks and the data set each needs (not available offline, so not generated).
RULER_QA = {"qa_1": "SQuAD", "qa_2": "HotpotQA"}


def _distinct(rng: random.Random, count: int, draw: Callable[[], str], taken: set[str]) -> list[str]:
    out: list[str] = []
    while len(out) < count:
        item = draw()
        if item not in taken:
            taken.add(item)
            out.append(item)
    return out


def _insert_chains(lines: list[str], chains: list[list[str]], rng: random.Random) -> tuple[list[str], list[float]]:
    """RULER's noise-haystack placement: each chain's statements go before distinct random lines, in order.

    A chain of ``k`` statements takes ``k`` distinct lines of the (growing) list, sorted, and statement
    ``j`` goes before the ``j``-th of them, so the chain reads in order and a noise line follows it.
    With fewer lines than statements (only in tiny prompts) lines are drawn with repetition.
    Returns the lines and each statement's depth (percent of the noise lines before it), in order of appearance.
    """
    noise = len(lines)
    out = list(lines)
    for chain in chains:
        n = len(out)
        slots = sorted(rng.sample(range(n), len(chain))) if n >= len(chain) else sorted(rng.choices(range(n + 1), k=len(chain)))
        for j, (slot, statement) in enumerate(zip(slots, chain)):
            out.insert(slot + j, statement)
    statements = {s for chain in chains for s in chain}
    depths, before = [], 0
    for line in out:
        if line in statements:
            depths.append(100.0 * before / noise if noise else 0.0)
        else:
            before += 1
    return out, depths


class _SelfContained(RetrievalTask):
    """A task that places its needles and builds its whole text itself, so it takes neither ``depths`` nor
    ``haystack_text``; ``refusals`` say why, as templates of ``{name}`` (and ``{depths}``)."""

    refusals: ClassVar[tuple[str, str]]

    def _check_inputs(self, depths: list[float] | None, haystack_text: str | None) -> None:
        no_depths, no_haystack_text = self.refusals
        if depths is not None:
            raise ValueError(no_depths.format(name=self.name, depths=depths))
        if haystack_text is not None:
            raise ValueError(no_haystack_text.format(name=self.name))


@dataclass(frozen=True)
class VariableTracking(_SelfContained):
    """RULER's variable tracking (``vt``): find every variable a chain of assignments gives one value.

    Each of ``num_chains`` chains is ``VAR X0 = v`` (``v`` a 5-digit number) followed by
    ``num_hops`` assignments ``VAR Xj = VAR Xj-1 `` (RULER's trailing space kept); variables are 5
    distinct upper-case letters. The statements are inserted before random lines of the noise
    haystack (:data:`~sparseattn.data.needle.NOISE`, one line per unit, RULER's ``type_haystack:
    noise``), each chain in order; the question gives the first chain's value, the answer is its
    ``num_hops + 1`` variables. Like RULER, a one-shot example comes first: a chain of 3-letter
    variables in noise fitted to at most ``example_tokens`` tokens, with its answer.

    Args:
        name: the task name recorded in samples.
        num_chains: chains inserted (RULER: 1); only the first is asked about.
        num_hops: assignments after the value in each chain (RULER: 4).
        example_tokens: the one-shot example's length limit (RULER: 500); 0 leaves the example out.
        example_lines: the example's noise lines; None fits them to ``example_tokens`` with the
            tokenizer (RULER fits one example, then redraws its variables and value per sample).

    >>> words = lambda text: len(text.split())
    >>> s = VariableTracking(example_tokens=0).render(20, words, seed=0)
    >>> [line for line in s.prompt.splitlines() if line.startswith("VAR")] == s.needles
    True
    """

    name: str = "vt"
    num_chains: int = 1
    num_hops: int = 4
    example_tokens: int = 500
    example_lines: int | None = None

    def __post_init__(self) -> None:
        check_int("", "num_chains", self.num_chains, 1)
        check_int("", "num_hops", self.num_hops, 1)
        check_int("", "example_tokens", self.example_tokens, 0)
        if self.example_lines is not None:
            check_int("", "example_lines", self.example_lines, 0)

    @property
    def num_needles(self) -> int:
        """Every assignment is a needle; RULER spreads them at random (no depth is asked for)."""
        return self.num_chains * (self.num_hops + 1)

    refusals = (
        "{name} places its chain at random lines as RULER does; it takes no depths, got {depths}",
        "{name} always uses the noise haystack; haystack_text is for NIAH tasks with prose",
    )

    def _resolved(self, count: Callable[[str], int], target_tokens: int | None) -> VariableTracking:
        if self.example_lines is not None or self.example_tokens == 0:
            return self
        # RULER fits its one example once (seed 0 here), then redraws variables and value per sample.
        hops = min(10, self.num_hops)
        reference = random.Random(0)
        variables = _distinct(reference, hops + 1, lambda: "".join(reference.choices(string.ascii_uppercase, k=3)), {"VAR"})

        def tokens(lines: int) -> int:
            return count(self._example(lines, variables, "12345", random.Random(1))[0])

        if tokens(0) > self.example_tokens:
            raise ValueError(f"{self.name}: the one-shot example has {tokens(0)} tokens without noise, more than "
                             f"example_tokens={self.example_tokens}")
        return replace(self, example_lines=fit_units(tokens, self.example_tokens, probe=8))

    def _example(self, lines: int, variables: list[str], value: str, rng: random.Random) -> tuple[str, list[str]]:
        """RULER's in-context example: the task's template and answer prefix, then the answer."""
        chain = [f"VAR {variables[0]} = {value}"] + [f"VAR {b} = VAR {a} " for a, b in itertools.pairwise(variables)]
        context, _ = _insert_chains([NOISE] * lines, [chain], rng)
        query = {"query": value, "num_v": len(variables)}
        prompt = VT_TEMPLATE.format(context="\n".join(context), **query) + VT_ANSWER_PREFIX.format(**query)
        return prompt, variables

    def _parts(self, units: int, seed: int, depths: list[float] | None, haystack_text: str | None) -> PromptParts:
        rng = random.Random(seed)
        taken = {"VAR"}
        upper = lambda k: lambda: "".join(rng.choices(string.ascii_uppercase, k=k))
        values = _distinct(rng, self.num_chains, lambda: str(rng.randint(10000, 99998)), set())
        chains, answer = [], []
        for value in values:
            variables = _distinct(rng, self.num_hops + 1, upper(5), taken)
            answer = answer or variables
            chains.append([f"VAR {variables[0]} = {value}"] + [f"VAR {b} = VAR {a} " for a, b in itertools.pairwise(variables)])
        head = ""
        if self.example_tokens and self.example_lines is not None:
            hops = min(10, self.num_hops)
            example_vars = _distinct(rng, hops + 1, upper(3), set(taken))
            example_value = _distinct(rng, 1, lambda: str(rng.randint(10000, 99998)), set(values))[0]
            text, shown = self._example(self.example_lines, example_vars, example_value, random.Random(rng.getrandbits(64)))
            head = text + " " + " ".join(shown) + "\n" + "\n"  # RULER: example, " ", answer, "\n"; then "\n" + the task
        # The lines depend on the haystack size: they come last, from a generator of their own.
        lines, chain_depths = _insert_chains([NOISE] * units, chains, random.Random(rng.getrandbits(64)))
        context = "\n".join(lines)
        query = {"query": values[0], "num_v": self.num_hops + 1}
        answer_prefix = VT_ANSWER_PREFIX.format(**query)
        prompt = head + VT_TEMPLATE.format(context=context, **query) + answer_prefix
        start = len(head) + VT_TEMPLATE.index("{context}")
        needles = [line for line in lines if line.startswith("VAR ")]
        return PromptParts(prompt, answer, chain_depths, needles, [values[0]], answer_prefix, (start, start + len(context)))


@lru_cache(maxsize=1)
def common_words() -> tuple[str, ...]:
    """RULER's cwe vocabulary: wonderwords' nouns, adjectives and verbs, sorted and deduplicated.

    The few entries that are not one plain word (``ice cream``, ``x-ray``) are left out, so a word
    can be counted in the list by plain matching.
    """
    pooled = {w for name in ("nounlist.txt", "adjectivelist.txt", "verblist.txt") for w in wonderwords_list(name)}
    return tuple(sorted(w for w in pooled if w.isalpha()))


@dataclass(frozen=True)
class CommonWords(_SelfContained):
    """RULER's common-word extraction (``cwe``): the ``num_cw`` words that appear most often in a list.

    The list is ``1. w 2. w ...`` over ``num_cw`` common words repeated ``freq_cw`` times each and
    uncommon words (the haystack units) repeated ``freq_ucw`` times each, shuffled. Before it come
    ``num_fewshot`` example lists of ``example_words`` words (the first ``num_cw`` repeated
    ``example_freq_cw`` times, the rest ``example_freq_ucw``) with their answer. Below
    ``short_below`` target tokens RULER switches to ``freq_cw, freq_ucw = 6, 1`` and a 20-word example
    (3 and 1 repetitions); :meth:`sample` applies that rule (``short_below=0`` turns it off). Words come
    from :func:`common_words`; a sample draws its common, uncommon and example words without overlap
    (RULER draws its example independently). RULER switches to a larger word list (not available
    offline) past its vocabulary; here such a length is refused.

    >>> words = lambda text: len(text.split())
    >>> s = CommonWords().sample(3000, words, seed=0)   # below 4096: the common words appear 6 times
    >>> context = s.prompt[slice(*s.context_span)].split()
    >>> sorted({context.count(w) for w in s.answers})
    [6]
    """

    name: str = "cwe"
    num_cw: int = 10
    freq_cw: int = 30
    freq_ucw: int = 3
    num_fewshot: int = 1
    example_words: int = 40
    example_freq_cw: int = 10
    example_freq_ucw: int = 3
    short_below: int = 4096

    def __post_init__(self) -> None:
        for field in ("num_cw", "freq_cw", "freq_ucw", "example_freq_cw", "example_freq_ucw"):
            check_int("", field, getattr(self, field), 1)
        check_int("", "num_fewshot", self.num_fewshot, 0)
        check_int("", "short_below", self.short_below, 0)
        check_int("", "example_words", self.example_words, self.num_cw)
        if self.freq_cw <= self.freq_ucw:
            raise ValueError(f"freq_cw={self.freq_cw} must exceed freq_ucw={self.freq_ucw}: the common words must be the most common")

    @property
    def num_needles(self) -> int:
        """No depth: the common words are spread over the whole list."""
        return 0

    @property
    def max_units(self) -> int:
        """Uncommon words available after the common and the example words."""
        return len(common_words()) - self.num_cw - self.num_fewshot * self.example_words

    refusals = (
        "{name} has no needle depth (the common words are everywhere); got depths={depths}",
        "{name} builds its own word list; it takes no haystack_text",
    )

    def _resolved(self, count: Callable[[str], int], target_tokens: int | None) -> CommonWords:
        if target_tokens is None or target_tokens >= self.short_below:
            return self
        return replace(self, freq_cw=6, freq_ucw=1, example_words=20, example_freq_cw=3, example_freq_ucw=1, short_below=0)

    def _parts(self, units: int, seed: int, depths: list[float] | None, haystack_text: str | None) -> PromptParts:
        if units > self.max_units:
            raise ValueError(f"{self.name}: {units} uncommon words asked for, the word list has {self.max_units} left")
        rng = random.Random(seed)
        words = list(common_words())
        rng.shuffle(words)
        common, rest = words[: self.num_cw], words[self.num_cw :]
        examples = []
        for i in range(self.num_fewshot):
            drawn = rest[i * self.example_words : (i + 1) * self.example_words]
            listed = drawn[: self.num_cw] * self.example_freq_cw + drawn[self.num_cw :] * self.example_freq_ucw
            rng.shuffle(listed)
            examples.append((_numbered(listed), drawn[: self.num_cw]))
        uncommon = rest[self.num_fewshot * self.example_words :][:units]
        listed = common * self.freq_cw + uncommon * self.freq_ucw
        random.Random(rng.getrandbits(64)).shuffle(listed)  # its order depends on the size: its own generator
        answer_prefix = CWE_ANSWER_PREFIX.format(num_cw=self.num_cw)
        shots = [CWE_TEMPLATE.format(num_cw=self.num_cw, context=c) + answer_prefix + " " + _numbered(a) for c, a in examples]
        head = "".join(shot + "\n" for shot in shots)
        context = _numbered(listed)
        prompt = head + CWE_TEMPLATE.format(num_cw=self.num_cw, context=context) + answer_prefix
        start = len(head) + CWE_TEMPLATE.index("{context}")
        return PromptParts(prompt, common, [], [], [], answer_prefix, (start, start + len(context)))


def _numbered(words: list[str]) -> str:
    """RULER's list format: ``1. apple 2. pear 3. apple``."""
    return " ".join(f"{i + 1}. {w}" for i, w in enumerate(words))


def zeta(s: float) -> float:
    """The Riemann zeta function for real ``s > 1``: 31 terms, then the Euler-Maclaurin remainder.

    >>> abs(zeta(2.0) - 1.6449340668482264) < 1e-14   # pi^2 / 6
    True
    """
    if not s > 1:
        raise ValueError(f"zeta(s) converges for s > 1 only, got s={s}")
    n = 32
    total = sum(k**-s for k in range(1, n)) + n ** (1 - s) / (s - 1) + n**-s / 2
    # B_2j / (2j)! * s (s + 1) ... (s + 2j - 2) * n^(-s - 2j + 1), Bernoulli numbers B_2 .. B_8.
    rising = s
    for j, bernoulli in enumerate((1 / 6, -1 / 30, 1 / 42, -1 / 30), start=1):
        total += bernoulli / math.factorial(2 * j) * rising * n ** (-s - 2 * j + 1)
        rising *= (s + 2 * j - 1) * (s + 2 * j)
    return total


@dataclass(frozen=True)
class FrequentWords(_SelfContained):
    """RULER's frequent-word extraction (``fwe``): the three most frequent coded words of a text.

    A vocabulary of ``vocab_size`` distinct random lower-case words of ``coded_wordlen`` letters is
    shuffled and its first word replaced by the noise word ``...``; with ``N`` the haystack units, the
    word of rank ``k`` appears ``floor(N k^-alpha / zeta(alpha))`` times (a Zeta distribution), all
    shuffled into one line. The answer is ranks 2 to 4 (rank 1 is the noise). ``vocab_size=None``
    is RULER's rule, (target tokens - reserved tokens) // 50, applied by :meth:`sample` (2000, the
    default of RULER's generator, when rendering without a target); only the words of rank up to
    ``sqrt(N / zeta(alpha))`` occur, so it changes which words are drawn, not how the text looks.

    >>> s = FrequentWords().render(400, lambda text: len(text.split()), seed=0)
    >>> context = s.prompt[slice(*s.context_span)].split()
    >>> [context.count(w) for w in ["..."] + s.answers]   # 400 / zeta(2) / k^2 for k = 1..4
    [243, 60, 27, 15]
    """

    name: str = "fwe"
    alpha: float = 2.0
    coded_wordlen: int = 6
    vocab_size: int | None = None

    def __post_init__(self) -> None:
        if isinstance(self.alpha, bool) or not isinstance(self.alpha, (int, float)) or not self.alpha > 1:
            raise ValueError(f"alpha must be a number > 1 (the Zeta distribution needs it), got {self.alpha!r}")
        check_int("", "coded_wordlen", self.coded_wordlen, 1)
        if self.vocab_size is not None:
            check_int("", "vocab_size", self.vocab_size, 4)

    @property
    def num_needles(self) -> int:
        """No depth: the frequent words are spread over the whole text."""
        return 0

    refusals = (
        "{name} has no needle depth (the frequent words are everywhere); got depths={depths}",
        "{name} builds its own coded text; it takes no haystack_text",
    )

    def sample(self, target_tokens: int, tokenizer, *, reserve_tokens: int = 0, **kwargs):
        if self.vocab_size is None and isinstance(target_tokens, int) and isinstance(reserve_tokens, int):
            vocab = max(4, (target_tokens - reserve_tokens) // 50)
            return replace(self, vocab_size=vocab).sample(target_tokens, tokenizer, reserve_tokens=reserve_tokens, **kwargs)
        return super().sample(target_tokens, tokenizer, reserve_tokens=reserve_tokens, **kwargs)

    sample.__doc__ = RetrievalTask.sample.__doc__

    def counts(self, units: int) -> list[int]:
        """Occurrences of the words of rank 1, 2, ... in a text of ``units`` (RULER's ``num_words``)."""
        scale = units / zeta(self.alpha)
        return [int(scale * k**-self.alpha) for k in range(1, (self.vocab_size or 2000) + 1)]

    def _parts(self, units: int, seed: int, depths: list[float] | None, haystack_text: str | None) -> PromptParts:
        rng = random.Random(seed)
        size = self.vocab_size or 2000
        coded = lambda: "".join(rng.choices(string.ascii_lowercase, k=self.coded_wordlen))
        vocab = sorted(_distinct(rng, size, coded, set()))
        rng.shuffle(vocab)
        vocab[0] = "..."  # RULER: the top rank is noise
        text = [w for w, n in zip(vocab, self.counts(units)) for _ in range(n)]
        random.Random(rng.getrandbits(64)).shuffle(text)
        context = " ".join(text)
        prompt = FWE_TEMPLATE.format(context=context) + FWE_ANSWER_PREFIX
        start = FWE_TEMPLATE.index("{context}")
        return PromptParts(prompt, vocab[1:4], [], [], [], FWE_ANSWER_PREFIX, (start, start + len(context)))


#: RULER's 11 offline synthetic tasks, in its order (``scripts/synthetic.yaml``; the QA tasks are not here).
RULER_TASKS: dict[str, RetrievalTask] = {
    **RULER_NIAH,
    "vt": VariableTracking(),
    "cwe": CommonWords(),
    "fwe": FrequentWords(),
}


def tokens_to_generate(task: str) -> int:
    """RULER's answer budget for a task of :data:`RULER_TASKS` (128 for every NIAH task).

    >>> tokens_to_generate("niah_multikey_2"), tokens_to_generate("cwe")
    (128, 120)
    """
    if task not in RULER_TASKS:
        raise ValueError(f"unknown RULER task {task!r}; known: {', '.join(RULER_TASKS)}")
    return TOKENS_TO_GENERATE.get(task, TOKENS_TO_GENERATE["niah"])
