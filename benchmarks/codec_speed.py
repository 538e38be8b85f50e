"""Encode/decode throughput of the codec on real KV, and coder efficiency.

    python -m benchmarks.codec_speed --out benchmarks/results/codec_speed.json

Throughput is in MB/s of fp16-equivalent KV (values x 2 bytes), single
chunks of 256 tokens, median of ``--repeat`` runs, with zstd on the fp16
bytes (level 1 and 3) measured in the same process as the yardstick: the
machine is shared, so ratios are steadier than absolute figures.

The default (transform, format 5) levels and the format-4 table's levels
(``v4/...``) run on the same chunk: the second 256 tokens of a text, so a
transform level codes every token (only a context's first tokens are kept
exactly). A transform level's decode includes its inverse transform, whose
share is given apart (``inverse_fp32_ms``, and ``inverse_bf16_ms`` where the CPU has a native
bf16 matmul, which decoding then uses: the matmul per layer and K/V and the
RoPE rotation, in torch on the CPU).

Coder efficiency (scheme 2 levels) compares the coded streams with the ideal size of the same
symbols under the stored model (sum of -log2 p, escapes' raw 16 bits
included), and with the order-0 empirical entropy per channel.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import sysconfig
import time
from pathlib import Path

import numpy as np
import torch
import zstandard

from codec import (
    DEFAULT_LEVELS,
    TRANSFORM_SCHEMES,
    Scheme,
    decode_chunk,
    encode_chunk,
    load_level_table,
    quantized,
    rans,
)
from codec.container import unpack
from codec.entropy_model import bank
from codec.levels import SCHEME4_TABLE_FILE, V4_TABLE_FILE, level_digest, shipped_level_table
from codec.parsed import parse_chunk
from codec.transform import bf16_inverse
from codec.transformed import inverse_


def real_kv(tokens: int) -> torch.Tensor:
    from engine import ModelRunner, load_model

    runner = ModelRunner(load_model())
    text = (Path(sysconfig.get_paths()["stdlib"]) / "LICENSE.txt").read_text()
    ids = runner.tokenizer(text, add_special_tokens=False)["input_ids"][: 2 * tokens]
    return runner.compute_kv(ids)[:, :, :, tokens:].contiguous()  # the second chunk


def inverse_precisions(data: bytes, kv: torch.Tensor, repeat: int) -> dict:
    """A transform chunk's inverse, timed and scored in float32 and (where the CPU multiplies bf16
    natively) in bf16: the error is relative to the chunk's KV, over its coded tokens, so the
    level's own error and what a bf16 matmul adds to it stand side by side."""
    body = parse_chunk(data).body
    layers, _, heads, tokens, dim = kv.shape
    coefficients = torch.empty(kv.shape)
    quantized.decode_into(body.quant, coefficients.view(layers * 2 * heads, tokens, dim).numpy())
    coded = kv[:, :, :, body.exact_tokens :]
    entry: dict = {"inverse_bf16_default": bf16_inverse(kv.device)}
    decoded = {}
    for precision in ("fp32", "bf16") if entry["inverse_bf16_default"] else ("fp32",):
        bf16 = precision == "bf16"
        out = coefficients.clone()
        inverse_(body, out, bf16)
        decoded[precision] = out[:, :, :, body.exact_tokens :]
        entry[f"inverse_{precision}_rel_error"] = float((decoded[precision] - coded).norm() / coded.norm())
        scratch = torch.zeros(kv.shape)
        entry[f"inverse_{precision}_ms"] = 1e3 * timed(lambda: inverse_(body, scratch, bf16), repeat)  # noqa: B023
        # the whole decode with this inverse: parse, integer decode, inverse (as ``decode_chunk``)
        seconds = timed(lambda: decode_with(data, scratch, bf16), repeat)  # noqa: B023
        entry[f"decode_{precision}_inverse_mb_s"] = kv.numel() * 2e-6 / seconds
    if "bf16" in decoded:
        entry["bf16_vs_fp32_rel_diff"] = float((decoded["bf16"] - decoded["fp32"]).norm() / coded.norm())
    return entry


def decode_with(data: bytes, out: torch.Tensor, bf16: bool) -> None:
    body = parse_chunk(data).body
    layers, _, heads, tokens, dim = out.shape
    quantized.decode_into(body.quant, out.view(layers * 2 * heads, tokens, dim).numpy())
    inverse_(body, out, bf16)


