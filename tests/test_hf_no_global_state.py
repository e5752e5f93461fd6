"""The transformers integration keeps no global state, and every state satisfies the one ``DecodeState`` contract.

The attention function finds its layer's state through the cache the attention module is called with
(hooks :func:`sparseattn.hf.apply` installs), never through a module-level table; every state's
``attend`` returns a ``StepInfo``; the ``DecodeState`` protocol declares everything the integration
calls, so a state written against the protocol alone decodes through ``generate`` (beam search and
left padding included).
"""

from __future__ import annotations

import importlib

import pytest
import torch

import hf_models
from hf_models import ARCHITECTURES, left_pad, prompts, tiny_model
from sparseattn import Dense, Radar, RadarAlg1
from sparseattn import registry
from sparseattn.evaluation.shared_prefill import Fanout, FanoutState, _split_layer
from sparseattn.hf import SparseCache, apply, cache_kwargs
from sparseattn.hf.attention import ATTENTION_NAME, CALL_CACHE, link_caches, register, unlink_caches
from sparseattn.hf.cache import RowwiseSelection, RowwiseState
from sparseattn.methods.base import DecodeState, StepInfo

HF_MODULES = ("sparseattn.hf", "sparseattn.hf.apply", "sparseattn.hf.attention", "sparseattn.hf.cache")
PROPERTIES = {"batch", "length", "keys", "values"}
METHOD_MEMBERS = {"append", "attend", "attend_block", "step", "select_batch", "nbytes"}


def declared(protocol) -> set[str]:
    return {name for name in vars(protocol) if not name.startswith("_")}


def decode(model, cache, ids: torch.Tensor, mask: torch.Tensor | None = None, steps: int = 6):
    """Prefill ``ids``, then greedy-decode ``steps`` tokens one forward call each; yields each call's logits."""
    with torch.no_grad():
        logits = model(ids, attention_mask=mask, **cache_kwargs(model, cache), use_cache=True).logits[:, -1]
        yield logits
        for _ in range(steps):
            token = logits.argmax(-1, keepdim=True)
            if mask is not None:
                mask = torch.cat([mask, torch.ones_like(token)], 1)
            logits = model(token, attention_mask=mask, **cache_kwargs(model, cache), use_cache=True).logits[:, -1]
            yield logits


def alone(model, cache, ids, mask=None, steps=6) -> list[torch.Tensor]:
    return list(decode(model, cache, ids, mask, steps))


def interleaved(*runs) -> list[list[torch.Tensor]]:
    """Advance several ``decode`` generators one forward call at a time, in turn."""
    out: list[list[torch.Tensor]] = [[] for _ in runs]
    for calls in zip(*runs):
        for i, logits in enumerate(calls):
            out[i].append(logits)
    return out


def assert_same(got: list[torch.Tensor], expected: list[torch.Tensor], label: str) -> None:
    assert len(got) == len(expected)
    for step, (g, e) in enumerate(zip(got, expected)):
        torch.testing.assert_close(g, e, rtol=0, atol=0, msg=f"{label}: step {step} differs")


def no_call_cache_left(model) -> bool:
    return not any(CALL_CACHE in module.__dict__ for module in model.modules())


def hook_count(model) -> int:
    return sum(len(m._forward_pre_hooks) + len(m._forward_hooks) for m in model.modules())


# -- no global state ------------------------------------------------------------------------------


def test_no_module_of_the_integration_holds_mutable_state():
    for name in HF_MODULES:
        module = importlib.import_module(name)
        assert not hasattr(module, "_HANDOFF") and not hasattr(module, "take_handoff"), name
        tables = [k for k, v in vars(module).items() if isinstance(v, (dict, list, set)) and not k.startswith("__")]
        assert tables == [], f"{name} keeps module-level mutable state: {tables}"


