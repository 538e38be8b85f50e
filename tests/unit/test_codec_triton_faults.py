"""Corrupt chunks and the Triton decoder: rejected before any launch, or after it without a stray read.

Runs in the process or the child of ``test_codec_triton.py`` (see its
docstring for why). Which memory the kernels read is checked under the
interpreter, by watching every load it makes; the SASS check compiles the
kernel for an H100/H200 (sm_90) without a GPU.
"""

from __future__ import annotations

import os
import struct
import subprocess
import sys
import tempfile
import zlib
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch

if "triton" not in sys.modules and not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"
triton = pytest.importorskip("triton")

from codec import CodecError, Level, Scheme, StreamError, decode_chunks_into, encode_chunk, parse_chunks
from codec.container import HEADER_SIZE
from codec.quantized import QuantParams

INTERPRETED = bool(triton.knobs.runtime.interpret)
RUNS_HERE = INTERPRETED or torch.cuda.is_available()
DEVICE = "cpu" if INTERPRETED else "cuda"
in_process = pytest.mark.skipif(not RUNS_HERE, reason="Triton is compiled here and there is no GPU")
QUANT = Level("q", Scheme.QUANT, False, QuantParams(key_step=(0.4,), value_step=(0.3,)))
INT8 = Level("int8", Scheme.INT8, lossless=False)


def kv(tokens: int, seed: int) -> torch.Tensor:
    return torch.randn(2, 2, 3, tokens, 16, generator=torch.Generator().manual_seed(seed))


def forge_crc(data: bytes | bytearray) -> bytes:
    body = bytes(data[:-4])
    return body + struct.pack("<I", zlib.crc32(body))


def chunks() -> list[bytes]:
    return [encode_chunk(kv(5, 0), QUANT), encode_chunk(kv(3, 1), INT8), encode_chunk(kv(6, 2), QUANT)]


def stream_table(data: bytes) -> int:
    """Offset of a scheme-2 chunk's stream table (format 4, float16 exact tokens)."""
    _, _, exact, _, side = struct.unpack_from("<BBHBI", data, HEADER_SIZE)
    layers, heads, dim = struct.unpack_from("<HHH", data, 8)
    return HEADER_SIZE + 9 + side + 2 * layers * 2 * heads * exact * dim


def backend():
    from codec.triton_backend import TritonBackend

    return TritonBackend(1024 if INTERPRETED else 128)


class Spy:
    def __init__(self, kernel) -> None:
        self.kernel = kernel
        self.launches = 0

    def __getitem__(self, grid):
        self.launches += 1
        return self.kernel[grid]


@pytest.fixture
def spies(monkeypatch: pytest.MonkeyPatch) -> list[Spy]:
    from codec import triton_backend

    found = [Spy(triton_backend.rans_dequant), Spy(triton_backend.dense_rows)]
    monkeypatch.setattr(triton_backend, "rans_dequant", found[0])
    monkeypatch.setattr(triton_backend, "dense_rows", found[1])
    return found


def _set(data: bytes, offset: int, fmt: str, value: int) -> bytes:
    bad = bytearray(data)
    struct.pack_into(fmt, bad, offset, value)
    return forge_crc(bad)


