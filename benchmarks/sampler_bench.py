"""The batched sampler against the per-row sampler it replaced, on the default model's vocabulary.

For each batch size and sampling mix, one step's sampling is timed both ways
on the same logits (the default model's, at positions of a real text),
alternating ``--rounds`` times (median kept):

- ``per_row``: the sampler before batching (``per_row_sample``): a softmax,
  a full sort for top-p and ``torch.multinomial`` per row, one host sync each;
- ``batched``: ``engine.sampling.sample_batch`` over (rows, vocab).

Mixes: ``greedy``; ``temperature`` 1.0 and ``top_p`` 0.9 at temperature 0.7,
each ``seeded`` (the draw reproduces ``torch.multinomial``) and ``unseeded``.
The step loop samples on the model thread, so the time is the step's. Prints
a table, writes JSON.

    python -m benchmarks.sampler_bench --batch 1,8,16
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from datetime import datetime
from pathlib import Path

import torch

from engine.sampling import SamplingParams, make_generator, sample_batch

RESULTS_DIR = Path(__file__).resolve().parent / "results"
TEXT = (
    "Permission is hereby granted, free of charge, to any person obtaining a copy of this software "
    "and associated documentation files, to deal in the Software without restriction, including "
    "without limitation the rights to use, copy, modify, merge, publish and distribute it."
)

MIXES = {
    "greedy": SamplingParams(temperature=0.0),
    "temperature 1.0, seeded": SamplingParams(temperature=1.0, seed=1),
    "temperature 1.0, unseeded": SamplingParams(temperature=1.0),
    "top_p 0.9, seeded": SamplingParams(temperature=0.7, top_p=0.9, seed=1),
    "top_p 0.9, unseeded": SamplingParams(temperature=0.7, top_p=0.9),
}


def per_row_sample(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator) -> int:
    """The sampler before it was batched, kept as the baseline (and the tests' reference)."""
    if params.greedy:
        return int(torch.argmax(logits))
    probs = torch.softmax(logits / params.temperature, dim=-1)
    if params.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)
        keep = torch.cumsum(sorted_probs, dim=-1) - sorted_probs < params.top_p
        sorted_probs = sorted_probs * keep
        choice = torch.multinomial(sorted_probs, 1, generator=generator)
        return int(order[choice])
    return int(torch.multinomial(probs, 1, generator=generator))


def timed(fn, repeats: int) -> float:
    started = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - started) / repeats


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", default="1,8,16")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=10, help="steps per timing")
    parser.add_argument("--threads", type=int, default=2, help="torch threads (the model thread's)")
    parser.add_argument("--out", type=Path, default=RESULTS_DIR / "sampler_2cpu.json")
    args = parser.parse_args()
    from engine import ModelRunner
    from engine.loading import convert_default_model, default_cache_dir, load_model

    torch.set_num_threads(args.threads)
    runner = ModelRunner(load_model(str(convert_default_model(default_cache_dir()))))
    ids = runner.tokenizer(TEXT)["input_ids"]
    logits = runner.prefill(ids, None, want_prompt_logits=True).prompt_logits
    assert logits is not None
    vocab = logits.shape[1]
    rows_of = {b: logits[-b:].contiguous() for b in (int(x) for x in args.batch.split(","))}
    results = []
    for batch, logits in rows_of.items():
        for mix, params in MIXES.items():
            gens = [make_generator(params.seed, torch.device("cpu")) for _ in range(batch)]
            plist = [params] * batch

            def per_row() -> None:
                [per_row_sample(logits[i], params, gens[i]) for i in range(batch)]  # noqa: B023

            def batched() -> None:
                sample_batch(logits, plist, gens)  # noqa: B023

            times: dict[str, list[float]] = {"per_row": [], "batched": []}
            per_row(), batched()  # warm
            for _ in range(args.rounds):
                times["per_row"].append(timed(per_row, args.repeats))
                times["batched"].append(timed(batched, args.repeats))
            row = {k: statistics.median(v) * 1000 for k, v in times.items()}
            results.append(
                {"batch": batch, "mix": mix, "per_row_ms": row["per_row"], "batched_ms": row["batched"]}
            )
    print(f"{'rows':>4}  {'mix':<26} {'per row ms':>11} {'batched ms':>11} {'speed-up':>9}")
    for r in results:
        print(
            f"{r['batch']:>4}  {r['mix']:<26} {r['per_row_ms']:>11.2f} {r['batched_ms']:>11.2f}"
            f" {r['per_row_ms'] / r['batched_ms']:>8.1f}x"
        )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(
        json.dumps(
            {
                "when": datetime.now().isoformat(timespec="seconds"),
                "torch_threads": args.threads,
                "vocab": vocab,
                "results": results,
            },
            indent=2,
        )
    )
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