def test_two_models_applied_at_once_decode_interleaved_exactly_as_each_alone():
    llama, qwen = tiny_model("llama", seed=1), tiny_model("qwen2", seed=2)
    ids_a, ids_b = prompts(1, [37], seed=3)[0], prompts(1, [41], seed=4)[0]
    method_a, method_b = Radar(top_k=2, n_features=32), RadarAlg1(top_k=1, n_features=32)
    with apply(llama, method_a) as a:
        expected_a = alone(llama, a.new_cache(), ids_a)
    with apply(qwen, method_b) as b:
        expected_b = alone(qwen, b.new_cache(), ids_b)
    with apply(llama, method_a) as a, apply(qwen, method_b) as b:
        cache_a, cache_b = a.new_cache(), b.new_cache()
        got_a, got_b = interleaved(decode(llama, cache_a, ids_a), decode(qwen, cache_b, ids_b))
        assert no_call_cache_left(llama) and no_call_cache_left(qwen)
    assert_same(got_a, expected_a, "llama")
    assert_same(got_b, expected_b, "qwen2")
    assert all(layer.stats.steps == 6 for cache in (cache_a, cache_b) for layer in cache.sparse_layers)


def test_the_same_architecture_twice_with_different_methods_interleaved():
    """Two models of one class (same attention module class, same layer indices) stay apart."""
    first, second = tiny_model("gemma2", seed=0), tiny_model("gemma2", seed=5)
    ids, mask = left_pad(prompts(2, [33, 26], seed=6))
    methods = (Radar(top_k=1, n_features=32), Dense())
    expected = []
    for model, method in zip((first, second), methods):
        with apply(model, method) as sparse:
            expected.append(alone(model, sparse.new_cache(), ids, mask))
    with apply(first, methods[0]) as s1, apply(second, methods[1]) as s2:
        got = interleaved(decode(first, s1.new_cache(), ids, mask), decode(second, s2.new_cache(), ids, mask))
    assert_same(got[0], expected[0], "first")
    assert_same(got[1], expected[1], "second")


def test_several_caches_of_one_model_used_in_turn_including_hand_made_ones():
    model = tiny_model("llama", seed=7)
    method = Radar(top_k=2, n_features=32)
    ids = prompts(2, [45, 45], seed=8)
    with apply(model, method) as sparse:
        expected = [alone(model, sparse.new_cache(), row) for row in ids]
        caches = [SparseCache(method, config=model.config), SparseCache(method)]  # made by hand, one without config
        got = interleaved(*(decode(model, cache, row) for cache, row in zip(caches, ids)))
    for i in range(2):
        assert_same(got[i], expected[i], f"cache {i}")
    assert all(layer.stats.steps == 6 for cache in caches for layer in cache.sparse_layers)


def test_apply_removes_its_hooks_and_leaves_nothing_on_the_modules_even_after_an_error():
    model = tiny_model("llama")
    before = hook_count(model)
    ids = torch.cat(prompts(2, [12, 12]))
    right_padded = torch.ones_like(ids)
    right_padded[1, -3:] = 0
    with apply(model, Radar(top_k=1)) as sparse:
        assert hook_count(model) > before
        with pytest.raises(ValueError, match="left padding"):  # raised inside the attention function
            model(ids, attention_mask=right_padded, **cache_kwargs(model, sparse.new_cache()))
        assert no_call_cache_left(model)
        model(ids, **cache_kwargs(model, sparse.new_cache()))  # still usable
        assert no_call_cache_left(model)
    assert hook_count(model) == before
    assert model.config._attn_implementation == "sdpa"


def test_the_implementation_set_without_apply_refuses_a_sparse_cache():
    """Without apply's hooks the attention function cannot reach the cache: the cache says so, not dense decoding."""
    model = tiny_model("llama")
    register()
    model.set_attn_implementation(ATTENTION_NAME)
    ids = prompts(1, [20])[0]
    with pytest.raises(RuntimeError, match=r"attention implementation is not 'sparseattn'.*sparseattn\.apply"):
        hf_models.greedy(model, ids, torch.ones_like(ids), SparseCache(Radar(top_k=1), config=model.config), 3)


@pytest.mark.parametrize("name", list(ARCHITECTURES))
def test_every_architecture_reaches_its_sparse_layers_through_the_module(name):
    """The decoder layers pass the cache to the attention module (by keyword); every sparse layer decodes sparsely."""
    model = tiny_model(name)
    ids, mask = left_pad(prompts(2, [30, 22]))
    with apply(model, Radar(top_k=1, n_features=32)) as sparse:
        cache = sparse.new_cache()
        hf_models.greedy(model, ids, mask, cache, 4)
    assert len(cache.sparse_layers) == sum(not sliding for sliding in cache.is_sliding)  # none: mistral-sliding
    assert all(layer.stats.steps == 3 and layer.state is not None for layer in cache.sparse_layers), name


