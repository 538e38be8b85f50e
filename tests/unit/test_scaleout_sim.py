"""The scale-out simulation's replica: what a single request costs, and steps that hold what was ready."""

from __future__ import annotations

import dataclasses

import pytest

from benchmarks.scaleout_sim import Costs, Job, Replica, simulate

TOKENS = 2000
COSTS = Costs(
    memory_hit_s_per_token=0.1 / TOKENS,  # a 0.1 s prefill step
    store_decode_s_per_token=0.4 / TOKENS,
    store_cpu_s_per_token=0.2 / TOKENS,
    store_bytes_per_token=1000.0,
    s3_stream_bytes_per_s=20e6,  # 2 MB in 0.1 s
    decode_s_per_token=0.05,
    beta=0.5,
    kv_bytes_per_token=1,
    colocated_slowdown=1.0,
    request_overhead_s=0.03,
    router_overhead_s=0.02,
)


def run(policy: str, requests: int, warmup: int, clients: int = 1, max_tokens: int = 4) -> dict[str, float]:
    return simulate(
        COSTS, replicas=1, context_tokens=[TOKENS], clients=clients, policy=policy, requests=requests,
        warmup=warmup, max_tokens=max_tokens, kv_memory_bytes=10 * TOKENS, s3_bytes_per_s=1e12, zipf=1.0, seed=0,
    )  # fmt: skip


@pytest.mark.parametrize(("policy", "routing"), [("round_robin", 0.0), ("cache_aware", 0.02)])
def test_one_client_pays_overhead_then_its_phases(policy: str, routing: float) -> None:
    cold = run(policy, requests=1, warmup=0)
    assert cold["memory_hot_share"] == 0.0
    # overhead, fetch (2 MB at 20 MB/s), decode of the fetched chunks, the question's prefill step
    assert cold["ttft_p50_s"] == pytest.approx(0.03 + routing + 0.1 + 0.4 + 0.2)
    hot = run(policy, requests=3, warmup=1)  # the first request loaded the context into memory
    assert hot["memory_hot_share"] == 1.0
    assert hot["ttft_p50_s"] == pytest.approx(0.03 + routing + 0.1)
    # after the first token, 3 decode steps alone: 4 tokens per request in 0.03 + 0.1 + 0.15 s
    assert hot["tokens_per_s"] == pytest.approx(4 / (0.03 + routing + 0.1 + 3 * 0.05))


def test_a_step_holds_what_was_ready_when_it_began() -> None:
    rep = Replica(capacity_tokens=10 * TOKENS)
    decoding = Job(0, 0, TOKENS, 0.0, 0, phase="decode", tokens_left=3)
    rep.running.append(decoding)
    rep.start_step(COSTS)
    assert rep.step == [decoding]
    assert rep.step_left == pytest.approx(0.05)
    late = Job(1, 0, TOKENS, 0.0, 0, phase="prompt", remaining=0.1)
    rep.ready.append(late)
    rep.start_step(COSTS)  # a step is in flight: the prompt waits for the next one
    assert rep.step == [decoding] and rep.ready == [late]
    rep.step = []
    rep.start_step(COSTS)
    assert set(map(id, rep.step)) == {id(decoding), id(late)}
    assert rep.step_left == pytest.approx(0.1 + 0.05)  # the prefill beside one decode


def test_loads_share_the_codec_thread() -> None:
    # two store hits at once: their decodes take turns on one thread (0.4 s each, so 0.8 s for
    # both), then both prompts are ready for one prefill step (0.2 s each)
    both = simulate(
        COSTS, replicas=1, context_tokens=[TOKENS, TOKENS], clients=2, policy="round_robin", requests=2,
        warmup=0, max_tokens=4, kv_memory_bytes=10 * TOKENS, s3_bytes_per_s=1e12, zipf=1.0, seed=0,
    )  # fmt: skip
    assert both["memory_hot_share"] == 0.0
    assert both["ttft_p50_s"] == pytest.approx(0.03 + 0.1 + 0.8 + 0.4)


