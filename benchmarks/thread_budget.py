"""How many threads torch and numba should get: model steps and chunk decodes, idle and on a busy machine.

For each (torch threads, numba threads) pair, times on the default model:

* ``step8``: one decode step of 8 sequences (the step loop's steady state);
* ``prefill256``: a 256-token prefill step;
* ``decode``: decoding one stored 256-token chunk at the default level (numba);
* ``overlap``: ``step8`` while another thread decodes chunks, as the step loop
  runs while a request's prefix loads.

Each is measured on an idle machine, then with ``--busy`` processes spinning
(default: one per core) to stand in for a shared one. Writes JSON and prints a
table of medians in ms.

    python -m benchmarks.thread_budget            # about 2 minutes on 2 cores
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import statistics
import threading
import time
from datetime import datetime
from pathlib import Path

RESULTS_DIR = Path(__file__).resolve().parent / "results"


def _spin() -> None:
    while True:
        pass


def _median_ms(fn, repeats: int) -> float:
    fn()  # warm
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return round(statistics.median(times) * 1000, 1)


def measure(repeats: int, pairs: list[tuple[int, int]]) -> dict[str, dict[str, float]]:
    import numba
    import torch

    from codec import decode_chunk, encode_chunk
    from codec.levels import default_level_table, load_level_table
    from engine import ModelRunner, load_model
    from engine.ragged import Segment

    runner = ModelRunner(load_model("smollm2"))
    ids = runner.tokenizer("The history of the Python language. " * 80)["input_ids"]
    seqs = [runner.new_kv(600) for _ in range(8)]
    for kv in seqs:
        runner.forward_ragged([Segment(kv, 0, ids[:500], "none")])
    big = runner.new_kv(300)
    levels = load_level_table(default_level_table())
    level = next(lv for lv in levels if lv.name == "medium")
    chunk = encode_chunk(seqs[0][:, :, :, :256].clone(), level)

    def step8() -> None:
        runner.forward_ragged([Segment(kv, 500, [5], decode=True) for kv in seqs])

    def prefill() -> None:
        runner.forward_ragged([Segment(big, 0, ids[:256], "none")])

    def decode() -> None:
        decode_chunk(chunk)

    def overlap() -> None:
        stop = threading.Event()

        def background() -> None:
            while not stop.is_set():
                decode_chunk(chunk)

        worker = threading.Thread(target=background)
        worker.start()
        try:
            for _ in range(3):
                step8()
        finally:
            stop.set()
            worker.join()

    out = {}
    for torch_threads, numba_threads in pairs:
        torch.set_num_threads(torch_threads)
        numba.set_num_threads(numba_threads)
        out[f"torch{torch_threads}/numba{numba_threads}"] = {
            "step8": _median_ms(step8, repeats),
            "prefill256": _median_ms(prefill, max(2, repeats // 3)),
            "decode": _median_ms(decode, repeats),
            "overlap": round(_median_ms(overlap, max(2, repeats // 3)) / 3, 1),
        }
        print(f"  {torch_threads=} {numba_threads=}: {out[f'torch{torch_threads}/numba{numba_threads}']}")
    return out


def main() -> None:
    cores = len(os.sched_getaffinity(0))
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=9)
    p.add_argument("--busy", type=int, default=cores, help="spinning processes for the busy case")
    p.add_argument("--out", type=Path)
    args = p.parse_args()
    import numba

    from app.threads import use_codec_layer

    use_codec_layer()  # as the gateway configures it
    top = min(cores, numba.config.NUMBA_NUM_THREADS)
    counts = sorted({1, max(1, cores // 2), top})
    pairs = [(t, n) for t in counts for n in counts]
    results = {"cores": cores, "busy_processes": args.busy, "idle": {}, "busy": {}}
    print(f"idle ({cores} cores)")
    results["idle"] = measure(args.repeats, pairs)
    print(f"busy ({args.busy} spinning processes)")
    spinners = [multiprocessing.Process(target=_spin, daemon=True) for _ in range(args.busy)]
    for s in spinners:
        s.start()
    try:
        results["busy"] = measure(args.repeats, pairs)
    finally:
        for s in spinners:
            s.terminate()
    out = args.out or RESULTS_DIR / f"threads_{datetime.now():%Y%m%d_%H%M%S}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2))
    print(
        f"\n{'threads':<16}"
        + "".join(f"{c + ' ' + k:>18}" for c in ("idle", "busy") for k in ("step8", "overlap"))
    )
    for name in results["idle"]:
        row = "".join(f"{results[c][name][k]:>18}" for c in ("idle", "busy") for k in ("step8", "overlap"))
        print(f"{name:<16}{row}")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
