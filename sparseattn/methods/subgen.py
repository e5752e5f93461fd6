"""SubGen: online clustering of keys and sampling of values (Zandieh, Han, Mirrokni and Karbasi 2024,
"SubGen: Token Generation in Sublinear Time and Memory").

SubGen estimates the two sums of attention separately. The softmax normaliser ``sum_j exp(q . k_j)``
comes from a clustering of the keys: each cluster keeps its size ``n_c`` and ``t`` keys sampled
uniformly (with replacement) from its members, so ``sum_c n_c / t * sum_samples exp(q . k)`` is an
unbiased estimate. The numerator ``sum_j exp(q . k_j) v_j`` comes from ``s`` pairs sampled with
probability proportional to ``||v_j||^2`` (l2 sampling of the value matrix), weighted ``mu / (s ||v||^2)``
with ``mu = sum_j ||v_j||^2``. Both are maintained in one pass over the stream (reservoir sampling).

Choices where the paper leaves room (documented and tested in ``tests/test_methods_eviction.py``):

* **Exact tokens.** The first ``sinks`` and the last ``window`` tokens are attended exactly (the
  Radar paper gives every baseline a 32-token sliding window); only tokens that leave the window
  enter the sketch. Until more than ``budget`` tokens have been seen nothing is sketched, so at
  ``budget >= t`` SubGen is exactly dense attention.
* **Bounded clusters.** The paper assumes ``(m, delta)``-clusterable keys. Here at most
  ``clusters`` clusters exist (so memory is bounded whatever the keys): a key founds a new cluster if
  it is farther than ``radius`` from every center and the cap is not reached, and otherwise joins the
  nearest center (Euclidean distance between post-RoPE keys). ``radius = 0`` founds clusters until the cap.
* **Batches.** A prefill block is folded in at once: new centers by greedy farthest-point seeding
  (the offline form of the same rule: the farthest key founds a cluster while it is beyond ``radius``),
  every key assigned to its nearest center, and each reservoir updated in bulk (a sample is replaced
  with probability ``new members / members`` by a uniform draw among the new members; a value sample
  with probability ``new mass / mass`` by an l2 draw among the new tokens), the same distribution as
  feeding the keys one at a time. A decode step folds the one token leaving the window.
* **The ratio of the two estimates** (``guard``). Both sums are unbiased, but their ratio is not
  bounded: the two are sampled independently, so when the cluster samples miss the few keys that hold
  a head's attention and a value sample holds one of them, the normaliser is orders of magnitude too
  small for the numerator. The paper's guarantee needs ``t ~ e^(2 delta r) / eps^2`` samples per
  cluster (``delta`` the cluster radius, ``r`` the query norm); on the default model ``e^(2 delta r)``
  is ~1e29 (median over heads) against ``t = 8``. ``guard=True`` floors the sketch's normaliser by the
  value samples' own unbiased estimate of it, which bounds every output by the largest value norm.
* **Split of the budget.** ``budget = sinks + window + clusters * cluster_samples + value_samples``:
  ``clusters = floor((budget - sinks - window) * (1 - value_share) / cluster_samples)`` (at least 1),
  the rest goes to value samples.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sparseattn.methods.base import LayerSpec, StatefulMethod
from sparseattn.validation import check_bool, check_int, check_number
from sparseattn.methods.eviction import SlotSelection, SlotStore
from sparseattn.registry import MethodEntry, Option, Range, alias, register
from sparseattn.seeding import layer_generator

_NO_DISTANCE = float("inf")
# Elements of one [B, H, rows, m, D] difference chunk when measuring key-to-center distances.
_DISTANCE_CHUNK = 1 << 22


@dataclass(frozen=True)
class SubGen(StatefulMethod):
    """Recent tokens exactly, older ones through clustered key samples and l2-sampled values.

    Budget rule: ``budget = sinks + window + clusters * cluster_samples + value_samples`` slots, all
    attended at every step once the sketch exists (a sampled token counts once per slot holding it).
    Evicts physically: the cache holds ``budget`` slots per KV head, plus ``clusters`` centers.

    Args:
        budget: slots per KV head, all attended per step.
        window: most recent tokens attended exactly (at least 1: the newest).
        sinks: first tokens attended exactly.
        cluster_samples: ``t``, uniform key samples kept per cluster.
        value_share: share of the sketch (``budget - sinks - window``) given to value samples.
        radius: ``delta``, a key farther than this from every center founds a cluster (while the cap
            allows); 0 founds clusters until the cap.
        seed: seeds the reservoir draws (with the layer index).
        guard: False (the paper's estimator): the output is the ratio of the two unbiased estimates,
            which is not bounded: when the cluster samples miss the few keys that hold a head's
            attention while a value sample holds one of them, the normaliser is far too small for the
            numerator and the output's norm exceeds every value's (measured on CPython's argparse.py,
            budget 256: outputs up to 41x the largest value norm, perplexity 97,600 where dense has
            2.94; see docs/methods.md). True: the sketch's normaliser is the larger of its two
            estimates, the cluster samples' and the value samples' own (``sum e_j mu / (s |v_j|^2)``,
            also unbiased), so every output is a sub-convex combination of stored values
            (``|out| <= max |v|``); biased towards zero instead of unbounded.
    """

    budget: int = 1024
    window: int = 32
    sinks: int = 0
    cluster_samples: int = 8
    value_share: float = 0.5
    radius: float = 0.0
    seed: int = 0
    guard: bool = False

    def __post_init__(self) -> None:
        check_int("SubGen", "window", self.window, 1)
        check_int("SubGen", "sinks", self.sinks, 0)
        check_int("SubGen", "cluster_samples", self.cluster_samples, 1)
        check_int("SubGen", "seed", self.seed, 0)
        floor = self.sinks + self.window + self.cluster_samples + 1
        why = (
            f"the minimum is sinks + window + cluster_samples + 1 = {self.sinks} + {self.window} + "
            f"{self.cluster_samples} + 1: the exact tokens, one cluster's samples and one value sample"
        )
        check_int("SubGen", "budget", self.budget, floor, why)
        check_number("SubGen", "value_share", self.value_share, "a number in (0, 1)", lambda x: 0.0 < x < 1.0)
        check_number("SubGen", "radius", self.radius, "a finite number >= 0", lambda x: x >= 0.0)
        check_bool("SubGen", "guard", self.guard)

    @property
    def clusters(self) -> int:
        """``m``: the most clusters the sketch holds."""
        sketch = self.budget - self.sinks - self.window
        m = int(sketch * (1.0 - self.value_share)) // self.cluster_samples
        return min(max(1, m), (sketch - 1) // self.cluster_samples)

    @property
    def value_samples(self) -> int:
        """``s``: l2-sampled (key, value) pairs; what the clusters leave of the sketch."""
        return self.budget - self.sinks - self.window - self.clusters * self.cluster_samples

    def state_type(self) -> type:
        return SubGenState


class SubGenState(SlotStore):
    """Slots ``[0, sinks + window)`` exact, then ``value_samples`` l2 samples, then ``clusters x t`` key samples.

    Per-slot weights ``field("den")`` and ``field("num")`` feed :func:`slot_attention`: exact slots
    ``(1, 1)``, cluster samples ``(n_c / t, 0)``, value samples ``(0, mu / (s ||v||^2))``, empty ``(0, 0)``.
    Until the first overflow every slot is exact and in position order.
    """

    def __init__(self, method: SubGen, layer: LayerSpec) -> None:
        super().__init__(method.budget, layer)
        self.method = method
        cd = self.compute_dtype
        self._add_slot_field("den", cd, 1.0)
        self._add_slot_field("num", cd, 1.0)
        self._generator = layer_generator(method.seed, self.layer_idx)
        self.sketched = False
        self._sizes = (method.clusters, method.cluster_samples, method.value_samples)  # m, t, s (computed once)
        # The m centers are allocated when the sketch is built (the first time more than `budget` tokens are
        # stored), never before: memory follows what is stored, not the budget (a budget of 10**6 for a
        # 5-token prompt allocates for 5 tokens).
        self.centers = torch.zeros(layer.batch, layer.kv_heads, 0, layer.head_dim, dtype=cd, device=self.device)
        self.counts = torch.zeros(layer.batch, layer.kv_heads, 0, dtype=torch.long, device=self.device)
        self.clusters_used = torch.zeros(layer.batch, layer.kv_heads, dtype=torch.long, device=self.device)
        self.value_mass = torch.zeros(layer.batch, layer.kv_heads, dtype=cd, device=self.device)

    # -- layout --------------------------------------------------------------------------------

    @property
    def exact_end(self) -> int:
        return self.method.sinks + self.method.window

    @property
    def clusters_start(self) -> int:
        return self.exact_end + self._sizes[2]

    def nbytes(self) -> dict[str, int]:
        """Bytes held: ``kv`` (the slots), ``slot_meta`` (positions, weights), ``sketch`` (centers, counts, mass)."""
        sketch = sum(t.numel() * t.element_size() for t in (self.centers, self.counts, self.clusters_used, self.value_mass))
        return {**super().nbytes(), "sketch": sketch}

    def select_batch(self, index: torch.Tensor) -> None:
        super().select_batch(index)  # validates the index first
        index = index.to(self.device).long()
        self.centers, self.counts, self.clusters_used, self.value_mass = (
            t.index_select(0, index) for t in (self.centers, self.counts, self.clusters_used, self.value_mass)
        )

    def _rand(self, *shape: int) -> torch.Tensor:
        return torch.rand(shape, generator=self._generator, dtype=torch.float64).to(self.device)

    # -- the sketch ----------------------------------------------------------------------------

    def _squared_distances(self, keys: torch.Tensor) -> torch.Tensor:
        """``[B, H, N, m]`` squared distances of ``keys: [B, H, N, D]`` to the centers (inf: unused).

        Computed from differences, not ``|k|^2 - 2 k.c + |c|^2``, so a copy of a center is at distance
        exactly 0 (radius 0 must not found a second cluster for it); in chunks of keys to bound memory.
        """
        B, H, N, D = keys.shape
        c = self.centers.unsqueeze(2)  # [B, H, 1, m, D]
        rows = max(1, _DISTANCE_CHUNK // max(1, B * H * c.shape[3] * D))
        d = torch.cat([((keys[:, :, a : a + rows].unsqueeze(3) - c) ** 2).sum(-1) for a in range(0, N, rows)], dim=2)
        unused = torch.arange(c.shape[3], device=self.device) >= self.clusters_used.unsqueeze(-1)
        # A NaN distance (a NaN or inf key or center) counts as infinitely far: a poisoned center never
        # attracts the keys of later blocks, and the poison stays with the tokens that carry it.
        return d.masked_fill(unused.unsqueeze(-2) | d.isnan(), _NO_DISTANCE)

    def _cluster(self, keys: torch.Tensor) -> torch.Tensor:
        """Found clusters for ``keys: [B, H, N, D]``, then return each key's nearest center ``[B, H, N]``.

        Greedy farthest-point seeding: while the key farthest from every center is beyond ``radius``
        (and fewer than ``clusters`` exist) it founds a cluster. Distances to a new center are exact
        differences, so a copy of a center is at distance 0 and never founds a second cluster.
        """
        B, H, N, D = keys.shape
        m = self._sizes[0]
        limit = self.method.radius**2
        if bool(self.clusters_used.any()):
            nearest, assign = self._squared_distances(keys).min(dim=-1)
        else:
            nearest = torch.full((B, H, N), _NO_DISTANCE, dtype=keys.dtype, device=self.device)
            assign = torch.zeros(B, H, N, dtype=torch.long, device=self.device)
        for _ in range(min(m, N)):
            far, which = nearest.max(dim=-1)  # [B, H]
            found = (far > limit) & (self.clusters_used < m)
            if not bool(found.any()):
                break
            center = keys.gather(2, which.view(B, H, 1, 1).expand(B, H, 1, D))
            slot = self.clusters_used.clamp(max=m - 1)
            index = slot.view(B, H, 1, 1).expand(B, H, 1, D)
            self.centers.scatter_(2, index, torch.where(found.view(B, H, 1, 1), center, self.centers.gather(2, index)))
            distance = ((keys - center) ** 2).sum(-1)
            closer = found.unsqueeze(-1) & (distance < nearest)
            nearest = torch.where(closer, distance, nearest)
            assign = torch.where(closer, slot.unsqueeze(-1), assign)
            self.clusters_used += found.long()
        return assign

    def _fold(self, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor) -> None:
        """Fold tokens ``[B, H, N, D]`` (and their positions ``[B, H, N]``) into the clusters and value samples."""
        B, H, N, D = keys.shape
        m, t, s = self._sizes
        cd = self.compute_dtype
        k = keys.to(cd)
        assign = self._cluster(k)  # [B, H, N]
        added = torch.zeros(B, H, m, dtype=torch.long, device=self.device).scatter_add_(-1, assign, torch.ones_like(assign))
        total = self.counts + added

        # Cluster reservoirs: each sample becomes a uniform draw among the new members w.p. added / total.
        grouped = assign.argsort(dim=-1, stable=True)  # token indices, grouped by cluster
        starts = added.cumsum(-1) - added
        offset = (self._rand(B, H, m, t) * added.unsqueeze(-1)).long()
        token = grouped.gather(-1, (starts.unsqueeze(-1) + offset).clamp(0, N - 1).view(B, H, m * t))
        replace = (self._rand(B, H, m, t) * total.clamp(min=1).unsqueeze(-1) < added.unsqueeze(-1)).view(B, H, m * t)
        self._overwrite(self.clusters_start, replace, token, keys, values, positions)
        self.counts = total
        region = slice(self.clusters_start, self.clusters_start + m * t)
        self.field("den")[:, :, region] = (total.to(cd) / t).repeat_interleave(t, dim=-1)
        self.field("num")[:, :, region] = 0.0

        # Value reservoir: each sample becomes an l2 draw among the new tokens w.p. new mass / mass.
        weight = (values.to(cd) ** 2).sum(-1)  # [B, H, N]
        new_mass = weight.sum(-1)
        mass = self.value_mass + new_mass
        # l2 draws need a finite positive mass; a head without one (all-zero values, or a NaN or inf value,
        # which makes `mass` non-finite and so the head's estimate NaN, as in dense attention) draws uniformly.
        drawable = (new_mass > 0) & torch.isfinite(new_mass)
        draw_from = torch.where(drawable.unsqueeze(-1), weight, torch.ones_like(weight)).double()
        token = torch.multinomial(draw_from.reshape(B * H, N).cpu(), s, replacement=True, generator=self._generator)
        token = token.to(self.device).view(B, H, s)
        replace = (self._rand(B, H, s) * mass.unsqueeze(-1) < new_mass.unsqueeze(-1)) & (new_mass.unsqueeze(-1) > 0)
        region = slice(self.exact_end, self.clusters_start)
        self._overwrite(self.exact_end, replace, token, keys, values, positions)
        self.value_mass = mass
        norms = (self.values[:, :, region].to(cd) ** 2).sum(-1)
        filled = norms > 0  # mass > 0 too; a NaN mass gives NaN weights, so a NaN value propagates as in dense attention
        weight = mass.unsqueeze(-1) / (s * norms.clamp(min=torch.finfo(cd).tiny))
        self.field("num")[:, :, region] = torch.where(filled, weight, 0.0)
        self.field("den")[:, :, region] = 0.0

    def _overwrite(self, start: int, replace, token, keys, values, positions) -> None:
        """Slot ``start + j`` takes token ``token[b, h, j]`` of the folded block where ``replace[b, h, j]``.

        Writes only the replaced slots (a decode step replaces few), in place.
        """
        b, h, j = replace.nonzero(as_tuple=True)
        if b.numel():
            src, slot = token[b, h, j], start + j
            self.keys[b, h, slot] = keys[b, h, src]
            self.values[b, h, slot] = values[b, h, src]
            self.positions[b, h, slot] = positions[b, h, src]

    def _build_sketch(self) -> None:
        """First overflow: keep sinks and window exactly, fold the middle into a fresh sketch."""
        L, B, H, D = self.length, self.batch, self.kv_heads, self.head_dim
        sinks, window, budget = self.method.sinks, self.method.window, self.budget
        exact = torch.cat([torch.arange(sinks), torch.arange(L - window, L)]).to(self.device)
        middle = torch.arange(sinks, L - window, device=self.device)
        mid = [t.index_select(2, middle) for t in (self.keys, self.values, self.positions)]
        empty = budget - exact.numel()
        m = self._sizes[0]
        self.centers = torch.zeros(B, H, m, D, dtype=self.compute_dtype, device=self.device)
        self.counts = torch.zeros(B, H, m, dtype=torch.long, device=self.device)
        for buf in (self._keys, self._values):
            kept = buf.view().index_select(2, exact)
            buf.replace(torch.cat([kept, kept.new_zeros(B, H, empty, D)], dim=2))
        kept = self.positions.index_select(2, exact)
        self._positions.replace(torch.cat([kept, kept.new_full((B, H, empty), -1)], dim=2))
        for buf, dtype, _ in self._fields.values():
            kept = buf.view().index_select(2, exact)
            buf.replace(torch.cat([kept, torch.zeros(B, H, empty, dtype=dtype, device=self.device)], dim=2))
        self.sketched = True
        self._fold(*mid)

    def _fold_overflow(self) -> None:
        """A block appended after the sketch exists: the window keeps the newest, the rest is folded."""
        sinks, window, budget, L = self.method.sinks, self.method.window, self.budget, self.length
        ring = torch.cat([torch.arange(sinks, self.exact_end), torch.arange(budget, L)]).to(self.device)
        pos = self.positions.index_select(2, ring)
        order = ring[pos.argsort(dim=-1)]  # [B, H, n] slot indices, oldest first
        D = self.head_dim

        def take(t: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
            return t.gather(2, idx.unsqueeze(-1).expand(*idx.shape, D)) if t.dim() == 4 else t.gather(2, idx)

        newest, older = order[..., -window:], order[..., :-window]
        keep = [take(t, newest) for t in (self.keys, self.values, self.positions)]
        fold = [take(t, older) for t in (self.keys, self.values, self.positions)]
        for buf in self._buffers():
            buf.truncate(budget)
        for view, new in zip((self.keys, self.values, self.positions), keep):
            view[:, :, sinks : self.exact_end] = new
        self.field("den")[:, :, sinks : self.exact_end] = 1.0
        self.field("num")[:, :, sinks : self.exact_end] = 1.0
        self._fold(*fold)

    # -- the engine ------------------------------------------------------------------------------
    # SubGen keeps its own engine: its store is not a set of ranked tokens but a sketch (reservoir
    # samples whose weights change as clusters grow, value samples redrawn by l2 mass), so no
    # per-token priority can say what it keeps; only the exact window is evicted oldest-first.

    def _settle(self) -> None:
        if self.length > self.budget:
            self._fold_overflow() if self.sketched else self._build_sketch()

    def _window_victim(self) -> torch.Tensor:
        """The window's slot ``[B, H_kv]`` holding its oldest token (the one that leaves)."""
        window = self.positions[:, :, self.method.sinks : self.exact_end]
        return window.argmin(dim=-1) + self.method.sinks

    def _insert(self, key: torch.Tensor, value: torch.Tensor) -> None:
        """The token leaving the window is folded into the sketch; the new one takes its slot."""
        slot = self._window_victim()
        B, H, D = key.shape
        index = slot.view(B, H, 1)
        leaving = [
            self.keys.gather(2, index.unsqueeze(-1).expand(B, H, 1, D)).clone(),
            self.values.gather(2, index.unsqueeze(-1).expand(B, H, 1, D)).clone(),
            self.positions.gather(2, index).clone(),
        ]
        self._fold(*leaving)
        self._write(slot, key, value, self.seen)

    def append(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Add ``[B, H_kv, T, D]``: once sketched, one decode token enters the window and folds the oldest
        into the sketch; a block is appended and folded after :meth:`attend_block` (or the next step)."""
        self._check_kv(keys, values)
        T = keys.shape[2]
        if T == 1 and self.length >= self.budget:
            self._settle()
            if self.sketched:
                self._insert(keys[:, :, 0], values[:, :, 0])
                self.seen += 1
                return
        self._append_block(keys, values)
        if T == 1:
            self._settle()

    def attend(self, query: torch.Tensor) -> tuple[torch.Tensor, SlotSelection]:
        """Attention of ``query: [B, H_q, D]`` over the exact slots and the sketch: ``([B, H_q, D], selection)``."""
        group = self._check_query(query)
        self._settle()
        B, H, D = self.batch, self.kv_heads, self.head_dim
        den, num = self._weights()
        grouped = query.reshape(B, H, group, 1, D)
        out, _ = self._attend_slots(grouped, self.keys, self.values, den, num, self._floor_weight())
        info = SlotSelection(live=self._live(), positions=self.positions.clone(), group=group)
        return out.reshape(B, H * group, D).to(query.dtype), info

    def _weights(self) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        return (self.field("den"), self.field("num")) if self.sketched else (None, None)

    def _floor_weight(self) -> torch.Tensor | None:
        """With ``guard``: the numerator's own weights (exact slots 1, value samples ``mu / (s |v|^2)``,
        cluster samples 0) floor the normaliser, so it is at least the value samples' estimate of the
        sketch's mass plus the exact slots' mass."""
        return self.field("num") if self.sketched and self.method.guard else None

    def _live(self) -> torch.Tensor:
        if not self.sketched:
            return torch.ones(self.batch, self.kv_heads, self.length, dtype=torch.bool, device=self.device)
        return (self.field("den") > 0) | (self.field("num") > 0)

    def attend_block(self, query: torch.Tensor) -> torch.Tensor:
        """Prefill: dense until the sketch exists; afterwards the block's queries see the sketch through its weights."""
        if not self.sketched:
            return super().attend_block(query)  # dense, then observe_block folds the block in
        group = self._check_prefill_query(query)
        B, H, D, T, S = self.batch, self.kv_heads, self.head_dim, query.shape[2], self.length
        grouped = query.reshape(B, H, group, T, D)
        out = torch.empty(B, H, group, T, D, dtype=query.dtype, device=self.device)
        rows = max(1, (1 << 23) // max(1, B * H * group * S))
        for start in range(0, T, rows):
            end = min(T, start + rows)
            visible = S - T + end  # the chunk's queries are the last ones of the first `visible` slots
            part, _ = self._attend_slots(
                grouped[:, :, :, start:end],
                self.keys[:, :, :visible],
                self.values[:, :, :visible],
                self.field("den")[:, :, :visible],
                self.field("num")[:, :, :visible],
                None if not self.method.guard else self.field("num")[:, :, :visible],
            )
            out[:, :, :, start:end] = part.to(query.dtype)
        self._settle()
        return out.reshape(B, H * group, T, D)

    def observe_block(self, query: torch.Tensor) -> None:
        """The block is folded into the sketch (what its output reads is only read)."""
        super().observe_block(query)
        self._settle()


register(
    MethodEntry(
        "subgen",
        "SubGen: recent window exact, older keys clustered online with samples, l2-sampled values (Zandieh et al. 2024)",
        SubGen,
        (
            Option("budget", int, help="past KV tokens' worth of memory per KV head (window, sinks, clusters, samples)"),
            Option("window", int, help="last tokens kept exactly", minimum=0),
            Option("sinks", int, help="first tokens kept exactly", minimum=0),
            Option("seed", int, help="seed of the value sampling", allowed=Range(0, 2**63 - 1)),
            Option("guard", bool, help="floor the normaliser by the value samples' own estimate (outputs stay within the values' range)"),
        ),
        origin=__name__,
        category="baseline",
    )
)
alias("subgen-guarded", "subgen:guard=true")
