"""Quest and the selection ablations as segment-search presets, the prefill-eviction composition, the CLI table."""

from __future__ import annotations

import math
import re

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from typer.testing import CliRunner

from sparseattn import (
    H2O,
    Dense,
    ExactScore,
    FixedSchedule,
    Lowest,
    MinMaxBound,
    PerformerFeatures,
    PrefillEviction,
    Quest,
    Radar,
    RadarExact,
    RadarLowest,
    RadarRandom,
    RadarRecent,
    Random,
    Recent,
    SegmentSearchState,
    SnapKV,
    StreamingLLM,
    SubGen,
    TopK,
)
from sparseattn.cli import app
from sparseattn.methods.presets import RadarAlg1
from sparseattn import registry
from tiny_checkpoint import save_tiny_checkpoint

B, H, G, D = 2, 2, 3, 8


# -- Quest ---------------------------------------------------------------------------------------


@given(
    seed=st.integers(0, 2**31 - 1),
    length=st.integers(17, 90),  # at least one sealed page before the newest token (never sealed)
    head_dim=st.sampled_from([1, 3, 8, 17]),
    key_scale=st.floats(0.01, 30.0),
    page_size=st.sampled_from([1, 2, 5, 16]),
)
def test_quest_page_bound_is_at_least_every_logit_in_its_page(seed, length, head_dim, key_scale, page_size):
    gen = torch.Generator().manual_seed(seed)
    keys = torch.randn(1, 2, length, head_dim, generator=gen, dtype=torch.float64) * key_scale
    query = torch.randn(1, 2, 2, head_dim, generator=gen, dtype=torch.float64)
    state = Quest(top_k=1, page_size=page_size).new_state(1, 2, head_dim, dtype=torch.float64, scale=0.7)
    state.prefill(keys, keys)
    pages = state.layout.n_segments
    bound = state.scores(query) - math.log(page_size)  # [1, 2, 2, pages]
    logits = 0.7 * torch.einsum("bhgd,bhtd->bhgt", query, keys[:, :, : pages * page_size])
    per_page = logits.view(1, 2, 2, pages, page_size)
    slack = 1e-12 * (1 + logits.abs().amax())
    assert bool((bound.unsqueeze(-1) >= per_page - slack).all())
    if page_size == 1:  # a page of one token: the bound is the logit itself
        assert torch.allclose(bound, logits, rtol=1e-12, atol=1e-12)


def test_quest_is_min_max_pages_of_16_ranked_by_their_bound():
    method = Quest()
    assert (method.summary, method.selector, method.schedule, method.top_k) == (MinMaxBound(), TopK(), FixedSchedule(16), 64)
    state = Quest(top_k=2).new_state(B, H, D)
    state.prefill(torch.randn(B, H, 100, D), torch.randn(B, H, 100, D))
    q = torch.randn(B, H * G, D)
    _, info = state.attend(q)
    best = state.scores(q.view(B, H, G, D)).topk(2, dim=-1).indices
    assert torch.equal(info.segments.sort(-1).values, best.sort(-1).values)
    assert info.layout.segment_size == 16 and int(info.attended.max()) == 2 * 16 + 100 % 16


# -- the selection ablations (Figure 7) ----------------------------------------------------------


def test_ablation_presets_swap_only_the_selection_of_algorithm_1():
    radar = RadarAlg1(top_k=5, budget=300)
    for preset, summary, selector in (
        (RadarExact(top_k=5, budget=300), ExactScore(), TopK()),
        (RadarRandom(top_k=5, budget=300, seed=2), ExactScore(), Random(seed=2)),
        (RadarLowest(top_k=5, budget=300), PerformerFeatures(), Lowest()),
        (RadarRecent(top_k=5, budget=300), ExactScore(), Recent()),
    ):
        assert (preset.summary, preset.selector) == (summary, selector)
        assert (preset.schedule, preset.top_k, preset.budget) == (radar.schedule, radar.top_k, radar.budget)


