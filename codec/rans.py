"""Many-stream rANS coder (32-bit state, 16-bit words), compiled with numba.

Every stream is independent: it has its own state, its own words and its own
slice of the output. That is what lets the CPU decode them with ``prange``,
each thread four streams in lockstep (one stream's decode is a chain of
dependent table lookups; four chains keep the core busy), and what a GPU
kernel does with one thread per stream. The decoder here is the
bit-exact reference for any other implementation (see codec/BITSTREAM.md).

The coder never sees floats: it gets integer symbols and, per channel, the
index of a frequency table built by ``codec.entropy_model``. Symbols
``0..ESCAPE-1`` are residuals ``r + BIAS``; ``ESCAPE`` is followed by the
residual as an int16 coded as two uniform bytes (high byte first).

Both kernels are plain Python that numba compiles; ``kernel.py_func`` runs the
same code uncompiled, which the tests use as an independent reference.
"""

from __future__ import annotations

import numba
import numpy as np
from numba import types as nt

PROB_BITS = 14
PROB_SCALE = 1 << PROB_BITS
STATE_LOW = 1 << 16  # L: the state lives in [L, 2^32) between symbols
ALPHABET = 256
ESCAPE = 255
BIAS = 127  # residual r is coded as symbol r + BIAS when |r| <= 127
_BYTE_FREQ = PROB_SCALE // 256  # raw escape bytes are coded as uniform symbols
_BYTE_SHIFT = PROB_BITS - 8

# decode_streams status codes, per stream
OK = 0
ERR_OVERRUN = 1  # read past the end of the stream's words
ERR_LENGTH = 2  # words left over, or a stream too short for its initial state
ERR_STATE = 3  # final state is not the encoder's initial state

U = np.uint64  # an index the decoder knows is not negative: no wrap-around code (see _decode_four)


def _in(dtype, ndim: int = 1) -> nt.Array:
    """A C-contiguous input array's type; read-only, so that writable arrays convert to it too."""
    return nt.Array(dtype, ndim, "C", readonly=True)


# decode_streams' one signature, compiled (or loaded from numba's cache) at import: any caller's
# arrays convert to it (words read-only or not, ``out`` with any strides), so no first request
# compiles a variant that start-up did not. Without it, a fresh gateway's first load (writable
# bytes, into a slice of a KV buffer) compiled a second variant in the request, 7 s on a cold
# cache, after start-up had warmed the codec up on a contiguous chunk from read-only bytes.
_DECODE_STREAMS = (
    (_in(nt.uint16), _in(nt.int64), _in(nt.int32), _in(nt.int32), _in(nt.float32))
    + (_in(nt.int32, 2), _in(nt.uint8, 2), nt.int64, nt.int64, nt.int64)
    + (nt.Array(nt.float32, 3, "A"), nt.Array(nt.int32, 1, "C"))
)


@numba.njit(cache=True, inline="always")
def _put(x, start, freq, buf, pos):
    # One renormalisation step is always enough: x < 2^32 and x_max >= 2^17.
    x_max = ((STATE_LOW >> PROB_BITS) << 16) * freq
    if x >= x_max:
        buf[pos] = x & 0xFFFF
        pos -= 1
        x >>= 16
    # Integer division is the encoder's slowest step; a float64 quotient of a
    # 32-bit x is off by at most one, and the remainder check puts it right.
    q = np.int64(np.float64(x) / np.float64(freq))
    r = x - q * freq
    if r < 0:
        q -= 1
        r += freq
    elif r >= freq:
        q += 1
        r -= freq
    x = (q << PROB_BITS) + r + start
    return x, pos


