"""vLLM's router (``vllm-router``, a Rust binary from PyPI) as a real process in front of gateways."""

from __future__ import annotations

import shutil
import subprocess
import time
from pathlib import Path

import httpx

from tests.gateway_process import ServerProcess, free_port


def router_binary() -> str | None:
    return shutil.which("vllm-router")


class RouterProcess(ServerProcess):
    """``vllm-router --worker-urls ... --policy P`` on a free port, health-checking ``/ready``.

    The health check runs every second and one failure marks a worker down, so a killed replica
    leaves the rotation within about a second (the defaults, 60 s and 3 failures, suit production).
    """

    def __init__(self, workers: list[str], policy: str, log_path: Path, *extra: str) -> None:
        super().__init__(log_path)
        self.workers = workers
        self.args = [
            router_binary() or "vllm-router",
            "--host", "127.0.0.1",
            "--port", str(self.port),
            "--prometheus-host", "127.0.0.1",
            "--prometheus-port", str(free_port()),  # its own metrics listener: two routers, two ports
            "--policy", policy,
            "--health-check-endpoint", "/ready",
            "--health-check-interval-secs", "1",
            "--health-failure-threshold", "1",
            "--worker-startup-timeout-secs", "120",
            "--log-level", "warning",
            *extra,
            "--worker-urls", *workers,
        ]  # fmt: skip

    def start(self, timeout: float = 60.0) -> RouterProcess:
        self._log = self.log_path.open("ab")
        self.proc = subprocess.Popen(self.args, stdout=self._log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"vllm-router exited with {self.proc.returncode}:\n{self.log()}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        self.stop()
        raise RuntimeError(f"vllm-router did not answer /health in {timeout}s:\n{self.log()}")
