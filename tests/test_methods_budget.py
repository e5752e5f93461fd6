"""One meaning of budget for every method: tokens attended per decode step; at budget >= t, dense attention.

The contract tests run over every name in :mod:`sparseattn.registry` (read at collection), so a method
is covered the moment it is registered; tests/test_registry.py runs them on a method registered there.
"""

from __future__ import annotations

import pytest
import torch

from sparseattn import registry
from sparseattn.testing import (
    BUDGET_CASES,
    CONTRACT_SHAPE,
    check_beam_reindexing,
    check_budget_honoured,
    check_dense_at_full_budget,
    contract_method,
)

B, H, G, D = CONTRACT_SHAPE
BUDGET = 48
NAMES = [name for name in registry.names() if name != "dense"]


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("prompt,how,dtype", BUDGET_CASES, ids=["prompt<budget", "prompt>budget-bf16", "prompt>budget-in-3-blocks"])
def test_every_decode_step_attends_at_most_the_budget(name, prompt, how, dtype):
    check_budget_honoured(name, BUDGET, prompt, how, dtype)


@pytest.mark.parametrize("name", ["dense", *NAMES])
@pytest.mark.parametrize("how", ["one-block", "blocks", "no-queries"])
def test_at_a_budget_of_at_least_t_every_method_is_dense_attention(name, how):
    check_dense_at_full_budget(name, how)


@pytest.mark.parametrize("name", ["streamingllm", "h2o", "snapkv", "subgen"])
def test_the_budget_is_the_number_of_tokens_an_evicting_method_keeps(name):
    method = contract_method(name, 50)
    assert method.budget == 50
    state = method.new_state(1, 1, 4)
    state.append(torch.randn(1, 1, 200, 4), torch.randn(1, 1, 200, 4))
    state.attend_block(torch.randn(1, 1, 200, 4))
    assert state.length == 50 and state.seen == 200
    assert state.nbytes()["kv"] == 2 * 50 * 4 * 4


def test_segment_search_methods_turn_the_budget_into_segments():
    for name in ("radar", "quest", "radar-exact", "radar-random", "radar-lowest", "radar-recent"):
        assert contract_method(name, 512).budget == 512
    assert contract_method("snapkv+radar", 512).decode.budget == 512
    assert contract_method("snapkv+radar", 512).prefill.budget == 4 * 512


@pytest.mark.parametrize("name", ["dense", *NAMES])
def test_beam_search_reindexes_every_state(name):
    check_beam_reindexing(name, BUDGET)


def test_the_contract_fails_for_a_method_that_breaks_it():
    # A method that silently attends only the newest token: the dense check must catch it.
    from dataclasses import dataclass

    from sparseattn import Candidates, Evicting, registry
    from sparseattn.registry import MethodEntry, Option

    @dataclass(frozen=True)
    class Forgetful(Evicting):
        budget: int = 1

        def priority(self, tokens: Candidates) -> torch.Tensor:
            return tokens.positions.double()

    registry.register(MethodEntry("forgetful", "keeps one token whatever the budget", lambda budget=1: Forgetful(),
                                  (Option("budget", int, 1, "ignored"),)))
    try:
        with pytest.raises(AssertionError, match="forgetful at t="):
            check_dense_at_full_budget("forgetful")
    finally:
        registry.unregister("forgetful")
