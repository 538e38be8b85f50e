"""The kernel's traffic control as the emulated link: an HTB class on loopback shapes every
connection to one server port, inside a network namespace of the benchmark's own.

The alternative to ``benchmarks/link_proxy.py``; ``benchmarks/link_fidelity.py`` measures both
(docs/adaptive.md). Traffic from the port (downloads: the KV chunks) goes through one HTB class at
the link's rate, traffic to it (uploads) through another at the same rate (a full-duplex link, as
the proxy's default ``upstream="separate"``); all other loopback traffic (the gateway's HTTP, the
server's internal ports) is left alone. Every connection shares its direction's class, so the
link, not a connection, has the rate, as an S3 client's ten connections need. The packets move in
the kernel: no thread of ours copies bytes, so a busy process or machine cannot slow the link.

It needs root (CAP_NET_ADMIN) and ``tc``, and changes the loopback of the namespace it runs in:
so it refuses to run outside a private one. ``enter_private_network()`` re-executes the calling
program under ``unshare --net``, whose new namespace holds only a loopback (no route out).
The kernel here has no ``netem``: this link has a rate, no added latency.

    python -m benchmarks.tc_link --port 8333 --rate 200mbit -- <command>   # runs <command> in it
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Sequence
from types import TracebackType
from typing import Self

from benchmarks.link_proxy import format_rate, parse_rate

DEVICE = "lo"
PRIVATE_ENV = "CACHEGEN_PRIVATE_NETNS"  # set in the re-executed program: its namespace is its own
UNSHAPED = "100gbit"  # the default class: loopback at full speed
# HTB's bucket: at least two 64 KiB GSO packets (loopback sends them whole; a bucket smaller than
# a packet stalls it), else 2 ms of the rate, as the proxy's DEFAULT_BURST_MS
MIN_BURST_BYTES = 160 * 1024
BURST_S = 0.002


def tc(*args: str) -> str:
    done = subprocess.run(["tc", *args], capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"tc {' '.join(args)}: {done.stderr.strip() or done.stdout.strip()}")
    return done.stdout


def available() -> str | None:
    """Why this link cannot run here, or None when it can."""
    if shutil.which("tc") is None or shutil.which("unshare") is None or shutil.which("ip") is None:
        return "needs tc, ip and unshare (iproute2, util-linux)"
    if os.geteuid() != 0:
        return "needs root (a network namespace and tc)"
    probe = f"ip link set {DEVICE} up && tc qdisc replace dev {DEVICE} root handle 1: htb default 30"
    done = subprocess.run(["unshare", "--net", "--", "sh", "-c", probe], capture_output=True, text=True)
    if done.returncode != 0:  # e.g. a container without CAP_SYS_ADMIN, or a kernel without HTB
        return f"cannot make a namespace with an HTB qdisc here: {done.stderr.strip()[:200]}"
    return None


def in_private_network() -> bool:
    return os.environ.get(PRIVATE_ENV) == str(os.getpid())


def enter_private_network(argv: Sequence[str] | None = None) -> None:
    """Re-execute this program (``python -m <module> argv``) in a new network namespace with its
    loopback up; returns at once when already in one. Only loopback exists there."""
    if in_private_network():
        return
    if reason := available():
        raise SystemExit(f"the tc link {reason}")
    module = sys.modules["__main__"].__spec__
    if module is None:
        raise SystemExit("run as python -m benchmarks.<name> to use the tc link")
    args = list(sys.argv[1:] if argv is None else argv)
    script = f'ip link set {DEVICE} up && {PRIVATE_ENV}=$$ exec "$@"'
    command = ["unshare", "--net", "--", "sh", "-c", script, "sh", sys.executable, "-m", module.name, *args]
    os.execvp(command[0], command)


def _burst(rate_bps: float) -> int:
    return max(MIN_BURST_BYTES, int(rate_bps / 8 * BURST_S))


class TcLink:
    """Shapes loopback traffic to and from ``port`` at ``rate_bps`` until closed."""

    def __init__(self, port: int, rate_bps: float | str, *, upstream: bool = True) -> None:
        if not in_private_network():
            raise RuntimeError("TcLink changes loopback: call enter_private_network() first")
        self.port = int(port)
        self._upstream = upstream
        self._rate_bps = parse_rate(rate_bps)
        tc("qdisc", "replace", "dev", DEVICE, "root", "handle", "1:", "htb", "default", "30", "r2q", "1000")
        tc("class", "add", "dev", DEVICE, "parent", "1:", "classid", "1:30", "htb", "rate", UNSHAPED)
        self._classes = {"down": "1:10", **({"up": "1:20"} if upstream else {})}
        for name, classid in self._classes.items():
            tc("class", "add", "dev", DEVICE, "parent", "1:", "classid", classid, "htb", *self._shape())
            side = "sport" if name == "down" else "dport"
            tc("filter", "add", "dev", DEVICE, "parent", "1:", "protocol", "ip", "prio", "1", "u32",
               "match", "ip", side, str(self.port), "0xffff", "flowid", classid)  # fmt: skip
        self._closed = False

    def _shape(self) -> list[str]:
        rate, burst = f"{int(self._rate_bps)}bit", str(_burst(self._rate_bps))
        return ["rate", rate, "ceil", rate, "burst", burst, "cburst", burst]

    @property
    def rate_bps(self) -> float:
        return self._rate_bps

    def set_rate(self, rate_bps: float | str) -> None:
        """Change the link's rate now (packets queued keep their place)."""
        self._rate_bps = parse_rate(rate_bps)
        for classid in self._classes.values():
            tc("class", "change", "dev", DEVICE, "parent", "1:", "classid", classid, "htb", *self._shape())

    def _sent(self, name: str) -> int:
        stats = tc("-s", "class", "show", "dev", DEVICE, "classid", self._classes[name])
        match = re.search(r"Sent (\d+) bytes", stats)
        return int(match[1]) if match else 0

    @property
    def bytes_down(self) -> int:
        """Bytes sent from the port (IP packets, headers included)."""
        return self._sent("down")

    @property
    def bytes_up(self) -> int:
        return self._sent("up") if self._upstream else 0

    def describe(self) -> str:
        upstream = "separate" if self._upstream else "free"
        return f"tc htb on {DEVICE} port {self.port} at {format_rate(self._rate_bps)}, upstream {upstream}"

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            tc("qdisc", "del", "dev", DEVICE, "root")

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--port", type=int, required=True, help="the server port whose traffic is shaped")
    p.add_argument("--rate", required=True, help="e.g. 200mbit, 1gbit")
    p.add_argument("command", nargs=argparse.REMAINDER, help="-- then the command to run on the link")
    args = p.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        p.error("give the command to run after --")
    enter_private_network(argv)
    with TcLink(args.port, args.rate) as link:
        print(link.describe(), file=sys.stderr)
        return subprocess.call(command)


if __name__ == "__main__":
    sys.exit(main())
