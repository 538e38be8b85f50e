"""The loader's plan-as-you-go on a simulated link: real bytes, simulated time.

A memory store behind a one-lane link that sleeps ``bytes / rate`` per GET
(fetches queue for the lane, as they share a real link), and a runner whose
text prefill sleeps the profile's recompute time. The rate can change in the
middle of a request.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor

import pytest
import torch

import scheduler.loader as loader_module
from codec import LOSSLESS, Level, Scheme
from codec.quantized import QuantParams
from scheduler.contexts import ContextStore
from scheduler.geometry import KVGeometry
from scheduler.loader import PRIOR_BYTES_PER_SECOND, PrefixLoader
from scheduler.planner import TEXT, Plan, plan
from scheduler.prefix import make_fingerprint
from scheduler.prefix_load import KVRequest
from scheduler.profile import CostProfile
from scheduler.stored import find_stored_prefix
from storage.base import DEFAULT_LIMIT
from storage.local import LocalStore
from storage.memory import MemoryStore

CHUNK = 16
GEOMETRY = KVGeometry(layers=4, kv_heads=2, head_dim=16)
MEDIUM = Level("medium", Scheme.QUANT, lossless=False, quant=QuantParams(key_step=(0.3,), value_step=(0.3,)))
LOW = Level("low", Scheme.QUANT, lossless=False, quant=QuantParams(key_step=(1.5,), value_step=(1.5,)))
LEVELS = [LOSSLESS, MEDIUM, LOW]
RANKS = {"lossless": 0.0, "medium": 0.0136, "low": 0.088}
RECOMPUTE_S = 0.04  # per chunk


class SimulatedLink(MemoryStore):
    def __init__(self, rate_bps: float) -> None:
        super().__init__()
        self.rate_bps = rate_bps
        self._lane = threading.Lock()
        self.gets = 0
        self.drop_after: tuple[int, float] | None = None  # (GETs, new rate): the link degrades
        self.overlapped: list[bool] = []  # per chunk GET: another was in flight when it was issued
        self._active = 0
        self._count = threading.Lock()

    def resident_many(self, keys):
        return [False for _ in keys]

    def get(self, key: str, limit: int = DEFAULT_LIMIT) -> bytes:
        data = super().get(key, limit)
        if key.endswith("index.json"):
            return data
        with self._count:
            self.overlapped.append(self._active > 0)
            self._active += 1
        try:
            with self._lane:
                self.gets += 1
                if self.drop_after is not None and self.gets > self.drop_after[0]:
                    self.rate_bps = self.drop_after[1]
                time.sleep(len(data) / self.rate_bps)
        finally:
            with self._count:
                self._active -= 1
        return data


class SimulatedRunner:
    def new_kv(self, tokens: int) -> torch.Tensor:
        return torch.zeros(GEOMETRY.chunk_shape(tokens))

    def start_prefill(
        self, kv: torch.Tensor, start: int, token_ids: list[int], after: Future[bool] | None = None
    ) -> Future[bool]:
        """The recompute time passes on a thread of its own, as a model's prefill does."""
        done: Future[bool] = Future()

        def prefill() -> None:
            if after is not None and not after.result():
                done.set_result(False)
                return
            time.sleep(RECOMPUTE_S * len(token_ids) / CHUNK)
            done.set_result(True)

        threading.Thread(target=prefill, daemon=True).start()
        return done


def setup(rate_bps: float, chunks: int = 12):
    store = SimulatedLink(rate_bps)
    pool = ThreadPoolExecutor(4)
    fp = make_fingerprint(weights="w", config={}, vocabulary="v", chunk_size=CHUNK)
    contexts = ContextStore(store, fp, "m", CHUNK, pool)
    tokens = list(range(chunks * CHUNK))
    kv = torch.randn(GEOMETRY.chunk_shape(len(tokens)), generator=torch.Generator().manual_seed(1))
    store.rate_bps = 1e12  # writing is not what is measured
    contexts.save(tokens, kv, LEVELS, 0.0)
    store.rate_bps = rate_bps
    # costs as a start-up profile would have measured them on this "machine"
    profile = CostProfile({"lossless": 1e-5, "medium": 3e-5, "low": 3e-5}, 0.0, RECOMPUTE_S / CHUNK, 0.0)
    loader = PrefixLoader(store, GEOMETRY, pool, profile)
    return store, contexts, loader, tokens


