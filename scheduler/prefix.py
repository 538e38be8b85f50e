"""Chunk keys: content addresses for the KV of a run of leading tokens.

Chunk ``i``'s key is ``sha256(key[i-1] || token ids of chunk i)``, rooted in
a fingerprint of everything that decides what the KV bytes are: the model's
weights and config, the tokenizer's vocabulary, the chunk size, and the
storage format version. Nothing process-specific (Python's ``hash``, object
ids, paths) goes in, so every process on every machine derives the same keys.

A salt (``KeySpace``, scheduler/tenancy.py) is mixed into the root: chains of
different salts share no key, so a request never reads, or learns of, KV
stored under another salt. Unsalted chains keep the fingerprint as their root.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from codec import FORMAT_VERSION as CODEC_FORMAT_VERSION

# Bump when the meaning of stored objects changes (key derivation, object layout).
# 2: level digests in object names, a per-prefix index, stored context tails.
STORAGE_FORMAT_VERSION = 2

_WEIGHT_SAMPLES_PER_TENSOR = 4096


@dataclass(frozen=True)
class Fingerprint:
    """Root of the key chain; also names the model in manifests."""

    digest: bytes

    @property
    def hex(self) -> str:
        return self.digest.hex()


def weights_digest(named_parameters: Iterable[tuple[str, torch.Tensor]]) -> str:
    """Names, shapes and an evenly strided sample of every parameter.

    Hashing all weights would add seconds to start-up; a strided sample of
    each tensor tells apart any two checkpoints that differ in more than a
    handful of values, which is what separates real fine-tunes.
    """
    h = hashlib.sha256()
    for name, param in named_parameters:
        flat = param.detach().reshape(-1)
        step = max(1, flat.numel() // _WEIGHT_SAMPLES_PER_TENSOR)
        sample = flat[::step][:_WEIGHT_SAMPLES_PER_TENSOR].to("cpu", torch.float32).numpy()
        h.update(f"{name}:{tuple(param.shape)}".encode())
        h.update(np.ascontiguousarray(sample).tobytes())
    return h.hexdigest()


def make_fingerprint(*, weights: str, config: dict, vocabulary: str, chunk_size: int) -> Fingerprint:
    payload = json.dumps(
        {
            "format": STORAGE_FORMAT_VERSION,
            "codec_format": CODEC_FORMAT_VERSION,  # a new bitstream version starts a new key space
            "weights": weights,
            "config": config,
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
