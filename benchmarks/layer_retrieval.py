"""Which layers' coding noise costs a level its pass-key retrieval (issue 18: pass-key at `medium`).

    python -m benchmarks.layer_retrieval --level medium --trials 8 \\
        --out benchmarks/results/layer_retrieval_medium.json

The calibration sets each layer's step by the KL of a prose continuation (``app/calibrate.py``,
step 2), which does not exercise retrieval over a long context. This asks retrieval directly:
for each pass-key trial, the context's KV is coded at the level, then one layer at a time is put
back exact, and the answer's NLL (teacher-forced after the question,
``engine.quality.passkey_answer_nll``) is read each way. A layer whose exact KV brings the NLL
well down is one whose noise the level cannot afford there: ``python -m app calibrate
--finer-layer LAYER=FACTOR`` gives it a finer step.

The trials' seeds start at ``--seed`` (10,000 by default), apart from the 0..35 of
``benchmarks/codec_quality.py`` and ``benchmarks/kv_balance.py``, so the layers found here are
not chosen on the trials that then score them. Everything is on the default model.
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import sys
import time
from pathlib import Path

import numpy as np

from app.calibrate import round_trip_chunks
from benchmarks.codec_quality import passkey_lengths
from codec.levels import DEFAULT_LEVELS, level_by_name, load_level_table

log = logging.getLogger("layer_retrieval")


def run(args: argparse.Namespace) -> dict:
    from engine import ModelRunner, load_model
    from engine.quality import passkey_answer_nll, passkey_task

    runner = ModelRunner(load_model())
    levels = DEFAULT_LEVELS
    if args.levels_file:
        levels = load_level_table(json.loads(args.levels_file.read_text()), args.levels_file.parent)
    level = level_by_name(args.level, levels)
    layers = runner.num_layers
    trials = []
    for i, n in enumerate(passkey_lengths(args.trials)):
        t0 = time.monotonic()
        task = passkey_task(runner, n, seed=args.seed + i)
        kv = runner.compute_kv(task.context_ids)
        coded = round_trip_chunks(kv, level)[0].to(kv.dtype)
        exact_layer = []
        for layer in range(layers):
            mixed = coded.clone()
            mixed[layer] = kv[layer]
            exact_layer.append(passkey_answer_nll(runner, task, mixed))
        trials.append(
            {
                "seed": args.seed + i,
                "tokens": len(task.context_ids),
                "lossless": passkey_answer_nll(runner, task, kv),
                "level": passkey_answer_nll(runner, task, coded),
                "exact_layer": exact_layer,
            }
        )
        log.info("trial %d (%d tokens) in %.0f s", i, len(task.context_ids), time.monotonic() - t0)
    gains = np.array([[t["level"] - x for x in t["exact_layer"]] for t in trials])  # (trials, layers)
    # the spread of a mean over the trials: a gain within about 2 of these is noise
    errors = gains.std(axis=0, ddof=1) / np.sqrt(len(trials)) if len(trials) > 1 else [None] * layers
    per_layer = [
        {
            "layer": layer,
            "nll_gain": float(gains[:, layer].mean()),
            "standard_error": None if errors[layer] is None else float(errors[layer]),
        }
        for layer in range(layers)
    ]
    return {
        "level": args.level,
        "trials": trials,
        "lossless_nll": statistics.fmean(t["lossless"] for t in trials),
        "level_nll": statistics.fmean(t["level"] for t in trials),
        "layers": sorted(per_layer, key=lambda r: -r["nll_gain"]),
    }


def print_table(result: dict, top: int) -> None:
    print(
        f"level {result['level']}, {len(result['trials'])} pass-key trials: answer NLL lossless "
        f"{result['lossless_nll']:.3f}, coded {result['level_nll']:.3f} (default model)"
    )
    print("| layer exact | NLL gain | standard error |")
    print("|---:|---:|---:|")
    for row in result["layers"][:top]:
        se = "-" if row["standard_error"] is None else f"{row['standard_error']:.3f}"
        print(f"| {row['layer']} | {row['nll_gain']:+.3f} | {se} |")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--level", default="medium")
    parser.add_argument("--levels-file", type=Path, help="the level table (default: the shipped one)")
    parser.add_argument("--trials", type=int, default=8)
    parser.add_argument("--seed", type=int, default=10_000)
    parser.add_argument("--top", type=int, default=8, help="layers to print")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/layer_retrieval.json"))
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    result = run(args)
    print_table(result, args.top)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
