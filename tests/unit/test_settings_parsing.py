"""Settings from the environment and from constructor arguments: case, lists."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from app.settings import Settings


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("CONFIG_FILE", "LOG_LEVEL", "LOG_FORMAT", "ENCODE_LEVELS", "WRITE_BACK_LEVELS"):
        monkeypatch.delenv(f"CACHEGEN_{name}", raising=False)


@pytest.mark.parametrize("value", ["INFO", "info", "Info", " warning ", "DEBUG", "Error"])
def test_log_level_any_case(monkeypatch: pytest.MonkeyPatch, value: str) -> None:
    monkeypatch.setenv("CACHEGEN_LOG_LEVEL", value)
    assert Settings().log_level == value.strip().lower()
    assert Settings(log_level=value).log_level == value.strip().lower()


def test_log_level_rejects_unknown(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CACHEGEN_LOG_LEVEL", "loud")
    with pytest.raises(ValidationError):
        Settings()


def test_log_format(monkeypatch: pytest.MonkeyPatch) -> None:
    assert Settings().log_format == "text"
    monkeypatch.setenv("CACHEGEN_LOG_FORMAT", "JSON")
    assert Settings().log_format == "json"
    monkeypatch.setenv("CACHEGEN_LOG_FORMAT", "xml")
    with pytest.raises(ValidationError):
        Settings()


@pytest.mark.parametrize("field", ["encode_levels", "write_back_levels"])
@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("lossless,medium", ["lossless", "medium"]),
        (" lossless , medium ,", ["lossless", "medium"]),
        ("lossless", ["lossless"]),
        ('["lossless","medium"]', ["lossless", "medium"]),
        ("[]", []),
        ("", None),
    ],
)
def test_level_lists_from_env(monkeypatch: pytest.MonkeyPatch, field: str, value: str, expected) -> None:
    monkeypatch.setenv(f"CACHEGEN_{field.upper()}", value)
    assert getattr(Settings(), field) == expected


def test_level_lists_from_arguments_and_toml(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    assert Settings(encode_levels=["low"]).encode_levels == ["low"]
    assert Settings(encode_levels="low,high").encode_levels == ["low", "high"]
    config = tmp_path / "gateway.toml"
    config.write_text(
        'encode_levels = ["lossless"]\nwrite_back_levels = "lossless,low"\nlog_level = "WARNING"\n'
    )
    monkeypatch.setenv("CACHEGEN_CONFIG_FILE", str(config))
    s = Settings()
    assert (s.encode_levels, s.write_back_levels, s.log_level) == (
        ["lossless"],
        ["lossless", "low"],
        "warning",
    )


def test_level_list_bad_json(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CACHEGEN_ENCODE_LEVELS", '["lossless",')
    with pytest.raises(ValidationError, match="encode_levels"):
        Settings()
