"""The one settings object: environment variables prefixed ``CACHEGEN_``, or a TOML file.

Precedence: constructor arguments, then the environment, then the TOML file
named by ``CACHEGEN_CONFIG_FILE``, then the defaults below.
"""

from __future__ import annotations

import json
import socket
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BeforeValidator, Field, SecretStr
from pydantic_settings import (
    BaseSettings,
    NoDecode,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    TomlConfigSettingsSource,
)

from engine.loading import DEFAULT_MODEL, default_cache_dir


def _name_list(value: Any) -> Any:
    """A list of names from the environment: ``lossless,medium`` or the JSON ``["lossless","medium"]``;
    empty means unset."""
    if not isinstance(value, str):
        return value
    text = value.strip()
    if not text:
        return None
    if text.startswith("["):
        return json.loads(text)
    return [name.strip() for name in text.split(",") if name.strip()]


def _lower(value: Any) -> Any:
    return value.strip().lower() if isinstance(value, str) else value


# NoDecode: the list is parsed here, not as JSON by pydantic-settings
NameList = Annotated[list[str] | None, NoDecode, BeforeValidator(_name_list)]
# API keys: parsed as a name list, held as secrets so that no repr or log line shows them
KeyList = Annotated[list[SecretStr] | None, NoDecode, BeforeValidator(_name_list)]


