"""Chunk keys: content addresses for the KV of a run of leading tokens.

Chunk ``i``'s key is ``sha256(key[i-1] || token ids of chunk i)``, rooted in
a fingerprint of everything that decides what the KV bytes are: the content of
the model's weights, its config and dtype, the tokenizer's vocabulary
(``engine.identity``), the chunk size, and the storage and codec format
versions. Nothing process-specific (Python's ``hash``, object ids, paths,
hosts) goes in, so every process on every machine derives the same keys, and
replicas whose model files sit at different paths share every stored chunk.

A salt (``KeySpace``, scheduler/tenancy.py) is mixed into the root: chains of
different salts share no key, so a request never reads, or learns of, KV
stored under another salt. Unsalted chains keep the fingerprint as their root.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from codec import FORMAT_VERSION as CODEC_FORMAT_VERSION

# Bump when the meaning of stored objects changes (key derivation, object layout).
# 2: level digests in object names, a per-prefix index, stored context tails.
# 3: the root hashes the weights' content and the KV-relevant config, never a path (engine/identity.py).
STORAGE_FORMAT_VERSION = 3


@dataclass(frozen=True)
class Fingerprint:
    """Root of the key chain; also names the model in manifests."""

    digest: bytes

    @property
    def hex(self) -> str:
        return self.digest.hex()


def make_fingerprint(
    *, weights: str, config: dict, vocabulary: str, chunk_size: int, dtype: str = ""
) -> Fingerprint:
    """The root of every key: the model's identity (``engine.identity``), the chunk size and the
    formats. Levels are not in it: each stored object's name carries its level's digest
    (``scheduler.layout``), so a new level table keeps the lossless chunks and unchanged levels."""
    payload = json.dumps(
        {
            "format": STORAGE_FORMAT_VERSION,
            "codec_format": CODEC_FORMAT_VERSION,  # a new bitstream version starts a new key space
            "weights": weights,
            "config": config,
            "dtype": dtype,
            "vocabulary": vocabulary,
            "chunk_size": chunk_size,
        },
        sort_keys=True,
        default=str,
    )
    return Fingerprint(hashlib.sha256(payload.encode()).digest())


def _token_bytes(tokens: Sequence[int]) -> bytes:
    return np.asarray(tokens, dtype="<u4").tobytes()


def chain_root(fingerprint: Fingerprint, salt: bytes | None) -> bytes:
    if salt is None:
        return fingerprint.digest
    return hashlib.sha256(fingerprint.digest + b"salt" + salt).digest()


def chunk_keys(
    fingerprint: Fingerprint, token_ids: Sequence[int], chunk_size: int, salt: bytes | None = None
) -> list[str]:
    """Keys of every *full* chunk of ``token_ids``, in order."""
    keys: list[str] = []
    previous = chain_root(fingerprint, salt)
    for start in range(0, len(token_ids) - chunk_size + 1, chunk_size):
        previous = hashlib.sha256(previous + _token_bytes(token_ids[start : start + chunk_size])).digest()
        keys.append(previous.hex())
    return keys


def tail_key(parent: str, tail_tokens: Sequence[int]) -> str:
    """Key of a context's trailing partial chunk, stored under the last full chunk's key ``parent``.

    Domain-separated from chunk keys, so a tail never collides with a full chunk of the same tokens.
    """
    return hashlib.sha256(bytes.fromhex(parent) + b"tail" + _token_bytes(tail_tokens)).hexdigest()


CONTEXT_ID_PATTERN = r"^ctx-[0-9a-f]{32}$"


def context_id(fingerprint: Fingerprint, token_ids: Sequence[int], salt: bytes | None = None) -> str:
    """Same model, salt and tokens give the same id, in any process."""
    root = chain_root(fingerprint, salt)
    digest = hashlib.sha256(root + b"context" + _token_bytes(token_ids)).hexdigest()
    return f"ctx-{digest[:32]}"
