"""The transform stage of scheme 4: a per-model linear decorrelation of each layer's keys and values.

Per (layer, K/V) group, a token's KV vector ``x`` (``kv_heads * head_dim``
values, head-major) is coded as the coefficients

    y = ((x - mean) * weight) @ basis

and decoded as ``x = (y @ basis.T) / weight + mean``. ``basis`` is orthonormal
(a PCA of calibration KV, components in decreasing variance), ``weight`` puts
keys in units of logit error (the RMS of the queries that read each channel)
and values in units of their head's RMS, so one quantizer step per group is
the rate-distortion choice (docs/codec.md, "Transform coding").

With ``inv_freq``, keys are coded *before* rotary embedding: the encoder
rotates them back for the chunk's positions, the decoder rotates them again.
RoPE turns channel pairs by the token's position, which hides the keys'
structure from a fixed basis; rotated back, the PCA finds it.

A transform is calibrated once per model (``python -m app calibrate``),
stored as a safetensors file beside the level table, and named in every chunk
by the first 16 bytes of its digest (``KVTransform.id``), so a chunk never
decodes under another one. ``load_transform`` checks every field of the file.
"""

from __future__ import annotations

import hashlib
import json
import math
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path

import numpy as np
import torch

from codec import split_matmul
from codec.inverse_kernel import finish_bf16_inverse

FILE_FORMAT = "cachegen-kv-transform/1"
ID_BYTES = 16
# An orthonormal basis stored in float32: columns are unit vectors within this.
_ORTHO_TOLERANCE = 1e-3


class TransformError(ValueError):
    """A transform file or array that does not validate."""


