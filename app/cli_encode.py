"""``python -m app encode FILE...``: pre-encode text files into the configured KV store.

Everything that can be checked is checked before any work: the files (exist,
readable, UTF-8) and the level names before the model loads, every file's
token count before the first one is encoded. One JSON line per context goes to
stdout (the ``POST /contexts`` object, plus ``file``); progress and errors go to
stderr. Exit status 1 when anything was refused, and then nothing is stored.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from contextlib import AbstractContextManager
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tqdm import tqdm

from app.cli import (
    add_settings_flags,
    build_settings,
    check_device,
    check_model,
    failure_line,
    print_failure,
)

if TYPE_CHECKING:
    from app.gateway import Gateway
    from codec import Level
    from scheduler.manifest import Manifest
    from scheduler.tenancy import KeySpace


def read_text(path: Path) -> tuple[str | None, str | None]:
    """(text, None), or (None, why it cannot be used)."""
    try:
        text = path.read_bytes().decode("utf-8")
    except FileNotFoundError:
        return None, "cannot read: no such file"
    except IsADirectoryError:
        return None, "cannot read: is a directory"
    except PermissionError:
        return None, "cannot read: permission denied"
    except OSError as exc:
        return None, f"cannot read: {exc.strerror or exc}"
    except UnicodeDecodeError as exc:
        return None, f"not UTF-8 text (invalid byte at offset {exc.start})"
    if not text.strip():
        return None, "empty"
    return text, None


class CountingGate:
    """The codec gate, ticking ``bar`` once per encode it lets through (one chunk at one level)."""

    def __init__(self, gate: AbstractContextManager[Any], bar: tqdm) -> None:
        self.gate = gate
        self.bar = bar

    def __enter__(self) -> Any:
        return self.gate.__enter__()

    def __exit__(self, *exc: object) -> None:
        self.gate.__exit__(*exc)
        self.bar.update(1)


def encode_file(
    gateway: Gateway,
    token_ids: list[int],
    levels: list[Level],
    label: str,
    space: KeySpace | None = None,
    ttl_seconds: int | None = None,
) -> Manifest:
    """As ``POST /contexts`` encodes (``serving_contexts.encode_tokens``), with progress: prefill in
    tokens, one chunk at a time; then encodes, one per chunk and level."""
    from scheduler.contexts import ContextStore
    from scheduler.tenancy import PUBLIC

    contexts = gateway.contexts
    size = contexts.chunk_size
    nbytes = gateway.runner.kv_bytes(len(token_ids))
    gateway.memory.reserve(nbytes)
    try:
        started = time.perf_counter()
        kv = gateway.runner.new_kv(len(token_ids))
        with tqdm(total=len(token_ids), desc=f"{label} prefill", unit="tok", file=sys.stderr) as bar:
            for start in range(0, len(token_ids), size):
                piece = token_ids[start : start + size]
                gateway.loop.prefill(kv, start, piece, background=True)
                bar.update(len(piece))
        compute_seconds = time.perf_counter() - started
        keys = contexts.keys(token_ids, space or PUBLIC)
        pieces = len(keys) + (contexts.tail(token_ids, keys) is not None)
        with tqdm(total=pieces * len(levels), desc=f"{label} encode", unit="chunk", file=sys.stderr) as bar:
            counted = ContextStore(
                contexts.store,
                contexts.fingerprint,
                contexts.model_name,
                size,
                contexts.pool,
                CountingGate(contexts.codec_gate, bar),
            )
            return counted.save(
                token_ids,
                kv,
                levels,
                compute_seconds=compute_seconds,
                space=space or PUBLIC,
                ttl_seconds=ttl_seconds,
            )
    finally:
        gateway.memory.release(nbytes)


def main(argv: list[str], prog: str = "python -m app encode") -> int:
    parser = argparse.ArgumentParser(
        prog=prog,
        description="Pre-encode UTF-8 text files into the configured KV store, one context per file "
        "(the same ids as POST /contexts).",
    )
    parser.add_argument("files", nargs="+", type=Path, metavar="FILE", help="UTF-8 text files")
    parser.add_argument(
        "--levels", nargs="+", help="levels to encode (default: CACHEGEN_ENCODE_LEVELS, else all)"
    )
    parser.add_argument(
        "--as-chat-system",
        action="store_true",
        help="encode each file as a chat system message (then chat requests that start with it reuse it)",
    )
    parser.add_argument(
        "--api-key",
        metavar="KEY",
        help="encode for this key's tenant, as POST /contexts with this key would "
        "(with CACHEGEN_API_KEY or _FILE set, it must be one of them)",
    )
    parser.add_argument("--cache-salt", metavar="SALT", help="as the cache_salt of POST /contexts")
    parser.add_argument(
        "--ttl-seconds",
        type=int,
        metavar="SECONDS",
        help="the contexts expire this long after (default: pinned)",
    )
    add_settings_flags(parser, {"model", "store"})
    args = parser.parse_args(argv)
    if args.ttl_seconds is not None and args.ttl_seconds < 1:
        parser.error("--ttl-seconds must be at least 1")

    texts: list[tuple[Path, str]] = []
    refused = 0
    for path in args.files:
        text, problem = read_text(path)
        if problem is not None:
            print(f"{path}: {problem}", file=sys.stderr)
            refused += 1
        else:
            texts.append((path, text))
    if refused:
        return print_failure(prog, f"{refused} of {len(args.files)} files refused; nothing encoded")
    try:
        return _encode(args, texts, prog)
    except Exception as exc:  # known kinds become one line; anything else is a bug
        line = failure_line(exc)
        if line is None:
            raise
        return print_failure(prog, line)


def _encode(args: argparse.Namespace, texts: list[tuple[Path, str]], prog: str) -> int:
    settings = build_settings(args)
    check_device(settings.device)
    check_model(settings.model)
    logging.basicConfig(level=logging.WARNING)
    from app.build import build_gateway
    from app.gateway import load_levels
    from engine.loading import pick_device

    known = [level.name for level in load_levels(settings, pick_device(settings.device).type).levels]
    unknown = [name for name in args.levels or settings.encode_levels or [] if name not in known]
    if unknown:
        return print_failure(prog, f"unknown levels {', '.join(unknown)}; known: {', '.join(known)}")

    from app.errors import APIError
    from app.protocol import ChatMessage
    from app.serving_contexts import context_object

    space = _key_space(settings, args.api_key, args.cache_salt)
    gateway = build_gateway(settings)
    try:
        levels = gateway.encode_levels(args.levels)
        todo: list[tuple[Path, list[int]]] = []
        for path, text in texts:
            try:
                if args.as_chat_system:
                    message = ChatMessage(role="system", content=text)
                    ids = gateway.chat_token_ids([message], add_generation_prompt=False)
                else:
                    ids = gateway.text_token_ids(text)
            except APIError as exc:  # a chat template that refuses the message
                print(f"{path}: {exc.message}", file=sys.stderr)
                continue
            if len(ids) >= gateway.max_context:
                limit = gateway.max_context - 1
                print(f"{path}: {len(ids)} tokens, more than the model's {limit}", file=sys.stderr)
                continue
            todo.append((path, ids))
        if len(todo) < len(texts):
            refused = len(texts) - len(todo)
            return print_failure(prog, f"{refused} of {len(texts)} files refused; nothing encoded")
        for number, (path, ids) in enumerate(todo, 1):
            label = f"[{number}/{len(todo)}] {path.name}"
            manifest = encode_file(gateway, ids, levels, label, space, args.ttl_seconds)
            tqdm.write(json.dumps({"file": str(path), **context_object(manifest)}), file=sys.stdout)
    finally:
        gateway.loop.stop()
        gateway.io_pool.shutdown()
        gateway.store.close()
    return 0


def _key_space(settings: Any, api_key: str | None, cache_salt: str | None) -> KeySpace:
    """The tenant and salt a gateway gives ``POST /contexts`` with this key and ``cache_salt``."""
    from app.auth import ANONYMOUS, ApiKeys, InvalidApiKey

    configured = settings.api_keys()
    if api_key is None:
        if configured and not settings.shared_cache:
            raise ValueError("API keys are configured: give --api-key, the key of the tenant to encode for")
        return ANONYMOUS.key_space(cache_salt)
    keys = ApiKeys(
        configured or [api_key], settings.shared_cache, tenant_secret=settings.tenant_secret_bytes()
    )
    try:
        return keys.tenant(f"Bearer {api_key}").key_space(cache_salt)
    except InvalidApiKey:
        raise ValueError("--api-key is not one of the configured API keys") from None
