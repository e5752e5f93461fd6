"""An lm-evaluation-harness model, ``sparseattn``: lm-eval's ``hf`` model decoding through a sparse method.

lm-eval 0.4.x looks models up in its own registry and loads no third-party plugins, so the model is
registered when this module is imported. The runner below takes ``lm_eval``'s own arguments::

    python -m sparseattn.evaluation.lm_eval_model --model sparseattn \\
        --model_args pretrained=default,method=radar+,budget=1024 --tasks TASKS --include_path DIR

and from Python, ``import sparseattn.evaluation.lm_eval_model`` before ``lm_eval.simple_evaluate(model="sparseattn", ...)``.

``model_args`` are lm-eval's ``hf`` arguments plus

* ``pretrained``: ``default`` (the embedded SmolLM2-135M-Instruct, see :func:`sparseattn.hf.load_model`),
  a local HF directory or a ``.gguf`` file; never a hub id;
* ``method``: a name from :mod:`sparseattn.registry` (``sparseattn methods`` lists them), required;
* that method's options as further ``key=value`` pairs (``top_k=8``, ``n_features=256``, ...).
  ``budget`` applies to every method with a budget unless ``top_k`` is given, as the CLI's ``--budget``
  (so ``method=dense,budget=1024`` runs dense); any other option the method does not take is refused.

How sparse attention applies (the protocol of ``sparseattn ppl``, so every scored or generated token
comes from one of the method's decode steps):

* **loglikelihood** of a continuation: the context except its last token is prefilled densely; the
  last context token and then the continuation's tokens but its last are fed one at a time through
  the sparse cache, and each step's logits score the next continuation token. A one-token answer (a
  multiple-choice letter) is thus scored by a sparse step too. Requests run one at a time; rolling
  loglikelihood (perplexity tasks) prefills its one-token prefix and decodes every window token.
* **generate_until**: the prompt except its last token is prefilled densely into a fresh sparse
  cache, then ``model.generate`` continues from it, so the first generated token is already sparse.

With ``method=dense`` both paths give lm-eval's ``hf`` scores (to float rounding).
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
import torch.nn.functional as F
from lm_eval.__main__ import cli_evaluate
from lm_eval.api.registry import register_model
from lm_eval.models.huggingface import HFLM
from tqdm import tqdm

from sparseattn import registry
from sparseattn.hf import apply, cache_kwargs
from sparseattn.hf.models import local_model_dir

#: The name lm-eval knows the model by (``--model sparseattn``).
MODEL_NAME = "sparseattn"


def build_method(method: str | None, options: dict[str, Any]) -> tuple[str, object]:
    """``(label, method)`` for ``method=NAME`` and its options from ``model_args``, checked by the registry.

    Raises:
        ValueError: no method, an unknown name, an option the method does not take, or a value out
            of range; the message is the registry's, as ``sparseattn`` commands show it.
    """
    if not method:
        raise ValueError(
            "model_args need method=NAME (`sparseattn methods` lists the names), e.g. method=radar+,budget=1024"
        )
    given = dict(options)
    budget = given.pop("budget", None)
    try:
        budget = None if budget is None else int(budget)
        parsed = registry.parse({"method": str(method), **{k: str(v) for k, v in given.items()}}, budget)
    except (ValueError, registry.PluginError) as err:
        given_args = ",".join([f"method={method}", *(f"{k}={v}" for k, v in options.items())])
        raise ValueError(f"model_args {given_args}: {err}") from None
    return parsed.label, parsed.method


@register_model(MODEL_NAME)
class SparseAttnLM(HFLM):
    """lm-eval's :class:`HFLM` whose loglikelihood and generation decode through ``method`` (see the module doc).

    Args:
        pretrained: ``"default"``, a local HF directory or a ``.gguf`` file.
        method: a registered method name; its options come as further keyword arguments.
        device: as for ``hf``; default ``"cuda"`` when available, ``"cpu"`` otherwise.
        **kwargs: lm-eval's ``hf`` arguments, then the method's options.
    """

    def __init__(
        self,
        pretrained: str = "default",
        method: str | None = None,
        device: str | None = None,
        **kwargs: Any,
    ) -> None:
        from sparseattn import registry

        options = {k: kwargs.pop(k) for k in list(kwargs) if k in registry.all_options()}
        self.method_label, self.method = build_method(method, options)  # refused before any weights load
        self.model_dir = str(local_model_dir(str(pretrained)))
        device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        super().__init__(pretrained=self.model_dir, device=device, **kwargs)
        if self.backend != "causal":
            raise ValueError(f"{self.model_dir} is a {self.backend} model; sparseattn decodes causal LMs only")

    def _keep_last(self) -> dict:
        """Prefill logits are never used: ask for the last position's only (``[1, T, vocab]`` otherwise)."""
        return {"logits_to_keep": 1} if "logits_to_keep" in inspect.signature(self.model.forward).parameters else {}

    def _continuation_logprobs(self, sparse, tokens: list[int], n_continuation: int) -> torch.Tensor:
        """Log-probabilities ``[n_continuation, vocab]`` of the last ``n_continuation`` of ``tokens``.

        ``tokens[: -n_continuation - 1]`` is prefilled densely; every later token but the last is one
        decode step whose logits predict the next token.
        """
        ids = torch.tensor([tokens], dtype=torch.long, device=self.device)  # [1, T]
        n_prefill = len(tokens) - n_continuation - 1
        cache = sparse.new_cache()
        if n_prefill:
            self.model(
                ids[:, :n_prefill],
                **cache_kwargs(self.model, cache),
                use_cache=True,
                **self._keep_last(),
            )
        rows = []
        for position in range(n_prefill, len(tokens) - 1):
            logits = self.model(
                ids[:, position : position + 1], **cache_kwargs(self.model, cache), use_cache=True
            ).logits  # [1, 1, V]
            rows.append(F.log_softmax(logits[0, -1], dim=-1, dtype=self.softmax_dtype))
        return torch.stack(rows)

    def _loglikelihood_tokens(
        self, requests, disable_tqdm: bool = False, override_bs: int | None = None
    ) -> list[tuple[float, bool]]:
        results = []
        bar = tqdm(
            requests,
            disable=disable_tqdm or self.rank != 0,
            desc=f"loglikelihood ({self.method_label})",
        )
        with (
            apply(self.model, self.method) as sparse,
            torch.no_grad(),
            torch.autocast(
                self.device.type,
                dtype=self.mixed_precision_dtype,
                enabled=self.mixed_precision_dtype is not None,
            ),
        ):
            for request, context, continuation in bar:
                if not context or not 0 < len(continuation) <= self.max_length:  # what hf asserts
                    raise ValueError(
                        f"a loglikelihood request needs a context and 1 to max_length={self.max_length} continuation "
                        f"tokens; got {len(context)} and {len(continuation)}"
                    )
                # As hf: left-truncate context + continuation to max_length + 1 tokens (the last is only predicted).
                tokens = (context + continuation)[-(self.max_length + 1) :]
                logprobs = self._continuation_logprobs(sparse, tokens, len(continuation))  # [n_cont, V]
                target = torch.tensor(continuation, dtype=torch.long, device=logprobs.device)
                answer = (
                    float(logprobs.gather(1, target[:, None]).sum()),
                    bool((logprobs.argmax(-1) == target).all()),
                )
                results.append(answer)
                if request is not None:  # rolling windows come without one: hf caches them per document
                    self.cache_hook.add_partial("loglikelihood", request, answer)
        return results

    def _model_generate(
        self,
        context: torch.Tensor,
        max_length: int,
        stop: list[str],
        **generation_kwargs,
    ) -> torch.Tensor:
        """``context: [batch, T]`` (left-padded, ``attention_mask`` in ``generation_kwargs``) -> ``[batch, T + new]``."""
        mask = generation_kwargs.get("attention_mask")
        mask = torch.ones_like(context) if mask is None else mask
        with apply(self.model, self.method) as sparse, torch.no_grad():
            cache = sparse.new_cache()
            if context.shape[1] > 1:
                # Positions as generate computes them under left padding, so the prefix matches its own prefill.
                positions = (mask[:, :-1].long().cumsum(-1) - 1).clamp(min=0)
                self.model(context[:, :-1], attention_mask=mask[:, :-1], position_ids=positions,
                           **cache_kwargs(self.model, cache), use_cache=True, **self._keep_last())  # fmt: skip
            return super()._model_generate(context, max_length, stop, **cache_kwargs(self.model, cache), **generation_kwargs)

    def get_model_info(self) -> dict:
        """What lm-eval writes into the results' config, with no hub look-up (everything is local)."""
        return {
            "model_num_parameters": sum(p.numel() for p in self.model.parameters()),
            "model_dtype": str(self.model.dtype),
            "model_dir": self.model_dir,
            "sparseattn_method": self.method_label,
            "sparseattn_method_repr": repr(self.method),
        }


def main(argv: list[str] | None = None) -> None:
    """lm-eval's command line with ``--model sparseattn`` registered; a bad method in ``--model_args`` is
    refused first, in one line with exit status 2, before lm-eval loads tasks or weights."""
    import sys

    args = sys.argv[1:] if argv is None else argv
    value = lambda flag: next((a.split("=", 1)[1] for a in args if a.startswith(flag + "=")), None) or next(  # noqa: E731
        (args[i + 1] for i, a in enumerate(args[:-1]) if a == flag), None
    )
    if value("--model") == MODEL_NAME:
        from sparseattn import registry

        pairs = dict(item.split("=", 1) for item in (value("--model_args") or "").split(",") if "=" in item)
        options = {k: v for k, v in pairs.items() if k in registry.all_options()}
        try:
            build_method(pairs.get("method"), options)
        except ValueError as err:
            print(f"sparseattn-lm-eval: error: {err}", file=sys.stderr)
            raise SystemExit(2) from None
    cli_evaluate()


if __name__ == "__main__":
    main()
