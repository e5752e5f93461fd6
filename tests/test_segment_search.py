"""SegmentSearch: every summary x selector x schedule runs, is exact at full budget, and attends what it reports."""

from dataclasses import dataclass

import pytest
import torch

from hypothesis import given
from hypothesis import strategies as st

from parts import SCHEDULES, SEGMENT_PRESETS, SELECTORS, SUMMARIES, part_id, random_decode
from sparseattn import Centroid, SegmentSearch, TopK, attention_ref, segment_attention_ref
from sparseattn.methods.presets import Radar, RadarAlg1
from sparseattn.schedules.aspect import AspectSchedule
from sparseattn.testing import assert_close

ALL_SCHEDULES = [*SCHEDULES, AspectSchedule(4), AspectSchedule(1.5)]

# (batch, kv_heads, group, head_dim, prefill, decode steps, sinks, window): odd sizes, GQA, batch > 1.
SHAPES = [
    pytest.param((1, 1, 1, 16, 1, 30, 0, 0), id="b1-mha-from-one-token"),
    pytest.param((2, 3, 3, 64, 103, 20, 2, 3), id="b2-gqa3-d64-sinks-window"),
    pytest.param((3, 2, 4, 24, 57, 20, 0, 5), id="b3-gqa4-d24-window"),
]


def decode(method, shape, dtype=torch.float32, seed=0):
    """Prefill then decode with fresh random tokens; yield (state, query, output, selection) per step."""
    *dims, prefill, steps, _, _ = shape
    return random_decode(method, dims, prefill, steps, dtype, seed)


def method_for(summary, selector, schedule, shape, top_k):
    *_, sinks, window = shape
    return SegmentSearch(summary, selector, schedule, top_k=top_k, sinks=sinks, window=window)


def over_every_part_and_shape(test):
    """``test`` parametrized by every summary x selector x schedule, at every shape."""
    test = pytest.mark.parametrize("summary", SUMMARIES, ids=part_id)(test)
    test = pytest.mark.parametrize("selector", SELECTORS, ids=part_id)(test)
    test = pytest.mark.parametrize("schedule", SCHEDULES, ids=part_id)(test)
    return pytest.mark.parametrize("shape", SHAPES)(test)


@over_every_part_and_shape
def test_full_budget_equals_dense_attention(summary, selector, schedule, shape):
    B, H, G, D = shape[:4]
    for state, q, out, info in decode(method_for(summary, selector, schedule, shape, top_k=10**6), shape):
        ref = attention_ref(q.view(B, H, G, D), state.keys, state.values).view(B, H * G, D)
        assert_close(out, ref, torch.float32)
        # Full budget selects every segment without scoring; the scores must still be well formed.
        scores = state.scores(q.view(B, H, G, D))
        assert scores.shape == (B, H, G, info.layout.n_segments) and torch.isfinite(scores).all()


@dataclass(frozen=True)
class RepeatingSelector(TopK):
    """A broken selector that returns its best segment twice."""

    def select(self, scores, k, generator):
        best = super().select(scores, 1, generator)
        return best.expand(*best.shape[:-1], k)


def test_a_selector_returning_a_segment_twice_is_an_error_not_a_wrong_answer():
    state = SegmentSearch(selector=RepeatingSelector(), top_k=2).new_state(1, 1, 8)
    state.prefill(torch.randn(1, 1, 50, 8), torch.randn(1, 1, 50, 8))
    with pytest.raises(ValueError, match="repeated or outside"):
        state.attend(torch.randn(1, 1, 8))


@over_every_part_and_shape
def test_sparse_output_is_attention_over_the_reported_selection(summary, selector, schedule, shape):
    B, H, G, D = shape[:4]
    for state, q, out, info in decode(method_for(summary, selector, schedule, shape, top_k=2), shape):
        ref = segment_attention_ref(q.view(B, H, G, D), state.keys, state.values, info.layout, info.segments)
        assert_close(out, ref.view(B, H * G, D), torch.float32)
        mask = info.to_mask()
        assert torch.equal(info.attended, mask.sum(-1))
        assert int(info.attended.max()) <= info.layout.max_attended(2)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64], ids=str)
def test_low_and_high_precision_inputs_match_the_reference(dtype):
    shape = (2, 2, 3, 32, 77, 12, 1, 2)
    B, H, G, D = shape[:4]
    for state, q, out, info in decode(Radar(top_k=3, n_features=128, sinks=1, window=2), shape, dtype=dtype):
        assert out.dtype == dtype
        ref = segment_attention_ref(q.view(B, H, G, D), state.keys, state.values, info.layout, info.segments)
        assert_close(out, ref.view(B, H * G, D), dtype)


