"""deploy/k8s: valid Kubernetes objects (the schemas kubernetes-validate ships, strict: no unknown
field), wired to each other, naming only settings the gateway reads. No cluster is needed."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from app.settings import Settings

K8S = Path(__file__).resolve().parents[2] / "deploy" / "k8s"
kubernetes_validate = pytest.importorskip("kubernetes_validate")


def objects() -> list[dict]:
    return [doc for path in sorted(K8S.glob("*.yaml")) for doc in yaml.safe_load_all(path.read_text()) if doc]


def by_kind(kind: str) -> dict[str, dict]:
    return {o["metadata"]["name"]: o for o in objects() if o["kind"] == kind}


def containers(obj: dict) -> list[dict]:
    spec = obj["spec"]
    pod = spec["jobTemplate"]["spec"]["template"] if obj["kind"] == "CronJob" else spec["template"]
    return pod["spec"]["containers"]


@pytest.mark.parametrize("obj", objects(), ids=lambda o: f"{o['kind']}/{o['metadata']['name']}")
def test_every_object_is_valid_against_the_kubernetes_schema(obj):
    kubernetes_validate.validate(obj, kubernetes_validate.latest_version(), strict=True)


def test_a_broken_object_is_refused():
    """The check can fail: a Deployment with a misspelt field and a string for replicas."""
    broken = yaml.safe_load((K8S / "gateway.yaml").read_text().split("---")[0])
    broken["spec"]["replicas"] = "two"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, kubernetes_validate.latest_version(), strict=True)
    broken["spec"]["replicas"] = 2
    broken["spec"]["template"]["spec"]["containerz"] = []
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, kubernetes_validate.latest_version(), strict=True)


def test_credentials_come_from_the_secret_and_replicas_are_named_by_pod():
    secret = by_kind("Secret")["cachegen-s3"]
    assert set(secret["stringData"]) == {"AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"}
    for obj in (by_kind("Deployment")["cachegen-gateway"], by_kind("CronJob")["cachegen-gc"]):
        (container,) = containers(obj)
        assert {"secretRef": {"name": "cachegen-s3"}} in container["envFrom"]
        assert not any(e["name"].startswith("AWS_SECRET") for e in container.get("env", []))
    (gateway,) = containers(by_kind("Deployment")["cachegen-gateway"])
    replica = next(e for e in gateway["env"] if e["name"] == "CACHEGEN_REPLICA")
    assert replica["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
    assert gateway["readinessProbe"]["httpGet"]["path"] == "/ready"


def test_the_router_finds_the_gateway_pods_and_may_list_them():
    (router,) = containers(by_kind("Deployment")["cachegen-router"])
    args = router["args"]
    assert "--policy=cache_aware" in args and "--service-discovery" in args
    selector = args[args.index("--selector") + 1]
    gateway = by_kind("Deployment")["cachegen-gateway"]
    key, value = selector.split("=")
    assert gateway["spec"]["template"]["metadata"]["labels"][key] == value
    assert "--health-check-endpoint=/ready" in args
    role = by_kind("Role")["cachegen-router"]
    assert {"get", "list", "watch"} <= set(role["rules"][0]["verbs"]) and role["rules"][0]["resources"] == ["pods"]
    binding = by_kind("RoleBinding")["cachegen-router"]
    pod = by_kind("Deployment")["cachegen-router"]["spec"]["template"]["spec"]
    assert binding["subjects"][0]["name"] == pod["serviceAccountName"]


def test_every_cachegen_variable_is_a_setting():
    known = {f"CACHEGEN_{name}".upper() for name in Settings.model_fields}
    used = set(by_kind("ConfigMap")["cachegen-store"]["data"])
    for obj in objects():
        if obj["kind"] in ("Deployment", "CronJob"):
            used |= {e["name"] for c in containers(obj) for e in c.get("env", [])}
    unknown = {n for n in used if n.startswith("CACHEGEN_")} - known
    assert not unknown, sorted(unknown)
    gc_env = {e["name"] for e in containers(by_kind("CronJob")["cachegen-gc"])[0]["env"]}
    gateway_env = {e["name"] for e in containers(by_kind("Deployment")["cachegen-gateway"])[0]["env"]}
    assert "CACHEGEN_STORE_MAX_BYTES" in gc_env and "CACHEGEN_STORE_MAX_BYTES" not in gateway_env  # the cap: once
