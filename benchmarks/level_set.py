"""Which levels should a context be stored at by default? What ``lossless`` buys against what it costs.

``lossless`` is the only level that serves a request exactly (``kv_quality:
"lossless"``, or ``auto`` when the link is fast enough to afford it). Without
it, an exact request recomputes the prefix from text, which is exact too. So
storing it buys, per request that wants exactness, the difference between
loading the raw KV and recomputing it; it costs its bytes in the store, on
every upload, and in the LRU tier, for every context.

Measured here, in this process, on the default model and a real-text context:

* the recompute: prefill of the whole context (median of ``--repeats``);
* per level: stored bytes per token, and the decode of all its chunks;
* an exact load from the store at several link rates: bytes / rate plus the
  decode (the link proxy measurements in docs/adaptive.md show fetches
  reaching the link's rate), against the recompute.

Writes JSON (``--out``) and prints a table.

    python -m benchmarks.level_set --tokens 4096 --out benchmarks/results/level_set.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

from benchmarks.gateway_bench import real_text

LINKS_GBPS = (0.2, 1.0, 10.0, 100.0)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/level_set.json"))
    args = parser.parse_args()

    import torch

    from app.settings import Settings
    from app.threads import configure_threads, thread_budget
    from codec import DEFAULT_LEVELS, decode_chunk, encode_chunk
    from codec.levels import default_level_table
    from engine import ModelRunner, load_model

    settings = Settings()
    configure_threads(thread_budget(settings.torch_threads, settings.numba_threads), model_thread=True)
    runner = ModelRunner(load_model())
    ids = runner.tokenizer(real_text(runner.tokenizer, args.tokens + 64))["input_ids"][: args.tokens]
    chunk = settings.chunk_size

    runner.compute_kv(ids[:256])  # warm-up
    prefill = []
    for _ in range(args.repeats):
        t0 = time.perf_counter()
        with torch.inference_mode():
            runner.prefill(ids)
        prefill.append(time.perf_counter() - t0)
    recompute_s = statistics.median(prefill)
    kv = runner.compute_kv(ids)

    measured = (default_level_table().get("calibration") or {}).get("measured") or {}
    levels = []
    for level in DEFAULT_LEVELS:
        blobs = [encode_chunk(kv[:, :, :, s : s + chunk], level) for s in range(0, len(ids), chunk)]
        decode_chunk(blobs[0])  # compile and warm
        t0 = time.perf_counter()
        for blob in blobs:
            decode_chunk(blob)
        decode_s = time.perf_counter() - t0
        nbytes = sum(len(b) for b in blobs)
        levels.append(
            {
                "level": level.name,
                "lossless": level.lossless,
                "bytes": nbytes,
                "bytes_per_token": nbytes / len(ids),
                "decode_s": decode_s,
                "kl_nats_per_token": 0.0 if level.lossless else (measured.get(level.name) or {}).get("kl"),
            }
        )
    total = sum(lv["bytes"] for lv in levels)
    lossless = next(lv for lv in levels if lv["lossless"])
    best_lossy = next(lv for lv in levels if not lv["lossless"])
    links = []
    for gbps in LINKS_GBPS:
        rate = gbps * 1e9 / 8
        links.append(
            {
                "link_gbps": gbps,
                "exact_load_s": lossless["bytes"] / rate + lossless["decode_s"],
                "exact_recompute_s": recompute_s,
                "best_lossy_load_s": best_lossy["bytes"] / rate + best_lossy["decode_s"],
            }
        )
    result = {
        "benchmark": "level_set",
        "machine": {"cpus": os.cpu_count(), "device": str(runner.device), "dtype": str(runner.loaded.dtype)},
        "context_tokens": len(ids),
        "recompute_s": recompute_s,
        "levels": levels,
        "lossless_share_of_all_levels": lossless["bytes"] / total,
        "links": links,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))

    print(f"{len(ids)} tokens on {runner.device} ({runner.loaded.dtype}); recompute (prefill) {recompute_s:.2f} s\n")
    print(f"{'level':<10} {'KB/token':>9} {'share':>6} {'decode s':>9} {'KL nats/tok':>12}")
    for lv in levels:
        kl = lv["kl_nats_per_token"]
        print(
            f"{lv['level']:<10} {lv['bytes_per_token'] / 1000:>9.1f} {lv['bytes'] / total:>6.0%} "
            f"{lv['decode_s']:>9.3f} {'-' if kl is None else f'{kl:.4f}':>12}"
        )
    print(f"\n{'link':>9} {'exact: load lossless':>21} {'exact: recompute':>17} {best_lossy['level'] + ': load':>12}")
    for row in links:
        print(
            f"{row['link_gbps']:>6.1f} Gb {row['exact_load_s']:>20.2f}s {row['exact_recompute_s']:>16.2f}s "
            f"{row['best_lossy_load_s']:>11.2f}s"
        )
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
