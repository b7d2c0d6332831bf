"""Adapters of third-party engines (each importable only in its own virtual environment), and
what more than one of them needs."""

from __future__ import annotations

import json
import os
import tempfile

TINY_LLAMA = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 2,
    "num_key_value_heads": 2,
    "num_hidden_layers": 1,
    "vocab_size": 256,
    "max_position_embeddings": 4096,
    "torch_dtype": "float32",
}
"""The ``config.json`` of a model folder that engines read their model settings from; no
weights are ever loaded by an adapter (its model runner is a fake)."""


def tiny_model_folder(engine: str) -> str:
    """A new temporary folder holding only ``TINY_LLAMA`` as its ``config.json``."""
    folder = tempfile.mkdtemp(prefix=f"kvspec-{engine}-model-")
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(TINY_LLAMA, f)
    return folder
