"""``python -m app encode FILE...``: pre-encode text files into the configured KV store."""

from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path

from tqdm import tqdm


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m app encode", description=__doc__)
    parser.add_argument("files", nargs="+", type=Path, help="UTF-8 text files, one context each")
    parser.add_argument("--levels", nargs="+", help="levels to encode (default: all configured)")
    parser.add_argument("--as-chat-system", action="store_true", help="encode as a chat system message")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)

    from app.gateway import build_gateway
    from app.protocol import ChatMessage
    from app.serving_contexts import context_object, encode_tokens
    from app.settings import Settings

    gateway = build_gateway(Settings())
    levels = gateway.encode_levels(args.levels)
    failed = 0
    for path in tqdm(args.files, desc="encoding", unit="file"):
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            tqdm.write(f"{path}: cannot read: {exc}")
            failed += 1
            continue
        if args.as_chat_system:
            ids = gateway.chat_token_ids(
                [ChatMessage(role="system", content=text)], add_generation_prompt=False
            )
        else:
            ids = gateway.text_token_ids(text)
        if not ids or len(ids) >= gateway.max_context:
            tqdm.write(f"{path}: {len(ids)} tokens, outside 1..{gateway.max_context - 1}; skipped")
            failed += 1
            continue
        manifest = encode_tokens(gateway, ids, levels)
        tqdm.write(json.dumps({"file": str(path), **context_object(manifest)}))
    gateway.loop.stop()
    gateway.io_pool.shutdown()
    return 1 if failed else 0
