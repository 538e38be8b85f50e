"""HTTP routes: thin; each hands a validated request to its serving module."""

from __future__ import annotations

import functools
from importlib import metadata
from typing import Annotated

from fastapi import APIRouter, Depends, Request, Response
from fastapi.responses import JSONResponse, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from app import serving_chat, serving_completions, serving_contexts, serving_tokens, serving_worker
from app.auth import ANONYMOUS, Tenant
from app.gateway import CLIENT_CLOSED, Gateway
from app.protocol import ChatCompletionRequest, CompletionRequest, ContextRequest, now
from app.readiness import Readiness, ReadinessReport
from app.serving_tokens import DetokenizeRequest, TokenizeRequest
from app.startup import ModelLoading

PACKAGE = "cachegen-gateway"


# The dependencies are ``async``: FastAPI runs a plain ``def`` dependency on its thread pool, a
# thread hop per dependency per request for an attribute read (and the pool's start-up cost in
# a fresh process's first request).
async def _gateway(request: Request) -> Gateway:
    gateway = request.app.state.gateway
    if gateway is None:  # still starting (app/startup.py)
        raise ModelLoading()
    return gateway


async def _readiness(request: Request) -> Readiness | None:
    return request.app.state.readiness


async def _tenant(request: Request) -> Tenant:
    """Set by ``ApiKeyAuth``; anonymous without API keys."""
    return getattr(request.state, "tenant", ANONYMOUS)


GatewayDep = Annotated[Gateway, Depends(_gateway)]
TenantDep = Annotated[Tenant, Depends(_tenant)]
ReadinessDep = Annotated[Readiness | None, Depends(_readiness)]

router = APIRouter()


@router.post("/v1/chat/completions", response_model=None)
async def chat_completions(
    body: ChatCompletionRequest, gateway: GatewayDep, tenant: TenantDep, http: Request
) -> JSONResponse | StreamingResponse | Response:
    space = tenant.key_space(body.cache_salt)
    return await serving_chat.chat_completion(gateway, body, http.is_disconnected, space)


@router.post("/v1/completions", response_model=None)
async def completions(
    body: CompletionRequest, gateway: GatewayDep, tenant: TenantDep, http: Request
) -> JSONResponse | StreamingResponse | Response:
    space = tenant.key_space(body.cache_salt)
    return await serving_completions.completion(gateway, body, http.is_disconnected, space)


# Every GET answers HEAD too (load tools probe with it, as they do vLLM).
GET = ["GET", "HEAD"]


def model_object(gateway: Gateway) -> dict:
    return {
        "id": gateway.model_name,
        "object": "model",
        "created": now(),
        "owned_by": "cachegen",
        "max_model_len": gateway.max_context,
    }


@router.api_route("/v1/models", methods=GET)
async def models(gateway: GatewayDep) -> dict:
    return {"object": "list", "data": [model_object(gateway)]}


@router.api_route("/v1/models/{model_id:path}", methods=GET)
async def model(model_id: str, gateway: GatewayDep) -> dict:
    """What ``client.models.retrieve`` asks for; 404 ``model_not_found`` for another model."""
    gateway.check_model(model_id)
    return model_object(gateway)


# The context routes are served under /v1 too, where an OpenAI client's base URL points.


@router.post("/contexts", response_model=None)
@router.post("/v1/contexts", response_model=None)
async def create_context(
    body: ContextRequest, gateway: GatewayDep, tenant: TenantDep, http: Request
) -> dict | Response:
    space = tenant.key_space(body.cache_salt)
    created = await serving_contexts.create_context(gateway, body, space, http.is_disconnected)
    return Response(status_code=CLIENT_CLOSED) if created is None else created


# listing, reading and deleting are per tenant; a client's cache_salt only separates stored KV


@router.api_route("/contexts", methods=GET)
@router.api_route("/v1/contexts", methods=GET)
async def list_contexts(gateway: GatewayDep, tenant: TenantDep) -> dict:
    return await serving_contexts.list_contexts(gateway, tenant.key_space(None))


