"""API keys and tenants, as vLLM's ``--api-key``, plus a tenant per key.

With keys configured (``CACHEGEN_API_KEY``, ``CACHEGEN_API_KEY_FILE``), every
route but ``/health`` (and ``/metrics`` unless ``CACHEGEN_METRICS_AUTH``) needs
``Authorization: Bearer <key>``; a missing or wrong key gets a 401 error
object with code ``invalid_api_key``.

Each key is a tenant: its stored KV and contexts are its own
(scheduler/tenancy.py). The tenant's id and salt are derived from the key by
hashing, so nothing the server keeps or writes reveals a key, and a client
cannot name another tenant's salt: its own ``cache_salt`` is mixed in after
its tenant's. ``CACHEGEN_SHARED_CACHE`` puts every key in one shared tenant.
Rotating a key starts its tenant afresh (its old contexts stay until they
expire or are evicted).

With ``CACHEGEN_TENANT_SECRET`` the id and salt are HMAC-SHA-256 of the key's
digest under that server-side secret; without it, plain SHA-256. The secret
matters to anyone who can read the bucket: object names and manifests are
functions of the salt and id, so without a secret a weak key could be guessed
offline by recomputing them. Every replica over one store needs the same
secret. Changing it is a rotation of every tenant at once: each starts afresh,
its old objects stay unreachable until they expire, are evicted by the cap or
collected (``python -m app gc``).
"""

from __future__ import annotations

import hashlib
import hmac
from dataclasses import dataclass

from starlette.types import ASGIApp, Receive, Scope, Send

from app.errors import APIError, error_response
from scheduler.tenancy import KeySpace

# Paths anyone may call: a load balancer's or Kubernetes' probes, and a router's load poll, carry
# no key. They tell whether the gateway serves and how busy it is, nothing stored.
OPEN_PATHS = frozenset({"/health", "/ready", "/get_load"})
METRICS_PATH = "/metrics"


class InvalidApiKey(APIError):
    status = 401
    code = "invalid_api_key"
    headers = {"WWW-Authenticate": "Bearer"}  # noqa: RUF012 - as the base class declares it


@dataclass(frozen=True)
class Tenant:
    id: str | None  # recorded in its contexts' manifests
    secret: bytes | None  # mixed into its chunk keys

    def key_space(self, cache_salt: str | None) -> KeySpace:
        return KeySpace.derive(self.id, self.secret, cache_salt)


ANONYMOUS = Tenant(None, None)  # no keys configured, or a shared cache


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


class ApiKeys:
    def __init__(
        self,
        keys: list[str],
        shared_cache: bool = False,
        metrics_auth: bool = False,
        tenant_secret: bytes | None = None,
    ) -> None:
        if any(not k or k != k.strip() for k in keys):
            raise ValueError("API keys must be non-empty and have no surrounding spaces")
        # compared as digests: equal lengths, so the comparison's time says nothing of a key
        self._digests = [_digest(k) for k in keys]
        self.shared_cache = shared_cache
        self.metrics_auth = metrics_auth
        self._tenant_secret = tenant_secret

    @property
    def enabled(self) -> bool:
        return bool(self._digests)

    def needs_key(self, path: str) -> bool:
        if not self.enabled or path in OPEN_PATHS:
            return False
        return path != METRICS_PATH or self.metrics_auth

    def tenant(self, authorization: str | None) -> Tenant:
        """The caller's tenant, from its ``Authorization`` header; raises InvalidApiKey."""
        if not self.enabled:
            return ANONYMOUS
        scheme, _, token = (authorization or "").partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            raise InvalidApiKey("missing API key: send 'Authorization: Bearer <key>'", code="invalid_api_key")
        presented = _digest(token.strip())
        match = None
        for digest in self._digests:  # every key is compared, whichever matches
            if hmac.compare_digest(presented, digest):
                match = digest
        if match is None:
            raise InvalidApiKey("incorrect API key provided")
        if self.shared_cache:
            return ANONYMOUS
        return Tenant(
            id=self._derive(b"cachegen tenant id\0", match).hex()[:32],
            secret=self._derive(b"cachegen tenant salt\0", match),
        )

    def _derive(self, label: bytes, key_digest: bytes) -> bytes:
        if self._tenant_secret is None:
            return hashlib.sha256(label + key_digest).digest()
        return hmac.new(self._tenant_secret, label + key_digest, hashlib.sha256).digest()


class ApiKeyAuth:
    """Plain ASGI middleware: checks the key, and puts the caller's tenant in ``request.state``."""

    def __init__(self, app: ASGIApp, keys: ApiKeys) -> None:
        self.app = app
        self.keys = keys

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        tenant = ANONYMOUS
        if self.keys.needs_key(scope["path"]):
            header = dict(scope["headers"]).get(b"authorization")
            try:
                tenant = self.keys.tenant(None if header is None else header.decode("latin-1"))
            except InvalidApiKey as err:
                await error_response(err)(scope, receive, send)
                return
        scope.setdefault("state", {})["tenant"] = tenant
        await self.app(scope, receive, send)
