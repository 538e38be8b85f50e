"""Many-stream rANS coder (32-bit state, 16-bit words), compiled with numba.

Every stream is independent: it has its own state, its own words and its own
slice of the output. That is what lets the CPU decode them with ``prange`` and
what a GPU kernel will do with one thread per stream. The decoder here is the
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


@numba.njit(cache=True, nogil=True)
def _decode_stream(words, pos, end, fams, centers, steps, cum, freq, slot_symbol, tokens, out, row, c0):
    cps = fams.shape[0]
    x = np.int64(words[pos]) | (np.int64(words[pos + 1]) << 16)
    pos += 2
    mask = PROB_SCALE - 1
    for t in range(tokens):
        dst = out[row, t]
        for c in range(cps):
            f = fams[c]
            slot = x & mask
            sym = np.int64(slot_symbol[f, slot])
            x = np.int64(freq[f, sym]) * (x >> PROB_BITS) + slot - np.int64(cum[f, sym])
            x, pos = _get(x, words, pos, end)
            if pos < 0:
                return ERR_OVERRUN
            if sym == ESCAPE:
                raw = 0
                for _ in range(2):
                    slot = x & mask
                    byte = slot >> _BYTE_SHIFT
                    x = _BYTE_FREQ * (x >> PROB_BITS) + slot - byte * _BYTE_FREQ
                    x, pos = _get(x, words, pos, end)
                    if pos < 0:
                        return ERR_OVERRUN
                    raw = (raw << 8) | byte
                r = raw - 65536 if raw >= 32768 else raw
            else:
                r = sym - BIAS
            dst[c0 + c] = np.float32(np.int32(centers[c] + r)) * steps[c]
    if pos != end:
        return ERR_LENGTH
    if x != STATE_LOW:
        return ERR_STATE
    return OK


@numba.njit(cache=True, parallel=True, nogil=True)
def decode_streams(
    words,
    offsets,
    channel_family,
    channel_center,
    channel_step,
    cum,
    freq,
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
    for s in numba.prange(n_streams):
        if offsets[s + 1] - offsets[s] < 2:
            status[s] = ERR_LENGTH
            continue
        base = s * channels_per_stream
        fams = channel_family[base : base + channels_per_stream]
        centers = channel_center[base : base + channels_per_stream]
        steps = channel_step[base : base + channels_per_stream]
        status[s] = _decode_stream(
            words,
            offsets[s],
            offsets[s + 1],
            fams,
            centers,
            steps,
            cum,
            freq,
            slot_symbol,
            tokens,
            coded,
            s // groups,
            (s % groups) * channels_per_stream,
        )
