"""The command line as a user meets it: help, flags, and start-up failures as one line on stderr.

Every case here fails or answers before the model loads, so each process takes
seconds (importing torch), not a model load.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest

from tests.gateway_process import REPO


def run_app(
    *args: str, env: dict[str, str] | None = None, timeout: float = 120
) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "app", *args],
        check=False,
        cwd=REPO,
        env={**os.environ, "CACHEGEN_STORE": "memory://", "CACHEGEN_LOG_LEVEL": "info", **(env or {})},
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def one_error_line(out: subprocess.CompletedProcess) -> str:
    """The process failed with exactly one line on stderr, which it returns."""
    lines = [line for line in out.stderr.splitlines() if line.strip()]
    assert out.returncode == 1, out.stderr
    assert len(lines) == 1, out.stderr
    assert lines[0].startswith("python -m app"), lines[0]
    assert "Traceback" not in out.stderr
    return lines[0]


def test_help_lists_the_subcommands():
    out = run_app("--help")
    assert out.returncode == 0, out.stderr
    for command in ("serve", "encode", "calibrate"):
        assert f"\n    {command}" in out.stdout, out.stdout


def test_serve_help_shows_the_flags():
    out = run_app("serve", "--help")
    assert out.returncode == 0, out.stderr
    flags = ("--model", "--served-model-name", "--max-model-len", "--api-key", "--host", "--port", "--store")
    for flag in flags:
        assert flag in out.stdout, flag
    assert "CACHEGEN_SERVED_MODEL_NAME" in out.stdout  # each flag names its variable


def test_unknown_command_is_a_usage_error():
    out = run_app("serv")
    assert out.returncode == 2
    assert "unknown command 'serv'" in out.stderr


def test_missing_model_directory_is_one_line():
    line = one_error_line(run_app(env={"CACHEGEN_MODEL": "/nonexistent"}))
    assert "'/nonexistent'" in line and "no such directory" in line


def test_flags_win_over_the_environment():
    line = one_error_line(run_app("serve", "--model", "/from-flag", env={"CACHEGEN_MODEL": "/from-env"}))
    assert "/from-flag" in line and "/from-env" not in line


def test_cuda_on_a_build_without_it_is_one_line():
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    line = one_error_line(run_app(env={"CACHEGEN_DEVICE": "cuda"}))
    assert "cuda" in line.lower()


def test_invalid_settings_are_one_line():
    line = one_error_line(run_app(env={"CACHEGEN_MAX_QUEUE": "0", "CACHEGEN_KV_SLO_MS": "soon"}))
    assert "invalid settings" in line and "max_queue" in line and "kv_slo_ms" in line


def test_config_file_problems_are_one_line(tmp_path):
    missing = tmp_path / "missing.toml"
    assert "No such file" in one_error_line(run_app("--config", str(missing)))
    typo = tmp_path / "typo.toml"
    typo.write_text('max_que = 3\nstore = "memory://"\n')
    assert "unknown settings max_que" in one_error_line(run_app("--config", str(typo)))


def test_busy_port_fails_before_the_model_loads():
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        line = one_error_line(run_app("--host", "127.0.0.1", "--port", str(port)))
    assert f"cannot listen on 127.0.0.1:{port}" in line


def test_encode_refuses_bad_files_before_loading_the_model(tmp_path):
    good = tmp_path / "good.txt"
    good.write_text("some text\n")
    latin1 = tmp_path / "latin1.txt"
    latin1.write_bytes("caf\xe9\n".encode("latin-1"))
    missing = tmp_path / "missing.txt"
    store = tmp_path / "store"
    # a model that cannot load: reaching it would be a different error
    out = run_app(
        "encode",
        str(good),
        str(missing),
        str(latin1),
        env={"CACHEGEN_MODEL": "/nonexistent", "CACHEGEN_STORE": f"file://{store}"},
        timeout=30,
    )
    assert out.returncode == 1, out.stderr
    assert f"{missing}: cannot read: no such file" in out.stderr
    assert f"{latin1}: not UTF-8 text" in out.stderr
    assert "2 of 3 files refused; nothing encoded" in out.stderr
    assert "nonexistent" not in out.stderr and out.stdout == ""
    assert not store.exists()
