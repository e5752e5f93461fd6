"""The evicting methods' defining behaviour, on inputs built so the right answer is known."""

from __future__ import annotations

import math

import pytest
import torch

from sparseattn import H2O, SnapKV, StreamingLLM, SubGen
from sparseattn.ops.slots import (
    causal_probability_sums,
    causal_probability_sums_ref,
    slot_attention,
    slot_attention_ref,
)
from sparseattn.ops.attention import attention_ref, causal_block_attention_ref
from sparseattn.testing import assert_close

B, H, G, D = 2, 2, 3, 8  # batch > 1, grouped-query attention (3 query heads per KV head)


def randn(*shape, dtype=torch.float32):
    return torch.randn(*shape, dtype=torch.float64).to(dtype)


def kept_positions(state) -> list[list[set[int]]]:
    return [[set(state.positions[b, h].tolist()) for h in range(state.kv_heads)] for b in range(state.batch)]


# -- the shared kernels --------------------------------------------------------------------------


@pytest.mark.parametrize("T,S", [(1, 1), (1, 37), (5, 37), (37, 37)], ids=lambda x: str(x))
@pytest.mark.parametrize("weighted", [False, True], ids=["plain", "weighted"])
def test_slot_attention_matches_its_reference(T, S, weighted):
    q, k, v = randn(B, H, G, T, D), randn(B, H, S, D), randn(B, H, S, D)
    den = num = None
    if weighted:  # some empty slots, some denominator-only, some numerator-only; the queries' own slots exact
        den, num = torch.rand(B, H, S, dtype=torch.float64) * 3, torch.rand(B, H, S, dtype=torch.float64) * 3
        den[:, :, : S // 3], num[:, :, S // 3 : 2 * S // 3] = 0.0, 0.0
        den[:, :, -T:], num[:, :, -T:] = 1.0, 1.0
    out, probs = slot_attention(q, k, v, den, num, scale=0.3, softcap=5.0)
    assert_close(out, slot_attention_ref(q, k, v, den, num, scale=0.3, softcap=5.0), torch.float32)
    assert torch.allclose(probs.sum(-1), torch.ones(B, H, G, T), atol=1e-5)


@pytest.mark.parametrize("T,S", [(1, 29), (7, 29), (29, 29), (613, 613)], ids=lambda x: str(x))
def test_prefill_attention_sums_match_the_reference(T, S, monkeypatch):
    monkeypatch.setattr("sparseattn.ops.slots._PROBABILITY_CHUNK", 4096)  # force several row chunks
    q, k = randn(1, H, G, T, D), randn(1, H, S, D)
    got = causal_probability_sums(q, k, scale=0.5)
    assert_close(got, causal_probability_sums_ref(q, k, scale=0.5), torch.float32)
    assert float(got.sum()) == pytest.approx(H * G * T, rel=1e-5)  # every query row sums to 1


# -- StreamingLLM --------------------------------------------------------------------------------


@pytest.mark.parametrize("prompt", [5, 40], ids=["short-prompt", "long-prompt"])
def test_streamingllm_attends_exactly_the_sinks_and_the_window(prompt):
    method = StreamingLLM(budget=13, sinks=4)
    state = method.new_state(B, H, D)
    state.append(randn(B, H, prompt, D), randn(B, H, prompt, D))
    state.attend_block(randn(B, H * G, prompt, D))
    for t in range(prompt + 1, prompt + 30):
        _, info = state.step(randn(B, H * G, D), randn(B, H, D), randn(B, H, D))
        expected = torch.zeros(t, dtype=torch.bool)
        expected[: method.sinks] = True
        expected[max(method.sinks, t - method.window) :] = True
        assert torch.equal(info.position_mask(t), expected.expand(B, H * G, t))
        assert state.length == min(t, method.budget)


def test_streamingllm_output_is_dense_attention_over_its_kept_tokens():
    method = StreamingLLM(budget=9, sinks=2)
    state = method.new_state(B, H, D, dtype=torch.float64)
    keys, values = randn(B, H, 40, D, dtype=torch.float64), randn(B, H, 40, D, dtype=torch.float64)
    state.append(keys[:, :, :20], values[:, :, :20])
    state.attend_block(randn(B, H * G, 20, D, dtype=torch.float64))
    for t in range(20, 40):
        q = randn(B, H * G, D, dtype=torch.float64)
        out, _ = state.step(q, keys[:, :, t], values[:, :, t])
        kept = [0, 1, *range(t - 6, t + 1)]
        ref = attention_ref(q.view(B, H, G, D), keys[:, :, kept], values[:, :, kept]).view(B, H * G, D)
        assert_close(out, ref, torch.float64)


# -- H2O -----------------------------------------------------------------------------------------


def heavy_hitter_prompt(T: int, heavy: list[int], strength: float = 20.0):
    """Queries all along one direction u; the ``heavy`` tokens' keys are ``strength * u``, the rest are noise."""
    u = torch.zeros(D, dtype=torch.float64)
    u[0] = 1.0
    q = u.expand(B, H, G, T, D) + 0.05 * randn(B, H, G, T, D, dtype=torch.float64)
    k = 0.05 * randn(B, H, T, D, dtype=torch.float64)
    k[:, :, heavy] += strength * u
    return q, k, randn(B, H, T, D, dtype=torch.float64)


def test_h2o_keeps_the_tokens_with_the_largest_accumulated_attention_after_prefill():
    method = H2O(budget=10, heavy_ratio=0.4)  # 4 heavy + 6 recent
    heavy = [3, 11, 17, 25]
    q, k, v = heavy_hitter_prompt(48, heavy)
    state = method.new_state(B, H, D, dtype=torch.float64)
    state.append(k, v)
    state.attend_block(q.reshape(B, H * G, 48, D))
    expected = set(heavy) | set(range(48 - method.recent, 48))
    assert kept_positions(state) == [[expected] * H] * B
    # the scores kept are the column sums of the prompt's causal attention, summed over each KV group
    sums = causal_probability_sums_ref(q, k)
    assert torch.allclose(state.attention_record, sums.gather(-1, state.positions), rtol=1e-10)


def h2o_reference(method: H2O, q_prompt, k, v, q_steps):
    """Naive H2O, one (row, KV head) at a time in float64: the kept positions after the prompt and each step."""
    T0 = q_prompt.shape[3]
    history = []
    for b in range(B):
        for h in range(H):
            score = {}
            sums = causal_probability_sums_ref(q_prompt[b : b + 1, h : h + 1], k[b : b + 1, h : h + 1, :T0])[0, 0]
            ranked = sorted(range(T0), key=lambda j: (j >= T0 - method.recent, float(sums[j]), j), reverse=True)
            kept = sorted(ranked[: method.budget])
            score = {j: float(sums[j]) for j in kept}
            rows = [set(kept)]
            for step, p in enumerate(range(T0, k.shape[2])):
                if len(kept) == method.budget:
                    candidates = [j for j in kept if j <= p - method.recent]
                    victim = min(candidates, key=lambda j: (score[j], j))
                    kept.remove(victim)
                    del score[victim]
                kept.append(p)
                score[p] = 0.0
                logits = torch.stack([k[b, h, j] for j in kept]) @ q_steps[b, h, :, step].T * D**-0.5  # [n, G]
                probs = torch.softmax(logits, dim=0).sum(-1)
                for j, w in zip(kept, probs.tolist()):
                    score[j] += w
                rows.append(set(kept))
            history.append(rows)
    return history


def test_h2o_evicts_like_the_naive_greedy_reference_during_decoding():
    method = H2O(budget=9, heavy_ratio=0.5)
    T0, steps = 23, 25
    k, v = randn(B, H, T0 + steps, D, dtype=torch.float64), randn(B, H, T0 + steps, D, dtype=torch.float64)
    q_prompt = randn(B, H, G, T0, D, dtype=torch.float64)
    q_steps = randn(B, H, G, steps, D, dtype=torch.float64)
    reference = h2o_reference(method, q_prompt, k, v, q_steps)
    state = method.new_state(B, H, D, dtype=torch.float64)
    state.append(k[:, :, :T0], v[:, :, :T0])
    state.attend_block(q_prompt.reshape(B, H * G, T0, D))
    got = [kept_positions(state)]
    for step in range(steps):
        t = T0 + step
        state.step(q_steps[:, :, :, step].reshape(B, H * G, D), k[:, :, t], v[:, :, t])
        got.append(kept_positions(state))
        assert state.length == method.budget
    for b in range(B):
        for h in range(H):
            assert [g[b][h] for g in got] == reference[b * H + h], f"row {b}, KV head {h}"


def test_h2o_heavy_and_recent_split_the_budget():
    assert (H2O(budget=100).heavy, H2O(budget=100).recent) == (50, 50)
    assert (H2O(budget=100, heavy_ratio=0.2).heavy, H2O(budget=100, heavy_ratio=0.2).recent) == (20, 80)
    assert H2O(budget=1, heavy_ratio=0.9).recent == 1  # the newest token is always kept


# -- SnapKV --------------------------------------------------------------------------------------


def voting_prompt(T: int, window: int, targets_by_head: list[list[int]]):
    """The last ``window`` queries point at one direction; each KV head's ``targets`` have keys along it."""
    u = torch.zeros(D, dtype=torch.float64)
    u[1] = 1.0
    q = 0.05 * randn(B, H, G, T, D, dtype=torch.float64)
    q[:, :, :, -window:] += u
    k = 0.05 * randn(B, H, T, D, dtype=torch.float64)
    for h, targets in enumerate(targets_by_head):
        k[:, h, targets] += 6.0 * u
    return q, k, randn(B, H, T, D, dtype=torch.float64)


def pinned(state) -> torch.Tensor:
    """``[B, H_kv, S]``: the slots SnapKV never evicts at decode (the prompt's survivors before its window)."""
    return state.positions < state.prompt_length - state.policy.observation_window


def test_snapkv_keeps_the_prompt_tokens_most_attended_by_the_observation_window():
    method = SnapKV(budget=8 + 3, observation_window=8, kernel_size=1)
    targets = [[2, 9, 30], [5, 17, 33]]  # each KV head keeps its own
    q, k, v = voting_prompt(50, 8, targets)
    state = method.new_state(B, H, D, dtype=torch.float64)
    state.append(k, v)
    state.attend_block(q.reshape(B, H * G, 50, D))
    window = set(range(42, 50))
    assert kept_positions(state) == [[set(targets[0]) | window, set(targets[1]) | window]] * B
    assert pinned(state).sum(-1).tolist() == [[3, 3]] * B


def test_snapkv_pooling_keeps_the_neighbours_of_a_voted_token():
    method = SnapKV(budget=6 + 3, observation_window=6, kernel_size=3, pooling="max")
    q, k, v = voting_prompt(40, 6, [[20], [11]])
    state = method.new_state(B, H, D, dtype=torch.float64)
    state.append(k, v)
    state.attend_block(q.reshape(B, H * G, 40, D))
    window = set(range(34, 40))
    assert kept_positions(state) == [[{19, 20, 21} | window, {10, 11, 12} | window]] * B


def test_snapkv_scores_a_kv_group_by_the_sum_of_its_query_heads():
    # Query head 0 of the group attends token 4 alone, heads 1 and 2 split between tokens 9 and 14:
    # per query head 4 wins, summed over the group 9 and 14 win (a budget of 2 prompt tokens).
    T, w = 24, 4
    q = torch.zeros(1, 1, 3, T, D, dtype=torch.float64)
    k = torch.zeros(1, 1, T, D, dtype=torch.float64)
    k[0, 0, 4, 0] = k[0, 0, 9, 1] = k[0, 0, 14, 1] = 10.0
    q[0, 0, 0, -w:, 0] = 10.0
    q[0, 0, 1:, -w:, 1] = 10.0
    state = SnapKV(budget=w + 2, observation_window=w, kernel_size=1).new_state(1, 1, D, dtype=torch.float64)
    state.append(k, torch.randn(1, 1, T, D, dtype=torch.float64))
    state.attend_block(q.reshape(1, 3, T, D))
    assert set(state.positions[0, 0].tolist()) == {9, 14, *range(T - w, T)}


def test_snapkv_decoding_slides_the_window_past_the_pinned_prompt_tokens():
    method = SnapKV(budget=8 + 3, observation_window=8, kernel_size=1)
    targets = [[2, 9, 30], [5, 17, 33]]
    q, k, v = voting_prompt(50, 8, targets)
    state = method.new_state(B, H, D, dtype=torch.float64)
    state.append(k, v)
    state.attend_block(q.reshape(B, H * G, 50, D))
    for t in range(51, 70):
        q, k_new, v_new = (randn(*shape, dtype=torch.float64) for shape in ((B, H * G, D), (B, H, D), (B, H, D)))
        _, info = state.step(q, k_new, v_new)
        recent = set(range(t - 8, t))
        assert kept_positions(state) == [[set(targets[0]) | recent, set(targets[1]) | recent]] * B
        assert int(info.attended.max()) == method.budget


def test_snapkv_keeps_a_short_prompt_whole_and_pins_it():
    method = SnapKV(budget=30, observation_window=4)
    state = method.new_state(B, H, D)
    state.append(randn(B, H, 20, D), randn(B, H, 20, D))
    state.attend_block(randn(B, H * G, 20, D))
    assert state.length == 20 and int(pinned(state).sum()) == B * H * 16
    for _ in range(25):
        state.step(randn(B, H * G, D), randn(B, H, D), randn(B, H, D))
    assert (state.positions[..., :16] == torch.arange(16)).all()  # the pinned prompt outlives the window
    assert set(state.positions[0, 0].tolist()) == set(range(16)) | set(range(31, 45))


# -- SubGen --------------------------------------------------------------------------------------


def test_subgen_splits_its_budget_into_window_clusters_and_value_samples():
    method = SubGen(budget=100, window=10, sinks=2, cluster_samples=4, value_share=0.25)
    assert method.clusters == 16 and method.value_samples == 88 - 64
    assert method.sinks + method.window + method.clusters * method.cluster_samples + method.value_samples == 100
    tiny = SubGen(budget=8, window=2, sinks=0, cluster_samples=5)
    assert (tiny.clusters, tiny.value_samples) == (1, 1)


def clustered_stream(sizes: list[int], spread: float = 0.01):
    """Keys around ``len(sizes)`` far-apart centers (``sizes[c]`` keys each), shuffled; their cluster ids."""
    centers = 5.0 * torch.eye(D, dtype=torch.float64)[: len(sizes)]
    labels = torch.cat([torch.full((n,), c) for c, n in enumerate(sizes)])
    labels = labels[torch.randperm(labels.numel())]
    keys = centers[labels] + spread * randn(labels.numel(), D, dtype=torch.float64)
    return keys.expand(B, H, -1, D).contiguous(), labels


def test_subgen_clusters_separated_keys_exactly_and_samples_within_each_cluster():
    sizes = [7, 19, 3, 11]
    keys, labels = clustered_stream(sizes)
    method = SubGen(budget=34, window=4, cluster_samples=3, value_share=0.2, radius=1.0)  # 8 clusters allowed
    assert method.clusters == 8
    n = keys.shape[2]
    tail = randn(B, H, 4, D, dtype=torch.float64)  # the window: exact tokens, not clustered
    state = method.new_state(B, H, D, dtype=torch.float64)
    state.append(torch.cat([keys, tail], 2), randn(B, H, n + 4, D, dtype=torch.float64))
    state.attend_block(randn(B, H * G, n + 4, D, dtype=torch.float64))
    assert state.sketched and state.clusters_used.tolist() == [[4, 4]] * B
    counts = state.counts[..., :4].sort(-1).values
    assert counts.tolist() == [[sorted(sizes)] * H] * B
    start, t = state.clusters_start, method.cluster_samples
    sampled = state.positions[..., start : start + 4 * t].reshape(B, H, 4, t)
    sample_labels = labels[sampled]
    assert bool((sample_labels == sample_labels[..., :1]).all()), "a cluster's samples come from several clusters"
    # each cluster's weight n_c / t is its size over its samples
    den = state.field("den")[..., start : start + 4 * t].reshape(B, H, 4, t)
    assert torch.equal(den * t, state.counts[..., :4, None].double().expand(B, H, 4, t))


def test_subgen_is_exact_when_the_sketched_tokens_are_copies_of_one_token():
    method = SubGen(budget=30, window=5, sinks=2, cluster_samples=3)
    key, value = randn(B, H, 1, D, dtype=torch.float64), randn(B, H, 1, D, dtype=torch.float64)
    keys = torch.cat([randn(B, H, 2, D, dtype=torch.float64), key.expand(B, H, 60, D)], 2)
    values = torch.cat([randn(B, H, 2, D, dtype=torch.float64), value.expand(B, H, 60, D)], 2)
    state = method.new_state(B, H, D, dtype=torch.float64)
    state.append(keys, values)
    state.attend_block(randn(B, H * G, 62, D, dtype=torch.float64))
    for t in range(62, 67):  # new distinct tokens push copies (only) out of the window into the sketch
        new_k, new_v = randn(B, H, 1, D, dtype=torch.float64), randn(B, H, 1, D, dtype=torch.float64)
        keys, values = torch.cat([keys, new_k], 2), torch.cat([values, new_v], 2)
        q = randn(B, H * G, D, dtype=torch.float64)
        out, _ = state.step(q, new_k[:, :, 0], new_v[:, :, 0])
        assert_close(out, attention_ref(q.view(B, H, G, D), keys, values).view(B, H * G, D), torch.float64)
    assert int(state.counts.sum()) == B * H * (67 - 2 - 5)  # every token that left the window is counted


def test_subgen_prefill_blocks_after_the_sketch_see_it_through_its_weights():
    # Copies of one token are sketched exactly, so a later prompt block must still get dense attention.
    method = SubGen(budget=30, window=5, sinks=2, cluster_samples=3)
    key, value = randn(B, H, 1, D, dtype=torch.float64), randn(B, H, 1, D, dtype=torch.float64)
    keys = torch.cat([randn(B, H, 2, D, dtype=torch.float64), key.expand(B, H, 60, D)], 2)
    values = torch.cat([randn(B, H, 2, D, dtype=torch.float64), value.expand(B, H, 60, D)], 2)
    keys = torch.cat([keys, key.expand(B, H, 9, D), randn(B, H, 4, D, dtype=torch.float64)], 2)  # 75 tokens
    values = torch.cat([values, value.expand(B, H, 9, D), randn(B, H, 4, D, dtype=torch.float64)], 2)
    state = method.new_state(B, H, D, dtype=torch.float64)
    state.append(keys[:, :, :62], values[:, :, :62])
    state.attend_block(randn(B, H * G, 62, D, dtype=torch.float64))
    assert state.sketched
    q = randn(B, H * G, 13, D, dtype=torch.float64)
    state.append(keys[:, :, 62:], values[:, :, 62:])
    out = state.attend_block(q)
    reference = causal_block_attention_ref(q.view(B, H, G, 13, D), keys, values).view(B, H * G, 13, D)
    assert_close(out, reference, torch.float64)
    # the window keeps the newest tokens; the copies that left it are counted in the sketch
    assert torch.equal(state.positions[..., 2:7].sort(-1).values, torch.arange(70, 75).expand(B, H, 5))
    assert state.length == 30 and int(state.counts.sum()) == B * H * (75 - 7)


def sketch_sums(state, q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """SubGen's estimates of ``sum exp(q.k)`` and ``sum exp(q.k) v`` over the sketched tokens (one query)."""
    lo = state.exact_end
    e = torch.exp(torch.einsum("d,sd->s", q, state.keys[0, 0, lo:]) * state.scale)
    den = (e * state.field("den")[0, 0, lo:]).sum()
    num = (e * state.field("num")[0, 0, lo:]) @ state.values[0, 0, lo:]
    return den, num


def test_subgen_estimates_both_sums_without_bias():
    # Keys in 3 loose clusters, values of varied norms; the sketch's estimates average to the truth.
    n, runs = 90, 300
    keys, _ = clustered_stream([30, 45, 15], spread=0.4)
    keys = keys[:1, :1] * 0.3
    values = randn(1, 1, n, D, dtype=torch.float64) * torch.linspace(0.2, 2.0, n, dtype=torch.float64).view(1, 1, n, 1)
    window = randn(1, 1, 2, D, dtype=torch.float64)
    q = randn(D, dtype=torch.float64)
    e = torch.exp(keys[0, 0] @ q * D**-0.5)
    true_den, true_num = e.sum(), e @ values[0, 0]
    dens, nums = [], []
    for seed in range(runs):
        state = SubGen(budget=22, window=2, cluster_samples=4, value_share=0.4, radius=0.0, seed=seed).new_state(
            1, 1, D, dtype=torch.float64
        )
        state.append(torch.cat([keys, window], 2), torch.cat([values, window], 2))
        state.attend_block(randn(1, 1, n + 2, D, dtype=torch.float64))
        den, num = sketch_sums(state, q)
        dens.append(den)
        nums.append(num)
    dens, nums = torch.stack(dens), torch.stack(nums)
    # the mean of `runs` independent estimates lies within 5 standard errors of the truth
    assert abs(float(dens.mean() - true_den)) <= 5 * float(dens.std()) / math.sqrt(runs)
    assert bool(((nums.mean(0) - true_num).abs() <= 5 * nums.std(0) / math.sqrt(runs) + 1e-12).all())
    assert float(dens.std()) > 0 and float(nums.std(0).max()) > 0  # the test is not vacuous


def test_subgen_decoding_keeps_the_window_exact_and_counts_every_folded_token():
    method = SubGen(budget=40, window=6, sinks=3, cluster_samples=4)
    state = method.new_state(B, H, D)
    state.append(randn(B, H, 30, D), randn(B, H, 30, D))
    state.attend_block(randn(B, H * G, 30, D))
    assert not state.sketched  # 30 tokens fit the budget: nothing sketched, attention is exact
    for t in range(31, 90):
        _, info = state.step(randn(B, H * G, D), randn(B, H, D), randn(B, H, D))
        exact = state.positions[..., : state.exact_end]
        expected = torch.tensor([0, 1, 2, *range(t - 6, t)]) if t > method.budget else None
        if expected is not None:
            assert torch.equal(exact.sort(-1).values, expected.expand(B, H, -1))
            assert int(state.counts.sum()) == B * H * (t - 9)
        assert state.length <= method.budget and int(info.attended.max()) <= method.budget


def test_subgen_states_are_reproducible_from_the_seed():
    outs = []
    for _ in range(2):
        torch.manual_seed(1)
        state = SubGen(budget=20, window=3, cluster_samples=2, seed=7).new_state(B, H, D)
        state.append(randn(B, H, 50, D), randn(B, H, 50, D))
        outs.append(state.step(randn(B, H * G, D), randn(B, H, D), randn(B, H, D))[0])
    assert torch.equal(outs[0], outs[1])


# -- validation ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "make,match",
    [
        (lambda: StreamingLLM(budget=4, sinks=4), r"StreamingLLM.budget must be an int >= 5, got 4"),
        (lambda: StreamingLLM(sinks=-1), r"StreamingLLM.sinks must be an int >= 0, got -1"),
        (lambda: H2O(budget=0), r"H2O.budget must be an int >= 1, got 0"),
        (lambda: H2O(heavy_ratio=1.0), r"H2O.heavy_ratio must be a number in \[0, 1\), got 1.0"),
        (lambda: SnapKV(budget=32), r"SnapKV.budget must be an int >= 33, got 32"),
        (lambda: SnapKV(kernel_size=4), r"SnapKV.kernel_size must be odd.*got 4"),
        (lambda: SnapKV(pooling="mean"), r"SnapKV.pooling must be 'max' or 'avg', got 'mean'"),
        (lambda: SubGen(budget=40), r"SubGen.budget must be an int >= 41, got 40"),
        (lambda: SubGen(value_share=0.0), r"SubGen.value_share must be a number in \(0, 1\), got 0.0"),
        (lambda: SubGen(radius=float("nan")), r"SubGen.radius must be a finite number >= 0, got nan"),
        (lambda: SubGen(window=0), r"SubGen.window must be an int >= 1, got 0"),
    ],
)
def test_invalid_hyperparameters_raise_errors_naming_the_field_and_value(make, match):
    with pytest.raises(ValueError, match=match):
        make()


def test_evicting_states_validate_their_inputs():
    state = H2O(budget=8).new_state(B, H, D)
    with pytest.raises(ValueError, match="keys must have shape"):
        state.append(randn(B, H + 1, 3, D), randn(B, H + 1, 3, D))
    with pytest.raises(ValueError, match="empty state"):
        state.attend(randn(B, H * G, D))
    state.append(randn(B, H, 3, D), randn(B, H, 3, D))
    with pytest.raises(ValueError, match="query must have shape"):
        state.attend(randn(B, H * G + 1, D))


def test_snapkv_prefill_without_queries_keeps_the_most_recent_and_pins_them():
    # `prefill` is `append` with no prompt queries: no votes, so the newest tokens are kept; they are
    # still the prompt, so the ones before the observation window are pinned.
    method = SnapKV(budget=12, observation_window=4)
    state = method.new_state(B, H, D)
    state.prefill(randn(B, H, 30, D), randn(B, H, 30, D))
    state.step(randn(B, H * G, D), randn(B, H, D), randn(B, H, D))
    assert set(state.positions[0, 0].tolist()) == set(range(18, 26)) | set(range(27, 31))
    assert int(pinned(state).sum()) == B * H * 8