@numba.njit(cache=True, parallel=True, nogil=True)
def encode_streams(symbols, escapes, channel_family, cum, freq, tokens, channels_per_stream, out, out_len):
    """Encode every stream; stream ``s`` codes channels ``s * channels_per_stream + c``.

    ``symbols[ch, t]`` is the symbol of channel ``ch`` at token ``t``;
    ``escapes[ch, t]`` is the int16 residual used when the symbol is ESCAPE.
    Words of stream ``s`` are written to ``out[s, :out_len[s]]`` in decode order.
    """
    n_streams = symbols.shape[0] // channels_per_stream
    cap = out.shape[1]
    for s in numba.prange(n_streams):
        buf = out[s]
        pos = cap - 1
        x = np.int64(STATE_LOW)
        base = s * channels_per_stream
        for t in range(tokens - 1, -1, -1):
            for c in range(channels_per_stream - 1, -1, -1):
                sym = np.int64(symbols[base + c, t])
                if sym == ESCAPE:
                    raw = np.int64(escapes[base + c, t]) & 0xFFFF
                    lo = raw & 0xFF
                    hi = raw >> 8
                    x, pos = _put(x, lo * _BYTE_FREQ, _BYTE_FREQ, buf, pos)
                    x, pos = _put(x, hi * _BYTE_FREQ, _BYTE_FREQ, buf, pos)
                f = channel_family[base + c]
                x, pos = _put(x, np.int64(cum[f, sym]), np.int64(freq[f, sym]), buf, pos)
        buf[pos] = x >> 16
        pos -= 1
        buf[pos] = x & 0xFFFF
        # Move the words to the front so streams can be concatenated in order.
        n = cap - pos
        for i in range(n):
            buf[i] = buf[pos + i]
        out_len[s] = n


@numba.njit(cache=True, inline="always")
def _get(x, words, pos, end):
    """Renormalise after a decode step; pos == -1 marks an over-read."""
    if x < STATE_LOW:
        if pos >= end:
            return x, -1
        x = (x << 16) | np.int64(words[pos])
        pos += 1
    return x, pos


@numba.njit(cache=True, inline="always")
def _escape(x, pos, end, words):
    """After an ESCAPE symbol: its int16 residual, two uniform bytes high first. Returns
    (x, pos, residual); pos -1 marks an over-read."""
    mask = PROB_SCALE - 1
    raw = 0
    for _ in range(2):
        slot = x & mask
        byte = slot >> _BYTE_SHIFT
        x = _BYTE_FREQ * (x >> PROB_BITS) + slot - byte * _BYTE_FREQ
        x, pos = _get(x, words, pos, end)
        if pos < 0:
            return x, pos, 0
        raw = (raw << 8) | byte
    return x, pos, (raw - 65536 if raw >= 32768 else raw)


@numba.njit(cache=True, inline="always")
def _next_state(x, slot, packed):
    """The state after decoding the symbol at ``slot``: ``packed`` is its table entry,
    ``freq << 16 | cum`` (``Bank.freq_cum``: one lookup where two were)."""
    packed = np.int64(packed)
    return (packed >> 16) * (x >> PROB_BITS) + slot - (packed & 0xFFFF)


@numba.njit(cache=True, inline="always")
def _start(words, pos):
    """The initial state of a stream whose words start at ``pos``."""
    return np.int64(words[pos]) | (np.int64(words[pos + 1]) << 16)


@numba.njit(cache=True, nogil=True)
def _decode_stream(words, pos, end, fams, centers, steps, freq_cum, slot_symbol, tokens, out, row, c0):
    cps = fams.shape[0]
    mask = PROB_SCALE - 1
    x = _start(words, pos)
    pos += 2
    for t in range(tokens):
        dst = out[row, t]
        for c in range(cps):
            f = fams[c]
            slot = x & mask
            sym = np.int64(slot_symbol[f, slot])
            x = _next_state(x, slot, freq_cum[f, sym])
            x, pos = _get(x, words, pos, end)
            r = sym - BIAS
            if sym == ESCAPE and pos >= 0:
                x, pos, r = _escape(x, pos, end, words)
            if pos < 0:
                return ERR_OVERRUN
            dst[c0 + c] = np.float32(np.int32(centers[c] + r)) * steps[c]
    if pos != end:
        return ERR_LENGTH
    if x != STATE_LOW:
        return ERR_STATE
    return OK


@numba.njit(cache=True, nogil=True, inline="always")
def _renorm_branchless(x, pos, end, words):
    """``x``'s renormalisation with no branch: the next word is always read (at ``end - 1`` at
    most, so never outside the stream) and only taken when ``x`` fell below ``STATE_LOW``. An
    over-read leaves ``pos`` past ``end``, which the caller's final check rejects."""
    take = np.int64(x < STATE_LOW)
    word = np.int64(words[U(min(pos, end - 1))])
    return (x << (take << 4)) | (word & -take), pos + take