def run(contexts, loader, tokens, budget_s=None, levels=LEVELS):
    stored = find_stored_prefix(
        contexts.store, contexts.fingerprint, CHUNK, contexts.keys(tokens), tokens, levels
    )
    request = KVRequest(list(levels), RANKS, budget_s=budget_s)
    started = time.perf_counter()
    result = loader.load(SimulatedRunner(), stored, tokens, request, len(tokens) + 1, started)
    return result, time.perf_counter() - started


def sources(result) -> list[str]:
    return [c.level or c.source for c in result.chunks]


def test_fast_link_and_a_loose_budget_load_lossless():
    _, contexts, loader, tokens = setup(rate_bps=5e6)
    run(contexts, loader, tokens, budget_s=5.0)  # the first request measures the link
    result, _ = run(contexts, loader, tokens, budget_s=5.0)
    # exact KV only: lossless, or text where recomputing beside the link is faster
    assert set(sources(result)) <= {"lossless", TEXT} and result.exact
    assert "lossless" in sources(result)
    assert loader.bandwidth.bytes_per_second > 2e6


def test_slow_link_mixes_lower_levels_and_text_to_meet_a_tight_budget():
    _, contexts, loader, tokens = setup(rate_bps=100e3)
    run(contexts, loader, tokens[: 4 * CHUNK], budget_s=0.3)  # measure the link
    result, elapsed = run(contexts, loader, tokens, budget_s=0.35)
    used = sources(result)
    assert result.tokens == len(tokens)
    assert TEXT in used and {"medium", "low"} & set(used), used  # levels and text, mixed
    assert elapsed <= 0.35 * 1.2, (elapsed, used)
    assert not result.exact


def test_rate_drop_mid_request_moves_later_chunks_down():
    store, contexts, loader, tokens = setup(rate_bps=2e6)
    run(contexts, loader, tokens, budget_s=1.0)  # measured at the fast rate
    steady, _ = run(contexts, loader, tokens, budget_s=0.2)
    assert steady.exact, sources(steady)  # the link holds: exact KV only
    store.drop_after = (store.gets + 2, 400e3)  # from the third fetch on, 5x slower
    result, elapsed = run(contexts, loader, tokens, budget_s=0.2)
    used = sources(result)
    # chunks planned after the drop move to smaller levels (or text); the fetches already in
    # flight when it came are what it costs
    assert not result.exact and {"medium", "low"} & set(used[4:]), (sources(steady), used)
    assert sources(steady).count("lossless") > used.count("lossless")
    assert elapsed <= 0.2 * 1.5, (elapsed, used)  # three fetches were in flight at the old rate


def test_named_level_is_used_for_every_chunk_whatever_the_link():
    store, contexts, loader, tokens = setup(rate_bps=200e3)
    stored = find_stored_prefix(store, contexts.fingerprint, CHUNK, contexts.keys(tokens), tokens, [MEDIUM])
    request = KVRequest([MEDIUM], RANKS, fixed=True, budget_s=0.01)
    result = loader.load(SimulatedRunner(), stored, tokens, request, len(tokens) + 1, time.perf_counter())
    assert sources(result) == ["medium"] * 12


def test_a_store_that_knows_its_rate_has_its_first_chunks_planned_with_it(monkeypatch):
    """A process's first fetches are priced at the store's prior: 100 Mbit/s for a link, the
    store's own for a local directory (``LocalStore.prior_bytes_per_second``)."""
    rates: list[float] = []

    def recording(inputs):
        rates.append(inputs.rate_bps)
        return plan(inputs)

    monkeypatch.setattr(loader_module, "plan", recording)
    _, contexts, loader, tokens = setup(rate_bps=1e9)
    run(contexts, loader, tokens)
    assert rates[0] == PRIOR_BYTES_PER_SECOND
    rates.clear()
    store, contexts, loader, tokens = setup(rate_bps=1e9)
    store.prior_bytes_per_second = 2e9
    run(contexts, loader, tokens)
    assert rates[0] == 2e9
    assert LocalStore.prior_bytes_per_second and LocalStore.prior_bytes_per_second > PRIOR_BYTES_PER_SECOND


