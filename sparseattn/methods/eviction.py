"""Eviction as a policy: which tokens a bounded store keeps, and the engine that keeps them.

StreamingLLM, H2O and SnapKV keep at most ``budget`` tokens per (batch row, KV head), each KV head
its own. A method of this family is an :class:`EvictionPolicy`: an immutable object that only ranks
tokens. The engine, :class:`EvictingState`, owns everything else: the slots ``[B, H_kv, S, D]``
(keys stored after RoPE, so a token's position travels with its key and slot order does not matter
to attention), positions, the attention record a policy asks for, batch reindexing, compaction and
byte accounting.

The engine asks a policy for one thing, :meth:`EvictionPolicy.priority` of a set of
:class:`Candidates`:

* after a prompt block (attended densely over everything stored, the setting of the papers), the
  ``budget`` highest of the stored tokens stay;
* at a decode step with a full store, the stored tokens *and the newcomer* compete: the lowest
  leaves (ties: the oldest). The step attends what is stored afterwards, so a newcomer that loses
  is not attended even by its own query (protect it with ``RecentWindow(1)`` to always attend it).

``+inf`` protects a token; :mod:`sparseattn.methods.always` has the reusable protected sets (sinks,
recent window, heavy hitters). A policy that ranks by attention declares an :class:`Observation`
and reads :attr:`Candidates.attention`, which the engine accumulates for it.

Shapes: ``keys, values: [B, H_kv, S, D]`` with ``S <= budget`` slots; queries ``[B, H_q, D]`` with
``H_q = G * H_kv`` (query head ``h`` uses KV head ``h // G``).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Callable, ClassVar, Protocol, runtime_checkable

import torch
import torch.nn.functional as F

from sparseattn.methods.base import KVState, LayerSpec, StatefulMethod
from sparseattn.validation import check_int
from sparseattn.backends.registry import select_backend
from sparseattn.ops.slots import causal_probability_sums
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
class Observation:
    """Which attention weights the engine records for a policy: per stored token, summed over queries.

    The record is the attention each token received, summed over the query heads of its KV group
    and over the queries observed (H2O's accumulated score, SnapKV's votes), in float32 (float64 for
    float64 caches); NaN weights count as 0 (see :func:`finite_evidence`).

    Args:
        prompt_queries: observe the last ``prompt_queries`` queries of each prompt block (None: all).
        decode: add every decode step's attention weights.
        per_prompt: each prompt block's observation replaces the record (SnapKV's votes are the
            latest prompt's); otherwise it accumulates (H2O).
    """

    prompt_queries: int | None = None
    decode: bool = True
    per_prompt: bool = False


def observe_prompt(
    observation: Observation, record: torch.Tensor, query: torch.Tensor, keys: torch.Tensor, scale: float, softcap: float | None
) -> None:
    """Record a prompt block's attention as ``observation`` says: ``record: [B, H_kv, S]`` gets the sums.

    ``query: [B, H_q, T, D]`` are the block's queries (the last ``T`` of the ``S`` stored tokens
    ``keys: [B, H_kv, S, D]``); each stored token receives the attention of the observed queries,
    summed over them and over its KV group's query heads, added to the record (or, ``per_prompt``,
    replacing it). Shared by every engine that keeps a record.
    """
    B, H, S, D = keys.shape
    grouped = query.reshape(B, H, query.shape[1] // H, query.shape[2], D)
    if observation.prompt_queries is not None:
        grouped = grouped[:, :, :, -min(observation.prompt_queries, grouped.shape[3]) :]
    sums = finite_evidence(causal_probability_sums(grouped, keys, scale, softcap))
    record.copy_(sums) if observation.per_prompt else record.add_(sums)


class Candidates:
    """The tokens a policy (or an :class:`~sparseattn.methods.always.AlwaysKept` part) ranks: ``[B, H_kv, n]`` per token.

    After a prompt block they are the stored tokens; at a decode step of an evicting engine the stored
    tokens followed by the newcomer (the last one). ``keys`` and ``attention`` are built only when
    read (a policy that ranks by position copies no key).

    Args:
        positions: ``[B, H_kv, n]`` original position of each candidate.
        seen: tokens seen so far, the newcomer included (every position is below it).
        prompt_length: ``seen`` when the latest prompt block was stored.
        decode: a decode step (the last candidate is the newcomer and one candidate leaves).
        keys: returns ``[B, H_kv, n, D]``, the candidates' keys (after RoPE).
        attention: returns ``[B, H_kv, n]``, the attention each candidate received as the reader's
            :class:`Observation` says; None when the engine keeps no record.
    """

    def __init__(
        self,
        positions: torch.Tensor,
        *,
        seen: int,
        prompt_length: int = 0,
        decode: bool = False,
        keys: Callable[[], torch.Tensor],
        attention: Callable[[], torch.Tensor] | None = None,
        owner: object = None,
    ) -> None:
        self.positions, self.seen, self.prompt_length, self.decode = positions, seen, prompt_length, decode
        self._keys, self._attention, self._owner = keys, attention, owner

    @property
    def newest(self) -> int:
        """Position of the newest token seen."""
        return self.seen - 1

    @cached_property
    def keys(self) -> torch.Tensor:
        """``[B, H_kv, n, D]`` the candidates' keys (after RoPE)."""
        return self._keys()

    @cached_property
    def attention(self) -> torch.Tensor:
        """``[B, H_kv, n]`` the attention each candidate received (a decode newcomer: 0)."""
        if self._attention is None:
            raise ValueError(f"{self._owner!r} reads Candidates.attention but declares no Observation, so no record is kept")
        return self._attention()


