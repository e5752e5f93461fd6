"""Every part the toolkit ships, for tests that must hold for any combination."""

import torch

from sparseattn import (
    CenteredFeatures,
    Centroid,
    DoublingSchedule,
    ExactScore,
    FixedSchedule,
    Lowest,
    MinMaxBound,
    PerformerFeatures,
    Random,
    Recent,
    Rerank,
    SqrtSchedule,
    TopK,
)

SUMMARIES = [
    PerformerFeatures(n_features=64),
    PerformerFeatures(n_features=64, orthogonal=True, antithetic=True),
    ExactScore(),
    Centroid(),
    MinMaxBound(),
    CenteredFeatures(PerformerFeatures(n_features=64)),
    Rerank(PerformerFeatures(n_features=64), shortlist=3),
    Rerank(Centroid(torch.bfloat16), shortlist=3, per_group=True),  # radar+pooled's: bf16 centroids, one shortlist per group
]
SELECTORS = [TopK(), Lowest(), Random(seed=3), Recent()]
SCHEDULES = [SqrtSchedule(), SqrtSchedule(aspect=2.0), FixedSchedule(7), DoublingSchedule()]


def part_id(part) -> str:
    return repr(part).replace(" ", "")
