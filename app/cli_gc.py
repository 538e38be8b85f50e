"""``python -m app gc``: delete expired contexts and unreferenced chunks; enforce the store's cap.

Runs on the store alone (no model is loaded), against the store the settings
name: the same ``CACHEGEN_*`` variables and TOML file as the gateway. Prints
the pass's report as JSON. Safe to run beside serving gateways and beside
another collector (scheduler/lifecycle.py says why).
"""

from __future__ import annotations

import argparse
import json

from app.cli import add_settings_flags, build_settings, failure_line, print_failure


def parser(prog: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=prog,
        description="Delete expired contexts, and chunks no live context lists once they are older than "
        "the grace period (write-back chunks, interrupted uploads); then evict least recently used "
        "contexts while the store is over CACHEGEN_STORE_MAX_BYTES.",
    )
    p.add_argument(
        "--grace-s",
        type=float,
        metavar="SECONDS",
        help="keep unreferenced chunks younger than this (default: CACHEGEN_GC_GRACE_S, 3600)",
    )
    p.add_argument(
        "--max-bytes", type=int, metavar="BYTES", help="the store's cap (default: CACHEGEN_STORE_MAX_BYTES)"
    )
    add_settings_flags(p, {"store"})
    return p


def main(argv: list[str], prog: str) -> int:
    args = parser(prog).parse_args(argv)
    try:
        from scheduler.lifecycle import StoreCollector
        from storage import open_store

        settings = build_settings(args)
        store = open_store(settings.store_url, cache_bytes=0)
        try:
            grace = settings.gc_grace_s if args.grace_s is None else args.grace_s
            cap = settings.store_max_bytes if args.max_bytes is None else args.max_bytes
            report = StoreCollector(store, grace, cap).collect()
        finally:
            store.close()
    except Exception as exc:  # known kinds become one line; anything else is a bug
        line = failure_line(exc)
        if line is None:
            raise
        return print_failure(prog, line)
    print(json.dumps({"store": settings.store_url, **report.as_dict()}, indent=2))
    return 0
