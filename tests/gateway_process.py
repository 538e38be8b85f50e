"""Run the gateway as a real process (``python -m app``) on a free port."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Self

import httpx

REPO = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ProcessExited(RuntimeError):
    def __init__(self, returncode: int) -> None:
        super().__init__(f"exited with {returncode}")
        self.returncode = returncode


def wait_healthy(url: str, proc: subprocess.Popen, timeout: float, poll_s: float = 0.3) -> bool:
    """Poll ``url``/health until it answers 200, and for the gateway ``"status": "ok"`` (it says
    ``loading`` until its model is loaded; vLLM's answers an empty body): True, or False when
    ``timeout`` passes; raises ``ProcessExited`` when ``proc`` ends first."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise ProcessExited(proc.returncode)
        try:
            r = httpx.get(f"{url}/health", timeout=2)
            if r.status_code == 200 and (not r.content or r.json().get("status") == "ok"):
                return True
        except (httpx.HTTPError, ValueError):
            pass
        time.sleep(poll_s)
    return False


class ServerProcess:
    """A server subprocess on ``port`` whose output goes to ``log_path``: ``start`` (each kind's
    own), ``stop``, ``log``, and a context manager that starts and stops it."""

    def __init__(self, log_path: Path) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, timeout: float) -> Self:
        raise NotImplementedError

    def stop(self, timeout: float = 15.0) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self.proc is not None:
            self._log.close()

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-5000:]

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


class GatewayProcess(ServerProcess):
    """``python -m app`` with ``env`` over the environment, run from the checkout ``repo``."""

    def __init__(self, env: dict[str, str], log_path: Path, repo: Path = REPO) -> None:
        super().__init__(log_path)
        self.env = {**os.environ, "PYTHONUNBUFFERED": "1", **env}
        self.repo = repo

    def start(self, timeout: float = 240.0) -> GatewayProcess:
        self._log = self.log_path.open("ab")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "app", "--host", "127.0.0.1", "--port", str(self.port)],
            cwd=self.repo,
            env=self.env,
            stdout=self._log,
            stderr=subprocess.STDOUT,
        )
        try:
            healthy = wait_healthy(self.url, self.proc, timeout)
        except ProcessExited as exc:
            raise RuntimeError(f"gateway exited with {exc.returncode}:\n{self.log()}") from None
        if healthy:
            return self
        self.stop()
        raise RuntimeError(f"gateway did not become healthy in {timeout}s:\n{self.log()}")
