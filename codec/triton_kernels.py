"""Triton kernels of the GPU decoder: rANS + dequantization fused, and dense rows.

Imported only by ``codec.triton_backend``, and only when a Triton backend is
made: ``triton.jit`` decides at import whether a kernel is compiled or run by
Triton's interpreter (``TRITON_INTERPRET=1``, set before Triton is imported).

``rans_dequant`` runs one lane per stream, ``BLOCK`` streams per program, all
streams of a batch of chunks in one launch. Each lane keeps its own state and
word position; the lanes of a program step through their symbols together,
masked once a lane is done or has failed. Per symbol a lane does three table
gathers (slot -> symbol, symbol -> freq and cum packed in one int32, and the
channel's table index, centre and step) and at most one 16-bit word load; an
escape's two raw bytes are decoded under a mask. Every load is masked to the
tensors the host built, so a forged stream never reads out of bounds: it ends
with a nonzero status, which the backend turns into ``StreamError``.

The arithmetic is the reference's (codec/rans.py) in uint32: the state stays
below 2^32 (``freq < 2^14``, ``x >> 14 < 2^18``). A value is
``float32(int32(centre + r)) * step``, one float32 multiply with no add after
it (so nothing for the compiler to contract into an FMA), rounded once to the
output's dtype (to nearest even, ``_to_out``).
"""

from __future__ import annotations

import triton
import triton.language as tl

PROB_BITS = tl.constexpr(14)
PROB_SCALE = tl.constexpr(1 << 14)
STATE_LOW = tl.constexpr(1 << 16)
ALPHABET = tl.constexpr(256)
ESCAPE = tl.constexpr(255)
BIAS = tl.constexpr(127)
BYTE_SHIFT = tl.constexpr(6)  # PROB_BITS - 8: an escape byte is a uniform symbol of 2^6 slots
ERR_OVERRUN = tl.constexpr(1)
ERR_LENGTH = tl.constexpr(2)
ERR_STATE = tl.constexpr(3)
STREAM_FIELDS = 6  # per stream: first word, end word, first channel, output offset, tokens, channels
ROW_FIELDS = 6  # per chunk: rows, heads, tokens, first source value, first scale, output offset
_STREAM_FIELDS = tl.constexpr(STREAM_FIELDS)
_ROW_FIELDS = tl.constexpr(ROW_FIELDS)


@triton.jit
def _to_out(value, dtype: tl.constexpr):
    """float32 -> the output's dtype, rounding to nearest even as torch's casts do.

    For bfloat16 the rounding is written out: Triton's interpreter truncates that
    cast (the GPU rounds), and the tests run the interpreter. Values are never NaN
    (the parse rejects NaN exact tokens), where this and torch would differ.
    """
    if dtype == tl.bfloat16:
        b = value.to(tl.uint32, bitcast=True)
        b = b + 0x7FFF + ((b >> 16) & 1)
        return (b >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)
    else:
        return value.to(dtype)


@triton.jit
def _refill(x, pos, err, lanes, end, words_ptr):
    """Renormalise the state of ``lanes``: a lane below ``STATE_LOW`` takes its stream's next
    16-bit word; one whose stream has no word left fails with ``ERR_OVERRUN``."""
    need = lanes & (x < STATE_LOW)
    take = need & (pos < end)
    word = tl.load(words_ptr + pos, mask=take, other=0).to(tl.uint32)
    x = tl.where(take, (x << 16) | word, x)
    pos = tl.where(take, pos + 1, pos)
    err = tl.where(need & ~take, ERR_OVERRUN, err)
    return x, pos, err


