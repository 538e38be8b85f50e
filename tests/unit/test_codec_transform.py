"""Scheme 4 (format 5): the transform is named in every chunk, and every field is checked in the parse.

A chunk names its transform by id: under any other transform (another
model's, a recalibrated one) it is refused before anything is decoded. A
transform file is checked when it loads: shapes, dtypes, finite values,
positive weights, an orthonormal basis, and the digest the table names.
"""

from __future__ import annotations

import json
import struct
import zlib
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.numpy import save_file

from codec import CodecError, Level, LevelTableError, Scheme, decode_chunk, encode_chunk, load_level_table
from codec.container import HEADER_SIZE
from codec.levels import default_level_table
from codec.parsed import parse_chunk
from codec.transform import KVTransform, TransformError, fit_transform, load_transform, rope_, save_transform
from codec.transformed import TransformParams

LAYERS, HEADS, DIM = 2, 2, 16


def _kv(tokens: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    c = HEADS * DIM
    x = torch.randn(LAYERS, 2, tokens, c, generator=g) @ torch.randn(LAYERS, 2, c, c, generator=g)
    return x.reshape(LAYERS, 2, tokens, HEADS, DIM).permute(0, 1, 3, 2, 4).contiguous()


def _transform(seed: int, rope: bool = True) -> KVTransform:
    inv_freq = (1.0 / 10000 ** (np.arange(0, DIM, 2) / DIM)).astype(np.float32) if rope else None
    return fit_transform(_kv(400, seed), np.ones((LAYERS, HEADS, DIM)), inv_freq=inv_freq, model=f"m{seed}")


def _level(t: KVTransform) -> Level:
    return Level("t", Scheme.TRANSFORM, False, TransformParams(t, (0.2,), (0.1,), sink_tokens=2))


def _forge_crc(data: bytes | bytearray) -> bytes:
    body = bytes(data[:-4])
    return body + struct.pack("<I", zlib.crc32(body))


T1, T2 = _transform(1), _transform(2)
CHUNK = encode_chunk(_kv(40, 7), _level(T1), position=256)


def test_a_chunk_decodes_under_its_transform_only() -> None:
    out = decode_chunk(CHUNK, {T1.id: T1})
    kv = _kv(40, 7)
    assert (out - kv).norm() < 0.05 * kv.norm()
    with pytest.raises(CodecError, match="transform"):
        parse_chunk(CHUNK, transforms={T2.id: T2})  # another model's: refused in the parse
    with pytest.raises(CodecError, match="transform"):
        parse_chunk(CHUNK, transforms={})


def test_the_chunk_names_its_transform_and_position() -> None:
    prefix = CHUNK[HEADER_SIZE : HEADER_SIZE + 20]
    assert prefix[:16] == T1.id and struct.unpack("<I", prefix[16:])[0] == 256
    assert T1.id != T2.id and len(T1.id) == 16


def test_the_position_turns_the_keys() -> None:
    """Coded at one position and relabelled at another (CRC forged), keys decode rotated:
    the position is part of what the chunk means."""
    data = bytearray(CHUNK)
    data[HEADER_SIZE + 16 : HEADER_SIZE + 20] = struct.pack("<I", 300)
    moved = decode_chunk(_forge_crc(data), {T1.id: T1})
    right = decode_chunk(CHUNK, {T1.id: T1})
    assert torch.equal(moved[:, 1], right[:, 1])  # values have no position
    assert not torch.allclose(moved[:, 0], right[:, 0], atol=1e-2)


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda d: d[: HEADER_SIZE + 10], "length|truncated"),  # cut inside the prefix
        (lambda d: _set(d, HEADER_SIZE + 16, struct.pack("<I", 0xFFFFFFF0)), "position"),
        (lambda d: _set(d, HEADER_SIZE, b"\x00" * 16), "transform"),
        (lambda d: _set(d, 4, struct.pack("<H", 4)), "scheme 4"),  # scheme 4 inside a format-4 chunk
        (lambda d: _set(d, HEADER_SIZE + 21, b"\x07"), "bank"),  # the scheme-2 body is checked too
    ],
)
def test_forged_fields_are_rejected_in_the_parse(edit, message: str) -> None:
    data = bytes(edit(bytearray(CHUNK)))
    if len(data) == len(CHUNK):
        data = _forge_crc(data)
    else:  # a truncated payload: fix its length field and CRC, so the scheme parse sees it
        data = bytearray(data + b"\0\0\0\0")
        data[18:26] = struct.pack("<Q", len(data) - HEADER_SIZE - 4)
        data = _forge_crc(data)
    with pytest.raises(CodecError, match=message):
        parse_chunk(data, transforms={T1.id: T1})


