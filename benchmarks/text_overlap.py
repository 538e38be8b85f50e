"""Text chunks of a load prefilling while the store chunks after them decode, against waiting for them.

    python -m benchmarks.text_overlap --out benchmarks/results/text_overlap.json

One gateway built in this process (``app.build``, the embedded defaults, a local
store in a temporary directory) stores a 4K-token context once. Each round loads
it as a request's prepare thread does (``PrefixLoader.load`` on a thread with the
gateway's thread budget, text chunks prefilled on the step loop), with a plan fixed
to ``k`` text chunks first and the rest at ``--level``, the shape the planner picks
on a slow link under a budget. Two targets, alternating round by round:

* ``overlapped``: the loader's own (``LoopTarget``): it starts a text run and goes
  on decoding the store chunks after it;
* ``blocking``: the same target, waiting for each text run before it returns, as
  the loader did before (issue 16: "no thread blocks on text-chunk prefill").

Both must give the same KV (checked). Prints the median load time per ``k`` and
the ratio, and writes JSON.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import sysconfig
import tempfile
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import torch

import scheduler.loader as loader_module
from app.build import build_gateway
from app.settings import Settings
from app.threads import thread_budget, worker_initializer
from scheduler.executor import LoopTarget
from scheduler.planner import TEXT, Plan
from scheduler.prefix_load import KVRequest
from scheduler.stored import find_stored_prefix


class BlockingTarget:
    """``LoopTarget`` that returns from a text run only when it is prefilled."""

    def __init__(self, target: LoopTarget) -> None:
        self.target = target

    def new_kv(self, tokens: int) -> torch.Tensor:
        return self.target.new_kv(tokens)

    def start_prefill(
        self, kv: torch.Tensor, start: int, token_ids: list[int], after: Future[bool] | None = None
    ) -> Future[bool]:
        future = self.target.start_prefill(kv, start, token_ids, after)
        future.result()
        return future


def fixed_plan(text_chunks: int, level: str):
    """``plan`` for ``scheduler.loader``: ``text_chunks`` text chunks first, ``level`` after; its
    re-plans keep ``level``."""
    calls = []

    def planned(inputs):
        n = len(inputs.chunks)
        text = 0 if calls else min(text_chunks, n)
        calls.append(n)
        return Plan([TEXT] * text + [level] * (n - text), 0.0, 0.0)

    return planned


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/text_overlap.json"))
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--text-chunks", default="1,2,4", help="text chunks first, comma-separated")
    parser.add_argument("--level", default="medium")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args(argv)

    with tempfile.TemporaryDirectory() as root:
        settings = Settings(store=f"file://{root}/store", write_back=False)
        gateway = build_gateway(settings)
        try:
            result = run(gateway, args)
        finally:
            gateway.loop.stop()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(
        f"{args.tokens} tokens, plan: k text chunks, then {args.level}; median load seconds of {args.rounds}"
    )
    print(f"{'k':>3s} {'blocking':>9s} {'overlapped':>10s} {'blocking/overlapped':>20s}")
    for k, row in result["rows"].items():
        print(f"{k:>3s} {row['blocking_s']:9.3f} {row['overlapped_s']:10.3f} {row['ratio']:20.2f}")
    return 0


def run(gateway, args: argparse.Namespace) -> dict:
    runner, contexts, loader = gateway.runner, gateway.contexts, gateway.executor.loader
    text = (Path(sysconfig.get_paths()["stdlib"]) / "LICENSE.txt").read_text()
    ids = runner.tokenizer(text, add_special_tokens=False)["input_ids"][: args.tokens]
    level = next(lv for lv in gateway.table.levels if lv.name == args.level)
    contexts.save(ids, runner.compute_kv(ids), [level], 0.0)
    keys = contexts.keys(ids)
    stored = find_stored_prefix(contexts.store, contexts.fingerprint, contexts.chunk_size, keys, ids, [level])
    request = KVRequest([level], {level.name: 0.0}, budget_s=60.0)
    prepare = ThreadPoolExecutor(1, initializer=worker_initializer(thread_budget(None, None)))
    original_plan = loader_module.plan

    def load(target_of, k: int) -> tuple[float, torch.Tensor]:
        kv = runner.new_kv(len(ids))
        target = target_of(LoopTarget(kv, gateway.loop, cancel=threading.Event()))
        loader_module.plan = fixed_plan(k, level.name)
        try:
            started = time.perf_counter()
            done = prepare.submit(loader.load, target, stored, ids, request, len(ids) + 1, started).result()
            seconds = time.perf_counter() - started
        finally:
            loader_module.plan = original_plan
        sources = [c.level or c.source for c in sorted(done.chunks, key=lambda c: c.index)]
        assert done.tokens == stored.chunks[-1].end and sources[:k] == [TEXT] * k, sources
        return seconds, kv[:, :, :, : done.tokens].clone()

    variants = {"overlapped": lambda t: t, "blocking": BlockingTarget}
    rows: dict[str, dict] = {}
    for k in (int(x) for x in args.text_chunks.split(",")):
        times: dict[str, list[float]] = {name: [] for name in variants}
        first, second = (load(target_of, k)[1] for target_of in variants.values())  # warm-up
        assert torch.equal(first, second), "the two targets loaded different KV"
        for r in range(args.rounds):
            order = list(variants.items()) if r % 2 == 0 else list(reversed(variants.items()))
            for name, target_of in order:
                times[name].append(load(target_of, k)[0])
        medians = {name: statistics.median(v) for name, v in times.items()}
        rows[str(k)] = {
            "blocking_s": round(medians["blocking"], 3),
            "overlapped_s": round(medians["overlapped"], 3),
            "ratio": round(medians["blocking"] / medians["overlapped"], 2),
            "rounds": {name: [round(t, 3) for t in v] for name, v in times.items()},
        }
    prepare.shutdown()
    return {
        "tokens": len(ids),
        "level": args.level,
        "chunks": len(stored.chunks),
        "torch_threads": torch.get_num_threads(),
        "rows": rows,
    }


if __name__ == "__main__":
    sys.exit(main())
