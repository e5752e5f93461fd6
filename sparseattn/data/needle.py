"""Retrieval tasks generated offline: passkey retrieval and RULER's needle-in-a-haystack (NIAH).

Two task families, each a small dataclass whose ``sample()`` builds one prompt of a target token
length:

* :class:`PasskeyTask`, the passkey test in the Landmark Attention / LongLoRA format: a line
  ``The pass key is N. Remember it. N is the pass key.`` hidden at some depth in repeated filler
  ("The grass is green. The sky is blue. ..."), then ``What is the pass key? The pass key is``.
* :class:`NiahTask`, RULER's NIAH family (Hsieh et al., 2024, Sec. 3.1): needles
  ``One of the special magic numbers for {key} is: {value}.`` in a haystack of filler (``noise``),
  of a book (``prose``, given as ``haystack_text``) or of distractor needles (``needles``), with
  one or several keys, values and queried keys. :data:`RULER_NIAH` holds RULER's eight presets
  (RULER's Paul Graham essays are replaced by any prose text, e.g. a fetched book).

The haystack is a sequence of *units* (filler sentences, book sentences or distractor lines). A
sample with ``n`` units puts needle ``i`` after unit ``int(n * depth_i / 100)``, and ``sample()``
finds by bisection the largest ``n`` whose prompt fits the target, so the prompt has at most
``target_tokens - reserve_tokens`` tokens and one more unit would not fit. Tokens are counted by
a callable ``count_tokens(str) -> int`` or by any tokenizer with ``encode`` (an HF tokenizer counts
its special tokens, as the model sees them). Everything is deterministic given ``seed``.

Scoring follows RULER's ``scripts/eval/synthetic/constants.py``: :func:`string_match_all` (NIAH)
and :func:`string_match_part` (QA).

>>> words = lambda text: len(text.split())
>>> s = PasskeyTask().sample(300, words, seed=1, depths=50)
>>> s.num_tokens <= 300 < words(PasskeyTask().render(s.haystack_units + 1, words, seed=1, depths=50).prompt)
True
>>> s.prompt.endswith("What is the pass key? The pass key is"), s.needles[0] in s.prompt
(True, True)
>>> string_match_all([" " + s.answers[0] + "."], [s.answers])
100.0
"""

from __future__ import annotations

import random
import re
import uuid
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from functools import lru_cache
from importlib.resources import files
from typing import Any, Literal

from sparseattn.validation import check_int

#: RULER's "noise" haystack and Landmark/LongLoRA's passkey filler: five sentences, repeated.
NOISE = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
NOISE_SENTENCES = tuple(s + "." for s in NOISE.rstrip(".").split(". "))

PASSKEY_INSTRUCTION = (
    "There is an important info hidden inside a lot of irrelevant text. "
    "Find it and memorize them. I will quiz you about the important information there."
)
PASSKEY_NEEDLE = "The pass key is {key}. Remember it. {key} is the pass key."
PASSKEY_QUESTION = "What is the pass key?"
PASSKEY_ANSWER_PREFIX = " The pass key is"

#: RULER's needle; ``type_needle_v`` is the plural value type ("numbers", "words", "uuids").
NIAH_NEEDLE = "One of the special magic {type_needle_v} for {key} is: {value}."
#: RULER's NIAH template and answer prefix, plural form (several values asked for).
NIAH_HEAD = (
    "Some special magic {type_needle_v} are hidden within the following text. "
    "Make sure to memorize it. I will quiz you about the {type_needle_v} afterwards."
)
NIAH_QUESTION = "What are all the special magic {type_needle_v} for {query} mentioned in the provided text?"
NIAH_ANSWER_PREFIX = " The special magic {type_needle_v} for {query} mentioned in the provided text are"
#: The singular forms RULER derives when exactly one value is asked for (one key queried, one value).
NIAH_HEAD_ONE = (
    "A special magic {type_needle_v} is hidden within the following text. "
    "Make sure to memorize it. I will quiz you about the {type_needle_v} afterwards."
)
NIAH_QUESTION_ONE = "What is the special magic {type_needle_v} for {query} mentioned in the provided text?"
NIAH_ANSWER_PREFIX_ONE = " The special magic {type_needle_v} for {query} mentioned in the provided text is"

