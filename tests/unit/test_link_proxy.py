"""The bandwidth-emulating proxy (benchmarks/link_proxy.py) against a small peer server, loopback only.

Timing checks assert lower bounds on elapsed time (the link must not be faster than set), which a
loaded machine cannot break; upper bounds are loose (several times the ideal) and only show that a
rate change took effect.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import socketserver
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from benchmarks.link_proxy import LinkProxy, Trace, parse_rate

REPO = Path(__file__).resolve().parents[2]
HEADER = 16


def _read_exact(conn: socket.socket, nbytes: int) -> bytes:
    data = bytearray()
    while len(data) < nbytes:
        part = conn.recv(nbytes - len(data))
        if not part:
            raise ConnectionError("EOF before the header")
        data += part
    return bytes(data)


def _read_to_eof(conn: socket.socket) -> bytes:
    parts = []
    while part := conn.recv(1 << 16):
        parts.append(part)
    return b"".join(parts)


class _Peer(socketserver.BaseRequestHandler):
    """Reads a 16-byte command: "echo" (until EOF), "send N" (N bytes, then close) or "sink" (count
    bytes until EOF, answer the count)."""

    request: socket.socket

    def handle(self) -> None:
        command = _read_exact(self.request, HEADER).split()
        try:
            if command[0] == b"echo":
                while data := self.request.recv(1 << 16):
                    self.request.sendall(data)
            elif command[0] == b"send":
                self.request.sendall(b"x" * int(command[1]))
            elif command[0] == b"sink":
                self.request.sendall(str(len(_read_to_eof(self.request))).encode())
        except OSError:
            pass  # the proxy cut the connection (the close test does that on purpose)


@pytest.fixture(scope="module")
def peer() -> Iterator[tuple[str, int]]:
    server = socketserver.ThreadingTCPServer(("127.0.0.1", 0), _Peer)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server.server_address[:2]
    server.shutdown()
    server.server_close()
    thread.join()


def _connect(proxy: LinkProxy, command: str) -> socket.socket:
    conn = socket.create_connection(("127.0.0.1", proxy.port), timeout=20)
    conn.sendall(command.encode().ljust(HEADER))
    return conn


def _download(proxy: LinkProxy, nbytes: int) -> None:
    with _connect(proxy, f"send {nbytes}") as conn:
        assert len(_read_to_eof(conn)) == nbytes


def _upload(proxy: LinkProxy, nbytes: int) -> None:
    with _connect(proxy, "sink") as conn:
        conn.sendall(b"y" * nbytes)
        conn.shutdown(socket.SHUT_WR)
        assert int(_read_to_eof(conn)) == nbytes


def _parallel(*jobs: tuple) -> list[float]:
    """Run (function, *args) jobs in threads at once; the seconds each took from the common start."""
    start = time.monotonic()

    def run(job: tuple) -> float:
        job[0](*job[1:])
        return time.monotonic() - start

    with ThreadPoolExecutor(len(jobs)) as pool:
        return list(pool.map(run, jobs))


def test_parse_rate() -> None:
    assert parse_rate("200mbit") == 200e6
    assert parse_rate("1gbit") == 1e9
    assert parse_rate("50Mbit/s") == 50e6
    assert parse_rate("1.5 Gbit") == 1.5e9
    assert parse_rate("800kbit") == 800e3
    assert parse_rate("20mbps") == 20e6
    assert parse_rate("2e9") == parse_rate(2e9) == 2e9
    for bad in ["200M", "200mb", "fast", "-5mbit", "0", "", "nan"]:
        with pytest.raises(ValueError):
            parse_rate(bad)


def test_trace_loops_and_loads_from_json(tmp_path: Path) -> None:
    trace = Trace.from_mbps(500, [20, 2000])
    assert [trace.rate_at(t) for t in (0.0, 0.499, 0.5, 0.999, 1.0, 1.7)] == [20e6, 20e6, 2e9, 2e9, 20e6, 2e9]
    path = tmp_path / "trace.json"
    path.write_text(json.dumps({"interval_ms": 500, "rates_mbps": [20, 2000]}))
    assert Trace.load(path) == trace
    path.write_text(json.dumps({"interval_ms": 500}))
    with pytest.raises(ValueError):
        Trace.load(path)
    for interval, rates in [(0, (1e6,)), (100, ()), (100, (0.0,))]:
        with pytest.raises(ValueError):
            Trace(interval, rates)


@pytest.mark.parametrize("latency_ms", [0.0, 20.0])
def test_bytes_pass_through_intact_both_ways(peer: tuple[str, int], latency_ms: float) -> None:
    payload = os.urandom(300_000)
    with LinkProxy(peer, "1gbit", latency_ms=latency_ms) as proxy, _connect(proxy, "echo") as conn:
        # Send from a thread: the echo comes back while we send, and both buffers would fill up.
        sender = threading.Thread(target=lambda: (conn.sendall(payload), conn.shutdown(socket.SHUT_WR)))
        sender.start()
        echoed = _read_to_eof(conn)  # EOF arrives only if the client's half-close went through
        sender.join()
        assert echoed == payload
        assert proxy.bytes_up == HEADER + len(payload)
        assert proxy.bytes_down == len(payload)


def test_connections_share_the_link_rate(peer: tuple[str, int]) -> None:
    rate, connections, each = 16e6, 8, 250_000
    ideal = connections * each * 8 / rate  # 1 s
    with LinkProxy(peer, rate) as proxy:
        finished = _parallel(*[(_download, proxy, each) for _ in range(connections)])
        assert proxy.bytes_down == connections * each
    assert 0.9 * ideal <= max(finished) < 5 * ideal
    # Taking turns, no connection gets far ahead: the first one ends late too.
    assert min(finished) >= 0.5 * ideal


@pytest.mark.parametrize(("upstream", "ideal"), [("separate", 0.25), ("shared", 0.5)])
def test_upstream_shaping(peer: tuple[str, int], upstream: str, ideal: float) -> None:
    """500 kB each way at 16 Mbit/s: 0.25 s when each direction has its own bucket, 0.5 s when they share one."""
    with LinkProxy(peer, "16mbit", upstream=upstream) as proxy:  # type: ignore[arg-type]
        finished = _parallel((_download, proxy, 500_000), (_upload, proxy, 500_000))
    assert 0.9 * ideal <= max(finished) < 5 * ideal


def test_free_upstream_is_not_shaped(peer: tuple[str, int]) -> None:
    with LinkProxy(peer, "16mbit", upstream="free") as proxy:
        start = time.monotonic()
        _upload(proxy, 4_000_000)  # 2 s if it were shaped
        assert time.monotonic() - start < 1.0


def test_trace_switches_the_rate(peer: tuple[str, int]) -> None:
    start = time.monotonic()
    with LinkProxy(peer, trace=Trace.from_mbps(300, [2, 200])) as proxy:
        assert proxy.rate_bps == 2e6
        # 1 MB: 4 s at 2 Mbit/s, 40 ms at 200; the first 300 ms let only ~75 kB through.
        _download(proxy, 1_000_000)
        assert 0.9 * 0.3 <= time.monotonic() - start < 2.0
        seen = [proxy.rate_bps]
        while len(seen) < 3 and time.monotonic() - start < 5:
            if proxy.rate_bps != seen[-1]:
                seen.append(proxy.rate_bps)
            time.sleep(0.005)
        assert seen in ([200e6, 2e6, 200e6], [2e6, 200e6, 2e6])  # it loops

        proxy.set_rate("5mbit")  # stops the trace
        time.sleep(0.4)
        assert proxy.rate_bps == 5e6


def test_set_rate_from_another_thread_takes_effect_at_once(peer: tuple[str, int]) -> None:
    with LinkProxy(peer, "1mbit") as proxy:
        start = time.monotonic()
        download = threading.Thread(target=_download, args=(proxy, 1_000_000))  # 8 s at 1 Mbit/s
        download.start()
        time.sleep(0.2)
        proxy.set_rate("400mbit")
        assert proxy.rate_bps == 400e6
        download.join()
        assert time.monotonic() - start < 3.0

        proxy.set_rate(16e6)
        start = time.monotonic()
        _download(proxy, 500_000)
        assert time.monotonic() - start >= 0.9 * 0.25


def test_latency_delays_each_direction(peer: tuple[str, int]) -> None:
    with LinkProxy(peer, "1gbit", latency_ms=40) as proxy, _connect(proxy, "echo") as conn:
        start = time.monotonic()
        conn.sendall(b"ping")
        assert _read_exact(conn, 4) == b"ping"
        assert 0.08 <= time.monotonic() - start < 1.0


@pytest.mark.parametrize(
    ("target", "listen"),
    [
        (("10.0.0.1", 80), ("127.0.0.1", 0)),
        (("8.8.8.8", 53), ("127.0.0.1", 0)),
        (("example.com", 80), ("127.0.0.1", 0)),
        (("0.0.0.0", 80), ("127.0.0.1", 0)),
        (("127.0.0.1", 80), ("0.0.0.0", 0)),
    ],
)
def test_non_loopback_addresses_are_refused(target: tuple[str, int], listen: tuple[str, int]) -> None:
    with pytest.raises(ValueError, match="loopback"):
        LinkProxy(target, "1mbit", listen=listen)
    assert not [thread for thread in threading.enumerate() if thread.name == "link-proxy"]


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def test_close_leaves_no_socket_or_thread(peer: tuple[str, int]) -> None:
    fds = _open_fds() if sys.platform == "linux" else 0
    proxy = LinkProxy(peer, "1mbit")
    conn = _connect(proxy, "send 1000000")  # still running when the proxy closes
    assert conn.recv(100)
    proxy.close()
    proxy.close()
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", proxy.port), timeout=5).close()
    with conn:
        try:
            _read_to_eof(conn)
        except ConnectionResetError:
            pass
    assert not [thread for thread in threading.enumerate() if thread.name == "link-proxy"]
    with pytest.raises(RuntimeError):
        proxy.set_rate("1gbit")
    if sys.platform == "linux":
        # The peer's handler threads (this test's and earlier ones') close their sockets in their own time.
        deadline = time.monotonic() + 5
        while _open_fds() > fds and time.monotonic() < deadline:
            time.sleep(0.01)
        assert _open_fds() <= fds


def test_cli_forwards_and_stops_on_sigterm(peer: tuple[str, int], tmp_path: Path) -> None:
    trace = tmp_path / "trace.json"
    trace.write_text(json.dumps({"interval_ms": 100, "rates_mbps": [50, 100]}))
    command = [
        sys.executable,
        "benchmarks/link_proxy.py",
        "--target",
        f"{peer[0]}:{peer[1]}",
        "--trace",
        str(trace),
    ]
    proc = subprocess.Popen(command, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        match = re.match(r"listening on 127\.0\.0\.1:(\d+) ", proc.stdout.readline())  # type: ignore[union-attr]
        assert match, proc.stderr.read()  # type: ignore[union-attr]
        with socket.create_connection(("127.0.0.1", int(match[1])), timeout=10) as conn:
            conn.sendall(b"send 100000".ljust(HEADER))
            assert len(_read_to_eof(conn)) == 100_000
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=10)
    finally:
        proc.kill()
        proc.wait()
    assert proc.returncode == 0
    assert "100000 bytes down, 16 bytes up" in out


def test_a_taken_listen_port_raises_in_the_caller(peer: tuple[str, int]) -> None:
    with socket.create_server(("127.0.0.1", 0)) as taken, pytest.raises(OSError):
        LinkProxy(peer, "1mbit", listen=("127.0.0.1", taken.getsockname()[1]))
    assert not [thread for thread in threading.enumerate() if thread.name == "link-proxy"]
