"""A TCP proxy that makes loopback behave like a network link of a set bandwidth, for tests and benchmarks.

Loading KV caches is bandwidth-bound in the CacheGen setting (tens of Mbit/s to a few Gbit/s), but
tests and benchmarks talk to a SeaweedFS on loopback, which moves GB/s. Put this proxy between the
S3 client and the server (``endpoint_url=proxy.url``) and the loopback becomes a link of a fixed
rate, or of a rate that follows a trace, without root (tc/netem need it) and without a change to
the client.

    python -m benchmarks.link_proxy --target 127.0.0.1:8333 --listen 127.0.0.1:9000 --rate 200mbit
    python -m benchmarks.link_proxy --target 127.0.0.1:8333 --trace trace.json

The rate is the link's, not a connection's: all connections share one token bucket per direction.
boto3 opens up to 10 connections per client; a per-connection limit would multiply the rate by that.
Downstream (server to client, where KV chunks flow) is always shaped. Upstream, by default, gets a
bucket of its own at the same rate, as on a full-duplex link, so that uploads during encoding are
shaped without slowing the downloads of other requests; ``upstream="shared"`` puts both directions
in one bucket (a half-duplex link), ``upstream="free"`` leaves upstream unshaped.

Rates are in bits per second, decimal as in tc (1 mbit = 10^6 bit/s). Only loopback targets (and
listen addresses) are accepted: these machines must not send traffic anywhere else.

One event loop thread moves about 4 Gbit/s on its own core. In the client's process it shares the
GIL with the client, and above about 1 Gbit/s the link then runs a few percent slower than set; for
such rates run the CLI as a process of its own (and see DEFAULT_BURST_MS).
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import ipaddress
import json
import math
import re
import signal
import threading
from collections import deque
from collections.abc import Coroutine, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any, Literal, Self, get_args

Upstream = Literal["separate", "shared", "free"]

MIN_BURST_BYTES = 16 * 1024
# The event loop's timers fire about 1 ms late; a bucket that holds 2 ms of tokens does not overflow
# (and so loses no rate) while a grant waits on a late timer. When the proxy's thread waits longer
# than the burst (a busy machine, a busy process holding the GIL), the tokens of that wait are lost
# and the link runs slower than set: measured on 2 busy cores at 1-2 Gbit/s, 2 ms lost 8-14 %,
# 5 ms 1-3 %. A larger burst costs fidelity the other way: a short transfer on an idle link passes
# its first burst's worth of bytes at loopback speed.
DEFAULT_BURST_MS = 2.0
MAX_SLICE_BYTES = 64 * 1024
# Slices in flight on one direction of one connection when a latency is set: enough for the
# bandwidth-delay product of 2 Gbit/s x 60 ms even at 16 KiB slices.
DELAY_SLOTS = 1024

_PREFIXES = {"": 1.0, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12}
_RATE = re.compile(
    r"\s*(?P<value>[0-9]*\.?[0-9]+(?:e[+-]?[0-9]+)?)\s*(?P<unit>(?P<prefix>[kmgt]?)(?:bit/s|bits?|bps))?\s*",
    re.IGNORECASE,
)


def parse_rate(rate: float | str) -> float:
    """Bits per second from a number or a string such as "200mbit", "1gbit", "50Mbit/s" or "2e9".

    Unlike tc, "mbps" means megabits here (the trace files' ``rates_mbps`` does too). A bare prefix
    ("200M") is refused: it reads as megabytes as easily as megabits.
    """
    if isinstance(rate, str):
        match = _RATE.fullmatch(rate)
        if match is None:
            raise ValueError(f"rate {rate!r}: expected a number of bit/s or e.g. '200mbit', '1gbit'")
        bps = float(match["value"]) * _PREFIXES[(match["prefix"] or "").lower()]
    else:
        bps = float(rate)
    if not math.isfinite(bps) or bps <= 0:
        raise ValueError(f"rate {rate!r}: must be a positive number of bit/s")
    return bps


def format_rate(bps: float) -> str:
    for prefix, scale in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if bps >= scale:
            return f"{bps / scale:g} {prefix}bit/s"
    return f"{bps:g} bit/s"


def loopback_host(host: str) -> str:
    """The IP literal for ``host`` if it names a loopback address; anything else is refused.

    Names other than "localhost" are refused rather than resolved, so that what is checked is what
    is connected to.
    """
    if host == "localhost":
        return "127.0.0.1"
    try:
        address = ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        raise ValueError(f"{host!r}: only loopback IP addresses (127.0.0.0/8, ::1) are allowed") from None
    if not address.is_loopback:
        raise ValueError(f"{host!r} is not a loopback address: this proxy only talks to loopback")
    return str(address)


@dataclass(frozen=True)
class Trace:
    """Link rates switched every ``interval_ms``, looping: ``rates_bps[i]`` holds from i to i+1 intervals."""

    interval_ms: float
    rates_bps: tuple[float, ...]

    def __post_init__(self) -> None:
        if not (math.isfinite(self.interval_ms) and self.interval_ms > 0):
            raise ValueError(f"trace interval_ms must be positive, got {self.interval_ms!r}")
        if not self.rates_bps:
            raise ValueError("a trace needs at least one rate")
        object.__setattr__(self, "rates_bps", tuple(parse_rate(rate) for rate in self.rates_bps))

    @classmethod
    def from_mbps(cls, interval_ms: float, rates_mbps: Sequence[float]) -> Trace:
        return cls(interval_ms, tuple(rate * 1e6 for rate in rates_mbps))

    @classmethod
    def load(cls, path: str | Path) -> Trace:
        """A trace from a JSON file ``{"interval_ms": 500, "rates_mbps": [20, 2000, ...]}``."""
        data = json.loads(Path(path).read_text())
        try:
            return cls.from_mbps(float(data["interval_ms"]), [float(rate) for rate in data["rates_mbps"]])
        except (KeyError, TypeError) as exc:
            raise ValueError(f"{path}: expected {{'interval_ms': N, 'rates_mbps': [...]}}") from exc

    def rate_at(self, elapsed_s: float) -> float:
        return self.rates_bps[int(elapsed_s * 1e3 // self.interval_ms) % len(self.rates_bps)]


class TokenBucket:
    """Bytes the link lets through, granted first come, first served.

    The burst is small (by default max(16 KiB, 2 ms of bytes)): a large one lets short transfers run at loopback
    speed, so the measured rate would depend on the transfer's size. Each connection asks for one
    slice at a time and queues again behind the others for the next, so connections take turns
    instead of one of them draining the bucket. Runs on the proxy's event loop only.
    """

    def __init__(self, rate_bps: float, burst_s: float = DEFAULT_BURST_MS / 1e3) -> None:
        self._loop = asyncio.get_running_loop()
        self._waiters: deque[tuple[int, asyncio.Future[None]]] = deque()
        self._timer: asyncio.TimerHandle | None = None
        self._stamp = self._loop.time()
        self._burst_s = burst_s
        self._rate = rate_bps / 8
        self._tokens = self.capacity

    @property
    def capacity(self) -> float:
        return max(MIN_BURST_BYTES, self._rate * self._burst_s)

    @property
    def slice_bytes(self) -> int:
        # A quarter of the bucket, so that the bucket still has room while a grant waits on a late timer.
        return int(min(MAX_SLICE_BYTES, self.capacity / 4))

    def set_rate(self, rate_bps: float) -> None:
        self._refill()  # the time up to now ran at the old rate
        self._rate = rate_bps / 8
        self._tokens = min(self._tokens, self.capacity)
        self._grant()

    async def take(self, nbytes: int) -> None:
        if not self._waiters and self._take_now(nbytes):
            return
        waiter = self._loop.create_future()
        self._waiters.append((nbytes, waiter))
        self._grant()
        await waiter  # a cancelled waiter is skipped by _grant and takes no tokens

    def close(self) -> None:
        if self._timer is not None:
            self._timer.cancel()

    def _refill(self) -> None:
        now = self._loop.time()
        self._tokens = min(self.capacity, self._tokens + (now - self._stamp) * self._rate)
        self._stamp = now

    def _take_now(self, nbytes: int) -> bool:
        """Take nbytes if the bucket holds them; a slice larger than the bucket (the rate just dropped)
        goes when the bucket is full and leaves it in debt, which later grants repay."""
        self._refill()
        if self._tokens < min(nbytes, self.capacity):
            return False
        self._tokens -= nbytes
        return True

    def _grant(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        while self._waiters:
            nbytes, waiter = self._waiters[0]
            if waiter.done():
                self._waiters.popleft()
            elif self._take_now(nbytes):
                self._waiters.popleft()
                waiter.set_result(None)
            else:
                missing = min(nbytes, self.capacity) - self._tokens
                self._timer = self._loop.call_later(missing / self._rate, self._grant)
                return


@dataclass
class _Direction:
    bucket: TokenBucket | None = None
    bytes: int = 0


class LinkProxy:
    """Forwards TCP from ``listen`` to ``target`` through an emulated link; its event loop runs in a
    background thread, so synchronous tests and benchmarks can use it directly.

    Give exactly one of ``rate_bps`` (bit/s, or a string such as "200mbit") and ``trace``. The trace
    starts when the proxy does. ``latency_ms`` delays each direction by that much (the round trip
    grows by twice it) without lowering the throughput. ``burst_ms``: see DEFAULT_BURST_MS. See the
    module docstring for ``upstream``.
    """

    def __init__(
        self,
        target: tuple[str, int],
        rate_bps: float | str | None = None,
        *,
        trace: Trace | None = None,
        listen: tuple[str, int] = ("127.0.0.1", 0),
        latency_ms: float = 0.0,
        burst_ms: float = DEFAULT_BURST_MS,
        upstream: Upstream = "separate",
    ) -> None:
        if (rate_bps is None) == (trace is None):
            raise ValueError("give exactly one of rate_bps and trace")
        self._rate_bps = trace.rates_bps[0] if trace is not None else parse_rate(rate_bps)  # type: ignore[arg-type]
        if upstream not in get_args(Upstream):
            raise ValueError(f"upstream must be one of {get_args(Upstream)}, got {upstream!r}")
        if not (math.isfinite(latency_ms) and latency_ms >= 0):
            raise ValueError(f"latency_ms must be >= 0, got {latency_ms!r}")
        if not (math.isfinite(burst_ms) and burst_ms > 0):
            raise ValueError(f"burst_ms must be positive, got {burst_ms!r}")
        self.target = (loopback_host(target[0]), int(target[1]))
        self.host = loopback_host(listen[0])
        self._trace = trace
        self._latency_s = latency_ms / 1e3
        self._burst_s = burst_ms / 1e3
        self._upstream = upstream
        self._down = _Direction()
        self._up = _Direction()
        self._buckets: list[TokenBucket] = []
        self._connections: set[asyncio.Task[None]] = set()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._trace_task: asyncio.Task[None] | None = None
        started: concurrent.futures.Future[int] = concurrent.futures.Future()
        self._thread = threading.Thread(
            target=asyncio.run, args=(self._main(int(listen[1]), started),), name="link-proxy", daemon=True
        )
        self._thread.start()
        try:
            self.port = started.result()
        except BaseException:
            self._thread.join()
            raise

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    @property
    def bytes_down(self) -> int:
        """Bytes delivered from the target to clients."""
        return self._down.bytes

    @property
    def bytes_up(self) -> int:
        """Bytes delivered from clients to the target."""
        return self._up.bytes

    @property
    def rate_bps(self) -> float:
        """The rate in force now (a trace changes it over time)."""
        return self._rate_bps

    def set_rate(self, rate_bps: float | str) -> None:
        """Switch the link to ``rate_bps`` now, from any thread; a running trace stops."""
        bps = parse_rate(rate_bps)

        async def apply() -> None:
            if self._trace_task is not None:
                self._trace_task.cancel()
            self._apply_rate(bps)

        self._on_loop(apply())

    def close(self) -> None:
        """Stop listening, cut open connections and join the thread; safe to call twice."""
        if self._thread.is_alive() and self._loop is not None and self._stop is not None:
            try:
                self._loop.call_soon_threadsafe(self._stop.set)
            except RuntimeError:
                pass  # the loop already ended
        self._thread.join()

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def describe(self) -> str:
        """One line for logs: "127.0.0.1:9000 -> 127.0.0.1:8333 at 200 Mbit/s, upstream separate"."""
        if self._trace is not None:
            rates = ", ".join(format_rate(rate) for rate in self._trace.rates_bps)
            shape = f"a trace every {self._trace.interval_ms:g} ms of {rates}"
        else:
            shape = format_rate(self._rate_bps)
        if self._latency_s:
            shape += f", +{self._latency_s * 1e3:g} ms each way"
        target = f"{self.target[0]}:{self.target[1]}"
        return f"{self.host}:{self.port} -> {target} at {shape}, upstream {self._upstream}"

    def _on_loop(self, coro: Coroutine[Any, Any, None]) -> None:
        if self._loop is None or not self._thread.is_alive():
            coro.close()
            raise RuntimeError("the proxy is closed")
        if threading.current_thread() is self._thread:
            # Called from a callback on our own loop: waiting on it here would deadlock.
            self._loop.create_task(coro)
            return
        # A bounded wait: a call that races close() may find its callback dropped with the loop.
        asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout=10)

    def _apply_rate(self, rate_bps: float) -> None:
        self._rate_bps = rate_bps
        for bucket in self._buckets:
            bucket.set_rate(rate_bps)

    async def _main(self, listen_port: int, started: concurrent.futures.Future[int]) -> None:
        try:
            server = await self._start(listen_port)
        except Exception as exc:  # noqa: BLE001 - the constructor raises it in the caller's thread
            started.set_exception(exc)
            return
        started.set_result(server.sockets[0].getsockname()[1])
        await self._stop.wait()
        server.close()
        await asyncio.sleep(0)  # connections accepted just before the close see _stop and end
        for task in [*self._connections, self._trace_task]:
            if task is not None:
                task.cancel()
        await asyncio.gather(*self._connections, return_exceptions=True)
        await server.wait_closed()
        for bucket in self._buckets:
            bucket.close()

    async def _start(self, listen_port: int) -> asyncio.Server:
        self._loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        self._down.bucket = TokenBucket(self._rate_bps, self._burst_s)
        self._buckets = [self._down.bucket]
        if self._upstream == "shared":
            self._up.bucket = self._down.bucket
        elif self._upstream == "separate":
            self._up.bucket = TokenBucket(self._rate_bps, self._burst_s)
            self._buckets.append(self._up.bucket)
        server = await asyncio.start_server(self._accept, self.host, listen_port)
        if self._trace is not None:
            self._trace_task = asyncio.create_task(self._follow(self._trace))
        return server

    async def _follow(self, trace: Trace) -> None:
        # Boundaries are computed from the start, so that the trace does not drift with timer lateness.
        start = asyncio.get_running_loop().time()
        interval_s = trace.interval_ms / 1e3
        while True:
            elapsed = asyncio.get_running_loop().time() - start
            self._apply_rate(trace.rate_at(elapsed))
            await asyncio.sleep((math.floor(elapsed / interval_s) + 1) * interval_s - elapsed)

    def _accept(self, client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        # A plain callback that starts a task of our own: close() cancels these, and a cancelled
        # coroutine callback makes asyncio 3.11 log a spurious error.
        assert self._stop is not None
        if self._stop.is_set():
            client_w.transport.abort()
            return
        task = asyncio.create_task(self._relay(client_r, client_w))
        self._connections.add(task)
        task.add_done_callback(self._connections.discard)

    async def _relay(self, client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        server_w: asyncio.StreamWriter | None = None
        clean = False
        try:
            server_r, server_w = await asyncio.open_connection(*self.target)
            async with asyncio.TaskGroup() as group:
                group.create_task(self._pump(server_r, client_w, self._down))
                group.create_task(self._pump(client_r, server_w, self._up))
            clean = True
        except* OSError:
            pass  # a refused target or a reset peer ends this connection only
        finally:
            for writer in (client_w, server_w):
                if writer is None:
                    continue
                if clean:
                    writer.close()
                else:
                    writer.transport.abort()

    async def _pump(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, direction: _Direction
    ) -> None:
        """Copy one direction until EOF, then half-close: HTTP clients may still be reading the answer."""
        if self._latency_s:
            await self._pump_delayed(reader, writer, direction)
        else:
            while data := await self._read_shaped(reader, direction):
                writer.write(data)
                direction.bytes += len(data)
                await writer.drain()
        if writer.can_write_eof():
            writer.write_eof()

    async def _pump_delayed(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, direction: _Direction
    ) -> None:
        # A delay line rather than a sleep before each write, so that the latency does not cap throughput.
        loop = asyncio.get_running_loop()
        line: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue(DELAY_SLOTS)

        async def deliver() -> None:
            while True:
                due, data = await line.get()
                await asyncio.sleep(due - loop.time())
                if not data:
                    return
                writer.write(data)
                direction.bytes += len(data)
                await writer.drain()

        async with asyncio.TaskGroup() as group:
            group.create_task(deliver())
            while True:
                data = await self._read_shaped(reader, direction)
                await line.put((loop.time() + self._latency_s, data))
                if not data:
                    break

    async def _read_shaped(self, reader: asyncio.StreamReader, direction: _Direction) -> bytes:
        bucket = direction.bucket
        data = await reader.read(bucket.slice_bytes if bucket is not None else MAX_SLICE_BYTES)
        if data and bucket is not None:
            await bucket.take(len(data))
        return data


def _address(text: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep or not port.isdigit():
        raise argparse.ArgumentTypeError(f"{text!r}: expected HOST:PORT")
    return host.strip("[]"), int(port)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", type=_address, required=True, help="HOST:PORT of the server (loopback)")
    parser.add_argument(
        "--listen", type=_address, default=("127.0.0.1", 0), help="HOST:PORT (port 0: a free one)"
    )
    shape = parser.add_mutually_exclusive_group(required=True)
    shape.add_argument("--rate", help="link rate, e.g. 200mbit, 1gbit")
    shape.add_argument("--trace", type=Path, help='JSON file {"interval_ms": 500, "rates_mbps": [...]}')
    parser.add_argument("--latency-ms", type=float, default=0.0, help="one-way delay added to each direction")
    parser.add_argument(
        "--burst-ms",
        type=float,
        default=DEFAULT_BURST_MS,
        help="bucket size in time at the rate (min 16 KiB)",
    )
    parser.add_argument("--upstream", choices=get_args(Upstream), default="separate")
    args = parser.parse_args(argv)

    stop = threading.Event()
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, lambda *_: stop.set())
    try:
        proxy = LinkProxy(
            args.target,
            args.rate,
            trace=Trace.load(args.trace) if args.trace else None,
            listen=args.listen,
            latency_ms=args.latency_ms,
            burst_ms=args.burst_ms,
            upstream=args.upstream,
        )
    except (ValueError, OSError) as exc:
        parser.error(str(exc))
    with proxy:
        print(f"listening on {proxy.describe()}", flush=True)
        stop.wait()
    print(f"stopped: {proxy.bytes_down} bytes down, {proxy.bytes_up} bytes up", flush=True)


if __name__ == "__main__":
    main()
