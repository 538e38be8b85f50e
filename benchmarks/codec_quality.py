"""Quality vs size of every codec level and of the baselines, on real texts, in one run.

    python -m benchmarks.codec_quality --out benchmarks/results/codec_quality.json

Per text (>= prefix + continuation tokens of real prose, none of them the
calibration texts): the KV of the first ``--prefix-tokens`` tokens is encoded
in 256-token chunks at each level, decoded, and the next
``--continuation-tokens`` are scored on top of it against the lossless KV
(perplexity change, top-1 agreement, KL). Pass-key retrieval runs
``--passkey-trials`` contexts of 1.5K-4.9K tokens. Baselines in the same run:
fp16, the paper's 8-bit per-token absmax quantization, 4-bit KIVI-style, and
zstd on fp16. Sizes are bits per KV value with every byte of metadata.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import sysconfig
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import torch

from app.calibrate import round_trip_chunks
from codec import DEFAULT_LEVELS, TRANSFORM_SCHEMES, Level, Scheme, encode_chunk, load_level_table

log = logging.getLogger("codec_quality")
BASELINE_8BIT = 8.0  # the paper's baseline stored raw: 8 bits per value


# -- baselines: (quantize-dequantize, bits per value with metadata) ---------------------------------------


def int8_per_token(kv: torch.Tensor) -> tuple[torch.Tensor, float]:
    """The paper's / LMCache's quantizer at 8 bits: one absmax scale per (layer, k/v, token) over heads x channels."""
    x = kv.float()
    scale = x.abs().amax(dim=(2, 4), keepdim=True).clamp_min(1e-8) / 127
    q = torch.round(x / scale).clamp(-127, 127)
    heads, dim = kv.shape[2], kv.shape[4]
    return q * scale, 8.0 + 16.0 / (heads * dim)


def kivi4(kv: torch.Tensor, chunk: int = 256) -> tuple[torch.Tensor, float]:
    """KIVI-style 4-bit: keys per channel (min/max over each chunk's tokens), values per token."""
    x = kv.float()
    out = torch.empty_like(x)
    for s in range(0, x.shape[3], chunk):
        k = x[:, 0, :, s : s + chunk]
        lo, hi = k.amin(dim=2, keepdim=True), k.amax(dim=2, keepdim=True)
        sc = ((hi - lo) / 15).clamp_min(1e-8)
        out[:, 0, :, s : s + chunk] = torch.round((k - lo) / sc).clamp(0, 15) * sc + lo
    v = x[:, 1]
    lo, hi = v.amin(dim=3, keepdim=True), v.amax(dim=3, keepdim=True)
    sc = ((hi - lo) / 15).clamp_min(1e-8)
    out[:, 1] = torch.round((v - lo) / sc).clamp(0, 15) * sc + lo
    tokens, dim = kv.shape[3], kv.shape[4]
    key_meta = 32.0 * -(-tokens // chunk) / tokens  # fp16 min + scale per channel and chunk
    value_meta = 32.0 / dim  # fp16 min + scale per token and head
    return out, 4.0 + (key_meta + value_meta) / 2


def fp16(kv: torch.Tensor) -> tuple[torch.Tensor, float]:
    return kv.half().float(), 16.0


def zstd_fp16(kv: torch.Tensor) -> tuple[torch.Tensor, float]:
    level = Level("zstd", Scheme.ZSTD)
    half = kv.half()
    size = sum(len(encode_chunk(half[:, :, :, s : s + 256], level)) for s in range(0, kv.shape[3], 256))
    return half.float(), 8.0 * size / kv.numel()


BASELINES: dict[str, Callable[[torch.Tensor], tuple[torch.Tensor, float]]] = {
    "fp16": fp16,
    "zstd-fp16": zstd_fp16,
    "int8-per-token": int8_per_token,
    "kivi-4bit": kivi4,
}


def level_method(
    level: Level, inverse_bf16: bool | None = None
) -> Callable[[torch.Tensor], tuple[torch.Tensor, float]]:
    def run(kv: torch.Tensor) -> tuple[torch.Tensor, float]:
        out, size = round_trip_chunks(kv, level, inverse_bf16=inverse_bf16)
        return out, 8.0 * size / kv.numel()

    return run


# -- texts -----------------------------------------------------------------------------------------------


def benchmark_texts(extra_dir: Path | None = None) -> dict[str, str]:
    """Real prose shipped with the interpreter (PSF licence), plus ``extra_dir``'s ``*.txt`` files."""
    from pydoc_data import topics

    texts = {
        "python-license": Path(sysconfig.get_paths()["stdlib"]) / "LICENSE.txt",
        "pyref-specialnames": topics.topics["specialnames"],
        "pyref-types": topics.topics["types"],
        "pyref-debugger": topics.topics["debugger"],
    }
    out = {}
    for name, text in texts.items():
        if isinstance(text, Path):
            if not text.is_file():
                continue
            text = text.read_text(encoding="utf-8")
        out[name] = text
    for extra in sorted(extra_dir.glob("*.txt")) if extra_dir is not None else []:
        out[f"extra-{extra.stem[:12]}"] = extra.read_text(encoding="utf-8")
    return out


def held_out_references(
    runner, args: argparse.Namespace, extra_dir: Path | None = None
) -> Iterator[tuple[str, int, object]]:
    """``(name, text tokens, reference)`` for up to ``args.texts`` texts long enough for the prefix
    and the continuation.

    A reference is ``engine.quality.reference_continuation`` of the text's first ``args.prefix_tokens``
    + ``args.continuation_tokens`` tokens: the lossless prefix KV and the continuation's logits.
    """
    from engine.quality import reference_continuation

    need = args.prefix_tokens + args.continuation_tokens
    taken = 0
    for name, text in benchmark_texts(extra_dir).items():
        if taken == args.texts:
            return
        ids = runner.tokenizer(text, add_special_tokens=False)["input_ids"]
        if len(ids) < need:
            log.info("skipping %s: %d tokens < %d", name, len(ids), need)
            continue
        taken += 1
        yield name, len(ids), reference_continuation(runner, ids[:need], args.prefix_tokens)


def passkey_lengths(trials: int) -> list[int]:
    """The context lengths of the pass-key trials, 1,500 to 4,900 tokens; trial i uses seed i."""
    return [int(n) for n in np.linspace(1500, 4900, trials).astype(int)] if trials else []


# -- the run ---------------------------------------------------------------------------------------------


def run(args: argparse.Namespace) -> dict:
    from engine import ModelRunner, load_model
    from engine.quality import continuation_quality, passkey_answer, passkey_task

    torch.manual_seed(0)
    tables = [(None, DEFAULT_LEVELS)]
    if args.levels_file:
        files = [Path(f) for f in args.levels_file]
        tables = [(f, load_level_table(json.loads(f.read_text()), f.parent)) for f in files]
    methods = {}
    for path, levels in tables:
        # several tables, measured in one run: their levels are named "<table>/<level>"
        label = path.stem.removeprefix("SmolLM2-135M-Instruct").lstrip(".+") if path else ""
        prefix = f"{label or 'default'}/" if len(tables) > 1 else ""
        for lv in levels:
            if lv.lossless:
                continue
            if args.inverse == "both" and lv.scheme in TRANSFORM_SCHEMES:
                methods[f"{prefix}{lv.name}/fp32-inv"] = level_method(lv, inverse_bf16=False)
                methods[f"{prefix}{lv.name}/bf16-inv"] = level_method(lv, inverse_bf16=True)
            else:
                methods[prefix + lv.name] = level_method(lv)
    if not args.no_baselines:
        methods.update(BASELINES)
    runner = ModelRunner(load_model(args.model, dtype=args.dtype))

    per_text: dict[str, dict] = {}
    t0 = time.monotonic()
    for name, tokens, ref in held_out_references(runner, args, args.extra_texts):
        rows = {}
        for method, fn in methods.items():
            kv, bits = fn(ref.prefix_kv)
            q = continuation_quality(runner, ref, kv.to(ref.prefix_kv.dtype))
            rows[method] = {"bits": bits, "ppl_change": q.ppl_change, "top1": q.top1, "kl": q.kl}
        per_text[name] = {"tokens": tokens, "ppl": float(np.exp(ref.nll)), "methods": rows}
        log.info("%s done in %.0f s", name, time.monotonic() - t0)
        t0 = time.monotonic()

    passkey: dict[str, list[bool]] = {"lossless": []} | {m: [] for m in methods}
    lengths = passkey_lengths(args.passkey_trials)
    for trial, n in enumerate(lengths):
        task = passkey_task(runner, n, seed=trial)
        kv = runner.compute_kv(task.context_ids)
        passkey["lossless"].append(passkey_answer(runner, task, kv))
        for method, fn in methods.items():
            passkey[method].append(passkey_answer(runner, task, fn(kv)[0].to(kv.dtype)))
        log.info(
            "pass-key trial %d (%d tokens): %s",
            trial,
            len(task.context_ids),
            {m: v[-1] for m, v in passkey.items()},
        )

    summary = {}
    for method in ["lossless", *methods]:
        rows = [t["methods"][method] for t in per_text.values()] if method != "lossless" else []
        entry = {"passkey": float(np.mean(passkey[method])) if lengths else None}
        if method == "lossless":
            entry |= {"bits": 32.0, "ppl_change": 0.0, "top1": 1.0}
        else:
            for key in ("bits", "ppl_change", "top1", "kl"):
                entry[key] = float(np.mean([r[key] for r in rows]))
            entry["worst_ppl_change"] = float(max(r["ppl_change"] for r in rows))
            entry["worst_top1"] = float(min(r["top1"] for r in rows))
        entry["x_smaller_than_8bit"] = BASELINE_8BIT / entry["bits"]
        summary[method] = entry
    return {
        "model": runner.loaded.name,
        "precision": runner.loaded.precision,
        "prefix_tokens": args.prefix_tokens,
        "continuation_tokens": args.continuation_tokens,
        "passkey_trials": len(lengths),
        "texts": per_text,
        "summary": summary,
    }


def print_table(result: dict) -> None:
    print(
        f"\n{result['model']}: {len(result['texts'])} texts x {result['prefix_tokens']}+"
        f"{result['continuation_tokens']} tokens, {result['passkey_trials']} pass-key trials"
    )
    print(
        f"{'method':16s} {'bits/val':>8s} {'vs 8-bit':>8s} {'PPL chg':>8s} {'worst':>7s} {'top-1':>6s} "
        f"{'worst':>6s} {'pass-key':>8s}"
    )
    for method, e in result["summary"].items():
        pk = "-" if e["passkey"] is None else f"{e['passkey']:.2f}"
        worst_p = f"{100 * e.get('worst_ppl_change', 0):+.2f}%"
        print(
            f"{method:16s} {e['bits']:8.3f} {e['x_smaller_than_8bit']:7.2f}x {100 * e['ppl_change']:+7.2f}% "
            f"{worst_p:>7s} {e['top1']:6.3f} {e.get('worst_top1', 1.0):6.3f} {pk:>8s}"
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/codec_quality.json"))
    parser.add_argument("--model", default="smollm2")
    parser.add_argument(
        "--dtype", default="auto", help="as CACHEGEN_DTYPE: auto, float32, bf16-weights, bfloat16"
    )
    parser.add_argument(
        "--levels-file",
        action="append",
        help="level table JSON to measure instead of the default; repeat it to compare tables in one run",
    )
    parser.add_argument("--texts", type=int, default=4)
    parser.add_argument("--extra-texts", type=Path, help="a directory of *.txt files to measure as well")
    parser.add_argument("--prefix-tokens", type=int, default=2048)
    parser.add_argument("--continuation-tokens", type=int, default=256)
    parser.add_argument("--passkey-trials", type=int, default=12)
    parser.add_argument(
        "--no-baselines", action="store_true", help="levels only (when comparing level tables)"
    )
    parser.add_argument(
        "--inverse",
        choices=("auto", "both"),
        default="auto",
        help="transform levels' inverse: the CPU's choice, or float32 and bf16 side by side",
    )
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    torch.set_num_threads(max(1, torch.get_num_threads()))
    result = run(args)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print_table(result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
