"""Which emulated link holds its rate: the user-space proxy (``benchmarks/link_proxy.py``), as a
thread of the client's process or as a process of its own, or the kernel's traffic control
(``benchmarks/tc_link.py``), on this machine, idle and busy.

In a network namespace of its own (so ``tc`` changes only its loopback), one SeaweedFS serves
chunk-sized objects; 8 threads of one boto3 client (the loader's shape: many connections, one
link) GET them back to back for ``--seconds`` at each rate, through each link. Busy: two
processes spin on the two cores (a gateway decoding) and one thread of this process spins in
Python (the GIL the proxy's thread shares in a test process). The figure is the delivered body
rate over the set rate; the proxy counts bytes of payload, tc's rate includes TCP/IP headers
(about 0.2 % on 64 KiB packets), so tc's ratio reads that much low.

    python -m benchmarks.link_fidelity                 # 50 Mbit/s to 2 Gbit/s, 5 s a point
    python -m benchmarks.link_fidelity --rates 200mbit --seconds 3 --loads idle
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import boto3
from botocore.config import Config

from benchmarks.adaptive_common import Link
from benchmarks.link_proxy import LinkProxy, format_rate, parse_rate
from benchmarks.tc_link import TcLink, enter_private_network
from tests.support.seaweed import SeaweedServer

RESULTS = Path(__file__).resolve().parent / "results" / "link_fidelity.json"
OBJECT_BYTES = 1_400_000  # one 256-token chunk at 'high' (9 MB at 'lossless')
OBJECTS = 16
WORKERS = 8
BUCKET = "fidelity"
# the proxy as a thread of the client's process (tests, the soak), as a process of its own with a
# 5 ms bucket (the adaptive benchmarks), tc, and none (the client's own ceiling on these cores)
LINKS = ("proxy", "proxy-process", "tc", "none")


@contextmanager
def busy_machine(on: bool):
    """Two spinning processes and one spinning Python thread here, while ``on``."""
    if not on:
        yield
        return
    hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(2)]
    stop = threading.Event()

    def spin() -> None:
        n = 0
        while not stop.is_set():
            n += 1

    thread = threading.Thread(target=spin, daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()
        for hog in hogs:
            hog.kill()
            hog.wait()


def fetch_for(client: Any, seconds: float) -> tuple[int, float]:
    """Body bytes that WORKERS threads fetch in ``seconds``, and the time they took."""
    deadline = time.perf_counter() + seconds
    counts = [0] * WORKERS

    def worker(k: int) -> None:
        i = k
        while time.perf_counter() < deadline:
            body = client.get_object(Bucket=BUCKET, Key=f"chunk-{i % OBJECTS}")["Body"].read()
            counts[k] += len(body)
            i += WORKERS

    started = time.perf_counter()
    with ThreadPoolExecutor(WORKERS) as pool:
        list(pool.map(worker, range(WORKERS)))
    return sum(counts), time.perf_counter() - started


def measure(server: SeaweedServer, link: str, rate: float, busy: bool, seconds: float) -> dict[str, Any]:
    port = urlparse(server.endpoint_url).port
    if link == "proxy":
        shaper = LinkProxy(("127.0.0.1", port), rate)
        url = shaper.url
    elif link == "proxy-process":
        shaper = Link(server.endpoint_url, rate_mbps=rate / 1e6, burst_ms=5.0)  # starts on entry
        url = shaper.url
    elif link == "tc":
        shaper = TcLink(port, rate)
        url = server.endpoint_url
    else:  # no link: what the client and server move on their own, the ceiling of the others
        shaper, url = nullcontext(), server.endpoint_url
    with shaper:
        client = boto3.client(
            "s3", endpoint_url=url, region_name=server.region, aws_access_key_id=server.access_key,
            aws_secret_access_key=server.secret_key,
            config=Config(s3={"addressing_style": "path"}, max_pool_connections=WORKERS + 2),
        )  # fmt: skip
        fetch_for(client, 0.5)  # connections opened, TCP windows grown
        with busy_machine(busy):
            nbytes, elapsed = fetch_for(client, seconds)
    delivered = nbytes * 8 / elapsed
    return {"link": link, "rate_bps": rate, "load": "busy" if busy else "idle", "bytes": nbytes,
            "seconds": elapsed, "delivered_bps": delivered, "ratio": delivered / rate}  # fmt: skip


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rates", default="50mbit,200mbit,1gbit,2gbit", help="comma-separated")
    p.add_argument("--links", default=",".join(LINKS), help=f"comma-separated: {', '.join(LINKS)}")
    p.add_argument("--loads", default="idle,busy", help="comma-separated: idle, busy")
    p.add_argument("--seconds", type=float, default=5.0, help="a point")
    p.add_argument("--out", type=Path, default=RESULTS)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    enter_private_network(argv)
    args = parse_args(argv)
    rates = [parse_rate(r) for r in args.rates.split(",")]
    points = []
    with SeaweedServer() as server:
        setup = server.client()
        setup.create_bucket(Bucket=BUCKET)
        for i in range(OBJECTS):
            setup.put_object(Bucket=BUCKET, Key=f"chunk-{i}", Body=os.urandom(OBJECT_BYTES))
        for rate in rates:
            for load in args.loads.split(","):
                for link in args.links.split(","):  # the two links side by side at each point
                    point = measure(server, link, rate, load == "busy", args.seconds)
                    points.append(point)
                    delivered = format_rate(point["delivered_bps"])
                    print(f"{format_rate(rate):>12} {load:<5} {link:<6} {delivered:>14} {point['ratio']:.3f}")
    print("\n| rate | load | " + " | ".join(f"{k} delivered / set" for k in LINKS) + " |")
    print("|---|---|" + "---:|" * len(LINKS))
    for rate in rates:
        for load in args.loads.split(","):
            ratio = {p["link"]: p["ratio"] for p in points if p["rate_bps"] == rate and p["load"] == load}
            cells = " | ".join(f"{ratio[k]:.3f}" if k in ratio else "-" for k in LINKS)
            print(f"| {format_rate(rate)} | {load} | {cells} |")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(
        json.dumps({"object_bytes": OBJECT_BYTES, "workers": WORKERS, "points": points}, indent=2)
    )
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