@triton.jit
def rans_dequant(
    words_ptr,  # uint16: the words of every stream of the batch
    desc_ptr,  # int64 (streams, STREAM_FIELDS)
    chan_fc_ptr,  # int32 per channel: centre * 256 + table index
    chan_step_ptr,  # float32 per channel
    slot_symbol_ptr,  # uint8 (tables, PROB_SCALE)
    freq_cum_ptr,  # int32 (tables, ALPHABET): cum << 16 | freq
    out_ptr,  # the output, in the model's dtype
    status_ptr,  # int32 per stream
    n_streams,
    stride_t,  # elements between tokens of the output
    stride_d,  # elements between channels of the output
    BLOCK: tl.constexpr,
):
    lane = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    live = lane < n_streams
    desc = desc_ptr + lane.to(tl.int64) * _STREAM_FIELDS
    pos = tl.load(desc, mask=live, other=0)
    end = tl.load(desc + 1, mask=live, other=0)
    chan = tl.load(desc + 2, mask=live, other=0)
    dst = tl.load(desc + 3, mask=live, other=0)
    tokens = tl.load(desc + 4, mask=live, other=0).to(tl.int32)
    cps = tl.load(desc + 5, mask=live, other=1).to(tl.int32)
    # the parse guarantees two words per stream: the final state, low half first
    lo = tl.load(words_ptr + pos, mask=live, other=0).to(tl.uint32)
    hi = tl.load(words_ptr + pos + 1, mask=live, other=0).to(tl.uint32)
    x = lo | (hi << 16)
    pos += 2
    n_symbols = tokens * cps
    err = tl.zeros([BLOCK], dtype=tl.int32)
    c = tl.zeros([BLOCK], dtype=tl.int32)
    for i in range(tl.max(n_symbols, axis=0)):
        act = live & (i < n_symbols) & (err == 0)
        fc = tl.load(chan_fc_ptr + chan + c, mask=act, other=0)
        step = tl.load(chan_step_ptr + chan + c, mask=act, other=0.0)
        table = (fc & 255).to(tl.int64)
        slot = x & (PROB_SCALE - 1)
        sym = tl.load(slot_symbol_ptr + table * PROB_SCALE + slot.to(tl.int64), mask=act, other=0).to(
            tl.int32
        )
        freq_cum = tl.load(freq_cum_ptr + table * ALPHABET + sym, mask=act, other=1)
        freq = (freq_cum & 0xFFFF).to(tl.uint32)
        cum = (freq_cum >> 16).to(tl.uint32)
        x = tl.where(act, freq * (x >> PROB_BITS) + slot - cum, x)
        x, pos, err = _refill(x, pos, err, act, end, words_ptr)
        esc = act & (err == 0) & (sym == ESCAPE)
        raw = tl.zeros([BLOCK], dtype=tl.int32)
        for _ in tl.static_range(2):  # the residual as int16, high byte first, uniform bytes
            slot = x & (PROB_SCALE - 1)
            byte = slot >> BYTE_SHIFT
            x = tl.where(esc, (x >> PROB_BITS) * 64 + slot - byte * 64, x)
            x, pos, err = _refill(x, pos, err, esc, end, words_ptr)
            raw = (raw << 8) | byte.to(tl.int32)
        residual = tl.where(sym == ESCAPE, raw - tl.where(raw >= 32768, 65536, 0), sym - BIAS)
        value = (fc >> 8) + residual  # the centre: an arithmetic shift keeps its sign
        value = value.to(tl.float32) * step
        tl.store(
            out_ptr + dst + c * stride_d, _to_out(value, out_ptr.dtype.element_ty), mask=act & (err == 0)
        )
        c += 1
        wrap = c == cps
        c = tl.where(wrap, 0, c)
        dst = tl.where(wrap, dst + stride_t, dst)
    ok = live & (err == 0)
    err = tl.where(ok & (pos != end), ERR_LENGTH, err)
    err = tl.where(ok & (pos == end) & (x != STATE_LOW), ERR_STATE, err)
    tl.store(status_ptr + lane, err, mask=live)


@triton.jit
def dense_rows(
    src_ptr,  # int8 codes or float32 values, rows of ``head_dim``
    scale_ptr,  # float32 per (layer, k/v, token), read if HAS_SCALE
    desc_ptr,  # int64 (chunks, ROW_FIELDS)
    out_ptr,
    stride_l,
    stride_kv,
    stride_h,
    stride_t,
    stride_d,
    head_dim,
    HAS_SCALE: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """Rows (layer, k/v, head, token) of ``head_dim`` values: int8 codes times their token's scale
    (scheme 3), or float32 values as they are (scheme 2's exact tokens)."""
    desc = desc_ptr + tl.program_id(1) * _ROW_FIELDS
    n_rows = tl.load(desc)
    heads = tl.load(desc + 1)
    tokens = tl.load(desc + 2)
    src = tl.load(desc + 3)
    scale = tl.load(desc + 4)
    base = tl.load(desc + 5)
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R).to(tl.int64)
    rows = r < n_rows
    t = r % tokens
    h = (r // tokens) % heads
    lkv = r // (tokens * heads)
    dst = base + (lkv // 2) * stride_l + (lkv % 2) * stride_kv + h * stride_h + t * stride_t
    d = tl.arange(0, BLOCK_D)
    mask = rows[:, None] & (d < head_dim)[None, :]
    value = tl.load(src_ptr + src + r[:, None] * head_dim + d[None, :], mask=mask, other=0).to(tl.float32)
    if HAS_SCALE:
        value = value * tl.load(scale_ptr + scale + lkv * tokens + t, mask=rows, other=0.0)[:, None]
    tl.store(
        out_ptr + dst[:, None] + d[None, :] * stride_d, _to_out(value, out_ptr.dtype.element_ty), mask=mask
    )
