"""Percentile bootstrap intervals for a quality report's cells, for its means over tasks, and for differences.

A report's cell holds one score per prompt (RULER's ``string_match_all``, 0 to 100); its number is
the mean over the prompts. How far that mean could move with other prompts of the same task is
estimated by the percentile bootstrap (Efron & Tibshirani, *An Introduction to the Bootstrap*, 1993,
ch. 13): draw the prompts ``B`` times with replacement, take each draw's mean, and report the
``(1 - level) / 2`` and ``(1 + level) / 2`` quantiles of those ``B`` means. Everything is float64 and
seeded (a :class:`numpy.random.Generator` per call), so a report's intervals are the same on every rerun.

* :func:`bootstrap_mean`: one cell (one task's prompts).
* :func:`stratified_bootstrap_mean`: the mean over tasks (RULER's headline: every task weighs the same),
  the prompts drawn again *within* each task, so every draw keeps each task's number of prompts.
* :func:`compare`: a method's cell against a reference's (dense's): whether its mean lies inside the
  reference's interval, and an interval for the difference of the means, *paired* (the same prompt
  indices drawn for both, which cancels what the prompts share) when both saw the same prompts.

What an interval says: with ``n`` prompts, the spread of the task's mean score over other draws of
``n`` prompts from the same generator, for this model and method. One prompt gives an interval of
zero width (the bootstrap sees no spread); so do prompts that all score the same.

>>> interval = bootstrap_mean([100.0, 0.0, 100.0, 100.0], resamples=2000, seed=0)
>>> interval.mean, interval.low <= interval.mean <= interval.high, interval.n
(75.0, True, 4)
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

#: Resamples drawn by default: the quantile's Monte Carlo error at 2.5% is then about 1.2% of the
#: interval's width for a normal mean (``sqrt(q (1 - q) / B) / phi(z_q)`` standard errors).
RESAMPLES = 10_000
#: The interval's coverage.
LEVEL = 0.95


@dataclass(frozen=True)
class Interval:
    """A mean with its percentile bootstrap interval.

    Attributes:
        mean: the mean of the data (not of the resamples).
        low, high: the ``(1 - level) / 2`` and ``(1 + level) / 2`` quantiles of the resampled means.
        n: the prompts it was computed from (summed over the tasks for a stratified mean).
        level: the coverage asked for (0.95).
        resamples: ``B``.
    """

    mean: float
    low: float
    high: float
    n: int
    level: float = LEVEL
    resamples: int = RESAMPLES

    def __contains__(self, value: float) -> bool:
        return self.low <= value <= self.high

    @property
    def width(self) -> float:
        return self.high - self.low

    def to_dict(self) -> dict[str, float | int]:
        return {"mean": self.mean, "low": self.low, "high": self.high, "n": self.n, "level": self.level,
                "resamples": self.resamples}  # fmt: skip


def _check(resamples: int, level: float) -> None:
    if isinstance(resamples, bool) or not isinstance(resamples, int) or resamples < 1:
        raise ValueError(f"resamples must be an int >= 1, got {resamples!r}")
    if not 0.0 < level < 1.0:
        raise ValueError(f"level must be in (0, 1), got {level!r}")


def _scores(values: Iterable[float], what: str) -> np.ndarray:
    """``values`` as a float64 vector ``[n]``, refused when empty or not finite."""
    x = np.asarray(list(values), dtype=np.float64).reshape(-1)
    if x.size == 0:
        raise ValueError(f"{what}: no scores to bootstrap")
    if not np.all(np.isfinite(x)):
        raise ValueError(f"{what}: scores must be finite, got {x[~np.isfinite(x)][:3].tolist()}")
    return x


def _resampled_means(x: np.ndarray, rng: np.random.Generator, resamples: int) -> np.ndarray:
    """``[B]`` means of ``x: [n]`` drawn with replacement (one row of ``n`` indices per resample)."""
    index = rng.integers(0, x.size, size=(resamples, x.size))  # [B, n]
    return x[index].mean(axis=1)


def _interval(mean: float, means: np.ndarray, n: int, level: float) -> Interval:
    low, high = np.quantile(means, [(1 - level) / 2, (1 + level) / 2])
    # A constant sample's resampled means equal its mean up to float rounding: keep mean in [low, high].
    return Interval(float(mean), float(min(low, mean)), float(max(high, mean)), n, level, int(means.size))


def bootstrap_mean(
    scores: Sequence[float], *, resamples: int = RESAMPLES, level: float = LEVEL, seed: int = 0
) -> Interval:
    """The mean of ``scores: [n]`` and its percentile bootstrap interval (``resamples`` draws of ``n``, seeded).

    >>> bootstrap_mean([3.0]).width, bootstrap_mean([1.0, 1.0, 1.0]).width
    (0.0, 0.0)
    """
    _check(resamples, level)
    x = _scores(scores, "bootstrap_mean")
    means = _resampled_means(x, np.random.default_rng(seed), resamples)
    return _interval(x.mean(), means, x.size, level)


def _strata(strata: Mapping[str, Sequence[float]], what: str) -> dict[str, np.ndarray]:
    if not strata:
        raise ValueError(f"{what}: no tasks to average")
    return {name: _scores(values, f"{what}, task {name!r}") for name, values in strata.items()}


def stratified_bootstrap_mean(
    strata: Mapping[str, Sequence[float]], *, resamples: int = RESAMPLES, level: float = LEVEL, seed: int = 0
) -> Interval:
    """The mean over tasks of each task's mean score, and its stratified percentile bootstrap interval.

    ``strata`` maps a task to its prompts' scores. Each resample draws every task's prompts with
    replacement within that task (``n_task`` of them) and averages the task means with equal weights,
    as RULER's headline averages its tasks; the interval is the quantiles of those ``B`` averages.

    >>> stratified_bootstrap_mean({"a": [100.0, 100.0], "b": [0.0, 0.0]}).to_dict()["mean"]
    50.0
    """
    _check(resamples, level)
    xs = _strata(strata, "stratified_bootstrap_mean")
    rng = np.random.default_rng(seed)
    means = np.mean([_resampled_means(x, rng, resamples) for x in xs.values()], axis=0)  # [B]
    point = float(np.mean([x.mean() for x in xs.values()]))
    return _interval(point, means, sum(x.size for x in xs.values()), level)


@dataclass(frozen=True)
class Comparison:
    """A method's mean against a reference's: the verdict a report prints beside a cell.

    Attributes:
        method, reference: each one's mean and interval.
        difference: the interval of ``method - reference`` (paired when ``paired``).
        paired: True when both saw the same prompts, so the difference was resampled over shared prompts.
    """

    method: Interval
    reference: Interval
    difference: Interval
    paired: bool

    @property
    def within_reference(self) -> bool:
        """Whether the method's mean lies inside the reference's interval (the report's "within dense")."""
        return self.method.mean in self.reference

    @property
    def worse(self) -> bool:
        """Whether the difference's whole interval is below 0: the method is worse beyond the prompts' noise."""
        return self.difference.high < 0.0

    @property
    def verdict(self) -> str:
        """``within`` (inside the reference's interval), ``worse`` (the difference's interval below 0), or
        ``outside`` (outside the reference's interval, the difference's interval not below 0)."""
        if self.within_reference:
            return "within"
        return "worse" if self.worse else "outside"

    def to_dict(self) -> dict[str, object]:
        return {"method": self.method.to_dict(), "reference": self.reference.to_dict(),
                "difference": self.difference.to_dict(), "paired": self.paired, "within_reference": self.within_reference,
                "verdict": self.verdict}  # fmt: skip


Keyed = Mapping[str, Mapping[object, float]]


def compare(
    method: Keyed, reference: Keyed, *, resamples: int = RESAMPLES, level: float = LEVEL, seed: int = 0
) -> Comparison:
    """A method's scores against a reference's, over the same tasks: means, intervals and their difference.

    ``method`` and ``reference`` map a task to ``{prompt key: score}`` (the key names the prompt, e.g.
    ``(length, depth, seed)``); one task is one cell, several a mean over tasks (stratified). Both must
    hold the same tasks. When every task has the same prompt keys on both sides the comparison is
    *paired*: each resample draws prompt indices once per task and takes both methods' scores of those
    prompts, so the difference's interval is that of the mean per-prompt difference. Otherwise each
    side is resampled on its own (independent draws from one generator) and the difference interval is
    the quantiles of the differences of the resampled means. The reference's interval is the one
    :func:`stratified_bootstrap_mean` gives it (the same ``seed``), so a report's dense interval is the
    same number in every comparison.
    """
    _check(resamples, level)
    if set(method) != set(reference) or not method:
        raise ValueError(f"compare: the method's tasks {sorted(method)} and the reference's {sorted(reference)} must be "
                         "the same, and at least one")  # fmt: skip
    tasks = sorted(method)
    own = stratified_bootstrap_mean({t: list(method[t].values()) for t in tasks}, resamples=resamples, level=level, seed=seed)
    ref = stratified_bootstrap_mean({t: list(reference[t].values()) for t in tasks}, resamples=resamples, level=level,
                                    seed=seed)  # fmt: skip
    paired = all(set(method[t]) == set(reference[t]) for t in tasks)
    rng = np.random.default_rng(seed + 1)
    if paired:
        per_task = []
        for t in tasks:
            keys = sorted(method[t], key=repr)
            a = _scores([method[t][k] for k in keys], f"compare, task {t!r}")
            b = _scores([reference[t][k] for k in keys], f"compare, task {t!r}")
            per_task.append(_resampled_means(a - b, rng, resamples))  # the same indices for both: a paired draw
        draws = np.mean(per_task, axis=0)
    else:
        draws = np.mean([_resampled_means(_scores(list(method[t].values()), t), rng, resamples)
                         - _resampled_means(_scores(list(reference[t].values()), t), rng, resamples) for t in tasks], axis=0)  # fmt: skip
    n = sum(len(method[t]) for t in tasks)
    return Comparison(own, ref, _interval(own.mean - ref.mean, draws, n, level), paired)