def test_shared_cores_slow_the_threads_but_not_the_link() -> None:
    half = simulate(
        COSTS, replicas=1, context_tokens=[TOKENS], clients=1, policy="round_robin", requests=1,
        warmup=0, max_tokens=4, kv_memory_bytes=10 * TOKENS, s3_bytes_per_s=1e12, zipf=1.0, seed=0,
        shared_cores=0.5,
    )  # fmt: skip
    assert half["ttft_p50_s"] == pytest.approx(0.03 + 0.1 + 2 * (0.4 + 0.2))


def test_decodes_batch_by_beta() -> None:
    rep = Replica(capacity_tokens=10 * TOKENS)
    rep.running.extend(Job(c, 0, TOKENS, 0.0, 0, phase="decode", tokens_left=3) for c in range(4))
    rep.start_step(COSTS)
    assert rep.step_left == pytest.approx(0.05 * 4**0.5)


def test_room_is_made_from_the_least_recently_used_context_that_nobody_reads() -> None:
    rep = Replica(capacity_tokens=5000)
    rep.memory.update({0: 2000, 1: 1000, 2: 1000})
    rep.make_room(reserved=1232 + 768, in_use={0})  # a store hit's KV and staging; context 0 is read
    assert list(rep.memory) == [0, 2]


def test_a_memory_hit_step_is_a_line_through_the_short_and_the_long_context() -> None:
    measured = {
        "context_tokens": 2000, "long_context_tokens": 4000,
        "memory_hit_ttft_s": 0.2, "memory_hit_step_s": 0.15, "memory_hit_step_long_s": 0.25,
        "request_overhead_s": 0.01, "store_hit_ttft_s": 0.7, "store_fetch_s": 0.1, "store_decode_s": 0.4,
        "store_bytes": 6e6, "decode_s_per_token_batch1": 0.07, "decode_s_per_token_batch2": 0.07 * 2**0.3,
        "colocated_slowdown": 1.0, "kv_bytes_per_token": 46080,
    }  # fmt: skip
    costs = Costs.from_measured(measured)
    assert costs.memory_hit_step(2000) == pytest.approx(0.15)
    assert costs.memory_hit_step(4000) == pytest.approx(0.25)
    assert costs.memory_hit_s == pytest.approx(0.05)
    assert costs.beta == pytest.approx(0.3)
    assert costs.store_cpu_s_per_token == pytest.approx((0.7 - 0.1 - 0.4 - 0.01) / 2000)
    # a run that measured one context only: through 0
    older = Costs.from_measured({k: v for k, v in measured.items() if k != "memory_hit_step_long_s"})
    assert older.memory_hit_s == 0.0 and older.memory_hit_step(4000) == pytest.approx(0.3)


def test_only_a_replicas_first_store_hit_pays_its_start_up() -> None:
    costs = dataclasses.replace(COSTS, first_load_extra_s=0.5)
    # two contexts that fit memory together: the second request is a store hit too (its own context)
    first, second = (
        simulate(
            costs, replicas=1, context_tokens=[TOKENS, TOKENS], clients=1, policy="round_robin", requests=1,
            warmup=n - 1, max_tokens=1, kv_memory_bytes=10 * TOKENS, s3_bytes_per_s=1e12, zipf=1.0, seed=0,
            draws=[0, 1],
        )  # fmt: skip
        for n in (1, 2)
    )
    assert first["ttft_p50_s"] == pytest.approx(0.03 + 0.1 + 0.5 + 0.4 + 0.2)
    assert second["memory_hot_share"] == 0.0
    assert second["ttft_p50_s"] == pytest.approx(0.03 + 0.1 + 0.4 + 0.2)


def test_a_store_hit_waits_for_memory_that_a_running_request_reads() -> None:
    # room for one context and a half: the second store hit starts its fetch when the first
    # request ends (its TTFT 0.73 s, then 3 decode steps of 0.05 s), then takes 0.1 + 0.4 + 0.2 s
    second = simulate(
        COSTS, replicas=1, context_tokens=[TOKENS, TOKENS], clients=2, policy="round_robin", requests=1,
        warmup=1, max_tokens=4, kv_memory_bytes=TOKENS * 3 // 2, s3_bytes_per_s=1e12, zipf=1.0, seed=0,
        draws=[0, 1],
    )  # fmt: skip
    assert second["ttft_p50_s"] == pytest.approx(0.03 + 0.1 + 0.4 + 0.2 + 3 * 0.05 + 0.1 + 0.4 + 0.2)
