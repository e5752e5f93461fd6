"""Radar's summary: the mean positive random feature of a segment (Radar Eq. 4-5)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from sparseattn.ops.features import draw_projection, log_positive_features
from sparseattn.validation import check_bool, check_int

_FEATURE_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)

#: Elements of the ``[segments, c, n]`` block of exponents that :meth:`PerformerFeatures.summarize`
#: holds at once (8 MiB in float32): the projection, its max-shift and ``exp`` then run in cache, in
#: place, instead of streaming several temporaries of the whole chunk through memory (3x faster at 128k).
_BLOCK_ELEMENTS = 2**21
#: On a GPU the block is sized for launches, not caches: each block is a few kernels, and 2**21 elements
#: would cut a 128k-token rebuild of 64 heads into ~18k of them (seconds of launch overhead); 2**26 is
#: 256 MiB of float32 exponents at once.
_GPU_BLOCK_ELEMENTS = 2**26


@dataclass(frozen=True)
class PerformerFeatures:
    """Segment summary ``sum_j phi(k_j)`` with phi(x) = exp(Omega x - ||x||^2/2) / sqrt(n).

    The paper stores the mean ``mean_j phi(k_j)``; we store the sum (c times the mean, the same
    ranking for equal segments), so that ``log(phi(q) . sum_j phi(k_j))`` is directly an estimate of
    the segment's log attention mass, unbiased before the log (Lemma 1).

    Storage is log-space with a max-shift per segment: ``summary = exp(L - m)`` in ``feature_dtype``
    (entries in [0, 1]) and the shift ``m`` in float32/64, where ``L = logsumexp_j log phi(k_j)``.
    Scoring is one matmul ``exp(b - max b) @ summary^T`` plus the shifts; when that product underflows
    (very large key norms) the affected scores are recomputed exactly with a logsumexp.

    Omega is drawn once per layer and per KV head from ``seed`` and the layer index
    (:func:`sparseattn.ops.features.draw_projection`); the query heads of a KV group share it,
    because their features must live in the same space as that head's keys.

    With ``antithetic=True`` the ``n/2`` Gaussian draws are used as pairs ``+omega, -omega``: n features
    ``exp(+-omega . x - ||x||^2/2) / sqrt(n)``, each still an unbiased factor (``-omega`` is as Gaussian
    as ``omega``), and the pair cancels the odd terms of the estimator's error. The exponents are
    formed and max-shifted in log space as for independent draws, so no dtype overflows.

    Args:
        n_features: n, the feature dimension (the paper's n = 2048 independent draws, Algorithm 1).
            The authors' code draws 2048 vectors and uses them as +-omega pairs: that is
            ``n_features=4096, antithetic=True`` here (the as-run :func:`~sparseattn.methods.Radar`).
        orthogonal: draw Omega as Performer's orthogonal random features (same mean, variance no larger).
        antithetic: use the pairs +-omega (n/2 draws, n even): still unbiased.
        seed: seed of Omega (an int >= 0); layers draw independent matrices from it.
        feature_dtype: storage dtype of the normalised summaries.
    """

    n_features: int = 2048
    orthogonal: bool = False
    antithetic: bool = False
    seed: int = 0
    feature_dtype: torch.dtype = torch.float32

    reads_keys = False
    #: Its score reads one flag back to the host (whether the underflow fallback is needed): a step that scores
    #: with it synchronises, and no CUDA graph captures it (:func:`~sparseattn.methods.static_step.static_refusal`).
    reads_back = True

    def __post_init__(self) -> None:
        check_int("PerformerFeatures", "n_features", self.n_features, 1)
        check_bool("PerformerFeatures", "orthogonal", self.orthogonal)
        check_bool("PerformerFeatures", "antithetic", self.antithetic)
        check_int("PerformerFeatures", "seed", self.seed, 0)
        if self.antithetic and self.n_features % 2:
            raise ValueError(
                f"PerformerFeatures.n_features must be an even int >= 2 with antithetic=True (pairs +-omega), got {self.n_features!r}"
            )
        if self.feature_dtype not in _FEATURE_DTYPES:
            raise ValueError(f"PerformerFeatures.feature_dtype must be one of {_FEATURE_DTYPES}, got {self.feature_dtype}")

    def prepare(self, kv_heads: int, head_dim: int, *, layer_idx: int, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
        n_draws = self.n_features // 2 if self.antithetic else self.n_features
        omega = draw_projection(
            kv_heads, n_draws, head_dim, orthogonal=self.orthogonal, seed=self.seed, layer_idx=layer_idx
        )
        return omega.to(device=device, dtype=dtype)

    def log_features(self, omega: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """``log phi(x)`` including the 1/sqrt(n) factor: ``[B, H, ..., D] -> [B, H, ..., n]``."""
        return log_positive_features(x, omega, antithetic=self.antithetic) - 0.5 * math.log(self.n_features)

    @torch.no_grad()  # summaries only steer the (non-differentiable) selection; in-place blocks need no graph
    def summarize(self, omega: torch.Tensor, keys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        B, H, S, c, D = keys.shape
        n = self.n_features
        # Sum (not mean) over the segment, so the score is a log-mass without knowing c.
        log_sum = keys.new_empty(B, H, S, n)  # logsumexp_j log phi(k_j), [B, H, S, n]
        # A block: some segments of one head, or every segment of several heads (many small heads, as
        # the theory tests draw), holding at most _BLOCK_ELEMENTS exponents.
        elements = _BLOCK_ELEMENTS if keys.device.type == "cpu" else _GPU_BLOCK_ELEMENTS
        if S * c * n <= elements:
            per_block, heads = S, min(H, max(1, elements // (S * c * n)))
        else:
            per_block, heads = max(1, elements // (c * n)), 1
        buffer = keys.new_empty(heads * per_block * c * n)  # one buffer: a fresh one per block would page-fault
        omega_t = omega.transpose(-1, -2)  # [H, D, m]
        for b in range(B):
            for h0 in range(0, H, heads):
                h1 = min(H, h0 + heads)
                for first in range(0, S, per_block):
                    last = min(S, first + per_block)
                    rows = keys[b, h0:h1, first:last].reshape(h1 - h0, -1, D)  # [h, s * c, D]
                    # log phi = omega . k - ||k||^2 / 2 - log(n) / 2: the bias rides in the GEMM (baddbmm).
                    bias = (rows * rows).sum(-1, keepdim=True).mul_(-0.5).sub_(0.5 * math.log(n))
                    out = buffer[: rows.shape[0] * rows.shape[1] * n].view(rows.shape[0], rows.shape[1], n)
                    if self.antithetic:
                        proj = torch.bmm(rows, omega_t[h0:h1])
                        torch.cat([proj + bias, bias - proj], dim=-1, out=out)
                    else:
                        torch.baddbmm(bias, rows, omega_t[h0:h1], out=out)
                    log_phi = out.view(h1 - h0, last - first, c, n)
                    top = log_phi.amax(dim=-2, keepdim=True)  # [h, s, 1, n]: a logsumexp over the c tokens
                    log_sum[b, h0:h1, first:last] = log_phi.sub_(top).exp_().sum(dim=-2).log_().add_(top.squeeze(-2))
        shift = log_sum.amax(dim=-1)  # [B, H, S]
        return torch.exp(log_sum - shift.unsqueeze(-1)).to(self.feature_dtype), shift

    def score(
        self, omega: torch.Tensor, summaries: tuple[torch.Tensor, torch.Tensor], queries: torch.Tensor,
        segment_keys: torch.Tensor | None, segment_size: int,
    ) -> torch.Tensor:  # fmt: skip
        log_q = self.log_features(omega, queries)  # [B, H, G, n]
        q_shift = log_q.amax(dim=-1, keepdim=True)
        return self._scores(torch.exp(log_q - q_shift), q_shift, summaries, log_q.unsqueeze(-2))

    def score_group(
        self, omega: torch.Tensor, summaries: tuple[torch.Tensor, torch.Tensor], queries: torch.Tensor,
        segment_keys: torch.Tensor | None, segment_size: int,
    ) -> torch.Tensor:  # fmt: skip
        """``log sum_g exp(score_g)`` ``[B, H, 1, S]``: the KV group's summed mass, in one product.

        Masses are linear in phi(q), so the group's estimate is ``(sum_g phi(q_g)) . summary``: the G
        query heads' features are added (under one max-shift) before the product with the summaries.
        """
        log_q = self.log_features(omega, queries)  # [B, H, G, n]
        q_shift = log_q.amax(dim=(-2, -1), keepdim=True)  # [B, H, 1, 1]
        summed = torch.exp(log_q - q_shift).sum(dim=-2, keepdim=True)  # [B, H, 1, n]
        return self._scores(summed, q_shift, summaries, log_q.unsqueeze(2))

    def _scores(self, weights, w_shift, summaries, log_q) -> torch.Tensor:
        """``log(weights . summary) + w_shift + shift`` ``[B, H, M, S]`` for ``weights: [B, H, M, n]``.

        Where the product underflows (very large key norms), the score is recomputed exactly as a
        logsumexp of ``log_q: [B, H, M, G', n]`` (the G' query heads whose features ``weights`` sums).
        """
        normalised, shift = summaries
        feats = normalised.to(weights.dtype)
        raw = weights @ feats.transpose(-1, -2)  # [B, H, M, S]
        scores = torch.log(raw) + w_shift + shift.unsqueeze(-2)
        underflow = raw < torch.finfo(raw.dtype).tiny * 2**10
        if bool(underflow.any()):
            terms = log_q.unsqueeze(-2) + torch.log(feats)[:, :, None, None]  # [B, H, M, G', S, n]
            exact = torch.logsumexp(terms.transpose(-2, -3).flatten(-2), dim=-1)  # over (G', n): [B, H, M, S]
            scores = torch.where(underflow, exact + shift.unsqueeze(-2), scores)
        return scores
