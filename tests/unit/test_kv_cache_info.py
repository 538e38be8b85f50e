"""The ``kv_cache_info`` response extension: what it shows, and what it keeps from tenants."""

from __future__ import annotations

from app.gateway import kv_cache_info, shows_link
from app.settings import Settings
from scheduler.generation import PrefixReport

REPORT = PrefixReport(
    cached_tokens=256, recomputed_tokens=10, chunks=[], load_ms=5.0, prefill_ms=3.0, faults=[], bandwidth_bps=1.25e8
)


def test_the_link_estimate_is_shown_in_megabits():
    assert kv_cache_info(REPORT)["bandwidth_mbps"] == 1000.0


def test_with_tenants_the_process_wide_link_estimate_stays_out_of_responses():
    assert shows_link(Settings())
    tenants = Settings(api_key="a,b")
    assert not shows_link(tenants)
    assert shows_link(Settings(api_key="a,b", shared_cache=True))  # one tenant: nothing to leak
    info = kv_cache_info(REPORT, show_link=shows_link(tenants))
    assert info["bandwidth_mbps"] is None and info["cached_tokens"] == 256
