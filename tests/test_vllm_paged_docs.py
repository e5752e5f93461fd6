"""The extension guide's worked examples, run through vLLM's paged engine as well (no vLLM needed).

docs/architecture.md writes a new summary and a new selector, a new select stage, two eviction policies
and a composed method (segment search plus heavy hitters), each in a few lines of user code, and
doctests them in the transformers engine. Here the same classes, taken from the guide itself, meet
the paged engine: where it runs the family (segment search over pages), a user's parts give over
vLLM's page layout exactly what their decode state gives; where it does not (eviction, token-level
select stages, always-kept parts), the method is refused at start-up with the reason.
"""

from __future__ import annotations

import dataclasses
import doctest
from pathlib import Path

import pytest
from tests.test_vllm_paged import assert_pages_equal_state

import sparseattn as sa
from sparseattn.vllm.paged import PagedPolicy

GUIDE = Path(__file__).resolve().parent.parent / "docs" / "architecture.md"


@pytest.fixture(scope="module")
def guide() -> dict:
    """The names the guide's examples define, run in order as its doctest runs them."""
    names: dict = {}
    for example in doctest.DocTestParser().get_examples(GUIDE.read_text()):
        try:
            exec(compile(example.source, str(GUIDE), "exec"), names)
        except Exception:  # the examples that show a refusal raise on purpose
            pass
    return names


@pytest.mark.parametrize("recent", [0, 1])
def test_the_guides_summary_and_selector_over_pages_equal_their_decode_state(guide, recent):
    method = sa.SegmentSearch(
        guide["SampledKeys"](samples=4), guide["TopKPlusRecent"](recent=recent), sa.FixedSchedule(16), top_k=3, sinks=16
    )
    assert_pages_equal_state(method, 16, (211, 150, 40), "sampled-keys")


@pytest.mark.parametrize(
    "build, why",
    [
        (lambda g: sa.SegmentSearch(sa.ExactScore(), sa.TopK(), sa.FixedSchedule(16), top_k=6, refine=g["DropFaint"](0.08)), "token refinement"),
        (lambda g: g["KeyNorm"](budget=64), "eviction methods"),
        (lambda g: g["Accumulated"](budget=64), "eviction methods"),
        (lambda g: dataclasses.replace(sa.Radar(budget=256, n_features=64), always=sa.HeavyHitters(32)), "always-kept part"),
    ],
    ids=["select-stage", "eviction-keynorm", "eviction-accumulated", "composed-heavy-hitters"],
)
def test_the_guides_other_examples_are_refused_by_the_paged_engine_saying_why(guide, build, why):
    with pytest.raises(ValueError, match=why):
        PagedPolicy(build(guide), "guide")
