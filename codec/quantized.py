"""The lossy scheme: per-channel uniform quantization + rANS under a compact parametric model.

Why this shape (measured on SmolLM2-135M, see docs/codec.md):
- with entropy coding, a uniform scalar quantizer is near-optimal and the bits
  follow from the step size alone, so a level is just a rule for step sizes;
- a key error moves attention logits by ``q . dk``, so a key channel's step is
  set from the calibrated RMS of the queries that read it (``key_channel_rms``)
  rather than from the keys' own spread;
- a value error reaches the output in proportion to the attention it gets, and
  the first token of a context (the attention sink) gets most of it: the first
  ``exact_tokens`` of a chunk are stored as fp16.

The decoder needs nothing from the level: steps, centres and table indices are
in the payload (layout: codec/BITSTREAM.md).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import numpy as np
import torch
import zstandard

from codec import rans
from codec.container import MAX_VALUES
from codec.entropy_model import FAMILIES, bank
from codec.errors import CodecError, StreamError
from codec.quantize_kernel import quantize_rows
from codec.zstd_frame import decompress_exact

STEP_CODES = 256
STEP_TABLE = (2.0 ** ((np.arange(STEP_CODES, dtype=np.float64) - 128.0) / 8.0)).astype(np.float32)
# Steps are chosen so that |q| stays below this, which keeps every residual within int16.
_MAX_LEVEL = 15000
BANK_ID = 1
# groups, bank id, exact tokens, exact tokens' dtype code (format 4 on), side-info length
_PREFIX = struct.Struct("<BBHBI")
_PREFIX_V3 = struct.Struct("<BBHI")
# Exact tokens are float16 unless a value would overflow it (dtype codes of codec/dtypes.py).
_EXACT_DTYPES = {1: "<f2", 0: "<f4"}
# Side info (step codes, table indices, centres) is a tenth of a medium chunk; zstd takes
# about 60% of it off, in about a millisecond.
_SIDE_ZSTD_LEVEL = 9
# Entropy streams per (layer, k/v, head) that levels use unless their table says otherwise.
# More groups are more, shorter streams: more parallel work for a GPU decoder, a few more bytes
# (each stream carries a 4-byte length and a 4-byte final state). benchmarks/gpu_decode.py
# measures 2 against 8; the format takes any divisor of head_dim (stored per chunk).
DEFAULT_GROUPS = 2


@dataclass(frozen=True)
class QuantParams:
    """How a level chooses its steps; the encoder's business only, never stored."""

    key_step: tuple[float, ...]  # per layer (or one for all): logit-error scale, or x std if no rms
    value_step: tuple[float, ...]  # per layer (or one): fraction of the head's RMS in the chunk
    key_channel_rms: np.ndarray | None = None  # (layers, kv_heads, head_dim), calibrated per model
    exact_tokens: int = 1
    groups: int = DEFAULT_GROUPS  # streams per (layer, k/v, head)

    def __hash__(self) -> int:  # ndarray fields: hash by identity, levels are compared by name
        return id(self)


def _per_layer(values: tuple[float, ...], layers: int) -> np.ndarray:
    arr = np.asarray(values, dtype=np.float64)
    if arr.size == 1:
        return np.full(layers, arr.item())
    if arr.size != layers:
        raise ValueError(f"level has {arr.size} per-layer steps but the chunk has {layers} layers")
    return arr


def channel_steps(x: np.ndarray, p: QuantParams) -> np.ndarray:
    """Step size per (layer, k/v, head, channel), before rounding to a step code."""
    layers, _, heads, _, dim = x.shape
    keys, vals = x[:, 0], x[:, 1]
    ks = _per_layer(p.key_step, layers)[:, None, None]
    if p.key_channel_rms is not None:
        rms = np.asarray(p.key_channel_rms, dtype=np.float64)
        if rms.shape != (layers, heads, dim):
            raise ValueError(f"key_channel_rms has shape {rms.shape}, chunk needs {(layers, heads, dim)}")
        k_step = ks / np.maximum(rms, 1e-6)
    else:
        k_step = ks * keys.std(axis=2, dtype=np.float64)
    vs = _per_layer(p.value_step, layers)[:, None, None]
    head_rms = np.sqrt(np.mean(np.square(vals, dtype=np.float64), axis=(2, 3)))[:, :, None]
    v_step = np.broadcast_to(vs * head_rms, (layers, heads, dim))
    return np.stack([k_step, v_step], axis=1)


def step_codes(x: np.ndarray, step: np.ndarray) -> np.ndarray:
    peak = np.abs(x).max(axis=3) if x.shape[3] else np.zeros(step.shape)
    with np.errstate(divide="ignore"):
        wanted = np.round(8.0 * np.log2(np.maximum(step, 1e-30))) + 128
        floor = np.ceil(8.0 * np.log2(np.maximum(peak / _MAX_LEVEL, 1e-30))) + 128
    return np.clip(np.maximum(wanted, floor), 0, STEP_CODES - 1).astype(np.uint8)


