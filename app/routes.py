"""HTTP routes: thin; each hands a validated request to its serving module."""

from __future__ import annotations

import functools
from importlib import metadata
from typing import Annotated

from fastapi import APIRouter, Depends, Request, Response
from fastapi.responses import JSONResponse, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from app import serving_chat, serving_completions, serving_contexts, serving_tokens
from app.gateway import Gateway
from app.protocol import ChatCompletionRequest, CompletionRequest, ContextRequest, now
from app.readiness import Readiness
from app.serving_tokens import DetokenizeRequest, TokenizeRequest

PACKAGE = "cachegen-gateway"


def _gateway(request: Request) -> Gateway:
    return request.app.state.gateway


def _readiness(request: Request) -> Readiness:
    return request.app.state.readiness


GatewayDep = Annotated[Gateway, Depends(_gateway)]
ReadinessDep = Annotated[Readiness, Depends(_readiness)]

router = APIRouter()


@router.post("/v1/chat/completions", response_model=None)
async def chat_completions(
    body: ChatCompletionRequest, gateway: GatewayDep, http: Request
) -> JSONResponse | StreamingResponse | Response:
    return await serving_chat.chat_completion(gateway, body, http.is_disconnected)


@router.post("/v1/completions", response_model=None)
async def completions(
    body: CompletionRequest, gateway: GatewayDep, http: Request
) -> JSONResponse | StreamingResponse | Response:
    return await serving_completions.completion(gateway, body, http.is_disconnected)


@router.get("/v1/models")
async def models(gateway: GatewayDep) -> dict:
    return {
        "object": "list",
        "data": [
            {
                "id": gateway.model_name,
                "object": "model",
                "created": now(),
                "owned_by": "cachegen",
                "max_model_len": gateway.max_context,
            }
        ],
    }


@router.post("/contexts")
async def create_context(body: ContextRequest, gateway: GatewayDep) -> dict:
    return await serving_contexts.create_context(gateway, body)


@router.get("/contexts")
async def list_contexts(gateway: GatewayDep) -> dict:
    return await serving_contexts.list_contexts(gateway)


@router.get("/contexts/{context_id}")
async def get_context(context_id: str, gateway: GatewayDep) -> dict:
    return await serving_contexts.get_context(gateway, context_id)


@router.delete("/contexts/{context_id}")
async def delete_context(context_id: str, gateway: GatewayDep) -> dict:
    return await serving_contexts.delete_context(gateway, context_id)


@router.post("/tokenize")
async def tokenize(body: TokenizeRequest, gateway: GatewayDep) -> dict:
    return serving_tokens.tokenize(gateway, body)


@router.post("/detokenize")
async def detokenize(body: DetokenizeRequest, gateway: GatewayDep) -> dict:
    return serving_tokens.detokenize(gateway, body)


@router.get("/health")
async def health(gateway: GatewayDep) -> dict:
    return {"status": "ok", "model": gateway.model_name, "in_flight": gateway.admission.admitted}


@router.get("/ready", response_model=None)
async def ready(readiness: ReadinessDep) -> JSONResponse:
    """200 when the gateway can serve; 503, naming the part that cannot, when it cannot."""
    report = await readiness.report()
    return JSONResponse(report.body(), status_code=200 if report.ready else 503)


@router.get("/version")
async def version() -> dict:
    return {"version": package_version()}


@router.get("/metrics")
async def metrics(gateway: GatewayDep) -> Response:
    return Response(generate_latest(gateway.metrics.registry), media_type=CONTENT_TYPE_LATEST)


@functools.cache
def package_version() -> str:
    try:
        return metadata.version(PACKAGE)
    except metadata.PackageNotFoundError:  # run from a checkout that was never installed
        return "0.0.0"
