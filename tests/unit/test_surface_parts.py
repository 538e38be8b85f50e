"""The gateway's operational surface without a model: readiness, tokenize request models,
context warnings, the new settings."""

from __future__ import annotations

import asyncio
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
from pydantic import ValidationError

from app.readiness import PROBE_KEY, Readiness
from app.serving_contexts import unstored_warning
from app.serving_tokens import DetokenizeRequest, TokenizeRequest
from app.settings import Settings
from storage import ObjectInfo, StorageUnavailable
from storage.memory import MemoryStore


class ProbedStore(MemoryStore):
    """Counts probes; fails them while ``down``; holds them while ``gate`` is clear."""

    def __init__(self) -> None:
        super().__init__()
        self.probes = 0
        self.down = False
        self.gate = threading.Event()
        self.gate.set()

    def head(self, key: str) -> ObjectInfo | None:
        assert key == PROBE_KEY
        self.probes += 1
        self.gate.wait(10)
        if self.down:
            raise StorageUnavailable("head s3://kv/readiness/probe: cannot reach http://127.0.0.1:1")
        return super().head(key)


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def pool():
    with ThreadPoolExecutor(max_workers=1) as executor:
        yield executor


def test_ready_then_not_ready_after_the_cache_expires(pool):
    store, clock = ProbedStore(), Clock()
    readiness = Readiness(store, pool, cache_s=5, clock=clock)

    async def scenario() -> None:
        report = await readiness.report()
        assert report.ready
        assert report.body() == {"status": "ready", "model": "ok", "store": "ok"}
        store.down = True
        clock.now += 4.9
        assert (await readiness.report()).ready  # cached
        assert store.probes == 1
        clock.now += 0.1
        report = await readiness.report()
        assert not report.ready and store.probes == 2
        assert report.body()["status"] == "not_ready"
        assert report.store.startswith("unreachable: ") and "cannot reach" in report.store

    asyncio.run(scenario())


def test_concurrent_callers_share_one_probe(pool):
    store = ProbedStore()
    readiness = Readiness(store, pool, clock=Clock())

    async def scenario() -> None:
        reports = await asyncio.gather(*(readiness.report() for _ in range(5)))
        assert all(r.ready for r in reports)

    asyncio.run(scenario())
    assert store.probes == 1


def test_a_hanging_probe_times_out_and_is_not_repeated(pool):
    store, clock = ProbedStore(), Clock()
    store.gate.clear()
    readiness = Readiness(store, pool, cache_s=5, timeout_s=0.05, clock=clock)

    async def scenario() -> None:
        report = await readiness.report()
        assert not report.ready and report.store == "unreachable: no answer in 0.05 s"
        clock.now += 10
        assert not (await readiness.report()).ready
        assert store.probes == 1  # the first one still hangs: no second one queued behind it
        store.gate.set()
        await asyncio.wrap_future(pool.submit(lambda: None))  # one worker: the probe has ended
        clock.now += 10
        assert (await readiness.report()).ready

    asyncio.run(scenario())
    assert store.probes == 2


def test_tokenize_takes_exactly_one_source():
    assert TokenizeRequest(prompt="hi").add_generation_prompt
    assert TokenizeRequest(messages=[{"role": "user", "content": "hi"}], model="m").prompt is None
    assert TokenizeRequest(prompt="hi", unknown_field=1).prompt == "hi"  # ignored, as vLLM does
    for body in ({}, {"prompt": "hi", "messages": [{"role": "user", "content": "hi"}]}, {"messages": []}):
        with pytest.raises(ValidationError):
            TokenizeRequest(**body)


@pytest.mark.parametrize("tokens", [[1, -1], [1.5], ["3"], [True], "12", None])
def test_detokenize_rejects_what_is_not_a_token_id(tokens):
    with pytest.raises(ValidationError):
        DetokenizeRequest(tokens=tokens)


def test_detokenize_accepts_ids_and_an_empty_list():
    assert DetokenizeRequest(tokens=[0, 5]).tokens == [0, 5]
    assert DetokenizeRequest(tokens=[]).tokens == []


def test_unstored_warning():
    assert unstored_warning(600, 600, 256) is None
    assert "nothing is stored" in unstored_warning(5, 0, 256)
    assert unstored_warning(600, 512, 256) == (
        "only the first 512 of 600 tokens are stored; requests that start with this context recompute "
        "the last 88"
    )


def test_cors_and_docs_settings(monkeypatch):
    monkeypatch.delenv("CACHEGEN_CORS_ORIGINS", raising=False)
    monkeypatch.delenv("CACHEGEN_DISABLE_DOCS", raising=False)
    assert Settings().cors_origins is None and not Settings().disable_docs
    monkeypatch.setenv("CACHEGEN_CORS_ORIGINS", "https://a.example, https://b.example")
    monkeypatch.setenv("CACHEGEN_DISABLE_DOCS", "true")
    settings = Settings()
    assert settings.cors_origins == ["https://a.example", "https://b.example"]
    assert settings.disable_docs
    monkeypatch.setenv("CACHEGEN_CORS_ORIGINS", "*")
    assert Settings().cors_origins == ["*"]
