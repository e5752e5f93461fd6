"""Changing a running engine's sparseattn method between requests: one prefill, several methods.

A benchmark that compares methods on the same long prompts would otherwise start one engine per
method and prefill every prompt in each (about 15 s per 8k-token prompt on one core). Every method of
the paged engine reads the same pages (prefill is vLLM's kernel in all of them), so one engine can
prefill once and answer the decode steps of each method in turn, the prompts' pages found in vLLM's
prefix cache. Started with a method and this worker extension::

    llm = LLM(model=..., additional_config={"sparseattn": {"method": "dense"}},
              worker_extension_cls="sparseattn.vllm.switch.MethodSwitch")
    use_method(llm, "radar+:budget=1024")   # every worker, every attention layer, from the next step on

The method lives on each worker's attention metadata builders
(:func:`sparseattn.vllm.backend.sparse_builders`), which hand it to every layer with each step's
metadata. A switch takes effect between steps: requests still running keep decoding under the new
method, so switch with none in flight. What a method derived from the pages (page summaries) is
dropped and rebuilt on first use. A method the paged engine cannot run is refused before anything changes.
"""

from __future__ import annotations

from typing import Any

__all__ = ["MethodSwitch", "use_method"]


class MethodSwitch:
    """vLLM worker extension: ``collective_rpc("sparseattn_use", args=(spec,))`` switches this worker's method.

    Also ``collective_rpc("sparseattn_fallbacks")``: the worker's count of decode layer steps answered
    by vLLM's kernel instead of the paged engine.

    ``spec`` is what ``additional_config["sparseattn"]`` takes: a dict (``{"method": "quest", "budget":
    1024}``) or a ``"name:key=value,..."`` string. Returns the method's label.
    """

    def sparseattn_use(self, spec: Any) -> str:
        from sparseattn.vllm.backend import sparse_builders
        from sparseattn.vllm.config import CONFIG_KEY, request_from

        request = request_from({CONFIG_KEY: spec}, {})
        builders = sparse_builders(self.model_runner)
        if not builders:
            raise ValueError("this engine runs no sparseattn method, so it has none to switch: start it with one "
                             '(additional_config={"sparseattn": {"method": "dense"}})')  # fmt: skip
        policies = [builder.policy(request) for builder in builders]  # a method the engine cannot run raises here, before any change
        for builder, policy in zip(builders, policies):
            builder.use(policy)
        return request.label

    def sparseattn_profile(self, start: bool) -> dict[str, Any] | None:
        """Start (``True``) or stop (``False``) timing this worker's decode steps (:class:`~sparseattn.vllm.profile.StepProfile`).

        Stopping returns what was timed since the start: ``steps`` (decode steps), ``calls`` (fused-step calls),
        ``ns`` and ``bytes`` per part (the C phases, the plan, the glue, the layers' own Python), totals over the steps.
        """
        from sparseattn.vllm.profile import StepProfile

        if start:
            if getattr(self, "_sparseattn_profile", None) is not None:
                raise RuntimeError("sparseattn_profile: a profile is already running on this worker")
            self._sparseattn_profile = StepProfile().__enter__()
            return None
        prof = getattr(self, "_sparseattn_profile", None)
        if prof is None:
            raise RuntimeError("sparseattn_profile: no profile is running on this worker (start one first)")
        prof.__exit__(None, None, None)
        self._sparseattn_profile = None
        rows = prof.rows(calls=1)  # totals: the caller divides by the steps
        return {"steps": prof.steps, "calls": prof.calls, "parts": {r["part"]: {"ns": r["us"] * 1e3, "bytes": r["mb"] * 1e6} for r in rows}}

    def sparseattn_fallbacks(self) -> int:
        """Layer steps this worker's paged engine left to vLLM's kernel so far (its builders' :class:`~sparseattn.vllm.step.Fallbacks`).

        A benchmark reads it before and after a run: a step answered densely is not the method's speed.
        """
        from sparseattn.vllm.backend import sparse_builders

        return sum(builder.fallbacks.total for builder in sparse_builders(self.model_runner))


def use_method(llm: Any, spec: Any) -> str:
    """Switch every worker of ``llm`` (a ``vllm.LLM`` started with :class:`MethodSwitch`) to ``spec``; its label."""
    labels = llm.collective_rpc("sparseattn_use", args=(spec,))
    return labels[0]