@router.api_route("/contexts/{context_id}", methods=GET)
@router.api_route("/v1/contexts/{context_id}", methods=GET)
async def get_context(context_id: str, gateway: GatewayDep, tenant: TenantDep) -> dict:
    return await serving_contexts.get_context(gateway, context_id, tenant.key_space(None))


@router.delete("/contexts/{context_id}")
@router.delete("/v1/contexts/{context_id}")
async def delete_context(context_id: str, gateway: GatewayDep, tenant: TenantDep) -> dict:
    return await serving_contexts.delete_context(gateway, context_id, tenant.key_space(None))


@router.post("/tokenize")
async def tokenize(body: TokenizeRequest, gateway: GatewayDep) -> dict:
    return serving_tokens.tokenize(gateway, body)


@router.post("/detokenize")
async def detokenize(body: DetokenizeRequest, gateway: GatewayDep) -> dict:
    return serving_tokens.detokenize(gateway, body)


@router.api_route("/health", methods=GET)
async def health(request: Request) -> dict:
    """200 while the process serves: ``"status": "loading"`` until the gateway is built, then ``ok``."""
    gateway = request.app.state.gateway
    if gateway is None:
        return {"status": "loading"}
    return {
        "status": "ok",
        "model": gateway.model_name,
        "device": str(gateway.runner.device),
        "dtype": str(gateway.runner.loaded.dtype).removeprefix("torch."),
        "weights_dtype": "bfloat16" if gateway.runner.loaded.bf16_weights else None,
        # prompts' attention, where it differs from ``dtype`` (bf16 weights on AMX)
        "prompt_attention_dtype": "bfloat16" if gateway.runner.loaded.bf16_attention else None,
        "mlp_activation_dtype": "bfloat16" if gateway.runner.loaded.bf16_mlp else None,
        "in_flight": gateway.admission.admitted,
    }


@router.api_route("/ready", methods=GET, response_model=None)
async def ready(readiness: ReadinessDep, request: Request) -> JSONResponse:
    """200 when the gateway can serve; 503, naming the part that cannot, when it cannot."""
    if readiness is None:  # still starting, or its start-up failed
        starter = request.app.state.startup
        model = f"failed: {starter.error}" if starter is not None and starter.error else "loading"
        return JSONResponse(ReadinessReport(model=model, store="not opened yet").body(), status_code=503)
    report = await readiness.report()
    return JSONResponse(report.body(), status_code=200 if report.ready else 503)


# What a router asks of its workers (vllm-router, sglang-router): app/serving_worker.py


@router.post("/v1/completions/render")
async def render_completion(body: CompletionRequest, gateway: GatewayDep) -> dict:
    return serving_worker.render_completion(gateway, body)


@router.post("/v1/chat/completions/render")
async def render_chat(body: ChatCompletionRequest, gateway: GatewayDep) -> dict:
    return serving_worker.render_chat(gateway, body)


@router.api_route("/get_load", methods=GET)
async def get_load(gateway: GatewayDep) -> dict:
    return serving_worker.load(gateway)


@router.api_route("/get_model_info", methods=GET)
async def get_model_info(gateway: GatewayDep) -> dict:
    return serving_worker.model_info(gateway)


@router.api_route("/get_server_info", methods=GET)
async def get_server_info(gateway: GatewayDep) -> dict:
    return serving_worker.server_info(gateway, package_version())


@router.api_route("/version", methods=GET)
async def version() -> dict:
    return {"version": package_version()}


@router.api_route("/metrics", methods=GET)
async def metrics(request: Request) -> Response:
    registry = request.app.state.metrics.registry  # there from the start, before the gateway
    return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)


@functools.cache
def package_version() -> str:
    try:
        return metadata.version(PACKAGE)
    except metadata.PackageNotFoundError:  # run from a checkout that was never installed
        return "0.0.0"
