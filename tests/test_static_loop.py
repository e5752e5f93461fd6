"""The fixed-shape decode loop: each step attends as the decode state's own step, a whole generation gives
``model.generate``'s greedy tokens, a step reads nothing back to the host, and what it cannot run is refused
at the start."""

from __future__ import annotations

import os

# The Triton kernels run in Triton's interpreter on the CPU; fixed when triton.language is first imported.
os.environ.setdefault("TRITON_INTERPRET", "1")

import dataclasses  # noqa: E402
import math  # noqa: E402
import importlib.util  # noqa: E402
import unittest.mock  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

import sparseattn as sa  # noqa: E402
from hf_models import tiny_model  # noqa: E402
from host_reads import host_reads  # noqa: E402
from sparseattn import registry  # noqa: E402
from sparseattn.hf import cache_kwargs  # noqa: E402
from sparseattn.hf.loop import generate  # noqa: E402
from sparseattn.hf.static_cache import StaticSparseCache  # noqa: E402
from sparseattn.methods.layers import SplitLayers, layer_method  # noqa: E402
from sparseattn.methods.rest import MergedRest  # noqa: E402
import sparseattn.methods.static_step as static_step_module  # noqa: E402
from sparseattn.methods.static_step import SEALING_TAIL, Phase, _segmentable, plan_phase, static_refusal, static_step  # noqa: E402
from sparseattn.ops.buffers import GrowableBuffer  # noqa: E402
from sparseattn.schedules import AspectSchedule, FixedSchedule, SqrtSchedule  # noqa: E402
from sparseattn.summaries import Centroid  # noqa: E402

#: Methods with a fixed-shape step: radar+ (its rerank per group and per head), the preset (a pooled split, layer 0
#: dropping the rest and the others merging it), Quest's bounds on pages sealed every 16 tokens, Radar's random
#: features (AspectSchedule, a window), dense. The state test steps a per-layer method's layer 1.
STEPPED = {
    "radar+": "radar+:budget=96",
    "radar+adaptive": "radar+adaptive:budget=96",
    "radar+ per head, factor 1": lambda: sa.RadarPlus(budget=96, factor=1.0, per_group=False),
    "quest": "quest:budget=64",
    "radar": "radar:budget=96",
    "dense": "dense",
    # Layers whose phases end apart: Quest's (sealing pages) cut short where radar+'s grid is rebuilt.
    "quest, then radar+": lambda: SplitLayers(sa.Quest(budget=96), sa.RadarPlus(budget=96), layers=1),
}


def _method(spec):
    return spec() if callable(spec) else registry.parse(spec).method


def _shared_centroids():
    return sa.SegmentSearch(Centroid(), sa.TopK(), FixedSchedule(4), budget=48, sinks=2, window=5, shared_kv_selection=True)


def _shared_features():  # a summary with its own group score (PerformerFeatures.score_group)
    return sa.SegmentSearch(sa.PerformerFeatures(64), sa.TopK(), SqrtSchedule(), budget=48, sinks=4, shared_kv_selection=True)


def _pooled_shared():  # a pooled split of a shared selection, no rerank, the rest merged per 3 segments
    method = sa.SegmentSearch(Centroid(), sa.TopK(), FixedSchedule(4), budget=48, sinks=2, window=5, shared_kv_selection=True)
    return dataclasses.replace(method, allocation=sa.PooledMass(cap=3.0, floor=0.5), rest=MergedRest(3))


#: The state test's methods beyond STEPPED's.
EXTRA = {
    "shared selection": _shared_centroids,
    "shared random features": _shared_features,
    "pooled shared selection, merged rest": _pooled_shared,
    "radar+ pooled, dropped rest": lambda: sa.RadarPlus(budget=96, aspect=16.0, split="pooled"),
    "radar+ merged rest, one block": lambda: sa.RadarPlus(budget=96, rest="merged", merge=0),
    "rerank on sealed pages, pooled, merged rest": lambda: _sealing_rerank(),
}


def _sealing_rerank():  # a shortlist over a grid that seals every 4 tokens (phases that seal on the device)
    method = sa.SegmentSearch(sa.Rerank(Centroid(), shortlist=6, factor=2.0, per_group=True), sa.TopK(), FixedSchedule(4), budget=40, sinks=2)
    return dataclasses.replace(method, allocation=sa.PooledMass(cap=2.0, floor=0.25), rest=MergedRest(3))


