"""Measured costs of this machine and model: decode time per level, prefill time per token.

The planner needs them before the first request, so they are measured at
start-up (about two seconds on 2 CPU cores) and cached as JSON in the cache
directory, keyed by everything that changes them: model fingerprint, device,
dtype, thread count, chunk size and level digests. While serving, every
decode and prefill the gateway runs corrects them (a moving average), so a
machine that becomes busier is planned for as it is now.

Prefill of ``n`` tokens after ``past`` cached ones is modelled as
``overhead + n * (per_token + per_token_position * (past + n / 2))``:
attention makes later tokens dearer.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import threading
import time
from dataclasses import dataclass, field, fields
from pathlib import Path

import torch

from codec import Level, decode_chunks_into, encode_chunk, level_digest
from engine import ModelRunner

log = logging.getLogger(__name__)

# 2: decode timed into the model's buffer, on its device; 3: prefill timed on the serving path;
# 4: serving no longer learns the wait for the codec gate as decode time (profiles saved by 3 had)
# 5: the rANS decoder takes four streams at a time, and the inverse transform multiplies in bf16 on
#    a CPU with native bf16: decodes are 1.5-1.9x faster than what profiles of 4 timed
# 6: dense streams renormalise without a branch: format 4's decodes are up to 1.3x faster
# 7: a step's activations no longer fault their pages in every step (app/allocator.py): prefill
#    is up to 1.6x faster than what profiles of 6 timed
# 8: a short tail chunk's decode counts for its share of a chunk, and a slow decode moves the
#    estimate by at most a twentieth (``observe_decode``): profiles of 7 could make a level look
#    several times dearer than it is
# 9: the engine's fused forward (engine/fused_layers.py): prefill passes of few rows are faster
#    than what profiles of 8 timed
# 10: the fused forward runs bf16 weights too: a bf16-weights model's prefill is faster than what
#    profiles of 9 timed
PROFILE_VERSION = 10
_EWMA = 0.2  # weight of the newest measurement
# A decode slower than this many times the estimate is learned as this many times: a fresh
# process's first chunk took 30-141 ms where the rest took 21-23 (a one-time cost not yet found).
# At 2x, every load's first chunk raised its level's price by a fifth, and in ``auto`` on the
# transform levels the first chunk was often the only ``medium`` one, so nothing brought it back.
_DECODE_OUTLIER = 1.25
# A fetch's receive is an overhead per object and a cost per byte. A local read costs about 1 ms of
# CPU whatever its size: 80-130 KB chunk tails read as 9e-9 s/byte, 11.8 MB raw chunks as 3e-10
# to 1e-9. Learning one cost per byte from every object over 64 KiB, the tails taught a raw
# chunk's receive to cost 70-100 ms, and the planner sent loads from a local disk to lossy levels
# that decode 5x slower. Objects below this size teach the overhead; larger ones the cost per
# byte, over the overhead.
RECEIVE_SMALL_BYTES = 256 << 10


@dataclass
class CostProfile:
    decode_s_per_token: dict[str, float]  # level -> seconds per decoded token (all layers)
    prefill_overhead_s: float
    prefill_s_per_token: float
    prefill_s_per_token_position: float
    # CPU seconds per byte the I/O threads spend receiving a fetch (client library, copies). On a
    # machine with few cores it competes with decode and prefill, so the planner charges it to
    # the compute side: a raw chunk is 15x the bytes of a lossy one. Learned while serving.
    receive_s_per_byte: float = 0.0
    receive_s_per_object: float = 0.0  # the same, per fetch whatever its size
    version: int = PROFILE_VERSION
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def decode_seconds(self, level: str, tokens: int) -> float:
        return self.decode_s_per_token.get(level, max(self.decode_s_per_token.values(), default=0.0)) * tokens

    def prefill_seconds(self, tokens: int, past: int) -> float:
        if tokens <= 0:
            return 0.0
        per_token = self.prefill_s_per_token + self.prefill_s_per_token_position * (past + tokens / 2)
        return self.prefill_overhead_s + tokens * per_token

    def observe_decode(self, level: str, tokens: int, seconds: float, full_tokens: int | None = None) -> None:
        """Learn ``level``'s cost per token from a decode of ``tokens`` tokens. With ``full_tokens``
        (a whole chunk's), a shorter chunk counts for its share of one: a context's 5-token tail
        decodes in about the fixed cost of a call, 0.4 ms, which is 20 ms a chunk per token, and
        taught at full weight at the end of every load it made ``medium`` look 5x dearer than
        it is (64 ms a chunk against 11-14), and ``auto`` took ``high`` for it."""
        if tokens <= 0:
            return
        weight = _EWMA * (1.0 if full_tokens is None else min(tokens / full_tokens, 1.0))
        with self._lock:
            old = self.decode_s_per_token.get(level)
            new = seconds / tokens
            if old is not None:
                new = (1 - weight) * old + weight * min(new, _DECODE_OUTLIER * old)  # a slow one is no trend
            self.decode_s_per_token[level] = new

    def receive_seconds(self, nbytes: int) -> float:
        return self.receive_s_per_object + self.receive_s_per_byte * nbytes if nbytes > 0 else 0.0

    def observe_receive(self, nbytes: int, cpu_seconds: float) -> None:
        if nbytes <= 0:
            return
        cpu_seconds = max(cpu_seconds, 0.0)
        with self._lock:
            if nbytes < RECEIVE_SMALL_BYTES:
                self.receive_s_per_object = _ewma(self.receive_s_per_object, cpu_seconds)
            else:
                per_byte = max(cpu_seconds - self.receive_s_per_object, 0.0) / nbytes
                self.receive_s_per_byte = _ewma(self.receive_s_per_byte, per_byte)

    def observe_prefill(self, tokens: int, past: int, seconds: float) -> None:
        """Scale the whole prefill model by how far a real prefill was from its prediction."""
        predicted = self.prefill_seconds(tokens, past)
        if tokens < 16 or predicted <= 0:
            return  # tiny prefills are dominated by noise
        factor = (1 - _EWMA) + _EWMA * min(max(seconds / predicted, 0.2), 5.0)
        with self._lock:
            self.prefill_overhead_s *= factor
            self.prefill_s_per_token *= factor
            self.prefill_s_per_token_position *= factor

    def to_json(self) -> str:
        data = {f.name: getattr(self, f.name) for f in fields(self) if not f.name.startswith("_")}
        return json.dumps(data, indent=1, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> CostProfile:
        data = json.loads(text)
        if not isinstance(data, dict) or data.get("version") != PROFILE_VERSION:
            raise ValueError("not a cost profile of this version")
        decode = data["decode_s_per_token"]
        numbers = [*decode.values(), data["prefill_overhead_s"], data["prefill_s_per_token"]]
        numbers.append(data["prefill_s_per_token_position"])
        if not isinstance(decode, dict) or not all(isinstance(v, int | float) and v >= 0 for v in numbers):
            raise ValueError("cost profile has a non-numeric or negative entry")
        return cls(
            decode_s_per_token={str(k): float(v) for k, v in decode.items()},
            prefill_overhead_s=float(data["prefill_overhead_s"]),
            prefill_s_per_token=float(data["prefill_s_per_token"]),
            prefill_s_per_token_position=float(data["prefill_s_per_token_position"]),
            receive_s_per_byte=max(float(data.get("receive_s_per_byte", 0.0)), 0.0),
            receive_s_per_object=max(float(data.get("receive_s_per_object", 0.0)), 0.0),
        )


def _ewma(old: float, new: float) -> float:
    """The first observation as it is, then an average that weights the newest by ``_EWMA``."""
    return new if old == 0.0 else (1 - _EWMA) * old + _EWMA * new


def profile_key(fingerprint_hex: str, runner: ModelRunner, levels: list[Level], chunk_size: int) -> str:
    parts = [
        fingerprint_hex,
        str(runner.device),
        runner.loaded.precision,
        str(torch.get_num_threads()),
        str(chunk_size),
        *(f"{lv.name}.{level_digest(lv)}" for lv in levels),
    ]
    return hashlib.sha256("|".join(parts).encode()).hexdigest()[:24]


def profile_path(cache_dir: Path, key: str) -> Path:
    return cache_dir / "profiles" / f"{key}.json"


def load_or_measure(path: Path, runner: ModelRunner, levels: list[Level], chunk_size: int) -> CostProfile:
    try:
        profile = CostProfile.from_json(path.read_text())
        if all(lv.name in profile.decode_s_per_token for lv in levels):
            log.info("cost profile from %s", path)
            return profile
    except FileNotFoundError:
        pass
    except (ValueError, KeyError, TypeError) as exc:
        log.warning("ignoring unreadable cost profile %s: %s", path, exc)
    started = time.perf_counter()
    profile = measure(runner, levels, chunk_size)
    log.info("measured the cost profile in %.1f s: %s", time.perf_counter() - started, profile)
    save(profile, path)
    return profile


def save(profile: CostProfile, path: Path) -> None:
    """Write the profile (as corrected by serving, at shutdown) for the next process to start from."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(profile.to_json())
        tmp.replace(path)
    except OSError as exc:  # a read-only cache dir costs a re-measure next start, nothing more
        log.warning("could not cache the cost profile at %s: %s", path, exc)


def measure(runner: ModelRunner, levels: list[Level], chunk_size: int) -> CostProfile:
    """Prefills at two positions and of two lengths, and a decode of each level on real KV.

    Each timing is the best of two runs: the profile is for planning on a quiet
    machine, and serving corrects it for a busy one.
    """
    vocab = len(runner.tokenizer)
    n, small = chunk_size, max(chunk_size // 8, 1)
    ids = torch.randint(0, vocab, (2 * n + small,), generator=torch.Generator().manual_seed(0)).tolist()
    runner.prefill(ids[:8])  # first-call overheads out of the way
    # one buffer with room for every pass, as the step loop prefills into a request's buffer
    buffer = runner.new_kv(2 * n + small)
    kv0 = runner.prefill(ids[:n], buffer, prefix_tokens=0).prefix.clone()

    def prefill(tokens: list[int], past: int) -> None:
        runner.prefill(tokens, buffer, prefix_tokens=past)
        if buffer.device.type == "cuda":
            torch.cuda.synchronize(buffer.device)

    t0 = min(_time(prefill, ids[:n], 0) for _ in range(2))  # n tokens at position 0
    t1 = min(_time(prefill, ids[n : 2 * n], n) for _ in range(2))  # n tokens after n
    t2 = min(_time(prefill, ids[n : n + small], n) for _ in range(2))  # a few after n
    # model: t = overhead + tokens * (per_token + per_position * (past + tokens / 2))
    per_position = max((t1 - t0) / (n * n), 0.0)
    per_token = max((t1 - t2) / (n - small) - per_position * (n + (n + small) / 2), 1e-7)
    overhead = max(t2 - small * (per_token + per_position * (n + small / 2)), 0.0)

    chunk = kv0.float().cpu().contiguous()
    # decoded as the loader decodes: parsed, then written into a slice of a KV buffer on the model's
    # device in its dtype (Triton on a GPU, numba on the CPU)
    out = runner.new_kv(chunk.shape[3])
    decode = {}
    for level in levels:
        data = encode_chunk(chunk, level, position=chunk_size)  # a chunk after the context's first
        _decode_into(data, out)  # warm (and compile)
        decode[level.name] = min(_time(_decode_into, data, out) for _ in range(3)) / chunk_size
    return CostProfile(decode, overhead, per_token, per_position)


def _decode_into(data: bytes, out: torch.Tensor) -> None:
    decode_chunks_into([data], out)
    if out.device.type == "cuda":
        torch.cuda.synchronize(out.device)


def _time(fn, *args) -> float:
    t = time.perf_counter()
    fn(*args)
    return time.perf_counter() - t
