"""What a context model could save on the transform levels' coefficients (issue 18, item 3).

    python -m benchmarks.context_study --out benchmarks/results/context_study.json

The transform levels code each quantized coefficient with one frequency table per component
(order 0). A context model would pick the table by something already decoded. This measures
the most either context the issue names could save, before any of it is built:

- ``H0``: the order-0 entropy of each component's quantized coefficients (what a table per
  component can reach at best);
- ``H|previous token``: conditioned on the same component's value at the token before;
- ``H|neighbour``: conditioned on the previous component's value at the same token (components
  are in decreasing variance).

A context is the conditioning value clipped to -3..3 (7 tables a component). Entropies are per
component, pooled over the chunks' tokens, with the Miller-Madow correction for the bias of a
finite sample, averaged over components: bits per value, without side information. They bound
what a coder with adapted tables could reach; one with a fixed bank, as ours, gets less. The
chunks are the second and later 256-token chunks of the held-out texts (no exact tokens), on the
default model.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

import numpy as np

from benchmarks.codec_quality import benchmark_texts
from codec import DEFAULT_LEVELS, Level
from codec.quantized import STEP_TABLE, step_codes
from codec.transformed import group_steps

log = logging.getLogger("context_study")
CLIP = 3  # contexts -3..3


def entropy(samples: np.ndarray) -> float:
    """Bits per sample of ``samples``' empirical distribution, Miller-Madow corrected."""
    if samples.size == 0:
        return 0.0
    _, counts = np.unique(samples, return_counts=True)
    p = counts / counts.sum()
    return float(-(p * np.log2(p)).sum() + (len(counts) - 1) / (2 * counts.sum() * np.log(2)))


def conditional_entropy(samples: np.ndarray, context: np.ndarray) -> float:
    """H(samples | context), with context clipped to -CLIP..CLIP."""
    context = np.clip(context, -CLIP, CLIP)
    return sum(float((context == c).mean()) * entropy(samples[context == c]) for c in np.unique(context))


def quantized_coefficients(level: Level, chunks: list[tuple[np.ndarray, int]]) -> np.ndarray:
    """(layers, 2, components, tokens): the level's integer coefficients, the chunks' tokens
    concatenated (each component's step as the encoder picks it per chunk)."""
    p = level.quant
    out = []
    for kv, position in chunks:
        c = p.transform.forward(kv, position)  # (layers, 2, heads, tokens, head_dim)
        layers, _, heads, _, dim = c.shape
        steps = np.broadcast_to(group_steps(p, layers)[:, :, None, None], (layers, 2, heads, dim))
        step = STEP_TABLE[step_codes(c, steps)][:, :, :, None, :]
        q = np.round(c / step).astype(np.int64)
        out.append(q.transpose(0, 1, 2, 4, 3).reshape(layers, 2, heads * dim, -1))  # component h*D + d
    return np.concatenate(out, axis=3)


def study(q: np.ndarray) -> dict[str, float]:
    layers, _, components, tokens = q.shape
    h0 = previous = neighbour = 0.0
    for layer in range(layers):
        for kind in range(2):
            group = q[layer, kind]
            for c in range(components):
                s = group[c]
                h0 += entropy(s)
                # the first token has no previous one: it is coded order-0
                previous += (conditional_entropy(s[1:], s[:-1]) * (tokens - 1) + entropy(s[:1])) / tokens
                neighbour += conditional_entropy(s, group[c - 1]) if c else entropy(s)
    n = layers * 2 * components
    return {"H0": h0 / n, "H|previous token": previous / n, "H|neighbour": neighbour / n}


def run(args: argparse.Namespace) -> dict:
    from engine import ModelRunner, load_model

    runner = ModelRunner(load_model())
    chunks: list[tuple[np.ndarray, int]] = []
    for name, text in benchmark_texts().items():
        tokens = (args.chunks_per_text + 1) * 256
        ids = runner.tokenizer(text, add_special_tokens=False)["input_ids"][:tokens]
        kv = runner.compute_kv(ids).float().numpy()
        chunks += [(kv[:, :, :, s : s + 256], s) for s in range(256, len(ids) - 255, 256)]
        log.info("%s: %d chunks so far", name, len(chunks))
    levels = {}
    for level in DEFAULT_LEVELS:
        if level.lossless:
            continue
        levels[level.name] = study(quantized_coefficients(level, chunks))
        log.info("%s: %s", level.name, levels[level.name])
    return {"chunks": len(chunks), "tokens": 256 * len(chunks), "levels": levels}


def print_table(result: dict) -> None:
    print(f"{result['chunks']} chunks of 256 tokens, default model; bits/value, no side information")
    print("| level | H0 | H given previous token | saving | H given neighbour | saving |")
    print("|---|---:|---:|---:|---:|---:|")
    for name, h in result["levels"].items():
        prev, nbr = h["H|previous token"], h["H|neighbour"]
        saved = (1 - prev / h["H0"], 1 - nbr / h["H0"])
        print(f"| {name} | {h['H0']:.4f} | {prev:.4f} | {saved[0]:.1%} | {nbr:.4f} | {saved[1]:.1%} |")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--chunks-per-text", type=int, default=4)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/context_study.json"))
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    result = run(args)
    print_table(result)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
