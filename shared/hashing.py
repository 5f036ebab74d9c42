"""Stable names for KV blocks: chained block hashes (docs/ARCHITECTURE.md §4 "Block identity").

A full block is named by sha256 over (its parent's name, its token ids, its extra keys). The
first block's parent is the model identity hash, which covers everything that changes the
bytes of a KV block: the model, dtype, KV dtype, block size and the parallel layout. Two
blocks with the same name therefore hold the same KV, in any process and after a restart,
which is what lets the prefix cache (and later the kvstore tiers) share them. This is the
scheme of vLLM's automatic prefix caching design (docs/design/prefix_caching.md): the hash
of a block covers all tokens before it through the parent hash.

Every input is encoded canonically (fixed-width little-endian integers, length-prefixed
strings) and hashed with hashlib's sha256, so names never depend on Python's `hash()`,
PYTHONHASHSEED, the platform's byte order or which optional packages are installed (xxh3-128
would be faster, but picking it only when installed would make names differ between
environments). Names are 32 bytes.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Iterable, Sequence

HASH_VERSION = b"kestrel-block-hash-v1"
HASH_BYTES = 32  # sha256 digest size

ExtraKey = str | bytes | int


def _encode_key(key: ExtraKey) -> bytes:
    """Canonical bytes of one extra key: a type tag, then a length-prefixed payload.

    Raises TypeError for anything but str, bytes and int (bool is rejected as ambiguous).
    """
    if isinstance(key, bool):
        raise TypeError("bool is not a valid extra key; use an int or str")
    if isinstance(key, int):
        return b"i" + struct.pack("<q", key)
    if isinstance(key, str):
        key = key.encode("utf-8")
        return b"s" + struct.pack("<I", len(key)) + key
    if isinstance(key, (bytes, bytearray)):
        return b"b" + struct.pack("<I", len(key)) + bytes(key)
    raise TypeError(f"extra key of type {type(key).__name__} cannot be hashed stably")


def model_identity_hash(model: str, dtype: str, kv_dtype: str, block_size: int,
                        tensor_parallel_size: int = 1,
                        extra: Iterable[ExtraKey] = ()) -> bytes:
    """The root of every block hash chain: 32 bytes naming what a KV block's bytes depend on.

    model: the model's path or name (the engine passes the model folder's absolute path).
    dtype, kv_dtype: e.g. "bfloat16" (the KV dtype equals the model dtype until KV dtypes
        arrive). block_size: tokens per block. tensor_parallel_size: KV heads are split
        across this many ranks. extra: further keys (e.g. a weights revision).
    Raises TypeError for an extra key that is not str, bytes or int.
    """
    h = hashlib.sha256(HASH_VERSION + b"/model")
    for key in (model, dtype, kv_dtype, int(block_size), int(tensor_parallel_size), *extra):
        h.update(_encode_key(key))
    return h.digest()


def hash_block_tokens(parent: bytes, token_ids: Sequence[int],
                      extra_keys: Sequence[ExtraKey] = ()) -> bytes:
    """The 32-byte name of one full block.

    parent: the previous block's name, or the model identity hash for the first block.
    token_ids: the block's token ids (non-negative, < 2**63). extra_keys: what else the
    block's KV depends on (multimodal item hashes, later a LoRA id), in order.
    Raises TypeError for a bad extra key, struct.error for a token id out of range.
    """
    h = hashlib.sha256(HASH_VERSION + b"/block")
    h.update(struct.pack("<I", len(parent)) + parent)
    h.update(struct.pack(f"<I{len(token_ids)}q", len(token_ids), *token_ids))
    h.update(struct.pack("<I", len(extra_keys)))
    for key in extra_keys:
        h.update(_encode_key(key))
    return h.digest()


def hash_block_chain(root: bytes, token_ids: Sequence[int], block_size: int,
                     extra_keys: Sequence[ExtraKey] = ()) -> list[bytes]:
    """Names of every full block of `token_ids` (a trailing partial block gets none).

    root: the model identity hash. extra_keys apply to every block (per-block keys, such as
    a multimodal item inside one block, go through `hash_block_tokens` directly).
    """
    out: list[bytes] = []
    parent = root
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = hash_block_tokens(parent, token_ids[start:start + block_size], extra_keys)
        out.append(parent)
    return out
