"""The compiled rANS kernels against their own uncompiled Python (the reference), and coder efficiency."""

from __future__ import annotations

import numpy as np
import pytest

from codec import rans
from codec.entropy_model import FAMILIES, bank


def _streams(seed: int, n_streams: int = 3, tokens: int = 40, cps: int = 4, scale: float = 3.0):
    rng = np.random.default_rng(seed)
    b = bank()
    family = rng.integers(0, FAMILIES, n_streams * cps).astype(np.uint8)
    r = np.rint(rng.laplace(0, scale, (n_streams, tokens, cps))).astype(np.int64)
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
        b.freq_cum,
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


# residual spreads whose streams the decoder finds dense (over 1 bit a value: it renormalises
# without a branch) and sparse (with one)
DENSE, SPARSE = 3.0, 0.15


def _nine_streams(scale: float = DENSE):
    """Nine streams: two groups that the decoder takes four at a time, and one alone; escapes in
    both groups and in the last stream."""
    b, family, sym, esc, tokens, cps = _streams(7, n_streams=9, tokens=33, cps=5, scale=scale)
    if scale == SPARSE:  # the families that expect it: each channel's most peaked one
        family[:] = int(np.argmax(b.freq[:, rans.BIAS]))
    for s, t, c, value in ((5, 7, 2, -1234), (2, 3, 4, 999), (7, 30, 0, -200)):  # every lane of a group
        sym[s, t, c], esc[s, t, c] = rans.ESCAPE, value
    fast, lengths = _encode(rans.encode_streams, b, family, _by_channel(sym), _by_channel(esc), tokens, cps)
    return b, family, fast, lengths, tokens, cps


def _alone(b, family, out, lengths, tokens, cps, s, centers):
    """Stream ``s`` decoded on its own: the one-stream path."""
    return _decode(
        rans.decode_streams,
        b,
        family[s * cps : (s + 1) * cps],
        out[s : s + 1],
        lengths[s : s + 1],
        tokens,
        cps,
        1,
        centers[s * cps : (s + 1) * cps],
    )


def _bits_per_value(lengths: np.ndarray, tokens: int, cps: int) -> float:
    return 16 * float(lengths.sum()) / (len(lengths) * tokens * cps)


def test_the_two_spreads_fall_on_either_side_of_the_decoders_line() -> None:
    assert _bits_per_value(*_nine_streams(DENSE)[3:6]) > 1.5
    assert _bits_per_value(*_nine_streams(SPARSE)[3:6]) < 0.9


@pytest.mark.parametrize("scale", [DENSE, SPARSE])
def test_streams_decoded_four_at_a_time_match_each_decoded_alone(scale: float) -> None:
    b, family, out, lengths, tokens, cps = _nine_streams(scale)
    centers = np.arange(9 * cps, dtype=np.int32) - 20
    together, status = _decode(rans.decode_streams, b, family, out, lengths, tokens, cps, 9, centers)
    assert not status.any()
    for s in range(9):
        alone, alone_status = _alone(b, family, out, lengths, tokens, cps, s, centers)
        assert not alone_status.any()
        assert np.array_equal(together[s], alone[0]), s
    assert together[5, 7, 2] == -1234 + centers[5 * cps + 2]  # the escape inside a group of four
    # the lockstep path itself decodes both groups, renormalising either way (it is not the
    # one-by-one fallback that did)
    words = np.concatenate([out[s, : lengths[s]] for s in range(9)])
    offsets = np.concatenate(([0], np.cumsum(lengths)))
    for first in (0, 4):
        for branchless in (False, True):
            lockstep = np.zeros_like(together)
            steps = np.ones(9 * cps, dtype=np.float32)
            args = (family.astype(np.int32), centers, steps, b.freq_cum, b.slot_symbol, tokens, cps, 1)
            assert rans._decode_four(words, offsets, first, *args, lockstep, branchless)
            assert np.array_equal(lockstep[first : first + 4], together[first : first + 4])


@pytest.mark.parametrize("scale", [DENSE, SPARSE])
@pytest.mark.parametrize("broken", [0, 6, 8])
def test_a_corrupt_stream_in_a_group_of_four_is_reported_alone(broken: int, scale: float) -> None:
    """A stream cut short inside a group is marked, as it would be alone; its neighbours decode."""
    b, family, out, lengths, tokens, cps = _nine_streams(scale)
    centers = np.zeros(9 * cps, dtype=np.int32)
    clean, _ = _decode(rans.decode_streams, b, family, out, lengths, tokens, cps, 9, centers)
    short = lengths.copy()
    short[broken] -= 1
    got, status = _decode(rans.decode_streams, b, family, out, short, tokens, cps, 9, centers)
    _, alone_status = _alone(b, family, out, short, tokens, cps, broken, centers)
    assert status[broken] == alone_status[0] != rans.OK
    assert np.flatnonzero(status).tolist() == [broken]
    for s in set(range(9)) - {broken}:
        assert np.array_equal(got[s], clean[s]), s


def test_the_packed_table_holds_every_frequency_and_start() -> None:
    b = bank()
    assert b.freq_cum.dtype == np.int32 and (b.freq_cum >= 0).all()
    assert np.array_equal(b.freq_cum >> 16, b.freq) and np.array_equal(b.freq_cum & 0xFFFF, b.cum)
