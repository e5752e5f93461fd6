"""Every part the toolkit ships, for tests that must hold for any combination, a small instance of every
segment-search preset, and a decode loop over random tokens."""

import torch

from sparseattn import (
    CenteredFeatures,
    Centroid,
    CentroidSpread,
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
from sparseattn.methods.presets import (
    Quest,
    Radar,
    RadarAlg1,
    RadarCentered,
    RadarExact,
    RadarLowest,
    RadarRandom,
    RadarRecent,
    RadarRerank,
)
from sparseattn.methods.radar_plus import RadarPlus

SUMMARIES = [
    PerformerFeatures(n_features=64),
    PerformerFeatures(n_features=64, orthogonal=True, antithetic=True),
    ExactScore(),
    Centroid(),
    MinMaxBound(),
    CenteredFeatures(PerformerFeatures(n_features=64)),
    Rerank(PerformerFeatures(n_features=64), shortlist=3),
    Rerank(Centroid(torch.bfloat16), shortlist=3, per_group=True),  # radar+pooled's: bf16 centroids, one shortlist per group
    Rerank(CentroidSpread(), shortlist=3, per_group=True),  # radar+:coarse=spread
]
SELECTORS = [TopK(), Lowest(), Random(seed=3), Recent()]
SCHEDULES = [SqrtSchedule(), SqrtSchedule(aspect=2.0), FixedSchedule(7), DoublingSchedule()]


def part_id(part) -> str:
    return repr(part).replace(" ", "")


#: Every segment-search preset by its registry name, as ``make(**options)``: small (16 features, pages
#: of 4, a shortlist of 2 unless ``options`` say otherwise) so that a test can run each one many times.
SEGMENT_PRESETS = {
    "radar": lambda **kw: Radar(n_features=16, **kw),
    "radar-alg1": lambda **kw: RadarAlg1(n_features=16, **kw),
    "quest": lambda **kw: Quest(page_size=4, **kw),
    "radar+": lambda **kw: RadarPlus(**kw),
    "radar-exact": lambda **kw: RadarExact(**kw),
    "radar-lowest": lambda **kw: RadarLowest(n_features=16, **kw),
    "radar-random": lambda **kw: RadarRandom(seed=1, **kw),
    "radar-recent": lambda **kw: RadarRecent(**kw),
    "radar-centered": lambda **kw: RadarCentered(n_features=16, **kw),
    "radar-rerank": lambda **kw: RadarRerank(**{"n_features": 16, "shortlist": 2, **kw}),
}


def random_decode(method, shape, prompt, steps, dtype=torch.float32, seed=0, draw=torch.float32):
    """Append ``prompt`` random tokens, then decode ``steps`` more; yield (state, query, out, info) per step.

    ``shape = (B, H_kv, G, D)``. Every tensor is drawn in ``draw`` from one generator seeded ``seed``,
    then cast to ``dtype``.
    """
    B, H, G, D = shape
    gen = torch.Generator().manual_seed(seed)
    rand = lambda *s: torch.randn(*s, generator=gen, dtype=draw).to(dtype)  # noqa: E731
    state = method.new_state(B, H, D, dtype=dtype)
    state.append(rand(B, H, prompt, D), rand(B, H, prompt, D))
    for _ in range(steps):
        q = rand(B, H * G, D)
        out, info = state.step(q, rand(B, H, D), rand(B, H, D))
        yield state, q, out, info