def test_shared_kv_selection_gives_every_query_head_of_a_group_the_same_segments():
    shape = (2, 3, 4, 16, 200, 10, 1, 0)
    B, H, G, D = shape[:4]
    method = Radar(top_k=3, n_features=64, window=4, shared_kv_selection=True)
    for state, q, out, info in decode(method, shape):
        per_head = info.per_query_head.view(B, H, G, -1).sort(-1).values
        assert torch.equal(per_head, per_head[:, :, :1].expand_as(per_head))
        ref = segment_attention_ref(q.view(B, H, G, D), state.keys, state.values, info.layout, info.segments)
        assert_close(out, ref.view(B, H * G, D), torch.float32)


@pytest.mark.parametrize("dtype, norm", [(torch.float64, 1.0), (torch.float32, 80.0)], ids=["f64-unit", "f32-norm80-underflow"])
@pytest.mark.parametrize("summary", SUMMARIES, ids=part_id)
def test_a_groups_scores_are_the_logsumexp_of_its_heads_scores(summary, dtype, norm):
    # Shared selections rank segments by the group's summed mass; a summary's score_group shortcut
    # (Performer adds the heads' features) must equal the logsumexp of its per-head scores. In float32,
    # keys of norm 80 make Performer's feature products underflow, so its exact fallback runs too.
    gen = torch.Generator().manual_seed(7)
    B, H, G, D = 2, 3, 4, 16
    state = SegmentSearch(summary, top_k=2).new_state(B, H, D, dtype=dtype)
    keys = torch.randn(B, H, 150, D, generator=gen, dtype=dtype)
    state.prefill(norm * keys / keys.norm(dim=-1, keepdim=True), torch.randn(B, H, 150, D, generator=gen, dtype=dtype))
    q = norm * torch.randn(B, H, G, D, generator=gen, dtype=dtype) / D**0.5
    per_head = state.scores(q)
    group = state.group_scores(q)
    assert group.shape == (B, H, 1, per_head.shape[-1])
    assert_close(group, torch.logsumexp(per_head, dim=2, keepdim=True), dtype)


def test_chunked_prefill_builds_the_same_structure_as_one_prefill():
    # Holds for schedules whose grid depends on t alone (Algorithm 1's squares, fixed pages); a
    # doubling rule's grid depends on where the rebuilds fell, so chunking legitimately changes it.
    torch.manual_seed(1)
    k, v = torch.randn(1, 2, 300, 16), torch.randn(1, 2, 300, 16)
    q = torch.randn(1, 2, 16)
    method = RadarAlg1(top_k=4, n_features=64)
    whole = method.new_state(1, 2, 16)
    whole.prefill(k, v)
    chunked = method.new_state(1, 2, 16)
    for a in range(0, 300, 70):
        chunked.append(k[:, :, a : a + 70], v[:, :, a : a + 70])
    assert whole.grid == chunked.grid
    out_whole, info_whole = whole.attend(q)
    out_chunked, info_chunked = chunked.attend(q)
    assert torch.equal(info_whole.segments.sort(-1).values, info_chunked.segments.sort(-1).values)
    assert_close(out_chunked, out_whole.double(), torch.float32)


