"""Chained block hashes: hash(block i) = sha256(hash(block i - 1) or a fixed seed, tokens of i).

Only full blocks are hashed. Tokens are packed as signed 64-bit little-endian integers, so the
hashes are the same on every machine and process. ``pack_tokens`` also validates tokens.
"""

from __future__ import annotations

import struct
from hashlib import sha256

SEED_HASH = sha256(b"kvspec.reference: the parent of every first block").digest()
"""The parent hash of a request's first block (vLLM's ``NONE_HASH``)."""

_TOKEN = struct.Struct("<q")


def pack_tokens(tokens: list[int] | tuple[int, ...]) -> bytes:
    """The tokens as bytes; raises ValueError for a token that is not a 64-bit int."""
    try:
        return struct.pack(f"<{len(tokens)}q", *tokens)
    except struct.error as err:
        raise ValueError(f"tokens must be 64-bit ints: {err}") from None


def pack_token(token: int) -> bytes:
    return _TOKEN.pack(token)


def hash_block(parent: bytes, tokens: list[int]) -> bytes:
    """The hash of a full block whose predecessor hashes to ``parent``."""
    return sha256(parent + struct.pack(f"<{len(tokens)}q", *tokens)).digest()


def extend_hashes(hashes: list[bytes], tokens: list[int], block_size: int, upto: int) -> None:
    """Append the hashes of blocks ``len(hashes) .. upto - 1`` (all full) to ``hashes``."""
    n = len(hashes)
    parent = hashes[-1] if n else SEED_HASH
    pack = _block_struct(block_size).pack
    while n < upto:
        parent = sha256(parent + pack(*tokens[n * block_size : (n + 1) * block_size])).digest()
        hashes.append(parent)
        n += 1


_STRUCTS: dict[int, struct.Struct] = {}


def _block_struct(block_size: int) -> struct.Struct:
    packer = _STRUCTS.get(block_size)
    if packer is None:
        packer = _STRUCTS[block_size] = struct.Struct(f"<{block_size}q")
    return packer