@pytest.mark.parametrize("name", ["cache", "past_key_values"])  # transformers >= 5.24, and before
def test_a_cache_passed_positionally_or_by_either_name_is_found(name):
    class Attention(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.layer_idx = 0
            self.seen = []

    def forward(self, hidden, mask=None, cache=None, **kwargs):
        self.seen.append(self.__dict__.get(CALL_CACHE))
        return hidden

    def forward_before_5_24(self, hidden, mask=None, past_key_values=None, **kwargs):
        self.seen.append(self.__dict__.get(CALL_CACHE))
        return hidden

    Attention.forward = forward if name == "cache" else forward_before_5_24
    module = Attention()
    handles = link_caches(module)
    marker = object()
    module(torch.zeros(1), None, marker)
    module(torch.zeros(1), **{name: marker})
    module(torch.zeros(1))
    assert module.seen == [marker, marker, None] and CALL_CACHE not in module.__dict__
    unlink_caches(handles)
    module(torch.zeros(1), None, marker)
    assert module.seen[-1] is None


def test_a_model_without_attention_modules_is_refused():
    with pytest.raises(ValueError, match="layer_idx"):
        link_caches(torch.nn.Linear(2, 2))


# -- one DecodeState / StepInfo contract ---------------------------------------------------------------


def test_the_protocol_declares_what_the_integration_calls():
    assert declared(DecodeState) == PROPERTIES | METHOD_MEMBERS
    assert declared(StepInfo) == {"attended", "to_mask"}


def exercise(state, batch: int = 2, kv_heads: int = 2, head_dim: int = 8, group: int = 3) -> None:
    """Call every ``DecodeState`` member as the integration does and check the shapes it promises."""
    gen = torch.Generator().manual_seed(0)
    T = 64
    keys, values = torch.randn(batch, kv_heads, T, head_dim, generator=gen), torch.randn(batch, kv_heads, T, head_dim, generator=gen)
    state.append(keys, values)
    assert isinstance(state, DecodeState)  # keys/values readable now (Python < 3.12 reads them in isinstance)
    for name in PROPERTIES:
        getattr(state, name)
    for name in METHOD_MEMBERS:
        assert callable(getattr(state, name)), name
    out = state.attend_block(torch.randn(batch, kv_heads * group, T, head_dim, generator=gen))
    assert out.shape == (batch, kv_heads * group, T, head_dim)
    q, k, v = (torch.randn(batch, h, head_dim, generator=gen) for h in (kv_heads * group, kv_heads, kv_heads))
    for _ in range(2):
        out, info = state.step(q, k, v)
        assert out.shape == (batch, kv_heads * group, head_dim)
        assert isinstance(info, StepInfo)
        assert info.attended.shape == (batch, kv_heads * group)
        assert info.to_mask().shape == (batch, kv_heads * group, state.length)
        assert state.keys.shape == state.values.shape == (batch, kv_heads, state.length, head_dim)
    state.append(k.unsqueeze(2), v.unsqueeze(2))
    out, info = state.attend(q)
    assert isinstance(info, StepInfo) and out.shape == q.shape
    state.select_batch(torch.tensor([1, 0, 1]))
    assert state.batch == 3 and state.keys.shape[0] == 3
    nbytes = state.nbytes()
    assert isinstance(nbytes, dict) and nbytes["kv"] > 0 and all(isinstance(n, int) for n in nbytes.values())


@pytest.mark.parametrize("name", registry.names())
def test_every_registered_methods_state_has_every_declared_member(name):
    method = registry.build(name, **registry.get(name).takes(budget=48, n_features=32))  # < the 64-token prompt: evicting methods evict
    exercise(method.new_state(2, 2, 8))


def test_the_engines_own_states_satisfy_the_protocol():
    method = Radar(top_k=2, n_features=32)
    exercise(FanoutState([method.new_state(2, 2, 8), Dense().new_state(2, 2, 8)]))
    exercise(RowwiseState([method.new_state(1, 2, 8) for _ in range(2)], pads=[0, 5]))


def test_a_rowwise_step_returns_a_step_info_padded_like_its_keys():
    state = RowwiseState([Dense().new_state(1, 2, 8) for _ in range(2)], pads=[0, 5])
    state.append(torch.randn(2, 2, 12, 8), torch.randn(2, 2, 12, 8))
    assert state.row_lengths == [12, 7] and state.length == 12
    _, info = state.attend(torch.randn(2, 4, 8))
    assert isinstance(info, RowwiseSelection) and isinstance(info, StepInfo)
    assert info.attended.tolist() == [[12] * 4, [7] * 4]
    mask = info.to_mask()
    assert mask.shape == (2, 4, 12)
    assert bool(mask[0].all()) and not bool(mask[1, :, :5].any()) and bool(mask[1, :, 5:].all())
    assert not bool(state.keys[1, :, :5].any())  # keys are left-padded with zeros the same way


class ProtocolOnlyState:
    """A state that offers exactly the ``DecodeState`` members (delegating to a dense state) and nothing else."""

    __slots__ = ("_inner",)

    def __init__(self, inner) -> None:
        self._inner = inner

    batch = property(lambda self: self._inner.batch)
    length = property(lambda self: self._inner.length)
    keys = property(lambda self: self._inner.keys)
    values = property(lambda self: self._inner.values)

    def append(self, keys, values):
        self._inner.append(keys, values)

    def attend(self, query):
        return self._inner.attend(query)

    def attend_block(self, query):
        return self._inner.attend_block(query)

    def step(self, query, key, value):
        return self._inner.step(query, key, value)

    def select_batch(self, index):
        self._inner.select_batch(index)

    def nbytes(self):
        return self._inner.nbytes()


class ProtocolOnly:
    def new_state(self, layer):
        return ProtocolOnlyState(Dense().new_state(layer))


def test_a_state_written_against_the_protocol_alone_decodes_with_padding_and_beam_search():
    assert declared(ProtocolOnlyState) == PROPERTIES | METHOD_MEMBERS
    model = tiny_model("llama")
    ids, mask = left_pad(prompts(2, [31, 24]))
    reference = hf_models.greedy(model, ids, mask, None, 8)
    beams = {"attention_mask": mask, "max_new_tokens": 8, "num_beams": 3, "do_sample": False, "pad_token_id": 0}
    beam_reference = model.generate(ids, **beams)
    with apply(model, ProtocolOnly()) as sparse:
        out = hf_models.greedy(model, ids, mask, sparse.new_cache(), 8)
        beam = model.generate(ids, **cache_kwargs(model, sparse.new_cache()), **beams)
    assert torch.equal(out.sequences, reference.sequences)
    assert torch.equal(beam, beam_reference)


def test_a_shared_left_padded_prefill_splits_into_the_caches_of_separate_prefills():
    """``prefill_together`` splits a fan-out cache layer by layer; a padded batch's RowwiseState splits too."""
    model = tiny_model("llama", seed=3)
    ids, mask = left_pad(prompts(2, [40, 29], seed=9))
    methods = [Radar(top_k=1, n_features=32), Dense()]
    fanout = Fanout(tuple(methods))
    with apply(model, fanout), torch.no_grad():
        shared = SparseCache(fanout, config=model.config)
        model(ids, attention_mask=mask, **cache_kwargs(model, shared), use_cache=True)
    assert all(isinstance(layer.state, RowwiseState) for layer in shared.sparse_layers)
    token = torch.full((2, 1), 5)
    longer = torch.cat([mask, torch.ones_like(token)], 1)
    for index, method in enumerate(methods):
        split = SparseCache(method, config=model.config)
        split.layers = [_split_layer(layer, method, index) for layer in shared.layers]
        with apply(model, method), torch.no_grad():
            own = SparseCache(method, config=model.config)
            model(ids, attention_mask=mask, **cache_kwargs(model, own), use_cache=True)
            expected = model(token, attention_mask=longer, **cache_kwargs(model, own), use_cache=True).logits
            got = model(token, attention_mask=longer, **cache_kwargs(model, split), use_cache=True).logits
        torch.testing.assert_close(got, expected, rtol=0, atol=0, msg=repr(method))
