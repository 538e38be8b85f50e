"""Issue 16, item 1: what a block table would cost the engine's attention on a CPU.

A sequence's KV is one run of pool blocks today, and a prefix it shares is
read in place as up to ``MAX_PARTS`` runs of another buffer
(``engine.ragged.Segment.shared``). A block table would let its KV lie in any
blocks: 16-token blocks, so a 4K prefix in 256 pieces. No paged kernel reads
our blocks in place on the CPU, so there are two ways to attend over them:

- ``parts``: every piece attended on its own by torch's fused flash kernel and
  merged by log-sum-exps, as shared runs are today (``_attend_parts``);
- ``gather``: the pieces copied into one contiguous buffer first, then one
  call (the copy every step, per layer: what a contiguous-KV kernel needs).

One model step on the real default model (float32, 30 layers), medians of
``--rounds`` alternating rounds:

- one decode after ``--context`` tokens held in 1, 4, 16 and ``context / 16``
  pieces (one own buffer; today's ``MAX_PARTS``; 256-token chunks; 16-token
  blocks);
- a 32-token question after the same context, the same ways;
- the gather alone: copying the pieces of one layer's K and V into one buffer,
  times 30 layers.

    python -m benchmarks.block_parts --out benchmarks/results/block_parts.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from engine import ModelRunner, load_model
from engine.loading import convert_default_model, default_cache_dir
from engine.ragged import Segment

RESULTS = Path(__file__).resolve().parent / "results"


def pieces_of(kv: torch.Tensor, tokens: int, pieces: int) -> tuple[torch.Tensor, ...]:
    """``kv``'s first ``tokens`` tokens as ``pieces`` separate buffers (copies: so no two are
    adjacent in memory, as blocks of a table need not be)."""
    size = tokens // pieces
    return tuple(kv[:, :, :, i * size : (i + 1) * size].clone() for i in range(pieces))


def step_seconds(
    runner: ModelRunner, shared: tuple[torch.Tensor, ...], own: torch.Tensor, tokens: list[int]
) -> float:
    start = sum(part.shape[3] for part in shared)
    t0 = time.perf_counter()
    runner.forward_ragged([Segment(own, start, tokens, "last", shared=shared)])
    return time.perf_counter() - t0


def step_seconds_own(runner: ModelRunner, own: torch.Tensor, start: int, tokens: list[int]) -> float:
    t0 = time.perf_counter()
    runner.forward_ragged([Segment(own, start, tokens, "last")])
    return time.perf_counter() - t0


def gather_seconds(pieces: tuple[torch.Tensor, ...], layers: int) -> float:
    """Copy every piece of each layer into one contiguous (2, heads, tokens, dim) buffer."""
    tokens = sum(p.shape[3] for p in pieces)
    shape = (2, pieces[0].shape[2], tokens, pieces[0].shape[4])
    out = torch.empty(shape, dtype=pieces[0].dtype)
    t0 = time.perf_counter()
    for layer in range(layers):
        at = 0
        for piece in pieces:
            n = piece.shape[3]
            out[:, :, at : at + n].copy_(piece[layer])
            at += n
    return time.perf_counter() - t0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--context", type=int, default=4096)
    p.add_argument("--question", type=int, default=32)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--out", type=Path)
    args = p.parse_args()
    torch.manual_seed(0)
    runner = ModelRunner(load_model(str(convert_default_model(default_cache_dir()))))
    context = args.context
    ids = torch.randint(100, 40000, (context + args.question,)).tolist()
    full = runner.new_kv(context + args.question + 1)
    runner.forward_ragged([Segment(full, 0, ids[:context], "none")])
    counts = sorted({1, 4, 16, context // 16})
    layouts = {n: pieces_of(full, context, n) for n in counts if n > 1}
    times: dict[str, dict[int, list[float]]] = {"decode": {}, "question": {}, "gather": {}}
    for _ in range(args.rounds):
        for n in counts:
            for name, tokens in (
                ("decode", ids[context : context + 1]),
                ("question", ids[context : context + args.question]),
            ):
                if n == 1:  # the whole context in the sequence's own buffer
                    own = full.clone()
                    seconds = step_seconds_own(runner, own, context, tokens)
                else:
                    own = runner.new_kv(len(tokens) + 1)
                    seconds = step_seconds(runner, layouts[n], own, tokens)
                times[name].setdefault(n, []).append(seconds)
            if n > 1:
                times["gather"].setdefault(n, []).append(gather_seconds(layouts[n], runner.num_layers))
    result = {
        "context": context,
        "question": args.question,
        "threads": torch.get_num_threads(),
        "ms": {k: {n: round(statistics.median(v) * 1000, 2) for n, v in d.items()} for k, d in times.items()},
    }
    print(f"one step after {context} tokens, ms (median of {args.rounds})")
    print(f"{'pieces':>8} {'decode':>9} {'question':>9} {'gather x30':>11}")
    for n in counts:
        gather = result["ms"]["gather"].get(n)
        print(
            f"{n:>8} {result['ms']['decode'][n]:>9} {result['ms']['question'][n]:>9} "
            f"{'-' if gather is None else gather:>11}"
        )
    out = args.out or RESULTS / "block_parts.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"written to {out}")


if __name__ == "__main__":
    main()