def corruptions(good: bytes) -> dict[str, bytes]:
    table = stream_table(good)
    first, second = struct.unpack_from("<II", good, table)
    flipped = bytearray(good)
    flipped[len(good) // 2] ^= 0x10
    return {
        "bit flip": bytes(flipped),
        "truncated": good[:-1],
        "groups 3 of head_dim 16": _set(good, HEADER_SIZE, "<B", 3),
        "more exact tokens than tokens": _set(good, HEADER_SIZE + 2, "<H", 9),
        "unknown exact dtype": _set(good, HEADER_SIZE + 4, "<B", 5),
        "a stream of one word": _set(_set(good, table, "<I", 1), table + 4, "<I", second + first - 1),
        "stream table longer than the words": _set(good, table, "<I", first + 1),
        "version 9": _set(good, 4, "<H", 9),
        "other layer count": _set(good, 8, "<H", 3),
    }


@in_process
def test_corrupt_chunks_are_rejected_before_any_launch(spies: list[Spy]) -> None:
    good = chunks()
    out = torch.full((2, 2, 3, 14, 16), 5.0, device=DEVICE)
    for name, bad in corruptions(good[2]).items():
        with pytest.raises(CodecError):
            decode_chunks_into([good[0], good[1], bad], out, backend())
        assert sum(s.launches for s in spies) == 0, name
        assert (out == 5).all(), name
    decode_chunks_into(good, out, backend())  # the spies do see launches
    assert spies[0].launches == 1 and spies[1].launches == 2


@dataclass
class LoadWatch:
    seen: int = 0
    stray: int = 0


@contextmanager
def loads_within(tensors: list[torch.Tensor]) -> Iterator[LoadWatch]:
    """Count the interpreter's loads, and those that touch a byte outside ``tensors``."""
    from triton.runtime.interpreter import interpreter_builder as builder

    ranges = [(t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()) for t in tensors if t.numel()]
    watch = LoadWatch()
    load = builder.create_masked_load

    def checked(ptrs, mask, other, *rest):
        addr = ptrs.data[np.broadcast_to(mask.data, ptrs.data.shape)].astype(np.uint64)
        size = ptrs.get_element_ty().primitive_bitwidth // 8
        inside = np.zeros(addr.shape, dtype=bool)
        for lo, hi in ranges:
            inside |= (addr >= lo) & (addr + size <= hi)
        watch.stray += int((~inside).sum())
        watch.seen += addr.size
        return load(ptrs, mask, other, *rest)

    builder.create_masked_load = checked
    try:
        yield watch
    finally:
        del builder.create_masked_load


def launch_checked(data: list[bytes], dev_edit=None) -> LoadWatch:
    """Upload, optionally edit the uploaded batch, launch while watching the loads; a StreamError
    is raised after the watch is checked."""
    from codec.triton_backend import upload

    be = backend()
    batch = parse_chunks(data)
    out = torch.zeros(batch.shape, device=DEVICE)
    dev = upload(batch, out)
    if dev_edit:
        dev_edit(dev)
    fields = ("words", "stream_desc", "chan_fc", "chan_step", "int8_codes", "int8_scales", "int8_desc")
    watched = [getattr(dev, f) for f in fields] + [dev.exact_values, dev.exact_desc, *be.tables(out.device)]
    error = None
    with loads_within(watched) as watch:
        try:
            be.launch(dev, out)
        except StreamError as exc:
            error = exc
    assert watch.seen > 0
    if error is not None:
        error.watch = watch  # type: ignore[attr-defined]
        raise error
    return watch


interpreted_only = pytest.mark.skipif(not INTERPRETED, reason="loads are watched under the interpreter")


@interpreted_only
def test_the_load_watch_sees_a_stray_read() -> None:
    """The watch itself: a stream whose words lie past the end (the parse never allows it) is seen."""

    def past_the_end(dev) -> None:
        dev.stream_desc[-1, 0] = dev.words.numel() + 8
        dev.stream_desc[-1, 1] = dev.words.numel() + 40

    with pytest.raises(StreamError) as info:
        launch_checked(chunks(), past_the_end)
    assert info.value.watch.stray > 0


@interpreted_only
def test_good_chunks_load_only_their_own_tensors() -> None:
    assert launch_checked(chunks()).stray == 0


def flip_last_stream(data: bytes) -> bytes:
    """A word of the last stream changed, the CRC made to match: only decoding can tell."""
    for pos in range(len(data) - 6, len(data) - 30, -1):
        bad = bytearray(data)
        bad[pos] ^= 0x5A
        try:
            from codec import decode_chunk

            decode_chunk(forge_crc(bad))
        except StreamError:
            return forge_crc(bad)
    raise AssertionError("no flip was caught")


def move_words(data: bytes) -> bytes:
    """The last stream two words shorter and the one before two longer: same total, valid CRC."""
    table = stream_table(data)
    layers, heads = struct.unpack_from("<HH", data, 8)
    streams = layers * 2 * heads * struct.unpack_from("<B", data, HEADER_SIZE)[0]
    last = table + 4 * (streams - 1)
    a, b = struct.unpack_from("<II", data, last - 4)
    return _set(_set(data, last - 4, "<I", a + 2), last, "<I", b - 2)


@in_process
@pytest.mark.parametrize("forge", [flip_last_stream, move_words])
def test_a_forged_stream_fails_after_the_launch_naming_its_chunk(forge, spies: list[Spy]) -> None:
    good = chunks()
    data = [good[0], good[1], forge(good[2])]
    parse_chunks(data)  # nothing the parse can see
    out = torch.zeros(2, 2, 3, 14, 16, device=DEVICE)
    with pytest.raises(StreamError) as info:
        decode_chunks_into(data, out, backend())
    assert info.value.chunk == 2 and spies[0].launches == 1
    from codec import decode_chunk

    before = torch.cat([decode_chunk(c) for c in good[:2]], dim=3)
    assert torch.equal(out[:, :, :, :8].cpu(), before)  # the chunks before it are right


@interpreted_only
@pytest.mark.parametrize("forge", [flip_last_stream, move_words])
def test_a_forged_stream_reads_nothing_outside_its_words(forge) -> None:
    good = chunks()
    with pytest.raises(StreamError) as info:
        launch_checked([good[0], good[1], forge(good[2])])
    assert info.value.watch.stray == 0 and info.value.chunk == 2


@pytest.mark.skipif(INTERPRETED, reason="compiles the kernel: Triton is interpreted here")
def test_the_compiled_kernel_multiplies_without_fma() -> None:
    """sm_90 SASS of the rANS kernel into bfloat16: one FMUL (centre + r times step), no FFMA."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from codec.triton_kernels import rans_dequant

    cuobjdump = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    if not cuobjdump.exists():
        pytest.skip("no cuobjdump in this Triton")
    signature = {
        "words_ptr": "*u16",
        "desc_ptr": "*i64",
        "chan_fc_ptr": "*i32",
        "chan_step_ptr": "*fp32",
        "slot_symbol_ptr": "*u8",
        "freq_cum_ptr": "*i32",
        "out_ptr": "*bf16",
        "status_ptr": "*i32",
        "n_streams": "i32",
        "stride_t": "i64",
        "stride_d": "i32",
        "BLOCK": "constexpr",
    }
    for fusion in (False, True):  # the backend turns fusion off; it would not matter here
        source = ASTSource(fn=rans_dequant, signature=signature, constexprs={"BLOCK": 128})
        kernel = triton.compile(
            source, target=GPUTarget("cuda", 90, 32), options={"enable_fp_fusion": fusion}
        )
        with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
            f.write(kernel.asm["cubin"])
            f.flush()
            sass = subprocess.run(
                [str(cuobjdump), "-sass", f.name], capture_output=True, text=True, check=True
            ).stdout
        assert sass.count("FMUL") == 1 and "FFMA" not in sass and "FADD" not in sass
