"""SubGen's ratio of two unbiased estimates, and the guard that bounds it (issue 15, item 5).

The paper's output is ``num / den``: ``den`` from uniform samples of key clusters, ``num`` from
l2-sampled values, drawn independently. Both are unbiased, but nothing ties them together: when the
cluster samples miss the one key that holds a head's attention while a value sample holds it, ``den``
is orders of magnitude too small for ``num`` and the output leaves the convex hull of the values (on
CPython's argparse.py at budget 256: outputs up to 41x the largest value norm, perplexity 97,600).
These tests build that situation from synthetic tensors: one heavy key among many in one cluster.
"""

from __future__ import annotations

import pytest
import torch

from sparseattn import SubGen
from sparseattn.ops.slots import slot_attention, slot_attention_ref
from sparseattn.ops.attention import attention_ref
from sparseattn.testing import assert_close

D = 8
N = 200  # tokens folded into the sketch
HEAVY = 37  # the position of the one key the query attends to (logit 12 nats above every other)
SEEDS = range(20)


def heavy_key_prompt() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``N`` sketched tokens, then 2 window tokens; a query whose attention is ~99.9% on token ``HEAVY``.

    The heavy token's value is large (so l2 sampling usually holds it); the keys form one cluster, so
    its 4 uniform samples hold the heavy key with probability 1 - (199/200)^4 = 2%.
    """
    g = torch.Generator().manual_seed(0)
    keys = torch.randn(1, 1, N + 2, D, generator=g, dtype=torch.float64) * 0.5
    keys[..., 0] = 0.0  # every key orthogonal to the query ...
    keys[0, 0, HEAVY, 0] = 12 * D**0.5 / 8.0  # ... but the heavy one: logit q.k / sqrt(D) = 12
    values = torch.randn(1, 1, N + 2, D, generator=g, dtype=torch.float64) / D**0.5
    values[0, 0, HEAVY] = 10.0 * torch.nn.functional.normalize(values[0, 0, HEAVY], dim=-1)
    query = torch.zeros(1, 1, D, dtype=torch.float64)
    query[..., 0] = 8.0
    return keys, values, query


def sketched_output(seed: int, guard: bool) -> tuple[torch.Tensor, object]:
    """SubGen's output for the heavy-key query, after a prompt whose first ``N`` tokens are sketched."""
    keys, values, query = heavy_key_prompt()
    # window 2, one cluster of 4 samples, 8 value samples: budget 2 + 4 + 8
    method = SubGen(budget=14, window=2, cluster_samples=4, value_share=0.75, seed=seed, guard=guard)
    assert (method.clusters, method.value_samples) == (1, 8)
    state = method.new_state(1, 1, D, dtype=torch.float64)
    state.append(keys, values)
    state.attend_block(torch.zeros(1, 1, N + 2, D, dtype=torch.float64))
    assert state.sketched
    out, _ = state.attend(query)
    return out[0, 0], state


def where_heavy_is(state) -> tuple[bool, bool]:
    """Whether the heavy token is among the cluster samples, and among the value samples."""
    positions = state.positions[0, 0]
    values_region = positions[state.exact_end : state.clusters_start]
    cluster_region = positions[state.clusters_start :]
    return bool((cluster_region == HEAVY).any()), bool((values_region == HEAVY).any())


def test_the_papers_ratio_exceeds_every_value_norm_when_only_the_value_samples_hold_the_heavy_key():
    keys, values, query = heavy_key_prompt()
    largest = float(values.norm(dim=-1).max())
    blown_up = 0
    for seed in SEEDS:
        out, state = sketched_output(seed, guard=False)
        in_clusters, in_values = where_heavy_is(state)
        if float(out.norm()) > largest:
            blown_up += 1
            # the mechanism: the normaliser's samples missed the heavy key, the numerator's did not
            assert in_values and not in_clusters
            assert float(out.norm()) > 50 * largest  # not a near miss: e^12 / 200 ~ 800 times too large
    assert blown_up >= len(SEEDS) // 2  # the usual case at this budget, not a rare draw