def test_radar_alg1_is_the_papers_composition():
    method = RadarAlg1()
    assert method.top_k == 64
    assert method.summary.n_features == 2048
    assert type(method.selector).__name__ == "TopK"
    assert type(method.schedule).__name__ == "SqrtSchedule" and method.schedule.aspect == 1.0
    assert (method.sinks, method.window) == (0, 0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_dense_on_the_cpu_kernel_is_dense_attention(dtype):
    # Dense(backend="cpu") runs the C kernel over every token: the like-for-like dense baseline.
    from sparseattn import Dense
    from sparseattn.backends.cpu_kernels import cpu_kernel_refusal

    if cpu_kernel_refusal() is not None:
        pytest.skip(f"the C kernel is unavailable: {cpu_kernel_refusal()}")
    shape = (2, 3, 3, 64, 700, 5, 0, 0)
    B, H, G, D = shape[:4]
    for state, q, out, _ in decode(Dense(backend="cpu"), shape, dtype=dtype):
        ref = attention_ref(q.view(B, H, G, D), state.keys, state.values).view(B, H * G, D)
        assert_close(out, ref, dtype)


def test_dense_names_its_backends_and_says_when_the_kernel_cannot_run():
    from sparseattn import Dense

    with pytest.raises(ValueError, match=r"Dense.backend must be one of \('torch', 'triton', 'cpu'\), got 'flash'"):
        Dense(backend="flash")
    state = Dense(backend="cpu").new_state(1, 1, 8, dtype=torch.float64)
    state.prefill(torch.randn(1, 1, 5, 8, dtype=torch.float64), torch.randn(1, 1, 5, 8, dtype=torch.float64))
    with pytest.raises(ValueError, match=r"Dense\(backend='cpu'\) cannot run"):
        state.attend(torch.randn(1, 1, 8, dtype=torch.float64))


# -- what is segmented: never the always-attended tail, never the current token ------------------


def selected_token_ranges(info):
    """``[(start, end)]`` of every selected segment, over all rows and heads."""
    lay = info.layout
    starts = lay.sink_end + info.segments.flatten() * lay.segment_size
    return [(int(a), int(a) + lay.segment_size) for a in starts.unique()]


@given(
    schedule=st.sampled_from(ALL_SCHEDULES),
    selector=st.sampled_from(SELECTORS),
    sinks=st.integers(0, 6),
    window=st.integers(0, 50),
    prefill=st.integers(1, 400),
    top_k=st.integers(1, 6),
)
def test_no_selected_segment_overlaps_the_always_attended_tail(schedule, selector, sinks, window, prefill, top_k):
    # The tail (the window, at least the current token, plus the unsegmented remainder) is attended
    # anyway: a segment inside it would waste the budget. So k segments are k segments outside it,
    # and the tokens attended add up without overlap.
    method = SegmentSearch(Centroid(), selector, schedule, top_k=top_k, sinks=sinks, window=window)
    state = method.new_state(1, 2, 4)
    state.prefill(torch.randn(1, 2, prefill, 4), torch.randn(1, 2, prefill, 4))
    for _ in range(3):
        _, info = state.step(torch.randn(1, 2, 4), torch.randn(1, 2, 4), torch.randn(1, 2, 4))
        lay, t = info.layout, state.length
        assert lay.segment_end <= max(lay.sink_end, t - max(window, 1)) and lay.tail_start == lay.segment_end
        for a, b in selected_token_ranges(info):
            assert lay.sink_end <= a and b <= lay.tail_start
        k = min(top_k, lay.n_segments)
        assert torch.equal(info.attended, torch.full_like(info.attended, lay.sink_end + k * lay.segment_size + lay.tail_size))


@given(
    schedule=st.sampled_from(ALL_SCHEDULES),
    selector=st.sampled_from(SELECTORS),
    sinks=st.integers(0, 3),
    prefill=st.integers(1, 300),
)
def test_the_current_token_is_attended_at_every_t_even_without_a_window(schedule, selector, sinks, prefill):
    # Literal Algorithm 1 seals the current token into a segment at every perfect square, where a
    # selector may then skip it; here it is never sealed.
    method = SegmentSearch(Centroid(), selector, schedule, top_k=1, sinks=sinks, window=0)
    state = method.new_state(1, 1, 4)
    state.prefill(torch.randn(1, 1, prefill, 4), torch.randn(1, 1, prefill, 4))
    for _ in range(12):
        _, info = state.step(torch.randn(1, 1, 4), torch.randn(1, 1, 4), torch.randn(1, 1, 4))
        assert info.to_mask()[..., -1].all()
        assert info.layout.n_segments == 0 or info.layout.segment_end < state.length  # never sealed


# Every segment preset at k = 1, with the sinks and window that radar and radar+ have by default turned off,
# so that nothing but the preset's own rule attends the current token; radar-rerank shortlists just its one segment.
WINDOWLESS_OPTIONS = {"radar": {"sinks": 0, "window": 0}, "radar+": {"sinks": 0}, "radar-rerank": {"shortlist": 1, "factor": 0.0}}
WINDOWLESS_PRESETS = {name: make(top_k=1, **WINDOWLESS_OPTIONS.get(name, {})) for name, make in SEGMENT_PRESETS.items()}


@pytest.mark.parametrize("name", WINDOWLESS_PRESETS)
def test_every_segment_preset_attends_the_current_token_at_every_t_from_the_first(name):
    # Walks t = 1, 2, ..., 300 one token at a time: every perfect square and every rebuild of the
    # authors' rule (64, 144, 288) is crossed. The current token's key is made the least attractive
    # (far from every query) so a selector attends it only if it is always attended.
    state = WINDOWLESS_PRESETS[name].new_state(1, 2, 8)
    state.append(torch.randn(1, 2, 1, 8), torch.randn(1, 2, 1, 8))
    for t in range(2, 301):
        q = torch.randn(1, 2, 8)
        _, info = state.step(q, -10 * q, torch.randn(1, 2, 8))
        assert info.to_mask()[..., t - 1].all(), t
