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
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from sparseattn import registry

__all__ = ["CONFIG_KEY", "ENV_VAR", "MethodRequest", "current_request", "parse_spec", "request_from"]

#: The key of vLLM's ``additional_config`` the plugin reads.
CONFIG_KEY = "sparseattn"
#: The environment variable the plugin reads when ``additional_config`` names no method.
ENV_VAR = "SPARSEATTN_VLLM_METHOD"


@dataclass(frozen=True)
class MethodRequest:
    """A method name and the options given for it (the others keep the registry's defaults)."""

    name: str
    options: dict[str, Any] = field(default_factory=dict)

    def check(self) -> registry.MethodEntry:
        """The registry entry, after the registry's checks of the name and options (ValueError otherwise)."""
        return registry.check(self.name, self.options)

    def build(self) -> Any:
        """The method instance (registry-checked)."""
        return registry.build(self.name, **self.options)

    @property
    def label(self) -> str:
        return self.name + ("" if not self.options else ":" + ",".join(f"{k}={v}" for k, v in sorted(self.options.items())))


def parse_spec(spec: str) -> MethodRequest:
    """``"quest:budget=1024,sinks=128"`` -> a request; option values are typed by the method's declared options.

    >>> parse_spec("dense")
    MethodRequest(name='dense', options={})
    >>> parse_spec("quest:budget=x")
    Traceback (most recent call last):
    ...
    ValueError: sparseattn method spec 'quest:budget=x': option budget must be a int, got 'x'
    """
    name, _, rest = spec.strip().partition(":")
    entry = registry.get(name)  # unknown name: the registry's message, listing the known ones
    options: dict[str, Any] = {}
    for item in filter(None, (part.strip() for part in rest.split(","))):
        key, eq, value = item.partition("=")
        key = key.strip().replace("-", "_")
        option = entry.option(key)
        if not eq:
            raise ValueError(f"sparseattn method spec {spec!r}: {item!r} is not key=value")
        if option is None:  # let the registry say what the method takes
            options[key] = value
            continue
        try:
            options[key] = option.type(value)
        except ValueError:
            raise ValueError(f"sparseattn method spec {spec!r}: option {key} must be a {option.type.__name__}, got {value!r}") from None
    return MethodRequest(name, options)


def _from_config_value(value: Any) -> MethodRequest:
    if isinstance(value, str):
        return parse_spec(value)
    if isinstance(value, Mapping):
        options = dict(value)
        name = options.pop("method", None)
        if not isinstance(name, str):
            raise ValueError(
                f'additional_config["{CONFIG_KEY}"] needs "method": a method name, got {value!r}; '
                f'e.g. {{"{CONFIG_KEY}": {{"method": "quest", "budget": 1024}}}}'
            )
        return MethodRequest(name, options)
    raise ValueError(f'additional_config["{CONFIG_KEY}"] must be a dict or a "name:key=value" string, got {value!r}')


def request_from(additional_config: Any, environ: Mapping[str, str] | None = None) -> MethodRequest | None:
    """The request ``additional_config`` (a dict, or None) or ``environ`` (default ``os.environ``) makes; None if neither does.

    The request is checked by the registry (its ValueError for an unknown name or a bad option).
    """
    environ = os.environ if environ is None else environ
    if isinstance(additional_config, Mapping) and CONFIG_KEY in additional_config:
        request = _from_config_value(additional_config[CONFIG_KEY])
    else:
        spec = environ.get(ENV_VAR, "").strip()
        if not spec:
            return None
        request = parse_spec(spec)
    request.check()
    return request


def current_request() -> MethodRequest | None:
    """The request of the vLLM config being built in this process (vLLM must be installed), or the environment's."""
    from vllm.config import get_current_vllm_config_or_none

    config = get_current_vllm_config_or_none()
    return request_from(None if config is None else config.additional_config)
