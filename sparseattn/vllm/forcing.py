"""Teacher forcing through vLLM's decode steps: each request may name the tokens it must generate.

Quality through a serving engine (the perplexity of a held continuation, next-token agreement that
does not compound) needs the engine's own decode steps fed the true tokens, one per step, as the
research engine does. vLLM has no such input, but its sampler computes the logprobs it returns from
the raw logits, before any logits processor runs; so a logits processor that leaves only the forced
token sampleable makes every step consume the true token while the returned logprobs are the model's
own: the forced token's logprob and rank, and (``logprobs=1``) the model's top-1 token.

    llm = LLM(..., logits_processors=[ForcedTokens])
    params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, logprobs=1,
                            extra_args={FORCED: true_tokens[:n]})

A request without ``extra_args[FORCED]`` is untouched; past the end of its list, a request samples
freely. Importing this module imports vLLM.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from vllm.v1.sample.logits_processor import AdapterLogitsProcessor

__all__ = ["FORCED", "ForcedTokens"]

#: The ``SamplingParams.extra_args`` key naming a request's forced tokens.
FORCED = "sparseattn_forced"


class ForcedTokens(AdapterLogitsProcessor):
    """Per request: at output step ``i``, every logit but that of ``extra_args[FORCED][i]`` set to -inf."""

    @classmethod
    def validate_params(cls, sampling_params) -> None:
        """A bad forced list is refused when the request is added (HTTP 400 through the server), not mid-batch."""
        from vllm.exceptions import VLLMValidationError

        forced = (sampling_params.extra_args or {}).get(FORCED)
        if forced is not None:
            try:
                _checked(forced)
            except ValueError as err:
                raise VLLMValidationError(str(err)) from None

    def is_argmax_invariant(self) -> bool:
        return False  # it changes the sampled token: vLLM must apply it for greedy requests too

    def new_req_logits_processor(self, params) -> Callable[[list[int], torch.Tensor], torch.Tensor] | None:
        forced = (params.extra_args or {}).get(FORCED)
        if forced is None:
            return None
        tokens = _checked(forced)

        def force(output_ids: list[int], logits: torch.Tensor) -> torch.Tensor:
            step = len(output_ids)
            if step >= len(tokens):
                return logits
            token = tokens[step]
            if not 0 <= token < logits.shape[-1]:
                raise ValueError(f"forced token {token} at step {step} is outside the vocabulary of {logits.shape[-1]}")
            kept = logits[..., token].clone()
            logits.fill_(float("-inf"))
            logits[..., token] = kept
            return logits

        return force


def _checked(forced: Sequence[int]) -> list[int]:
    if isinstance(forced, (str, bytes)) or not isinstance(forced, Sequence) or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in forced):
        raise ValueError(f"extra_args[{FORCED!r}] must be a list of token ids (ints), got {forced!r:.80}")
    return list(forced)
