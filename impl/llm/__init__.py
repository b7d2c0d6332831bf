"""The small-model engine: a Llama decoder (SmolLM2 by default) on the paged cache, served by the
reference engine (``engine.LLM``, exported as ``kvspec.LLM``; ``docs/engine.md``)."""
