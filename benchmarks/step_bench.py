"""One decode step over sequences of different lengths, per precision and attention path, in one process.

For each precision (``--dtypes``: ``float32``, ``bf16-weights``, ``bfloat16``)
the default model is loaded and, for each batch size, a decode step is timed:

- ``step``: the step loop's path (``engine/ragged.py``): the decodes in one
  call per layer (the compiled kernel, ``engine/decode_attention.py``, with
  float32 KV on a CPU; otherwise a padded batch, or each by itself where the
  model is batch-invariant);
- ``padded decodes``: the step loop's path with the decodes gathered into a
  padded batch (``_DecodeBatch``) instead of the kernel (where the model is
  not batch-invariant);
- ``plain head``: the step loop's path with the output projection unpacked
  (a plain ``nn.Linear``, MKL; or bf16 through ``F.linear``), where the runner
  has packed it for oneDNN (``engine/packed_linear.py``: float32 or bf16 weights on a CPU);
- ``transformers forward``: the step loop's path through transformers' own
  model forward (plain ``nn.Linear`` projections), where the runner has the
  fused forward (``engine/fused_layers.py``: Llama on a CPU, float32 or bf16 weights);
- ``padded``: what transformers offers out of the box, one left-padded batch,
  a ``DynamicCache`` and a 2D mask, SDPA attention (``--padded``; slow to
  set up, so off by default).

The variants alternate ``--rounds`` times and the median of each is kept, so a
machine whose speed drifts affects them alike. A prefill of ``--prefill``
tokens as serving runs it (``ModelRunner.prefill``, 512 a pass) is timed
against one plain SDPA forward of the same tokens. ``--questions N`` times
the floor under N concurrent questions on stored contexts: one step that
prefills N questions (``--question-tokens`` each) after ``--question-prefix``
cached tokens of their own, against the step of one such question alone, and
the share of the step that attention takes. Prints a table, writes JSON.

    python -m benchmarks.step_bench --batch 1,8,16 --dtypes float32,bf16-weights
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from datetime import datetime
from pathlib import Path

import torch

RESULTS_DIR = Path(__file__).resolve().parent / "results"


def seconds(fn, repeats: int) -> float:
    fn()
    started = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - started) / repeats


def padded_step(runner, buffers, lengths):
    """A step as transformers batches it: a left-padded ``DynamicCache`` rebuilt from the buffers;
    returns (run the step, build the cache only) so the build can be subtracted."""
    from transformers import DynamicCache

    model, batch, longest = runner.model, len(lengths), max(lengths)

    def build() -> DynamicCache:
        cache = DynamicCache(config=model.config)
        for layer in range(runner.num_layers):
            keys = torch.zeros(
                batch, runner.num_kv_heads, longest, runner.head_dim, dtype=runner.loaded.dtype
            )
            values = torch.zeros_like(keys)
            for b, (kv, n) in enumerate(zip(buffers, lengths)):
                keys[b, :, longest - n :] = kv[layer, 0, :, :n]
                values[b, :, longest - n :] = kv[layer, 1, :, :n]
            cache.update(keys, values, layer)
        return cache

    mask = torch.zeros(batch, longest + 1, dtype=torch.long)
    for b, n in enumerate(lengths):
        mask[b, longest - n :] = 1

    def step() -> None:
        with torch.inference_mode():
            model(
                input_ids=torch.full((batch, 1), 5),
                attention_mask=mask,
                position_ids=torch.tensor([[n] for n in lengths]),
                cache=build(),
                use_cache=True,
            )

    return step, build


def with_plain_head(runner, step):
    """``step`` with the model's output projection unpacked: a plain ``nn.Linear`` of the same weight,
    or a bf16 one (``Bf16WeightLinear``) on its own weight."""
    from engine.bf16_weights import Bf16WeightLinear

    model = runner.model
    packed = model.get_output_embeddings()
    if isinstance(packed, Bf16WeightLinear):
        return _bf16_unpacked(packed, step)
    plain = torch.nn.Linear(packed.in_features, packed.out_features, bias=packed.bias is not None)
    plain.weight, plain.bias = packed.weight, packed.bias

    def run() -> None:
        model.set_output_embeddings(plain)
        try:
            step()
        finally:
            model.set_output_embeddings(packed)

    return run


def _bf16_unpacked(head, step):
    def run() -> None:
        packed, head.packed = head.packed, None
        try:
            step()
        finally:
            head.packed = packed

    return run


def with_transformers_forward(runner, step):
    """``step`` through transformers' model forward instead of the runner's fused one."""

    def run() -> None:
        with runner.transformers_forward():
            step()

    return run


def without_decode_kernel(step):
    """``step`` with the decodes attended as a padded batch, not by ``engine.decode_attention``."""
    from engine import decode_attention

    def run() -> None:
        taken, decode_attention.supports = decode_attention.supports, lambda kv: False
        try:
            step()
        finally:
            decode_attention.supports = taken

    return run


def measure(runner, ids, batches, args) -> list[dict]:
    from engine import decode_attention, ragged
    from engine.ragged import Segment

    rng = random.Random(0)
    rows = []
    for batch in batches:
        lengths = [rng.randint(args.min_len, args.max_len) for _ in range(batch)]
        buffers = [runner.new_kv(n + 1) for n in lengths]
        for kv, n in zip(buffers, lengths):
            runner.forward_ragged([Segment(kv, 0, ids[:n], "none")])

        def ragged_step(buffers=buffers, lengths=lengths) -> None:
            runner.forward_ragged([Segment(kv, n, [5], decode=True) for kv, n in zip(buffers, lengths)])

        variants = {"step": ragged_step}
        if decode_attention.supports(buffers[0]) and not runner.loaded.batch_invariant:
            variants["padded_decodes"] = without_decode_kernel(ragged_step)
        if runner.packed_output:
            variants["plain_head"] = with_plain_head(runner, ragged_step)
        if runner.fused is not None:
            variants["transformers_forward"] = with_transformers_forward(runner, ragged_step)
        times: dict[str, list[float]] = {name: [] for name in variants}
        for _ in range(args.rounds):
            for name, fn in variants.items():
                times[name].append(seconds(fn, args.repeats))
        row = {"batch": batch, "lengths": lengths}
        row.update({f"{name}_ms": round(statistics.median(t) * 1000, 1) for name, t in times.items()})
        if args.padded:
            step, build = padded_step(runner, buffers, lengths)
            runner.model.set_attn_implementation("sdpa")
            try:
                row["padded_ms"] = round(
                    (seconds(step, args.repeats) - seconds(build, args.repeats)) * 1000, 1
                )
            finally:
                runner.model.set_attn_implementation(ragged.ATTENTION_NAME)
        rows.append(row)
    return rows


def prefill_seconds(runner, ids, tokens: int, rounds: int) -> tuple[float, float]:
    """(serving's prefill, one plain SDPA forward) of ``tokens`` tokens, medians of ``rounds``
    alternating runs. Serving's is ``ModelRunner.prefill``: passes of at most 512 tokens, the
    step loop's largest prefill step, through the engine's attention."""
    prompt = ids[:tokens]

    def plain() -> None:
        from engine import ragged

        runner.model.set_attn_implementation("sdpa")
        try:
            with torch.inference_mode():
                runner.model(input_ids=torch.tensor([prompt]), use_cache=False, logits_to_keep=1)
        finally:
            runner.model.set_attn_implementation(ragged.ATTENTION_NAME)

    engine, sdpa = [], []
    for _ in range(rounds):
        engine.append(seconds(lambda: runner.prefill(prompt), 1))
        sdpa.append(seconds(plain, 1))
    return statistics.median(engine), statistics.median(sdpa)


def question_steps(runner, ids, count: int, prefix: int, tokens: int, rounds: int) -> dict:
    """One step prefilling ``count`` questions of ``tokens`` tokens, each after ``prefix`` cached tokens
    in a buffer of its own (as loads leave them), against one such question alone; medians of
    ``rounds`` alternating runs, and the attention's share of the step of them all."""
    from engine import ragged
    from engine.ragged import Segment

    buffers = [runner.new_kv(prefix + tokens) for _ in range(count)]
    for kv in buffers:
        kv.normal_()  # what the prefix holds does not change the work
    question = ids[prefix : prefix + tokens]

    def step(n: int) -> None:
        runner.forward_ragged([Segment(kv, prefix, question) for kv in buffers[:n]])

    alone, together = [], []
    for _ in range(rounds):
        alone.append(seconds(lambda: step(1), 1))
        together.append(seconds(lambda: step(count), 1))
    attention = [0.0]
    plain = ragged.ragged_attention

    def timed(*args, **kwargs):
        started = time.perf_counter()
        try:
            return plain(*args, **kwargs)
        finally:
            attention[0] += time.perf_counter() - started

    from transformers import AttentionInterface

    from engine import runner as runner_module

    # the fused forward (engine/fused_layers.py) is handed the runner's own reference to the
    # function; transformers' forward finds it by name: both are timed
    AttentionInterface.register(ragged.ATTENTION_NAME, timed)
    runner_module.ragged_attention = timed
    try:
        runner.model.set_attn_implementation(ragged.ATTENTION_NAME)
        step_s = seconds(lambda: step(count), 1)
        attention_s = attention[0] / 2  # ``seconds`` ran the step twice
    finally:
        runner_module.ragged_attention = plain
        AttentionInterface.register(ragged.ATTENTION_NAME, plain)
        runner.model.set_attn_implementation(ragged.ATTENTION_NAME)
    return {
        "questions": count,
        "prefix_tokens": prefix,
        "question_tokens": tokens,
        "alone_s": round(statistics.median(alone), 3),
        "together_s": round(statistics.median(together), 3),
        "attention_share": round(attention_s / step_s, 2),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", default="1,8,16")
    p.add_argument("--dtypes", default="float32,bf16-weights")
    p.add_argument("--min-len", type=int, default=40)
    p.add_argument("--max-len", type=int, default=180)
    p.add_argument("--prefill", type=int, default=1024, help="tokens of the timed chunked prefill (0: none)")
    p.add_argument("--questions", type=int, default=0, help="concurrent questions on stored contexts (0: none)")
    p.add_argument("--question-prefix", type=int, default=2048)
    p.add_argument("--question-tokens", type=int, default=30)
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--padded", action="store_true", help="also time transformers' padded batch")
    p.add_argument("--torch-threads", type=int, help="default: the gateway's thread budget")
    p.add_argument("--out", type=Path)
    args = p.parse_args()

    from app.threads import configure_threads, thread_budget
    from engine import ModelRunner, load_model

    configure_threads(thread_budget(args.torch_threads, None), model_thread=True)
    batches = [int(b) for b in args.batch.split(",")]
    results = []
    for dtype in args.dtypes.split(","):
        runner = ModelRunner(load_model("smollm2", dtype=dtype))
        ids = runner.tokenizer("A long history of programming languages. " * 600)["input_ids"]
        result = {
            "dtype": dtype,
            "precision": runner.loaded.precision,
            "rows": measure(runner, ids, batches, args),
        }
        if args.prefill:
            engine_s, sdpa_s = prefill_seconds(runner, ids, args.prefill, args.rounds)
            result["prefill_s"], result["sdpa_prefill_s"] = round(engine_s, 3), round(sdpa_s, 3)
        if args.questions:
            result["question_steps"] = question_steps(
                runner, ids, args.questions, args.question_prefix, args.question_tokens, args.rounds
            )
        results.append(result)
        del runner

    out = args.out or RESULTS_DIR / f"step_{datetime.now():%Y%m%d_%H%M%S}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"threads": torch.get_num_threads(), "results": results}, indent=2))
    padded = " padded ms |" if args.padded else ""
    others = {"padded_decodes": "padded decodes", "plain_head": "plain head"}
    others["transformers_forward"] = "transformers forward"
    head = "".join(f" {label} ms | {label} / step |" for label in others.values())
    print(f"\n| precision | batch | step ms | tok/s |{head}{padded}")
    print("|---|---:|---:|---:|" + "---:|---:|" * len(others) + ("---:|" if args.padded else ""))
    for result in results:
        for r in result["rows"]:
            extra = ""
            for name in (f"{key}_ms" for key in others):
                other = r.get(name)
                extra += f" {other} | {other / r['step_ms']:.2f} |" if other else " - | - |"
            extra += f" {r['padded_ms']} |" if args.padded else ""
            print(
                f"| {result['precision']} | {r['batch']} | {r['step_ms']} | "
                f"{r['batch'] / r['step_ms'] * 1000:.1f} |{extra}"
            )
    if args.prefill:
        print(f"\n| precision | {args.prefill}-token prefill s | one SDPA forward s | ratio |\n|---|---:|---:|---:|")
        for result in results:
            ratio = result["prefill_s"] / result["sdpa_prefill_s"]
            print(f"| {result['precision']} | {result['prefill_s']} | {result['sdpa_prefill_s']} | {ratio:.2f} |")
    for result in results:
        q = result.get("question_steps")
        if q:
            print(
                f"\n{result['precision']}: one step prefilling {q['questions']} questions of "
                f"{q['question_tokens']} tokens after {q['prefix_tokens']} cached: {q['together_s']} s, "
                f"one alone {q['alone_s']} s ({q['together_s'] / q['alone_s']:.1f}x); "
                f"attention {q['attention_share']:.0%} of the step"
            )
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
