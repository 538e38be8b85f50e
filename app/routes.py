"""HTTP routes: thin; each hands a validated request to its serving module."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends, Request, Response
from fastapi.responses import JSONResponse, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from app import serving_chat, serving_completions, serving_contexts
from app.gateway import Gateway
from app.protocol import ChatCompletionRequest, CompletionRequest, ContextRequest, now


def _gateway(request: Request) -> Gateway:
    return request.app.state.gateway


GatewayDep = Annotated[Gateway, Depends(_gateway)]

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


@router.get("/health")
async def health(gateway: GatewayDep) -> dict:
    return {"status": "ok", "model": gateway.model_name, "in_flight": gateway.admission.admitted}


@router.get("/metrics")
async def metrics(gateway: GatewayDep) -> Response:
    return Response(generate_latest(gateway.metrics.registry), media_type=CONTENT_TYPE_LATEST)
