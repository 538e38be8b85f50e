"""Issue 16, item 9: transformers' own continuous batching against the engine, offline, in one process.

Both generate ``--max-tokens`` greedy tokens for each of N short distinct
prompts, all submitted at once, for each N in ``--requests``:

- ``transformers``: ``model.generate_batch`` (``transformers.generation.continuous_batching``:
  a paged cache, its scheduler, paged SDPA attention), on its own copy of
  the default model;
- ``engine``: the engine's forward path (``ModelRunner.forward_ragged``),
  one step prefilling every prompt and then one decode step for all of them
  per token: what the step loop runs when N requests arrive together,
  without HTTP, sampling parameters or detokenization.

Both run float32 on the same threads. Tokens/s count the generated tokens
over the wall time of the whole batch, the median of ``--rounds``
alternating rounds. ``generate_batch`` builds its manager and paged cache on
every call, which here cost about 4 s (a 1-token call of 8 requests took 4.1 s; the first call
in a process about 40 s, not counted: a warm-up call comes first); the
engine's buffers come from the runner as a request needs them.

Prints a table, writes JSON.

    python -m benchmarks.hf_batching
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from datetime import datetime
from pathlib import Path

import torch

RESULTS_DIR = Path(__file__).resolve().parent / "results"


def prompts(tokenizer, count: int) -> list[list[int]]:
    return [
        list(tokenizer(f"Client {i}: write a short story about the number {i * 1000 + 7}.")["input_ids"])
        for i in range(count)
    ]


def engine_tokens(runner, batch: list[list[int]], max_tokens: int) -> int:
    """Greedy generation of ``max_tokens`` for every prompt, all in the same steps; returns the
    number of tokens generated."""
    from engine.ragged import Segment

    buffers = [runner.new_kv(len(p) + max_tokens) for p in batch]
    logits = runner.forward_ragged([Segment(kv, 0, p) for kv, p in zip(buffers, batch)])
    lengths = [len(p) for p in batch]
    generated = 0
    for step in range(max_tokens):
        tokens = [int(row.argmax()) for row in logits]  # type: ignore[union-attr]
        generated += len(tokens)
        if step + 1 == max_tokens:
            break
        step = [Segment(kv, n, [t], decode=True) for kv, n, t in zip(buffers, lengths, tokens)]
        logits = runner.forward_ragged(step)
        lengths = [n + 1 for n in lengths]
    return generated


def transformers_tokens(model, batch: list[list[int]], max_tokens: int) -> int:
    from transformers import GenerationConfig

    config = GenerationConfig(
        max_new_tokens=max_tokens, min_new_tokens=max_tokens, do_sample=False, eos_token_id=None
    )
    outputs = model.generate_batch(inputs=batch, generation_config=config, progress_bar=False)
    return sum(len(out.generated_tokens) for out in outputs.values())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--requests", default="1,8,16")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--out", type=Path)
    args = p.parse_args()

    from app.threads import configure_threads, thread_budget
    from engine import ModelRunner, load_model

    configure_threads(thread_budget(None, None), model_thread=True)
    runner = ModelRunner(load_model("smollm2", dtype="float32"))
    theirs = load_model("smollm2", dtype="float32").model  # stock modules and attention
    rows = []
    for count in [int(n) for n in args.requests.split(",")]:
        batch = prompts(runner.tokenizer, count)
        runs = {
            "engine": lambda n, batch=batch: engine_tokens(runner, batch, n),
            "transformers": lambda n, batch=batch: transformers_tokens(theirs, batch, n),
        }
        whole: dict[str, list[float]] = {name: [] for name in runs}
        with torch.inference_mode():
            for run in runs.values():
                run(4)  # warm-up
            for _ in range(args.rounds):
                for name, run in runs.items():
                    started = time.perf_counter()
                    made = run(args.max_tokens)
                    whole[name].append(made / (time.perf_counter() - started))
        row = {"requests": count, "max_tokens": args.max_tokens}
        for name in runs:
            row[f"{name}_tok_s"] = round(statistics.median(whole[name]), 1)
        rows.append(row)
        print(json.dumps(row), flush=True)

    out = args.out or RESULTS_DIR / f"hf_batching_{datetime.now():%Y%m%d_%H%M%S}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"threads": torch.get_num_threads(), "rows": rows}, indent=2))
    print("\n| requests | engine tok/s | transformers generate_batch tok/s | engine / transformers |")
    print("|---:|---:|---:|---:|")
    for r in rows:
        ratio = r["engine_tok_s"] / r["transformers_tok_s"]
        print(f"| {r['requests']} | {r['engine_tok_s']} | {r['transformers_tok_s']} | {ratio:.2f} |")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
