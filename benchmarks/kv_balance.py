"""How a lossy level's error splits between keys and values, and what moving bits between them does.

    python -m benchmarks.kv_balance --level medium --passkey-trials 36 \\
        --out benchmarks/results/kv_balance_medium.json

Variants of one level of the default table, in one run:
- ``kXvY``: the level with every key step times X and every value step times Y (``1,1`` is the
  level as calibrated);
- ``keys only`` / ``values only``: the level's decoded keys (values) with the other side exact;
  their bits per value are the whole level's (the coded side alone would be about half).

Each is scored as ``benchmarks/codec_quality.py`` scores a level, on the same held-out texts and
pass-key trials: bits per value with every byte, perplexity change, top-1 agreement and KL of a
256-token continuation after a 2,048-token prefix; pass-key retrieval (pass or fail, greedy) and
the answer's NLL teacher-forced after the question (``engine.quality.passkey_answer_nll``), which
reads each trial on a continuous scale. Everything is on the default model (SmolLM2-135M).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import sys
import time
from pathlib import Path

import numpy as np
import torch

from app.calibrate import round_trip_chunks
from benchmarks.codec_quality import held_out_references, passkey_lengths
from codec import Level
from codec.levels import level_by_name

log = logging.getLogger("kv_balance")
KEYS_ONLY, VALUES_ONLY = "keys only", "values only"


def scaled(level: Level, key: float, value: float) -> Level:
    """``level`` with its key steps times ``key`` and its value steps times ``value``."""
    q = level.quant
    steps = {"key_step": tuple(s * key for s in q.key_step), "value_step": tuple(s * value for s in q.value_step)}
    return dataclasses.replace(level, quant=dataclasses.replace(q, **steps))


def variants(level: Level, splits: list[tuple[float, float]]) -> dict[str, Level | str]:
    out: dict[str, Level | str] = {f"k{k:g}v{v:g}": scaled(level, k, v) for k, v in splits}
    return out | {KEYS_ONLY: KEYS_ONLY, VALUES_ONLY: VALUES_ONLY}


def decoded(kv: torch.Tensor, level: Level, variant: Level | str, cache: dict) -> tuple[torch.Tensor, float]:
    """The variant's decoded KV and its bits per value (``cache``: the level's own round trip of
    ``kv``, which the one-sided variants reuse)."""
    if isinstance(variant, Level):
        out, size = round_trip_chunks(kv, variant)
        return out.to(kv.dtype), 8.0 * size / kv.numel()
    if "level" not in cache:
        out, size = round_trip_chunks(kv, level)
        cache["level"] = (out.to(kv.dtype), 8.0 * size / kv.numel())
    out, bits = cache["level"]
    mixed = out.clone()
    exact_side = 1 if variant == KEYS_ONLY else 0  # axis 1: keys, values
    mixed[:, exact_side] = kv[:, exact_side]
    return mixed, bits


def run(args: argparse.Namespace) -> dict:
    from engine import ModelRunner, load_model
    from engine.quality import (
        continuation_quality,
        passkey_answer,
        passkey_answer_nll,
        passkey_task,
    )

    torch.manual_seed(0)
    level = level_by_name(args.level)
    splits = [tuple(float(x) for x in s.split(",")) for s in args.splits.split()]
    table = variants(level, splits)
    runner = ModelRunner(load_model())
    rows: dict[str, dict[str, list]] = {name: {} for name in ["lossless", *table]}

    def add(name: str, **values: float | bool) -> None:
        for key, value in values.items():
            rows[name].setdefault(key, []).append(value)

    texts = 0
    for text_name, _, ref in held_out_references(runner, args):
        texts += 1
        cache: dict = {}
        for name, variant in table.items():
            kv, bits = decoded(ref.prefix_kv, level, variant, cache)
            q = continuation_quality(runner, ref, kv)
            add(name, bits=bits, ppl_change=q.ppl_change, top1=q.top1, kl=q.kl)
        log.info("%s done", text_name)

    for trial, n in enumerate(passkey_lengths(args.passkey_trials)):
        t0 = time.monotonic()
        task = passkey_task(runner, n, seed=trial)  # codec_quality's trials
        kv = runner.compute_kv(task.context_ids)
        nll = passkey_answer_nll(runner, task, kv)
        add("lossless", passkey=passkey_answer(runner, task, kv), answer_nll=nll)
        cache = {}
        for name, variant in table.items():
            x, bits = decoded(kv, level, variant, cache)
            add(name, passkey=passkey_answer(runner, task, x), answer_nll=passkey_answer_nll(runner, task, x),
                passkey_bits=bits)  # fmt: skip
        seconds = time.monotonic() - t0
        log.info("pass-key trial %d (%d tokens) in %.0f s", trial, len(task.context_ids), seconds)

    summary = {}
    for name, r in rows.items():
        entry: dict[str, float | int | None] = {
            "passkey": int(sum(r.get("passkey", []))),
            "answer_nll": float(np.mean(r["answer_nll"])) if r.get("answer_nll") else None,
        }
        if name != "lossless":
            entry |= {key: float(np.mean(r[key])) for key in ("bits", "ppl_change", "top1", "kl")}
            entry["worst_ppl_change"] = float(max(r["ppl_change"]))
        summary[name] = entry
    return {"level": args.level, "texts": texts, "passkey_trials": args.passkey_trials, "summary": summary,
            "rows": rows}  # fmt: skip


def print_table(result: dict) -> None:
    n = result["passkey_trials"]
    print(f"\nlevel {result['level']}: {result['texts']} texts, {n} pass-key trials (default model)")
    print("| variant | bits/value | dPPL | worst dPPL | top-1 | KL | pass-key | answer NLL |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for name, e in result["summary"].items():
        quality = (
            "| - | - | - | - | - "
            if name == "lossless"
            else f"| {e['bits']:.3f} | {100 * e['ppl_change']:+.2f}% | {100 * e['worst_ppl_change']:+.2f}% "
            f"| {e['top1']:.3f} | {e['kl']:.4f} "
        )
        nll = "-" if e["answer_nll"] is None else f"{e['answer_nll']:.3f}"
        print(f"| {name} {quality}| {e['passkey']} of {n} | {nll} |")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--level", default="medium")
    parser.add_argument(
        "--splits",
        default="1,1 0.85,1.1 0.85,1.25 0.7,1.25 0.75,1.4",
        help="space-separated key,value step multipliers",
    )
    parser.add_argument("--texts", type=int, default=4)
    parser.add_argument("--prefix-tokens", type=int, default=2048)
    parser.add_argument("--continuation-tokens", type=int, default=256)
    parser.add_argument("--passkey-trials", type=int, default=12)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/kv_balance.json"))
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    result = run(args)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print_table(result)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
