"""kvspec.impl: paged K/V on real tensors, checked against dense attention.

Modules: ``records`` (the replay plan's records: ``Fill``, ``Work``, ``Executed``), ``kv_cache``
(the paged cache and its layout), ``batch`` (a mixed batch's metadata), ``kernels`` (Triton: the
K/V write and paged attention), ``attention_ref`` (the torch oracle and CPU fallback), ``model``
(a toy model whose K/V are functions of the token prefix) and ``replay`` (a plan on real
tensors, every output compared with dense attention). The reference LLM engine: ``llama`` (a
Llama decoder on the paged cache), ``weights`` (safetensors folders, GGUF files),
``sampling``, ``model_worker`` (the engine's worker running the model) and ``llm`` (``LLM``,
exported as ``kvspec.LLM``); see docs/engine.md. Only ``kernels`` imports Triton; nothing
here imports ``kvspec.spec`` or ``kvspec.conformance``.
"""