def _set(data: bytearray, at: int, value: bytes) -> bytearray:
    data[at : at + len(value)] = value
    return data


def test_a_transform_of_another_shape_is_refused() -> None:
    other = fit_transform(
        torch.randn(LAYERS + 1, 2, HEADS, 100, DIM), np.ones((LAYERS + 1, HEADS, DIM)), skip_tokens=0
    )
    forged = KVTransform(**{**_fields(other), "model": "x"})
    data = bytearray(CHUNK)
    data[HEADER_SIZE : HEADER_SIZE + 16] = forged.id
    with pytest.raises(CodecError, match="is for KV of"):
        parse_chunk(_forge_crc(data), transforms={forged.id: forged})


def _fields(t: KVTransform) -> dict:
    return {
        "mean": t.mean,
        "weight": t.weight,
        "basis": t.basis,
        "kv_heads": t.kv_heads,
        "head_dim": t.head_dim,
        "inv_freq": t.inv_freq,
        "rope_scale": t.rope_scale,
    }


def test_transform_file_round_trips_and_pins_its_digest(tmp_path: Path) -> None:
    path = tmp_path / "t.safetensors"
    save_transform(T1, path)
    back = load_transform(path)
    assert back.digest == T1.digest and back.model == "m1"
    assert torch.equal(decode_chunk(CHUNK, {back.id: back}), decode_chunk(CHUNK, {T1.id: T1}))


def _broken(name: str) -> dict:
    f = {k: v.copy() if isinstance(v, np.ndarray) else v for k, v in _fields(T1).items()}
    if name == "nan_mean":
        f["mean"][0, 1, 3] = np.nan
    elif name == "zero_weight":
        f["weight"][1, 0, 0] = 0.0
    elif name == "not_orthonormal":
        f["basis"][0, 0, :, 0] *= 1.01
    elif name == "float64":
        f["mean"] = f["mean"].astype(np.float64)
    elif name == "bad_inv_freq":
        f["inv_freq"] = f["inv_freq"][:-1]
    elif name == "layers_disagree":
        f["weight"] = f["weight"][:1]
    elif name == "rope_scale":
        f["rope_scale"] = float("inf")
    return f


@pytest.mark.parametrize(
    "name",
    [
        "nan_mean",
        "zero_weight",
        "not_orthonormal",
        "float64",
        "bad_inv_freq",
        "layers_disagree",
        "rope_scale",
    ],
)
def test_a_broken_transform_is_refused(name: str) -> None:
    with pytest.raises(TransformError):
        KVTransform(**_broken(name))


def test_a_tampered_file_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "t.safetensors"
    save_transform(T1, path)
    from safetensors import safe_open

    with safe_open(str(path), framework="numpy") as f:
        meta = f.metadata()
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    tensors["mean"] = tensors["mean"] + np.float32(0.5)  # valid arrays, but not the ones the digest names
    save_file(tensors, str(path), metadata=meta)
    with pytest.raises(TransformError, match="digest"):
        load_transform(path)
    path.write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{}      ")
    with pytest.raises(TransformError):
        load_transform(path)


def test_a_table_naming_another_digest_or_a_path_is_refused(tmp_path: Path) -> None:
    table = default_level_table()
    save_transform(T1, tmp_path / "t.safetensors")
    wrong = dict(table, transform={"file": "t.safetensors", "digest": table["transform"]["digest"]})
    with pytest.raises(LevelTableError, match="digest"):
        load_level_table(json.loads(json.dumps(wrong)), tmp_path)
    for name in ("../t.safetensors", "/etc/passwd", ".hidden"):
        with pytest.raises(LevelTableError, match="plain file name"):
            load_level_table(dict(table, transform={"file": name, "digest": "00"}), tmp_path)
    no_transform = {k: v for k, v in table.items() if k != "transform"}
    with pytest.raises(LevelTableError, match="needs the table's transform"):
        load_level_table(no_transform)


