"""The selection-gap ceilings (issue 49, item 4): each is what its name says, checked by brute force, and they nest."""

import itertools

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from sparseattn.evaluation.selection_gap import WHERE, pooled_mask, selection_ceilings, top_mass, where_masks
from sparseattn.ops.attention import segment_mask
from sparseattn.ops.layout import SegmentLayout

F64 = torch.float64
EPS = 1e-12


def random_step(seed: int, B=2, H=2, G=3, sinks=2, c=3, S=7, tail=2, k=3):
    """Exact attention ``[B, H G, t]`` and a random segment selection (up to ``k`` per query head) on a layout."""
    gen = torch.Generator().manual_seed(seed)
    layout = SegmentLayout(length=sinks + S * c + tail, sinks=sinks, segment_size=c, n_segments=S)
    t = layout.length
    probs = torch.softmax(3 * torch.randn(B, H * G, t, generator=gen, dtype=F64), dim=-1)
    segments = torch.stack([torch.randperm(S, generator=gen)[:k] for _ in range(B * H * G)]).reshape(B, H, G, k)
    valid = torch.rand(B, H, G, k, generator=gen) < 0.7
    mask = segment_mask(layout, segments, G, valid).reshape(B, H * G, t)
    merged = torch.randint(0, 3, (B, H * G), generator=gen)
    return probs, mask, mask.sum(-1) + merged, layout


def test_top_mass_is_the_sum_of_the_largest_entries():
    values = torch.tensor([[0.1, 0.5, 0.2, 0.2], [0.4, 0.3, 0.2, 0.1]], dtype=F64)
    assert top_mass(values, torch.tensor([2, 0])).tolist() == pytest.approx([0.7, 0.0])
    assert top_mass(values, torch.tensor([9, 4])).tolist() == pytest.approx([1.0, 1.0])  # more than there are: all


def test_pooled_mask_takes_each_rows_total_over_all_heads():
    values = torch.tensor([[[0.9, 0.1], [0.8, 0.7]], [[0.1, 0.2], [0.3, 0.4]]], dtype=F64)
    mask = pooled_mask(values, torch.tensor([3, 1]))
    assert mask[0].tolist() == [[True, False], [True, True]]
    assert mask[1].tolist() == [[False, False], [False, True]]


def test_where_sorts_every_position_once():
    masks = where_masks(600)
    assert masks.sum(0).tolist() == [1] * 600  # each position in exactly one place
    assert [int(m.sum()) for m in masks] == [4, 64, 448, 84]
    assert len(WHERE) == masks.shape[0]


@given(seed=st.integers(0, 2**31 - 1))
def test_the_ceilings_nest_as_the_decomposition_needs(seed):
    """pooled >= per_head >= grid_per_head >= method, summed over a row's heads (pooled, grid_pooled: the row's
    total is what pooling maximises); per head, per_head and grid_per_head bound the method's own selection."""
    probs, mask, spent, layout = random_step(seed)
    kept, missed, oracle = selection_ceilings(probs, mask, spent, layout)
    row = {name: mass.sum(-1) for name, mass in kept.items()}
    assert (row["pooled"] >= row["per_head"] - EPS).all()
    assert (row["grid_pooled"] >= row["grid_per_head"] - EPS).all()
    assert (kept["per_head"] >= kept["grid_per_head"] - EPS).all()
    assert (kept["grid_per_head"] >= kept["method"] - EPS).all()
    assert (kept["method"] == (probs * mask).sum(-1)).all()
    assert (oracle.sum((1, 2)) == spent.sum(-1)).all()  # the oracle spends the method's whole budget
    assert torch.allclose(missed.sum(-1), (probs * (oracle & ~mask)).sum(-1))


@pytest.mark.parametrize("seed", range(5))
def test_the_ceilings_equal_brute_force(seed):
    """Each ceiling against an enumeration: the best token sets and segment sets of the given sizes."""
    probs, mask, spent, layout = random_step(seed, B=1, H=1, G=2, S=5, k=2)
    kept, _, _ = selection_ceilings(probs, mask, spent, layout)
    p, t = probs[0], probs.shape[-1]
    lo, hi, c = layout.sink_end, layout.segment_end, layout.segment_size
    inside = torch.zeros(t, dtype=torch.bool)
    inside[lo:hi] = True
    for h in range(p.shape[0]):
        n = int(mask[0, h].sum())
        assert float(kept["per_head"][0, h]) == pytest.approx(max(
            float(p[h, list(s)].sum()) for s in itertools.combinations(range(t), n)))  # fmt: skip
        m = int(mask[0, h, lo:hi].reshape(-1, c).any(-1).sum())
        outside = float((p[h] * mask[0, h] * ~inside).sum())
        best = max(sum(float(p[h, lo + s * c : lo + (s + 1) * c].sum()) for s in chosen)
                   for chosen in itertools.combinations(range(layout.n_segments), m))  # fmt: skip
        assert float(kept["grid_per_head"][0, h]) == pytest.approx(outside + best)
    total = int(spent.sum())
    flat = sorted(p.flatten().tolist(), reverse=True)
    assert float(kept["pooled"].sum()) == pytest.approx(sum(flat[:total]))


def test_grid_ceilings_are_nan_without_a_layout():
    probs, mask, spent, _ = random_step(0)
    kept, _, _ = selection_ceilings(probs, mask, spent, None)
    assert kept["grid_pooled"].isnan().all() and kept["grid_per_head"].isnan().all()
    assert not kept["per_head"].isnan().any()


def test_the_benchmark_splits_each_models_loss_into_its_parts():
    """benchmarks/selection_gap.py on a tiny model: per layer the split, grid and ranking parts add up to what the
    method lost against the pooled oracle, and the JSON's rows are per query head."""
    import importlib.util
    from pathlib import Path

    from hf_models import tiny_model
    from sparseattn import registry

    spec = importlib.util.spec_from_file_location("selection_gap_bench", Path(__file__).parents[1] / "benchmarks" / "selection_gap.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    model = tiny_model("llama")
    ids = torch.randint(3, 97, (900,), generator=torch.Generator().manual_seed(0))
    for name in ("radar+adaptive", "radar+adaptive:factor=1", "quest"):
        summary = bench.probe_text(model, registry.parse(name, 128).method, ids, 890, 4)
        layers = bench.layer_means(summary)
        assert len(layers) == 2
        for row in layers:
            lost = bench.losses(row)
            assert lost["split"] + lost["grid"] + lost["ranking"] == pytest.approx(lost["total"], abs=1e-4)
            assert lost["total"] >= -1e-4 and lost["grid"] >= -1e-4 and lost["ranking"] >= -1e-4
        heads = bench.per_head(summary)
        assert len(heads) == 2 and len(heads[0]["kept"]["method"]) == 6