#: RULER's needle depths: 40 evenly spaced integer percentages from 0 to 100.
RULER_DEPTHS = tuple(round(i * 100 / 39) for i in range(40))

NeedleType = Literal["numbers", "words", "uuids"]
Haystack = Literal["noise", "prose", "needles"]
_NEEDLE_TYPES = ("numbers", "words", "uuids")
_HAYSTACKS = ("noise", "prose", "needles")


def token_counter(tokenizer: Callable[[str], int] | Any) -> Callable[[str], int]:
    """A ``count_tokens(text) -> int`` from a tokenizer.

    Args:
        tokenizer: an object with ``encode(text)`` returning a sequence (an HF tokenizer, whose
            count includes special tokens such as BOS, or a tiktoken encoding), or a callable
            returning the number of tokens directly.
    """
    encode = getattr(tokenizer, "encode", None)
    if callable(encode) and hasattr(tokenizer, "model_max_length"):
        # An HF tokenizer warns of "indexing errors" past its maximum length; fitting probes past it on purpose.
        return lambda text: len(encode(text, verbose=False))
    if callable(encode):
        return lambda text: len(encode(text))
    if not callable(tokenizer):
        raise TypeError(f"tokenizer must have encode() or be a callable str -> int, got {type(tokenizer).__name__}")

    def count(text: str) -> int:
        n = tokenizer(text)
        if isinstance(n, bool) or not isinstance(n, int):
            raise TypeError(f"count_tokens must return an int, got {type(n).__name__} ({n!r:.60})")
        return n

    return count


@dataclass(frozen=True)
class NeedleSample:
    """One generated prompt and what a correct answer contains.

    Attributes:
        task: the task's name (``passkey``, ``niah_single_1``, ...).
        prompt: the whole input, ending with ``answer_prefix`` so a model continues with the answer.
        answers: the strings a correct answer contains (score with :func:`string_match_all`).
        target_tokens: the requested length (``None`` when rendered at a fixed haystack size).
        num_tokens: the prompt's actual token count.
        depths: the depth, in percent of the haystack, of each needle, in order of appearance.
        needles: the inserted needle sentences, in order of appearance.
        queries: the keys asked about (empty for the passkey).
        answer_prefix: the prompt's tail after the question (for chat templates, split it off).
        context_span: ``prompt[start:end]`` is the haystack with the needles.
        haystack_units: the number of haystack units (sentences or lines) in the context.
        seed: the seed the sample was drawn with.
    """

    task: str
    prompt: str
    answers: list[str]
    target_tokens: int | None
    num_tokens: int
    depths: list[float]
    needles: list[str]
    queries: list[str]
    answer_prefix: str
    context_span: tuple[int, int]
    haystack_units: int
    seed: int

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class PromptParts:
    """A rendered prompt before its tokens are counted."""

    prompt: str
    answers: list[str]
    depths: list[float]
    needles: list[str]
    queries: list[str]
    answer_prefix: str
    context_span: tuple[int, int]


