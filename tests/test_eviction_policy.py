"""The eviction protocol (issue 13, item 1): a policy ranks tokens, the engine keeps the best ``budget``.

* The newcomer competes with the stored tokens: a policy that ranks it lowest keeps what it has
  (every buffer untouched); the step attends exactly what is stored afterwards.
* Protected parts (sinks, recent window, heavy hitters) are never evicted, whatever the policy ranks.
* Bad policies are refused with clear errors; the engine owns the record, beam reindexing and bytes.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from sparseattn import (
    H2O,
    Candidates,
    Evicting,
    EvictionPolicy,
    HeavyHitters,
    Observation,
    PrefillEviction,
    Protected,
    Radar,
    RecentWindow,
    Sinks,
    SnapKV,
    StreamingLLM,
)
from sparseattn.ops.attention import attention_ref
from sparseattn.testing import assert_close

B, H, G, D = 2, 2, 3, 8


@dataclass(frozen=True)
class KeyNorm(Evicting):
    """Keep the largest key norms; the newcomer competes too."""

    budget: int = 6

    def priority(self, tokens: Candidates) -> torch.Tensor:
        return tokens.keys.double().norm(dim=-1)


def randn(*shape, dtype=torch.float64):
    return torch.randn(*shape, dtype=dtype)


def stored_set(state) -> list[list[set[int]]]:
    return [[set(state.positions[b, h].tolist()) for h in range(state.kv_heads)] for b in range(state.batch)]


def test_a_policy_is_a_frozen_dataclass_the_protocol_recognises():
    assert isinstance(KeyNorm(), EvictionPolicy)
    assert isinstance(H2O(), EvictionPolicy) and isinstance(SnapKV(), EvictionPolicy) and isinstance(StreamingLLM(), EvictionPolicy)
    with pytest.raises(Exception):
        KeyNorm().budget = 3  # immutable


@pytest.mark.parametrize("newcomer_scale", [0.01, 100.0], ids=["newcomer-smallest", "newcomer-largest"])
def test_the_newcomer_competes_with_the_stored_tokens(newcomer_scale):
    torch.manual_seed(0)
    state = KeyNorm(budget=6).new_state(B, H, D, dtype=torch.float64)
    prompt_k, prompt_v = randn(B, H, 10, D), randn(B, H, 10, D)
    state.append(prompt_k, prompt_v)
    state.attend_block(randn(B, H * G, 10, D))
    kept = stored_set(state)
    norms = prompt_k.norm(dim=-1)
    expected = [[set(norms[b, h].topk(6).indices.tolist()) for h in range(H)] for b in range(B)]
    assert kept == expected  # after the prompt: the 6 largest norms

    key = randn(B, H, D)
    key = key / key.norm(dim=-1, keepdim=True) * newcomer_scale
    value, query = randn(B, H, D), randn(B, H * G, D)
    out, info = state.step(query, key, value)

    # The step attends what is stored after the decision: dense attention over it (float64 reference).
    ref = attention_ref(query.view(B, H, G, D), state.keys, state.values).reshape(B, H * G, D)
    assert_close(out, ref, torch.float64)
    assert info.attended.tolist() == [[6] * (H * G)] * B and state.length == 6
    if newcomer_scale < 1:
        assert stored_set(state) == kept  # the newcomer lost: nothing evicted, the newcomer not stored
        assert not info.position_mask(11)[..., 10].any()
    else:
        smallest = [[min(k, key=lambda p: float(norms[b, h, p])) for h, k in enumerate(row)] for b, row in enumerate(kept)]
        assert stored_set(state) == [[(k - {smallest[b][h]}) | {10} for h, k in enumerate(row)] for b, row in enumerate(kept)]


def test_a_newcomer_that_loses_leaves_every_stored_buffer_as_it_was():
    torch.manual_seed(1)
    method = Protected(KeyNorm(budget=4), HeavyHitters(1))  # a record field too
    state = method.new_state(1, 1, D, dtype=torch.float64)
    state.append(randn(1, 1, 4, D) * 10, randn(1, 1, 4, D))
    state.attend_block(randn(1, G, 4, D))
    before = state.keys.clone(), state.values.clone(), state.positions.clone(), state.attention_record.clone()
    state.append(randn(1, 1, 1, D) * 1e-3, randn(1, 1, 1, D))
    after = state.keys, state.values, state.positions, state.attention_record
    assert all(torch.equal(a, b) for a, b in zip(before, after)) and state.seen == 5



@pytest.mark.parametrize("always,protected", [
    (Sinks(2), {0, 1}),
    (RecentWindow(3), None),  # the 3 newest
    (Sinks(1) | RecentWindow(2), None),
])  # fmt: skip
def test_protected_tokens_are_never_evicted_whatever_the_policy_ranks(always, protected):
    torch.manual_seed(2)
    method = Protected(KeyNorm(budget=6), always)
    state = method.new_state(B, H, D, dtype=torch.float64)
    state.append(randn(B, H, 12, D) * 0.01, randn(B, H, 12, D))  # small keys: the policy would evict them
    state.attend_block(randn(B, H * G, 12, D))
    for step in range(10):
        state.step(randn(B, H * G, D), randn(B, H, D) * 10, randn(B, H, D))
        seen = 12 + step + 1
        want = set()
        if isinstance(always, Sinks) or "Sinks" in repr(always):
            want |= set(range(always.n if isinstance(always, Sinks) else 1))
        if "RecentWindow" in repr(always):
            n = always.n if isinstance(always, RecentWindow) else 2
            want |= set(range(seen - n, seen))
        for row in stored_set(state):
            for heads in row:
                assert want <= heads, (step, want, heads)
        assert state.length == 6


def test_heavy_hitters_are_the_tokens_with_the_largest_recorded_attention():
    torch.manual_seed(3)
    method = Protected(StreamingLLM(budget=8, sinks=0), HeavyHitters(3))
    assert method.observation == Observation()
    state = method.new_state(B, H, D, dtype=torch.float64)
    k, v, q = randn(B, H, 30, D), randn(B, H, 30, D), randn(B, H * G, 30, D)
    state.append(k, v)
    state.attend_block(q)
    from sparseattn.ops.slots import causal_probability_sums_ref

    sums = causal_probability_sums_ref(q.view(B, H, G, 30, D), k)
    for b in range(B):
        for h in range(H):
            heavy = set(sums[b, h].topk(3).indices.tolist())
            newest = [p for p in range(29, -1, -1) if p not in heavy][:5]  # the policy (recency) fills the rest
            assert set(state.positions[b, h].tolist()) == heavy | set(newest)
    assert torch.allclose(state.attention_record, sums.gather(-1, state.positions), rtol=1e-10)


def test_h2o_is_accumulated_attention_with_a_protected_recent_window():
    # The preset and the same policy written from the parts decode identically.
    @dataclass(frozen=True)
    class Accumulated(Evicting):
        budget: int = 10
        observation = Observation()

        def priority(self, tokens: Candidates) -> torch.Tensor:
            return tokens.attention.double()

    torch.manual_seed(4)
    preset, parts = H2O(budget=10, heavy_ratio=0.5), Protected(Accumulated(10), RecentWindow(5))
    states = [m.new_state(B, H, D, dtype=torch.float64) for m in (preset, parts)]
    k, v, q = randn(B, H, 24, D), randn(B, H, 24, D), randn(B, H * G, 24, D)
    for s in states:
        s.append(k, v)
        s.attend_block(q)
    for _ in range(12):
        step = randn(B, H * G, D), randn(B, H, D), randn(B, H, D)
        (a, _), (b, _) = (s.step(*step) for s in states)
        assert torch.equal(a, b)
    assert torch.equal(states[0].positions, states[1].positions)


def test_a_policy_returning_the_wrong_shape_is_refused_naming_it():
    @dataclass(frozen=True)
    class Broken(Evicting):
        budget: int = 4

        def priority(self, tokens):
            return tokens.positions[..., :-1].double()

    state = Broken().new_state(1, 1, D)
    state.append(torch.randn(1, 1, 8, D), torch.randn(1, 1, 8, D))
    with pytest.raises(ValueError, match=r"Broken\(budget=4\)\.priority must return a float tensor of shape \(1, 1, 8\)"):
        state.attend_block(torch.randn(1, 1, 8, D))


def test_a_policy_that_protects_everything_is_refused_at_the_step_that_finds_it():
    state = Protected(StreamingLLM(budget=4, sinks=0), Sinks(100)).new_state(1, 1, D)
    state.append(torch.randn(1, 1, 4, D), torch.randn(1, 1, 4, D))
    with pytest.raises(RuntimeError, match="every token is protected"):
        state.step(torch.randn(1, 1, D), torch.randn(1, 1, D), torch.randn(1, 1, D))


def test_parts_reading_different_records_are_refused():
    with pytest.raises(ValueError, match="different attention records"):
        Protected(SnapKV(budget=64), HeavyHitters(4))
    with pytest.raises(ValueError, match="Protected.policy must be an eviction policy"):
        Protected(Radar(), Sinks(1))
    with pytest.raises(ValueError, match="combines with another part"):
        Sinks(1) | 3


def test_any_eviction_policy_can_compress_the_prompt_for_any_decode_method():
    torch.manual_seed(6)
    method = PrefillEviction(prefill=KeyNorm(budget=20), decode=Radar(top_k=2, n_features=16, window=4))
    state = method.new_state(1, H, D)
    state.append(torch.randn(1, H, 50, D), torch.randn(1, H, 50, D))
    state.attend_block(torch.randn(1, H * G, 50, D))
    state.step(torch.randn(1, H * G, D), torch.randn(1, H, D), torch.randn(1, H, D))
    assert state.length == 21 and state.seen == 51