def test_exact_search_attends_the_segments_with_the_largest_true_attention_mass():
    state = RadarExact(top_k=3).new_state(B, H, D, dtype=torch.float64)
    keys = torch.randn(B, H, 120, D, dtype=torch.float64)
    state.prefill(keys, torch.randn(B, H, 120, D, dtype=torch.float64))
    q = torch.randn(B, H * G, D, dtype=torch.float64)
    _, info = state.attend(q)
    lay = info.layout
    seg = keys[:, :, : lay.n_segments * lay.segment_size].view(B, H, lay.n_segments, lay.segment_size, D)
    mass = torch.logsumexp(torch.einsum("bhgd,bhscd->bhgsc", q.view(B, H, G, D), seg) * D**-0.5, dim=-1)
    assert torch.equal(info.segments.sort(-1).values, mass.topk(3, dim=-1).indices.sort(-1).values)


def test_lowest_and_recent_ablations_pick_what_they_say():
    q = torch.randn(B, H * G, D)
    lowest = RadarLowest(top_k=2, n_features=16).new_state(B, H, D)
    recent = RadarRecent(top_k=2).new_state(B, H, D)
    for state in (lowest, recent):
        state.prefill(torch.randn(B, H, 150, D), torch.randn(B, H, 150, D))
    _, info = lowest.attend(q)
    worst = lowest.scores(q.view(B, H, G, D)).topk(2, dim=-1, largest=False).indices
    assert torch.equal(info.segments.sort(-1).values, worst.sort(-1).values)
    _, info = recent.attend(q)
    n = info.layout.n_segments
    assert info.segments.sort(-1).values.unique().tolist() == [n - 2, n - 1]


def test_random_ablation_draws_different_segments_per_step_reproducibly():
    def draws(seed):
        torch.manual_seed(0)
        state = RadarRandom(top_k=2, seed=seed).new_state(1, 1, D)
        state.prefill(torch.randn(1, 1, 200, D), torch.randn(1, 1, 200, D))
        return [state.attend(torch.randn(1, 1, D))[1].segments.sort(-1).values.flatten().tolist() for _ in range(6)]

    assert draws(1) == draws(1) and draws(1) != draws(2)
    assert len({tuple(d) for d in draws(1)}) > 1


# -- prefill eviction, then decode retrieval -----------------------------------------------------


def test_snapkv_compressed_prompt_is_handed_to_radar_which_appends_new_tokens():
    prefill, decode = SnapKV(budget=40, observation_window=8), Radar(top_k=2, n_features=16, window=4)
    composed = PrefillEviction(prefill=prefill, decode=decode).new_state(B, H, D)
    alone = prefill.new_state(B, H, D)
    keys, values, queries = torch.randn(B, H, 150, D), torch.randn(B, H, 150, D), torch.randn(B, H * G, 150, D)
    for state in (composed, alone):
        state.append(keys, values)
        state.attend_block(queries)
    kept_k, kept_v, kept_pos = alone.kept_tokens()
    assert composed.length == 40
    # the decode method receives exactly SnapKV's kept tokens, in order, and then the new ones
    radar = decode.new_state(B, H, D)
    radar.append(kept_k, kept_v)
    for t in range(30):
        q, k, v = torch.randn(B, H * G, D), torch.randn(B, H, D), torch.randn(B, H, D)
        out, info = composed.step(q, k, v)
        ref, ref_info = radar.step(q, k, v)
        assert torch.equal(out, ref) and torch.equal(info.segments, ref_info.segments)
    assert isinstance(composed.decode_state, SegmentSearchState)
    assert composed.length == 40 + 30 and composed.seen == 180
    assert torch.equal(composed.keys[:, :, :40], kept_k)


def test_prefill_eviction_accepts_only_methods_that_hand_over_tokens():
    for ok in (SnapKV(), H2O(), StreamingLLM()):
        PrefillEviction(prefill=ok, decode=Dense())
    for bad in (SubGen(), Radar(), Dense(), SnapKV):
        with pytest.raises(ValueError, match="PrefillEviction.prefill must be an eviction policy"):
            PrefillEviction(prefill=bad, decode=Radar())
    with pytest.raises(ValueError, match="PrefillEviction.decode must be a sparse method instance"):
        PrefillEviction(prefill=SnapKV(), decode=Radar)


