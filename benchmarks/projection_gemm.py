"""The decoder's projection products, through MKL and through oneDNN on a packed weight, by rows.

For each fused projection of the default model's decoder layer (query, key
and value together; output; gate and up together; down), 30 layers' worth of
random float32 weights of that shape are multiplied by a batch of rows:
``F.linear`` (MKL, what transformers' ``nn.Linear`` runs) against oneDNN's
``_linear_pointwise`` on the weights reordered once
(``engine.fused_layers.PackedWeight``). The two alternate ``--rounds``
times; medians. Prints a table, writes JSON.

    python -m benchmarks.projection_gemm --out benchmarks/results/projection_gemm_2cpu.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from datetime import datetime
from pathlib import Path

RESULTS_DIR = Path(__file__).resolve().parent / "results"

# (outputs, inputs) of SmolLM2-135M's projections, fused as engine.fused_layers fuses them
SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536)}
LAYERS = 30


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", default="1,2,4,8,16,64,512")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--out", type=Path)
    args = p.parse_args()

    import torch
    import torch.nn.functional as F

    from app.threads import configure_threads, thread_budget
    from engine.fused_layers import PACK_FOR_ROWS

    configure_threads(thread_budget(None, None), model_thread=True)
    weights = {name: [torch.randn(n, k) for _ in range(LAYERS)] for name, (n, k) in SHAPES.items()}
    packed = {
        name: [torch.ops.mkldnn._reorder_linear_weight(w, PACK_FOR_ROWS) for w in ws]
        for name, ws in weights.items()
    }
    results = []
    for rows in (int(r) for r in args.rows.split(",")):
        row: dict = {"rows": rows}
        for name, (_, k) in SHAPES.items():
            x = torch.randn(rows, k)

            def mkl(name=name, x=x) -> None:
                for w in weights[name]:
                    F.linear(x, w)

            def onednn(name=name, x=x) -> None:
                for w in packed[name]:
                    torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], "")

            repeats = 1 if rows >= 64 else 3
            times: dict[str, list[float]] = {"mkl": [], "onednn": []}
            with torch.inference_mode():
                for _ in range(args.rounds):
                    for label, fn in (("mkl", mkl), ("onednn", onednn)):
                        fn()
                        started = time.perf_counter()
                        for _ in range(repeats):
                            fn()
                        times[label].append((time.perf_counter() - started) / repeats * 1000)
            row[name] = {label: round(statistics.median(t), 2) for label, t in times.items()}
        results.append(row)
        print(row, flush=True)

    out = args.out or RESULTS_DIR / f"projection_gemm_{datetime.now():%Y%m%d_%H%M%S}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(
        json.dumps({"threads": torch.get_num_threads(), "layers": LAYERS, "rows": results}, indent=2)
    )
    print(f"\nms for {LAYERS} layers, MKL / oneDNN packed\n")
    print("| rows | " + " | ".join(SHAPES) + " | all four |")
    print("|---:|" + "---:|" * (len(SHAPES) + 1))
    for row in results:
        cells = [f"{row[n]['mkl']} / {row[n]['onednn']}" for n in SHAPES]
        mkl, onednn = (sum(row[n][label] for n in SHAPES) for label in ("mkl", "onednn"))
        print(f"| {row['rows']} | " + " | ".join(cells) + f" | {mkl:.1f} / {onednn:.1f} |")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
