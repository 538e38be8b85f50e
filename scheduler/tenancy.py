"""Key spaces: whose stored KV a request may read, and who owns the contexts it stores.

A ``KeySpace`` has two parts:

- ``salt``, mixed into the root of the chunk-key chain (scheduler/prefix.py).
  Requests of different salts never share a chunk, and no request can tell
  whether a prefix is stored under another salt: its own keys for that prefix
  name objects that do not exist, so a lookup costs the same as a cold miss.
- ``tenant``, recorded in the manifests of the contexts it pre-encodes.
  Listing, reading and deleting contexts is per tenant.

The app derives both from the caller's API key and the request's
``cache_salt`` (app/auth.py): a client can add a salt of its own, but never
drop or choose its tenant's.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

TENANT_ID_PATTERN = r"^[0-9a-f]{32}$"


@dataclass(frozen=True)
class KeySpace:
    salt: bytes | None = None  # None: the unsalted, shared chain
    tenant: str | None = None  # None: no tenants (no API keys, or a shared cache)

    @classmethod
    def derive(cls, tenant: str | None, tenant_secret: bytes | None, cache_salt: str | None) -> KeySpace:
        """The key space of a request: its tenant's secret and its own ``cache_salt``, either optional."""
        if tenant_secret is None and cache_salt is None:
            return cls(None, tenant)
        h = hashlib.sha256(b"cachegen key space\0")
        for part in (tenant_secret or b"", (cache_salt or "").encode()):
            h.update(len(part).to_bytes(4, "little") + part)  # length-prefixed: no two inputs collide
        return cls(h.digest(), tenant)


PUBLIC = KeySpace()
