"""The command line: subcommands, the flags that map onto settings, and start-up failures as one line.

Flags win over ``CACHEGEN_*`` variables, which win over the TOML file. Parsers
import nothing heavy, so ``--help`` answers at once; the checks here run before
the model loads, so a wrong device, model path, config file or port costs a
second, not a model load.
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from app.settings import Settings

COMMANDS = {
    "serve": "run the OpenAI-compatible HTTP server (the default when no subcommand is given)",
    "encode": "pre-encode UTF-8 text files into the configured KV store",
    "calibrate": "measure a model's quality-level table (for CACHEGEN_LEVELS_FILE)",
    "gc": "delete expired contexts and unreferenced chunks from the KV store; enforce its size cap",
}
SETTINGS_PRECEDENCE = "Flags win over CACHEGEN_* environment variables, which win over the TOML file."


class StartupError(Exception):
    """A configuration the gateway cannot start with; the message is the one line the user sees."""


@dataclass(frozen=True)
class SettingsFlag:
    flag: str
    field: str  # the Settings field, and so the CACHEGEN_<FIELD> variable
    help: str
    type: type = str
    metavar: str | None = None

    @property
    def env(self) -> str:
        return f"CACHEGEN_{self.field.upper()}"


SETTINGS_FLAGS = (
    SettingsFlag("--model", "model", "'smollm2' (built in), a model directory, or a hub id"),
    SettingsFlag(
        "--served-model-name", "served_model_name", "the name clients send in 'model'", metavar="NAME"
    ),
    SettingsFlag(
        "--max-model-len",
        "max_model_len",
        "context window in tokens, prompt plus output; default: the model's",
        type=int,
        metavar="TOKENS",
    ),
    SettingsFlag(
        "--dtype",
        "dtype",
        "auto (on a CPU bf16-weights where its bf16 is native and batch-invariant, else float32; the "
        "model's own on a GPU), "
        "float32, bfloat16, float16, bf16-weights (float32 with bf16 weights in the linear layers)",
    ),
    SettingsFlag("--api-key", "api_key", "clients must send 'Authorization: Bearer KEY'", metavar="KEY"),
    SettingsFlag("--store", "store", "KV store: file:///dir, memory:// or s3://bucket/prefix", metavar="URL"),
)
# read from the environment where they are used, not only through Settings
ENV_PASSTHROUGH = {"api_key"}


def program_name() -> str:
    """``cachegen-gateway`` when run as the console script, ``python -m app`` otherwise."""
    name = Path(sys.argv[0]).name if sys.argv and sys.argv[0] else ""
    return "python -m app" if name in ("", "__main__.py", "-c") else name


def command_parser(prog: str) -> argparse.ArgumentParser:
    """Only for ``--help``: dispatch is by the first word, so ``python -m app --port 8001`` still serves."""
    parser = argparse.ArgumentParser(
        prog=prog,
        description="CacheGen gateway: an OpenAI-compatible server that reuses long contexts' KV caches "
        "from object storage. Without a subcommand it serves (flags as for 'serve').",
        epilog=f"'{prog} COMMAND --help' shows a subcommand's flags.",
    )
    subcommands = parser.add_subparsers(title="subcommands", metavar="COMMAND")
    for name, help_text in COMMANDS.items():
        subcommands.add_parser(name, help=help_text)
    return parser


def add_settings_flags(parser: argparse.ArgumentParser, fields: set[str] | None = None) -> None:
    group = parser.add_argument_group("settings", SETTINGS_PRECEDENCE)
    group.add_argument(
        "--config",
        type=Path,
        metavar="FILE",
        help="TOML settings file; keys are the settings' names in lower case (CACHEGEN_CONFIG_FILE)",
    )
    for spec in SETTINGS_FLAGS:
        if fields is None or spec.field in fields:
            group.add_argument(
                spec.flag,
                dest=spec.field,
                type=spec.type,
                metavar=spec.metavar,
                help=f"{spec.help} ({spec.env})",
            )


def serve_parser(prog: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=f"{prog} serve",
        description="Run the OpenAI-compatible HTTP server. Every setting also has a CACHEGEN_* "
        "variable (README, Configuration); the flags below are the common ones.",
    )
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default: %(default)s)")
    parser.add_argument("--port", type=int, default=8000, help="port to listen on (default: %(default)s)")
    add_settings_flags(parser)
    return parser


def build_settings(args: argparse.Namespace) -> Settings:
    """Settings from the flags in ``args`` over the environment and the TOML file."""
    if getattr(args, "config", None) is not None:
        os.environ["CACHEGEN_CONFIG_FILE"] = str(args.config)
    from app.settings import Settings

    check_config_file(os.environ.get("CACHEGEN_CONFIG_FILE"), set(Settings.model_fields))
    overrides: dict[str, Any] = {}
    for spec in SETTINGS_FLAGS:
        value = getattr(args, spec.field, None)
        if value is None:
            continue
        if spec.field not in Settings.model_fields:
            raise StartupError(f"{spec.flag} is not supported by this version (no {spec.field} setting)")
        if spec.field in ENV_PASSTHROUGH:
            os.environ[spec.env] = str(value)
        overrides[spec.field] = value
    return Settings(**overrides)


def check_config_file(path: str | None, known: set[str]) -> None:
    """A named TOML file must exist, parse, and name only known settings (pydantic would ignore typos)."""
    if not path:
        return
    import tomllib

    try:
        data = tomllib.loads(Path(path).read_text(encoding="utf-8"))
    except OSError as exc:
        raise StartupError(f"config file {path}: {exc.strerror or exc}") from None
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise StartupError(f"config file {path}: {exc}") from None
    unknown = sorted(set(data) - known - {"config_file"})
    if unknown:
        raise StartupError(f"config file {path}: unknown settings {', '.join(unknown)}")


def check_device(device: str) -> None:
    """A device this torch build and machine have, before the model is loaded onto it."""
    if device == "auto":
        return
    import torch

    try:
        dev = torch.device(device)
    except RuntimeError as exc:
        raise StartupError(f"device {device!r} (CACHEGEN_DEVICE): {exc}") from None
    if dev.type == "cuda":
        if torch.version.cuda is None:
            raise StartupError(
                f"device {device!r} (CACHEGEN_DEVICE): this torch build has no CUDA support "
                f"(torch {torch.__version__}); use 'cpu' or 'auto', or install a CUDA build of torch"
            )
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            raise StartupError(f"device {device!r} (CACHEGEN_DEVICE): no CUDA GPU is visible")
        if dev.index is not None and dev.index >= count:
            raise StartupError(f"device {device!r} (CACHEGEN_DEVICE): only {count} CUDA GPU(s) visible")
    elif dev.type == "mps" and not torch.backends.mps.is_available():
        raise StartupError(f"device {device!r} (CACHEGEN_DEVICE): MPS is not available on this machine")


def check_model(reference: str) -> None:
    """A reference written as a path must exist (else the hub client rejects it as a malformed id)."""
    if reference.startswith(("/", "./", "../", "~")) and not Path(reference).expanduser().exists():
        raise StartupError(f"model {reference!r} (CACHEGEN_MODEL): no such directory")


def check_port(host: str, port: int) -> None:
    """Bind once before the model loads: a busy port then fails in a second, not after the load."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(
            host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )[0]
    except socket.gaierror as exc:
        raise StartupError(f"cannot listen on {host}:{port}: {exc.strerror}") from None
    with socket.socket(family, kind, proto) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds
        try:
            sock.bind(address)
        except OSError as exc:
            raise StartupError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None


