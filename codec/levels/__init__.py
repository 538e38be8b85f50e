"""Quality levels: a name that requests use, bound to an encoding scheme and its parameters.

Lossy levels are model-specific (the steps come from measured sensitivity),
so they live in a JSON level table per model; ``load_level_table`` validates
one. ``DEFAULT_LEVELS`` is the table of the default model, shipped next to
this file and written by ``python -m app calibrate``.
"""

from __future__ import annotations

import enum
import hashlib
import json
import math
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

import numpy as np
import torch

from codec.dtypes import DTYPE_NAMES, NAME_OF_DTYPE
from codec.quantized import DEFAULT_GROUPS, QuantParams
from codec.transform import KVTransform, TransformError, load_transform
from codec.transformed import TransformParams

TABLE_FORMAT = "cachegen-level-table/1"
DEFAULT_TABLE_FILE = "SmolLM2-135M-Instruct.json"
# The default table plus the paper's baselines (fp16, int8) for benchmarks; not loaded by default,
# so a gateway does not store every chunk twice more. Point levels_file at it to serve them.
BASELINES_TABLE_FILE = "SmolLM2-135M-Instruct+baselines.json"
# The format-4 levels (scheme 2 on the raw channels) the transform levels replaced: measured beside
# them by the benchmarks, and servable with levels_file.
V4_TABLE_FILE = "SmolLM2-135M-Instruct.v4.json"
# The default table before scheme 5: `low` on scheme 4 (high and medium are the default's own), kept
# for the benchmarks to measure beside it.
SCHEME4_TABLE_FILE = "SmolLM2-135M-Instruct.scheme4.json"


class Scheme(enum.IntEnum):
    """The scheme byte of the chunk header."""

    RAW = 0
    ZSTD = 1
    QUANT = 2
    INT8 = 3
    TRANSFORM = 4  # from format 5
    SALIENT = 5  # scheme 4 with finer steps for salient tokens; added within format 5


# the schemes that code a transform's coefficients (and decode through its inverse)
TRANSFORM_SCHEMES = (Scheme.TRANSFORM, Scheme.SALIENT)


@dataclass(frozen=True)
class Level:
    """``cast``: the dtype the KV is cast to before a lossless scheme stores it (the
    ``fp16`` baseline); None stores the input dtype. Casting to float16 or bfloat16
    loses bits of float32 input, so such a level must say ``lossless=False``."""

    name: str
    scheme: Scheme
    lossless: bool = True
    quant: QuantParams | TransformParams | None = field(default=None, compare=False)
    cast: torch.dtype | None = None

    def __post_init__(self) -> None:
        if self.cast is None:
            return
        if self.scheme not in (Scheme.RAW, Scheme.ZSTD):
            raise ValueError(f"level {self.name!r}: only raw and zstd levels cast, not {self.scheme.name}")
        if self.cast not in NAME_OF_DTYPE:
            raise ValueError(f"level {self.name!r}: cannot cast to {self.cast}")
        if self.lossless and self.cast != torch.float32:
            raise ValueError(f"level {self.name!r} casts to {self.cast}, which is lossy: pass lossless=False")


LOSSLESS = Level("lossless", Scheme.RAW)


class LevelTableError(ValueError):
    """A level table that does not validate."""


_LEVEL_KEYS = {
    "name",
    "scheme",
    "key_step",
    "value_step",
    "exact_tokens",
    "sink_tokens",
    "groups",
    "salient_fraction",
    "salient_step",
    "dtype",
    "comment",
}
_QUANT_KEYS = {"key_step", "value_step", "exact_tokens", "groups", "sink_tokens"}
_SALIENT_KEYS = {"salient_fraction", "salient_step"}


def _steps(entry: dict[str, Any], key: str, where: str) -> tuple[float, ...]:
    raw = entry.get(key)
    values = [raw] if isinstance(raw, int | float) else raw
    if not isinstance(values, list) or not values:
        raise LevelTableError(f"{where}: {key} must be a positive number or a non-empty list of them")
    for v in values:
        if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v) or v <= 0:
            raise LevelTableError(f"{where}: {key} has an entry that is not a positive number: {v!r}")
    return tuple(float(v) for v in values)


def _int(entry: dict[str, Any], key: str, default: int, lo: int, hi: int, where: str) -> int:
    v = entry.get(key, default)
    if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
        raise LevelTableError(f"{where}: {key} must be an integer in [{lo}, {hi}], got {v!r}")
    return v


