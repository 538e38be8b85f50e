"""Committed chunks decode to their committed tensors, bit for bit; the model bank is pinned."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pytest
import torch

from codec import FORMAT_VERSION, decode_chunk, encode_chunk
from codec.container import read_header
from codec.entropy_model import BANK_DIGEST, bank

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
    if read_header(data).scheme == 4:  # the inverse transform is a float32 matmul (generate.py)
        np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5)
    else:
        assert np.array_equal(got, expected)


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
