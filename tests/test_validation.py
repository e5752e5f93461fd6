"""Bad input raises a ValueError that names the problem."""

import pytest
import torch

from sparseattn import (
    DoublingSchedule,
    FixedSchedule,
    PerformerFeatures,
    Radar,
    SegmentLayout,
    SegmentSearch,
    SqrtSchedule,
)


@pytest.mark.parametrize(
    "make,message",
    [
        (lambda: SegmentSearch(top_k=-1), "top_k"),
        (lambda: SegmentSearch(sinks=1.5), "sinks"),
        (lambda: SegmentSearch(top_k=True), "top_k"),
        (lambda: SegmentSearch(summary="performer"), "Summary protocol"),
        (lambda: SegmentSearch(selector=object()), "Selector protocol"),
        (lambda: SegmentSearch(schedule=FixedSchedule), r"the class FixedSchedule; use FixedSchedule\(\)"),
        (lambda: SegmentSearch(schedule=object()), "Schedule protocol"),
        (lambda: PerformerFeatures(n_features=0), "n_features"),
        (lambda: PerformerFeatures(n_features=7, antithetic=True), "even"),
        (lambda: PerformerFeatures(feature_dtype=torch.int8), "feature_dtype"),
        (lambda: FixedSchedule(0), "size"),
        (lambda: SqrtSchedule(aspect=0), "aspect"),
        (lambda: DoublingSchedule(aspect=-1), "aspect"),
        (lambda: SegmentLayout(length=3, sinks=0, segment_size=2, n_segments=2), "past the sequence length"),
        (lambda: Radar().new_state(0, 1, 8), "batch"),
        (lambda: Radar().new_state(1, 1, 8, dtype=torch.int32), "dtype"),
        (lambda: Radar().new_state(1, 1, 8, scale=-1.0), "scale"),
    ],
)
def test_bad_configuration_is_rejected_with_its_name(make, message):
    with pytest.raises(ValueError, match=message):
        make()


@pytest.fixture
def state():
    s = Radar(top_k=2, n_features=16).new_state(2, 2, 8)
    s.prefill(torch.randn(2, 2, 30, 8), torch.randn(2, 2, 30, 8))
    return s


def test_wrong_key_shape_is_reported(state):
    with pytest.raises(ValueError, match=r"keys must have shape \(2, 2, 'T', 8\), got \(2, 3, 5, 8\)"):
        state.append(torch.randn(2, 3, 5, 8), torch.randn(2, 3, 5, 8))


def test_wrong_dtype_is_reported(state):
    with pytest.raises(ValueError, match="dtype torch.float16 but this state was made for torch.float32"):
        state.append(torch.randn(2, 2, 5, 8).half(), torch.randn(2, 2, 5, 8).half())


def test_query_heads_must_be_a_multiple_of_kv_heads(state):
    with pytest.raises(ValueError, match="multiple of kv_heads=2"):
        state.attend(torch.randn(2, 3, 8))


def test_mismatched_keys_and_values_are_reported(state):
    with pytest.raises(ValueError, match="differ in shape"):
        state.append(torch.randn(2, 2, 5, 8), torch.randn(2, 2, 4, 8))


def test_attending_an_empty_state_is_an_error():
    with pytest.raises(ValueError, match="empty state"):
        Radar().new_state(1, 1, 8).attend(torch.randn(1, 1, 8))
