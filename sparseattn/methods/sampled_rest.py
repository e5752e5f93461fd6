"""What a step leaves out, estimated from a uniform sample of it, with an error bound (vAttention's idea).

vAttention (Desai et al. 2025, "vAttention: Verified Sparse Attention", arXiv:2510.05688) pairs a
deterministic top-k (sinks, window, heavy hitters) with a *uniform random sample* of the remaining
tokens, whose contributions to the softmax's numerator and denominator are scaled by ``n / m``
(``n`` tokens left, ``m`` sampled): an unbiased (Horvitz-Thompson) estimate of the rest's share, and
from the sample's spread a bound on the output's error at confidence ``1 - delta``. Here the
deterministic part is a segment search's selection (sinks, selected segments, tail) and the sample
is its ``rest`` part (:class:`~sparseattn.methods.rest.Rest`), :class:`SampledRest`.

Per query head, with ``A`` the tokens it attends and ``R`` the candidates it leaves out (the tokens of
``[layout.sink_end, layout.tail_start)`` outside ``A``; ``n = |R|``), ``m`` draws ``j_1 .. j_m`` are
made from ``R`` uniformly and independently (with replacement), and the step's softmax runs over

    A:      logit_j = scale q . k_j                        (exact)
    sample: logit_i = scale q . k_{j_i} + log(n / m)       (each draw stands for n / m tokens)

so ``Z_R^ = (n/m) sum_i exp(l_i)`` and ``N_R^ = (n/m) sum_i exp(l_i) v_i`` estimate the rest's
denominator ``Z_R = sum_{j in R} exp(l_j)`` and numerator ``N_R`` without bias, and the output is
``o^ = (N_A + N_R^) / (Z_A + Z_R^)`` (a ratio estimator: consistent, not unbiased). When ``n <= m``
the "sample" is the whole rest, each token once with weight 1: the output is exact attention.

The bound (per query head). With ``o`` the dense output, ``e_N = N_R^ - N_R``, ``e_Z = Z_R^ - Z_R`` and
``Z^ = Z_A + Z_R^``, exactly (``N_A = o Z_A + o Z_R - N_R``)

    o^ - o = (e_N - o e_Z) / Z^ = (Y^ - Y) / Z^,    Y = sum_{j in R} exp(l_j) (v_j - o),
    Y^ = (1/m) sum_i y_i,    y_i = f_i (v_{j_i} - o),    f_i = n exp(l_{j_i}),

and ``Y^`` is the mean of ``m`` i.i.d. draws with expectation ``Y``: the error of the numerator and the
error of the denominator enter together, and a component every value shares cancels. The central
limit theorem (the normal approximation ``Y^ - Y ~ N(0, Cov(y) / m)``) and the concentration of a
Gaussian vector's norm (``P(||X|| >= sqrt(tr C) + sqrt(2 lambda_max(C) ln(1/delta))) <= delta``, with
``lambda_max <= tr``) give, with probability ``1 - delta``,

    ||o^ - o||_2 <= bound = (1 + sqrt(2 ln(1/delta))) sqrt(tr S_y / m) / Z^,

``S_y`` the sample covariance of ``y_i`` with ``o^`` in place of the unknown ``o``. It is reported per
query head (:attr:`~sparseattn.methods.segment_step.SegmentSelection.rest_bound`); ``0`` when the
whole rest was attended (``n <= m``), ``inf`` with one draw (no spread to estimate). Assumptions: the
normal approximation of the mean of the draws with the sample covariance (and ``o^`` for ``o``) in
place of the true one, which needs ``m`` large against the skew of ``exp(l)`` over the rest. A rest with
a few tokens far above the others (exactly what a top-k should have attended) is where it is
optimistic: a sample that misses them sees no spread. Replacing ``lambda_max`` by the trace makes it
conservative when the error spreads over many of the ``D`` directions (the tests' random inputs: the
error is typically a third of it). The bound is on one head's attention output against *dense*
attention (the selection is exact, so the rest is the only error); it is not a bound on a model's
output.

Design: one sample per step and **query head**, not per KV group: radar+'s heads select their own
segments, so each head's rest differs; drawing from each head's own rest wastes no draw on a token the
head attends, keeps the estimate unbiased per head, and makes ``n <= m`` exact per head. The cost is
``G m`` gathered keys and values per KV head, small next to the budget's reads. The draws are a pure
function of ``(seed, layer, step length)`` (:meth:`SampledRest.generator`): a run is reproducible and
a step drawn again draws the same sample. The state keeps no sums for this rest (its ``per_block`` is
None): the sample reads the cache. Each draw counts against the budget as one attended token
(:meth:`SampledRest.blocks` is ``samples``), as :class:`~sparseattn.methods.rest.MergedRest`'s merged
tokens do.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from sparseattn.ops.attention import gather_tokens, soft_cap
from sparseattn.ops.buffers import Workspace
from sparseattn.ops.layout import SegmentLayout
from sparseattn.validation import check_int, check_number

if TYPE_CHECKING:
    from sparseattn.allocations.base import Selection
    from sparseattn.backends.base import SegmentAttentionLSE
    from sparseattn.methods.segment_step import SegmentStep

__all__ = [
    "Draws",
    "RestComplement",
    "SampleState",
    "SampledRest",
    "bound_factor",
    "merge_with_bound",
    "rest_of_segments",
    "rest_of_tokens",
    "sample_ranks",
    "sample_state",
    "sampled_attention_ref",
]

#: Padding of an attended-position list: above every position and rank.
_HUGE = 2**62


@dataclass(frozen=True)
class SampledRest:
    """Join what a step leaves out to its softmax as a uniform sample of ``samples`` tokens per query head.

    Each drawn token enters the softmax with its exact logit plus ``log(n / samples)`` (``n`` tokens
    left out by that head): an unbiased estimate of the rest's numerator and denominator, and a bound,
    at confidence ``1 - delta``, on the error of the output it gives (the formula and its assumptions:
    :mod:`sparseattn.methods.sampled_rest`). A head whose rest has at most ``samples`` tokens attends
    all of them (exact). Both attend hooks of :class:`~sparseattn.methods.rest.Rest`: over whole
    segments the backend's log-sum-exp op plus the sample; over listed tokens one softmax over them and
    the sample. Every hook sets ``step.rest_bound``.

    Args:
        samples: tokens drawn per step and query head (>= 1); each counts against the budget.
        delta: the bound holds with probability ``1 - delta`` (a number in (0, 1)).
        seed: seeds the draws, with the layer index and the step's length (>= 0).

    Example (the rest of 6 tokens fits in 8 samples: the output is dense attention, the bound 0):
        >>> import torch
        >>> from sparseattn import FixedSchedule, SegmentSearch, ExactScore, TopK, attention_ref
        >>> m = SegmentSearch(ExactScore(), TopK(), FixedSchedule(3), top_k=1, sinks=1, rest=SampledRest(8))
        >>> state = m.new_state(1, 1, 4, dtype=torch.float64)
        >>> k, v = torch.randn(1, 1, 11, 4, dtype=torch.float64), torch.randn(1, 1, 11, 4, dtype=torch.float64)
        >>> state.prefill(k[:, :, :10], v[:, :, :10])
        >>> q = torch.randn(1, 1, 4, dtype=torch.float64)
        >>> out, info = state.step(q, k[:, :, 10], v[:, :, 10])
        >>> torch.allclose(out, attention_ref(q.view(1, 1, 1, 4), k, v).view(1, 1, 4)), info.rest_bound.tolist()
        (True, [[[0.0]]])
    """

    samples: int = 32
    delta: float = 0.05
    seed: int = 0

    def __post_init__(self) -> None:
        check_int("SampledRest", "samples", self.samples, 1)
        check_number("SampledRest", "delta", self.delta, "a number in (0, 1)", lambda x: 0.0 < x < 1.0)
        check_int("SampledRest", "seed", self.seed, 0)

    @property
    def per_block(self) -> None:
        """None: this rest reads no block or segment sums, so the state keeps none (the sample reads the cache)."""
        return None

    def blocks(self, n_segments: int) -> int:
        """Tokens a step adds over any grid: ``samples`` (at most; fewer when a head's rest is smaller)."""
        return self.samples

    def generator(self, layer_idx: int, length: int, device: torch.device | str | None = None) -> torch.Generator:
        """The generator of the draws of layer ``layer_idx`` at the step over ``length`` stored tokens, on ``device``."""
        return torch.Generator(device=device or "cpu").manual_seed(_mix(self.seed, layer_idx, length))

    def attend_segments(self, step: SegmentStep, selection: Selection, backend: SegmentAttentionLSE, fused: bool) -> torch.Tensor:
        """``[B, H_kv, G, D]``: the selection's whole segments by ``backend``'s log-sum-exp op, then the sample
        joined by log-sum-exp (:func:`merge_with_bound`). ``fused`` is unused (no fused kernel samples)."""
        lay, q = step.layout, step.query
        out, lse = backend.segment_attention_lse(q, step.keys, step.values, lay, selection.segments, selection.valid, step.scale, step.softcap)
        rest = rest_of_segments(lay, selection.segments, selection.valid)
        cd = _compute_dtype(q)
        out, _ = self._join(step, rest, out.to(cd), lse.to(cd))
        return out

    def attend_tokens(
        self, step: SegmentStep, listed: torch.Tensor, attended: torch.Tensor | None, runs: tuple[int, int, int]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(out, probs)``: one softmax over the listed tokens (where ``attended``) and the sample; ``probs``
        the listed tokens' weights ``[B, H_kv, G, L]`` in it (0 where not attended). ``runs`` is unused."""
        q = step.query
        B, H, G, D = q.shape
        cd = _compute_dtype(q)
        k = gather_tokens(step.keys, listed, step.workspace, "token_keys").to(cd)
        v = gather_tokens(step.values, listed, step.workspace, "token_values").to(cd)
        logits = soft_cap(torch.matmul(q.to(cd), k.transpose(-1, -2)) * step.scale, step.softcap)  # [B, H, G, L]
        if attended is not None:
            logits = logits.masked_fill(~attended.expand(B, H, G, -1), float("-inf"))
        lse_a = torch.logsumexp(logits, dim=-1)
        out_a = torch.matmul(torch.softmax(logits, dim=-1), v)
        out, lse = self._join(step, rest_of_tokens(step.layout, listed, attended), out_a, lse_a)
        return out, torch.exp(logits - lse.unsqueeze(-1))

    def _join(self, step: SegmentStep, rest: RestComplement, out_a: torch.Tensor, lse_a: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The attended part ``(out_a, lse_a)`` with this step's sample of ``rest``: ``(out, lse)``; the bound to ``step``."""
        B, H, G, _ = step.query.shape
        n_rest = rest.n_rest.expand(B, H, G)
        draws = sample_ranks(n_rest, self.samples, self.generator(step.layer_idx, step.layout.length, step.device))
        positions = rest.positions(draws.ranks)
        sample = sample_state(step.query, step.keys, step.values, positions, draws, step.scale, step.softcap, step.workspace)
        out, lse, bound = merge_with_bound(out_a, lse_a, sample, self.delta)
        step.rest_bound = bound
        return out, lse


def _mix(*values: int) -> int:
    """A 63-bit seed from ``values`` (splitmix64 steps): nearby inputs give unrelated seeds."""
    x = 0
    for value in values:
        x = (x + value + 0x9E3779B97F4A7C15) % 2**64
        x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) % 2**64
        x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) % 2**64
        x ^= x >> 31
    return x % 2**63


def _compute_dtype(q: torch.Tensor) -> torch.dtype:
    return torch.float64 if q.dtype == torch.float64 else torch.float32


@dataclass(frozen=True)
class RestComplement:
    """The tokens of ``[start, end)`` a head leaves out, as the attended ones define them: what a sample is drawn from.

    ``gaps: [B, H_kv, G', K + 1]`` long: for each attended position of ``[start, end)`` in increasing order,
    the number of left-out positions before it (nondecreasing), padded with ``2**62``; ``n_rest: [B, H_kv,
    G']`` the left-out count (``G'`` in ``{1, G}``: one attended set per KV head, or per query head).
    """

    gaps: torch.Tensor
    n_rest: torch.Tensor
    start: int

    @classmethod
    def from_sorted(cls, attended: torch.Tensor, start: int, end: int) -> RestComplement:
        """From ``attended: [B, H, G', K]`` the attended positions of ``[start, end)`` in increasing order,
        distinct, then padding ``>= 2**62``."""
        K = attended.shape[-1]
        inside = attended < _HUGE
        gaps = torch.where(inside, attended - start - torch.arange(K, device=attended.device), _HUGE)
        gaps = torch.cat([gaps, torch.full_like(gaps[..., :1], _HUGE)], dim=-1)  # never empty (searchsorted)
        return cls(gaps, (end - start) - inside.sum(-1), start)

    def positions(self, ranks: torch.Tensor) -> torch.Tensor:
        """``[B, H, G, m]`` the positions of the left-out tokens of rank ``ranks: [B, H, G, m]`` (0: the first).

        The ``r``-th left-out position is ``start + r + #{attended before it}``, and an attended position
        lies before it exactly when fewer than ``r + 1`` left-out positions precede that attended one.
        """
        B, H, G, _ = ranks.shape
        gaps = self.gaps.expand(B, H, G, -1).contiguous()
        return self.start + ranks + torch.searchsorted(gaps, ranks.contiguous(), right=True)


def rest_of_segments(layout: SegmentLayout, segments: torch.Tensor, valid: torch.Tensor | None) -> RestComplement:
    """What a selection of whole segments leaves out: ``segments: [B, H_kv, G', w]`` listed, ``valid`` (same
    shape, None: all) attended; the candidates are ``[sink_end, tail_start)`` (a segment's tokens in the
    window are the tail's). O(w c) per selection: the tokens it attends, not the rest."""
    S, c, start, end = layout.n_segments, layout.segment_size, layout.sink_end, layout.tail_start
    seg = segments if valid is None else segments.masked_fill(~valid, S)
    seg = seg.sort(dim=-1).values  # attended first, ascending; the sentinel S last
    pos = (start + seg.unsqueeze(-1) * c + torch.arange(c, device=seg.device)).flatten(-2)  # ascending
    pos = torch.where((seg < S).repeat_interleave(c, dim=-1) & (pos < end), pos, _HUGE)  # clipped: only the last
    return RestComplement.from_sorted(pos, start, end)


def rest_of_tokens(layout: SegmentLayout, listed: torch.Tensor, attended: torch.Tensor | None) -> RestComplement:
    """What a token listing leaves out: ``listed: [B, H_kv, L]`` positions, ``attended: [B, H_kv, G'', L]``
    (None: all) which each head attends, each attended position listed once; candidates as
    :func:`rest_of_segments`. O(L log L) per head (a sort)."""
    start, end = layout.sink_end, layout.tail_start
    B, H, L = listed.shape
    flags = torch.ones(B, H, 1, L, dtype=torch.bool, device=listed.device) if attended is None else attended
    pos = listed.unsqueeze(2).expand(B, H, flags.shape[2], L)
    pos = torch.where(flags & (pos >= start) & (pos < end), pos, _HUGE)
    return RestComplement.from_sorted(pos.sort(dim=-1).values, start, end)


@dataclass(frozen=True)
class Draws:
    """One step's draws, per query head: ``ranks: [B, H, G, m]`` long ranks in the head's rest,
    ``drawn: [B, H, G, m]`` which are used, ``log_weight: [B, H, G]`` float64 ``log(n / m)`` (0 when
    exact), ``exact: [B, H, G]`` the heads whose whole rest is taken (``n <= m``)."""

    ranks: torch.Tensor
    drawn: torch.Tensor
    log_weight: torch.Tensor
    exact: torch.Tensor


def sample_ranks(n_rest: torch.Tensor, samples: int, generator: torch.Generator) -> Draws:
    """``samples`` ranks per head, uniform in ``[0, n)`` and independent (with replacement), for ``n_rest:
    [B, H, G]`` (long); a head with ``n <= samples`` takes ranks ``0 .. n-1`` once each, weight 1.

    The uniforms are drawn (float64) from ``generator`` on its device whatever ``n_rest`` holds, so the
    same generator gives the same draws to every caller that asks for the same ``n_rest``.
    """
    device = n_rest.device
    u = torch.rand(*n_rest.shape, samples, generator=generator, dtype=torch.float64, device=generator.device).to(device)
    n = n_rest.unsqueeze(-1)
    sampled = (u * n.double()).floor().long().clamp(min=0).minimum((n - 1).clamp(min=0))
    order = torch.arange(samples, device=device)
    exact = n_rest <= samples
    ranks = torch.where(exact.unsqueeze(-1), torch.minimum(order, (n - 1).clamp(min=0)), sampled)
    drawn = ~exact.unsqueeze(-1) | (order < n)
    log_weight = torch.where(exact, 0.0, n_rest.double().clamp(min=1).log() - math.log(samples))
    return Draws(ranks, drawn, log_weight, exact)


@dataclass(frozen=True)
class SampleState:
    """A sample's partial attention state, per query head: ``out: [B, H, G, D]`` its weighted mean value
    ``N_R^ / Z_R^`` (0 without a draw), ``lse: [B, H, G]`` ``log Z_R^`` (-inf without a draw), and the
    draws themselves for the bound: ``logits: [B, H, G, m]`` (``+ log(n / m)``, -inf where not drawn),
    ``values: [B, H, G, m, D]``, ``exact: [B, H, G]`` (the whole rest taken)."""

    out: torch.Tensor
    lse: torch.Tensor
    logits: torch.Tensor
    values: torch.Tensor
    exact: torch.Tensor


def sample_state(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor, draws: Draws,
    scale: float, softcap: float | None = None, workspace: Workspace | None = None,
) -> SampleState:  # fmt: skip
    """The drawn tokens ``positions: [B, H_kv, G, m]`` of each query head ``q: [B, H_kv, G, D]`` as a
    :class:`SampleState`, in float32 (float64 for float64 ``q``), every exponential max-shifted.

    Logit ``l_i = softcap(scale q . k) + log(n / m)``; ``Z_R^ = sum_i exp(l_i)``, ``N_R^ = sum_i exp(l_i) v_i``.
    """
    B, H, G, D = q.shape
    m = positions.shape[-1]
    cd = _compute_dtype(q)
    flat = positions.reshape(B, H, G * m)
    k = gather_tokens(keys, flat, workspace, "rest_sample_keys").to(cd).view(B, H, G, m, D)
    v = gather_tokens(values, flat, workspace, "rest_sample_values").to(cd).view(B, H, G, m, D)
    logits = soft_cap(torch.einsum("bhgd,bhgmd->bhgm", q.to(cd), k) * scale, softcap) + draws.log_weight.to(cd).unsqueeze(-1)
    logits = logits.masked_fill(~draws.drawn, float("-inf"))
    top = logits.amax(-1)
    top = torch.where(torch.isfinite(top), top, torch.zeros_like(top))  # no draw: any finite shift
    w = torch.exp(logits - top.unsqueeze(-1))  # (0, 1], 0 where not drawn
    total = w.sum(-1)
    out = torch.einsum("bhgm,bhgmd->bhgd", w, v) / total.clamp_min(torch.finfo(cd).tiny).unsqueeze(-1)
    return SampleState(out, top + total.log(), logits, v, draws.exact)


def bound_factor(delta: float) -> float:
    """``1 + sqrt(2 ln(1 / delta))``: a Gaussian vector's norm exceeds this many ``sqrt(trace)`` of its
    covariance with probability at most ``delta``."""
    return 1.0 + math.sqrt(2.0 * math.log(1.0 / delta))


def merge_with_bound(
    out_a: torch.Tensor, lse_a: torch.Tensor, sample: SampleState, delta: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The attended part ``(out_a [B, H, G, D], lse_a [B, H, G])`` and the sample joined by log-sum-exp:
    ``(out, lse, bound)``; ``bound [B, H, G]`` is the module's ``c sqrt(tr S_y / m) / Z^``, every term scaled
    by the same ``exp(-top)``."""
    top = torch.maximum(lse_a, sample.lse)
    z_a, z_r = torch.exp(lse_a - top), torch.exp(sample.lse - top)
    total = z_a + z_r
    out = (z_a.unsqueeze(-1) * out_a + z_r.unsqueeze(-1) * sample.out) / total.unsqueeze(-1)
    m = sample.logits.shape[-1]
    if m > 1:
        f = m * torch.exp(sample.logits - top.unsqueeze(-1))  # n exp(logit), in units of exp(top)
        y = f.unsqueeze(-1) * (sample.values - out.unsqueeze(-2))  # [B, H, G, m, D]
        se = (y.var(-2, correction=1).sum(-1) / m).sqrt()
        bound = bound_factor(delta) * se / total
    else:
        bound = torch.full_like(total, float("inf"))
    return out, top + total.log(), bound.masked_fill(sample.exact, 0.0)


def sampled_attention_ref(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, attended: torch.Tensor, start: int, end: int,
    draws: Draws, scale: float, softcap: float | None = None, delta: float = 0.05,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """Reference of a step with a :class:`SampledRest`: ``(out [B, H, G, D], bound [B, H, G])``, float64,
    one loop per head and draw.

    ``attended: [B, H, G, t]`` the tokens each query head attends exactly; its rest is the positions of
    ``[start, end)`` outside them, in increasing order, and draw ``i`` is its token of rank
    ``draws.ranks[..., i]`` (where ``draws.drawn``), with logit ``+ draws.log_weight``. The bound is the
    module's formula, from the draws' terms ``y_i = n exp(logit) (v_i - out)`` one by one.
    """
    B, H, G, D = q.shape
    cap = (lambda x: x) if softcap is None else (lambda x: softcap * torch.tanh(x / softcap))
    c = bound_factor(delta)
    out = torch.zeros(B, H, G, D, dtype=torch.float64)
    bound = torch.zeros(B, H, G, dtype=torch.float64)
    for b in range(B):
        for h in range(H):
            K, V = keys[b, h].double().cpu(), values[b, h].double().cpu()
            for g in range(G):
                logit = cap(K @ q[b, h, g].double().cpu() * scale)
                chosen = attended[b, h, g].cpu()
                rest = [p for p in range(start, end) if not bool(chosen[p])]
                drawn = [rest[int(r)] for r, d in zip(draws.ranks[b, h, g].tolist(), draws.drawn[b, h, g].tolist()) if d]
                log_w = float(draws.log_weight[b, h, g])
                sample_logits = logit[drawn] + log_w if drawn else torch.zeros(0, dtype=torch.float64)
                shift = float(torch.cat([logit[chosen], sample_logits]).max())
                e_a, e_s = torch.exp(logit[chosen] - shift), torch.exp(sample_logits - shift)
                total = float(e_a.sum() + e_s.sum())
                o = (e_a @ V[chosen] + (e_s @ V[drawn] if drawn else 0.0)) / total
                out[b, h, g] = o
                m = len(drawn)
                if bool(draws.exact[b, h, g]) or not rest:
                    continue
                if m < 2:
                    bound[b, h, g] = float("inf")
                    continue
                y = (e_s * m).unsqueeze(-1) * (V[drawn] - o)  # n exp(logit - shift) (v - out) per draw
                spread = sum(float(((y[:, d] - y[:, d].mean()) ** 2).sum()) / (m - 1) for d in range(D))
                bound[b, h, g] = c * math.sqrt(spread / m) / total
    return out, bound