def encode(kv: torch.Tensor, p: QuantParams) -> bytes:
    layers, _, heads, tokens, dim = kv.shape
    if dim % p.groups:
        raise ValueError(f"head_dim {dim} is not divisible into {p.groups} stream groups")
    x = kv.detach().to(device="cpu", dtype=torch.float32).numpy()
    if not np.isfinite(x).all():
        raise ValueError("KV chunk has non-finite values")
    n_exact = min(p.exact_tokens, tokens)
    exact, x = x[:, :, :, :n_exact], x[:, :, :, n_exact:]
    steps = channel_steps(x, p) if tokens - n_exact else np.ones((layers, 2, heads, dim))
    return encode_body(exact, x, steps, p.groups)


def encode_body(exact: np.ndarray, x: np.ndarray, steps: np.ndarray, groups: int) -> bytes:
    """The payload: ``exact`` (layers, 2, heads, E, head_dim) stored as they are, then ``x``
    (layers, 2, heads, tokens - E, head_dim) quantized with ``steps`` (layers, 2, heads,
    head_dim, before rounding to a step code) and entropy coded in ``groups`` streams a row."""
    layers, _, heads, coded, dim = x.shape
    n_exact = exact.shape[3]
    codes = step_codes(x, steps)
    step = STEP_TABLE[codes]  # (L, 2, H, D) float32
    channels = layers * 2 * heads * dim
    rows = np.ascontiguousarray(x.reshape(layers * 2 * heads, coded, dim), dtype=np.float32)
    symbols = np.empty((channels, coded), dtype=np.uint8)
    escapes = np.empty((channels, coded), dtype=np.int16)
    family = np.empty(channels, dtype=np.uint8)
    center = np.empty(channels, dtype=np.int16)
    b = bank()
    quantize_rows(rows, step.reshape(-1, dim), b.cost, b.freq, symbols, escapes, family, center)

    cps = dim // groups
    n_streams = channels // cps
    out = np.empty((n_streams, 3 * coded * cps + 2), dtype=np.uint16)
    lengths = np.empty(n_streams, dtype=np.int64)
    rans.encode_streams(symbols, escapes, family, b.cum, b.freq, coded, cps, out, lengths)

    side = _pack_side(codes.reshape(-1), family, center)
    exact_code = _exact_dtype_code(exact)
    parts = [
        _PREFIX.pack(groups, BANK_ID, n_exact, exact_code, len(side)),
        side,
        exact.astype(_EXACT_DTYPES[exact_code]).tobytes(),
        lengths.astype("<u4").tobytes(),
    ]
    parts.extend(out[s, : lengths[s]].astype("<u2").tobytes() for s in range(n_streams))
    return b"".join(parts)


def _exact_dtype_code(exact: np.ndarray) -> int:
    """float16 (1) unless a value is beyond its range or rounds to its infinity: then float32 (0).

    An attention sink's key can be large; stored as an fp16 infinity it would poison every
    attention score that reads it.
    """
    with np.errstate(over="ignore"):
        return 1 if np.isfinite(exact.astype(np.float16)).all() else 0


def _pack_side(codes: np.ndarray, family: np.ndarray, center: np.ndarray) -> bytes:
    c = center.astype("<i2").view(np.uint8)
    raw = np.concatenate([codes, family, c[0::2], c[1::2]]).tobytes()  # centres as byte planes
    return zstandard.ZstdCompressor(level=_SIDE_ZSTD_LEVEL).compress(raw)