def test_refitting_gives_the_same_bytes() -> None:
    """Deterministic fit (eigenvector signs fixed), so two machines calibrating agree."""
    assert _transform(1).digest == T1.digest
    assert _transform(1, rope=False).digest != T1.digest


@pytest.mark.parametrize("heads", [1, HEADS])
def test_encoding_never_writes_its_input(heads: int) -> None:
    """The encoder rotates keys back in a copy, whatever the shape (a one-head permute is a view)."""
    kv = torch.randn(LAYERS, 2, heads, 5, DIM)
    t = fit_transform(
        torch.randn(LAYERS, 2, heads, 64, DIM), np.ones((LAYERS, heads, DIM)), inv_freq=T1.inv_freq
    )
    before = kv.clone()
    encode_chunk(kv, _level(t), position=9)
    assert torch.equal(kv, before)


def _inverse_fresh(t: KVTransform, values: torch.Tensor, position: int) -> torch.Tensor:
    """The bf16 inverse with its temporaries freshly allocated (the scratch buffers held)."""
    import codec.transform as transform

    out = values.clone()
    with transform._CPU_SCRATCH.take(out.device) as held:
        assert held is transform._CPU_SCRATCH
        t.inverse_(out, position, bf16=True)  # finds the buffers in use: allocates its own
    return out


@pytest.mark.parametrize("tokens", [40, 7, 40, 64])  # grown, shrunk, reused, grown again
def test_the_cpu_inverse_gives_the_same_bits_from_its_reused_buffers(tokens: int) -> None:
    coefficients = _kv(tokens, 11 + tokens)
    reused = coefficients.clone()
    T1.inverse_(reused, 300, bf16=True)
    assert torch.equal(reused, _inverse_fresh(T1, coefficients, 300))
    assert not torch.equal(reused, coefficients)


def test_concurrent_inverses_do_not_share_buffers() -> None:
    import threading

    inputs = [_kv(40, 20 + k) for k in range(6)]
    expected = [_inverse_fresh(T1, x, 100) for x in inputs]
    wrong: list[int] = []

    def run(k: int) -> None:
        for _ in range(20):
            out = inputs[k].clone()
            T1.inverse_(out, 100, bf16=True)
            if not torch.equal(out, expected[k]):
                wrong.append(k)

    threads = [threading.Thread(target=run, args=(k,)) for k in range(len(inputs))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert wrong == []


def _inverse_in_torch(t: KVTransform, values: torch.Tensor, position: int) -> torch.Tensor:
    """The bf16 inverse as torch ops alone, step by step: the reference for the CPU's one-pass
    finish (codec/inverse_kernel.py)."""
    layers, _, heads, tokens, dim = values.shape
    decode, mean = t._on(values.device, True)
    y = values.permute(0, 1, 3, 2, 4).reshape(layers * 2, tokens, heads * dim).to(torch.bfloat16)
    x = (torch.bmm(y, decode).float() + mean).view(layers, 2, tokens, heads, dim)
    if t.inv_freq is not None:
        rope_(x[:, 0], t.inv_freq, t.rope_scale, position)
    return x.permute(0, 1, 3, 2, 4).contiguous()


@pytest.mark.parametrize("rope", [True, False])
@pytest.mark.parametrize("tokens", [1, 7, 40])
def test_the_cpu_inverse_finishes_as_the_torch_steps_do(rope: bool, tokens: int) -> None:
    """The mean, RoPE and the copy out, fused on the CPU, give torch's values, into a strided slice
    of a larger buffer (a cache's tokens after the exact ones) without touching the rest of it:
    the same bits without RoPE; with it, within float32's last bit (torch may fuse a multiply and
    an add in its vector code)."""
    t = T1 if rope else _transform(3, rope=False)
    coefficients = _kv(tokens, 5 + tokens)
    buffer = torch.full((LAYERS, 2, HEADS, tokens + 3, DIM), 7.0)
    buffer[:, :, :, 3:] = coefficients
    t.inverse_(buffer[:, :, :, 3:], 300, bf16=True)
    expected = _inverse_in_torch(t, coefficients, 300)
    if rope:
        ulp = 2.0**-23 * float(expected.abs().max())
        torch.testing.assert_close(buffer[:, :, :, 3:], expected, rtol=2**-22, atol=2 * ulp)
    else:
        assert torch.equal(buffer[:, :, :, 3:], expected)
    assert bool((buffer[:, :, :, :3] == 7.0).all())
