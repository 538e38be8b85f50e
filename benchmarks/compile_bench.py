"""Does torch.compile pay on this machine? Eager against compiled parts of the model, in one process.

The engine's attention (``engine/ragged.py``) reads per-request buffers
chosen at run time, so it stays eager (``torch.compiler.disable``); what can
be compiled around it is measured here, each variant on its own:

- ``layers``: every decoder layer's forward (norms, projections, rotary
  embedding, MLP) with one compiled function shared by the layers;
- ``mlp``: every layer's MLP alone (the SiLU-and-multiply fused between the
  matmuls).

For each, the inductor cache is emptied first (``TORCHINDUCTOR_CACHE_DIR``, a
fresh temporary folder), so the compile time is what a fresh start would
pay. Then eager and compiled alternate ``--rounds`` times on decode steps of
1, 8 and 16 sequences of 40-180 tokens and a 512-token prefill chunk
(medians kept). Prints a table and writes JSON.

    python -m benchmarks.compile_bench --variants layers,mlp
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path

RESULTS_DIR = Path(__file__).resolve().parent / "results"


def run_variant(variant: str, rounds: int) -> dict:
    """In this process (a fresh one per variant, see ``main``)."""
    import torch
    from transformers import AttentionInterface

    from app.threads import configure_threads, thread_budget
    from engine import ModelRunner, load_model, ragged
    from engine.ragged import Segment

    configure_threads(thread_budget(None, None), model_thread=True)
    runner = ModelRunner(load_model("smollm2", dtype="float32"))
    runner.fused = None  # what is compiled are transformers' modules: run transformers' forward
    ids = runner.tokenizer("A long history of programming languages. " * 600)["input_ids"]
    rng = random.Random(0)

    def decode_step(batch: int):
        lengths = [rng.randint(40, 180) for _ in range(batch)]
        buffers = [runner.new_kv(n + 1) for n in lengths]
        for kv, n in zip(buffers, lengths):
            runner.forward_ragged([Segment(kv, 0, ids[:n], "none")])
        segments = [Segment(kv, n, [5], decode=True) for kv, n in zip(buffers, lengths)]
        return lambda: runner.forward_ragged(segments)

    work = {f"decode {b}": decode_step(b) for b in (1, 8, 16)}
    work["prefill 512"] = lambda: runner.forward_ragged([Segment(runner.new_kv(512), 0, ids[:512], "last")])

    layers = runner.model.model.layers
    AttentionInterface.register(ragged.ATTENTION_NAME, torch.compiler.disable(ragged.ragged_attention))
    started = time.perf_counter()
    if variant == "layers":
        shared = torch.compile(type(layers[0]).forward, dynamic=True)
        eager = [layer.forward for layer in layers]
        compiled = [(lambda layer: lambda *a, **k: shared(layer, *a, **k))(layer) for layer in layers]

        def use(on: bool) -> None:
            for layer, forward in zip(layers, compiled if on else eager):
                layer.forward = forward
    elif variant == "mlp":
        eager_mlps = [layer.mlp for layer in layers]
        compiled_mlps = [torch.compile(mlp, dynamic=True) for mlp in eager_mlps]

        def use(on: bool) -> None:
            for layer, mlp in zip(layers, compiled_mlps if on else eager_mlps):
                layer.mlp = mlp
    else:
        raise SystemExit(f"unknown variant {variant!r}")
    use(True)
    for fn in work.values():  # compiles every shape served below
        fn()
    compile_s = time.perf_counter() - started

    def timed(fn, repeats: int) -> float:
        t = time.perf_counter()
        for _ in range(repeats):
            fn()
        return (time.perf_counter() - t) / repeats * 1000

    times = {name: {"eager": [], "compiled": []} for name in work}
    for _ in range(rounds):
        for on in (False, True):
            use(on)
            for name, fn in work.items():
                times[name]["compiled" if on else "eager"].append(timed(fn, 2 if "prefill" in name else 6))
    return {
        "variant": variant,
        "compile_and_first_calls_s": round(compile_s, 1),
        "rows": [
            {
                "work": name,
                "eager_ms": round(statistics.median(t["eager"]), 1),
                "compiled_ms": round(statistics.median(t["compiled"]), 1),
            }
            for name, t in times.items()
        ],
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--variants", default="layers,mlp")
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--one", help=argparse.SUPPRESS)  # internal: run one variant, print its JSON
    p.add_argument("--out", type=Path, default=RESULTS_DIR / "compile_2cpu.json")
    args = p.parse_args()
    if args.one:
        print(json.dumps(run_variant(args.one, args.rounds)))
        return
    results = []
    for variant in args.variants.split(","):
        with tempfile.TemporaryDirectory() as cache:  # a cold inductor cache: what a fresh start pays
            env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache}
            out = subprocess.run(
                [
                    sys.executable,
                    "-m",
                    "benchmarks.compile_bench",
                    "--one",
                    variant,
                    "--rounds",
                    str(args.rounds),
                ],
                env=env,
                check=True,
                capture_output=True,
                text=True,
            ).stdout
        results.append(json.loads(out.strip().splitlines()[-1]))
    print("\n| variant | compile + first calls s | work | eager ms | compiled ms | eager / compiled |")
    print("|---|---:|---|---:|---:|---:|")
    for result in results:
        for row in result["rows"]:
            print(
                f"| {result['variant']} | {result['compile_and_first_calls_s']} | {row['work']} | "
                f"{row['eager_ms']} | {row['compiled_ms']} | {row['eager_ms'] / row['compiled_ms']:.2f} |"
            )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(
        json.dumps({"when": datetime.now().isoformat(timespec="seconds"), "results": results}, indent=2)
    )
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