def test_a_small_level_measured_slow_does_not_price_lossless_under_the_store_floor(monkeypatch):
    """Each level is priced at its own transfers' rate (``LinkRates``): after requests that read
    only ``medium``, a local directory's lossless chunks are planned at the store's floor, not at
    the rate the small reads got, and from their own reads on at what those got."""
    seen: list[dict[str, float]] = []

    def recording(inputs):
        seen.append(dict(inputs.level_rates_bps or {}))
        return plan(inputs)

    store, contexts, loader, tokens = setup(rate_bps=2e6)
    store.prior_bytes_per_second = 50e6
    loader.bandwidth.evidence_s = 0.0  # the simulated chunks are small: any transfer counts
    stored = find_stored_prefix(store, contexts.fingerprint, CHUNK, contexts.keys(tokens), tokens, [MEDIUM])
    fixed = KVRequest([MEDIUM], RANKS, fixed=True)
    loader.load(SimulatedRunner(), stored, tokens, fixed, len(tokens) + 1, time.perf_counter())
    medium_rate = loader.bandwidth.level("medium")
    assert medium_rate is not None and medium_rate < 3e6
    monkeypatch.setattr(loader_module, "plan", recording)
    run(contexts, loader, tokens)
    assert seen[0]["lossless"] == 50e6  # the floor, where the small reads' rate would be 2 MB/s
    assert seen[0]["medium"] == medium_rate
    assert loader.bandwidth.level("lossless") is not None  # lossless was read, and so measured
    assert seen[-1]["lossless"] == pytest.approx(2e6, rel=0.5)  # its own rate, once it counts


def test_a_store_that_knows_its_rate_overlaps_its_first_fetches():
    """On a link nobody has measured the first chunk is fetched alone; a store with a prior (a
    local directory) fetches the whole window at once, so its first estimate is of reads that
    overlap as later ones do."""
    for prior, overlaps in ((None, False), (50e6, True)):
        store, contexts, loader, tokens = setup(rate_bps=2e6)
        store.prior_bytes_per_second = prior
        store.overlapped.clear()
        run(contexts, loader, tokens)
        assert store.overlapped[1] is overlaps, (prior, store.overlapped[:4])


class GatedRunner(SimulatedRunner):
    """Its prefill ends only once the loader has decoded a store chunk since it started (or after
    5 s), with what ``outcome`` says: so a loader that waited for it would be seen waiting."""

    def __init__(self, outcome=True) -> None:
        self.outcome = outcome  # True, False (cancelled) or an exception
        self.decoded = threading.Event()
        self.calls: list[tuple[int, int]] = []
        self.waited: list[bool] = []

    def start_prefill(
        self, kv: torch.Tensor, start: int, token_ids: list[int], after: Future[bool] | None = None
    ) -> Future[bool]:
        done: Future[bool] = Future()
        self.calls.append((start, len(token_ids)))
        self.decoded.clear()

        def prefill() -> None:
            self.waited.append(self.decoded.wait(5.0))
            if isinstance(self.outcome, BaseException):
                done.set_exception(self.outcome)
            else:
                done.set_result(self.outcome)

        threading.Thread(target=prefill, daemon=True).start()
        return done


def text_first(monkeypatch, runner: GatedRunner, text_chunks: int = 2) -> None:
    """Plans put ``text_chunks`` text chunks first and the store's medium after them; every decode
    tells ``runner``."""
    first = []

    def planned(inputs):
        n = len(inputs.chunks)
        sources = [TEXT] * text_chunks + ["medium"] * (n - text_chunks) if not first else ["medium"] * n
        first.append(True)
        return Plan(sources, 0.0, 0.0)

    decode_into = loader_module.decode_into

    def decoding(batch, out):
        decode_into(batch, out)
        runner.decoded.set()

    monkeypatch.setattr(loader_module, "plan", planned)
    monkeypatch.setattr(loader_module, "decode_into", decoding)