# -- the CLI's names -----------------------------------------------------------------------------

NAMES = [
    "dense", "radar", "streamingllm", "h2o", "snapkv", "subgen", "subgen-guarded", "radar-alg1", "quest",
    "radar-exact", "radar-random", "radar-lowest", "radar-recent", "radar+", "radar-centered", "radar-rerank",
    "snapkv-then-radar",
]  # fmt: skip


def test_the_registry_names_every_method():
    known = set(registry.names()) | set(registry.aliases())  # a former name (subgen-guarded) is an alias
    assert set(NAMES) <= known
    with pytest.raises(ValueError, match="unknown method 'lsh'; known methods: dense, radar"):
        registry.build("lsh")


def test_without_a_budget_each_method_runs_at_its_paper_default():
    defaults = {name: registry.build(name) for name in NAMES}
    assert defaults["streamingllm"] == StreamingLLM(budget=1024, sinks=4)
    assert defaults["h2o"] == H2O(budget=1024, heavy_ratio=0.5)
    assert defaults["snapkv"] == SnapKV(budget=2048, observation_window=32)
    assert defaults["subgen"] == SubGen()
    assert defaults["quest"] == Quest(top_k=64, page_size=16)
    assert defaults["radar"] == Radar()  # as the authors ran it: k = 64, 1 sink, window 1024, aspect 4
    assert defaults["radar-alg1"] == RadarAlg1()  # the paper's Algorithm 1
    assert defaults["snapkv-then-radar"] == PrefillEviction(prefill=SnapKV(), decode=Radar())
    options = dict(budget=300, heavy_ratio=0.25, observation_window=16, page_size=8, sinks=2, window=10)

    def build(name: str, **given):
        return registry.build(name, **registry.get(name).takes(**given))

    assert build("h2o", **options) == H2O(budget=300, heavy_ratio=0.25)
    assert build("snapkv", **options) == SnapKV(budget=300, observation_window=16)
    assert build("quest", **options) == Quest(page_size=8, sinks=2, window=10, budget=300)
    assert build("radar", **options) == Radar(sinks=2, window=10, budget=300)
    assert build("radar", budget=512) == Radar(budget=512)  # window min(1024, 512 // 4)
    assert build("radar-alg1", **options) == RadarAlg1(sinks=2, window=10, budget=300)
    assert build("subgen", **options) == SubGen(budget=300, window=10, sinks=2)


def test_sparseattn_methods_lists_every_name_with_options_and_a_description():
    result = CliRunner().invoke(app, ["methods", "--all"], terminal_width=200)
    assert result.exit_code == 0, result.output
    for name in NAMES:
        assert re.search(rf"│ {re.escape(name)} +│", result.output), name
    assert "heavy_ratio (0.5)" in result.output and "observation_window (32)" in result.output


@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory):
    return str(save_tiny_checkpoint(tmp_path_factory.mktemp("generate") / "model"))


@pytest.mark.parametrize("name", registry.names())
def test_generate_runs_every_method_at_one_budget(tiny_checkpoint, name):
    prompt = "".join(f"def f{i}(x): return x + {i}\n" for i in range(6))  # 150 characters, one token each
    # Per-layer budgets (FirstLayers) leave layer 1 of this 2-layer model half the budget: 24 of 48 is below
    # what a segment search can honour at t = 145 (4 sinks + a 20-token tail + one segment; it warns), 32 fits.
    budget = 64 if "layer_factor" in registry.get(name).option_names else 48
    args = ["generate", "--model", tiny_checkpoint, "--method", name, "--budget", str(budget), "--prompt", prompt]
    result = CliRunner().invoke(app, [*args, "--max-new-tokens", "3", "--quiet"], catch_exceptions=False, terminal_width=80)
    assert result.exit_code == 0, result.output
    attended, stored = map(int, re.search(r"attended\s+per\s+step\s+(\d+)\s+of\s+(\d+)\s+stored", result.output).groups())
    if "budget" not in registry.get(name).option_names:  # dense: every past token
        assert attended == stored > 140
    else:
        assert attended <= budget