def _salient(entry: dict[str, Any], where: str) -> tuple[float, float]:
    """A transform level's (salient_fraction, salient_step): both or neither (0, 1: scheme 4)."""
    given = set(entry) & _SALIENT_KEYS
    if not given:
        return 0.0, 1.0
    if given != _SALIENT_KEYS:
        raise LevelTableError(f"{where}: salient_fraction and salient_step go together")
    fraction, ratio = entry["salient_fraction"], entry["salient_step"]
    for key, v in (("salient_fraction", fraction), ("salient_step", ratio)):
        if isinstance(v, bool) or not isinstance(v, int | float) or not 0 < v < 1:
            raise LevelTableError(f"{where}: {key} must be a number in (0, 1), got {v!r}")
    if ratio < 2.0**-16:
        raise LevelTableError(f"{where}: salient_step {ratio} is finer than a step code can say (2^-16)")
    return float(fraction), float(ratio)


def _cast(entry: dict[str, Any], where: str) -> torch.dtype | None:
    if "dtype" not in entry:
        return None
    name = entry["dtype"]
    if not isinstance(name, str) or name not in DTYPE_NAMES:
        raise LevelTableError(f"{where}: dtype must be one of {sorted(DTYPE_NAMES)}, got {name!r}")
    return DTYPE_NAMES[name]


def _level(entry: Any, rms: np.ndarray | None, index: int, transform: KVTransform | None) -> Level:
    if not isinstance(entry, dict):
        raise LevelTableError(f"levels[{index}] must be an object")
    name = entry.get("name")
    if (
        not isinstance(name, str)
        or not name
        or not name.isascii()
        or not name.replace("-", "").replace("_", "").isalnum()
    ):
        raise LevelTableError(f"levels[{index}]: name must be a short ascii word, got {name!r}")
    where = f"level {name!r}"
    unknown = set(entry) - _LEVEL_KEYS
    if unknown:
        raise LevelTableError(f"{where}: unknown fields {sorted(unknown)}")
    scheme = entry.get("scheme")
    if scheme in ("raw", "zstd"):
        cast = _cast(entry, where)
        lossless = cast is None or cast == torch.float32
        return Level(name, Scheme.RAW if scheme == "raw" else Scheme.ZSTD, lossless=lossless, cast=cast)
    if "dtype" in entry:
        raise LevelTableError(f"{where}: dtype applies to raw and zstd levels only")
    if scheme == "int8":
        if set(entry) & _QUANT_KEYS:
            raise LevelTableError(
                f"{where}: int8 takes no parameters, got {sorted(set(entry) & _QUANT_KEYS)}"
            )
        return Level(name, Scheme.INT8, lossless=False)
    if scheme not in ("quant", "transform"):
        raise LevelTableError(
            f"{where}: scheme must be 'raw', 'zstd', 'quant', 'transform' or 'int8', got {scheme!r}"
        )
    key_step = _steps(entry, "key_step", where)
    value_step = _steps(entry, "value_step", where)
    layers = transform.layers if scheme == "transform" and transform is not None else None
    layers = rms.shape[0] if layers is None and rms is not None else layers
    if layers is not None:
        for steps, key in ((key_step, "key_step"), (value_step, "value_step")):
            if len(steps) not in (1, layers):
                raise LevelTableError(f"{where}: {key} needs 1 or {layers} entries, has {len(steps)}")
    if scheme == "transform":
        if transform is None:
            raise LevelTableError(f"{where}: a transform level needs the table's transform")
        if "exact_tokens" in entry:
            raise LevelTableError(f"{where}: a transform level keeps sink_tokens exact, not exact_tokens")
        fraction, ratio = _salient(entry, where)
        tparams = TransformParams(
            transform=transform,
            key_step=key_step,
            value_step=value_step,
            sink_tokens=_int(entry, "sink_tokens", 4, 0, 65535, where),
            groups=_int(entry, "groups", DEFAULT_GROUPS, 1, 255, where),
            salient_fraction=fraction,
            salient_step=ratio,
        )
        scheme_of = Scheme.SALIENT if tparams.salient else Scheme.TRANSFORM
        return Level(name, scheme_of, lossless=False, quant=tparams)
    if "sink_tokens" in entry or set(entry) & _SALIENT_KEYS:
        raise LevelTableError(f"{where}: sink_tokens and salient_* apply to transform levels only")
    params = QuantParams(
        key_step=key_step,
        value_step=value_step,
        key_channel_rms=rms,
        exact_tokens=_int(entry, "exact_tokens", 1, 0, 65535, where),
        groups=_int(entry, "groups", DEFAULT_GROUPS, 1, 255, where),
    )
    return Level(name, Scheme.QUANT, lossless=False, quant=params)


