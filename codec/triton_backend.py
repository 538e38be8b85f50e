"""The GPU backend: a parsed batch into a tensor slice on the device, in Triton.

The host side lays the batch out for the kernels (codec/triton_kernels.py):
the words of every stream in one array, per stream a descriptor (its words,
its channels, where its first value goes in the output), per channel the
table index, centre and step, and the probability bank's tables once per
device. Then one launch decodes every scheme-2 stream of the batch, one
writes the int8 chunks and one the exact tokens; lossless chunks, already
decompressed by the parse, are copied. Only the status of the streams comes
back to the host, so the call waits for the kernels. Scheme-4 chunks decode
their coefficients the same way, into float32 (the output itself, or a
scratch when the output is narrower), and the transform's inverse then runs
in torch on the device, chunk by chunk (``codec.transformed.inverse_``).

Nothing here asks the CUDA driver anything: under ``TRITON_INTERPRET=1`` the
same kernels run on CPU tensors, which is how the tests check them.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import triton

from codec.backends import check_out
from codec.entropy_model import bank
from codec.errors import StreamError
from codec.int8 import Int8Body
from codec.parsed import DenseBody, ParsedBatch
from codec.quantized import QuantBody
from codec.transformed import TransformBody, inverse_
from codec.triton_kernels import ROW_FIELDS, STREAM_FIELDS, dense_rows, rans_dequant

STREAMS_PER_PROGRAM = 128  # one lane per stream, 4 warps
ROWS_PER_PROGRAM = 32


@dataclass(frozen=True)
class DeviceBatch:
    """What the kernels read, on the output's device, laid out for one output's strides."""

    strides: tuple[int, ...]
    streams: int
    words: torch.Tensor  # uint16
    stream_desc: torch.Tensor  # int64 (streams, STREAM_FIELDS)
    chan_fc: torch.Tensor  # int32
    chan_step: torch.Tensor  # float32
    stream_chunk: np.ndarray  # the batch position of each stream's chunk, for the error
    int8_codes: torch.Tensor
    int8_scales: torch.Tensor
    int8_desc: torch.Tensor  # int64 (int8 chunks, ROW_FIELDS)
    exact_values: torch.Tensor  # float32
    exact_desc: torch.Tensor  # int64 (scheme-2 chunks with exact tokens, ROW_FIELDS)
    dense: list[tuple[int, torch.Tensor]]  # (first token, values on the device)
    max_rows: tuple[int, int]  # int8, exact


class TritonBackend:
    """``streams_per_program``: lanes of a rANS program, a power of two (the interpreter, which
    pays per operation rather than per lane, is fastest with one program for everything)."""

    def __init__(self, streams_per_program: int = STREAMS_PER_PROGRAM) -> None:
        self.streams_per_program = streams_per_program
        self._tables: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}

    def tables(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """The bank's slot -> symbol table and its freq/cum table, once per device."""
        if device not in self._tables:
            b = bank()
            freq_cum = (b.cum.astype(np.int64) << 16 | b.freq).astype(np.int32)
            self._tables[device] = (
                torch.from_numpy(b.slot_symbol.reshape(-1)).to(device),
                torch.from_numpy(freq_cum.reshape(-1)).to(device),
            )
        return self._tables[device]

    def decode_into(self, batch: ParsedBatch, out: torch.Tensor) -> None:
        check_out(batch, out)
        pairs = zip(batch.chunks, batch.starts, strict=True)
        coded = [(chunk, start) for chunk, start in pairs if isinstance(chunk.body, TransformBody)]
        if not coded:
            self.launch(upload(batch, out), out)
            return
        target = out if out.dtype == torch.float32 else torch.empty(batch.shape, device=out.device)
        self.launch(upload(batch, target), target)
        for chunk, start in coded:
            assert isinstance(chunk.body, TransformBody)
            inverse_(chunk.body, target[:, :, :, start : start + chunk.tokens])
        if target is not out:
            out.copy_(target)

    def launch(self, dev: DeviceBatch, out: torch.Tensor) -> None:
        """Decode an uploaded batch into ``out``; waits for the streams' status."""
        if out.stride() != dev.strides:
            raise ValueError("the batch was uploaded for an output of other strides")
        for start, values in dev.dense:
            out[:, :, :, start : start + values.shape[3]].copy_(values)
        head_dim = out.shape[4]
        for src, scales, desc, rows, has_scale in (
            (dev.int8_codes, dev.int8_scales, dev.int8_desc, dev.max_rows[0], True),
            (dev.exact_values, dev.exact_values, dev.exact_desc, dev.max_rows[1], False),
        ):
            if rows:
                dense_rows[(triton.cdiv(rows, ROWS_PER_PROGRAM), desc.shape[0])](
                    src,
                    scales,
                    desc,
                    out,
                    *dev.strides,
                    head_dim,
                    HAS_SCALE=has_scale,
                    BLOCK_R=ROWS_PER_PROGRAM,
                    BLOCK_D=triton.next_power_of_2(head_dim),
                    enable_fp_fusion=False,
                )
        if not dev.streams:
            return
        slot_symbol, freq_cum = self.tables(out.device)
        status = torch.zeros(dev.streams, dtype=torch.int32, device=out.device)
        rans_dequant[(triton.cdiv(dev.streams, self.streams_per_program),)](
            dev.words,
            dev.stream_desc,
            dev.chan_fc,
            dev.chan_step,
            slot_symbol,
            freq_cum,
            out,
            status,
            dev.streams,
            dev.strides[3],
            dev.strides[4],
            BLOCK=self.streams_per_program,
            enable_fp_fusion=False,  # no add follows the multiply anyway: the SASS has no FFMA
        )
        codes = status.cpu().numpy()
        bad = np.flatnonzero(codes)
        if bad.size:
            s = int(bad[0])
            raise StreamError(
                f"{bad.size} corrupt entropy-coded streams (first: stream {s}, error {int(codes[s])})",
                int(dev.stream_chunk[s]),
            )


