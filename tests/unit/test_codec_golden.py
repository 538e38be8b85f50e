"""Committed chunks decode to their committed tensors, bit for bit; the model bank is pinned."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pytest
import torch

from codec import FORMAT_VERSION, decode_chunk, encode_chunk, quantized
from codec.container import read_header
from codec.entropy_model import BANK_DIGEST, bank
from codec.parsed import parse_chunk
from codec.transform import bf16_inverse
from codec.transformed import inverse_

GOLDEN = Path(__file__).resolve().parents[1] / "fixtures" / "golden"
_spec = importlib.util.spec_from_file_location("golden_generate", GOLDEN / "generate.py")
assert _spec and _spec.loader
generate = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(generate)

NAMES = sorted(generate.golden_levels())
# What older writers produced: every reader must still decode it.
OLD = sorted(str(p.relative_to(GOLDEN).with_suffix("")) for p in GOLDEN.glob("v*/*.bin"))
_NUMPY = {torch.float32: "<f4", torch.float16: "<f2", torch.bfloat16: "<u2"}


@pytest.mark.parametrize("name", NAMES + OLD)
def test_golden_chunk_decodes_to_its_tensor(name: str) -> None:
    data = (GOLDEN / f"{name}.bin").read_bytes()
    out = decode_chunk(data, generate.transforms())
    assert tuple(out.shape) == generate.SHAPE
    expected = np.frombuffer((GOLDEN / f"{name}.out").read_bytes(), dtype=_NUMPY[out.dtype])
    got = out.contiguous().view(torch.int16) if out.dtype == torch.bfloat16 else out.contiguous()
    got = got.numpy().reshape(-1).view(expected.dtype)
    if read_header(data).scheme in (4, 5):  # the inverse transform is a matmul, in the device's precision
        _assert_inverse_close(got, expected, bf16_inverse(out.device))
    else:
        assert np.array_equal(got, expected)


TRANSFORM_NAMES = [name for name in NAMES if name.startswith(("transform", "salient"))]


@pytest.mark.parametrize("bf16", [False, True])
@pytest.mark.parametrize("name", TRANSFORM_NAMES)
def test_transform_goldens_decode_with_either_inverse(name: str, bf16: bool) -> None:
    """Whatever this CPU's own choice, both inverses give the golden tensor: float32 to its
    last bits (generate.py), bf16 (as on a CPU with native bf16) to bf16's rounding."""
    data = (GOLDEN / f"{name}.bin").read_bytes()
    chunk = parse_chunk(data, transforms=generate.transforms())
    layers, _, heads, tokens, dim = chunk.shape
    out = torch.empty(chunk.shape)
    quantized.decode_into(chunk.body.quant, out.view(layers * 2 * heads, tokens, dim).numpy())
    inverse_(chunk.body, out, bf16)
    expected = np.frombuffer((GOLDEN / f"{name}.out").read_bytes(), dtype="<f4")
    _assert_inverse_close(out.numpy().reshape(-1), expected, bf16)


def _assert_inverse_close(got: np.ndarray, expected: np.ndarray, bf16: bool) -> None:
    if not bf16:
        np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5)
        return
    # bf16 keeps 8 significant bits of the coefficients, the basis and the product (float32 sums)
    err = np.abs(got - expected)
    assert err.max() <= 2**-6 * np.abs(expected).max()
    assert np.linalg.norm(err) <= 2**-7 * np.linalg.norm(expected)
    assert err.max() > 0  # it did round: this is not the float32 path


def test_transform_goldens_hold_both_sink_cases() -> None:
    """At position 0 the sinks are exact tokens; at 300 none are, and RoPE turns far angles."""
    t = generate.transforms()
    sinks = decode_chunk((GOLDEN / "transform_sinks.bin").read_bytes(), t)
    far = decode_chunk((GOLDEN / "transform_far.bin").read_bytes(), t)
    kv = generate.golden_kv()
    assert torch.equal(sinks[:, :, :, :4], kv[:, :, :, :4].half().float())
    assert not torch.equal(far[:, :, :, :4], kv[:, :, :, :4].half().float())
    for out in (sinks, far):
        assert (out - kv).norm() < 0.01 * kv.norm()  # steps of 0.05-0.2 against a spread of +-7


def test_salient_goldens_name_their_tokens_and_code_them_finer() -> None:
    """Scheme 5: per layer, ceil(0.2 x coded tokens) salient tokens, none of them exact, and at
    a quarter of the step they decode closer to the input than scheme 4's chunk of the same KV."""
    t = generate.transforms()
    kv = generate.golden_kv()
    for name, exact in (("salient_sinks", 4), ("salient_far", 0)):
        data = (GOLDEN / f"{name}.bin").read_bytes()
        chunk = parse_chunk(data, transforms=t)
        assert read_header(data).scheme == 5 and chunk.body.salient_ratio == 0.25
        layer, token = chunk.body.salient_rows
        coded = generate.SHAPE[3] - exact
        assert np.array_equal(np.bincount(layer, minlength=2), [-(-coded // 5)] * 2)
        assert token.min() >= exact
        out = decode_chunk(data, t, inverse_bf16=False)  # bf16's rounding would hide the steps
        plain_data = (GOLDEN / f"{name.replace('salient', 'transform')}.bin").read_bytes()
        plain = decode_chunk(plain_data, t, inverse_bf16=False)
        for lay, tok in zip(layer, token, strict=True):
            err = (out[lay, :, :, tok] - kv[lay, :, :, tok]).norm()
            assert err < (plain[lay, :, :, tok] - kv[lay, :, :, tok]).norm()


def test_old_goldens_are_there_and_say_their_version() -> None:
    assert len(OLD) >= 6
    for name in OLD:
        version = int(name.split("/")[0][1:])
        assert read_header((GOLDEN / f"{name}.bin").read_bytes()).version == version


def test_current_goldens_are_this_format_version() -> None:
    for name in NAMES:
        assert read_header((GOLDEN / f"{name}.bin").read_bytes()).version == FORMAT_VERSION


@pytest.mark.parametrize("name", NAMES)
def test_golden_chunk_is_what_this_encoder_writes(name: str) -> None:
    """Encoder determinism: a change here means the format changed (bump FORMAT_VERSION, regenerate)."""
    level = generate.golden_levels()[name]
    data = encode_chunk(generate.golden_input(name), level, position=generate.POSITIONS.get(name, 0))
    assert data == (GOLDEN / f"{name}.bin").read_bytes()


def test_golden_headers() -> None:
    header = read_header((GOLDEN / "quant_rms_g4.bin").read_bytes())
    assert header.shape == generate.SHAPE and header.scheme == 2


def test_probability_bank_is_pinned() -> None:
    assert bank().digest() == BANK_DIGEST


def test_golden_int8_header() -> None:
    header = read_header((GOLDEN / "int8.bin").read_bytes())
    assert header.shape == generate.SHAPE and header.scheme == 3 and header.dtype == 0