def load_with(runner, contexts, loader, tokens):
    stored = find_stored_prefix(
        contexts.store, contexts.fingerprint, CHUNK, contexts.keys(tokens), tokens, LEVELS
    )
    request = KVRequest(list(LEVELS), RANKS, budget_s=10.0)
    return loader.load(runner, stored, tokens, request, len(tokens) + 1, time.perf_counter())


def test_store_chunks_decode_while_the_text_chunks_before_them_prefill(monkeypatch):
    """A run of text chunks is one prefill on the model, and the loader goes on decoding the store
    chunks after it instead of waiting for it (issue 16: no thread blocks on text prefill)."""
    _, contexts, loader, tokens = setup(rate_bps=1e9)
    runner = GatedRunner()
    text_first(monkeypatch, runner)
    result = load_with(runner, contexts, loader, tokens)
    assert runner.calls == [(0, 2 * CHUNK)]  # the two text chunks, one prefill
    assert runner.waited == [True]  # a store chunk was decoded while it ran
    assert sources(result) == [TEXT, TEXT] + ["medium"] * 10
    assert [c.index for c in result.chunks] == list(range(12))
    assert result.tokens == 12 * CHUNK and result.kv is not None


def test_a_cancelled_text_prefill_ends_the_prefix_before_it(monkeypatch):
    """Store chunks decoded after a text run that did not finish are no prefix: without its KV
    they do not continue anything."""
    _, contexts, loader, tokens = setup(rate_bps=1e9)
    runner = GatedRunner(outcome=False)
    text_first(monkeypatch, runner)
    result = load_with(runner, contexts, loader, tokens)
    assert runner.waited == [True]
    assert result.tokens == 0 and result.kv is None


def test_a_failed_text_prefill_fails_the_load(monkeypatch):
    _, contexts, loader, tokens = setup(rate_bps=1e9)
    runner = GatedRunner(outcome=RuntimeError("the model step failed"))
    text_first(monkeypatch, runner)
    with pytest.raises(RuntimeError, match="model step failed"):
        load_with(runner, contexts, loader, tokens)


class HeldRunner(SimulatedRunner):
    """Its prefill ends only when the test lets it (``release``)."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.decoded = threading.Event()  # set by ``text_first``'s decoder; unused here

    def start_prefill(
        self, kv: torch.Tensor, start: int, token_ids: list[int], after: Future[bool] | None = None
    ) -> Future[bool]:
        done: Future[bool] = Future()
        threading.Thread(target=lambda: done.set_result(self.release.wait(30)), daemon=True).start()
        return done


def start_with(runner, contexts, loader, tokens) -> Future:
    stored = find_stored_prefix(
        contexts.store, contexts.fingerprint, CHUNK, contexts.keys(tokens), tokens, LEVELS
    )
    request = KVRequest(list(LEVELS), RANKS, budget_s=10.0)
    return loader.start(runner, stored, tokens, request, len(tokens) + 1, time.perf_counter())


def test_start_returns_with_the_store_chunks_in_and_the_text_still_prefilling(monkeypatch):
    """The caller's thread does not wait for the text run: the future is done when it is."""
    _, contexts, loader, tokens = setup(rate_bps=1e9)
    runner = HeldRunner()
    text_first(monkeypatch, runner)
    future = start_with(runner, contexts, loader, tokens)
    assert not future.done()
    runner.release.set()
    result = future.result(10)
    assert sources(result) == [TEXT, TEXT] + ["medium"] * 10 and result.tokens == 12 * CHUNK


def test_a_load_that_fails_with_a_text_run_in_flight_raises_only_when_the_run_is_over(monkeypatch):
    """The run writes into the request's buffer: the caller, which frees it on an error, hears
    of the error only once nothing writes there any more."""
    _, contexts, loader, tokens = setup(rate_bps=1e9)
    runner = HeldRunner()
    text_first(monkeypatch, runner)

    def broken(batch, out):
        raise RuntimeError("the decoder broke")

    monkeypatch.setattr(loader_module, "decode_into", broken)
    future = start_with(runner, contexts, loader, tokens)
    assert not future.done()
    runner.release.set()
    with pytest.raises(RuntimeError, match="decoder broke"):
        future.result(10)
