"""The rANS decoder's renormalisation, with a branch or without one, per level (issue 18: decode speed).

After each symbol a stream's state may fall below ``STATE_LOW`` and take the
next 16-bit word. Dense streams (many bits a value) do so every few symbols,
at random, and the branch mispredicts; sparse ones rarely do. ``decode_streams``
picks per group of four streams (``codec.rans.dense_group``: over 1 bit a
value, branchless). This times the integer decode of one real 256-token chunk
of the default model per level, every group through ``_decode_four`` on one
thread, three ways, alternating rounds:

- ``branch``: every group renormalised with a branch (the decoder before);
- ``branchless``: every group without;
- ``chosen``: each group as ``dense_group`` says (the decoder now).

    python -m benchmarks.rans_renorm --out benchmarks/results/rans_renorm.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import numpy as np

from benchmarks.codec_speed import real_kv
from codec import DEFAULT_LEVELS, encode_chunk, load_level_table, rans
from codec.entropy_model import bank
from codec.levels import V4_TABLE_FILE, shipped_level_table
from codec.parsed import parse_chunk

RESULTS = Path(__file__).resolve().parent / "results"
WAYS = ("branch", "branchless", "chosen")


def integer_decode(quant, out: np.ndarray, way: str) -> float:
    """Seconds to decode every group of four streams of ``quant`` into ``out``, the given way."""
    b = bank()
    tokens = out.shape[1] - quant.exact_tokens
    cps = out.shape[2] // quant.groups
    coded = out[:, quant.exact_tokens :]
    args = (
        quant.family.astype(np.int32),
        quant.center.astype(np.int32),
        quant.step,
        b.freq_cum,
        b.slot_symbol,
    )
    t0 = time.perf_counter()
    for s in range(0, quant.streams - 3, 4):
        dense = rans.dense_group(quant.offsets, s, tokens, cps)
        branchless = way == "branchless" or (way == "chosen" and dense)
        ok = rans._decode_four(
            quant.words, quant.offsets, s, *args, tokens, cps, quant.groups, coded, branchless
        )
        assert ok, "a clean chunk decoded as corrupt"
    return time.perf_counter() - t0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--out", type=Path)
    args = p.parse_args()
    kv = real_kv(256)
    layers, _, heads, tokens, dim = kv.shape
    v4 = [("v4/" + lv.name, lv) for lv in load_level_table(shipped_level_table(V4_TABLE_FILE))]
    levels = [(lv.name, lv) for lv in DEFAULT_LEVELS] + v4
    result: dict = {"tokens": tokens, "levels": {}}
    print(f"{'level':>10} {'bits/val':>9} {'dense groups':>13} " + " ".join(f"{w + ' ms':>14}" for w in WAYS))
    for name, level in levels:
        if level.lossless:
            continue
        body = parse_chunk(encode_chunk(kv, level, position=tokens)).body
        quant = getattr(body, "quant", body)  # a transform chunk's quantized coefficients, or format 4's
        cps = dim // quant.groups
        coded = tokens - quant.exact_tokens
        groups = range(0, quant.streams - 3, 4)
        dense = sum(bool(rans.dense_group(quant.offsets, s, coded, cps)) for s in groups) / len(groups)
        outs = {way: np.zeros((layers * 2 * heads, tokens, dim), np.float32) for way in WAYS}
        times: dict[str, list[float]] = {way: [] for way in WAYS}
        for way in WAYS:
            integer_decode(quant, outs[way], way)  # compiled and warm
        for _ in range(args.rounds):
            for way in WAYS:
                times[way].append(integer_decode(quant, outs[way], way))
        assert all(np.array_equal(outs[way], outs["branch"]) for way in WAYS), "the ways disagree"
        ms = {way: round(statistics.median(t) * 1e3, 2) for way, t in times.items()}
        bits = 16 * len(quant.words) / (layers * 2 * heads * coded * dim)
        result["levels"][name] = {"bits_per_value": round(bits, 3), "dense_groups": round(dense, 3), "ms": ms}
        print(f"{name:>10} {bits:>9.3f} {dense:>13.2f} " + " ".join(f"{ms[w]:>14}" for w in WAYS))
    out = args.out or RESULTS / "rans_renorm.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"written to {out}")


if __name__ == "__main__":
    main()
