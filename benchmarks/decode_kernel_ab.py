"""The decode attention kernel of this tree against a baseline revision's, in one process.

Loads ``engine/decode_attention.py`` as it was at ``--baseline`` (``git
show``) beside this tree's and times decode steps of the real model, the one
table class and then the other routed into ``engine.ragged`` (with the
baseline's ``BATCH_MAX_KEYS`` for its turn), alternating ``--rounds`` times.
Each (batch, context) pair is decode steps of ``--batches`` sequences over a
context of ``--contexts`` tokens each. Both kernels must give the same
outputs; the script checks one step's logits. Prints a table of the medians
and their ratios, writes JSON.

    python -m benchmarks.decode_kernel_ab --baseline 2a16f16 --dtype auto
    python -m benchmarks.decode_kernel_ab --baseline 2a16f16 --dtype bf16-weights
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
RESULTS_DIR = ROOT / "benchmarks" / "results"
STEPS = 15  # timed decode steps per setting and round, after 3 untimed


def baseline_module(revision: str, directory: Path):
    """``engine/decode_attention.py`` at ``revision``, imported as a module of its own."""
    source = subprocess.run(
        ["git", "show", f"{revision}:engine/decode_attention.py"],
        cwd=ROOT,
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    path = directory / "baseline_decode_attention.py"
    path.write_text(source)
    sys.path.insert(0, str(directory))
    spec = importlib.util.spec_from_file_location("baseline_decode_attention", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def baseline_max_keys(revision: str) -> int:
    source = subprocess.run(
        ["git", "show", f"{revision}:engine/ragged.py"], cwd=ROOT, check=True, capture_output=True, text=True
    ).stdout
    line = next(line for line in source.splitlines() if line.startswith("BATCH_MAX_KEYS = "))
    return int(line.split("=")[1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--baseline", required=True, help="git revision whose decode kernel is the baseline")
    p.add_argument("--dtype", default="auto", help="CACHEGEN_DTYPE-style model dtype")
    p.add_argument("--batches", default="1,4,8,16")
    p.add_argument("--contexts", default="100,400,2000")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--out", type=Path)
    args = p.parse_args()

    from benchmarks.vs_vllm import LICENCE
    from engine import ModelRunner, decode_attention, load_model, ragged
    from engine.ragged import Segment

    runner = ModelRunner(load_model(dtype=args.dtype))
    ids = runner.tokenizer(LICENCE.read_text())["input_ids"]
    batches = [int(b) for b in args.batches.split(",")]
    contexts = [int(c) for c in args.contexts.split(",")]
    scratch = tempfile.TemporaryDirectory()
    kernels = {
        "baseline": (
            baseline_module(args.baseline, Path(scratch.name)).DecodeTable,
            baseline_max_keys(args.baseline),
        ),
        "this tree": (decode_attention.DecodeTable, ragged.BATCH_MAX_KEYS),
    }
    prefixes = {}
    for context in contexts:  # one prefill per context length, copied into every sequence's buffer
        kv = runner.new_kv(context)
        runner.forward_ragged([Segment(kv, 0, ids[:context], "none")])
        prefixes[context] = kv

    def segments(batch: int, context: int) -> list[Segment]:
        kvs = [runner.new_kv(context + 32) for _ in range(batch)]
        for kv in kvs:
            kv[:, :, :, :context].copy_(prefixes[context])
        return [Segment(kv, context, [ids[context + i]], "last", decode=True) for i, kv in enumerate(kvs)]

    def use(name: str) -> None:
        ragged.DecodeTable, ragged.BATCH_MAX_KEYS = kernels[name]

    agree = {}
    for context in contexts:  # the same step through each kernel: the same logits
        logits = {}
        for name in kernels:
            use(name)
            logits[name] = torch.stack(runner.forward_ragged(segments(4, context)))
        agree[context] = float((logits["baseline"] - logits["this tree"]).abs().max())

    samples: dict[str, dict[str, list[float]]] = {name: {} for name in kernels}
    for _ in range(args.rounds):
        for name, own in samples.items():
            use(name)
            for context in contexts:
                for batch in batches:
                    step = segments(batch, context)
                    times = []
                    for i in range(3 + STEPS):
                        t = time.perf_counter()
                        runner.forward_ragged(step)
                        if i >= 3:
                            times.append(time.perf_counter() - t)
                    own.setdefault(f"step_{batch}x{context}_s", []).append(statistics.median(times))
    medians = {name: {k: statistics.median(v) for k, v in own.items()} for name, own in samples.items()}
    ratios = {k: medians["this tree"][k] / medians["baseline"][k] for k in medians["baseline"]}

    out = args.out or RESULTS_DIR / f"decode_kernel_ab_{datetime.now():%Y%m%d_%H%M%S}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    report = {
        "baseline": args.baseline,
        "precision": runner.loaded.precision,
        "torch_threads": torch.get_num_threads(),
        "rounds": args.rounds,
        "max_logit_difference": agree,
        "medians": medians,
        "this_tree_over_baseline": ratios,
        "samples": samples,
    }
    out.write_text(json.dumps(report, indent=2))
    print(f"\n{runner.loaded.precision}; max logit difference between the kernels: {agree}")
    print("\n| decode step (sequences x context) | baseline | this tree | ratio |")
    print("|---|---:|---:|---:|")
    for k, ratio in ratios.items():
        print(
            f"| {k} | {medians['baseline'][k] * 1e3:.1f} ms | {medians['this tree'][k] * 1e3:.1f} ms | {ratio:.3f} |"
        )
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