FLOATS = pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["float64 (torch gather)", "float32 (the C kernel)"])


def _stepped_against_the_state(name: str, dtype: torch.dtype, seed: int, prompt: int, new: int) -> list:
    """Step ``name``'s layer-1 method through ``new`` tokens after a ``prompt``, phase by phase, asserting each output
    equals the decode state's own step (and the state's structure after the run); returns the phases."""
    method = layer_method(EXTRA[name]() if name in EXTRA else _method(STEPPED[name]), 1, 2)
    if name == "dense" and dtype == torch.float32:
        method = sa.Dense(backend="cpu")  # the kernel's dense: the tokens before the phase read as its region by its kernel
    B, H, G, D = 2, 2, 3, 8
    gen = torch.Generator().manual_seed(seed)
    keys = 2 * torch.randn(B, H, prompt + new, D, dtype=dtype, generator=gen)
    values = torch.randn(B, H, prompt + new, D, dtype=dtype, generator=gen)
    queries = 2 * torch.randn(new, B, H * G, D, dtype=dtype, generator=gen)
    eager, fixed = method.new_state(B, H, D, dtype=dtype), method.new_state(B, H, D, dtype=dtype)
    tolerance = 1e-10 if dtype == torch.float64 else 2e-5
    if dtype == torch.float64 and getattr(method, "rest", None) is not None:
        tolerance = 1e-6  # the state keeps each segment's sums in float32 (the eager float64 step gathers the keys instead)
    eager.append(keys[:, :, :prompt], values[:, :, :prompt])
    fixed.append(keys[:, :, :prompt], values[:, :, :prompt])
    step = static_step(fixed, prompt + new)
    position = torch.tensor([prompt])
    length, phases = prompt + 1, []
    while length <= prompt + new:
        phase = step.plan(length, prompt + new)
        step.begin(phase)
        phases.append(phase)
        for i in range(phase.steps):
            t = length - 1
            want, _ = eager.step(queries[t - prompt], keys[:, :, t], values[:, :, t])
            got = step.step(queries[t - prompt], keys[:, :, t], values[:, :, t], position)
            position += 1
            torch.testing.assert_close(got, want, rtol=tolerance, atol=tolerance)
            if isinstance(phase, Phase):  # the grid the phase planned for the step is the one the state built
                assert eager.grid == phase.grid_at(i)
            length += 1
    step.finish(prompt + new)
    assert fixed.length == eager.length and torch.equal(fixed.keys, eager.keys)
    if isinstance(phase, Phase):  # what the steps sealed on the device is the state's: its grid, summaries and sums
        assert fixed.grid == eager.grid
        for mine, theirs in zip(fixed._summaries + fixed._segment_sums + fixed._rest_sums, eager._summaries + eager._segment_sums + eager._rest_sums):
            assert len(mine) == len(theirs)
            if len(theirs):
                torch.testing.assert_close(mine.view(), theirs.view(), rtol=tolerance, atol=tolerance)
    return phases


@FLOATS
@pytest.mark.parametrize("name", [*STEPPED, *EXTRA])
@settings(max_examples=4, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), prompt=st.one_of(st.integers(1, 6), st.integers(40, 260)), new=st.integers(1, 45))
def test_the_fixed_shape_step_attends_as_the_decode_state(name, dtype, seed, prompt, new):
    """Step for step, across seals and rebuilds, the output equals the state's own step: in float64 the step's
    region is a torch gather (no backend kernel runs float64), in float32 the kernel the state's step runs."""
    _stepped_against_the_state(name, dtype, seed, prompt, new)


