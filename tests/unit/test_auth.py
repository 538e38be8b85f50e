"""API keys, tenants and the body limit, through their ASGI middlewares on a minimal app."""

from __future__ import annotations

import asyncio
import hashlib
import hmac

import httpx
import pytest
from fastapi import FastAPI, Request

from app.auth import ANONYMOUS, ApiKeyAuth, ApiKeys, InvalidApiKey
from app.body_limit import BodyLimit


def test_a_wrong_or_missing_key_is_refused_and_each_key_is_a_tenant():
    keys = ApiKeys(["key-one", "key-two"])
    for header in (None, "", "Bearer", "Bearer ", "Basic key-one", "Bearer key-three", "Bearer key-on"):
        with pytest.raises(InvalidApiKey) as err:
            keys.tenant(header)
        assert err.value.status == 401 and err.value.code == "invalid_api_key"
    one, two = keys.tenant("Bearer key-one"), keys.tenant("bearer  key-two")
    assert one.id != two.id and one.secret != two.secret and None not in (one.id, two.id)
    assert keys.tenant("Bearer key-one") == one  # derived, so stable across restarts
    assert "key-one" not in repr(one) and b"key-one" not in one.secret
    assert ApiKeys(["key-one"], shared_cache=True).tenant("Bearer key-one") == ANONYMOUS
    assert ApiKeys([]).tenant(None) == ANONYMOUS  # no keys: open


def test_a_server_secret_changes_every_tenant_and_is_needed_to_recompute_one():
    """Ids and salts under a tenant secret are HMACs: the same key and secret give the same tenant
    (replicas agree), another secret or none gives another (a rotation), and the plain-hash
    derivation that anyone could compute from a guessed key no longer matches."""
    plain = ApiKeys(["key-one"]).tenant("Bearer key-one")
    a = ApiKeys(["key-one"], tenant_secret=b"s1").tenant("Bearer key-one")
    assert a == ApiKeys(["key-one"], tenant_secret=b"s1").tenant("Bearer key-one")
    b = ApiKeys(["key-one"], tenant_secret=b"s2").tenant("Bearer key-one")
    assert len({plain.id, a.id, b.id}) == 3 and len({plain.secret, a.secret, b.secret}) == 3
    digest = hashlib.sha256(b"key-one").digest()
    assert a.secret == hmac.new(b"s1", b"cachegen tenant salt\0" + digest, hashlib.sha256).digest()


def test_the_tenant_secret_comes_from_the_environment_or_a_file(tmp_path, monkeypatch):
    from app.settings import Settings

    monkeypatch.setenv("CACHEGEN_TENANT_SECRET", "from-env")
    assert Settings().tenant_secret_bytes() == b"from-env"
    assert "from-env" not in repr(Settings())
    monkeypatch.delenv("CACHEGEN_TENANT_SECRET")
    (tmp_path / "secret").write_text("from-file\n")
    assert Settings(tenant_secret_file=tmp_path / "secret").tenant_secret_bytes() == b"from-file"
    (tmp_path / "empty").write_text("")
    with pytest.raises(ValueError, match="empty"):
        Settings(tenant_secret_file=tmp_path / "empty").tenant_secret_bytes()
    assert Settings().tenant_secret_bytes() is None


def test_keys_must_be_clean():
    with pytest.raises(ValueError):
        ApiKeys(["ok", " padded"])


def _app(keys: ApiKeys, max_body: int = 1 << 20) -> FastAPI:
    app = FastAPI()

    @app.get("/health")
    @app.get("/ready")
    @app.get("/get_load")
    @app.get("/get_server_info")
    async def health() -> dict:
        return {}

    @app.get("/metrics")
    async def metrics() -> dict:
        return {}

    @app.post("/echo")
    async def echo(request: Request) -> dict:
        body = await request.body()
        return {"tenant": request.state.tenant.id, "bytes": len(body)}

    app.add_middleware(BodyLimit, max_bytes=max_body)
    app.add_middleware(ApiKeyAuth, keys=keys)
    return app


def _call(app: FastAPI, method: str, path: str, **kwargs) -> httpx.Response:
    async def go() -> httpx.Response:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://gateway") as client:
            return await client.request(method, path, **kwargs)

    return asyncio.run(go())


def test_the_middleware_answers_401_with_an_error_object_except_on_open_paths():
    app = _app(ApiKeys(["k1"]))
    refused = _call(app, "POST", "/echo", content=b"{}")
    assert refused.status_code == 401 and refused.headers["www-authenticate"] == "Bearer"
    assert refused.json()["error"]["code"] == "invalid_api_key"
    assert set(refused.json()["error"]) == {"message", "type", "param", "code"}
    assert _call(app, "POST", "/echo", headers={"Authorization": "Bearer k2"}).status_code == 401
    ok = _call(app, "POST", "/echo", content=b"{}", headers={"Authorization": "Bearer k1"})
    assert ok.status_code == 200 and ok.json()["tenant"] == ApiKeys(["k1"]).tenant("Bearer k1").id
    for probe in ("/health", "/ready", "/get_load"):  # a prober or router sends no key
        assert _call(app, "GET", probe).status_code == 200
    assert _call(app, "GET", "/get_server_info").status_code == 401  # how it is configured: a key
    assert _call(app, "GET", "/metrics").status_code == 200  # open by default
    locked = _app(ApiKeys(["k1"], metrics_auth=True))
    assert _call(locked, "GET", "/metrics").status_code == 401


def test_bodies_over_the_limit_get_413_declared_or_streamed():
    app = _app(ApiKeys([]), max_body=1024)
    assert _call(app, "POST", "/echo", content=b"x" * 1024).json()["bytes"] == 1024
    declared = _call(app, "POST", "/echo", content=b"x" * 1025)
    assert declared.status_code == 413 and declared.json()["error"]["code"] == "request_too_large"

    async def chunks():
        for _ in range(8):
            yield b"y" * 400

    streamed = _call(app, "POST", "/echo", content=chunks())  # chunked: no Content-Length
    assert streamed.status_code == 413 and streamed.json()["error"]["code"] == "request_too_large"


def test_the_rank_test_of_the_timing_benchmark():
    from benchmarks.stats import mann_whitney

    same = [float(v) for v in range(50)]
    assert mann_whitney(same, list(same))[1] > 0.99
    u, p = mann_whitney([1.0, 2.0, 3.0], [4.0, 5.0, 6.0])
    assert u == 0 and 0.04 < p < 0.06  # scipy (normal approximation, no continuity correction): 0.0495
    assert mann_whitney([float(v) for v in range(50)], [v + 100.0 for v in range(50)])[1] < 1e-15


def test_keys_come_from_the_variable_and_the_file(tmp_path):
    from app.settings import Settings

    path = tmp_path / "keys.txt"
    path.write_text("# the ops team\nfile-key-1\n\n  file-key-2  \n")
    settings = Settings(api_key="env-key-1,env-key-2", api_key_file=path)
    assert settings.api_keys() == ["env-key-1", "env-key-2", "file-key-1", "file-key-2"]
    assert "env-key-1" not in repr(settings) and "env-key-1" not in str(settings.model_dump())
    assert Settings().api_keys() == []
