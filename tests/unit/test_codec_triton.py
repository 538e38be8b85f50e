"""The Triton decoder matches the CPU decoder bit for bit, run by Triton's interpreter (no GPU here).

``triton.jit`` decides when a kernel is defined whether it is compiled or
interpreted, from ``TRITON_INTERPRET`` as it is when Triton is first imported.
This module sets it before importing Triton when it can (run alone, or
first); a process that already imported Triton compiled (the full unit suite
does, through transformers) and has no GPU runs this module and
``test_codec_triton_faults.py`` again in a child process with
``TRITON_INTERPRET=1`` (``test_in_a_fresh_process``). With a GPU the same
tests run compiled, on CUDA tensors. Shapes are small: the interpreter pays
milliseconds per operation of a kernel's loop.
"""

from __future__ import annotations

from dataclasses import replace

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

if "triton" not in sys.modules and not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"
triton = pytest.importorskip("triton")

from codec import (
    Level,
    NumbaBackend,
    Scheme,
    decode_chunk,
    decode_into,
    encode_chunk,
    load_level_table,
    parse_chunks,
)
from codec.backends import backend_for
from codec.container import read_header
from codec.levels import BASELINES_TABLE_FILE, shipped_level_table
from codec.quantized import QuantParams
from codec.transform import fit_transform
from codec.transformed import TransformParams

INTERPRETED = bool(triton.knobs.runtime.interpret)
RUNS_HERE = INTERPRETED or torch.cuda.is_available()
DEVICE = "cpu" if INTERPRETED else "cuda"
ROOT = Path(__file__).resolve().parents[2]
GOLDEN = ROOT / "tests" / "fixtures" / "golden"
in_process = pytest.mark.skipif(not RUNS_HERE, reason="Triton is compiled here and there is no GPU")

# Every level there is: the default model's table, its baselines (fp16, int8) and zstd.
LEVELS = {lv.name: lv for lv in load_level_table(shipped_level_table(BASELINES_TABLE_FILE))}
LEVELS["zstd"] = Level("zstd", Scheme.ZSTD)
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