@numba.njit(cache=True, nogil=True)
def dense_group(offsets, s, tokens, cps):
    """Whether streams ``s .. s+3`` take over a word per 16 symbols (1 bit a value): then
    ``_decode_four`` renormalises them without a branch (``benchmarks/rans_renorm.py``)."""
    return (offsets[s + 4] - offsets[s]) * 16 > 4 * tokens * cps


@numba.njit(cache=True, nogil=True)
def _decode_four(
    words, offsets, s, family, center, step, freq_cum, slot_symbol, tokens, cps, groups, out, branchless
):
    """Streams ``s .. s+3`` in lockstep: four independent state chains keep the core busy where one
    waits on its table lookups (1.6-1.9x a chunk on one thread; docs/codec.md, "Speed"). False if
    any of them is corrupt: the caller then decodes them one by one, for their exact status.

    ``branchless``: renormalise without a branch (``_renorm_branchless``). Dense streams take a
    word every few symbols, at random, and the branch mispredicts (``high``: 1.3x faster
    branchless); sparse ones rarely do, and the branch costs less than the unconditional read.
    The flag is the same for the whole call, so the compiler makes a loop for each."""
    for k in range(4):
        if offsets[s + k + 1] - offsets[s + k] < 2:
            return False  # too short for its initial state
    p0, p1, p2, p3 = offsets[s] + 2, offsets[s + 1] + 2, offsets[s + 2] + 2, offsets[s + 3] + 2
    e0, e1, e2, e3 = offsets[s + 1], offsets[s + 2], offsets[s + 3], offsets[s + 4]
    x0, x1, x2, x3 = (
        _start(words, p0 - 2),
        _start(words, p1 - 2),
        _start(words, p2 - 2),
        _start(words, p3 - 2),
    )
    # each stream's channels: families, centres, steps
    b0, b1, b2, b3 = s * cps, (s + 1) * cps, (s + 2) * cps, (s + 3) * cps
    fa0, fa1, fa2, fa3 = (
        family[b0 : b0 + cps],
        family[b1 : b1 + cps],
        family[b2 : b2 + cps],
        family[b3 : b3 + cps],
    )
    ce0, ce1, ce2, ce3 = (
        center[b0 : b0 + cps],
        center[b1 : b1 + cps],
        center[b2 : b2 + cps],
        center[b3 : b3 + cps],
    )
    st0, st1, st2, st3 = step[b0 : b0 + cps], step[b1 : b1 + cps], step[b2 : b2 + cps], step[b3 : b3 + cps]
    # each stream's rows of the output, and its first column there
    d0, d1, d2, d3 = out[s // groups], out[(s + 1) // groups], out[(s + 2) // groups], out[(s + 3) // groups]
    o0, o1, o2, o3 = (
        U(s % groups * cps),
        U((s + 1) % groups * cps),
        U((s + 2) % groups * cps),
        U((s + 3) % groups * cps),
    )
    mask = PROB_SCALE - 1
    for t in range(tokens):
        tu = U(t)
        for c in range(cps):
            # stage by stage across the four streams, so that their table lookups overlap; the
            # lanes are written out: through helpers that mark an over-read instead of returning,
            # the same kernel ran 20% slower. Every index is unsigned (U): numba wraps a negative
            # signed index around, a compare and a select on every access, and skips that for
            # an unsigned one (1.2x a chunk, docs/codec.md "Speed").
            cu = U(c)
            f0, f1, f2, f3 = U(fa0[cu]), U(fa1[cu]), U(fa2[cu]), U(fa3[cu])
            s0, s1, s2, s3 = x0 & mask, x1 & mask, x2 & mask, x3 & mask
            y0, y1 = np.int64(slot_symbol[f0, U(s0)]), np.int64(slot_symbol[f1, U(s1)])
            y2, y3 = np.int64(slot_symbol[f2, U(s2)]), np.int64(slot_symbol[f3, U(s3)])
            x0 = _next_state(x0, s0, freq_cum[f0, U(y0)])
            x1 = _next_state(x1, s1, freq_cum[f1, U(y1)])
            x2 = _next_state(x2, s2, freq_cum[f2, U(y2)])
            x3 = _next_state(x3, s3, freq_cum[f3, U(y3)])
            if branchless:
                x0, p0 = _renorm_branchless(x0, p0, e0, words)
                x1, p1 = _renorm_branchless(x1, p1, e1, words)
                x2, p2 = _renorm_branchless(x2, p2, e2, words)
                x3, p3 = _renorm_branchless(x3, p3, e3, words)
            else:
                if x0 < STATE_LOW:
                    if p0 >= e0:
                        return False
                    x0 = (x0 << 16) | np.int64(words[U(p0)])
                    p0 += 1
                if x1 < STATE_LOW:
                    if p1 >= e1:
                        return False
                    x1 = (x1 << 16) | np.int64(words[U(p1)])
                    p1 += 1
                if x2 < STATE_LOW:
                    if p2 >= e2:
                        return False
                    x2 = (x2 << 16) | np.int64(words[U(p2)])
                    p2 += 1
                if x3 < STATE_LOW:
                    if p3 >= e3:
                        return False
                    x3 = (x3 << 16) | np.int64(words[U(p3)])
                    p3 += 1
            r0, r1, r2, r3 = y0 - BIAS, y1 - BIAS, y2 - BIAS, y3 - BIAS
            if y0 == ESCAPE or y1 == ESCAPE or y2 == ESCAPE or y3 == ESCAPE:  # rare
                if y0 == ESCAPE:
                    x0, p0, r0 = _escape(x0, p0, e0, words)
                if y1 == ESCAPE:
                    x1, p1, r1 = _escape(x1, p1, e1, words)
                if y2 == ESCAPE:
                    x2, p2, r2 = _escape(x2, p2, e2, words)
                if y3 == ESCAPE:
                    x3, p3, r3 = _escape(x3, p3, e3, words)
                if p0 < 0 or p1 < 0 or p2 < 0 or p3 < 0:
                    return False
            d0[tu, o0 + cu] = np.float32(np.int32(ce0[cu] + r0)) * st0[cu]
            d1[tu, o1 + cu] = np.float32(np.int32(ce1[cu] + r1)) * st1[cu]
            d2[tu, o2 + cu] = np.float32(np.int32(ce2[cu] + r2)) * st2[cu]
            d3[tu, o3 + cu] = np.float32(np.int32(ce3[cu] + r3)) * st3[cu]
    return (p0, p1, p2, p3) == (e0, e1, e2, e3) and x0 == x1 == x2 == x3 == STATE_LOW


@numba.njit([_DECODE_STREAMS], cache=True, parallel=True, nogil=True)
def decode_streams(
    words,
    offsets,
    channel_family,
    channel_center,
    channel_step,
    freq_cum,
    slot_symbol,
    tokens,
    channels_per_stream,
    token_start,
    out,
    status,
):
    """Decode every stream into ``out[s // groups, token_start + t, c0 + c]`` as float32.

    ``offsets[s]:offsets[s+1]`` are the words of stream ``s``. A stream that
    ends early, leaves words unread or does not return to the initial state is
    marked in ``status``; nothing outside ``words`` is ever read.
    """
    n_streams = offsets.shape[0] - 1
    head_dim = out.shape[2]
    groups = head_dim // channels_per_stream
    coded = out[:, token_start : token_start + tokens]
    cps = channels_per_stream
    for g in numba.prange((n_streams + 3) // 4):
        s0 = 4 * g
        if s0 + 4 <= n_streams and _decode_four(
            words,
            offsets,
            s0,
            channel_family,
            channel_center,
            channel_step,
            freq_cum,
            slot_symbol,
            tokens,
            cps,
            groups,
            coded,
            dense_group(offsets, s0, tokens, cps),
        ):
            status[s0 : s0 + 4] = OK
            continue
        for s in range(s0, min(s0 + 4, n_streams)):
            if offsets[s + 1] - offsets[s] < 2:
                status[s] = ERR_LENGTH
                continue
            base = s * cps
            status[s] = _decode_stream(
                words,
                offsets[s],
                offsets[s + 1],
                channel_family[base : base + cps],
                channel_center[base : base + cps],
                channel_step[base : base + cps],
                freq_cum,
                slot_symbol,
                tokens,
                coded,
                s // groups,
                (s % groups) * cps,
            )
