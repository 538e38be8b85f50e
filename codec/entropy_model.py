"""The compact probability model: a fixed bank of discretised Laplace and Gaussian tables.

Per-chunk frequency tables are what cap other implementations on GQA models
(a 16-bit CDF per layer and channel costs more than the symbols it models on
short chunks). Here a channel stores one byte, the index of the table in a bank
that both sides rebuild from this file: shape (Laplace or Gaussian) and
spread (a quarter-octave grid in units of the quantization step). The encoder
picks, per channel, the table under which the channel's residuals cost the
fewest bits, escapes included.

The bank is built with float64 numpy arithmetic and a deterministic rounding
rule; ``BANK_DIGEST`` pins the result (a test recomputes it) so that a
different platform or numpy cannot silently change the bitstream.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass
from functools import cache, cached_property

import numpy as np

from codec.rans import ALPHABET, BIAS, ESCAPE, PROB_SCALE

SPREADS_PER_SHAPE = 32
SHAPES = ("laplace", "gaussian")
FAMILIES = SPREADS_PER_SHAPE * len(SHAPES)
_ESCAPE_FLOOR = 1e-4  # escapes stay codable (and cheap enough) even where the tails vanish
ESCAPE_RAW_BITS = 16


def spread(index: int) -> float:
    """Standard deviation, in quantization steps, of spread ``index`` (0.18 .. 38)."""
    return 2.0 ** (index / 4.0 - 2.5)


def _probabilities(shape: str, sigma: float) -> np.ndarray:
    """P(r) for r = -BIAS..BIAS (the rest is tail mass, coded as escapes)."""
    edges = np.arange(-BIAS - 0.5, BIAS + 1.5, 1.0)
    if shape == "laplace":
        b = sigma / math.sqrt(2.0)
        cdf = np.where(
            edges < 0, 0.5 * np.exp(np.minimum(edges, 0) / b), 1 - 0.5 * np.exp(-np.maximum(edges, 0) / b)
        )
    else:
        erf = np.vectorize(math.erf)
        cdf = 0.5 * (1 + erf(edges / (sigma * math.sqrt(2.0))))
    return np.diff(cdf)


def _quantize(p: np.ndarray, tail: float) -> np.ndarray:
    """Integer frequencies summing to PROB_SCALE; symbols too rare to matter get 0 (escaped)."""
    probs = np.append(p, max(tail, _ESCAPE_FLOOR))
    probs = probs / probs.sum()
    freq = np.floor(probs * PROB_SCALE).astype(np.int64)
    keep = probs * PROB_SCALE >= 0.5
    keep[ESCAPE] = True
    freq = np.where(keep, np.maximum(freq, 1), 0)
    # Hand the rounding remainder to the most probable symbols, largest first, ties to the lowest index.
    deficit = PROB_SCALE - int(freq.sum())
    order = np.argsort(-probs, kind="stable")
    i = 0
    while deficit != 0:
        sym = order[i % len(order)]
        if deficit > 0:
            freq[sym] += 1
            deficit -= 1
        elif freq[sym] > 1:
            freq[sym] -= 1
            deficit += 1
        i += 1
    return freq


@dataclass(frozen=True)
class Bank:
    freq: np.ndarray  # (FAMILIES, ALPHABET) uint32
    cum: np.ndarray  # (FAMILIES, ALPHABET) uint32, start of each symbol's slots
    slot_symbol: np.ndarray  # (FAMILIES, PROB_SCALE) uint8
    cost: np.ndarray  # (FAMILIES, ALPHABET + 1) float64 bits; last column: a residual outside the table
    min_bits: float  # the cheapest symbol of any table: bounds how many symbols a word can hold

    def digest(self) -> str:
        return hashlib.sha256(self.freq.astype("<u4").tobytes()).hexdigest()

    @cached_property
    def freq_cum(self) -> np.ndarray:
        """(FAMILIES, ALPHABET) int32, ``freq << 16 | cum``: the decoder's one lookup per symbol
        (a frequency is at most 2^14, a start below it)."""
        return ((self.freq.astype(np.int64) << 16) | self.cum).astype(np.int32)


@cache
def bank() -> Bank:
    freqs = []
    for shape in SHAPES:
        for i in range(SPREADS_PER_SHAPE):
            p = _probabilities(shape, spread(i))
            freqs.append(_quantize(p, max(0.0, 1.0 - float(p.sum()))))
    freq = np.array(freqs, dtype=np.uint32)
    cum = np.zeros_like(freq)
    cum[:, 1:] = np.cumsum(freq, axis=1)[:, :-1]
    slot_symbol = np.zeros((FAMILIES, PROB_SCALE), dtype=np.uint8)
    for f in range(FAMILIES):
        slot_symbol[f] = np.repeat(np.arange(ALPHABET, dtype=np.uint8), freq[f])
    with np.errstate(divide="ignore"):
        bits = -np.log2(freq / PROB_SCALE)
    escape_bits = bits[:, ESCAPE] + ESCAPE_RAW_BITS
    cost = np.concatenate([bits, escape_bits[:, None]], axis=1)
    # A residual the table gives no slots is coded as an escape.
    cost[:, :ESCAPE] = np.where(freq[:, :ESCAPE] == 0, escape_bits[:, None], cost[:, :ESCAPE])
    min_bits = float(-np.log2(freq.max() / PROB_SCALE))
    return Bank(freq=freq, cum=cum, slot_symbol=slot_symbol, cost=cost, min_bits=min_bits)


BANK_DIGEST = "034a5627eaef57ba389bae376e67b2e167efa41c40d648b5dba7238dcaca82cf"
