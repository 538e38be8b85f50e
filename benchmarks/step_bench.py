"""One decode step over sequences of different lengths: ragged segments against a padded batch.

The step loop's choice (``engine/ragged.py``): every sequence keeps its own KV
buffer, the tokens of a step are laid end to end, and attention runs per
sequence. The baseline is what transformers offers out of the box: one
left-padded batch, a ``DynamicCache`` of (batch, heads, longest, dim) and a 2D
attention mask, with SDPA attention. Both run the default model; lengths are
drawn between ``--min-len`` and ``--max-len``. Prints median ms per step and
tokens/s, writes JSON.

    python benchmarks/step_bench.py --batch 1,8,16
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from datetime import datetime
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

RESULTS_DIR = Path(__file__).resolve().parent / "results"


def median_ms(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1000


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", default="1,8,16")
    p.add_argument("--min-len", type=int, default=100)
    p.add_argument("--max-len", type=int, default=600)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--torch-threads", type=int, help="default: the gateway's thread budget")
    p.add_argument("--out", type=Path)
    args = p.parse_args()

    import torch
    from transformers import DynamicCache

    from app.threads import configure_threads, thread_budget
    from engine import ModelRunner, load_model
    from engine.ragged import ATTENTION_NAME, Segment

    configure_threads(thread_budget(args.torch_threads, None), model_thread=True)
    runner = ModelRunner(load_model("smollm2"))
    model = runner.model
    ids = runner.tokenizer("A long history of programming languages. " * 200)["input_ids"]
    rng = random.Random(0)
    rows = []
    for batch in [int(b) for b in args.batch.split(",")]:
        lengths = [rng.randint(args.min_len, args.max_len) for _ in range(batch)]
        buffers = [runner.new_kv(n + 1) for n in lengths]
        for kv, n in zip(buffers, lengths):
            runner.forward_ragged([Segment(kv, 0, ids[:n], "none")])

        def ragged(buffers=buffers, lengths=lengths) -> None:
            runner.forward_ragged([Segment(kv, n, [5]) for kv, n in zip(buffers, lengths)])

        longest = max(lengths)

        def padded(buffers=buffers, lengths=lengths, batch=batch, longest=longest) -> None:
            # rebuilt each time: the cache grows by concatenation, as a fresh step's would
            cache = DynamicCache(config=model.config)
            for layer in range(runner.num_layers):
                keys = torch.zeros(batch, runner.num_kv_heads, longest, runner.head_dim)
                values = torch.zeros_like(keys)
                for b, (kv, n) in enumerate(zip(buffers, lengths)):
                    keys[b, :, longest - n :] = kv[layer, 0, :, :n]
                    values[b, :, longest - n :] = kv[layer, 1, :, :n]
                cache.update(keys, values, layer)
            mask = torch.zeros(batch, longest + 1, dtype=torch.long)
            for b, n in enumerate(lengths):
                mask[b, longest - n :] = 1
            with torch.inference_mode():
                model(
                    input_ids=torch.full((batch, 1), 5),
                    attention_mask=mask,
                    position_ids=torch.tensor([[n] for n in lengths]),
                    cache=cache,
                    use_cache=True,
                )

        def padded_build_only(buffers=buffers, lengths=lengths, batch=batch, longest=longest) -> None:
            cache = DynamicCache(config=model.config)
            for layer in range(runner.num_layers):
                keys = torch.zeros(batch, runner.num_kv_heads, longest, runner.head_dim)
                for b, (kv, n) in enumerate(zip(buffers, lengths)):
                    keys[b, :, longest - n :] = kv[layer, 0, :, :n]
                cache.update(keys, keys.clone(), layer)

        ragged_ms = median_ms(ragged, args.repeats)
        model.set_attn_implementation("sdpa")
        try:
            padded_ms = median_ms(padded, args.repeats) - median_ms(padded_build_only, args.repeats)
        finally:
            model.set_attn_implementation(ATTENTION_NAME)
        row = {
            "batch": batch,
            "lengths": lengths,
            "ragged_ms": round(ragged_ms, 1),
            "padded_ms": round(padded_ms, 1),
            "ragged_tok_s": round(batch / ragged_ms * 1000, 1),
            "padded_tok_s": round(batch / padded_ms * 1000, 1),
        }
        rows.append(row)
        print(f"batch {batch:>3}: ragged {row['ragged_ms']:>7} ms   padded {row['padded_ms']:>7} ms")
    out = args.out or RESULTS_DIR / f"step_{datetime.now():%Y%m%d_%H%M%S}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"threads": torch.get_num_threads(), "rows": rows}, indent=2))
    print("\n| batch | ragged ms | padded ms | ragged tok/s | padded tok/s | padded / ragged |")
    print("|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        ratio = r["padded_ms"] / r["ragged_ms"]
        print(
            f"| {r['batch']} | {r['ragged_ms']} | {r['padded_ms']} | {r['ragged_tok_s']} | "
            f"{r['padded_tok_s']} | {ratio:.2f} |"
        )
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
