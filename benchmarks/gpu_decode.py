"""GPU decode: the Triton decoder's throughput, and that it matches the CPU decoder bit for bit.

    python -m benchmarks.gpu_decode --out benchmarks/results/gpu_decode.json   # a CUDA machine
    TRITON_INTERPRET=1 python -m benchmarks.gpu_decode --smoke                  # CPU, tiny: it runs

Random KV (channels of different spreads) is encoded at each lossy level as
256-token chunks of two shapes: a 7B-class model (32 layers, 8 KV heads x
128) and the default model (30 layers, 3 KV heads x 64). A batch of 16
chunks (4 distinct ones, repeated) is decoded into a bfloat16 slice of a
bigger cache buffer, as the loader does, and checked against the numba
decoder's float32 output cast to bfloat16, bit for bit, with the rest of the
buffer untouched. Times are CUDA-event medians after a warm-up: ``kernel``
with the batch already on the device (the launches and the status read),
``from bytes`` with the parse and the upload. GB/s are of fp16-equivalent
output (values x 2 bytes / time), next to the device's copy bandwidth
(device-to-device, read + write) and torch dequantizing an int8 tensor of the
same shape (``codes.float() * scale`` to fp16). The shipped encoder's stream
count (``DEFAULT_GROUPS`` = 2 per head) is measured against 8, with the size
it costs, and the lanes per program against 64 and 256.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

SHAPES = {"7b": (32, 8, 128), "default": (30, 3, 64)}  # layers, kv heads, head_dim
SMOKE_SHAPES = {"tiny": (2, 2, 16)}
# Uncalibrated steps (fractions of each channel's spread) that give about the bits of the
# default table's high / medium / low on Gaussian KV: ~4.5, ~2.2 and ~1.2 bits per value.
STEPS = {"high": 0.18, "medium": 0.9, "low": 1.8}
TARGET_GBPS = 100  # fp16-equivalent output of a 16-chunk batch of the 7B shape, on an H200


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--out", type=Path, help="JSON results (default on a GPU: benchmarks/results/gpu_decode.json)"
    )
    parser.add_argument(
        "--smoke", action="store_true", help="tiny shapes, on the CPU under TRITON_INTERPRET=1"
    )
    parser.add_argument("--tokens", type=int, default=256, help="tokens per chunk")
    parser.add_argument("--batch", type=int, default=16, help="chunks per launch")
    parser.add_argument(
        "--distinct", type=int, default=4, help="distinct chunks in a batch (encoding is slow)"
    )
    parser.add_argument("--repeat", type=int, default=20)
    parser.add_argument("--dtype", choices=["bfloat16", "float16"], default="bfloat16")
    args = parser.parse_args()
    if args.smoke:
        args.tokens, args.batch, args.distinct, args.repeat = 8, 3, 2, 2
    return args


def levels(groups: int) -> dict:
    from codec import Level, Scheme
    from codec.quantized import QuantParams

    out = {
        name: Level(name, Scheme.QUANT, False, QuantParams(key_step=(s,), value_step=(s,), groups=groups))
        for name, s in STEPS.items()
    }
    if groups == 2:
        out["int8"] = Level("int8", Scheme.INT8, lossless=False)
    return out


def random_kv(shape: tuple[int, int, int], tokens: int, seed: int) -> torch.Tensor:
    layers, heads, dim = shape
    g = torch.Generator().manual_seed(seed)
    kv = torch.randn(layers, 2, heads, tokens, dim, generator=g)
    kv[:, 0] *= torch.logspace(-1, 1, dim)  # key channels of very different spreads, as in real keys
    kv[:, 0] += torch.linspace(-2, 2, dim)
    kv[:, :, :, 0] *= 8.0  # a sink-like first token
    return kv


class Timer:
    def __init__(self, device: torch.device, repeat: int) -> None:
        self.device = device
        self.repeat = repeat

    def __call__(self, fn, wall: bool = False, repeat: int | None = None) -> float:
        """Median seconds of ``fn()`` after one warm-up call: CUDA events on a GPU, unless ``wall``
        (host work inside: the parse); ``fn`` must end synchronised if ``wall``."""
        fn()
        times = []
        for _ in range(repeat or self.repeat):
            if self.device.type == "cuda" and not wall:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                fn()
                end.record()
                torch.cuda.synchronize()
                times.append(start.elapsed_time(end) / 1000)
            else:
                t = time.perf_counter()
                fn()
                times.append(time.perf_counter() - t)
        return statistics.median(times)


def gbps(values: int, seconds: float) -> float:
    return float(f"{2 * values / seconds / 1e9:.4g}")


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int16 if t.element_size() == 2 else torch.int32)


def run_case(args, device, dtype, timer, shape, level, backends) -> dict:
    from codec import decode_chunk, encode_chunk, parse_chunks
    from codec.triton_backend import upload

    distinct = [encode_chunk(random_kv(shape, args.tokens, seed), level) for seed in range(args.distinct)]
    chunks = [distinct[i % len(distinct)] for i in range(args.batch)]
    batch = parse_chunks(chunks)
    layers, _, heads, tokens, dim = batch.shape
    pad = 128 if not args.smoke else 2
    buffer = torch.full((layers, 2, heads, tokens + 2 * pad, dim), -3.0, dtype=dtype, device=device)
    out = buffer[:, :, :, pad : pad + tokens]
    row = {"level": level.name, "groups": level.quant.groups if level.quant else None}
    for lanes, backend in backends.items():
        dev = upload(batch, out)
        seconds = timer(lambda b=backend, d=dev: b.launch(d, out))
        row[f"kernel_s_lanes{lanes}"] = seconds
        row[f"kernel_gbps_lanes{lanes}"] = gbps(out.numel(), seconds)
    backend = backends[min(backends, key=lambda n: row[f"kernel_s_lanes{n}"])]
    # the launch reads the streams' status back, so it ends synchronised
    row["from_bytes_s"] = timer(
        lambda: backend.decode_into(parse_chunks(chunks), out), wall=True, repeat=max(3, args.repeat // 4)
    )
    row["from_bytes_gbps"] = gbps(out.numel(), row["from_bytes_s"])
    got = buffer.cpu()
    exact = bool((got[:, :, :, :pad] == -3).all() and (got[:, :, :, pad + tokens :] == -3).all())
    for k, data in enumerate(distinct):
        ref = decode_chunk(data).to(dtype)
        for start in range(k * args.tokens, tokens, len(distinct) * args.tokens):
            exact &= torch.equal(bits(got[:, :, :, pad + start : pad + start + args.tokens]), bits(ref))
    values_per_chunk = layers * 2 * heads * args.tokens * dim
    row.update(
        chunks=args.batch,
        values=out.numel(),
        streams=sum(c.body.streams for c in batch.chunks if hasattr(c.body, "streams")),
        bits_per_value=round(8 * float(np.mean([len(d) for d in distinct])) / values_per_chunk, 4),
        bit_exact=exact,
        best_lanes=min(backends, key=lambda n: row[f"kernel_s_lanes{n}"]),
    )
    row["kernel_gbps"] = row[f"kernel_gbps_lanes{row['best_lanes']}"]
    return row


def baselines(device, dtype, timer, shape, tokens: int) -> dict:
    """Torch dequantizing int8 of the same shape, and the device's copy bandwidth."""
    layers, heads, dim = shape
    codes = torch.randint(-127, 128, (layers, 2, heads, tokens, dim), dtype=torch.int8, device=device)
    scale = torch.rand(layers, 2, 1, tokens, 1, device=device)
    seconds = timer(lambda: (codes.float() * scale).to(torch.float16))
    out = {"torch_int8_dequant_s": seconds, "torch_int8_dequant_gbps": gbps(codes.numel(), seconds)}
    if device.type == "cuda":
        src = torch.empty(1 << 30, dtype=torch.uint8, device=device)
        dst = torch.empty_like(src)
        copy_s = timer(lambda: dst.copy_(src))
        out["copy_gbps_read_plus_write"] = round(2 * src.numel() / copy_s / 1e9, 1)
        props = torch.cuda.get_device_properties(device)
        clock, width = getattr(props, "memory_clock_rate", None), getattr(props, "memory_bus_width", None)
        if clock and width:  # kHz, bits; double data rate
            out["spec_gbps"] = round(2 * clock * 1e3 * width / 8 / 1e9, 1)
    return out


