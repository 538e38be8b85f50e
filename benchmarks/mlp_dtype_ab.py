"""The MLP's activations in float32 against bf16 (``LoadedModel.bf16_mlp``), in one process.

With bf16 weights, the engine's fused forward keeps the MLP's activations in
bf16 between its products where the bf16 products are not batch-invariant
anyway (AMX). This flips that switch (``ModelRunner.fused.bf16_mlp``) on one
loaded model and times, alternating ``--rounds`` times, a chunked prefill of
``--prefill`` tokens of the licence text and decode steps of 1, 8 and 16
sequences. Prints a table of the medians and their ratios, writes JSON.

    python -m benchmarks.mlp_dtype_ab --rounds 3
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from datetime import datetime
from pathlib import Path

RESULTS_DIR = Path(__file__).resolve().parent / "results"
BATCHES = (1, 8, 16)
STEPS = 15  # timed decode steps per batch and round, after 3 untimed


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prefill", type=int, default=3584, help="tokens of the timed prefill")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--out", type=Path)
    args = p.parse_args()

    from benchmarks.vs_vllm import LICENCE
    from engine import ModelRunner, load_model
    from engine.ragged import Segment

    runner = ModelRunner(load_model(dtype="bf16-weights"))
    if runner.fused is None:
        raise SystemExit("no fused forward here (bf16 weights need a CPU with native bf16)")
    ids = runner.tokenizer(LICENCE.read_text())["input_ids"][: args.prefill]

    def decode_step_s(batch: int) -> float:
        kvs = [runner.new_kv(300) for _ in range(batch)]
        for kv in kvs:
            runner.forward_ragged([Segment(kv, 0, ids[:256], "none")])
        segments = [Segment(kv, 256, [ids[257]], decode=True) for kv in kvs]
        times = []
        for i in range(3 + STEPS):
            t = time.perf_counter()
            runner.forward_ragged(segments)
            if i >= 3:
                times.append(time.perf_counter() - t)
        return statistics.median(times)

    samples: dict[str, dict[str, list[float]]] = {"float32": {}, "bfloat16": {}}
    for _ in range(args.rounds):
        for mlp, own in samples.items():
            runner.fused.bf16_mlp = mlp == "bfloat16"
            t = time.perf_counter()
            runner.prefill(ids)
            own.setdefault("prefill_s", []).append(time.perf_counter() - t)
            for batch in BATCHES:
                own.setdefault(f"decode_step_{batch}_s", []).append(decode_step_s(batch))
    medians = {mlp: {k: statistics.median(v) for k, v in own.items()} for mlp, own in samples.items()}
    ratios = {k: medians["bfloat16"][k] / medians["float32"][k] for k in medians["float32"]}

    out = args.out or RESULTS_DIR / f"mlp_dtype_ab_{datetime.now():%Y%m%d_%H%M%S}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    report = {
        "tokens": len(ids),
        "rounds": args.rounds,
        "precision_with_bf16_mlp": runner.loaded.precision,
        "medians": medians,
        "bf16_over_float32": ratios,
        "samples": samples,
    }
    out.write_text(json.dumps(report, indent=2))
    print("\n| measure | MLP in float32 | MLP in bf16 | ratio |")
    print("|---|---:|---:|---:|")
    for k, ratio in ratios.items():
        print(f"| {k} | {medians['float32'][k]:.4f} | {medians['bfloat16'][k]:.4f} | {ratio:.3f} |")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
