"""What every registered method does with hostile input (issue 14, defects 3, 4 and 6).

* A huge budget costs nothing until it is used: a state allocates for the tokens it stores.
* A NaN or inf key, value or query is propagated like dense attention does: it shows in the outputs of
  its own (batch row, KV head) at most, never in another row's or head's, and no method raises on it.
* A decode step that fails validation raises ValueError and leaves the state exactly as it was.
* A budget or another int field out of range (or a bool, or a float) is refused by the constructor,
  naming the field, the value and the allowed range, and why the minimum is what it is (defect 9).

Every test runs over the library's registry (``sparseattn.registry.names()``, read at collection), so a
new method is checked as soon as it is registered.
"""

from __future__ import annotations

import pytest
import torch

from sparseattn import H2O, PrefillEviction, SnapKV, StreamingLLM, SubGen, registry
from sparseattn.ops.buffers import GrowableBuffer
from sparseattn.methods.layers import SplitLayers

B, H, G, D = 2, 2, 3, 8  # two batch rows, two KV heads, three query heads per KV head
PROMPT = 100
BUDGET = 48  # at least every method's floor (SnapKV: observation window 32 + 1; SubGen: window 32 + 8 + 1)
NAMES = registry.names()


def build(name: str, budget: int = BUDGET):
    # The builder itself, without the registry's range checks: a budget of 10**23 must reach the method.
    entry = registry.get(name)  # prefill_budget: make snapkv-then-radar evict the prompt
    return entry.build(**entry.takes(budget=budget, n_features=32, prefill_budget=64))


def randn(*shape: int) -> torch.Tensor:
    return torch.randn(*shape, dtype=torch.float64).float()


def allocated_bytes(obj, seen: set[int] | None = None, depth: int = 0) -> int:
    """Bytes of every tensor storage reachable from a decode state (capacity included, each storage once)."""
    seen = set() if seen is None else seen
    if depth > 4:
        return 0
    if isinstance(obj, torch.Tensor):
        storage = obj.untyped_storage()
        if storage.data_ptr() in seen:
            return 0
        seen.add(storage.data_ptr())
        return storage.nbytes()
    if isinstance(obj, GrowableBuffer):
        return allocated_bytes(obj._data, seen, depth + 1)
    if isinstance(obj, (list, tuple)):
        return sum(allocated_bytes(x, seen, depth + 1) for x in obj)
    if isinstance(obj, dict):
        return sum(allocated_bytes(x, seen, depth + 1) for x in obj.values())
    if hasattr(obj, "__dict__") and not isinstance(obj, (type, torch.Generator, torch.device)):
        return sum(allocated_bytes(x, seen, depth + 1) for x in vars(obj).values())
    return 0


# -- a huge budget allocates for what is stored (defect 3) --------------------------------------


def short_run(name: str, budget: int):
    """A 5-token prompt and 3 decode steps under ``budget``; returns the state."""
    torch.manual_seed(0)
    state = build(name, budget).new_state(1, H, D)
    state.append(randn(1, H, 5, D), randn(1, H, 5, D))
    state.attend_block(randn(1, H * G, 5, D))
    for _ in range(3):
        out, _ = state.step(randn(1, H * G, D), randn(1, H, D), randn(1, H, D))
        assert bool(torch.isfinite(out).all())
    return state


@pytest.mark.parametrize("name", NAMES)
def test_a_huge_budget_allocates_for_the_tokens_stored_not_for_the_budget(name):
    modest = allocated_bytes(short_run(name, 64))
    # 10**6 cost SubGen 2.46 GB instead of 1.03 GB on the default model; 10**23 overflowed a tensor size.
    for huge in (10**6, 10**23):
        assert allocated_bytes(short_run(name, huge)) == modest, f"{name} at budget {huge} allocates more than at 64"


def test_subgen_allocates_its_cluster_centers_only_when_it_sketches():
    state = short_run("subgen", 10**6)
    assert not state.sketched and state.nbytes()["sketch"] < 1024
    assert state.centers.numel() == 0  # 62,498 centers per KV head before the fix


# -- NaN and inf are propagated per (row, KV head), never raised on or spread (defect 4) ---------

POISON_STEP = 4  # the decode step (t = PROMPT + 5, not a perfect square) whose inputs carry the poison
STEPS = 12
ROW, KV_HEAD, Q_HEAD = 0, 1, 4  # the poisoned batch row and KV head; query head 4 belongs to KV head 1


