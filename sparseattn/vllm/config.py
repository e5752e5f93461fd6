"""Which sparseattn method a vLLM engine runs: read from ``additional_config`` or the environment, checked by the registry.

Two ways to ask, the first found wins:

* vLLM's ``additional_config`` (``LLM(..., additional_config={"sparseattn": {"method": "quest", "budget": 1024}})``,
  ``vllm serve ... --additional-config '{"sparseattn": {"method": "quest", "budget": 1024}}'``); the value may
  also be a spec string, ``{"sparseattn": "quest:budget=1024"}``;
* the environment variable ``SPARSEATTN_VLLM_METHOD="quest:budget=1024"`` (the CLI's ``-m`` spelling).

Neither given: no sparse method, vLLM runs unchanged. A method name the registry does not know, an
option the method does not take or a value out of range raises the registry's ValueError.

>>> request_from({"sparseattn": {"method": "quest", "budget": 1024}}, {})
MethodRequest(name='quest', options={'budget': 1024})
>>> request_from({}, {"SPARSEATTN_VLLM_METHOD": "quest:budget=512,sinks=128"})
MethodRequest(name='quest', options={'budget': 512, 'sinks': 128})
>>> request_from({}, {}) is None
True
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from sparseattn import registry

__all__ = ["AUTO", "CONFIG_KEY", "ENV_VAR", "PAGE", "WORKER_CLS", "MethodRequest", "count_stores", "current_request", "layer_index",
           "parse_spec", "request_from", "stores_counted"]

#: The key of vLLM's ``additional_config`` the plugin reads.
CONFIG_KEY = "sparseattn"
#: The environment variable the plugin reads when ``additional_config`` names no method.
ENV_VAR = "SPARSEATTN_VLLM_METHOD"
#: ``segment`` values that are not a number of tokens: the method's own grid, and a page per segment.
AUTO, PAGE = "auto", "page"
#: vLLM's ``worker_cls`` that sizes the KV cache with the paged engine's page stores counted in
#: (:class:`sparseattn.vllm.worker.SparseCPUWorker`; named here, where no vLLM is imported).
WORKER_CLS = "sparseattn.vllm.worker.SparseCPUWorker"

_stores_counted = False  # set in this process once that worker sized its KV cache with the page stores


def count_stores() -> None:
    """Note that this process's KV cache was sized with the page stores counted in (the worker above calls it; the
    backend reads it to say whether a store's memory is within what vLLM was given)."""
    global _stores_counted
    _stores_counted = True


def stores_counted() -> bool:
    """Whether this process's KV cache was sized with the page stores counted in (:func:`count_stores`)."""
    return _stores_counted


def layer_index(name: str) -> int:
    """The decoder layer a vLLM attention layer's name belongs to (its first dotted number; 0 if none): a
    per-layer method (``radar+adaptive``) runs the variant of that index.

    >>> layer_index("model.layers.17.self_attn.attn"), layer_index("attn")
    (17, 0)
    """
    found = re.findall(r"\.(\d+)\.", f".{name}.")
    return int(found[0]) if found else 0