@FLOATS
@pytest.mark.parametrize("name", ["dense", "quest", "rerank on sealed pages, pooled, merged rest"])
@settings(max_examples=3, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), prompt=st.integers(1, 200), new=st.integers(20, 60))
def test_a_phase_ends_where_its_tail_would_pass_its_reach(name, dtype, seed, prompt, new):
    """The tail a step reads (copied whole) is bounded: with SEALING_TAIL at 4, a phase whose tail grows (dense's,
    or one that seals segments) ends where it would pass max(4, 2 sqrt t), and the steps still attend as the state's
    own across the many phases this makes (dense's region then moves at each phase: every token before it)."""
    with unittest.mock.patch.object(static_step_module, "SEALING_TAIL", 4):
        phases = _stepped_against_the_state(name, dtype, seed, prompt, new)
    for phase in phases:  # (a phase that seals nothing has the schedule's own tail: a segment's worth and the window)
        if not isinstance(phase, Phase) or phase.segments[-1] > phase.segments[0]:
            assert phase.last - phase.tail_start <= max(4, 2 * math.isqrt(phase.last))
    if name == "dense":  # laid end to end, each ended where one more step would pass the reach
        assert [p.first for p in phases[1:]] == [p.last + 1 for p in phases[:-1]] and phases[-1].last == prompt + new
        assert all(p.last + 1 - p.tail_start > max(4, 2 * math.isqrt(p.last + 1)) for p in phases[:-1])
        assert len(phases) > 1 or new <= max(4, 2 * math.isqrt(prompt + new))


@settings(max_examples=60, deadline=None)
@given(
    schedule=st.sampled_from([SqrtSchedule(), SqrtSchedule(aspect=8.0), AspectSchedule(4.0), FixedSchedule(16), FixedSchedule(3)]),
    sinks=st.integers(0, 6), window=st.integers(0, 40), budget=st.integers(20, 300),
    first=st.integers(1, 3000), steps=st.integers(1, 400),
)  # fmt: skip
def test_phases_cover_the_steps_and_keep_the_grid_the_schedule_plans(schedule, sinks, window, budget, first, steps):
    """Phases, laid end to end, are the steps; in each, the schedule (asked token by token, as a state asks it)
    keeps the phase's grid, and the next phase starts where it plans another."""
    method = sa.SegmentSearch(Centroid(), sa.TopK(), schedule, sinks=sinks, window=window, budget=budget)
    grid, length, last = None, first, first + steps - 1
    incremental = None
    for n in range(0, first):  # the grids a state built before the first step, token by token
        incremental = schedule.plan(max(0, n - min(sinks, n) - max(window, 1)), incremental) if n else None
    grid = incremental
    while length <= last:
        phase = plan_phase(method, grid, length, last)
        assert phase.first == length and 1 <= phase.steps <= last - length + 1
        for i in range(phase.steps):
            n = length + i
            grid = schedule.plan(max(0, n - min(sinks, n) - max(window, 1)), grid)
            assert grid == phase.grid_at(i)
            assert phase.tail_starts[i] == phase.sink_end + grid.covered
            assert phase.attended(i) <= max(budget, phase.sink_end + grid.segment_size + n - phase.tail_starts[i])
        length += phase.steps
        if length <= last:  # the next phase starts where the schedule rebuilds, or its grid had no segment to grow
            n = length
            after = schedule.plan(max(0, n - min(sinks, n) - max(window, 1)), grid)
            assert after.is_rebuild_of(grid) or after.n_segments > grid.n_segments + 1 or phase.grid.n_segments == 0 or (
                min(sinks, n) != phase.sink_end) or n - phase.tail_start > max(SEALING_TAIL, 2 * math.isqrt(n))


def test_a_phase_seals_segments_until_the_schedule_rebuilds():
    """A phase spans the seals of a grid (each step seals at most one segment, on the device) and ends where the
    schedule rebuilds or its widest tail would pass SEALING_TAIL (256) tokens: Quest's pages (sealed every 16 tokens,
    never rebuilt) make phases of ~240 steps, not 16; radar+'s grid (rebuilt at every perfect square, nothing sealed
    between) one per ~2 sqrt(t) tokens."""
    quest = _method("quest:budget=1024")
    phase = plan_phase(quest, quest.schedule.plan(_segmentable(quest, 4000), None), 4001, 5000)
    assert 230 <= phase.steps <= 256 and phase.tail <= SEALING_TAIL and phase.segments[-1] - phase.segments[0] >= 14
    assert all(b - a in (0, 1) for a, b in zip(phase.segments, phase.segments[1:]))
    plus = _method("radar+:budget=1024")
    phase = plan_phase(plus, plus.schedule.plan(_segmentable(plus, 4000), None), 4001, 5000)
    after = plus.schedule.plan(_segmentable(plus, phase.last + 1), phase.grid_at(phase.steps - 1))
    assert phase.steps == 100 and after.is_rebuild_of(phase.grid_at(phase.steps - 1))