DEFAULT_STORE_CACHE_BYTES = 512 * 2**20


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="CACHEGEN_", extra="ignore")

    config_file: Path | None = Field(None, description="TOML file with any of these settings")

    # model
    model: str = Field(DEFAULT_MODEL, description="'smollm2' (built in), a model directory, or a hub id")
    served_model_name: str | None = Field(None, description="name clients put in 'model'")
    replica: str = Field(
        default_factory=socket.gethostname,
        min_length=1,
        max_length=253,
        description="this gateway's name in kv_cache_info and /metrics, to tell replicas apart "
        "(default: the host name, a pod's name under Kubernetes); keys never depend on it",
    )
    max_model_len: int | None = Field(
        None, ge=1, description="context window in tokens (prompt + output); default: the model's"
    )
    device: str = Field("auto", description="'auto', 'cpu', 'cuda', 'cuda:1', ...")
    dtype: Literal["auto", "float32", "bfloat16", "float16", "bf16-weights"] = Field(
        "auto",
        description="the model's dtype; 'auto': on a CPU bf16-weights where its native bf16 products "
        "are batch-invariant (a start-up probe: AVX512-BF16 yes, AMX no), else float32; the model's own "
        "on a GPU. 'bf16-weights': float32 with bf16 weights in the linear layers (docs/serving.md)",
    )
    cache_dir: Path = Field(default_factory=default_cache_dir, description="converted models live here")
    torch_threads: int | None = Field(
        None,
        ge=1,
        description="torch intra-op threads; default: the cores numba does not get (app/threads.py)",
    )
    numba_threads: int | None = Field(
        None,
        ge=1,
        description=(
            "codec threads per decode or encode; default: every core while the model idles, else a"
            " quarter of them, at least 1 (app/threads.py)"
        ),
    )
    codec_threading_layer: Literal["auto", "tbb", "workqueue"] = Field(
        "auto",
        description="numba's threading layer for the codec: 'auto' is TBB where the tbb package loads, "
        "else numba's workqueue (app/threads.py)",
    )

    # KV store
    store: str = Field(
        "", description="file:///dir, memory:// or s3://bucket/prefix; default: a dir in cache_dir"
    )
    store_cache_bytes: int | None = Field(
        None,
        ge=0,
        description="in-memory LRU in front of the store, bytes (0: off); default: 512 MiB in front of "
        "a remote store, none in front of a local directory (the OS page cache keeps its hot files)",
    )
    store_threads: int = Field(8, ge=1, le=256, description="parallel chunk fetches and uploads")
    malloc_tuning: bool = Field(
        True, description="glibc: 2 arenas, 32 MiB mmap threshold, 64 MiB trim (app/allocator.py)"
    )
    malloc_trim_interval_s: float = Field(
        0.5,
        ge=0,
        description="with malloc_tuning: every this many seconds, give the arenas' free pages back to the "
        "OS when the RSS grew by malloc_trim_growth_bytes since the last trim (malloc_trim; "
        "app/malloc_trim.py); 0: never",
    )
    malloc_trim_growth_bytes: int = Field(
        64 << 20,
        ge=0,
        description="the RSS growth since the last trim, with that much free in the arenas, that triggers a trim",
    )
    chunk_size: int = Field(256, ge=16, le=65536, description="tokens per stored KV chunk")
    levels_file: Path | None = Field(None, description="JSON level table (see `python -m app calibrate`)")
    encode_levels: NameList = Field(
        None, description="levels pre-encode writes, e.g. 'lossless,medium'; default: all"
    )
    write_back: bool = Field(False, description="store the KV of uncached prompt chunks after a request")
    write_back_levels: NameList = Field(None, description="levels write-back stores; default: all")

    kv_slo_ms: float | None = Field(
        None, gt=0, description="default time-to-first-token budget for kv_quality 'auto' (unset: none)"
    )
    min_quality: str | None = Field(
        None,
        description="without a budget, 'auto' uses no level below this one (default: the table's default)",
    )

    # serving
    max_queue: int = Field(64, ge=1, description="requests in flight (loading, waiting, running) before 429")
    max_num_seqs: int = Field(16, ge=1, description="sequences batched into one step; 1 turns batching off")
    encode_threads: int = Field(
        2, ge=1, le=64, description="pre-encodes run at once (on threads of their own, not the requests')"
    )
    max_encodes_per_tenant: int = Field(
        2, ge=1, description="pre-encodes one tenant may have in flight; 429 with Retry-After beyond"
    )
    max_batched_tokens: int | None = Field(
        None,
        ge=1,
        description="tokens per step while streams decode (decodes first, then prefill chunks); "
        "default: 64 on a CPU, 2048 on a GPU",
    )
    kv_memory_bytes: int = Field(
        2 * 2**30, ge=2**20, description="KV buffers of all requests in flight; admission waits beyond it"
    )
    kv_prefault: bool = Field(
        True,
        description="on a CPU, fault the KV memory's pages in at start-up (0.3-0.6 s per GiB), so that no "
        "load pays for it (engine/kv_pool.py)",
    )
    prefix_cache: bool = Field(
        True,
        description="keep finished requests' computed KV in memory (within kv_memory_bytes) for the next "
        "request with the same prefix",
    )
    hold_for_loads: bool = Field(
        True,
        description="a step of new prompts only waits for prefix loads in flight, for at most 3x that step's "
        "predicted time and 0.25 s, so a burst of questions on stored contexts shares one step "
        "(scheduler/step_loop.py)",
    )
    default_max_tokens: int = Field(512, ge=1, description="chat max_tokens when the client sets none")
    log_level: Annotated[Literal["debug", "info", "warning", "error"], BeforeValidator(_lower)] = "info"
    log_format: Annotated[Literal["text", "json"], BeforeValidator(_lower)] = Field(
        "text", description="'json': one JSON object per line, with the request id of each request's lines"
    )

    # access and tenants (app/auth.py)
    api_key: KeyList = Field(
        None, description="bearer keys clients must send, comma-separated; unset (and no file): open"
    )
    api_key_file: Path | None = Field(None, description="file of API keys, one per line ('#' comments)")
    metrics_auth: bool = Field(False, description="/metrics needs a key too (default: open to scrapers)")
    tenant_secret: SecretStr | None = Field(
        None,
        description="server-side secret HMAC'd into each tenant's id and key salt, so stored object names "
        "cannot be tested against guessed API keys; every replica over one store needs the same one, "
        "and changing it starts every tenant afresh",
    )
    tenant_secret_file: Path | None = Field(None, description="file holding tenant_secret (its first line)")
    shared_cache: bool = Field(
        False,
        description="with API keys: all keys share one KV cache (default: each key is its own tenant, "
        "and a tenant never reads, lists or learns of another's stored KV)",
    )

    # stored KV lifecycle (scheduler/lifecycle.py)
    store_max_bytes: int | None = Field(
        None,
        ge=1,
        description="cap on the store's size: whole contexts are evicted, least recently used first",
    )
    gc_interval_s: float | None = Field(
        None, gt=0, description="run the garbage collector (python -m app gc) in the gateway this often"
    )
    gc_grace_s: float = Field(
        3600.0,
        ge=0,
        description="chunks no live context lists (write-back, interrupted uploads) are kept this long",
    )

    # HTTP
    max_body_bytes: int = Field(
        16 * 2**20, ge=1024, description="largest request body accepted (413 beyond it)"
    )
    shutdown_grace_s: float = Field(
        30.0, ge=0, description="on SIGTERM, running requests get this long to finish, then are cancelled"
    )
    cors_origins: NameList = Field(
        None,
        description="origins browsers may call from, e.g. 'https://app.example,https://b.example', "
        "or '*'; default: none (no CORS headers)",
    )
    disable_docs: bool = Field(False, description="turn off /docs, /redoc and /openapi.json (production)")

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        import os

        sources: list[PydanticBaseSettingsSource] = [init_settings, env_settings]
        config_file = os.environ.get("CACHEGEN_CONFIG_FILE")
        if config_file:
            sources.append(TomlConfigSettingsSource(settings_cls, toml_file=config_file))
        return tuple(sources)

    def api_keys(self) -> list[str]:
        """Every configured key: ``api_key`` and the lines of ``api_key_file``."""
        keys = [k.get_secret_value() for k in self.api_key or []]
        if self.api_key_file is not None:
            for line in self.api_key_file.read_text(encoding="utf-8").splitlines():
                line = line.strip()
                if line and not line.startswith("#"):
                    keys.append(line)
        return keys

    def tenant_secret_bytes(self) -> bytes | None:
        if self.tenant_secret is not None:
            return self.tenant_secret.get_secret_value().encode()
        if self.tenant_secret_file is not None:
            lines = self.tenant_secret_file.read_text(encoding="utf-8").splitlines()
            if not lines or not lines[0].strip():
                raise ValueError(f"tenant_secret_file {self.tenant_secret_file} is empty")
            return lines[0].strip().encode()
        return None

    @property
    def store_url(self) -> str:
        return self.store or f"file://{(self.cache_dir / 'store').resolve()}"

    @property
    def store_cache_size(self) -> int:
        """The LRU tier's bytes. A local directory's reads are served from the page cache already,
        so a tier there only held each hot chunk twice; it also kept fetches off the KV pool's
        resident staging memory (``ObjectStore.get_into``)."""
        if self.store_cache_bytes is not None:
            return self.store_cache_bytes
        return 0 if self.store_url.startswith("file://") else DEFAULT_STORE_CACHE_BYTES
