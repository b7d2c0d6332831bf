"""kvspec.impl: the spec's blocks on real tensors. Two products, one folder each:

* ``paged/``: paged K/V and the Triton kernels beside their torch references (``kernels``: the
  K/V write and paged attention; ``attention_ref``, ``attention_torch``), the cache and a batch's
  metadata (``kv_cache``, ``batch``), a toy model whose K/V are functions of the token prefix
  (``model``) and ``replay``: a trace's replay plan (``records``) executed on the cache, every
  attention output compared with dense attention. ``kvspec replay`` is this.
* ``llm/``: a small-model engine (SmolLM2 and other Llama models) served through the reference
  engine on the same paged cache: ``llama`` (the decoder), ``weights`` (safetensors folders, GGUF
  files), ``sampling``, ``model_worker`` (the engine's worker running the model) and ``engine``
  (``LLM``, exported as ``kvspec.LLM``); ``docs/engine.md``.

Only ``paged/kernels`` imports Triton; nothing here imports ``kvspec.spec`` or
``kvspec.conformance``.
"""