def failure_line(exc: BaseException) -> str | None:
    """The one line for a failure of a known kind (bad settings, model, store, files); None for a bug,
    and for everything with ``CACHEGEN_LOG_LEVEL=debug`` (then the traceback is shown)."""
    if os.environ.get("CACHEGEN_LOG_LEVEL", "").lower() == "debug":
        return None
    from pydantic import ValidationError

    from engine.loading import ModelLoadError
    from storage import StorageError

    if isinstance(exc, ValidationError):
        problems = [
            f"{'.'.join(str(part) for part in error['loc']) or 'settings'}: {error['msg']}"
            + (
                f" (got {error['input']!r})"
                if "input" in error and not isinstance(error["input"], dict)
                else ""
            )
            for error in exc.errors()
        ]
        message = "invalid settings: " + "; ".join(problems)
    elif isinstance(exc, StorageError):
        message = f"KV store: {exc}"
    elif isinstance(exc, StartupError | ModelLoadError | OSError | ValueError):
        message = str(exc) or type(exc).__name__
    else:
        return None
    return " ".join(message.split())


def print_failure(prog: str, line: str) -> int:
    """``line`` on stderr, as argparse words its errors; returns the exit status."""
    print(f"{prog}: error: {line}", file=sys.stderr)
    return 1
