"""One meaning of budget for every method: tokens attended per decode step; at budget >= t, dense attention.

The contract tests run over every name in :mod:`sparseattn.registry` (read at collection), so a method
is covered the moment it is registered; tests/test_registry.py runs them on a method registered there.
"""

from __future__ import annotations

import pytest
import torch

from sparseattn import registry
from sparseattn.methods.eviction import EvictingState
from sparseattn.ops.attention import attention_ref
from sparseattn.testing import assert_close

B, H, G, D = 2, 2, 3, 8
BUDGET = 48
NAMES = [name for name in registry.names() if name != "dense"]


def method_at(name: str, budget: int):
    """The method ``name`` at ``budget`` (if it has one), with few random features to keep the tests fast."""
    return registry.build(name, **registry.get(name).takes(budget=budget, n_features=32))


def run_prompt(state, keys, values, how: str, dtype) -> None:
    """Prefill ``keys, values`` as one attended block, three attended blocks, or appended without queries."""
    T = keys.shape[2]
    if how == "no-queries":
        state.prefill(keys, values)
        return
    cuts = [0, T] if how == "one-block" else [0, T // 3, 2 * T // 3, T]
    for a, b in zip(cuts, cuts[1:]):
        state.append(keys[:, :, a:b], values[:, :, a:b])
        state.attend_block(torch.randn(B, H * G, b - a, D, dtype=dtype))


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize(
    "prompt,how,dtype",
    [(29, "one-block", torch.float32), (97, "one-block", torch.bfloat16), (97, "blocks", torch.float32)],
    ids=["prompt<budget", "prompt>budget-bf16", "prompt>budget-in-3-blocks"],
)
def test_every_decode_step_attends_at_most_the_budget(name, prompt, how, dtype):
    state = method_at(name, BUDGET).new_state(B, H, D, dtype=dtype)
    run_prompt(state, torch.randn(B, H, prompt, D, dtype=dtype), torch.randn(B, H, prompt, D, dtype=dtype), how, dtype)
    for _ in range(70):
        q, k, v = torch.randn(B, H * G, D), torch.randn(B, H, D), torch.randn(B, H, D)
        out, info = state.step(q.to(dtype), k.to(dtype), v.to(dtype))
        assert torch.isfinite(out).all()
        assert info.attended.shape == (B, H * G)
        assert int(info.attended.max()) <= BUDGET, f"{name}: {int(info.attended.max())} tokens attended"
        assert torch.equal(info.attended, info.to_mask().sum(-1))
        if isinstance(state, EvictingState):
            assert state.length <= BUDGET  # eviction is physical: memory is bounded too
            assert state.keys.shape == (B, H, state.length, D)


@pytest.mark.parametrize("name", ["dense", *NAMES])
@pytest.mark.parametrize("how", ["one-block", "blocks", "no-queries"])
def test_at_a_budget_of_at_least_t_every_method_is_dense_attention(name, how):
    prompt, steps = 41, 23
    keys = torch.randn(B, H, prompt + steps, D, dtype=torch.float64).float()
    values = torch.randn(B, H, prompt + steps, D, dtype=torch.float64).float()
    state = method_at(name, prompt + steps).new_state(B, H, D)
    run_prompt(state, keys[:, :, :prompt], values[:, :, :prompt], how, torch.float32)
    for t in range(prompt, prompt + steps):
        q = torch.randn(B, H * G, D)
        out, info = state.step(q, keys[:, :, t], values[:, :, t])
        reference = attention_ref(q.view(B, H, G, D), keys[:, :, : t + 1], values[:, :, : t + 1]).view(B, H * G, D)
        assert_close(out, reference, torch.float32, what=f"{name} at t={t + 1}")
        assert torch.equal(info.attended, torch.full((B, H * G), t + 1))


@pytest.mark.parametrize("name", ["streamingllm", "h2o", "snapkv", "subgen"])
def test_the_budget_is_the_number_of_tokens_an_evicting_method_keeps(name):
    method = method_at(name, 50)
    assert method.budget == 50
    state = method.new_state(1, 1, 4)
    state.append(torch.randn(1, 1, 200, 4), torch.randn(1, 1, 200, 4))
    state.attend_block(torch.randn(1, 1, 200, 4))
    assert state.length == 50 and state.seen == 200
    assert state.nbytes()["kv"] == 2 * 50 * 4 * 4


def test_segment_search_methods_turn_the_budget_into_segments():
    for name in ("radar", "quest", "radar-exact", "radar-random", "radar-lowest", "radar-recent"):
        assert method_at(name, 512).budget == 512
    assert method_at("snapkv+radar", 512).decode.budget == 512
    assert method_at("snapkv+radar", 512).prefill.budget == 4 * 512


@pytest.mark.parametrize("name", ["dense", *NAMES])
def test_beam_search_reindexes_every_state(name):
    state = method_at(name, BUDGET).new_state(B, H, D)
    state.append(torch.randn(B, H, 90, D), torch.randn(B, H, 90, D))
    state.attend_block(torch.randn(B, H * G, 90, D))
    state.step(torch.randn(B, H * G, D), torch.randn(B, H, D), torch.randn(B, H, D))
    before = state.keys.clone()
    state.select_batch(torch.tensor([1, 1, 0]))
    assert state.batch == 3 and torch.equal(state.keys, before[[1, 1, 0]])
    out, info = state.step(torch.randn(3, H * G, D), torch.randn(3, H, D), torch.randn(3, H, D))
    assert out.shape == (3, H * G, D)
    if "budget" in registry.get(name).option_names:
        assert int(info.attended.max()) <= BUDGET