@dataclass(frozen=True)
class MethodRequest:
    """A method name and the options given for it (the others keep the registry's defaults), and the paged
    engine's ``segment``: tokens per segment inside vLLM's pages (None or ``"page"``: a page is a segment;
    ``"auto"``: the method's own grid at the engine's longest sequence, :func:`~sparseattn.vllm.paged.own_segment`,
    what ``sparseattn serve`` asks for by default; the dict form's ``"segment"`` key, an engine setting rather
    than a method option).

    >>> request_from({"sparseattn": {"method": "radar+adaptive", "budget": 512, "segment": 16}}, {}).segment
    16
    >>> request = request_from({"sparseattn": {"method": "radar+adaptive", "budget": 512, "segment": "auto"}}, {})
    >>> request.policy(block_size=32, length=8192).segment
    4
    """

    name: str
    options: dict[str, Any] = field(default_factory=dict)
    segment: int | str | None = field(default=None, repr=False)

    def policy(self, block_size: int | None = None, length: int | None = None) -> Any:
        """The method as the paged engine runs it (:class:`~sparseattn.vllm.paged.PagedPolicy`; ValueError saying
        why when it cannot). ``block_size`` and ``length`` (the engine's page size and longest sequence) resolve
        ``segment="auto"``; they are needed only then."""
        from sparseattn.vllm.policy import PagedPolicy, own_segment

        method = self.build()
        segment = None if self.segment == PAGE else self.segment
        if segment == AUTO:
            if block_size is None or length is None:
                raise ValueError(f"sparseattn method {self.label!r}: segment 'auto' needs the engine's block size and "
                                 "longest sequence to pick the method's own grid")  # fmt: skip
            segment = own_segment(method, length, block_size)
        return PagedPolicy(method, self.label, segment)

    def check(self) -> registry.MethodEntry:
        """The registry entry, after the registry's checks of the name and options (ValueError otherwise)."""
        return registry.check(self.name, self.options)

    def build(self) -> Any:
        """The method instance (registry-checked)."""
        return registry.build(self.name, **self.options)

    @property
    def label(self) -> str:
        return registry.label(self.name, self.options)


def parse_spec(spec: str) -> MethodRequest:
    """``"quest:budget=1024,sinks=128"`` -> a request, parsed and checked by the registry's one grammar.

    >>> parse_spec("dense")
    MethodRequest(name='dense', options={})
    >>> parse_spec("quest:budget=x")
    Traceback (most recent call last):
    ...
    ValueError: option budget in 'quest:budget=x' must be a int, got 'x'
    """
    return _request(registry.parse(spec))


def _request(parsed: registry.Spec) -> MethodRequest:
    return MethodRequest(parsed.name, dict(parsed.options))


def _from_config_value(value: Any) -> MethodRequest:
    if isinstance(value, Mapping) and "segment" in value:
        segment = value["segment"]
        if isinstance(segment, str):
            segment = int(segment) if segment.strip().isdigit() else segment.strip().lower()
        if segment not in (None, AUTO, PAGE) and (isinstance(segment, bool) or not isinstance(segment, int) or segment < 1):
            raise ValueError(f'additional_config["{CONFIG_KEY}"]["segment"] must be a positive number of tokens (a divisor of '
                             f'vLLM\'s block size), "auto" (the method\'s own grid) or "page"/null (a page), got {value["segment"]!r}')
        rest = {k: v for k, v in value.items() if k != "segment"}
        request = _request(registry.parse(rest))
        return MethodRequest(request.name, request.options, segment)
    if isinstance(value, (str, Mapping)):
        return _request(registry.parse(value))  # the registry's message as it is: the engine's log shows it
    raise ValueError(f'additional_config["{CONFIG_KEY}"] must be a dict or a "name:key=value" string, got {value!r}')


def request_from(additional_config: Any, environ: Mapping[str, str] | None = None) -> MethodRequest | None:
    """The request ``additional_config`` (a dict, or None) or ``environ`` (default ``os.environ``) makes; None if neither does.

    The request is checked by the registry (its ValueError for an unknown name or a bad option).
    """
    environ = os.environ if environ is None else environ
    if isinstance(additional_config, Mapping) and CONFIG_KEY in additional_config:
        return _from_config_value(additional_config[CONFIG_KEY])  # parsed and checked once, by the registry
    spec = environ.get(ENV_VAR, "").strip()
    return parse_spec(spec) if spec else None


def current_request() -> MethodRequest | None:
    """The request of the vLLM config being built in this process (vLLM must be installed), or the environment's."""
    from vllm.config import get_current_vllm_config_or_none

    config = get_current_vllm_config_or_none()
    return request_from(None if config is None else config.additional_config)
