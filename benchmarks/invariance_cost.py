"""What batch-invariant attention costs: the engine's attention at a baseline commit against this one's,
untiled (float32 and non-invariant bf16) and tiled (``LoadedModel.batch_invariant``).

Both run in one process on one loaded model, the steps alternating ``--rounds``
times (medians kept), so a machine whose speed drifts affects them alike. The
baseline's ``engine/ragged.py`` is read with ``git show REV:engine/ragged.py``
and registered under the engine's attention name for its turns; the model,
its weights and the runner are this commit's.

The steps are the serving loop's: decodes of short and 2K-token sequences,
a 3.6K-token prompt prefilled 512 tokens a step, questions of 30 tokens after
2K tokens of their own (a burst on stored contexts), and questions on a shared
3.6K-token part (prefix-cache hits).

    python -m benchmarks.invariance_cost --baseline 3408c48 --dtypes bf16-weights,float32
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import random
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from datetime import datetime
from pathlib import Path

import torch

RESULTS_DIR = Path(__file__).resolve().parent / "results"
ROOT = Path(__file__).resolve().parents[1]


def baseline_module(rev: str):
    """The baseline commit's ``engine/ragged.py``, imported as a module of its own."""
    source = subprocess.run(
        ["git", "show", f"{rev}:engine/ragged.py"], cwd=ROOT, check=True, capture_output=True, text=True
    ).stdout
    path = Path(tempfile.mkdtemp()) / "ragged_baseline.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location("ragged_baseline", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["ragged_baseline"] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


class Engine:
    """One side's attention: its module, and how to make its segments."""

    def __init__(self, module, runner, current: bool, tiled: bool = False) -> None:
        self.module, self.runner, self.current, self.tiled = module, runner, current, tiled

    def segment(self, kv, start, tokens, decode=False, shared=()):
        if self.current:
            return self.module.Segment(kv, start, tokens, "last", shared, decode=decode)
        return self.module.Segment(kv, start, tokens, "last", shared)

    def forward(self, segments) -> None:
        from transformers import AttentionInterface

        ids, positions, keep = [], [], []
        for segment in segments:
            ids.extend(segment.token_ids)
            positions.extend(range(segment.start, segment.end))
            keep.append(len(ids) - 1)
        AttentionInterface.register(self.module.ATTENTION_NAME, self.module.ragged_attention)
        routed = self.module.active(segments, tiled=self.tiled) if self.current else self.module.active(segments)
        with torch.inference_mode(), routed:
            self.runner.model(
                input_ids=torch.tensor([ids]),
                position_ids=torch.tensor([positions]),
                use_cache=False,
                logits_to_keep=torch.tensor(keep),
            )


def cases(runner) -> dict[str, Callable[[Engine], None]]:
    rng = random.Random(0)
    ids = [rng.randrange(100, 40000) for _ in range(4000)]
    work: dict[str, Callable[[Engine], None]] = {}
    for batch in (1, 8, 16):
        lengths = [rng.randint(40, 180) for _ in range(batch)]
        buffers = [runner.new_kv(n + 1).normal_() for n in lengths]
        work[f"decode x{batch}, 40-180 tokens"] = lambda e, b=buffers, n=lengths: e.forward(
            [e.segment(kv, length, [5], decode=True) for kv, length in zip(b, n)]
        )
    lengths = [rng.randint(1500, 2500) for _ in range(8)]
    long = [runner.new_kv(n + 1).normal_() for n in lengths]
    work["decode x8, 1.5-2.5K tokens"] = lambda e: e.forward(
        [e.segment(kv, n, [5], decode=True) for kv, n in zip(long, lengths)]
    )
    prompt = runner.new_kv(3600)
    work["3.6K-token prompt, 512 a step"] = lambda e: [
        e.forward([e.segment(prompt, at, ids[at : min(at + 512, 3600)])]) for at in range(0, 3600, 512)
    ]
    stored = [runner.new_kv(2048 + 30).normal_() for _ in range(8)]
    work["8 questions after 2K each"] = lambda e: e.forward([e.segment(kv, 2048, ids[:30]) for kv in stored])
    work["1 question after 2K"] = lambda e: e.forward([e.segment(stored[0], 2048, ids[:30])])
    shared = runner.new_kv(3584).normal_()
    own = [runner.new_kv(40).normal_() for _ in range(4)]
    work["4 questions on a shared 3.6K part"] = lambda e: e.forward(
        [e.segment(kv, 3584, ids[:30], shared=(shared,)) for kv in own]
    )
    return work


def measure(dtype: str, baseline_rev: str, rounds: int) -> dict:
    from engine import ModelRunner, load_model, ragged

    runner = ModelRunner(load_model(dtype=dtype))
    sides = {
        "baseline": Engine(baseline_module(baseline_rev), runner, current=False),
        "untiled": Engine(ragged, runner, current=True),
        "tiled": Engine(ragged, runner, current=True, tiled=True),
    }
    rows = []
    for name, step in cases(runner).items():
        times: dict[str, list[float]] = {side: [] for side in sides}
        for engine in sides.values():
            step(engine)  # warm
        for _ in range(rounds):
            for side, engine in sides.items():
                started = time.perf_counter()
                step(engine)
                times[side].append(time.perf_counter() - started)
        base, untiled, tiled = (statistics.median(times[s]) * 1000 for s in sides)
        rows.append(
            {"case": name, "baseline_ms": round(base, 1), "untiled_ms": round(untiled, 1), "tiled_ms": round(tiled, 1)}
        )
        print(f"  {runner.loaded.precision} {name}: {base:.1f} -> {untiled:.1f} untiled, {tiled:.1f} ms tiled")
    from transformers import AttentionInterface

    AttentionInterface.register(ragged.ATTENTION_NAME, ragged.ragged_attention)
    return {"precision": runner.loaded.precision, "rows": rows}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--baseline", default="3408c48", help="the commit whose engine/ragged.py is the baseline")
    p.add_argument("--dtypes", default="bf16-weights,float32")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--torch-threads", type=int, help="default: the gateway's thread budget")
    p.add_argument("--out", type=Path)
    args = p.parse_args()
    from app.threads import configure_threads, thread_budget

    configure_threads(thread_budget(args.torch_threads, None), model_thread=True)
    results = [measure(dtype, args.baseline, args.rounds) for dtype in args.dtypes.split(",")]
    out = args.out or RESULTS_DIR / f"invariance_cost_{datetime.now():%Y%m%d_%H%M%S}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    report = {"baseline": args.baseline, "rounds": args.rounds, "threads": torch.get_num_threads()}
    out.write_text(json.dumps({**report, "results": results}, indent=2))
    rev = args.baseline
    print(f"\n| precision | step | {rev} ms | untiled ms | tiled ms | untiled / {rev} | tiled / {rev} |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for result in results:
        for r in result["rows"]:
            base = r["baseline_ms"]
            ratios = [f"{r['untiled_ms'] / base:.2f}", f"{r['tiled_ms'] / base:.2f}"]
            cells = [result["precision"], r["case"], base, r["untiled_ms"], r["tiled_ms"], *ratios]
            print("| " + " | ".join(str(c) for c in cells) + " |")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