class RetrievalTask:
    """Shared work of the retrieval tasks: rendering at a haystack size, and fitting a target length.

    A subclass has a ``name`` and implements ``_parts(units, seed, depths, haystack_text)``, which
    must draw everything random from ``seed`` alone, so that only the haystack grows with ``units``.
    A task whose rules depend on the tokenizer or on the target length (RULER's one-shot example of
    ``vt``, the word frequencies of ``cwe`` below 4096 tokens) fixes them in :meth:`_resolved`; a task
    that can grow only so far (``cwe``, bounded by its word list) says how far in :attr:`max_units`.
    """

    name: str

    @property
    def num_needles(self) -> int:
        """Needles with a depth each: 1 (one depth asked for), more (spread as RULER does) or 0 (no depth)."""
        return 1

    @property
    def max_units(self) -> int | None:
        """The largest haystack the task can build (None: unbounded)."""
        return None

    def _resolved(self, count: Callable[[str], int], target_tokens: int | None) -> RetrievalTask:
        """The task with its tokenizer- or length-dependent settings fixed (this one when it has none)."""
        return self

    def _parts(self, units: int, seed: int, depths: list[float] | None, haystack_text: str | None) -> PromptParts:
        raise NotImplementedError

    def _check_inputs(self, depths: list[float] | None, haystack_text: str | None) -> None:
        raise NotImplementedError

    def render(
        self,
        haystack_units: int,
        tokenizer: Callable[[str], int] | Any,
        *,
        seed: int = 0,
        depths: float | Sequence[float] | None = None,
        haystack_text: str | None = None,
        target_tokens: int | None = None,
    ) -> NeedleSample:
        """The sample with exactly ``haystack_units`` haystack units (no length fitting).

        ``target_tokens`` is the length the sample is built for, for the tasks whose rules depend on
        it (``cwe``, ``fwe``); it is recorded, not fitted to.
        """
        check_int("", "haystack_units", haystack_units, 0)
        depth_list = _depth_list(depths)
        self._check_inputs(depth_list, haystack_text)
        count = token_counter(tokenizer)
        task = self._resolved(count, target_tokens)
        parts = task._parts(haystack_units, seed, depth_list, haystack_text)
        return self._sample(parts, count(parts.prompt), target_tokens, haystack_units, seed)

    def _sample(self, parts: PromptParts, num_tokens: int, target_tokens: int | None, units: int, seed: int) -> NeedleSample:
        return NeedleSample(
            task=self.name,
            num_tokens=num_tokens,
            target_tokens=target_tokens,
            haystack_units=units,
            seed=seed,
            **asdict(parts),
        )

    def sample(
        self,
        target_tokens: int,
        tokenizer: Callable[[str], int] | Any,
        *,
        seed: int = 0,
        depths: float | Sequence[float] | None = None,
        haystack_text: str | None = None,
        reserve_tokens: int = 0,
    ) -> NeedleSample:
        """The longest sample whose prompt has at most ``target_tokens - reserve_tokens`` tokens.

        Args:
            target_tokens: the length to fill, in tokens of ``tokenizer``.
            tokenizer: a callable ``count_tokens(str) -> int`` or an object with ``encode``.
            seed: draws the needles, their depths (unless given) and the queried keys.
            depths: needle depths in percent of the haystack (0: first, 100: last), one per
                needle; by default drawn from :data:`RULER_DEPTHS` (NIAH) or uniformly (passkey).
            haystack_text: the book to draw haystack sentences from (``haystack="prose"`` only);
                a text shorter than needed is cycled.
            reserve_tokens: tokens to leave free, e.g. for the answer (RULER reserves the
                generation length).
        """
        check_int("", "target_tokens", target_tokens, 1)
        if isinstance(reserve_tokens, bool) or not isinstance(reserve_tokens, int) or not 0 <= reserve_tokens < target_tokens:
            raise ValueError(f"reserve_tokens must be an int in [0, target_tokens={target_tokens}), got {reserve_tokens!r}")
        depth_list = _depth_list(depths)
        self._check_inputs(depth_list, haystack_text)
        count = token_counter(tokenizer)
        budget = target_tokens - reserve_tokens
        task = self._resolved(count, target_tokens)
        cap = task.max_units
        memo: dict[int, int] = {}

        def tokens(units: int) -> int:
            if cap is not None and units > cap:
                return budget + 1  # cannot be built, so it does not fit either
            if units not in memo:
                memo[units] = count(task._parts(units, seed, depth_list, haystack_text).prompt)
            return memo[units]

        if tokens(0) > budget:
            raise ValueError(
                f"{self.name}: target_tokens={target_tokens} (reserve_tokens={reserve_tokens}) leaves {budget} tokens, "
                f"but the prompt without any haystack already has {tokens(0)}"
            )
        units = fit_units(tokens, budget)
        if units == cap:  # the fit stopped at the largest haystack there is, not at the length asked for
            raise ValueError(
                f"{self.name}: target_tokens={target_tokens} needs more than the {cap} haystack units this task can "
                f"build (they make {tokens(cap)} tokens with reserve_tokens={reserve_tokens}); use a shorter length"
            )
        parts = task._parts(units, seed, depth_list, haystack_text)
        return self._sample(parts, tokens(units), target_tokens, units, seed)

    def samples(
        self,
        num_samples: int,
        target_tokens: int,
        tokenizer: Callable[[str], int] | Any,
        *,
        seed: int = 0,
        depths: float | Sequence[float] | None = None,
        haystack_text: str | None = None,
        reserve_tokens: int = 0,
    ) -> list[NeedleSample]:
        """``num_samples`` samples with seeds ``seed, seed + 1, ...`` (see :meth:`sample`)."""
        count = token_counter(tokenizer)
        kwargs = dict(depths=depths, haystack_text=haystack_text, reserve_tokens=reserve_tokens)
        return [self.sample(target_tokens, count, seed=seed + i, **kwargs) for i in range(num_samples)]