def _unpack_side(data: memoryview, channels: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    raw = decompress_exact(data, 4 * channels, "side info")
    arr = np.frombuffer(raw, dtype=np.uint8)
    codes, family = arr[:channels], arr[channels : 2 * channels]
    center = arr[2 * channels : 3 * channels].astype(np.uint16) | (arr[3 * channels :].astype(np.uint16) << 8)
    return codes, family, center.view(np.int16)


class _Reader:
    def __init__(self, data: memoryview) -> None:
        self.data = data
        self.pos = 0

    def take(self, n: int, what: str) -> memoryview:
        if n < 0 or self.pos + n > len(self.data):
            raise CodecError(f"lossy payload truncated in {what}")
        view = self.data[self.pos : self.pos + n]
        self.pos += n
        return view

    def array(self, dtype: str, count: int, what: str) -> np.ndarray:
        size = np.dtype(dtype).itemsize
        return np.frombuffer(self.take(size * count, what), dtype=dtype)


@dataclass(frozen=True)
class QuantBody:
    """A scheme-2 payload after the host-side parse: every check done but the streams' rANS ends.

    ``words[offsets[s]:offsets[s+1]]`` are stream ``s``'s words (at least two each);
    channel ``j`` has ``family[j] < FAMILIES``, ``center[j]`` and ``step[j]``.
    """

    groups: int
    exact_tokens: int
    exact: np.ndarray  # (layers*2*heads, exact_tokens, head_dim), float16 or float32
    words: np.ndarray  # uint16
    offsets: np.ndarray  # int64, streams + 1
    family: np.ndarray  # uint8, per channel
    center: np.ndarray  # int16, per channel
    step: np.ndarray  # float32, per channel

    @property
    def streams(self) -> int:
        return self.offsets.shape[0] - 1


def parse(payload: bytes | memoryview, shape: tuple[int, int, int, int, int], version: int) -> QuantBody:
    layers, _, heads, tokens, dim = shape
    rd = _Reader(memoryview(payload))
    if version >= 4:
        groups, bank_id, n_exact, exact_code, side_len = _PREFIX.unpack(rd.take(_PREFIX.size, "prefix"))
        if exact_code not in _EXACT_DTYPES:
            raise CodecError(f"unknown dtype code {exact_code} for the exact tokens")
    else:
        groups, bank_id, n_exact, side_len = _PREFIX_V3.unpack(rd.take(_PREFIX_V3.size, "prefix"))
        exact_code = 1
    if bank_id != BANK_ID:
        raise CodecError(f"unknown probability model bank {bank_id}")
    if groups == 0 or dim % groups:
        raise CodecError(f"{groups} stream groups do not divide head_dim {dim}")
    if n_exact > tokens:
        raise CodecError("more exact tokens than tokens")
    coded = tokens - n_exact
    channels = layers * 2 * heads * dim
    cps = dim // groups
    n_streams = channels // cps
    # Bound what the side info may decompress to by what the payload can hold: every stream
    # has a 4-byte table entry and at least 4 bytes of words.
    if channels > MAX_VALUES or 8 * n_streams > len(rd.data):
        raise CodecError(f"{channels} channels do not fit a {len(rd.data)}-byte payload")
    codes, family, center = _unpack_side(rd.take(side_len, "side info"), channels)
    exact = rd.array(_EXACT_DTYPES[exact_code], layers * 2 * heads * n_exact * dim, "exact tokens")
    lengths = rd.array("<u4", n_streams, "stream table").astype(np.int64)
    if family.size and int(family.max()) >= FAMILIES:
        raise CodecError("table index out of range")
    # The encoder refuses non-finite KV; format 3 wrote an fp16 infinity for a value beyond
    # float16, which decodes as it did. NaN is never written (and would make backends differ).
    if exact.size and not np.isfinite(exact).all() and (version >= 4 or np.isnan(exact).any()):
        raise CodecError("exact tokens hold non-finite values")
    total = int(lengths.sum())
    body = rd.take(2 * total, "streams")
    if rd.pos != len(rd.data):
        raise CodecError("lossy payload has trailing bytes")
    if layers * 2 * heads * tokens * dim > MAX_VALUES:
        raise CodecError(f"chunk of {layers * 2 * heads * tokens * dim} values is over the decoder's limit")
    shortest = int(lengths.min())
    # Two words hold the final state, so every stream's first load is in bounds.
    if shortest < 2:
        raise CodecError("a stream is shorter than the rANS state")
    if coded * cps > (shortest - 1) * 16 / bank().min_bits + 1:
        raise CodecError("a stream is too short for the symbols the header promises")
    offsets = np.zeros(n_streams + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    return QuantBody(
        groups=groups,
        exact_tokens=n_exact,
        exact=exact.reshape(layers * 2 * heads, n_exact, dim),
        words=np.frombuffer(body, dtype="<u2"),
        offsets=offsets,
        family=family,
        center=center,
        step=STEP_TABLE[codes],
    )


def decode_into(q: QuantBody, out: np.ndarray) -> None:
    """Reconstruct into ``out``, float32 (layers*2*heads, tokens, head_dim), any strides, on the CPU."""
    out[:, : q.exact_tokens] = q.exact
    status = np.zeros(q.streams, dtype=np.int32)
    b = bank()
    rans.decode_streams(
        q.words,
        q.offsets,
        q.family.astype(np.int32),
        q.center.astype(np.int32),
        q.step,
        b.freq_cum,
        b.slot_symbol,
        out.shape[1] - q.exact_tokens,
        out.shape[2] // q.groups,
        q.exact_tokens,
        out,
        status,
    )
    raise_for_status(status)


def raise_for_status(status: np.ndarray, chunk: int = 0) -> None:
    bad = np.flatnonzero(status)
    if bad.size:
        raise StreamError(
            f"{bad.size} corrupt entropy-coded streams (first: stream {bad[0]}, error {status[bad[0]]})",
            chunk,
        )