def _model(name: str = "llama"):
    model = tiny_model(name)
    with torch.no_grad():  # the pad token's zero embedding would make every score tie (and ties break either way)
        model.get_input_embeddings().weight[0].normal_()
    return model


@pytest.mark.parametrize("architecture", ["llama", "qwen3"])
@pytest.mark.parametrize("name", list(STEPPED))
def test_the_loop_gives_model_generate_s_greedy_tokens(architecture, name):
    model = _model(architecture)
    method = _method(STEPPED[name])
    ids = torch.randint(3, 97, (2, 300), generator=torch.Generator().manual_seed(1))
    with sa.apply(model, method) as sparse:
        want = model.generate(ids, max_new_tokens=40, do_sample=False, **cache_kwargs(model, sparse.new_cache()))[:, 300:]
    got = generate(model, ids, method, 40)
    assert torch.equal(got.tokens, want)
    # radar+'s grid is rebuilt within the 40 steps (a new phase); Quest's pages and Radar's grid seal segments
    # on the device within one phase; dense has one (its phases end every max(256, 2 sqrt t) steps).
    assert got.phases >= (2 if "radar+" in name else 1)
    assert model.config._attn_implementation == "sdpa"  # the loop removed what it applied


@pytest.mark.parametrize("name", ["dense", "quest"])
def test_the_loop_over_many_short_phases_gives_model_generate_s_tokens(name):
    """With SEALING_TAIL at 4, dense's and Quest's phases end every ~2 sqrt t steps (dense's region moving to
    every token before the phase): the tokens are still ``model.generate``'s."""
    model = _model()
    method = _method(STEPPED[name])
    ids = torch.randint(3, 97, (2, 100), generator=torch.Generator().manual_seed(3))
    with sa.apply(model, method) as sparse:
        want = model.generate(ids, max_new_tokens=60, do_sample=False, **cache_kwargs(model, sparse.new_cache()))[:, 100:]
    with unittest.mock.patch.object(static_step_module, "SEALING_TAIL", 4):
        got = generate(model, ids, method, 60)
    assert torch.equal(got.tokens, want) and got.phases >= 3


@pytest.mark.parametrize("name", ["radar+", "quest"])
def test_a_chunked_prefill_gives_the_one_pass_tokens(name):
    """The prompt in passes of 128 (and a last short one) builds the cache one pass builds: the same tokens."""
    model = _model()
    ids = torch.randint(3, 97, (2, 300), generator=torch.Generator().manual_seed(6))
    method = _method(STEPPED[name])
    assert torch.equal(generate(model, ids, method, 20, prefill_chunk=128).tokens, generate(model, ids, method, 20).tokens)


@pytest.mark.parametrize("name", ["radar+", "radar+adaptive", "quest"])  # quest: steps that seal pages on the device
def test_a_decode_step_reads_nothing_back_to_the_host(name):
    """Every layer's step, through the model: no read of a device tensor on the host, no Python number written in."""
    model = _model()
    method = _method(STEPPED[name])
    ids = torch.randint(3, 97, (2, 300), generator=torch.Generator().manual_seed(2))
    with sa.apply(model, method) as sparse, torch.no_grad():
        cache = sparse.new_cache()
        token = model(ids, logits_to_keep=1, **cache_kwargs(model, cache)).logits[:, -1].argmax(-1, keepdim=True)
        static = StaticSparseCache(cache, 340)
        static.begin(301, 339)

        def step():
            out = model(input_ids=token, position_ids=static.position.view(1, 1), logits_to_keep=1, **cache_kwargs(model, static))
            token.copy_(out.logits[:, -1].argmax(-1, keepdim=True))
            static.position.add_(1)

        reads = host_reads(step)
    assert reads == [], reads


def test_the_spy_finds_a_host_read():
    """The spy above can fail: the eager step reads its layout's numbers, and a length read back is caught."""
    position = torch.tensor([3])
    assert host_reads(lambda: int(position + 1)) == ["aten._local_scalar_dense.default"]


