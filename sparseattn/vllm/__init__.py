"""sparseattn inside vLLM: a ``vllm.general_plugins`` entry point and a paged decode engine.

* :mod:`sparseattn.vllm.config`: which method an engine runs (``additional_config["sparseattn"]`` or
  ``SPARSEATTN_VLLM_METHOD``), checked by the registry;
* :mod:`sparseattn.vllm.paged`: the paged engine's public names (pure torch, no vLLM import): a segment
  is one KV page (block) of one KV head or a part of it; its parts: :mod:`~sparseattn.vllm.cache_format`,
  :mod:`~sparseattn.vllm.policy`, :mod:`~sparseattn.vllm.selection`, :mod:`~sparseattn.vllm.attention`;
* :mod:`sparseattn.vllm.route`: which path a policy's decode step takes (the fused C step's mode, or why
  the generic path), from what its parts declare; :mod:`sparseattn.vllm.paged_kernel` the fused step,
  :mod:`sparseattn.vllm.paged_library` its ctypes binding, :mod:`sparseattn.vllm.profile` its timers;
* :mod:`sparseattn.vllm.backend`: vLLM's CPU backend (metadata builder, metadata, impl) with the paged
  engine answering decode tokens;
* :mod:`sparseattn.vllm.step`: what the backend decides without vLLM (a step's decode requests, the
  cache layout a sparse engine reads, the fallback counts);
* :mod:`sparseattn.vllm.plugin`: the entry point;
* :mod:`sparseattn.vllm.switch`: a worker extension that switches a running engine's method between
  requests (one prefill, several methods: the serving benchmark);
* :mod:`sparseattn.vllm.forcing`: a logits processor for teacher forcing through decode steps (quality
  measured in the serving engine).

``plugin`` and ``switch`` need vLLM only when called; ``backend`` and ``forcing`` import it (their
classes subclass vLLM's) and are loaded only by vLLM and inside its processes. See docs/serving.md.
"""
