"""What the evicting methods share: a bounded set of slots per (batch row, KV head), overwritten in place.

StreamingLLM, H2O, SnapKV and SubGen keep at most ``budget`` tokens per KV head, and each KV head may
keep different ones. The storage stays ``[B, H_kv, slots, D]``: keys are stored after RoPE, so a
token's position travels with its key and the order of the slots does not matter to attention. A
decode token that arrives when the slots are full overwrites the slot the method evicts (O(1) copy, no
compaction); a prefill block is appended, attended densely over everything stored (the setting of the
papers), and only then evicted down to the budget.

A method writes only its *priorities*: which stored tokens it keeps after a prefill block
(:meth:`EvictingState._prefill_priority`) and which one it overwrites at a decode step
(:meth:`EvictingState._eviction_priority`); ``+inf`` protects a token (sinks, recent window).

Shapes: ``keys, values: [B, H_kv, S, D]`` with ``S <= budget`` slots; queries ``[B, H_q, D]`` with
``H_q = G * H_kv`` (query head ``h`` uses KV head ``h // G``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sparseattn.methods.base import KVState, LayerSpec
from sparseattn.ops.slots import slot_attention
from sparseattn.ops.buffers import GrowableBuffer


def defined_priority(priority: torch.Tensor) -> torch.Tensor:
    """``priority`` with NaN read as ``-inf``: a slot whose priority is undefined goes first.

    A NaN (or inf) key or query makes its head's attention weights NaN, and so the statistics a method
    ranks by. Sorting would put NaN above ``+inf`` (torch sorts NaN as the largest value), so a NaN
    score would outrank the protected slots and could leave nothing evictable. Reading NaN as the
    lowest priority keeps eviction defined; only the poisoned (row, KV head) is affected, as in dense
    attention, where the NaN shows up in that head's outputs and nowhere else.
    """
    return priority.nan_to_num(nan=float("-inf"), posinf=float("inf"), neginf=float("-inf"))


def finite_evidence(probs: torch.Tensor) -> torch.Tensor:
    """Attention weights with NaN read as 0, for the statistics that accumulate them (H2O, SnapKV).

    A query whose logits meet a NaN or inf key (or a NaN query) has NaN weights: that query gives no
    evidence about which tokens matter, and accumulating the NaN would poison the head's scores for
    good (NaN + x = NaN).
    """
    return probs.nan_to_num(nan=0.0)


@dataclass(frozen=True)
class SlotSelection:
    """What one decode step of an evicting method attended: every live slot it stores.

    ``live: [B, H_kv, S]`` marks filled slots, ``positions: [B, H_kv, S]`` the original index of the
    token in each slot (-1 when empty), ``group`` the query heads per KV head. A slot counts once even
    when two slots hold the same token (SubGen samples with replacement): it is attended once each.
    """

    live: torch.Tensor
    positions: torch.Tensor
    group: int

    @property
    def attended(self) -> torch.Tensor:
        """Slots attended per query head, ``[B, H_q]``."""
        return self.live.sum(-1).repeat_interleave(self.group, dim=1)

    def to_mask(self) -> torch.Tensor:
        """The attended set as a boolean mask ``[B, H_q, S]`` over the stored slots."""
        B, H, S = self.live.shape
        return self.live.unsqueeze(2).expand(B, H, self.group, S).reshape(B, H * self.group, S)

    def position_mask(self, length: int) -> torch.Tensor:
        """The attended tokens as a boolean mask ``[B, H_q, length]`` over original positions."""
        B, H, _ = self.live.shape
        hits = torch.zeros(B, H, length, dtype=torch.long, device=self.live.device)
        hits.scatter_add_(-1, self.positions.clamp(min=0), self.live.long())
        return (hits > 0).unsqueeze(2).expand(B, H, self.group, length).reshape(B, H * self.group, length)


class EvictingState(KVState):
    """Base of the evicting decode states: at most ``budget`` slots per (batch row, KV head).

    Keeps, beside the keys and values, each slot's original ``positions`` and whatever per-slot fields
    the method registers with :meth:`_add_slot_field` (H2O's accumulated scores, SnapKV's pins, SubGen's
    weights), all reindexed together by eviction and :meth:`select_batch`. ``seen`` counts the tokens
    seen; ``length`` the slots stored (at most ``budget`` once a step is answered).

    Subclasses define :meth:`_prefill_priority` (tokens kept after a prefill block: the ``budget``
    highest) and :meth:`_eviction_priority` (the slot a full store overwrites: the lowest; ties go to
    the oldest token); ``+inf`` protects. They may record statistics in :meth:`_record_block`
    (prefill queries) and :meth:`_record_step` (decode attention weights).
    """

    def __init__(self, budget: int, layer: LayerSpec) -> None:
        super().__init__(layer)
        self.budget = budget
        self.seen = 0
        self._positions = GrowableBuffer(dim=2)
        self._fields: dict[str, tuple[GrowableBuffer, torch.dtype, float]] = {}

    # -- storage -------------------------------------------------------------------------------

    def _add_slot_field(self, name: str, dtype: torch.dtype, fill: float) -> None:
        """Register a per-slot tensor ``[B, H_kv, S]`` that new tokens enter with value ``fill``."""
        self._fields[name] = (GrowableBuffer(dim=2), dtype, fill)

    def field(self, name: str) -> torch.Tensor:
        """The per-slot field ``name`` as a ``[B, H_kv, S]`` view."""
        return self._fields[name][0].view()

    @property
    def positions(self) -> torch.Tensor:
        """``[B, H_kv, S]`` original position of the token in each slot (-1: empty)."""
        return self._positions.view()

    def _buffers(self) -> list[GrowableBuffer]:
        return [*super()._buffers(), self._positions, *(buf for buf, _, _ in self._fields.values())]

    def nbytes(self) -> dict[str, int]:
        """Bytes held: ``kv`` (the stored slots) and ``slot_meta`` (positions and per-slot fields)."""
        meta = sum(buf.view().numel() * buf.view().element_size() for buf in self._buffers()[2:] if len(buf))
        return {**super().nbytes(), "slot_meta": meta}

    def _append_slots(self, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor) -> None:
        B, H, T, _ = keys.shape
        self._keys.append(keys)
        self._values.append(values)
        self._positions.append(positions)
        for buf, dtype, fill in self._fields.values():
            buf.append(torch.full((B, H, T), fill, dtype=dtype, device=self.device))
        if self.length == self.budget:
            self._shrink_to_fit()

    def _shrink_to_fit(self) -> None:
        """Drop the spare capacity of capacity doubling, so a full store holds exactly ``budget`` slots."""
        for buf in self._buffers():
            if len(buf) and buf.capacity > len(buf):
                buf.replace(buf.view())

    def _write(self, slot: torch.Tensor, key: torch.Tensor, value: torch.Tensor, position: torch.Tensor | int) -> None:
        """Overwrite ``slot: [B, H_kv]`` with ``key, value: [B, H_kv, D]`` in place; reset its fields."""
        B, H, D = key.shape
        index = slot.view(B, H, 1)
        self.keys.scatter_(2, index.unsqueeze(-1).expand(B, H, 1, D), key.unsqueeze(2))
        self.values.scatter_(2, index.unsqueeze(-1).expand(B, H, 1, D), value.unsqueeze(2))
        pos = torch.as_tensor(position, device=self.device).expand(B, H).reshape(B, H, 1)
        self.positions.scatter_(2, index, pos)
        for name, (_, dtype, fill) in self._fields.items():
            self.field(name).scatter_(2, index, torch.full((B, H, 1), fill, dtype=dtype, device=self.device))

    def _compact(self, keep: torch.Tensor) -> None:
        """Keep the slots ``keep: [B, H_kv, n]`` (in that order), dropping every other one."""
        B, H, n = keep.shape
        rows = keep.unsqueeze(-1).expand(B, H, n, self.head_dim)
        self._keys.replace(self.keys.gather(2, rows))
        self._values.replace(self.values.gather(2, rows))
        self._positions.replace(self.positions.gather(2, keep))
        for buf, _, _ in self._fields.values():
            buf.replace(buf.view().gather(2, keep))

    def kept_tokens(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The stored tokens in position order: ``keys, values: [B, H_kv, S, D]``, ``positions: [B, H_kv, S]``.

        Each KV head lists its own tokens (the ``s``-th token of two heads may differ).
        """
        self._settle()
        order = self.positions.argsort(dim=-1)
        rows = order.unsqueeze(-1).expand(*order.shape, self.head_dim)
        return self.keys.gather(2, rows), self.values.gather(2, rows), self.positions.gather(2, order)

    # -- eviction ------------------------------------------------------------------------------

    def _prefill_priority(self) -> torch.Tensor:
        """``[B, H_kv, S]``: after a prefill block the ``budget`` highest are kept (``+inf``: always)."""
        raise NotImplementedError

    def _eviction_priority(self, position: int) -> torch.Tensor:
        """``[B, H_kv, S]``: the lowest slot is overwritten by the token at ``position`` (``+inf``: never)."""
        raise NotImplementedError

    def _record_block(self, grouped_query: torch.Tensor) -> None:
        """Hook: learn from the prefill block's queries ``[B, H_kv, G, T, D]`` before eviction."""

    def _record_step(self, probs: torch.Tensor) -> None:
        """Hook: learn from one decode step's attention weights ``[B, H_kv, G, S]``."""

    def _keep_slots(self, priority: torch.Tensor, n: int) -> torch.Tensor:
        """The ``n`` highest-priority slots ``[B, H_kv, n]`` (ties: the newer token), in position order."""
        newest_first = self.positions.argsort(dim=-1, descending=True)
        ranked = defined_priority(priority).gather(-1, newest_first).argsort(dim=-1, descending=True, stable=True)
        keep = newest_first.gather(-1, ranked[..., :n])
        return keep.gather(-1, self.positions.gather(-1, keep).argsort(dim=-1))

    def _victim(self, position: int) -> torch.Tensor:
        """The slot ``[B, H_kv]`` the token at ``position`` overwrites: lowest priority, then oldest."""
        priority = defined_priority(self._eviction_priority(position))
        low = priority.amin(dim=-1, keepdim=True)
        if bool((low == float("inf")).any()):
            raise RuntimeError(f"{type(self).__name__}: every slot is protected, nothing can be evicted (a bug)")
        oldest = self.positions.masked_fill(priority != low, torch.iinfo(torch.long).max)
        return oldest.argmin(dim=-1)

    def _settle(self) -> None:
        """Evict down to ``budget`` what a prefill block left above it."""
        if self.length > self.budget:
            self._compact(self._keep_slots(self._prefill_priority().double(), self.budget))

    def _insert(self, key: torch.Tensor, value: torch.Tensor) -> None:
        """A decode token ``[B, H_kv, D]`` into a full store: overwrite the evicted slot."""
        self._write(self._victim(self.seen), key, value, self.seen)

    def _can_insert(self) -> bool:
        return True

    # -- the DecodeState protocol --------------------------------------------------------------

    def append(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Add ``[B, H_kv, T, D]``: one decode token overwrites an evicted slot when the store is full;
        a block is appended and evicted after :meth:`attend_block` (or the next step) has seen it."""
        self._check_block("keys", keys, True)
        self._check_block("values", values, True)
        if keys.shape != values.shape:
            raise ValueError(f"keys {tuple(keys.shape)} and values {tuple(values.shape)} differ in shape")
        B, H, T, _ = keys.shape
        if T == 1 and self.length >= self.budget:
            self._settle()
            if self._can_insert():
                self._insert(keys[:, :, 0], values[:, :, 0])
                self.seen += 1
                return
        positions = torch.arange(self.seen, self.seen + T, device=self.device).expand(B, H, T)
        self._append_slots(keys, values, positions)
        self.seen += T
        if T == 1:
            self._settle()

    def prefill(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Same as :meth:`append` (dispatched, so a subclass's ``append`` is the one that runs)."""
        self.append(keys, values)

    def attend_block(self, query: torch.Tensor) -> torch.Tensor:
        """Dense causal prefill attention ``[B, H_q, T, D]`` over everything stored, then eviction to ``budget``."""
        out = super().attend_block(query)
        B, H, D = self.batch, self.kv_heads, self.head_dim
        self._record_block(query.reshape(B, H, query.shape[1] // H, query.shape[2], D))
        self._settle()
        return out

    def _weights(self) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """Per-slot ``(den_weight, num_weight)`` for :func:`slot_attention` (None: plain attention)."""
        return None, None

    def _floor_weight(self) -> torch.Tensor | None:
        """Per-slot ``floor_weight`` for :func:`slot_attention` (None: no floor on the normaliser)."""
        return None

    def _live(self) -> torch.Tensor:
        return torch.ones(self.batch, self.kv_heads, self.length, dtype=torch.bool, device=self.device)

    def attend(self, query: torch.Tensor) -> tuple[torch.Tensor, SlotSelection]:
        """Attention of ``query: [B, H_q, D]`` over every stored slot: ``([B, H_q, D], selection)``."""
        group = self._check_query(query)
        self._settle()
        B, H, D = self.batch, self.kv_heads, self.head_dim
        den, num = self._weights()
        grouped = query.reshape(B, H, group, 1, D)
        out, probs = slot_attention(grouped, self.keys, self.values, den, num, self.scale, self.softcap, self._floor_weight())
        self._record_step(probs[:, :, :, 0])
        info = SlotSelection(live=self._live(), positions=self.positions.clone(), group=group)
        return out.reshape(B, H * group, D).to(query.dtype), info