@pytest.mark.parametrize(
    "spec, options, message",
    [
        ("radar+:budget=96,rest=sampled", {}, "layer 0: its rest part SampledRest"),
        ("streamingllm:budget=96", {}, "EvictingState|has no fixed-shape step"),
        ("radar+:budget=96", {"graphs": True}, "graphs=True captures CUDA graphs"),
        ("radar+:budget=96", {"graphs": True, "compile": True}, "graphs=True and compile=True"),
        ("radar+:budget=96", {"max_new_tokens": 0}, "max_new_tokens must be an int >= 1"),
        ("radar+:budget=96", {"input_ids": torch.arange(5)}, "input_ids must be a \\[batch, prompt\\]"),
        ("radar+:budget=96", {"max_new_tokens": 900}, "exceeds the model's max_position_embeddings 1024"),
        ("radar+:budget=96", {"prefill_chunk": -1}, "prefill_chunk must be an int >= 0"),
    ],
)
def test_what_the_loop_cannot_run_is_refused_before_any_work(spec, options, message):
    model = _model()
    calls = []
    handle = model.register_forward_pre_hook(lambda *a: calls.append(1))
    arguments = {"input_ids": torch.randint(3, 97, (1, 200)), "max_new_tokens": 8, **options}
    ids, n = arguments.pop("input_ids"), arguments.pop("max_new_tokens")
    with pytest.raises(ValueError, match=message):
        generate(model, ids, _method(spec), n, **arguments)
    handle.remove()
    assert calls == [] and model.config._attn_implementation == "sdpa"


def test_sliding_window_layers_are_refused():
    model = tiny_model("mistral-sliding")
    with pytest.raises(ValueError, match="sliding-window or other"):
        generate(model, torch.randint(3, 97, (1, 50)), _method("radar+:budget=32"), 4)


def test_static_refusal_names_the_part():
    assert static_refusal(_method("radar+:budget=96")) is None
    assert "Rerank's prefilter" in static_refusal(_method("radar+:budget=96,prefilter=4"))
    assert "TopK" in static_refusal(dataclasses.replace(_method("quest:budget=64"), selector=sa.Random(0)))
    assert "rest part" in static_refusal(_method("radar+:budget=96,rest=sampled"))
    assert "TopP" in static_refusal(_method("radar+:budget=96,split=topp"))
    assert static_refusal(_method("radar+adaptive:budget=96"), n_layers=30) is None
    # Radar's random features step in fixed shapes, but their score reads a flag back to the host: not for a graph.
    assert static_refusal(_method("radar:budget=96")) is None
    assert "reads a value back to the host" in static_refusal(_method("radar:budget=96"), capture=True)


def test_a_reserved_buffer_keeps_its_storage_and_counts_what_was_written():
    buf = GrowableBuffer(dim=1)
    buf.append(torch.arange(6.0).view(1, 6))
    buf.reserve(40)
    storage = buf.storage
    assert buf.capacity == 40 and torch.equal(buf.view(), torch.arange(6.0).view(1, 6))
    storage[0, 6:9] = torch.tensor([6.0, 7.0, 8.0])  # written in place, as a fixed-shape step does
    buf.fill_to(9)
    buf.append(torch.tensor([[9.0]]))
    assert buf.storage.data_ptr() == storage.data_ptr() and torch.equal(buf.view(), torch.arange(10.0).view(1, 10))
    with pytest.raises(ValueError, match="must be in \\[0, 40\\]"):
        buf.fill_to(41)
    with pytest.raises(ValueError, match="append a first block"):
        GrowableBuffer().reserve(4)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["radar+", "dense"])
def test_the_compiled_loop_gives_the_eager_loop_s_tokens(name):
    model = _model()
    ids = torch.randint(3, 97, (2, 300), generator=torch.Generator().manual_seed(3))
    method = _method(STEPPED[name])
    eager = generate(model, ids, method, 24)
    compiled = generate(model, ids, method, 24, compile=True)
    assert torch.equal(compiled.tokens, eager.tokens)


