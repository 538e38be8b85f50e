"""``python -m app [--host H --port P]`` serves; ``python -m app encode FILE...`` pre-encodes;
``python -m app calibrate ...`` measures a model's level table."""

from __future__ import annotations

import argparse
import logging
import os
import sys


def serve(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m app", description="CacheGen OpenAI-compatible gateway")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--config", help="TOML settings file (same keys as the CACHEGEN_* variables)")
    args = parser.parse_args(argv)
    if args.config:
        os.environ["CACHEGEN_CONFIG_FILE"] = args.config

    import uvicorn

    from app.factory import create_app
    from app.settings import Settings

    settings = Settings()
    logging.basicConfig(
        level=settings.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    app = create_app(settings)
    uvicorn.run(
        app, host=args.host, port=args.port, log_level=settings.log_level, timeout_graceful_shutdown=5
    )
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "encode":
        from app.cli_encode import main as encode_main

        return encode_main(argv[1:])
    if argv and argv[0] == "calibrate":
        from app.calibrate import main as calibrate_main

        return calibrate_main(argv[1:])
    if argv and argv[0] == "serve":
        argv = argv[1:]
    return serve(argv)


if __name__ == "__main__":
    sys.exit(main())