def timed(fn, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def efficiency(data: bytes) -> dict[str, float]:
    """Coded bits vs the ideal bits of the decoded symbols under the stored model and vs empirical entropy."""
    header, payload = unpack(data)
    layers, _, heads, tokens, dim = header.shape
    body = quantized.parse(payload, header.shape, header.version)
    channels = layers * 2 * heads * dim
    n_exact = body.exact_tokens
    family, center = body.family.astype(np.int64), body.center.astype(np.int64)
    lengths = np.diff(body.offsets)
    kv = decode_chunk(data).numpy()[:, :, :, n_exact:]
    step = body.step.reshape(layers, 2, heads, dim)
    r = np.rint(kv / step[:, :, :, None, :]).astype(np.int64) - center.reshape(layers, 2, heads, 1, dim)
    r = r.transpose(0, 1, 2, 4, 3).reshape(channels, -1)
    b = bank()
    inside = np.abs(r) <= rans.BIAS
    sym = np.where(inside, r + rans.BIAS, rans.ESCAPE)
    fam = np.broadcast_to(family[:, None], sym.shape)
    sym = np.where(b.freq[fam, np.minimum(sym, rans.ESCAPE)] == 0, rans.ESCAPE, sym)
    ideal = float(-np.log2(b.freq[fam, sym] / rans.PROB_SCALE).sum() + 16 * (sym == rans.ESCAPE).sum())
    empirical = 0.0
    for row in r:
        _, counts = np.unique(row, return_counts=True)
        p = counts / counts.sum()
        empirical -= float((counts * np.log2(p)).sum())
    coded = float(16 * lengths.sum())
    meta = 8.0 * (len(data) - 2 * lengths.sum())
    return {
        "coded_bits": coded,
        "model_bits": ideal,
        "empirical_entropy_bits": empirical,
        "coded_over_model": coded / ideal,
        "model_over_empirical": ideal / empirical,
        "metadata_bits_per_value": meta / (layers * 2 * heads * tokens * dim),
        "stream_bits_per_value": coded / (layers * 2 * heads * tokens * dim),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/codec_speed.json"))
    parser.add_argument("--tokens", type=int, default=256, help="tokens per chunk")
    parser.add_argument("--repeat", type=int, default=7)
    parser.add_argument(
        "--synthetic", action="store_true", help="random KV instead of the model's (no model load)"
    )
    args = parser.parse_args(argv)

    if args.synthetic:
        kv = torch.randn(30, 2, 3, args.tokens, 64)
    else:
        kv = real_kv(args.tokens)
    fp16_bytes = kv.numel() * 2
    mb = fp16_bytes / 1e6
    raw16 = kv.half().numpy().tobytes()
    results: dict[str, dict] = {}
    for zlevel in (1, 3):
        comp = zstandard.ZstdCompressor(level=zlevel)
        blob = comp.compress(raw16)
        dec = zstandard.ZstdDecompressor()
        results[f"zstd-{zlevel} on fp16"] = {
            "encode_mb_s": mb / timed(lambda: comp.compress(raw16), args.repeat),  # noqa: B023
            "decode_mb_s": mb / timed(lambda: dec.decompress(blob), args.repeat),  # noqa: B023
            "bits_per_value": 8 * len(blob) / kv.numel(),
        }
    v4_table = load_level_table(shipped_level_table(V4_TABLE_FILE))
    v4 = [("v4/" + lv.name, lv) for lv in v4_table if not lv.lossless]
    # the scheme-4 levels scheme 5 replaced (low): what salient tokens cost to code
    ours = {level_digest(lv) for lv in DEFAULT_LEVELS}
    scheme4 = [
        ("scheme4/" + lv.name, lv)
        for lv in load_level_table(shipped_level_table(SCHEME4_TABLE_FILE))
        if level_digest(lv) not in ours
    ]
    position = args.tokens  # the chunk's place in its text
    for name, level in [(lv.name, lv) for lv in DEFAULT_LEVELS] + scheme4 + v4:
        data = encode_chunk(kv, level, position=position)  # also compiles (numba cache) before timing
        decode_chunk(data)
        entry = {
            "encode_mb_s": mb / timed(lambda: encode_chunk(kv, level, position=position), args.repeat),  # noqa: B023
            "decode_mb_s": mb / timed(lambda: decode_chunk(data), args.repeat),  # noqa: B023
            "bits_per_value": 8 * len(data) / kv.numel(),
        }
        if level.scheme is Scheme.QUANT:
            entry |= efficiency(data)
        if level.scheme in TRANSFORM_SCHEMES:
            entry |= inverse_precisions(data, kv, args.repeat)
        results[name] = entry
    zstd_dec = results["zstd-1 on fp16"]["decode_mb_s"]
    for entry in results.values():
        entry["decode_vs_zstd1"] = entry["decode_mb_s"] / zstd_dec
    out = {
        "tokens": args.tokens,
        "values": kv.numel(),
        "fp16_mb": mb,
        "threads": torch.get_num_threads(),
        "numba_threads": __import__("numba").get_num_threads(),
        "results": results,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=1) + "\n")
    print(f"chunk: {args.tokens} tokens, {mb:.2f} MB fp16-equivalent; MB/s of fp16-equivalent KV")
    print(
        f"{'method':16s} {'bits/val':>8s} {'enc MB/s':>9s} {'dec MB/s':>9s} {'dec/zstd1':>9s} {'coded/model':>11s} "
        f"{'model/H0':>8s}"
    )
    for name, e in results.items():
        eff = (
            f"{e['coded_over_model']:11.4f} {e['model_over_empirical']:8.4f}"
            if "coded_over_model" in e
            else (inverse_summary(e) if "inverse_fp32_ms" in e else "")
        )
        print(
            f"{name:16s} {e['bits_per_value']:8.3f} {e['encode_mb_s']:9.1f} {e['decode_mb_s']:9.1f} "
            f"{e['decode_vs_zstd1']:9.2f} {eff}"
        )
    return 0


def inverse_summary(e: dict) -> str:
    text = (
        f"  inverse fp32 {e['inverse_fp32_ms']:.1f} ms (decode {e['decode_fp32_inverse_mb_s']:.0f} MB/s, "
        f"error {e['inverse_fp32_rel_error']:.4f})"
    )
    if "inverse_bf16_ms" in e:
        text += (
            f", bf16 {e['inverse_bf16_ms']:.1f} ms (decode {e['decode_bf16_inverse_mb_s']:.0f} MB/s, "
            f"error {e['inverse_bf16_rel_error']:.4f}, {e['bf16_vs_fp32_rel_diff']:.4f} from fp32)"
        )
    return text


if __name__ == "__main__":
    sys.exit(main())