@pytest.mark.gpu  # scripts/gpu-check.sh's contract step runs it
@pytest.mark.skipif(not torch.cuda.is_available(), reason="captures CUDA graphs: needs a CUDA GPU")
@pytest.mark.parametrize("name", ["radar+", "radar+adaptive", "quest", "dense"])
def test_the_captured_loop_gives_the_eager_loop_s_tokens(name):
    model = _model().cuda()
    ids = torch.randint(3, 97, (2, 300), generator=torch.Generator().manual_seed(4)).cuda()
    method = _method(STEPPED[name])
    eager = generate(model, ids, method, 40)
    captured = generate(model, ids, method, 40, graphs=True)
    assert torch.equal(captured.tokens, eager.tokens)
    assert captured.captures >= 1


def test_positions_not_yet_written_are_zeros_so_a_zero_weight_stays_zero():
    """A fixed-shape step multiplies the reserved positions past the length by weight 0: they must not hold NaN."""
    buf = GrowableBuffer(dim=0)
    buf.append(torch.full((4,), float("nan")))
    buf.truncate(2)  # the old entries 2, 3 are past the length now
    buf.reserve(8)
    assert torch.equal(buf.storage[2:], torch.zeros(buf.capacity - 2)) and buf.storage[:2].isnan().all()


def _triton_runs() -> bool:
    if importlib.util.find_spec("triton") is None:
        return False
    from sparseattn.backends.triton_backend import interpreting

    return torch.cuda.is_available() or interpreting()


@pytest.mark.gpu  # also on the CPU, in the interpreter; compiled in scripts/gpu-check.sh's contract step
@pytest.mark.skipif(not _triton_runs(), reason="needs triton (its interpreter on the CPU: TRITON_INTERPRET=1 before it is imported)")
@pytest.mark.parametrize("name", ["radar+", "radar+adaptive", "quest", "dense"])
def test_the_fixed_shape_step_runs_the_triton_kernels(name):
    """What a GPU runs (in Triton's interpreter here): the region by the Triton kernel, the rerank's masses by its
    log-mass kernel; step for step as the state's own Triton step."""
    layer_1 = layer_method(_method(STEPPED[name]), 1, 2)  # the preset's: pooled, its rest merged
    method = sa.Dense(backend="triton") if name == "dense" else dataclasses.replace(layer_1, backend="triton")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    B, H, G, D, prompt, new = 1, 2, 2, 16, 300, 20
    gen = torch.Generator().manual_seed(5)
    keys, values = (torch.randn(B, H, prompt + new, D, generator=gen).to(device) for _ in range(2))
    queries = torch.randn(new, B, H * G, D, generator=gen).to(device)
    eager, fixed = (method.new_state(B, H, D, device=device) for _ in range(2))
    eager.append(keys[:, :, :prompt], values[:, :, :prompt])
    fixed.append(keys[:, :, :prompt], values[:, :, :prompt])
    step = static_step(fixed, prompt + new)
    position = torch.tensor([prompt], device=device)
    length = prompt + 1
    while length <= prompt + new:
        phase = step.plan(length, prompt + new)
        step.begin(phase)
        for _ in range(phase.steps):
            t = length - 1
            want, _ = eager.step(queries[t - prompt], keys[:, :, t], values[:, :, t])
            got = step.step(queries[t - prompt], keys[:, :, t], values[:, :, t], position)
            position += 1
            torch.testing.assert_close(got, want, rtol=2e-5, atol=2e-5)
            length += 1
    assert type(step._lse_backend(queries[0].view(B, H, G, D))).__name__ == "TritonBackend"
    last = prompt + new - 1  # the last step again, at its own position: nothing read back to the host (a graph captures it)
    assert host_reads(lambda: step.step(queries[-1], keys[:, :, last], values[:, :, last], position - 1)) == []


@pytest.mark.parametrize("name", ["dense", "radar+"])
def test_a_phase_past_the_reserved_capacity_is_refused_before_any_work(name):
    method = layer_method(_method(STEPPED[name]), 1, 2)
    state = method.new_state(1, 2, 8, dtype=torch.float64)
    state.append(torch.randn(1, 2, 50, 8, dtype=torch.float64), torch.randn(1, 2, 50, 8, dtype=torch.float64))
    step = static_step(state, 52)
    phase = step.plan(51, 70)  # planned past the 52 tokens reserved
    assert phase.last > 52
    with pytest.raises(ValueError, match="past the reserved capacity 52"):
        step.begin(phase)
    assert step.phase is None and state.length == 50