def poisoned_run(name: str, poison: str | None):
    """Prefill + decode steps; ``poison`` puts a non-finite number into row 0, KV head 1 (or its query head 4).

    Returns the prefill output ``[B, H_q, PROMPT, D]`` and the step outputs ``[STEPS, B, H_q, D]``.
    """
    torch.manual_seed(0)
    keys, values, queries = randn(B, H, PROMPT, D), randn(B, H, PROMPT, D), randn(B, H * G, PROMPT, D)
    steps = [(randn(B, H * G, D), randn(B, H, D), randn(B, H, D)) for _ in range(STEPS)]
    q, k, v = steps[POISON_STEP]
    if poison == "nan key in the prompt":
        keys[ROW, KV_HEAD, 10] = float("nan")
    elif poison == "nan key":
        k[ROW, KV_HEAD] = float("nan")
    elif poison == "inf key":
        k[ROW, KV_HEAD] = float("inf")
    elif poison == "nan value":
        v[ROW, KV_HEAD] = float("nan")
    elif poison == "nan query":
        q[ROW, Q_HEAD] = float("nan")
    state = build(name).new_state(B, H, D)
    state.append(keys, values)
    prefill = state.attend_block(queries)
    return prefill, torch.stack([state.step(*step)[0] for step in steps])


POISONS = ["nan key in the prompt", "nan key", "inf key", "nan value", "nan query"]


def shares_budget_between_heads(name: str) -> bool:
    """Whether the method splits a row's budget between its heads (a non-uniform allocation)."""
    method = build(name)
    parts = (method.first, method.others) if isinstance(method, SplitLayers) else (getattr(method, "method", method),)  # FirstLayers wraps one
    allocations = [getattr(part, "allocation", None) for part in parts]
    return any(allocation is not None and not allocation.uniform for allocation in allocations)


@pytest.mark.parametrize("poison", POISONS)
@pytest.mark.parametrize("name", NAMES)
def test_a_non_finite_input_shows_only_in_its_own_row_and_kv_head(name, poison):
    clean_prefill, clean = poisoned_run(name, None)
    prefill, out = poisoned_run(name, poison)  # raises nothing (H2O and SnapKV raised "every slot is protected")
    heads = slice(KV_HEAD * G, (KV_HEAD + 1) * G)
    other_heads = [h for h in range(H * G) if not heads.start <= h < heads.stop]
    # The other batch row and the other KV head of the poisoned row decode exactly as without the poison.
    assert torch.equal(out[:, 1 - ROW], clean[:, 1 - ROW]), f"{name}: {poison} in row {ROW} changed row {1 - ROW}"
    if shares_budget_between_heads(name):  # the row's heads split one budget: the others' split may move,
        assert bool(torch.isfinite(out[:, ROW, other_heads]).all()), f"{name}: {poison} spread to another KV head"
    else:  # but never their finiteness
        assert torch.equal(out[:, ROW, other_heads], clean[:, ROW, other_heads]), f"{name}: {poison} spread to another KV head"
    assert torch.equal(prefill[1 - ROW], clean_prefill[1 - ROW])
    assert torch.equal(prefill[ROW, other_heads], clean_prefill[ROW, other_heads])
    # Where dense attention gives NaN, so does every method: the poisoned token is one it attends.
    if poison == "nan key in the prompt":  # dense prefill: every query from position 10 on sees it
        assert not bool(torch.isfinite(prefill[ROW, heads, 10:]).any())
    elif poison in ("nan key", "nan value"):  # the newest token is attended by every method
        assert not bool(torch.isfinite(out[POISON_STEP, ROW, heads]).any())
    elif poison == "nan query":
        assert not bool(torch.isfinite(out[POISON_STEP, ROW, Q_HEAD]).any())
    # Before the poison arrives nothing differs at all.
    if poison != "nan key in the prompt":
        assert torch.equal(out[:POISON_STEP], clean[:POISON_STEP])


# -- a refused step leaves the state unchanged (defect 6) ----------------------------------------