@runtime_checkable
class EvictionPolicy(Protocol):
    """What an evicting method is: a budget, an optional observation, and a per-token priority.

    Everything else (storage, positions, the attention record, batch reindexing, compaction, bytes)
    is the engine's, :class:`EvictingState`. A frozen dataclass deriving from :class:`Evicting`
    gets ``observation = None`` and ``new_state`` for free.
    """

    budget: int  #: tokens kept per (batch row, KV head)
    observation: Observation | None  #: the attention record :attr:`Candidates.attention` holds, or None

    def priority(self, tokens: Candidates) -> torch.Tensor:
        """``[B, H_kv, n]`` float: the highest are kept, the lowest leaves first; ``+inf`` never leaves."""
        ...


class Evicting(StatefulMethod):
    """Base of eviction policies: makes an :class:`EvictingState` for the policy (a mixin, no fields)."""

    observation: ClassVar[Observation | None] = None

    def state_type(self) -> type:
        return EvictingState


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

    @property
    def merged(self) -> torch.Tensor:
        """None: every attended slot is a stored token (zeros ``[B, H_q]``)."""
        B, H, _ = self.live.shape
        return torch.zeros(B, H * self.group, dtype=torch.long, device=self.live.device)

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


class SlotStore(KVState):
    """Bounded slot storage: keys, values, each slot's original position and per-slot fields.

    At most ``budget`` slots per (batch row, KV head) once a step is answered; every buffer is
    reindexed together by compaction and :meth:`select_batch`. ``seen`` counts the tokens seen,
    ``length`` the slots stored. The storage of :class:`EvictingState` and of SubGen's sketch.
    """

    def __init__(self, budget: int, layer: LayerSpec) -> None:
        super().__init__(layer)
        self.budget = budget
        self.seen = 0
        self._positions = GrowableBuffer(dim=2)
        self._fields: dict[str, tuple[GrowableBuffer, torch.dtype, float]] = {}
        self._slots = None  # the slot_attention backend, chosen on the first step

    def _attend_slots(self, grouped, keys, values, den=None, num=None, floor=None) -> tuple[torch.Tensor, torch.Tensor]:
        """:func:`~sparseattn.ops.slots.slot_attention` of ``grouped: [B, H_kv, G, T, D]`` through the backend
        that accepted this state's inputs (chosen once; unchecked afterwards)."""
        if self._slots is None:
            self._slots = select_backend("auto", "slot_attention", q=grouped, keys=keys, softcap=self.softcap)
        return self._slots.slot_attention(grouped, keys, values, den, num, self.scale, self.softcap, floor, checked=False)

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

    def _append_block(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Store a block ``[B, H_kv, T, D]`` in new slots, positions ``seen .. seen + T - 1``."""
        B, H, T, _ = keys.shape
        self._append_slots(keys, values, torch.arange(self.seen, self.seen + T, device=self.device).expand(B, H, T))
        self.seen += T

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

    def _settle(self) -> None:
        """Bring the store down to ``budget`` slots (what a prompt block left above it)."""
        raise NotImplementedError

class EvictingState(SlotStore):
    """The engine of an :class:`EvictionPolicy` for one layer: at most ``budget`` slots per (row, KV head).

    A decode token arriving at a full store competes with the stored ones (the lowest priority
    leaves, ties the oldest) and, when it wins, overwrites the loser's slot in place (O(1) copy, no
    compaction); a prompt block is appended, attended densely over everything stored, observed,
    and only then evicted down to the budget. ``prompt_length`` is ``seen`` after the latest prompt
    block (a block of more than one token).
    """

    def __init__(self, policy: EvictionPolicy, layer: LayerSpec) -> None:
        check_int(type(policy).__name__, "budget", policy.budget, 1)
        super().__init__(policy.budget, layer)
        self.policy = policy
        self.method = policy
        self.prompt_length = 0
        self._observation = policy.observation
        if self._observation is not None:
            self._add_slot_field("attention", self.compute_dtype, 0.0)

    @property
    def attention_record(self) -> torch.Tensor | None:
        """``[B, H_kv, S]`` the attention each stored token received (the policy's :class:`Observation`), or None."""
        return self.field("attention") if self._observation is not None else None

    def _candidates(self, newcomer: torch.Tensor | None = None) -> Candidates:
        """The stored tokens, followed by the decode token ``newcomer: [B, H_kv, D]`` when given."""
        record = self.attention_record
        if newcomer is None:
            positions, keys = self.positions, lambda: self.keys
            attention = None if record is None else lambda: record
        else:
            positions = F.pad(self.positions, (0, 1), value=self.seen)  # one op: this runs every decode step
            keys = lambda: torch.cat([self.keys, newcomer.unsqueeze(2)], dim=2)  # noqa: E731
            attention = None if record is None else lambda: F.pad(record, (0, 1))  # noqa: E731
        return Candidates(
            positions, seen=self.seen + (newcomer is not None), prompt_length=self.prompt_length,
            decode=newcomer is not None, keys=keys, attention=attention, owner=self.policy,
        )

    def _priority(self, tokens: Candidates) -> torch.Tensor:
        priority = self.policy.priority(tokens)
        want = (*tokens.positions.shape,)
        if not isinstance(priority, torch.Tensor) or tuple(priority.shape) != want or not priority.is_floating_point():
            got = tuple(priority.shape) if isinstance(priority, torch.Tensor) else type(priority).__name__
            raise ValueError(f"{self.policy!r}.priority must return a float tensor of shape {want}, got {got}")
        return defined_priority(priority.double())

    def _settle(self) -> None:
        if self.length > self.budget:
            self._compact(self._keep_slots(self._priority(self._candidates()), self.budget))

    def _keep_slots(self, priority: torch.Tensor, n: int) -> torch.Tensor:
        """The ``n`` highest-priority slots ``[B, H_kv, n]`` (ties: the newer token), in position order."""
        newest_first = self.positions.argsort(dim=-1, descending=True)
        ranked = priority.gather(-1, newest_first).argsort(dim=-1, descending=True, stable=True)
        keep = newest_first.gather(-1, ranked[..., :n])
        return keep.gather(-1, self.positions.gather(-1, keep).argsort(dim=-1))

    def _admit(self, key: torch.Tensor, value: torch.Tensor) -> None:
        """A decode token ``[B, H_kv, D]`` at a full store: it and the stored tokens compete, the lowest leaves."""
        tokens = self._candidates(key)
        priority = self._priority(tokens)
        low = priority.amin(dim=-1, keepdim=True)
        oldest = tokens.positions.masked_fill(priority != low, torch.iinfo(torch.long).max)
        loser = oldest.argmin(dim=-1)  # [B, H]; == S: the newcomer itself
        stored = loser < self.length
        # One device sync for both questions: is anything evictable, and did every head take the newcomer?
        all_protected, all_stored = torch.stack([(low == float("inf")).any(), stored.all()]).tolist()
        if all_protected:
            raise RuntimeError(f"{self.policy!r}: every token is protected (+inf), nothing can be evicted")
        if all_stored:
            self._write(loser, key, value, self.seen)
            return
        # Some KV heads keep what they have: their slot is rewritten with its own content.
        slot = loser.clamp(max=self.length - 1)
        B, H, D = key.shape
        index = slot.view(B, H, 1, 1).expand(B, H, 1, D)
        keep = stored.view(B, H, 1)
        new_key = torch.where(keep, key, self.keys.gather(2, index).squeeze(2))
        new_value = torch.where(keep, value, self.values.gather(2, index).squeeze(2))
        fields = {name: self.field(name).gather(2, slot.view(B, H, 1)) for name in self._fields}
        position = torch.where(stored, self.seen, self.positions.gather(2, slot.view(B, H, 1)).squeeze(2))
        self._write(slot, new_key, new_value, position)
        for name, old in fields.items():
            self.field(name).scatter_(2, slot.view(B, H, 1), torch.where(keep, self.field(name).gather(2, slot.view(B, H, 1)), old))

    # -- the DecodeState protocol --------------------------------------------------------------

    def append(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Add ``[B, H_kv, T, D]``: one decode token competes for a slot when the store is full; a block is
        appended, and evicted after :meth:`attend_block` (or the next step) has seen it."""
        self._check_kv(keys, values)
        T = keys.shape[2]
        if T == 1 and self.length >= self.budget:
            self._settle()
            self._admit(keys[:, :, 0], values[:, :, 0])
            self.seen += 1
            return
        self._append_block(keys, values)
        if T > 1:
            self.prompt_length = self.seen
            if self._observation is not None and self._observation.per_prompt:
                self.field("attention").zero_()  # a new prompt's observation replaces the last one's
        else:
            self._settle()

    def observe_block(self, query: torch.Tensor) -> None:
        """After the dense prefill attention over everything stored: the observation records it, then eviction
        to ``budget``."""
        super().observe_block(query)
        if self._observation is not None:
            observe_prompt(self._observation, self.field("attention"), query, self.keys, self.scale, self.softcap)
        self._settle()

    def attend(self, query: torch.Tensor) -> tuple[torch.Tensor, SlotSelection]:
        """Attention of ``query: [B, H_q, D]`` over every stored slot: ``([B, H_q, D], selection)``."""
        group = self._check_query(query)
        self._settle()
        B, H, D = self.batch, self.kv_heads, self.head_dim
        grouped = query.reshape(B, H, group, 1, D)
        out, probs = self._attend_slots(grouped, self.keys, self.values)
        if self._observation is not None and self._observation.decode:
            self.field("attention").add_(finite_evidence(probs[:, :, :, 0]).sum(dim=2))
        live = torch.ones(B, H, self.length, dtype=torch.bool, device=self.device)
        info = SlotSelection(live=live, positions=self.positions.clone(), group=group)
        return out.reshape(B, H * group, D).to(query.dtype), info
