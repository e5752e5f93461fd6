"""Helpers for testing sparse methods against their references (used by our tests, useful for yours)."""

from __future__ import annotations

import string
from pathlib import Path

import torch

from sparseattn.methods.eviction import SlotStore

#: Relative error allowed when comparing a fast path run in ``dtype`` with a float64 reference.
#: fp32 accumulates O(sqrt(t)) rounding steps of 2^-24; fp16/bf16 inputs are rounded once on entry.
RELATIVE_TOLERANCE = {
    torch.float64: 1e-10,
    torch.float32: 1e-5,
    torch.float16: 2e-3,
    torch.bfloat16: 1.6e-2,
}


def relative_error(actual: torch.Tensor, reference: torch.Tensor) -> float:
    """``||actual - reference|| / ||reference||`` in float64 (0 when both are zero)."""
    a, r = actual.double(), reference.double()
    denom = r.norm().item()
    return (a - r).norm().item() / denom if denom > 0 else (a - r).norm().item()


def assert_close(actual: torch.Tensor, reference: torch.Tensor, dtype: torch.dtype | None = None, *, what: str = "output") -> None:
    """Assert no NaN/inf in ``actual`` and a relative error within the tolerance of ``dtype``.

    Args:
        actual: the fast path's result.
        reference: the naive reference's result (ideally float64).
        dtype: the dtype the fast path ran in (default: ``actual.dtype``).
    """
    dtype = actual.dtype if dtype is None else dtype
    if actual.shape != reference.shape:
        raise AssertionError(f"{what}: shape {tuple(actual.shape)} != reference shape {tuple(reference.shape)}")
    if not torch.isfinite(actual).all():
        raise AssertionError(f"{what}: {int((~torch.isfinite(actual)).sum())} non-finite values")
    err = relative_error(actual, reference)
    tol = RELATIVE_TOLERANCE[dtype]
    if not err <= tol:
        raise AssertionError(f"{what}: relative error {err:.3e} exceeds the {dtype} tolerance {tol:.1e}")


# -- the contract every registered method meets (tests/test_methods_budget.py runs it over the registry) --

#: Shapes the contract runs at: batch 2, 2 KV heads, 3 query heads per KV head, head dim 8.
CONTRACT_SHAPE = (2, 2, 3, 8)


def contract_shape(head_dim: int | None = None) -> tuple[int, int, int, int]:
    """:data:`CONTRACT_SHAPE` with another head dim (the GPU run takes 16, the smallest the Triton kernels
    accept, so that its steps run them instead of the torch ops)."""
    B, H, G, D = CONTRACT_SHAPE
    return B, H, G, D if head_dim is None else head_dim
#: (prompt, how, dtype) of the budget checks: a prompt under the budget, over it in bfloat16, over it in 3 blocks.
BUDGET_CASES = ((29, "one-block", torch.float32), (97, "one-block", torch.bfloat16), (97, "blocks", torch.float32))


def contract_method(name: str, budget: int):
    """The registered method ``name`` at ``budget`` (if it takes one), with few random features (fast)."""
    from sparseattn import registry

    return registry.build(name, **registry.get(name).takes(budget=budget, n_features=32))