@pytest.mark.skipif(RUNS_HERE, reason="the checks run in this process")
@pytest.mark.skipif(os.environ.get("CACHEGEN_TRITON_CHILD") == "1", reason="already the child")
def test_in_a_fresh_process() -> None:
    env = dict(os.environ, TRITON_INTERPRET="1", CACHEGEN_TRITON_CHILD="1")
    files = [__file__, str(Path(__file__).with_name("test_codec_triton_faults.py"))]
    cmd = [sys.executable, "-m", "pytest", *files, "-q", "-x", "-p", "no:cacheprovider"]
    done = subprocess.run(cmd, check=False, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    assert " passed" in done.stdout


def backend(streams_per_program: int = 1024):
    """One program for every stream under the interpreter (it pays per operation, not per lane)."""
    from codec.triton_backend import TritonBackend

    return TritonBackend(streams_per_program if INTERPRETED else 128)


def kv(tokens: int, seed: int = 0, layers: int = 30, heads: int = 3, dim: int = 64) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(layers, 2, heads, tokens, dim, generator=g)
    x[:, 0] *= torch.linspace(0.2, 6.0, dim)
    x[:, 0, :, 0] *= 30.0  # an attention-sink-like first token
    x[0, 1, 0, -1, 1] = 900.0  # an outlier: an escape
    return x


def bits(t: torch.Tensor) -> torch.Tensor:
    """Integer view, so -0.0 and 0.0 (and NaN payloads) count as different."""
    return t.contiguous().view({4: torch.int32, 2: torch.int16}[t.element_size()])


def check_batch(chunks: list[bytes], dtype: torch.dtype, pad: int = 3, be=None, transforms=None) -> None:
    """Decode into the middle of a bigger buffer: the CPU decoder's values cast to ``dtype``,
    and nothing else of the buffer written."""
    batch = parse_chunks(chunks, transforms)
    layers, _, heads, tokens, dim = batch.shape
    buffer = torch.full((layers, 2, heads, tokens + 2 * pad, dim), -7.0, dtype=dtype, device=DEVICE)
    decode_into(batch, buffer[:, :, :, pad : pad + tokens], be or backend())
    expected = torch.cat([decode_chunk(c, transforms).to(dtype) for c in chunks], dim=3)
    got = buffer.cpu()
    assert torch.equal(bits(got[:, :, :, pad : pad + tokens]), bits(expected))
    assert (got[:, :, :, :pad] == -7).all() and (got[:, :, :, pad + tokens :] == -7).all()


@in_process
@pytest.mark.parametrize("dtype", DTYPES)
def test_a_batch_of_every_level_matches_the_cpu_decoder(dtype: torch.dtype) -> None:
    names = ["high", "lossless", "medium", "int8", "low", "fp16", "zstd"]
    tokens = [3, 2, 4, 3, 1, 2, 3]
    check_batch(
        [encode_chunk(kv(t, seed=i), LEVELS[n]) for i, (n, t) in enumerate(zip(names, tokens))], dtype
    )


def model_kv() -> torch.Tensor:
    """The default model's KV of the first 4 tokens of a text (tests/fixtures/golden/generate.py)."""
    return decode_chunk((GOLDEN / "model_kv.bin").read_bytes()).float()


@in_process
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_real_model_kv_at_every_level(dtype: torch.dtype) -> None:
    real = model_kv()
    levels = ["high", "medium", "low", "int8", "fp16", "lossless", "zstd"]
    check_batch([encode_chunk(real, LEVELS[n]) for n in levels], dtype)


@in_process
def test_golden_chunks_of_every_format_in_one_batch() -> None:
    """Formats 3, 4 and 5, schemes 4 and 5 (transform, salient tokens) among them, in one launch."""
    files = sorted(GOLDEN.glob("*.bin")) + sorted(GOLDEN.glob("v4/*.bin")) + sorted(GOLDEN.glob("v3/*.bin"))
    chunks = [f.read_bytes() for f in files if f.name != "model_kv.bin"]
    assert len(chunks) >= 24 and [sum(read_header(c).scheme == s for c in chunks) for s in (4, 5)] == [2, 2]
    check_batch(chunks, torch.float32, transforms=golden_transforms())


def golden_transforms() -> dict:
    from codec.transform import load_transform

    t = load_transform(GOLDEN / "transform.safetensors")
    return {t.id: t}


def transform_level(layers: int, heads: int, dim: int, groups: int, sinks: int) -> Level:
    """A transform fitted on random correlated KV of this shape, keys coded before RoPE."""
    g = torch.Generator().manual_seed(heads * dim)
    c = heads * dim
    mixed = torch.randn(layers, 2, 64, c, generator=g) @ torch.randn(layers, 2, c, c, generator=g)
    x = mixed.reshape(layers, 2, 64, heads, dim).permute(0, 1, 3, 2, 4)
    inv_freq = (1.0 / 10000 ** (np.arange(0, dim, 2) / dim)).astype(np.float32)
    t = fit_transform(x, np.ones((layers, heads, dim)), inv_freq=inv_freq, skip_tokens=0)
    return Level(
        "t", Scheme.TRANSFORM, False, TransformParams(t, (0.5,), (0.3,), sink_tokens=sinks, groups=groups)
    )


@in_process
@pytest.mark.parametrize(
    ("heads", "dim", "groups", "sinks", "tokens"),
    [
        (1, 128, 2, 1, 3),  # head_dim 128, one KV head
        (5, 16, 1, 0, 4),  # another GQA head count, one stream per head, no sink
        (2, 32, 8, 3, 5),  # more, shorter streams; several sinks
        (3, 16, 16, 2, 1),  # one token, a sink at position 0: nothing coded
    ],
)
def test_transform_chunks_mixed_with_format4_schemes(
    heads: int, dim: int, groups: int, sinks: int, tokens: int
) -> None:
    """Scheme-4 and scheme-5 chunks at a context's start and far into it, beside scheme-2 and int8
    chunks: the integers decode bit for bit alike, and the salient tokens' scaling and the inverse
    transform are the same torch code."""
    level = transform_level(2, heads, dim, groups, sinks)
    assert isinstance(level.quant, TransformParams)
    salient = Level("s", Scheme.SALIENT, False, replace(level.quant, salient_fraction=0.3, salient_step=0.5))
    transforms = {level.quant.transform.id: level.quant.transform}
    chunks = [
        encode_chunk(kv(tokens, 1, 2, heads, dim), level, position=0),
        encode_chunk(kv(tokens + 2, 2, 2, heads, dim), quant(groups, 1)),
        encode_chunk(kv(tokens, 3, 2, heads, dim), level, position=5000),
        encode_chunk(kv(tokens + 1, 5, 2, heads, dim), salient, position=0),
        encode_chunk(kv(2, 4, 2, heads, dim), LEVELS["int8"]),
        encode_chunk(kv(tokens, 6, 2, heads, dim), salient, position=700),
    ]
    for dtype in (torch.float32, torch.bfloat16):
        check_batch(chunks, dtype, pad=1, transforms=transforms)


def quant(groups: int, exact: int) -> Level:
    return Level(
        "q",
        Scheme.QUANT,
        False,
        QuantParams(key_step=(0.4,), value_step=(0.3,), exact_tokens=exact, groups=groups),
    )


@in_process
@pytest.mark.parametrize(
    ("heads", "dim", "groups", "exact", "tokens"),
    [
        (1, 128, 2, 1, 3),  # head_dim 128
        (5, 16, 1, 0, 4),  # another GQA head count, one stream per head, no exact token
        (2, 32, 8, 3, 5),  # more, shorter streams; several exact tokens
        (4, 8, 4, 1, 1),  # one token: only the exact one, streams of just a final state
        (3, 16, 16, 0, 1),  # one coded token, one channel per stream
    ],
)
def test_odd_shapes(heads: int, dim: int, groups: int, exact: int, tokens: int) -> None:
    x = kv(tokens, layers=2, heads=heads, dim=dim)
    chunks = [encode_chunk(x, quant(groups, exact)), encode_chunk(kv(2, 1, 2, heads, dim), LEVELS["int8"])]
    check_batch(chunks, torch.bfloat16, pad=1)


@in_process
def test_many_programs_and_a_ragged_last_one() -> None:
    """Streams of different lengths over several programs of 16 lanes (9 tokens; 1, 2 and 8 groups)."""
    chunks = [encode_chunk(kv(9, s, 2, 3, 8), quant(g, 1)) for s, g in ((0, 2), (1, 8), (2, 1))]
    check_batch(chunks, torch.float16, be=backend(16))


@in_process
def test_exact_tokens_beyond_float16_are_written_exactly() -> None:
    x = kv(3)
    x[4, 0, 2, 0, 9] = 1e6  # format 4 stores it as float32
    check_batch([encode_chunk(x, LEVELS["medium"])], torch.float32)
    check_batch([encode_chunk(x, LEVELS["medium"])], torch.bfloat16)


@in_process
@pytest.mark.filterwarnings("ignore:overflow encountered in cast")
def test_a_cast_out_of_range_is_the_cast_of_the_cpu_value() -> None:
    """A float16 cache cannot hold 1e6: the backend writes what ``decode_chunk(...).half()`` gives (inf)."""
    x = kv(2)
    x[4, 0, 2, 0, 9] = 1e6
    check_batch([encode_chunk(x, LEVELS["medium"])], torch.float16)


def test_cuda_outputs_get_triton_and_cpu_outputs_numba() -> None:
    from codec.triton_backend import TritonBackend

    assert isinstance(backend_for(torch.device("cuda")), TritonBackend)  # no driver is asked
    assert isinstance(backend_for(torch.device("cpu")), NumbaBackend)


@in_process
def test_non_mergeable_output_strides() -> None:
    """An output whose (layer, k/v, head) axes do not merge (heads sliced out of a bigger buffer)."""
    chunks = [encode_chunk(kv(3, 0, 2, 2, 16), quant(2, 1)), encode_chunk(kv(2, 1, 2, 2, 16), LEVELS["int8"])]
    batch = parse_chunks(chunks)
    big = torch.zeros(2, 2, 5, 9, 16, dtype=torch.float32, device=DEVICE)
    out = big[:, :, 1:3, 2:7]
    decode_into(batch, out, backend())
    ref = torch.zeros(2, 2, 5, 9, 16)
    decode_into(batch, ref[:, :, 1:3, 2:7], NumbaBackend())
    assert torch.equal(bits(big.cpu()), bits(ref))
    assert np.count_nonzero(big.cpu().numpy()) > 0
