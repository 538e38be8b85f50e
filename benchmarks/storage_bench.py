"""Storage benchmark: S3Store vs plain boto3 on a real SeaweedFS, the LRU hit path, LocalStore,
and the two chunk layouts for streaming.

    PYTHONPATH=. python -m benchmarks.storage_bench [--quick] [--out FILE]

Starts its own SeaweedFS (tests/support/seaweed.py) on free loopback ports and
stops it at the end. S3Store and boto3 run in the same process against the
same server on the same objects, their calls interleaved, so the ratio between
them holds even on a machine shared with other jobs; the absolute figures do not.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime
from pathlib import Path

from benchmarks.stats import percentile
from storage.local import LocalStore
from storage.memory import MemoryStore
from storage.s3 import S3Store
from storage.tiered import LRUCacheStore
from tests.support.seaweed import SeaweedServer

MB = 1_000_000
# The default model (SmolLM2-135M): 30 layers x (K, V) x 3 KV heads x 64 dims = 11,520 values
# per token; a 256-token chunk is 2.95 M values.
CHUNK_VALUES = 256 * 11_520
SIZES = {
    "fp32_raw": CHUNK_VALUES * 4,  # 11.8 MB
    "int8_raw": CHUNK_VALUES,  # 2.95 MB
    "coded_4bit": CHUNK_VALUES // 2,  # 1.47 MB
    "coded_1.2bit": 450_000,  # ~0.45 MB: a CacheGen-class compressed chunk
}
LEVEL_SIZES = [150_000, 300_000, 450_000, 750_000]  # four quality levels of one chunk, low to high
CHUNKS = 32


def summary(samples: list[float], nbytes: int) -> dict[str, float]:
    total = sum(samples)
    return {
        "n": len(samples),
        "p50_ms": percentile(samples, 50) * 1e3,
        "p99_ms": percentile(samples, 99) * 1e3,
        "mean_ms": statistics.fmean(samples) * 1e3,
        "mb_per_s": nbytes * len(samples) / total / MB,
    }


def timed(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def interleaved(calls: dict[str, Callable[[int], object]], repeats: int) -> dict[str, list[float]]:
    """Run each named call ``repeats`` times, alternating names (and their order) every round."""
    names = list(calls)
    samples: dict[str, list[float]] = {n: [] for n in names}
    for i in range(repeats):
        order = names if i % 2 == 0 else names[::-1]
        for name in order:
            samples[name].append(timed(lambda name=name: calls[name](i)))
    return samples


def bench_s3_vs_boto3(server: SeaweedServer, bucket: str, repeats: dict[str, int]) -> dict[str, object]:
    store = S3Store(bucket, "bench", endpoint_url=server.endpoint_url,
                    access_key=server.access_key, secret_key=server.secret_key)
    # Plain boto3 with the settings S3Store uses, so the difference is S3Store's own code.
    import boto3

    boto = boto3.client("s3", endpoint_url=server.endpoint_url, aws_access_key_id=server.access_key,
                        aws_secret_access_key=server.secret_key, config=store._client.meta.config)
    results: dict[str, object] = {}
    for label, size in SIZES.items():
        n = repeats[label]
        blobs = [os.urandom(size) for _ in range(2)]
        put = interleaved({
            "boto3": lambda i: boto.put_object(Bucket=bucket, Key=f"bench/raw/{label}/{i}", Body=blobs[i % 2]),
            "s3store": lambda i: store.put(f"s3s/{label}/{i}", blobs[i % 2]),
        }, n)
        # Both read the same objects (written by boto3 above).
        get = interleaved({
            "boto3": lambda i: boto.get_object(Bucket=bucket, Key=f"bench/raw/{label}/{i}")["Body"].read(),
            "s3store": lambda i: store.get(f"raw/{label}/{i}"),
        }, n)
        row = {
            "size_bytes": size,
            "put": {k: summary(v, size) for k, v in put.items()},
            "get": {k: summary(v, size) for k, v in get.items()},
        }
        for op, samples in (("put", put), ("get", get)):
            ops = row[op]
            ops["s3store_over_boto3_p50"] = ops["s3store"]["p50_ms"] / ops["boto3"]["p50_ms"]  # type: ignore[index]
            ops["s3store_over_boto3_mean"] = ops["s3store"]["mean_ms"] / ops["boto3"]["mean_ms"]  # type: ignore[index]
            # Each round's two calls ran back to back: the median of their ratios cancels the
            # load that other jobs put on the machine better than a ratio of two medians.
            paired = [mine / plain for mine, plain in zip(samples["s3store"], samples["boto3"], strict=True)]
            ops["s3store_over_boto3_paired_median"] = statistics.median(paired)  # type: ignore[index]
        results[label] = row
    results["parallel_get_32"] = bench_parallel_get(store, boto, bucket)
    results["put_variants_fp32"] = bench_put_variants(store, boto, bucket, repeats["fp32_raw"])
    results["lookup_32"] = bench_lookup(store, repeats["coded_1.2bit"])
    store.close()
    return results


def bench_parallel_get(store: S3Store, boto: object, bucket: str) -> dict[str, object]:
    """32 compressed chunks fetched at once: get_many vs boto3 on a pool of the same size."""
    size = SIZES["coded_1.2bit"]
    keys = [f"par/{i:02d}" for i in range(CHUNKS)]
    for key in keys:
        store.put(key, os.urandom(size))
    pool = ThreadPoolExecutor(32)

    def boto_many(_: int) -> list[bytes]:
        fetch = lambda k: boto.get_object(Bucket=bucket, Key=f"bench/{k}")["Body"].read()  # noqa: E731
        return list(pool.map(fetch, keys))

    samples = interleaved({
        "boto3_pool32": boto_many,
        "s3store_get_many": lambda _: store.get_many(keys),
        "s3store_sequential": lambda _: [store.get(k) for k in keys],
    }, 8)
    pool.shutdown()
    return {name: summary(v, size * CHUNKS) for name, v in samples.items()}


def bench_put_variants(store: S3Store, boto: object, bucket: str, n: int) -> dict[str, object]:
    """Large puts: bytes body, a memoryview streamed in place, and s3transfer's multipart upload."""
    import io

    from boto3.s3.transfer import TransferConfig

    size = SIZES["fp32_raw"]
    blob = os.urandom(size)
    view = memoryview(bytearray(blob))
    multipart = TransferConfig(multipart_threshold=8 * 1024 * 1024, max_concurrency=4)
    samples = interleaved({
        "put_object_bytes": lambda i: store.put(f"pv/b{i}", blob),
        "put_memoryview_stream": lambda i: store.put(f"pv/m{i}", view),
        "upload_fileobj_multipart": lambda i: boto.upload_fileobj(
            io.BytesIO(view), bucket, f"bench/pv/u{i}", Config=multipart),
    }, n)
    return {name: summary(v, size) for name, v in samples.items()}


