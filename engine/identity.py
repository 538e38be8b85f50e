"""What determines a model's KV, as digests that name no path: weights, config, dtype, vocabulary.

Chunk keys and context ids are rooted in these (``scheduler.prefix``), so two
gateways whose model files are byte-identical derive the same keys wherever
the files sit, and a model with other weights never shares a key.

- **Weights**: SHA-256 over every parameter's name, shape, dtype and bytes as
  loaded (tied parameters once, under the name transformers gives them). That
  is independent of how the files are laid out: shards, a tied tensor saved
  under either name, safetensors or GGUF give one digest for one set of values.
  Hashing costs about a second per GB, so the digest is cached in a small JSON
  file beside the weight files (or, when that directory is read-only, in the
  cache directory), valid while the files' names, sizes and modification times
  are unchanged: a moved directory keeps its cache, a copied one hashes once.
- **Config**: the model config without bookkeeping (``_name_or_path``,
  ``transformers_version``, output switches...). Everything else stays in,
  since an unknown field may change the KV: a stray difference costs a cache
  miss, a missing one would serve wrong KV.
- **Vocabulary**: a digest of the tokenizer's token -> id map.
- **Precision**: how the model computes, ``torch.float32`` or ``torch.float32+bf16-weights``
  (``engine.bf16_weights``): the same files at another precision give other KV.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import torch

log = logging.getLogger(__name__)

DIGEST_FILE = ".cachegen-weights.json"
_DIGEST_VERSION = 1  # bump when what the weights digest covers changes
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".gguf", ".pt", ".pth")
# Config fields that describe where the model came from or what a forward pass returns, not its KV.
_BOOKKEEPING = frozenset(
    {
        "transformers_version",
        "architectures",
        "dtype",
        "torch_dtype",
        "use_cache",
        "return_dict",
        "output_hidden_states",
        "output_attentions",
        "torchscript",
        "id2label",
        "label2id",
        "task_specific_params",
        "problem_type",
        "tokenizer_class",
        "chunk_size_feed_forward",
        "pruned_heads",
        "tie_encoder_decoder",
    }
)


@dataclass(frozen=True)
class ModelIdentity:
    """The parts of the key-chain root that come from the model."""

    weights: str  # hex digest of the parameters' content
    config: dict
    dtype: str
    vocabulary: str  # hex digest of the token -> id map


def kv_config(config: dict) -> dict:
    """``config`` without the fields that do not change the KV (paths, versions, output switches)."""
    return {k: v for k, v in config.items() if not k.startswith("_") and k not in _BOOKKEEPING}


def vocabulary_digest(vocab: dict[str, int]) -> str:
    return hashlib.sha256(json.dumps(sorted(vocab.items()), ensure_ascii=False).encode()).hexdigest()


def parameters_digest(named_parameters: Iterable[tuple[str, torch.Tensor]]) -> str:
    """SHA-256 over every parameter's name, shape, dtype and bytes."""
    h = hashlib.sha256()
    for name, param in named_parameters:
        tensor = param.detach().to("cpu").contiguous()
        h.update(f"{name}:{tuple(tensor.shape)}:{tensor.dtype}\n".encode())
        h.update(tensor.reshape(-1).view(torch.uint8).numpy().data)
    return h.hexdigest()


def weight_files_signature(directory: Path) -> list[list[object]] | None:
    """(name, size, mtime_ns) of every weight file in ``directory``; None when it holds none."""
    try:
        entries = sorted(
            (entry.name, entry.stat().st_size, entry.stat().st_mtime_ns)
            for entry in os.scandir(directory)
            if entry.is_file() and entry.name.endswith(_WEIGHT_SUFFIXES)
        )
    except OSError:
        return None
    return [list(e) for e in entries] or None


def weights_digest(
    model: torch.nn.Module,
    weights_dir: Path | None,
    cache_dir: Path | None = None,
    precision: str | None = None,
) -> str:
    """The content digest of ``model``'s parameters, cached beside the files in ``weights_dir``.

    ``precision`` (default: the first parameter's dtype) keys the cached digest: the same files
    loaded at another precision hold other values, and so another digest.
    """
    dtype = precision or str(next(model.parameters()).dtype)
    signature = weight_files_signature(weights_dir) if weights_dir is not None else None
    record = None
    if signature is not None:
        record = {"version": _DIGEST_VERSION, "dtype": dtype, "files": signature}
        for place in _digest_places(weights_dir, cache_dir):
            cached = _read_digest(place, record)
            if cached is not None:
                return cached
    digest = parameters_digest(model.named_parameters())
    if record is not None:
        for place in _digest_places(weights_dir, cache_dir):
            if _write_digest(place, {**record, "digest": digest}):
                break
    return digest


def model_identity(
    model: torch.nn.Module,
    vocab: dict[str, int],
    weights_dir: Path | None,
    cache_dir: Path | None = None,
    precision: str | None = None,
) -> ModelIdentity:
    """``precision``: how the model computes (``LoadedModel.precision``); default its first
    parameter's dtype."""
    precision = precision or str(next(model.parameters()).dtype)
    return ModelIdentity(
        weights=weights_digest(model, weights_dir, cache_dir, precision),
        config=kv_config(model.config.to_dict()),
        dtype=precision,
        vocabulary=vocabulary_digest(vocab),
    )


def _digest_places(weights_dir: Path, cache_dir: Path | None) -> list[Path]:
    places = [weights_dir / DIGEST_FILE]
    if cache_dir is not None:
        # a read-only model directory (a mounted volume): the cache directory, found by path, but
        # still checked against the files' signature, so a changed file is hashed again
        located = hashlib.sha256(str(weights_dir.resolve()).encode()).hexdigest()[:32]
        places.append(cache_dir / "weight-digests" / f"{located}.json")
    return places


def _read_digest(place: Path, record: dict) -> str | None:
    try:
        stored = json.loads(place.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(stored, dict) or {k: stored.get(k) for k in record} != record:
        return None
    digest = stored.get("digest")
    if isinstance(digest, str) and len(digest) == 64 and all(c in "0123456789abcdef" for c in digest):
        return digest
    return None


def _write_digest(place: Path, record: dict) -> bool:
    tmp = place.with_name(f"{place.name}.{os.getpid()}.tmp")
    try:
        place.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(json.dumps(record))
        os.replace(tmp, place)
        return True
    except OSError as exc:
        log.debug("cannot cache the weights digest in %s: %s", place, exc)
        tmp.unlink(missing_ok=True)
        return False
