"""``impl/llm/model_cache.py``: a converted GGUF model read back from the cache is the fresh
conversion, tensor for tensor and token for token; a damaged copy is made again; the cache can be
turned off; a write that fails never fails the load."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvspec.impl.llm import model_cache, weights
from kvspec.impl.llm.weights import convert_gguf, load_tokenizer, load_weights, smollm2_path

TEXTS = [
    "The capital of France is",
    "  two spaces,\ttabs\nand lines",
    "émigré 東京 🙂",
    "<|im_end|>",
]


def test_the_cached_smollm2_is_the_fresh_conversion(monkeypatch: pytest.MonkeyPatch) -> None:
    path = smollm2_path()
    fresh, fields = convert_gguf(path)
    folder = model_cache.entry(path, "weights")
    assert folder is not None  # conftest points KVSPEC_MODEL_CACHE at .pytest_cache
    # stores this conversion if no other test has stored one yet (then it reads theirs)
    model_cache.cached(folder, model_cache.load_tensors, lambda: (fresh, fields),
                       model_cache.save_tensors)  # fmt: skip
    read = model_cache.load_tensors(folder)
    assert read is not None
    tensors, read_fields = read
    assert read_fields == fields and tensors.keys() == fresh.keys()
    for name, tensor in fresh.items():
        assert tensors[name].dtype == tensor.dtype and torch.equal(tensors[name], tensor), name

    def no_conversion(path: Path) -> None:
        raise AssertionError("converted again: the cached copy was not read")

    monkeypatch.setattr(weights, "convert_gguf", no_conversion)
    loaded = load_weights("smollm2")
    assert torch.equal(loaded.layers[3].q, fresh["blk.3.attn_q.weight"])
    assert torch.equal(loaded.embed, fresh["token_embd.weight"])

    from transformers import AutoTokenizer

    original = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    cached = load_tokenizer("smollm2")
    assert len(cached) == len(original)
    assert (cached.bos_token_id, cached.eos_token_id) == (
        original.bos_token_id,
        original.eos_token_id,
    )
    for text in TEXTS:
        ids = original.encode(text)
        assert cached.encode(text) == ids, text
        assert cached.decode(ids, skip_special_tokens=True) == original.decode(
            ids, skip_special_tokens=True
        )


def test_a_damaged_copy_is_made_again(tmp_path: Path) -> None:
    folder = tmp_path / "m-0-v1" / "weights"
    made: list[int] = []

    def make() -> tuple[dict, dict]:
        made.append(1)
        return {"w": torch.arange(6.0).reshape(2, 3)}, {"n": 1}

    first = model_cache.cached(folder, model_cache.load_tensors, make, model_cache.save_tensors)
    again = model_cache.cached(folder, model_cache.load_tensors, make, model_cache.save_tensors)
    assert len(made) == 1 and torch.equal(again[0]["w"], first[0]["w"]) and again[1] == {"n": 1}
    (folder / "model.safetensors").write_bytes(b"\x00" * 11)  # truncated
    model_cache.cached(folder, model_cache.load_tensors, make, model_cache.save_tensors)
    assert len(made) == 2 and model_cache.load_tensors(folder) is not None


def test_the_cache_can_be_off_and_a_failed_write_is_skipped(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KVSPEC_MODEL_CACHE", "off")
    assert model_cache.cache_root() is None
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    monkeypatch.setenv("KVSPEC_MODEL_CACHE", str(blocker))
    gguf = tmp_path / "x.gguf"
    gguf.write_bytes(b"GGUF")
    folder = model_cache.entry(gguf, "weights")
    assert folder is not None
    got = model_cache.cached(folder, model_cache.load_tensors, lambda: ({}, {"n": 2}),
                             model_cache.save_tensors)  # fmt: skip
    assert got == ({}, {"n": 2})
