"""The manifest of a pre-encoded context: JSON, validated on every read."""

from __future__ import annotations

from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field, StringConstraints, ValidationError

from scheduler.errors import ManifestError
from scheduler.prefix import CONTEXT_ID_PATTERN
from scheduler.tenancy import TENANT_ID_PATTERN
from storage import ObjectStore, ObjectTooLarge

MANIFEST_VERSION = 3  # 2: the context's tail is stored too; 3: tenant and expiry
MAX_MANIFEST_BYTES = 2**20  # about 15K chunk keys: a 4M-token context at 256 tokens a chunk

_HEX64 = r"^[0-9a-f]{64}$"
# chunk keys become store prefixes that readers list and deleters remove: hex digests only
ChunkKey = Annotated[str, StringConstraints(pattern=_HEX64)]


class Manifest(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    version: int = Field(MANIFEST_VERSION, ge=1, le=MANIFEST_VERSION)
    id: str = Field(pattern=CONTEXT_ID_PATTERN)
    model: str
    fingerprint: str = Field(pattern=_HEX64)
    chunk_size: int = Field(gt=0)
    tokens: int = Field(ge=0)
    chunk_keys: list[ChunkKey]
    tail_key: str | None = Field(None, pattern=_HEX64)  # the trailing partial chunk, when stored
    tail_tokens: int = Field(0, ge=0)
    level_bytes: dict[str, int]  # level name -> bytes stored for all chunks at that level
    created: int
    encode_seconds: float = Field(ge=0)
    tenant: str | None = Field(None, pattern=TENANT_ID_PATTERN)  # owner; None: no tenants
    expires: int | None = None  # Unix time after which the context is gone; None: pinned

    def expired(self, now: float) -> bool:
        return self.expires is not None and now >= self.expires

    @property
    def cached_tokens(self) -> int:
        return len(self.chunk_keys) * self.chunk_size + self.tail_tokens

    @property
    def stored_keys(self) -> list[str]:
        """Every chunk and tail key whose objects this context wrote."""
        return [*self.chunk_keys, *([self.tail_key] if self.tail_key else [])]

    def to_bytes(self) -> bytes:
        return self.model_dump_json().encode()

    @classmethod
    def read(cls, store: ObjectStore, key: str) -> Manifest:
        """The manifest at ``key``, never downloading more than ``MAX_MANIFEST_BYTES``. Raises
        ObjectNotFound, ManifestError (too large, invalid) or StorageError."""
        try:
            return cls.from_bytes(store.get(key, MAX_MANIFEST_BYTES))
        except ObjectTooLarge as exc:
            raise ManifestError(str(exc)) from None

    @classmethod
    def from_bytes(cls, data: bytes) -> Manifest:
        if len(data) > MAX_MANIFEST_BYTES:
            raise ManifestError(f"manifest of {len(data)} bytes exceeds {MAX_MANIFEST_BYTES}")
        try:
            manifest = cls.model_validate_json(data)
        except ValidationError as exc:
            raise ManifestError(f"invalid manifest: {exc.errors()[0]['msg']}") from exc
        if manifest.cached_tokens > manifest.tokens:
            raise ManifestError("manifest lists more chunks than its tokens fill")
        if (manifest.tail_key is None) != (manifest.tail_tokens == 0) or (
            manifest.tail_tokens >= manifest.chunk_size
        ):
            raise ManifestError("manifest has an inconsistent tail")
        return manifest
