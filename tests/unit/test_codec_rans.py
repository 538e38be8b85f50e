"""The compiled rANS kernels against their own uncompiled Python (the reference), and coder efficiency."""

from __future__ import annotations

import numpy as np
import pytest

from codec import rans
from codec.entropy_model import FAMILIES, bank


def _streams(seed: int, n_streams: int = 3, tokens: int = 40, cps: int = 4):
    rng = np.random.default_rng(seed)
    b = bank()
    family = rng.integers(0, FAMILIES, n_streams * cps).astype(np.uint8)
    r = np.rint(rng.laplace(0, 3, (n_streams, tokens, cps))).astype(np.int64)
    r[0, 5, 1] = 4000  # escapes
    r[-1, -1, -1] = -32768
    sym = np.where(np.abs(r) <= rans.BIAS, r + rans.BIAS, rans.ESCAPE)
    fam = family.reshape(n_streams, 1, cps)
    sym = np.where(
        b.freq[np.broadcast_to(fam, sym.shape), np.minimum(sym, rans.ESCAPE)] == 0, rans.ESCAPE, sym
    )
    return b, family, sym.astype(np.uint8), r.astype(np.int16), tokens, cps


def _by_channel(a: np.ndarray) -> np.ndarray:
    """(streams, tokens, channels in stream) -> (channels, tokens), the encoder's layout."""
    return np.ascontiguousarray(a.transpose(0, 2, 1).reshape(-1, a.shape[1]))


def _encode(fn, b, family, sym, esc, tokens, cps):
    out = np.zeros((sym.shape[0] // cps, 3 * tokens * cps + 2), dtype=np.uint16)
    lengths = np.zeros(sym.shape[0] // cps, dtype=np.int64)
    fn(sym, esc, family, b.cum, b.freq, tokens, cps, out, lengths)
    return out, lengths


def _decode(fn, b, family, out, lengths, tokens, cps, n_streams, centers):
    words = np.concatenate([out[s, : lengths[s]] for s in range(n_streams)])
    offsets = np.zeros(n_streams + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    dec = np.zeros((n_streams, tokens, cps), dtype=np.float32)
    status = np.zeros(n_streams, dtype=np.int32)
    steps = np.ones(n_streams * cps, dtype=np.float32)
    fn(
        words,
        offsets,
        family.astype(np.int32),
        centers,
        steps,
        b.cum,
        b.freq,
        b.slot_symbol,
        tokens,
        cps,
        0,
        dec,
        status,
    )
    return dec, status


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_compiled_and_python_kernels_agree_bit_for_bit(seed: int) -> None:
    b, family, sym, esc, tokens, cps = _streams(seed)
    fast, fast_len = _encode(rans.encode_streams, b, family, _by_channel(sym), _by_channel(esc), tokens, cps)
    slow, slow_len = _encode(
        rans.encode_streams.py_func, b, family, _by_channel(sym), _by_channel(esc), tokens, cps
    )
    assert np.array_equal(fast_len, slow_len)
    for s in range(sym.shape[0]):
        assert np.array_equal(fast[s, : fast_len[s]], slow[s, : slow_len[s]])
    centers = np.zeros(sym.shape[0] * cps, dtype=np.int32)
    # one stream per row: cps channels per stream and head_dim == cps
    d1, st1 = _decode(rans.decode_streams, b, family, fast, fast_len, tokens, cps, sym.shape[0], centers)
    d2, st2 = _decode(
        rans.decode_streams.py_func, b, family, fast, fast_len, tokens, cps, sym.shape[0], centers
    )
    assert not st1.any() and not st2.any()
    assert np.array_equal(d1, d2)
    assert np.array_equal(d1.astype(np.int64), esc.astype(np.int64))


def test_coded_size_is_within_3_percent_of_the_model_entropy() -> None:
    rng = np.random.default_rng(5)
    b = bank()
    n_streams, tokens, cps = 8, 2048, 8
    family = rng.integers(8, 40, n_streams * cps).astype(np.uint8)
    r = np.rint(rng.laplace(0, 2.0, (n_streams, tokens, cps))).astype(np.int64)
    sym = np.where(np.abs(r) <= rans.BIAS, r + rans.BIAS, rans.ESCAPE)
    fam = np.broadcast_to(family.reshape(n_streams, 1, cps), sym.shape)
    sym = np.where(b.freq[fam, np.minimum(sym, rans.ESCAPE)] == 0, rans.ESCAPE, sym).astype(np.uint8)
    ideal = -np.log2(b.freq[fam, sym] / (1 << rans.PROB_BITS)).sum() + 16 * (sym == rans.ESCAPE).sum()
    _, lengths = _encode(
        rans.encode_streams, b, family, _by_channel(sym), _by_channel(r.astype(np.int16)), tokens, cps
    )
    coded = 16 * lengths.sum()
    assert coded <= 1.03 * ideal
