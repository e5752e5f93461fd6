"""Greedy decoding in a loop of fixed-shape steps: eager, compiled, or captured as CUDA graphs.

``model.generate`` with a :class:`~sparseattn.hf.cache.SparseCache` runs every decode step from Python:
hundreds of kernel launches a token, each a few microseconds, which on a GPU cost more than the bytes a
sparse step saves (docs/performance.md). :func:`generate` prefills through a ``SparseCache`` exactly as
``model.generate`` does, hands it to a :class:`~sparseattn.hf.static_cache.StaticSparseCache`, and decodes
in steps whose shapes hold while a segment grid lasts (a phase). With ``graphs=True`` (CUDA) each phase's
first step runs eagerly (the warm-up) and the step is captured once and replayed for the rest of the phase;
with ``compile=True`` the step goes through ``torch.compile`` (recompiled when a phase changes the shapes).
The dense baseline (``Dense``) runs through the same loop, so a comparison is loop against loop.

Greedy only, a fixed number of new tokens (no early stop: a captured loop does not look at its tokens;
cut at an end-of-sequence token afterwards), rows of one length (no padding).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from sparseattn.hf.apply import apply, cache_kwargs
from sparseattn.hf.cache import SparseCache, SparseLayer
from sparseattn.hf.static_cache import StaticSparseCache
from sparseattn.methods.static_step import static_refusal


@dataclass(frozen=True)
class LoopResult:
    """What :func:`generate` decoded and how.

    ``tokens``: ``[B, max_new_tokens]`` greedy tokens (the first from the prefill's logits). ``phases``: runs of
    fixed shapes; ``captures``: CUDA graphs captured (``graphs=True``). ``attended``: tokens a query head
    attended per decode step, averaged over layers and steps. Wall seconds (the device synchronised at each
    phase's bounds): ``prefill_s`` the prefill (its first token included); ``decode_s`` every decode step;
    ``steady_s`` the ``steady_steps`` steps after each phase's first (which sets the phase up: the structure,
    a warm-up and capture with ``graphs``, a compile with ``compile``).
    """

    tokens: torch.Tensor
    phases: int
    captures: int
    attended: float
    prefill_s: float
    decode_s: float
    steady_s: float
    steady_steps: int

    @property
    def steps(self) -> int:
        """Decode steps run (the first token comes from the prefill)."""
        return self.tokens.shape[1] - 1

    @property
    def steady_ms(self) -> float:
        """Milliseconds a decode step takes once its phase is set up (nan when no phase had a second step)."""
        return 1e3 * self.steady_s / self.steady_steps if self.steady_steps else float("nan")


def check_loop(model, input_ids, method, max_new_tokens, *, graphs: bool, compile: bool, prefill_chunk: int = 0) -> None:
    """Raise a ValueError naming the option and the value when :func:`generate` cannot run them, before any work."""
    if isinstance(prefill_chunk, bool) or not isinstance(prefill_chunk, int) or prefill_chunk < 0:
        raise ValueError(f"generate: prefill_chunk must be an int >= 0 (0: the prompt in one pass), got {prefill_chunk!r}")
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2 or input_ids.shape[1] == 0 or input_ids.is_floating_point():
        shape = tuple(input_ids.shape) if isinstance(input_ids, torch.Tensor) else type(input_ids).__name__
        raise ValueError(f"generate: input_ids must be a [batch, prompt] tensor of token ids (one length per row), got {shape}")
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"generate: max_new_tokens must be an int >= 1, got {max_new_tokens!r}")
    if graphs and compile:
        raise ValueError("generate: graphs=True and compile=True: give one (graphs captures the eager step; compile traces it)")
    device = input_ids.device
    if graphs and device.type != "cuda":
        raise ValueError(f"generate: graphs=True captures CUDA graphs; the inputs are on {device} (use compile=True or neither there)")
    n_layers = getattr(model.config, "num_hidden_layers", None)
    reason = static_refusal(method, n_layers, capture=graphs)
    if reason is not None:
        raise ValueError(f"generate: {method!r} cannot decode in fixed shapes{' captured as CUDA graphs' if graphs else ''}: {reason}")
    plain = [type(layer).__name__ for layer in SparseCache(method, config=model.config).layers if not isinstance(layer, SparseLayer)]
    if plain:
        raise ValueError(f"generate: the model has layers the fixed-shape loop does not hold ({sorted(set(plain))}: sliding-window or other)")
    limit = getattr(model.config, "max_position_embeddings", None)
    if limit is not None and input_ids.shape[1] + max_new_tokens > limit:
        raise ValueError(
            f"generate: prompt {input_ids.shape[1]} + max_new_tokens {max_new_tokens} exceeds the model's "
            f"max_position_embeddings {limit}"
        )


@torch.no_grad()
def generate(
    model, input_ids: torch.Tensor, method, max_new_tokens: int, *, graphs: bool = False, compile: bool = False,
    prefill_chunk: int = 0,
) -> LoopResult:  # fmt: skip
    """Greedy decoding of ``max_new_tokens`` tokens with ``method``, in fixed-shape steps (see the module).

    Args:
        model: a transformers decoder (the loop applies ``method`` to it for the call and removes it after).
        input_ids: ``[B, P]`` prompt token ids, one length per row.
        method: a method with a fixed-shape step in every layer (:func:`~sparseattn.methods.static_step.static_refusal`).
        max_new_tokens: tokens to generate per row (all of them: no early stop).
        graphs: capture each phase's step as a CUDA graph and replay it (CUDA only; a summary that reads a value back
            to the host when it scores, Radar's random features, is refused).
        compile: run the step through ``torch.compile`` (CPU or GPU): compiled anew when a phase changes the shapes,
            so past torch's recompile limit (8 by default) the later phases run eagerly (dense's phases too: one per
            ``max(256, 2 sqrt t)`` steps, :func:`~sparseattn.methods.static_step.tail_reach`).
        prefill_chunk: prompt tokens per prefill pass (0: one pass); a long prompt's peak memory is its passes' MLP
            activations (128k tokens x 4 rows of an 8B model in one pass do not fit beside their cache on a 141 GB GPU).
    """
    check_loop(model, input_ids, method, max_new_tokens, graphs=graphs, compile=compile, prefill_chunk=prefill_chunk)
    B, P = input_ids.shape
    device = input_ids.device
    with apply(model, method) as sparse:
        start = time.perf_counter()
        cache = sparse.new_cache()
        per_pass = prefill_chunk or P
        for begin in range(0, P, per_pass):  # the sparse cache takes a chunked prefill as one (tests/test_static_loop.py)
            chunk = input_ids[:, begin : begin + per_pass]
            logits = model(input_ids=chunk, logits_to_keep=1, use_cache=True, **cache_kwargs(model, cache)).logits
        token = logits[:, -1].argmax(-1, keepdim=True)  # [B, 1]: the loop's input, updated in place by each step
        del logits
        _synchronize(device)
        prefill_s = time.perf_counter() - start
        static = StaticSparseCache(cache, capacity=P + max_new_tokens)
        del cache
        position_ids = static.position.view(1, 1)  # a view: each step reads the position the last one advanced

        def step() -> None:
            out = model(input_ids=token, position_ids=position_ids, logits_to_keep=1, use_cache=True, **cache_kwargs(model, static))
            token.copy_(out.logits[:, -1].argmax(-1, keepdim=True))
            static.position.add_(1)

        run = torch.compile(step, dynamic=False) if compile else step
        generated = [token.clone()]

        def record() -> None:
            generated.append(token.clone())

        phases = captures = steady_steps = 0
        steady_s = 0.0
        start = time.perf_counter()
        length, last = P + 1, P + max_new_tokens - 1  # lengths (the new token's own included) of the decode steps
        while length <= last:
            steps = static.begin(length, last)
            phases += 1
            replay = None  # the last phase's graph goes before the next is captured: one memory pool held at a time
            if graphs and steps > 1:
                replay = _captured(step, device)  # the phase's first step, then its graph
                captures += 1
            else:
                run()
                replay = run
            record()
            _synchronize(device)
            steady = time.perf_counter()
            for _ in range(steps - 1):
                replay()
                record()
            _synchronize(device)
            steady_s += time.perf_counter() - steady
            steady_steps += steps - 1
            length += steps
        decode_s = time.perf_counter() - start
        static.finish(P + max_new_tokens - 1)
    return LoopResult(
        torch.cat(generated, dim=1), phases, captures, static.mean_attended(), prefill_s, decode_s, steady_s, steady_steps
    )


def _captured(step, device: torch.device):
    """Run ``step`` once eagerly on a side stream (the warm-up CUDA graphs ask for), then capture it (capturing
    runs nothing); returns the graph's replay."""
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        step()
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    return graph.replay


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


__all__ = ["LoopResult", "check_loop", "generate"]