def load_level_table(data: dict[str, Any], directory: Path | None = None) -> tuple[Level, ...]:
    """Validated levels of a parsed level table, best quality first (the first is lossless).

    ``directory``: where the table's transform file lies (default: the shipped tables' own).
    """
    if not isinstance(data, dict):
        raise LevelTableError("a level table is a JSON object")
    if data.get("format") != TABLE_FORMAT:
        raise LevelTableError(f"level table format must be {TABLE_FORMAT!r}, got {data.get('format')!r}")
    rms = None
    if data.get("key_channel_rms") is not None:
        try:
            rms = np.array(data["key_channel_rms"], dtype=np.float64)
        except (TypeError, ValueError) as exc:
            raise LevelTableError(f"key_channel_rms is not a numeric array: {exc}") from None
        if rms.ndim != 3 or rms.size == 0 or not np.isfinite(rms).all() or (rms <= 0).any():
            raise LevelTableError(
                "key_channel_rms must be a (layers, kv_heads, head_dim) array of positive numbers"
            )
        rms.setflags(write=False)
    entries = data.get("levels")
    if not isinstance(entries, list) or not entries:
        raise LevelTableError("levels must be a non-empty list")
    transform = _table_transform(data.get("transform"), directory)
    levels = tuple(_level(e, rms, i, transform) for i, e in enumerate(entries))
    if not levels[0].lossless:
        raise LevelTableError("the first level must be lossless (levels are ordered best quality first)")
    names = [lv.name for lv in levels]
    if len(set(names)) != len(names):
        raise LevelTableError(f"level names repeat: {names}")
    return levels


def _table_transform(entry: Any, directory: Path | None) -> KVTransform | None:
    """The transform a table names: ``{"file": ..., "digest": ...}``, loaded and checked."""
    if entry is None:
        return None
    if not isinstance(entry, dict) or set(entry) - {"file", "digest", "model", "comment"}:
        raise LevelTableError("transform must be an object with a file and its digest")
    name, digest = entry.get("file"), entry.get("digest")
    if not isinstance(name, str) or not name or "/" in name or "\\" in name or name.startswith("."):
        raise LevelTableError(f"transform file must be a plain file name beside the table, got {name!r}")
    if not isinstance(digest, str):
        raise LevelTableError("transform digest must be the file's digest in hex")
    base = Path(str(resources.files(__name__))) if directory is None else directory
    try:
        transform = _load_transform_cached(base / name)
    except TransformError as exc:
        raise LevelTableError(str(exc)) from None
    if transform.digest.hex() != digest:
        raise LevelTableError(f"transform {name} has digest {transform.digest.hex()}, the table names {digest}")
    return transform


_TRANSFORMS: dict[tuple[str, int, int], KVTransform] = {}


def _load_transform_cached(path: Path) -> KVTransform:
    """One load per file version and process: every table that names it shares the arrays."""
    try:
        st = path.stat()
    except OSError as exc:
        raise TransformError(f"{path}: cannot read the transform: {exc}") from None
    key = (str(path.resolve()), st.st_size, st.st_mtime_ns)
    if key not in _TRANSFORMS:
        _TRANSFORMS[key] = load_transform(path)
    return _TRANSFORMS[key]


def loaded_transforms() -> dict[bytes, KVTransform]:
    """Every transform a level table loaded in this process named, by id: what a reader that
    is not told which transforms to trust decodes with (``codec.parse_chunk``)."""
    return {t.id: t for t in _TRANSFORMS.values()}


def level_transforms(levels: tuple[Level, ...]) -> dict[bytes, KVTransform]:
    """The transforms ``levels`` code with, by id: what a reader of their chunks needs."""
    return {
        lv.quant.transform.id: lv.quant.transform for lv in levels if isinstance(lv.quant, TransformParams)
    }


def shipped_level_table(file_name: str) -> dict[str, Any]:
    """A level table shipped next to this file (parsed, not yet validated)."""
    return json.loads(resources.files(__name__).joinpath(file_name).read_text(encoding="utf-8"))


def default_level_table() -> dict[str, Any]:
    return shipped_level_table(DEFAULT_TABLE_FILE)


DEFAULT_LEVELS: tuple[Level, ...] = load_level_table(default_level_table())


def level_digest(level: Level) -> str:
    """16 hex digits that change whenever the level would encode a chunk differently.

    Stored object names carry it, so gateways whose tables give one name
    different parameters never read each other's chunks under that name.
    """
    h = hashlib.sha256(f"{level.scheme.name}".encode())
    q = level.quant
    if isinstance(q, TransformParams):
        h.update(repr((q.key_step, q.value_step, q.sink_tokens, q.groups)).encode())
        if q.salient:  # absent for scheme 4, so its digests are what they were
            h.update(repr((q.salient_fraction, q.salient_step)).encode())
        h.update(q.transform.digest)
    elif q is not None:
        h.update(repr((q.key_step, q.value_step, q.exact_tokens, q.groups)).encode())
        if q.key_channel_rms is not None:
            h.update(np.ascontiguousarray(q.key_channel_rms, dtype=np.float64).tobytes())
    if level.cast is not None:  # absent for uncast levels, so their digests are what they were
        h.update(f"cast={NAME_OF_DTYPE[level.cast]}".encode())
    return h.hexdigest()[:16]


def level_by_name(name: str, levels: tuple[Level, ...] = DEFAULT_LEVELS) -> Level:
    for level in levels:
        if level.name == name:
            return level
    raise KeyError(name)
