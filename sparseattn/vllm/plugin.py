"""The ``vllm.general_plugins`` entry point: route vLLM's CPU attention through sparseattn when a method is asked for.

vLLM calls :func:`register` once in every process it starts (the front end, the engine core, each
worker), before any config exists. It points vLLM's ``CPU_ATTN`` backend entry at
:data:`sparseattn.vllm.backend.CPU_ATTN` through vLLM's public ``register_backend``; that name
resolves, when a model's attention layers are built (the engine's config is then current), to vLLM's
own class unless the config's ``additional_config["sparseattn"]`` or ``SPARSEATTN_VLLM_METHOD`` asks
for a method (:mod:`sparseattn.vllm.config`). Without a request vLLM runs its own backend unchanged.

A method given through ``SPARSEATTN_VLLM_METHOD`` is checked here (the registry's checks, then the
paged engine's: an eviction method is refused), so a bad name or option stops
``LLM(...)``/``vllm serve`` in the front-end process with the registry's message. One given through
``additional_config`` is checked where vLLM has a platform validate its ``additional_config``: the
platform's ``check_and_update_config``, which runs as the engine's config is made, in the front end,
before an engine process starts or a weight is read (:func:`check_request_first`).
"""

from __future__ import annotations

import os

from sparseattn.vllm.config import ENV_VAR, MethodRequest, parse_spec, request_from
from sparseattn.vllm.policy import PagedPolicy

__all__ = ["register"]

#: Where vLLM resolves ``CPU_ATTN`` once the plugin has registered.
BACKEND_PATH = "sparseattn.vllm.backend.CPU_ATTN"


def register() -> None:
    """Register the ``CPU_ATTN`` override (on the CPU platform); check ``SPARSEATTN_VLLM_METHOD`` if set."""
    spec = os.environ.get(ENV_VAR, "").strip()
    if spec:  # the registry's ValueError, or the paged engine's refusal, at start-up in the calling process
        check_runnable(parse_spec(spec))
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        if spec:
            raise NotImplementedError(
                f"{ENV_VAR}={spec!r}: sparseattn's vLLM backend runs on the CPU platform only so far "
                f"(this platform: {current_platform.device_name}); see docs/serving.md"
            )
        return
    from vllm.v1.attention.backends.registry import (
        AttentionBackendEnum,
        register_backend,
    )

    register_backend(AttentionBackendEnum.CPU_ATTN, BACKEND_PATH)
    check_request_first(type(current_platform))


def check_runnable(request: MethodRequest) -> None:
    """Refuse a request the paged engine cannot run (an eviction method, an always-kept part: its refusal)."""
    PagedPolicy(request.build(), request.label)


def check_request(vllm_config) -> None:
    """Refuse a bad ``additional_config["sparseattn"]`` (the registry's message, or the paged engine's refusal)."""
    request = request_from(getattr(vllm_config, "additional_config", None), environ={})
    if request is not None:
        check_runnable(request)


def check_request_first(platform: type) -> None:
    """Have ``platform``'s ``check_and_update_config`` (vLLM calls it as it makes an engine's config) run
    :func:`check_request` first; once per platform class, whoever registers again."""
    hook = platform.__dict__.get("check_and_update_config")
    if hook is None or getattr(hook.__func__, "checks_sparseattn", False):
        return
    update = hook.__func__

    def check_and_update_config(cls, vllm_config) -> None:
        check_request(vllm_config)
        update(cls, vllm_config)

    check_and_update_config.checks_sparseattn = True
    platform.check_and_update_config = classmethod(check_and_update_config)
