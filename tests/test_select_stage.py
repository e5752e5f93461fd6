"""A part of a new type plugs into a segment search's stages without a change to its decode state.

* A user-defined select stage (``SelectStage.select_segments``) runs through ``SegmentSearchState``
  on every backend, and the output is dense attention (float64) over exactly the segments a naive
  reference picks: each selection's ``k`` best by exact log mass, less those holding under ``share``
  of its attention mass (per KV group when the group shares one selection).
* A user-defined rest (``Rest``) is called by the attend stage in both its forms.
* A part lacking its slot's hook is refused when the method is built, naming the protocol.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import pytest
import torch
from parts import random_decode

import sparseattn as sa
from sparseattn.allocations import SelectStage, Selection, log_total_mass
from sparseattn.methods.rest import Rest
from sparseattn.ops.attention import attention_ref
from sparseattn.ops.tokens import token_attention
from sparseattn.testing import assert_close

B, H, G, D = 2, 3, 2, 16
SINKS, WINDOW, SIZE, K = 3, 5, 7, 5  # odd sizes: segments of 7, a 5-token window


@dataclass(frozen=True)
class DropFaint:
    """The selector's k picks, less those estimated to hold under ``share`` of their head's attention."""

    share: float = 0.05

    def select_segments(self, step):
        scores, estimates, segments = step.scored_picks(step.k)
        total = log_total_mass(scores, step.always_log_mass())
        return Selection(segments, valid=estimates - total[..., None] >= math.log(self.share))


def decode(method, dtype, prompt=131, steps=9, seed=0):
    """Prefill ``prompt`` random tokens (drawn in float64), then decode; yield (state, query, out, info) per step."""
    return random_decode(method, (B, H, G, D), prompt, steps, dtype, seed, draw=torch.float64)


def reference_mask(state, q, share: float, shared: bool) -> torch.Tensor:
    """``[B, H, G, t]`` the tokens the naive rule attends: sinks, tail, and of each selection's ``K`` segments
    of largest exact mass those holding at least ``share`` of its mass (float64, from the keys)."""
    lay = state.layout
    logits = torch.einsum("bhgd,bhtd->bhgt", q.double().view(B, H, G, D), state.keys.double()) * state.scale
    masses = logits[..., lay.sink_end : lay.segment_end].unflatten(-1, (lay.n_segments, lay.segment_size)).logsumexp(-1)
    total = logits.logsumexp(-1)  # [B, H, G]
    if shared:  # one selection per KV group: its heads' masses added
        masses, total = masses.logsumexp(2, keepdim=True), total.logsumexp(2, keepdim=True)
    best = masses.topk(K, dim=-1)
    kept = best.values - total[..., None] >= math.log(share)  # [B, H, G', K]
    mask = torch.zeros(B, H, G, state.length, dtype=torch.bool)
    mask[..., : lay.sink_end] = True
    mask[..., lay.tail_start :] = True
    for b in range(B):
        for h in range(H):
            for g in range(G):
                s = 0 if shared else g
                for segment in best.indices[b, h, s][kept[b, h, s]].tolist():
                    start = lay.sink_end + segment * lay.segment_size
                    mask[b, h, g, start : start + lay.segment_size] = True
    return mask


@pytest.mark.parametrize("backend", ["auto", "torch"])
@pytest.mark.parametrize("shared", [False, True], ids=["per-query-head", "shared-per-kv-head"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_a_user_select_stage_runs_through_the_state_as_its_naive_reference(backend, shared, dtype):
    share = 0.06
    method = sa.SegmentSearch(
        sa.ExactScore(), sa.TopK(), sa.FixedSchedule(SIZE), top_k=K, sinks=SINKS, window=WINDOW,
        shared_kv_selection=shared, refine=DropFaint(share), backend=backend,
    )  # fmt: skip
    dropped = 0
    for state, q, out, info in decode(method, dtype):
        assert state.layout.n_segments > K
        want = reference_mask(state, q, share, shared)
        assert torch.equal(info.to_mask(), want.view(B, H * G, -1))  # the part's selection, exactly
        assert torch.equal(info.attended, want.sum(-1).view(B, H * G))
        ref = attention_ref(q.double().view(B, H, G, D), state.keys.double(), state.values.double(), want).view(B, H * G, D)
        assert_close(out, ref, dtype)
        dropped += int((~info.valid).sum())
    assert dropped > 0  # the rule dropped some picks: the masked path ran


@dataclass(frozen=True)
class ExactRest:
    """A rest of one token per step: every unattended token merged with its exact mass and mean value.

    Its ``attend_segments`` gathers the selection's tokens too (a backend kernel would read them in
    place); ``calls`` records which hook the attend stage called.
    """

    calls: list = field(default_factory=list, compare=False)
    per_block = 2**62  # one block: the state keeps one key and value sum per row and head

    def blocks(self, n_segments: int) -> int:
        return 1 if n_segments else 0

    def attend_segments(self, step, selection, backend, fused):
        self.calls.append("segments")
        listed, attended, runs = selection.listing(step.layout)
        return self._attend(step, listed, attended)[0]

    def attend_tokens(self, step, listed, attended, runs):
        self.calls.append("tokens")
        return self._attend(step, listed, attended)

    def _attend(self, step, listed, attended):

        q = step.query.double()
        keys, values = step.keys.double(), step.values.double()
        logits = torch.einsum("bhgd,bhtd->bhgt", q, keys) * step.scale  # [B, H, G, t]
        taken = torch.zeros_like(logits, dtype=torch.bool)
        flags = torch.ones_like(listed, dtype=torch.bool).unsqueeze(2) if attended is None else attended
        taken.scatter_(-1, listed.unsqueeze(2).expand(*logits.shape[:3], -1), flags.expand(*logits.shape[:3], -1))
        rest = logits.masked_fill(taken, float("-inf"))
        weights = torch.softmax(rest, -1).nan_to_num(0.0)  # the rest's own softmax: its mean value
        merged = rest.logsumexp(-1, keepdim=True)  # [B, H, G, 1]: its exact mass
        out, probs = token_attention(step.query, step.keys, step.values, listed, attended, step.scale)
        own = logits.masked_fill(~taken, float("-inf")).logsumexp(-1, keepdim=True)
        w = torch.softmax(torch.cat([own, merged], -1), -1)
        mixed = w[..., :1] * out.double() + w[..., 1:] * torch.einsum("bhgt,bhtd->bhgd", weights, values)
        return mixed.to(out.dtype), probs * w[..., :1].to(probs.dtype)


@pytest.mark.parametrize("backend, hook", [("auto", "segments"), ("torch", "tokens")])
@pytest.mark.parametrize("allocation", [sa.Uniform(), sa.PooledMass(cap=2.0)], ids=["uniform", "pooled"])
def test_a_user_rest_is_called_by_the_attend_stage_and_recovers_dense_attention(allocation, backend, hook):
    # The rest merges what the step leaves out with its exact mass and mean value: dense attention, whatever is
    # selected. The C backend (auto on the CPU) has the log-sum-exp capability: the rest's segment form runs.
    rest = ExactRest()
    method = sa.SegmentSearch(
        sa.Centroid(), sa.TopK(), sa.FixedSchedule(SIZE), top_k=2, sinks=SINKS, window=WINDOW, allocation=allocation,
        rest=rest, backend=backend,
    )  # fmt: skip
    for state, q, out, info in decode(method, torch.float32, steps=4):
        assert info.n_merged == 1
        ref = attention_ref(q.double().view(B, H, G, D), state.keys.double(), state.values.double()).view(B, H * G, D)
        assert_close(out, ref, torch.float32)
    if backend == "auto" and "lse" not in state._kernels:
        pytest.skip("the auto backend here has no log-sum-exp capability")
    assert rest.calls == [hook] * 4


def test_parts_without_their_slots_hook_are_refused_naming_the_protocol():
    assert isinstance(DropFaint(), SelectStage) and isinstance(ExactRest(), Rest)
    with pytest.raises(ValueError, match="SegmentSearch.refine .* SelectStage protocol: select_segments"):
        sa.SegmentSearch(refine=sa.TopK())
    with pytest.raises(ValueError, match="SegmentSearch.rest .* Rest protocol"):
        sa.SegmentSearch(rest=DropFaint())
    with pytest.raises(ValueError, match="SegmentSearch.allocation must implement the Allocation protocol"):
        sa.SegmentSearch(allocation=DropFaint())  # a select stage, but no split (uniform, width, plan)