def _row_offsets(rows: np.ndarray, heads: int, strides: tuple[int, ...]) -> np.ndarray:
    """Output offset of row (layer, k/v, head) = ``rows``, token 0, channel 0."""
    return (rows // (2 * heads)) * strides[0] + (rows // heads % 2) * strides[1] + (rows % heads) * strides[2]


def upload(batch: ParsedBatch, out: torch.Tensor) -> DeviceBatch:
    """Lay ``batch`` out for the kernels and copy it to ``out``'s device."""
    strides = tuple(out.stride())
    device = out.device
    layers, _, heads, _, dim = batch.shape
    words, descs, fcs, steps, owners = [], [], [], [], []
    int8_codes, int8_scales, int8_desc = [], [], []
    exact_values, exact_desc = [], []
    dense = []
    n_words = n_chans = n_codes = n_scales = n_exact = 0
    for k, (chunk, start) in enumerate(zip(batch.chunks, batch.starts, strict=True)):
        body = chunk.body
        tokens = chunk.tokens
        if isinstance(body, DenseBody):
            dense.append((start, body.values.to(device)))
        elif isinstance(body, Int8Body):
            rows = layers * 2 * heads * tokens
            int8_desc.append((rows, heads, tokens, n_codes, n_scales, start * strides[3]))
            int8_codes.append(body.codes)
            int8_scales.append(body.scales)
            n_codes += body.codes.size
            n_scales += body.scales.size
        else:
            if isinstance(body, TransformBody):  # its coefficients decode as a scheme-2 body's values
                body = body.quant
            assert isinstance(body, QuantBody)
            e = body.exact_tokens
            if e:
                exact_desc.append((layers * 2 * heads * e, heads, e, n_exact, 0, start * strides[3]))
                exact_values.append(body.exact.reshape(-1).astype(np.float32))
                n_exact += body.exact.size
            cps = dim // body.groups
            s = np.arange(body.streams, dtype=np.int64)
            desc = np.empty((body.streams, STREAM_FIELDS), dtype=np.int64)
            desc[:, 0] = n_words + body.offsets[:-1]
            desc[:, 1] = n_words + body.offsets[1:]
            desc[:, 2] = n_chans + s * cps
            desc[:, 3] = (
                _row_offsets(s // body.groups, heads, strides)
                + (start + e) * strides[3]
                + (s % body.groups) * cps * strides[4]
            )
            desc[:, 4] = tokens - e
            desc[:, 5] = cps
            descs.append(desc)
            words.append(body.words)
            fcs.append(body.center.astype(np.int32) * 256 + body.family)
            steps.append(body.step)
            owners.append(np.full(body.streams, k, dtype=np.int64))
            n_words += body.words.size
            n_chans += body.family.size

    return DeviceBatch(
        strides=strides,
        streams=sum(d.shape[0] for d in descs),
        words=_to(device, words, np.uint16),
        stream_desc=_to(device, descs, np.int64).reshape(-1, STREAM_FIELDS),
        chan_fc=_to(device, fcs, np.int32),
        chan_step=_to(device, steps, np.float32),
        stream_chunk=np.concatenate(owners) if owners else np.zeros(0, dtype=np.int64),
        int8_codes=_to(device, int8_codes, np.int8),
        int8_scales=_to(device, int8_scales, np.float32),
        int8_desc=_rows(device, int8_desc),
        exact_values=_to(device, exact_values, np.float32),
        exact_desc=_rows(device, exact_desc),
        dense=dense,
        max_rows=(max((d[0] for d in int8_desc), default=0), max((d[0] for d in exact_desc), default=0)),
    )


def _to(device: torch.device, parts: list[np.ndarray], dtype: type) -> torch.Tensor:
    whole = np.concatenate(parts) if parts else np.zeros(0, dtype=dtype)
    return torch.from_numpy(np.ascontiguousarray(whole, dtype=dtype)).to(device)


def _rows(device: torch.device, desc: list[tuple[int, ...]]) -> torch.Tensor:
    return torch.tensor(desc, dtype=torch.int64).reshape(-1, ROW_FIELDS).to(device)