def device_info(device: torch.device) -> dict:
    if device.type != "cuda":
        return {"device": "cpu (Triton interpreter)", "interpreted": True}
    props = torch.cuda.get_device_properties(device)
    return {
        "device": props.name,
        "sms": props.multi_processor_count,
        "memory_gib": props.total_memory / 2**30,
    }


def main() -> None:
    args = parse_args()
    if not torch.cuda.is_available():
        if not args.smoke:
            sys.exit(
                "gpu_decode: no CUDA device. This benchmark needs a GPU; to check that it runs on a CPU: "
                "TRITON_INTERPRET=1 python -m benchmarks.gpu_decode --smoke"
            )
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before Triton is imported
    import triton

    from codec.triton_backend import TritonBackend

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cpu" and not triton.knobs.runtime.interpret:
        sys.exit("gpu_decode --smoke on a CPU needs TRITON_INTERPRET=1 set before Triton is imported")
    dtype = getattr(torch, args.dtype)
    timer = Timer(device, args.repeat)
    lanes = (1024,) if device.type == "cpu" else (64, 128, 256)
    backends = {n: TritonBackend(n) for n in lanes}
    result: dict = {"config": {k: str(v) for k, v in vars(args).items()}, **device_info(device), "shapes": {}}
    shapes = SMOKE_SHAPES if args.smoke else SHAPES
    for name, shape in shapes.items():
        rows = []
        for groups in (2, 8):
            for level in levels(groups).values():
                rows.append(run_case(args, device, dtype, timer, shape, level, backends))
                print(f"{name} {rows[-1]['level']} G={groups}: done", file=sys.stderr)
        result["shapes"][name] = {
            "shape": shape,
            "cases": rows,
            **baselines(device, dtype, timer, shape, args.batch * args.tokens),
        }
    if "7b" in result["shapes"]:
        medium = [c for c in result["shapes"]["7b"]["cases"] if c["level"] == "medium"]
        result["target"] = {
            "gbps": TARGET_GBPS,
            "medium_g2": medium[0]["kernel_gbps"],
            "medium_g8": medium[1]["kernel_gbps"],
        }
    report(result, args)
    out = args.out or (None if args.smoke else Path("benchmarks/results/gpu_decode.json"))
    if out:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=1) + "\n")
        print(f"wrote {out}")
    if not all(c["bit_exact"] for s in result["shapes"].values() for c in s["cases"]):
        sys.exit("gpu_decode: the GPU decoder does not match the CPU decoder")


def report(result: dict, args) -> None:
    print(f"{result['device']}: {args.batch} chunks of {args.tokens} tokens per launch, into {args.dtype}")
    if "target" in result:
        t = result["target"]
        print(f"target >= {t['gbps']} GB/s (7b, medium): G=2 {t['medium_g2']}, G=8 {t['medium_g8']} GB/s")
    for name, s in result["shapes"].items():
        layers, heads, dim = s["shape"]
        copy = s.get("copy_gbps_read_plus_write")
        print(
            f"\n{name}: {layers} layers x {heads} KV heads x {dim}; device copy {copy} GB/s, "
            f"spec {s.get('spec_gbps')} GB/s; torch int8 dequant {s['torch_int8_dequant_gbps']} GB/s"
        )
        print("| level | G | streams | bits/value | kernel GB/s (best lanes) | from bytes GB/s | bit-exact |")
        print("|---|---|---|---|---|---|---|")
        for c in s["cases"]:
            print(
                f"| {c['level']} | {c['groups'] or '-'} | {c['streams']} | {c['bits_per_value']} | "
                f"{c['kernel_gbps']} ({c['best_lanes']}) | {c['from_bytes_gbps']} | {c['bit_exact']} |"
            )


if __name__ == "__main__":
    main()