@dataclass(frozen=True, eq=False)
class RowScale:
    """Token rows of some layers' coefficients, keys and values both, to multiply by ``ratio``
    before the inverse (scheme 5's salient tokens, coded on a finer step). ``layer`` and ``token``
    (int64, one pair per row; tokens counted from the first of the inverse's ``values``)."""

    layer: np.ndarray
    token: np.ndarray
    ratio: float

    @cached_property
    def _rows(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(group = layer * 2 + K/V, K/V, token) for the keys' rows, then the values'."""
        kv = np.repeat(np.arange(2, dtype=np.int64), self.layer.size)
        layer, token = np.tile(self.layer, 2), np.tile(self.token, 2)
        return layer * 2 + kv, kv, token

    def apply_(self, values: torch.Tensor, first: int, end: int) -> None:
        """Scale the rows of groups ``first:end`` of ``values`` (layers, 2, heads, tokens, dim), in
        place, in float32 (any strides: indexing, never a flattened copy)."""
        group, kv, token = self._rows
        take = (group >= first) & (group < end)
        if take.any():
            index = [torch.from_numpy(a[take]).to(values.device) for a in (group // 2, kv, token)]
            values[index[0], index[1], :, index[2], :] *= self.ratio


@dataclass(frozen=True, eq=False)
class KVTransform:
    mean: np.ndarray  # (layers, 2, C) float32, C = kv_heads * head_dim
    weight: np.ndarray  # (layers, 2, C) float32, > 0
    basis: np.ndarray  # (layers, 2, C, C) float32, orthonormal columns
    kv_heads: int
    head_dim: int
    inv_freq: np.ndarray | None = None  # (head_dim // 2,) float32: keys coded before RoPE
    rope_scale: float = 1.0  # the rotary embedding's attention scaling (1 for plain RoPE)
    model: str = ""  # the fingerprint of the model it was calibrated on (engine.identity)
    _device: dict = field(default_factory=dict, repr=False)  # per (device, bf16): (decode matrix, mean)

    def __post_init__(self) -> None:
        check(self)

    @property
    def layers(self) -> int:
        return self.mean.shape[0]

    @cached_property
    def id(self) -> bytes:
        """What a chunk names the transform by: the digest's first ``ID_BYTES`` bytes."""
        return self.digest[:ID_BYTES]

    @cached_property
    def digest(self) -> bytes:
        """SHA-256 of everything that decides what a coefficient decodes to."""
        h = hashlib.sha256(FILE_FORMAT.encode())
        h.update(json.dumps([self.layers, self.kv_heads, self.head_dim, float(self.rope_scale)]).encode())
        for arr in (self.mean, self.weight, self.basis):
            h.update(np.ascontiguousarray(arr, dtype="<f4").tobytes())
        h.update(b"rope" if self.inv_freq is not None else b"no-rope")
        if self.inv_freq is not None:
            h.update(np.ascontiguousarray(self.inv_freq, dtype="<f4").tobytes())
        return h.digest()

    @property
    def shape(self) -> tuple[int, int, int]:
        return (self.layers, self.kv_heads, self.head_dim)

    # -- encoding (host, numpy) --------------------------------------------------------------

    def forward(self, kv: np.ndarray, position: int) -> np.ndarray:
        """Coefficients of ``kv`` (layers, 2, heads, tokens, head_dim) whose first token is at
        ``position``, laid out as the KV: component ``c`` of a group at ``[.., c // D, :, c % D]``.
        In float32 (torch, on the CPU): the encoder is not part of the format."""
        layers, _, heads, tokens, dim = kv.shape
        x = torch.from_numpy(np.asarray(kv, dtype=np.float32))
        # a copy, always (the caller's array is never written), token-major
        v = x.permute(0, 1, 3, 2, 4).clone(memory_format=torch.contiguous_format)
        if self.inv_freq is not None:
            rope_(v[:, 0], self.inv_freq, self.rope_scale, position, inverse=True)
        encode, mean = self._encoder
        x = v.reshape(layers * 2, tokens, heads * dim).sub_(mean)
        y = split_matmul.bmm(x, encode, torch.empty_like(x))
        return y.view(layers, 2, tokens, heads, dim).permute(0, 1, 3, 2, 4).contiguous().numpy()

    @cached_property
    def _encoder(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(weight-scaled basis, mean) per group, on the CPU: y = (x - mean) @ encode."""
        layers, c = self.layers, self.kv_heads * self.head_dim
        basis = torch.from_numpy(self.basis).reshape(layers * 2, c, c)
        weight = torch.from_numpy(self.weight).reshape(layers * 2, c, 1)
        mean = torch.from_numpy(self.mean).reshape(layers * 2, 1, c)
        return (basis * weight).contiguous(), mean.contiguous()

    # -- decoding (torch, on the output's device) ---------------------------------------------

    def _on(self, device: torch.device, bf16: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """(decode matrix, mean) per group on ``device``; the matrix in bf16 for a bf16 inverse."""
        if (device, bf16) not in self._device:
            layers, c = self.layers, self.kv_heads * self.head_dim
            basis = torch.from_numpy(self.basis).reshape(layers * 2, c, c)
            weight = torch.from_numpy(self.weight).reshape(layers * 2, 1, c)
            decode = (basis.transpose(1, 2) / weight).contiguous()  # x = y @ decode + mean
            mean = torch.from_numpy(self.mean).reshape(layers * 2, 1, c).contiguous()
            decode = decode.to(device, torch.bfloat16 if bf16 else torch.float32)
            self._device[(device, bf16)] = (decode, mean.to(device))
        return self._device[(device, bf16)]

    def inverse_(
        self, values: torch.Tensor, position: int, bf16: bool | None = None, scale: RowScale | None = None
    ) -> None:
        """Turn the coefficients in ``values`` (layers, 2, heads, tokens, head_dim), float32, any
        strides, whose first token is at ``position``, into KV, in place, on their device.

        ``bf16``: multiply in bf16 (float32 accumulation, the product rounded to bf16, the mean
        and RoPE in float32); None: where the device has a native bf16 matmul (``bf16_inverse``).
        ``scale``: rows multiplied first, on the CPU by each lane for its own groups (the same
        float32 products as one call before the inverse)."""
        layers, _, heads, tokens, dim = values.shape
        if tokens == 0:
            return
        if bf16 is None:
            bf16 = bf16_inverse(values.device)
        in_lanes = bf16 and values.device.type == "cpu"  # the split inverse: each lane scales its groups
        if scale is not None and not in_lanes:
            scale.apply_(values, 0, layers * 2)
        decode, mean = self._on(values.device, bf16)
        c = heads * dim
        coefficients = values.permute(0, 1, 3, 2, 4)
        groups = (layers * 2, tokens, c)
        with _CPU_SCRATCH.take(values.device) as scratch:
            if bf16:  # one pass rounds and transposes; the sum with the mean comes back as float32
                y = scratch.tensor("y", groups, torch.bfloat16)
                product = scratch.tensor("product", groups, torch.bfloat16)
                into, source = y.view(layers * 2, tokens, heads, dim), coefficients.flatten(0, 1)

                def lane(i: int, j: int) -> None:  # each of the codec's threads: its groups
                    if scale is not None and in_lanes:
                        scale.apply_(values, i, j)
                    into[i:j].copy_(source[i:j])
                    torch.bmm(y[i:j], decode[i:j], out=product[i:j])

                split_matmul.over_groups(layers * 2, values.device, lane)
                if values.device.type == "cpu":  # the mean, RoPE and the copy out in one pass
                    cos, sin = self._rope_tables(tokens, position)
                    bits = product.view(torch.int16).numpy().view(np.uint16)
                    finish_bf16_inverse(bits, mean.view(layers * 2, c).numpy(), cos, sin, values.numpy())
                    return
                x = torch.add(mean, product, out=scratch.tensor("x", groups, torch.float32))
            else:  # one matmul per group (einsum picks a faster bmm layout than baddbmm here: 12 against 15 ms)
                y = coefficients.reshape(layers * 2, tokens, c)
                x = torch.einsum("gtc,gcd->gtd", y, decode).add_(mean)
            x = x.view(layers, 2, tokens, heads, dim)
            if self.inv_freq is not None:
                rope_(x[:, 0], self.inv_freq, self.rope_scale, position)
            values.copy_(x.permute(0, 1, 3, 2, 4))

    def _rope_tables(self, tokens: int, position: int) -> tuple[np.ndarray, np.ndarray]:
        """RoPE's (cos, sin) rows for ``finish_bf16_inverse``; no rows when keys are coded after
        RoPE."""
        if self.inv_freq is None:
            empty = np.empty((0, self.head_dim // 2), np.float32)
            return empty, empty
        cos, sin = rope_tables(tokens, self.inv_freq, self.rope_scale, position, torch.device("cpu"))
        return cos.numpy(), sin.numpy()


class _Scratch:
    """Buffers the CPU inverse reuses for its temporaries, one set per process (the bf16
    coefficients and product, about 12 MB for a 256-token chunk of the default model; the float32
    sum is gone since ``finish_bf16_inverse`` writes the KV straight out). Fresh temporaries are fresh memory, faulted in page by
    page: in a fresh gateway, a prepare thread's first inverse took 21-126 ms, against 10-13 ms for
    the next, nearly all of it in the copy into the bf16 coefficients and the sum with the mean
    (torch profiler). A second thread that finds the buffers in use allocates its own, as before
    (in the gateway the codec gate runs one decode at a time); other devices always allocate
    (a GPU's caching allocator reuses its memory already)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._flat: dict[str, torch.Tensor] = {}

    @contextmanager
    def take(self, device: torch.device) -> Iterator[_Scratch | _Fresh]:
        if device.type != "cpu" or not self._lock.acquire(blocking=False):
            yield _Fresh(device)
            return
        try:
            yield self
        finally:
            self._lock.release()

    def tensor(self, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """A contiguous ``shape`` view of buffer ``name``, grown when too small."""
        n = math.prod(shape)
        flat = self._flat.get(name)
        if flat is None or flat.dtype != dtype or flat.numel() < n:
            flat = self._flat[name] = torch.empty(n, dtype=dtype)
        return flat[:n].view(shape)


@dataclass(frozen=True)
class _Fresh:
    device: torch.device

    def tensor(self, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(shape, dtype=dtype, device=self.device)


_CPU_SCRATCH = _Scratch()


def cheap_inverse(device_type: str) -> bool:
    """Whether the inverse costs little on ``device_type``: a GPU, or a CPU with a native bf16
    matmul (``bf16_inverse``). Elsewhere it multiplies in float32 on the CPU, 4x slower."""
    return device_type == "cuda" or (device_type == "cpu" and bf16_inverse(torch.device("cpu")))


def bf16_inverse(device: torch.device) -> bool:
    """Whether the inverse transform multiplies in bf16 on ``device``: on a CPU with a native bf16
    matmul (AMX or AVX512-BF16), where it is 2.4x faster than float32 (docs/codec.md, "Speed").
    Elsewhere float32: a GPU's matmul is fast either way, and a CPU without native bf16 emulates
    it (40x slower)."""
    if device.type != "cpu":
        return False
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False


def rope_tables(
    tokens: int, inv_freq: np.ndarray, scale: float, position: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """``scale * cos`` and ``scale * sin`` of each token's angles, (tokens, head_dim / 2), float32,
    computed as transformers' Llama rotary embedding computes them."""
    positions = torch.arange(position, position + tokens, device=device, dtype=torch.float32)
    angles = positions[:, None] * torch.from_numpy(inv_freq).to(device)[None, :]
    return angles.cos() * scale, angles.sin() * scale


def rope_(
    keys: torch.Tensor, inv_freq: np.ndarray, scale: float, position: int, inverse: bool = False
) -> None:
    """Rotary embedding, in place, of ``keys`` (..., tokens, heads, head_dim) whose first token is
    at ``position``, with angles computed as transformers' Llama rotary embedding computes them
    (float32, ``cat(freqs, freqs)``: channels c and c + D/2 turn by one angle); ``inverse``: the
    rotation undone, ``x * cos - rotate_half(x) * sin``, over ``scale^2``."""
    half = keys.shape[-1] // 2
    cos, sin = rope_tables(keys.shape[-3], inv_freq, scale, position, keys.device)
    cos, sin = cos[:, None], sin[:, None]  # over the heads
    if inverse:
        cos, sin = cos / scale**2, -sin / scale**2
    first, second = keys[..., :half], keys[..., half:]
    rotated_first = first * cos - second * sin
    second.mul_(cos).addcmul_(first, sin)
    first.copy_(rotated_first)


def check(t: KVTransform) -> None:
    """Every field's shape, dtype and range; the basis orthonormal. Raises ``TransformError``."""
    if t.kv_heads < 1 or t.head_dim < 2 or t.head_dim % 2:
        raise TransformError(f"bad transform dimensions: {t.kv_heads} heads of {t.head_dim}")
    c = t.kv_heads * t.head_dim
    for name, arr, tail in (("mean", t.mean, (c,)), ("weight", t.weight, (c,)), ("basis", t.basis, (c, c))):
        if not isinstance(arr, np.ndarray) or arr.dtype != np.float32:
            raise TransformError(f"transform {name} must be a float32 array")
        if arr.ndim != 2 + len(tail) or arr.shape[1] != 2 or arr.shape[2:] != tail or arr.shape[0] < 1:
            raise TransformError(f"transform {name} has shape {arr.shape}, expected (layers, 2, *{tail})")
        if not np.isfinite(arr).all():
            raise TransformError(f"transform {name} holds non-finite values")
    if t.weight.shape[0] != t.mean.shape[0] or t.basis.shape[0] != t.mean.shape[0]:
        raise TransformError("transform arrays disagree on the number of layers")
    if (t.weight <= 0).any():
        raise TransformError("transform weights must be positive")
    b = t.basis.astype(np.float64)
    gram = b.transpose(0, 1, 3, 2) @ b
    if np.abs(gram - np.eye(c)).max() > _ORTHO_TOLERANCE:
        raise TransformError("transform basis is not orthonormal")
    if not math.isfinite(t.rope_scale) or t.rope_scale <= 0:
        raise TransformError(f"transform rope_scale must be a positive number, got {t.rope_scale!r}")
    if t.inv_freq is not None:
        f = t.inv_freq
        if not isinstance(f, np.ndarray) or f.dtype != np.float32 or f.shape != (t.head_dim // 2,):
            raise TransformError(f"transform inv_freq must be float32 of shape ({t.head_dim // 2},)")
        if not np.isfinite(f).all() or (f < 0).any():
            raise TransformError("transform inv_freq must be finite and non-negative")


def save_transform(t: KVTransform, path: Path) -> None:
    from safetensors.numpy import save_file

    tensors = {"mean": t.mean, "weight": t.weight, "basis": t.basis}
    if t.inv_freq is not None:
        tensors["inv_freq"] = t.inv_freq
    meta = {
        "format": FILE_FORMAT,
        "kv_heads": str(t.kv_heads),
        "head_dim": str(t.head_dim),
        "rope_scale": repr(float(t.rope_scale)),
        "model": t.model,
        "digest": t.digest.hex(),
    }
    save_file({k: np.ascontiguousarray(v) for k, v in tensors.items()}, str(path), metadata=meta)


def load_transform(path: Path) -> KVTransform:
    """Read and check a transform file (safetensors: no code runs on load)."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(path), framework="numpy") as f:
            meta = f.metadata() or {}
            names = set(f.keys())
            if meta.get("format") != FILE_FORMAT:
                raise TransformError(f"{path}: not a {FILE_FORMAT} file")
            unknown = names - {"mean", "weight", "basis", "inv_freq"}
            if unknown or not {"mean", "weight", "basis"} <= names:
                raise TransformError(f"{path}: unexpected tensors {sorted(names)}")
            arrays = {name: f.get_tensor(name) for name in names}
    except (SafetensorError, OSError) as exc:
        raise TransformError(f"{path}: cannot read the transform: {exc}") from None
    try:
        heads, dim, scale = int(meta["kv_heads"]), int(meta["head_dim"]), float(meta["rope_scale"])
    except (KeyError, ValueError) as exc:
        raise TransformError(f"{path}: bad metadata: {exc}") from None
    t = KVTransform(
        mean=arrays["mean"],
        weight=arrays["weight"],
        basis=arrays["basis"],
        kv_heads=heads,
        head_dim=dim,
        inv_freq=arrays.get("inv_freq"),
        rope_scale=scale,
        model=meta.get("model", ""),
    )
    if meta.get("digest") not in (None, t.digest.hex()):
        raise TransformError(f"{path}: the arrays do not match the digest the file names")
    return t


def fit_transform(
    kv: torch.Tensor,
    key_weight: np.ndarray,
    inv_freq: np.ndarray | None = None,
    rope_scale: float = 1.0,
    skip_tokens: int = 4,
    model: str = "",
) -> KVTransform:
    """Calibrate a transform on ``kv`` (layers, 2, heads, tokens, head_dim) of one context from
    position 0 (its first ``skip_tokens``, the attention sinks, left out).

    ``key_weight`` (layers, heads, head_dim): the RMS of the queries that read each key channel,
    so that key coefficients are in units of logit error. Values are weighted by their head's
    RMS. The basis is the eigenvectors of the weighted vectors' covariance, largest first.
    """
    layers, _, heads, _tokens, dim = kv.shape
    c = heads * dim
    x = kv.detach().to(device="cpu", dtype=torch.float32, copy=True)
    if inv_freq is not None:  # keys before RoPE (token-major for the rotation, then back)
        keys = x[:, 0].permute(0, 2, 1, 3).contiguous()
        rope_(keys, np.asarray(inv_freq, dtype=np.float32), rope_scale, 0, inverse=True)
        x[:, 0] = keys.permute(0, 2, 1, 3)
    x = x.double().numpy()
    x = x[:, :, :, skip_tokens:]
    v = x.transpose(0, 1, 3, 2, 4).reshape(layers, 2, -1, c)
    weight = np.empty((layers, 2, c))
    weight[:, 0] = np.asarray(key_weight, dtype=np.float64).reshape(layers, c)
    head_rms = np.sqrt(np.mean(np.square(x[:, 1]), axis=(2, 3)))  # (layers, heads)
    weight[:, 1] = np.repeat(1.0 / np.maximum(head_rms, 1e-12), dim, axis=1)
    mean = v.mean(axis=2)
    y = (v - mean[:, :, None]) * weight[:, :, None]
    cov = y.transpose(0, 1, 3, 2) @ y / y.shape[2]
    _, vectors = np.linalg.eigh(cov)  # ascending
    basis = vectors[..., ::-1]
    # a sign per component, so that a refit on the same data gives the same bytes
    peak = np.take_along_axis(basis, np.argmax(np.abs(basis), axis=-2)[..., None, :], axis=-2)
    basis = basis * np.where(peak < 0, -1.0, 1.0)
    return KVTransform(
        mean=mean.astype(np.float32),
        weight=weight.astype(np.float32),
        basis=np.ascontiguousarray(basis, dtype=np.float32),
        kv_heads=heads,
        head_dim=dim,
        inv_freq=None if inv_freq is None else np.asarray(inv_freq, dtype=np.float32),
        rope_scale=rope_scale,
        model=model,
    )