def test_the_guard_keeps_every_output_within_the_largest_value_norm():
    keys, values, query = heavy_key_prompt()
    truth = attention_ref(query.view(1, 1, 1, D), keys, values)[0, 0, 0]
    largest = float(values.norm(dim=-1).max())
    errors = []
    for seed in SEEDS:
        out, _ = sketched_output(seed, guard=True)
        assert float(out.norm()) <= largest * (1 + 1e-12)
        errors.append(float((out - truth).norm() / truth.norm()))
    # where a value sample holds the heavy key (~96% of draws), the guarded output is close to the truth
    assert sorted(errors)[len(errors) // 2] < 0.05


@pytest.mark.parametrize("seed", range(5))
def test_the_guarded_output_is_a_sub_convex_combination_of_the_weighted_values(seed):
    # Random slot weights (empty, exact, cluster-like and value-like slots) and logits spread over 30
    # nats: with floor_weight = num_weight, |out| <= max |v| over the slots that carry numerator weight.
    g = torch.Generator().manual_seed(seed)
    B, H, G, S = 2, 2, 3, 40
    q = torch.randn(B, H, G, 1, D, generator=g, dtype=torch.float64) * 6
    k = torch.randn(B, H, S, D, generator=g, dtype=torch.float64)
    v = torch.randn(B, H, S, D, generator=g, dtype=torch.float64) * torch.rand(B, H, S, 1, generator=g, dtype=torch.float64)
    kind = torch.randint(0, 4, (B, H, S), generator=g)  # 0 empty, 1 exact, 2 cluster sample, 3 value sample
    scale = torch.rand(B, H, S, generator=g, dtype=torch.float64) * 50
    den = torch.where(kind == 1, 1.0, torch.where(kind == 2, scale, 0.0))
    num = torch.where(kind == 1, 1.0, torch.where(kind == 3, scale, 0.0))
    out, _ = slot_attention(q, k, v, den, num, floor_weight=num)
    bound = (v.norm(dim=-1) * (num > 0)).amax(-1)  # [B, H]
    assert bool((out[:, :, :, 0].norm(dim=-1) <= bound.unsqueeze(-1) * (1 + 1e-12)).all())
    assert_close(out, slot_attention_ref(q, k, v, den, num, floor_weight=num), torch.float64)
    unguarded, _ = slot_attention(q, k, v, den, num)
    floor = torch.einsum("bhgts,bhs->bhgt", torch.exp(torch.einsum("bhgtd,bhsd->bhgts", q, k) * D**-0.5), num)
    kept = floor <= torch.einsum("bhgts,bhs->bhgt", torch.exp(torch.einsum("bhgtd,bhsd->bhgts", q, k) * D**-0.5), den)
    # where the clusters' normaliser is already the larger, the guard changes nothing
    assert torch.equal(out[kept], unguarded[kept])


def test_the_guard_keeps_subgen_exact_where_the_papers_form_is_exact():
    # Copies of one token are sketched exactly by both estimates, so the floor equals the cluster estimate.
    B, H, G = 2, 2, 3
    g = torch.Generator().manual_seed(1)
    key, value = torch.randn(B, H, 1, D, generator=g, dtype=torch.float64), torch.randn(B, H, 1, D, generator=g, dtype=torch.float64)
    keys = torch.cat([torch.randn(B, H, 2, D, generator=g, dtype=torch.float64), key.expand(B, H, 60, D)], 2)
    values = torch.cat([torch.randn(B, H, 2, D, generator=g, dtype=torch.float64), value.expand(B, H, 60, D)], 2)
    for guard in (False, True):
        state = SubGen(budget=30, window=5, sinks=2, cluster_samples=3, guard=guard).new_state(B, H, D, dtype=torch.float64)
        state.append(keys, values)
        state.attend_block(torch.randn(B, H * G, 62, D, generator=g, dtype=torch.float64))
        q = torch.randn(B, H * G, D, generator=g, dtype=torch.float64)
        new_k, new_v = torch.randn(B, H, D, generator=g, dtype=torch.float64), torch.randn(B, H, D, generator=g, dtype=torch.float64)
        out, _ = state.step(q, new_k, new_v)
        all_keys, all_values = torch.cat([keys, new_k.unsqueeze(2)], 2), torch.cat([values, new_v.unsqueeze(2)], 2)
        assert_close(out, attention_ref(q.view(B, H, G, D), all_keys, all_values).view(B, H * G, D), torch.float64)


def test_the_papers_form_stays_the_default_and_guard_must_be_a_bool():
    assert SubGen().guard is False
    with pytest.raises(ValueError, match=r"SubGen.guard must be True or False, got 1"):
        SubGen(guard=1)