def bench_lookup(store: S3Store, n: int) -> dict[str, object]:
    """Is a 32-chunk prompt stored? exists_many over its chunk keys, all present or all absent,
    beside the one round trip of a single manifest lookup."""
    keys = [f"par/{i:02d}" for i in range(CHUNKS)]
    absent = [f"absent/{i:02d}" for i in range(CHUNKS)]
    samples = interleaved({
        "exists_many_hit": lambda _: store.exists_many(keys),
        "exists_many_miss": lambda _: store.exists_many(absent),
        "one_head_hit": lambda _: store.head(keys[0]),
        "one_head_miss": lambda _: store.head(absent[0]),
    }, n)
    return {name: {"p50_ms": percentile(v, 50) * 1e3, "p99_ms": percentile(v, 99) * 1e3} for name, v in samples.items()}


def bench_local_and_lru(repeats: int) -> dict[str, object]:
    results: dict[str, object] = {}
    with tempfile.TemporaryDirectory(prefix="storage-bench-") as tmp:
        local = LocalStore(tmp)
        lru = LRUCacheStore(MemoryStore(), capacity_bytes=200 * MB)
        for label in ("fp32_raw", "coded_1.2bit"):
            size = SIZES[label]
            blob = os.urandom(size)
            puts = interleaved({
                "local": lambda i: local.put(f"{label}/{i}", blob),
                "lru": lambda i: lru.put(f"{label}/{i}", blob),
            }, repeats)
            gets = interleaved({
                "local": lambda i: local.get(f"{label}/{i}"),
                "lru_hit": lambda i: lru.get(f"{label}/{i}"),
                "lru_hit_range": lambda i: lru.get_range(f"{label}/{i}", size // 3, size // 4),
            }, repeats)
            results[label] = {
                "size_bytes": size,
                "put": {k: summary(v, size) for k, v in puts.items()},
                "get": {k: summary(v, size if k != "lru_hit_range" else size // 4) for k, v in gets.items()},
            }
    return results


def bench_layout(server: SeaweedServer, bucket: str, rounds: int) -> dict[str, object]:
    """Streaming level X of 32 chunks: one object per (chunk, level), or one object per chunk with
    its levels at byte ranges (offsets known from the manifest, so no index read)."""
    store = S3Store(bucket, "layout", endpoint_url=server.endpoint_url,
                    access_key=server.access_key, secret_key=server.secret_key)
    offsets = [sum(LEVEL_SIZES[:i]) for i in range(len(LEVEL_SIZES))]
    write: dict[str, float] = {}
    start = time.perf_counter()
    for c in range(CHUNKS):
        for level, size in enumerate(LEVEL_SIZES):
            store.put(f"split/{c:02d}/L{level}", os.urandom(size))
    write["per_level_objects_s"] = time.perf_counter() - start
    start = time.perf_counter()
    for c in range(CHUNKS):
        store.put(f"packed/{c:02d}", os.urandom(sum(LEVEL_SIZES)))
    write["packed_objects_s"] = time.perf_counter() - start

    def split_one(c: int, level: int) -> bytes:
        return store.get(f"split/{c:02d}/L{level}")

    def packed_one(c: int, level: int) -> bytes:
        return store.get_range(f"packed/{c:02d}", offsets[level], LEVEL_SIZES[level])

    pool = ThreadPoolExecutor(CHUNKS)
    results: dict[str, object] = {"write": write, "level_sizes": LEVEL_SIZES, "chunks": CHUNKS}
    for level in (0, len(LEVEL_SIZES) - 1):
        nbytes = LEVEL_SIZES[level] * CHUNKS
        samples = interleaved({
            "per_level_objects_parallel": lambda _: list(pool.map(lambda c: split_one(c, level), range(CHUNKS))),
            "packed_ranges_parallel": lambda _: list(pool.map(lambda c: packed_one(c, level), range(CHUNKS))),
            # A streamer that picks each chunk's level from the throughput it just saw fetches
            # chunk by chunk: here the per-request latency is what counts.
            "per_level_objects_sequential": lambda _: [split_one(c, level) for c in range(CHUNKS)],
            "packed_ranges_sequential": lambda _: [packed_one(c, level) for c in range(CHUNKS)],
        }, rounds)
        results[f"level_{level}"] = {name: summary(v, nbytes) for name, v in samples.items()}
        chunk_latency: dict[str, list[float]] = {"per_level_object": [], "packed_range": []}
        for _ in range(rounds):
            for c in range(CHUNKS):
                chunk_latency["per_level_object"].append(timed(lambda: split_one(c, level)))
                chunk_latency["packed_range"].append(timed(lambda: packed_one(c, level)))
        results[f"level_{level}_per_chunk"] = {
            k: summary(v, LEVEL_SIZES[level]) for k, v in chunk_latency.items()
        }
    pool.shutdown()
    store.close()
    return results


def print_tables(report: dict[str, object]) -> None:
    s3 = report["s3_vs_boto3"]  # type: ignore[index]
    print(f"\n{'size':>14} {'op':>4} {'boto3 MB/s':>11} {'S3Store MB/s':>13} {'p50 ms b/s':>14} "
          f"{'p99 ms b/s':>16} {'ratio p50':>10} {'paired':>7}")
    for label in SIZES:
        row = s3[label]  # type: ignore[index]
        for op in ("put", "get"):
            b, s = row[op]["boto3"], row[op]["s3store"]
            print(f"{label:>14} {op:>4} {b['mb_per_s']:11.0f} {s['mb_per_s']:13.0f} "
                  f"{b['p50_ms']:6.1f}/{s['p50_ms']:6.1f} {b['p99_ms']:7.1f}/{s['p99_ms']:7.1f} "
                  f"{row[op]['s3store_over_boto3_p50']:10.3f} {row[op]['s3store_over_boto3_paired_median']:7.3f}")
    print("\n32 x coded chunks, all at once:")
    for name, v in s3["parallel_get_32"].items():  # type: ignore[index]
        print(f"  {name:>22}: p50 {v['p50_ms']:7.1f} ms  {v['mb_per_s']:6.0f} MB/s")
    print("\nput of one fp32 chunk (11.8 MB):")
    for name, v in s3["put_variants_fp32"].items():  # type: ignore[index]
        print(f"  {name:>26}: p50 {v['p50_ms']:7.1f} ms  {v['mb_per_s']:6.0f} MB/s")
    print("\nlookup of a 32-chunk prompt:")
    for name, v in s3["lookup_32"].items():  # type: ignore[index]
        print(f"  {name:>18}: p50 {v['p50_ms']:6.2f} ms  p99 {v['p99_ms']:6.2f} ms")
    print("\nlocal directory and LRU hits:")
    for label, row in report["local_and_lru"].items():  # type: ignore[union-attr]
        for op in ("put", "get"):
            for name, v in row[op].items():
                print(f"  {label:>14} {op:>4} {name:>14}: p50 {v['p50_ms']:8.3f} ms  {v['mb_per_s']:8.0f} MB/s")
    layout = report["layout"]
    print(f"\nlayout, level X of {CHUNKS} chunks (levels {LEVEL_SIZES} bytes):")
    for key, rows in layout.items():  # type: ignore[union-attr]
        if key.startswith("level_") and isinstance(rows, dict):
            for name, v in rows.items():
                print(f"  {key:>20} {name:>30}: p50 {v['p50_ms']:7.2f} ms  p99 {v['p99_ms']:7.2f} ms  "
                      f"{v['mb_per_s']:6.0f} MB/s")
    print(f"  write: {layout['write']}")  # type: ignore[index]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path,
                        default=Path(__file__).parent / "results" / f"storage-{datetime.now(UTC):%Y%m%dT%H%M%S}.json")
    parser.add_argument("--quick", action="store_true", help="fewer repeats (a smoke run)")
    args = parser.parse_args()
    scale = 0.25 if args.quick else 1.0
    repeats = {label: max(4, int(n * scale)) for label, n in
               {"fp32_raw": 16, "int8_raw": 32, "coded_4bit": 60, "coded_1.2bit": 100}.items()}

    report: dict[str, object] = {
        "when": datetime.now(UTC).isoformat(timespec="seconds"),
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(), "platform": platform.platform()},
        "repeats": repeats,
        "note": "loopback SeaweedFS on a shared 2-core machine: compare ratios from the same run",
    }
    with SeaweedServer() as server:
        bucket = server.create_bucket("bench")
        report["seaweedfs_endpoint"] = server.endpoint_url
        report["s3_vs_boto3"] = bench_s3_vs_boto3(server, bucket, repeats)
        report["layout"] = bench_layout(server, bucket, max(2, int(6 * scale)))
    report["local_and_lru"] = bench_local_and_lru(max(4, int(20 * scale)))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2))
    print_tables(report)
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
