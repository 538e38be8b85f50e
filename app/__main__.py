"""``python -m app`` (or ``cachegen-gateway``): ``serve`` (the default), ``encode``, ``calibrate``.

``python -m app --host H --port P`` serves, as ``python -m app serve ...`` does;
``--help`` lists the subcommands, ``serve --help`` the server's flags.
"""

from __future__ import annotations

import sys

from app.cli import (
    COMMANDS,
    build_settings,
    check_device,
    check_model,
    check_port,
    command_parser,
    failure_line,
    print_failure,
    program_name,
    serve_parser,
)


def serve(argv: list[str], prog: str) -> int:
    args = serve_parser(prog).parse_args(argv)
    try:
        settings = build_settings(args)
        if settings.malloc_tuning:  # before the server's threads exist (app/allocator.py)
            from app.allocator import tune

            tune()
        check_device(settings.device)
        check_model(settings.model)
        check_port(args.host, args.port)
        from app.factory import create_app

        app = create_app(settings)  # configures logging; the model loads once the server runs
    except Exception as exc:  # known kinds become one line; anything else is a bug
        line = failure_line(exc)
        if line is None:
            raise
        return print_failure(prog, line)

    import uvicorn

    config = uvicorn.Config(
        app,
        host=args.host,
        port=args.port,
        log_level=settings.log_level,
        # SIGTERM: stop accepting, let running requests finish this long, then cancel them
        timeout_graceful_shutdown=settings.shutdown_grace_s,
    )
    server = uvicorn.Server(config)
    app.state.stop_server = lambda: setattr(server, "should_exit", True)  # a failed start-up stops it
    server.run()
    starter = app.state.startup
    if starter is not None and starter.error is not None:  # logged already; the exit status says it
        return 1
    return 0


def calibrate(argv: list[str], prog: str) -> int:
    from app.calibrate import main as calibrate_main

    try:
        return calibrate_main(argv)
    except Exception as exc:  # as in serve
        line = failure_line(exc)
        if line is None:
            raise
        return print_failure(f"{prog} calibrate", line)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    prog = program_name()
    if argv and argv[0] in ("-h", "--help"):
        command_parser(prog).print_help()
        return 0
    if argv and not argv[0].startswith("-") and argv[0] not in COMMANDS:
        command_parser(prog).error(f"unknown command {argv[0]!r} (choose from {', '.join(COMMANDS)})")
    command, rest = (argv[0], argv[1:]) if argv and argv[0] in COMMANDS else ("serve", argv)
    try:
        if command == "encode":
            from app.cli_encode import main as encode_main

            return encode_main(rest, prog=f"{prog} encode")
        if command == "calibrate":
            return calibrate(rest, prog)
        if command == "gc":
            from app.cli_gc import main as gc_main

            return gc_main(rest, prog=f"{prog} gc")
        return serve(rest, prog)
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