def run_prompt(state, keys: torch.Tensor, values: torch.Tensor, how: str, dtype: torch.dtype, device: str | torch.device = "cpu") -> None:
    """Prefill ``keys, values`` as one attended block (``one-block``), three (``blocks``), or appended without queries.

    ``keys, values`` are on the state's ``device`` already; the block queries are drawn on the CPU and
    moved there, so a run draws the same numbers on every device.
    """
    B, H, T, D = keys.shape
    G = CONTRACT_SHAPE[2]
    if how == "no-queries":
        state.prefill(keys, values)
        return
    cuts = [0, T] if how == "one-block" else [0, T // 3, 2 * T // 3, T]
    for a, b in zip(cuts, cuts[1:]):
        state.append(keys[:, :, a:b], values[:, :, a:b])
        state.attend_block(torch.randn(B, H * G, b - a, D, dtype=dtype).to(device))


def check_on_device(name: str, what: str, x: torch.Tensor, device: str | torch.device) -> None:
    """Raise AssertionError unless ``x`` lives on ``device`` (``"cuda"`` means the current CUDA device):
    a step that answers from the CPU for a CUDA state has silently left the device."""
    from sparseattn.methods.base import resolve_device

    if x.device != resolve_device(device):
        raise AssertionError(f"{name}: {what} is on {x.device}, but the state lives on {resolve_device(device)}")


def check_dense_at_full_budget(
    name: str, how: str = "one-block", prompt: int = 41, steps: int = 23, device: str | torch.device = "cpu",
    head_dim: int | None = None,
) -> None:
    """At a budget of at least ``t`` the method is dense attention (float64 reference), attending all ``t`` tokens.

    The state and its inputs live on ``device``; inputs are drawn on the CPU (the same numbers on every
    device) and the float64 reference runs there, on the CPU copies.
    """
    from sparseattn.ops.attention import attention_ref

    B, H, G, D = contract_shape(head_dim)
    keys = torch.randn(B, H, prompt + steps, D, dtype=torch.float64).float()
    values = torch.randn(B, H, prompt + steps, D, dtype=torch.float64).float()
    on_keys, on_values = keys.to(device), values.to(device)
    state = contract_method(name, prompt + steps).new_state(B, H, D, device=device)
    run_prompt(state, on_keys[:, :, :prompt], on_values[:, :, :prompt], how, torch.float32, device)
    for t in range(prompt, prompt + steps):
        q = torch.randn(B, H * G, D)
        out, info = state.step(q.to(device), on_keys[:, :, t], on_values[:, :, t])
        check_on_device(name, f"the output at t={t + 1}", out, device)
        check_on_device(name, f"attended at t={t + 1}", info.attended, device)
        reference = attention_ref(q.view(B, H, G, D), keys[:, :, : t + 1], values[:, :, : t + 1]).view(B, H * G, D)
        assert_close(out.cpu(), reference, torch.float32, what=f"{name} at t={t + 1}")
        if not torch.equal(info.attended.cpu(), torch.full((B, H * G), t + 1)):
            raise AssertionError(f"{name} at t={t + 1}: attended {info.attended.tolist()}, not every token")


def over_budget(state, attended: torch.Tensor, budget: int) -> bool:
    """Whether a step attended more than ``budget`` tokens: per head, or on average over a row's heads when
    the method splits the layer's budget unevenly (a non-uniform ``allocation``)."""
    allocation = getattr(getattr(state, "method", None), "allocation", None)
    if allocation is not None and not allocation.uniform:
        return bool((attended.double().mean(-1) > budget).any())
    return int(attended.max()) > budget


def check_budget_honoured(
    name: str, budget: int = 48, prompt: int = 97, how: str = "one-block", dtype=torch.float32, device: str | torch.device = "cpu",
    head_dim: int | None = None,
) -> None:
    """No decode step attends more than ``budget`` tokens (per head; on average over the heads under a
    non-uniform allocation); ``attended`` is the size of ``to_mask()``; outputs finite and on ``device``,
    where the state and its inputs live (inputs drawn on the CPU: the same numbers on every device)."""
    B, H, G, D = contract_shape(head_dim)
    state = contract_method(name, budget).new_state(B, H, D, dtype=dtype, device=device)
    keys, values = torch.randn(B, H, prompt, D, dtype=dtype), torch.randn(B, H, prompt, D, dtype=dtype)
    run_prompt(state, keys.to(device), values.to(device), how, dtype, device)
    for _ in range(70):
        q, k, v = torch.randn(B, H * G, D), torch.randn(B, H, D), torch.randn(B, H, D)
        out, info = state.step(q.to(device, dtype), k.to(device, dtype), v.to(device, dtype))
        check_on_device(name, "the output", out, device)
        check_on_device(name, "attended", info.attended, device)
        if not torch.isfinite(out).all():
            raise AssertionError(f"{name}: non-finite output")
        if info.attended.shape != (B, H * G) or over_budget(state, info.attended, budget):
            raise AssertionError(f"{name}: attended {info.attended.tolist()} with a budget of {budget}")
        # Stand-in tokens beyond the stored ones (a merged rest) count in ``attended`` too; not part of the
        # StepInfo protocol (no engine reads them), so a third-party info without them has none.
        mask = info.to_mask()
        check_on_device(name, "to_mask()", mask, device)
        in_mask = mask.sum(-1) + getattr(info, "merged", 0)
        if not torch.equal(info.attended, in_mask):
            raise AssertionError(f"{name}: attended {info.attended.tolist()} is not the size of its mask plus its merged tokens {in_mask.tolist()}")
        if isinstance(state, SlotStore) and (state.length > budget or state.keys.shape != (B, H, state.length, D)):
            raise AssertionError(f"{name}: stores {tuple(state.keys.shape)} with a budget of {budget}")  # eviction is physical


def check_beam_reindexing(name: str, budget: int = 48, device: str | torch.device = "cpu", head_dim: int | None = None) -> None:
    """``select_batch`` repeats and reorders rows (beam search); decoding goes on with the new batch.

    The state, its inputs and the row index live on ``device`` (an engine's beam index is on the
    model's device); inputs are drawn on the CPU, so every device sees the same numbers.
    """
    B, H, G, D = contract_shape(head_dim)
    state = contract_method(name, budget).new_state(B, H, D, device=device)
    keys, values = torch.randn(B, H, 90, D), torch.randn(B, H, 90, D)
    state.append(keys.to(device), values.to(device))
    state.attend_block(torch.randn(B, H * G, 90, D).to(device))
    q, k, v = torch.randn(B, H * G, D), torch.randn(B, H, D), torch.randn(B, H, D)
    state.step(q.to(device), k.to(device), v.to(device))
    before = state.keys.clone()
    state.select_batch(torch.tensor([1, 1, 0], device=device))
    if state.batch != 3 or not torch.equal(state.keys, before[[1, 1, 0]]):
        raise AssertionError(f"{name}: select_batch did not reindex the stored keys")
    q, k, v = torch.randn(3, H * G, D), torch.randn(3, H, D), torch.randn(3, H, D)
    out, info = state.step(q.to(device), k.to(device), v.to(device))
    check_on_device(name, "the output after select_batch", out, device)
    if out.shape != (3, H * G, D) or (_takes_budget(name) and over_budget(state, info.attended, budget)):
        raise AssertionError(f"{name}: after select_batch, output {tuple(out.shape)}, attended {info.attended.tolist()}")


def check_method(name: str, device: str | torch.device = "cpu", head_dim: int | None = None) -> None:
    """Run the contract on the registered method ``name``: dense at full budget (three ways of prefilling),
    the budget honoured (float32 and bfloat16, one or three prompt blocks), beam reindexing.

    ``device`` is where the states and their inputs live (``"cuda"``: the GPU run of
    tests/test_contract_device.py); the inputs are drawn on the CPU and the float64 references run
    there, so a device gets the same inputs as the CPU and every output is also checked to stay on it.
    ``head_dim`` replaces :data:`CONTRACT_SHAPE`'s 8 (16 on CUDA: the Triton kernels' smallest).

    Raises AssertionError naming the method and what failed; returns None when the method meets it.
    """
    for how in ("one-block", "blocks", "no-queries"):
        check_dense_at_full_budget(name, how, device=device, head_dim=head_dim)
    if _takes_budget(name):
        for prompt, how, dtype in BUDGET_CASES:
            check_budget_honoured(name, 48, prompt, how, dtype, device=device, head_dim=head_dim)
    check_beam_reindexing(name, device=device, head_dim=head_dim)


def _takes_budget(name: str) -> bool:
    from sparseattn import registry

    return "budget" in registry.get(name).option_names


# -- a tiny model for examples and tests that need a real checkpoint but no download ---------------

SPECIALS = ["<pad>", "<s>", "</s>", "<unk>"]
CHARS = list(string.printable)


def char_tokenizer():
    """A character-level fast tokenizer (printable ASCII plus 4 specials): no vocabulary file to download."""
    import tokenizers
    import transformers as tf

    vocab = {tok: i for i, tok in enumerate(SPECIALS + CHARS)}
    model = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<unk>"))
    model.pre_tokenizer = tokenizers.pre_tokenizers.Split(tokenizers.Regex(r"[\s\S]"), behavior="isolated")
    model.decoder = tokenizers.decoders.Fuse()
    return tf.PreTrainedTokenizerFast(
        tokenizer_object=model, pad_token="<pad>", bos_token="<s>", eos_token="</s>", unk_token="<unk>", model_max_length=4096
    )


def save_tiny_checkpoint(path: Path, seed: int = 0) -> Path:
    """A random 2-layer Llama (6 query / 2 KV heads, head dim 8) and its character tokenizer saved at ``path``.

    A local HF directory (safetensors) that ``--model`` and ``load_model`` accept; seconds to write.
    """
    import transformers as tf

    tokenizer = char_tokenizer()
    torch.manual_seed(seed)
    config = tf.LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=48, intermediate_size=96, num_hidden_layers=2, num_attention_heads=6,
        num_key_value_heads=2, max_position_embeddings=4096, pad_token_id=0, bos_token_id=1, eos_token_id=2,
    )
    model = tf.LlamaForCausalLM(config).eval()
    model.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    return path