def fit_units(tokens: Callable[[int], int], budget: int, *, probe: int = 64) -> int:
    """The haystack size ``n`` with ``tokens(n) <= budget < tokens(n + 1)``, found by bisection.

    ``tokens(n)`` is the token count of the prompt with ``n`` units; ``tokens(0) <= budget`` is
    required. A linear estimate from ``tokens(0)`` and ``tokens(probe)`` brackets the answer
    tightly; galloping from it and bisecting the bracket keep the invariant *lo fits, hi does
    not*, so the guarantee holds even for a tokenizer whose count is not monotone in ``n``.
    """
    base, grown = tokens(0), tokens(probe)
    if grown <= base:
        raise ValueError(f"the token count did not grow with the haystack ({probe} units: {grown} tokens, 0 units: {base})")
    if grown > budget:
        lo, hi = 0, probe
    else:
        guess = probe + int((budget - grown) * probe / (grown - base))
        step = max(1, guess // 256)
        if tokens(guess) <= budget:
            lo = guess
            while tokens(lo + step) <= budget:
                lo, step = lo + step, step * 2
                if step > 1 << 40:
                    raise ValueError(f"the token count stopped growing with the haystack ({lo} units: {tokens(lo)} tokens)")
            hi = lo + step
        else:
            lo, hi = probe, guess
            while hi - step > lo:
                if tokens(hi - step) <= budget:
                    lo = hi - step
                    break
                hi, step = hi - step, step * 2
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if tokens(mid) <= budget:
            lo = mid
        else:
            hi = mid
    return lo


def _depth_list(depths: float | Sequence[float] | None) -> list[float] | None:
    if depths is None:
        return None
    values = [depths] if isinstance(depths, (int, float)) else list(depths)
    for d in values:
        if isinstance(d, bool) or not isinstance(d, (int, float)) or not 0 <= d <= 100:
            raise ValueError(f"depths must be percentages in [0, 100], got {depths!r}")
    return sorted(float(d) for d in values)


def _insert(units: list[str], needles: list[str], depths: list[float], sep: str) -> str:
    """``units`` joined by ``sep`` with needle ``i`` after unit ``int(len(units) * depths[i] / 100)``."""
    out: list[str] = []
    start = 0
    for needle, depth in zip(needles, depths):
        at = int(len(units) * depth / 100)
        out += units[start:at]
        out.append(needle)
        start = at
    out += units[start:]
    return sep.join(out)


# -- passkey ------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class PasskeyTask(RetrievalTask):
    """Passkey retrieval (Mohtashami & Jaggi, 2023; Chen et al., 2024, LongLoRA).

    The prompt is ``instruction / filler / needle / filler / question``, one per line; the filler
    is the five :data:`NOISE_SENTENCES` cycled, each part starting from the first sentence (as the
    reference implementation slices both from the same repeated string). The haystack unit is one
    sentence. The key is an integer in ``[1, max_key]``; the depth is uniform unless given.

    Args:
        max_key: the largest pass key (the reference draws from 1..50000).
        name: the task name recorded in samples.
    """

    max_key: int = 50000
    name: str = "passkey"

    def __post_init__(self) -> None:
        check_int("", "max_key", self.max_key, 1)

    def _check_inputs(self, depths: list[float] | None, haystack_text: str | None) -> None:
        if depths is not None and len(depths) != 1:
            raise ValueError(f"passkey has one needle, so one depth; got depths={depths}")
        if haystack_text is not None:
            raise ValueError("passkey always uses the filler haystack; haystack_text is for NiahTask(haystack='prose')")

    def _parts(self, units: int, seed: int, depths: list[float] | None, haystack_text: str | None) -> PromptParts:
        rng = random.Random(seed)
        key = str(rng.randint(1, self.max_key))
        depth = depths[0] if depths is not None else rng.uniform(0, 100)
        before = int(units * depth / 100)
        prefix = " ".join(NOISE_SENTENCES[i % len(NOISE_SENTENCES)] for i in range(before))
        suffix = " ".join(NOISE_SENTENCES[i % len(NOISE_SENTENCES)] for i in range(units - before))
        needle = PASSKEY_NEEDLE.format(key=key)
        context = "\n".join([prefix, needle, suffix])
        start = len(PASSKEY_INSTRUCTION) + 1
        prompt = "\n".join([PASSKEY_INSTRUCTION, context, PASSKEY_QUESTION + PASSKEY_ANSWER_PREFIX])
        return PromptParts(prompt, [key], [depth], [needle], [], PASSKEY_ANSWER_PREFIX, (start, start + len(context)))


# -- RULER NIAH -----------------------------------------------------------------------------------------


@lru_cache(maxsize=4)
def wonderwords_list(name: str) -> tuple[str, ...]:
    """One of wonderwords' word lists (``nounlist.txt``, ``adjectivelist.txt``, ``verblist.txt``), as stored."""
    try:
        assets = files("wonderwords") / "assets"
    except ModuleNotFoundError:
        raise ImportError("RULER's word tasks (NIAH 'words', cwe) need wonderwords: pip install wonderwords") from None
    return tuple(w.strip() for w in (assets / name).read_text(encoding="utf-8").splitlines() if w.strip())


def _word_lists() -> tuple[tuple[str, ...], tuple[str, ...]]:
    """wonderwords' adjective and noun lists, which RULER combines into ``adjective-noun`` keys."""
    return wonderwords_list("adjectivelist.txt"), wonderwords_list("nounlist.txt")


def _draw(rng: random.Random, kind: str) -> str:
    if kind == "numbers":
        return str(rng.randint(10**6, 10**7 - 1))  # RULER's 7-digit numbers
    if kind == "uuids":
        return str(uuid.UUID(int=rng.getrandbits(128), version=4))
    adjectives, nouns = _word_lists()
    return f"{rng.choice(adjectives)}-{rng.choice(nouns)}"


def _draw_unique(rng: random.Random, kind: str, count: int, taken: set[str]) -> list[str]:
    out = []
    while len(out) < count:
        item = _draw(rng, kind)
        if item not in taken:
            taken.add(item)
            out.append(item)
    return out


@lru_cache(maxsize=8)
def split_sentences(text: str) -> tuple[str, ...]:
    """Prose haystack units: whitespace collapsed (as RULER does), split after ``. ! ? ; :``.

    >>> split_sentences("The kettle's lid rattled,\\n  and the cat left; nobody moved. Then: rain!")
    ("The kettle's lid rattled, and the cat left;", 'nobody moved.', 'Then:', 'rain!')
    """
    flat = " ".join(text.split())
    return tuple(s for s in re.split(r"(?<=[.!?;:])\s+", flat) if s)


@dataclass(frozen=True)
class NiahTask(RetrievalTask):
    """A RULER needle-in-a-haystack task (Hsieh et al., 2024, "RULER", Sec. 3.1 and App. B).

    ``num_keys`` keys each get ``num_values`` needles ``One of the special magic {values} for
    {key} is: {value}.``; the needles are shuffled and inserted at sorted depths; the question
    asks for the values of ``num_queries`` of the keys, the other keys being distractors. Keys and
    values are distinct within a sample; ``words`` are ``adjective-noun`` pairs from wonderwords'
    lists, ``numbers`` have 7 digits, ``uuids`` are version-4 UUIDs.

    Args:
        name: the task name recorded in samples.
        haystack: ``noise`` (:data:`NOISE` lines), ``prose`` (sentences of ``haystack_text``) or
            ``needles`` (distractor needle lines, keys distinct from the real keys).
        key_type: ``words``, ``numbers`` or ``uuids``.
        value_type: ``numbers``, ``words`` or ``uuids``; also names the values in the prompt.
        num_keys: keys with needles (RULER's ``num_needle_k``).
        num_values: needles per key (``num_needle_v``).
        num_queries: keys asked about (``num_needle_q``), at most ``num_keys``.

    >>> words = lambda text: len(text.split())
    >>> s = RULER_NIAH["niah_multikey_1"].sample(500, words, haystack_text="A tale. " * 50, seed=3)
    >>> len(s.needles), len(s.queries), len(s.answers), s.num_tokens <= 500
    (4, 1, 1, True)
    """

    name: str = "niah_single_1"
    haystack: Haystack = "noise"
    key_type: NeedleType = "words"
    value_type: NeedleType = "numbers"
    num_keys: int = 1
    num_values: int = 1
    num_queries: int = 1

    def __post_init__(self) -> None:
        if self.haystack not in _HAYSTACKS:
            raise ValueError(f"haystack must be one of {_HAYSTACKS}, got {self.haystack!r}")
        for field in ("key_type", "value_type"):
            if getattr(self, field) not in _NEEDLE_TYPES:
                raise ValueError(f"{field} must be one of {_NEEDLE_TYPES}, got {getattr(self, field)!r}")
        for field in ("num_keys", "num_values", "num_queries"):
            check_int("", field, getattr(self, field), 1)
        if self.num_queries > self.num_keys:
            raise ValueError(f"num_queries={self.num_queries} exceeds num_keys={self.num_keys}: only keys with needles can be asked")

    @property
    def num_needles(self) -> int:
        """One needle per key and value."""
        return self.num_keys * self.num_values

    def _check_inputs(self, depths: list[float] | None, haystack_text: str | None) -> None:
        if depths is not None and len(depths) != self.num_needles:
            raise ValueError(f"{self.name} has {self.num_needles} needles, so needs as many depths; got depths={depths}")
        if self.haystack == "prose":
            if haystack_text is None or not split_sentences(haystack_text):
                raise ValueError(f"{self.name} has haystack='prose': pass the book as haystack_text (e.g. load_text('kjv-bible'))")
        elif haystack_text is not None:
            raise ValueError(f"{self.name} has haystack={self.haystack!r}; haystack_text is only used with haystack='prose'")

    def _parts(self, units: int, seed: int, depths: list[float] | None, haystack_text: str | None) -> PromptParts:
        rng = random.Random(seed)
        keys = _draw_unique(rng, self.key_type, self.num_keys, set())
        # one pool for keys and all values: no value repeats, so no answer can be read off a distractor
        taken = set(keys)
        values = [_draw_unique(rng, self.value_type, self.num_values, taken) for _ in keys]
        needles = [NIAH_NEEDLE.format(type_needle_v=self.value_type, key=k, value=v) for k, vs in zip(keys, values) for v in vs]
        rng.shuffle(needles)
        if depths is None:
            if len(needles) <= len(RULER_DEPTHS):
                depths = sorted(float(d) for d in rng.sample(RULER_DEPTHS, len(needles)))
            else:
                depths = sorted(float(d) for d in rng.choices(RULER_DEPTHS, k=len(needles)))
        asked = rng.sample(range(self.num_keys), self.num_queries)
        queries = [keys[i] for i in asked]
        answers = [v for i in asked for v in values[i]]
        haystack_seed = rng.getrandbits(64)

        if self.haystack == "prose":
            sentences = split_sentences(haystack_text)
            context = _insert([sentences[i % len(sentences)] for i in range(units)], needles, depths, " ")
        elif self.haystack == "noise":
            context = _insert([NOISE] * units, needles, depths, "\n")
        else:
            # line i is drawn after lines 0..i-1 only, so a longer haystack extends a shorter one
            hay_rng, used, lines = random.Random(haystack_seed), set(keys), []
            for _ in range(units):
                (key,) = _draw_unique(hay_rng, self.key_type, 1, used)
                lines.append(NIAH_NEEDLE.format(type_needle_v=self.value_type, key=key, value=_draw(hay_rng, self.value_type)))
            context = _insert(lines, needles, depths, "\n")

        one = self.num_queries * self.num_values == 1
        kind = self.value_type[:-1] if one else self.value_type
        query = queries[0] if len(queries) == 1 else ", ".join(queries[:-1]) + ", and " + queries[-1]
        head = (NIAH_HEAD_ONE if one else NIAH_HEAD).format(type_needle_v=kind)
        question = (NIAH_QUESTION_ONE if one else NIAH_QUESTION).format(type_needle_v=kind, query=query)
        answer_prefix = (NIAH_ANSWER_PREFIX_ONE if one else NIAH_ANSWER_PREFIX).format(type_needle_v=kind, query=query)
        start = len(head) + 1
        prompt = f"{head}\n{context}\n{question}{answer_prefix}"
        return PromptParts(prompt, answers, depths, needles, queries, answer_prefix, (start, start + len(context)))


#: RULER's eight NIAH tasks (``scripts/synthetic.yaml``), with ``prose`` where RULER uses essays.
RULER_NIAH: dict[str, NiahTask] = {
    t.name: t
    for t in (
        NiahTask("niah_single_1", "noise", "words", "numbers"),
        NiahTask("niah_single_2", "prose", "words", "numbers"),
        NiahTask("niah_single_3", "prose", "words", "uuids"),
        NiahTask("niah_multikey_1", "prose", "words", "numbers", num_keys=4),
        NiahTask("niah_multikey_2", "needles", "words", "numbers"),
        NiahTask("niah_multikey_3", "needles", "uuids", "uuids"),
        NiahTask("niah_multivalue", "prose", "words", "numbers", num_values=4),
        NiahTask("niah_multiquery", "prose", "words", "numbers", num_keys=4, num_queries=4),
    )
}


# -- scoring --------------------------------------------------------------------------------------------


def _check_scoring_inputs(preds: Sequence[str], refs: Sequence[Sequence[str]]) -> None:
    if isinstance(preds, str):
        raise TypeError("preds must be a sequence of predictions, got one str; wrap it in a list")
    if len(preds) == 0 or len(preds) != len(refs):
        raise ValueError(f"need one reference list per prediction and at least one of each; got {len(preds)} preds, {len(refs)} refs")
    for i, ref in enumerate(refs):
        if isinstance(ref, str):
            raise TypeError(f"refs[{i}] is the str {ref!r:.40}; each entry must be a list of reference strings")
        if len(ref) == 0:
            raise ValueError(f"refs[{i}] is empty; each prediction needs at least one reference string")


def string_match_all(preds: Sequence[str], refs: Sequence[Sequence[str]]) -> float:
    """RULER's NIAH metric: the share of each prediction's references it contains, averaged.

    A reference counts when it occurs in the prediction, case-insensitively. The result is in
    percent, rounded to 2 decimals, as RULER reports it.

    >>> string_match_all(["The numbers are 1234567 and 7654321."], [["1234567", "7654321", "1111111"]])
    66.67
    """
    _check_scoring_inputs(preds, refs)
    score = sum(sum(1.0 if r.lower() in p.lower() else 0.0 for r in ref) / len(ref) for p, ref in zip(preds, refs))
    return round(score / len(preds) * 100, 2)


def string_match_part(preds: Sequence[str], refs: Sequence[Sequence[str]]) -> float:
    """RULER's QA metric: 1 when a prediction contains any of its references, averaged, in percent.

    >>> string_match_part(["The numbers are 1234567 and 7654321."], [["1234567", "7654321", "1111111"]])
    100.0
    """
    _check_scoring_inputs(preds, refs)
    score = sum(max(1.0 if r.lower() in p.lower() else 0.0 for r in ref) for p, ref in zip(preds, refs))
    return round(score / len(preds) * 100, 2)


_CONTROL = re.compile(r"[\x00-\x1f]")


def clean_prediction(text: str) -> str:
    """RULER's post-processing of a generation before scoring: control characters become newlines.

    >>> clean_prediction("  1234567\\t\\x00 ")
    '1234567'
    """
    return _CONTROL.sub("\n", text.strip()).strip()
