"""The Grafana dashboard (docker/monitoring) against a live gateway: every query parses as PromQL and
names only metrics the gateway exports, every topic an operator looks for has a panel, and the
compose monitoring profile wires Prometheus and Grafana to the files in the repository."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path

import httpx
import promql_parser
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from tests.conftest import MODEL_NAME

pytestmark = pytest.mark.slow

DOCKER = Path(__file__).resolve().parents[2] / "docker"
DASHBOARD = DOCKER / "monitoring" / "grafana" / "dashboards" / "cachegen.json"

# Grafana's variables, as Grafana would expand them, so that the queries parse as plain PromQL.
GRAFANA_VARIABLES = {"$__rate_interval": "1m", "$instance": ".*"}

# What the dashboard must show (the list), each by a metric that carries it.
TOPICS = {
    "TTFT": "cachegen:time_to_first_token_seconds_bucket",
    "E2E latency": "cachegen:e2e_request_latency_seconds_bucket",
    "prompt tokens/s": "cachegen:prompt_tokens_total",
    "generated tokens/s": "cachegen:generation_tokens_total",
    "requests running": "cachegen:num_requests_running",
    "requests waiting": "cachegen:num_requests_waiting",
    "KV memory": "cachegen:kv_memory_used_bytes",
    "prefix-cache hit rate": "cachegen:prefix_cache_hits_total",
    "chunks by level and source": "cachegen:kv_chunks_total",
    "link bandwidth estimate": "cachegen:kv_bandwidth_estimate_bytes_per_second",
    "SLO met and missed": "cachegen:kv_slo_total",
    "store faults": "cachegen:kv_store_faults_total",
    "store bytes": "cachegen:store_bytes",
}

_SAMPLE_SUFFIXES = {
    "counter": ("_total", "_created"),
    "histogram": ("_bucket", "_sum", "_count", "_created"),
    "summary": ("", "_sum", "_count", "_created"),
    "gauge": ("",),
}


def panels(dashboard: dict) -> Iterator[dict]:
    for panel in dashboard["panels"]:
        yield panel
        yield from panel.get("panels", [])  # a collapsed row holds its panels


def expand(expr: str) -> str:
    for variable, value in GRAFANA_VARIABLES.items():
        expr = expr.replace(variable, value)
    assert "$" not in expr, f"a Grafana variable this test does not know: {expr}"
    return expr


def selected_metrics(node) -> set[str]:
    """The metric names of every selector in a parsed PromQL expression."""
    if isinstance(node, promql_parser.VectorSelector):
        return {node.name}
    if isinstance(node, promql_parser.MatrixSelector):
        return selected_metrics(node.vector_selector)
    children = []
    if isinstance(node, promql_parser.Call):
        children = list(node.args)
    elif isinstance(node, promql_parser.BinaryExpr):
        children = [node.lhs, node.rhs]
    elif isinstance(node, promql_parser.AggregateExpr):
        children = [node.expr, node.param]
    elif isinstance(node, (promql_parser.ParenExpr, promql_parser.UnaryExpr, promql_parser.SubqueryExpr)):
        children = [node.expr]
    return set().union(*(selected_metrics(c) for c in children if c is not None))


def exported_sample_names(exposition: str) -> set[str]:
    """Every sample name the families in a /metrics text can have, observed yet or not."""
    names = set()
    for family in text_string_to_metric_families(exposition):
        names.update(family.name + suffix for suffix in _SAMPLE_SUFFIXES.get(family.type, ("",)))
        names.update(sample.name for sample in family.samples)
    return names


@pytest.fixture(scope="module")
def dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


@pytest.fixture(scope="module")
def queries(dashboard: dict) -> dict[str, set[str]]:
    """Each panel's title -> the metrics its queries select (after checking each query parses)."""
    found = {}
    for panel in panels(dashboard):
        if panel["type"] == "row":
            continue
        assert panel.get("targets"), f"panel {panel['title']!r} has no query"
        metrics = set()
        for target in panel["targets"]:
            names = selected_metrics(promql_parser.parse(expand(target["expr"])))
            assert names, f"{target['expr']!r} selects no metric"
            metrics |= names
        found[panel["title"]] = metrics
    return found


def test_every_dashboard_query_names_a_metric_the_live_gateway_exports(gateway, queries, dashboard):
    r = httpx.post(
        f"{gateway.url}/v1/chat/completions",
        json={"model": MODEL_NAME, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2},
        timeout=120,
    )
    assert r.status_code == 200, r.text
    exported = exported_sample_names(httpx.get(f"{gateway.url}/metrics", timeout=30).text)
    assert "cachegen:time_to_first_token_seconds_bucket" in exported  # the parse above found the gateway's

    wanted = {name: title for title, names in queries.items() for name in names}
    for variable in dashboard["templating"]["list"]:
        if variable["type"] == "query":  # Grafana's label_values(metric, label), not PromQL
            metric = re.fullmatch(r"label_values\(([\w:]+),\s*\w+\)", variable["definition"]).group(1)
            wanted[metric] = f"variable {variable['name']}"
    missing = {name: title for name, title in wanted.items() if name not in exported}
    assert not missing, f"the dashboard queries metrics the gateway does not export: {missing}"


def test_the_dashboard_has_a_panel_for_each_topic(queries):
    shown = set().union(*queries.values())
    assert not {topic for topic, metric in TOPICS.items() if metric not in shown}
    assert len(queries) == len(set(queries)), "two panels share a title"


def test_the_monitoring_profile_provisions_this_dashboard_over_the_gateways_metrics(dashboard):
    compose = yaml.safe_load((DOCKER / "compose.yaml").read_text())["services"]
    assert compose["prometheus"]["profiles"] == compose["grafana"]["profiles"] == ["monitoring"]
    assert "profiles" not in compose["gateway"]  # plain `docker compose up` still runs the gateway alone

    prometheus = yaml.safe_load((DOCKER / "monitoring" / "prometheus.yaml").read_text())
    (job,) = prometheus["scrape_configs"]
    gateway_port = compose["gateway"]["ports"][0].split(":")[-1]
    assert job["metrics_path"] == "/metrics"
    assert job["static_configs"][0]["targets"] == [f"gateway:{gateway_port}"]

    # compose volume "source:target:ro" -> {target: source}
    mounted = {v.split(":")[1]: DOCKER / v.split(":")[0] for v in compose["grafana"]["volumes"]}
    provisioning = mounted["/etc/grafana/provisioning"]
    (provider,) = yaml.safe_load((provisioning / "dashboards" / "cachegen.yaml").read_text())["providers"]
    assert (mounted[provider["options"]["path"]] / DASHBOARD.name).resolve() == DASHBOARD

    (source,) = yaml.safe_load((provisioning / "datasources" / "prometheus.yaml").read_text())["datasources"]
    assert source["type"] == "prometheus" and source["url"] == "http://prometheus:9090"
    (datasource,) = [v for v in dashboard["templating"]["list"] if v["type"] == "datasource"]
    assert datasource["query"] == "prometheus"  # every panel picks its Prometheus through this variable