def bad_inputs(bad: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    q, k, v = randn(B, H * G, D), randn(B, H, D), randn(B, H, D)
    if bad == "query heads not a multiple of kv_heads":
        q = randn(B, H * G + 1, D)
    elif bad == "query of the wrong head_dim":
        q = randn(B, H * G, D + 1)
    elif bad == "query of the wrong batch":
        q = randn(B + 1, H * G, D)
    elif bad == "query in float64":
        q = q.double()
    elif bad == "key of the wrong kv_heads":
        k = randn(B, H + 1, D)
    elif bad == "key as a block":
        k = randn(B, H, 1, D)
    elif bad == "key in float16":
        k = k.half()
    elif bad == "value of the wrong head_dim":
        v = randn(B, H, D - 1)
    return q, k, v


BAD = [
    "query heads not a multiple of kv_heads",
    "query of the wrong head_dim",
    "query of the wrong batch",
    "query in float64",
    "key of the wrong kv_heads",
    "key as a block",
    "key in float16",
    "value of the wrong head_dim",
]


def snapshot(state) -> dict:
    """What a refused step must not change: what is stored, how much, and what was counted."""
    return {
        "length": state.length,
        "seen": getattr(state, "seen", None),
        "keys": state.keys.clone(),
        "values": state.values.clone(),
    }


@pytest.mark.parametrize("bad", BAD)
@pytest.mark.parametrize("steps_before", [0, 3], ids=["first-step", "after-3-steps"])
@pytest.mark.parametrize("name", NAMES)
def test_a_refused_step_leaves_the_state_as_it_was(name, steps_before, bad):
    torch.manual_seed(0)
    prompt = (randn(B, H, PROMPT, D), randn(B, H, PROMPT, D), randn(B, H * G, PROMPT, D))
    steps = [(randn(B, H * G, D), randn(B, H, D), randn(B, H, D)) for _ in range(steps_before + 1)]
    bad_q, bad_k, bad_v = bad_inputs(bad)
    states = []
    for sees_bad_call in (False, True):
        state = build(name).new_state(B, H, D)
        state.append(prompt[0], prompt[1])
        state.attend_block(prompt[2])
        for step in steps[:steps_before]:
            state.step(*step)
        if sees_bad_call:
            before = snapshot(state)
            with pytest.raises(ValueError):
                state.step(bad_q, bad_k, bad_v)
            after = snapshot(state)
            assert after["length"] == before["length"], f"{name}: the refused step changed the length"
            assert after["seen"] == before["seen"], f"{name}: the refused step was counted"
            assert torch.equal(after["keys"], before["keys"]) and torch.equal(after["values"], before["values"])
        states.append(state)
    untouched, refused = states
    out_untouched, info_untouched = untouched.step(*steps[steps_before])
    out_refused, info_refused = refused.step(*steps[steps_before])
    assert torch.equal(out_refused, out_untouched), f"{name}: the step after a refused one differs"
    assert torch.equal(info_refused.attended, info_untouched.attended)
    assert refused.length == untouched.length and torch.equal(refused.keys, untouched.keys)


# -- int fields: a bool, a float or a value below the floor is refused by name (defect 9) --------


@pytest.mark.parametrize(
    "make,message",
    [
        (lambda: StreamingLLM(budget=-3), r"StreamingLLM.budget must be an int >= 5, got -3 \(the minimum is sinks \+ 1 = 5"),
        (lambda: StreamingLLM(budget=True), r"StreamingLLM.budget must be an int >= 5, got True"),
        (lambda: StreamingLLM(sinks=2.0), r"StreamingLLM.sinks must be an int >= 0, got 2.0"),
        (lambda: H2O(budget=-3), r"H2O.budget must be an int >= 1, got -3"),
        (lambda: H2O(budget=64.0), r"H2O.budget must be an int >= 1, got 64.0"),
        (lambda: H2O(heavy_ratio=True), r"H2O.heavy_ratio must be a number in \[0, 1\), got True"),
        (lambda: H2O(heavy_ratio=float("nan")), r"H2O.heavy_ratio must be a number in \[0, 1\), got nan"),
        (lambda: SnapKV(budget=-12), r"SnapKV.budget must be an int >= 33, got -12 \(the minimum is observation_window \+ 1"),
        (lambda: SnapKV(observation_window=False), r"SnapKV.observation_window must be an int >= 1, got False"),
        (lambda: SnapKV(kernel_size="5"), r"SnapKV.kernel_size must be an int >= 1, got '5'"),
        (lambda: SubGen(budget=-3), r"SubGen.budget must be an int >= 41, got -3 \(the minimum is sinks \+ window"),
        (lambda: SubGen(cluster_samples=True), r"SubGen.cluster_samples must be an int >= 1, got True"),
        (lambda: SubGen(seed=1.5), r"SubGen.seed must be an int >= 0, got 1.5"),
        (lambda: SubGen(radius=float("inf")), r"SubGen.radius must be a finite number >= 0, got inf"),
        (lambda: SubGen(value_share=False), r"SubGen.value_share must be a number in \(0, 1\), got False"),
        (lambda: PrefillEviction(prefill=SnapKV(budget=-12), decode=H2O()), r"SnapKV.budget must be an int >= 33, got -12"),
        (lambda: PrefillEviction(prefill=SubGen(), decode=H2O()), r"PrefillEviction.prefill must be an eviction policy"),
        (lambda: H2O().new_state(1, 2, 8, layer_idx=-1), r"layer_idx must be an int >= 0, got -1"),
        (lambda: H2O().new_state(True, 2, 8), r"batch must be an int >= 1, got True"),
    ],
)
def test_a_field_out_of_range_is_refused_naming_the_field_the_value_and_the_range(make, message):
    with pytest.raises(ValueError, match=message):
        make()
