"""What a router asks of its workers: token ids, load, server and model info (docs/scaleout.md).

- ``POST /v1/completions/render`` and ``/v1/chat/completions/render`` answer the token ids a
  request would be served with (``{"token_ids": [...]}``, as vLLM's render endpoints).
  vllm-router's ``cache_aware`` policy matches prompts by token ids and asks every worker on
  every request; on a 404 it falls back to ``/tokenize``, one more round trip.
- ``GET /get_load`` (an integer ``load``) feeds the router's ``/get_loads`` view and its
  ``power_of_two`` policy; ``/get_server_info`` and ``/get_model_info`` are forwarded to a
  worker when a client asks the router. Names and fields follow SGLang's server, which these
  routers were first written against; ``replica`` says which gateway answered.
"""

from __future__ import annotations

from typing import Any

from app.gateway import Gateway
from app.protocol import ChatCompletionRequest, CompletionRequest
from app.serving_completions import prompt_ids


def load(gateway: Gateway) -> dict[str, Any]:
    """Requests in flight (``load``: loading, waiting or running), and of those the running ones."""
    in_flight = gateway.admission.admitted
    running = gateway.loop.running
    return {
        "load": in_flight,
        "num_reqs": running,
        "num_waiting_reqs": max(0, in_flight - running),
        "kv_memory_used_bytes": gateway.memory.used,
        "replica": gateway.settings.replica,
    }


def model_info(gateway: Gateway) -> dict[str, Any]:
    return {"model_path": gateway.model_name, "tokenizer_path": gateway.model_name, "is_generation": True}


def server_info(gateway: Gateway, version: str) -> dict[str, Any]:
    """How this gateway serves: no secrets, no store address."""
    s = gateway.settings
    return {
        "version": version,
        "replica": s.replica,
        "served_model_name": gateway.model_name,
        "max_model_len": gateway.max_context,
        "max_num_seqs": s.max_num_seqs,
        "max_queue": s.max_queue,
        "chunk_size": s.chunk_size,
        "kv_memory_bytes": s.kv_memory_bytes,
        "prefix_cache": s.prefix_cache,
        "write_back": s.write_back,
        "device": str(gateway.runner.device),
        "dtype": str(gateway.runner.loaded.dtype).removeprefix("torch."),
        "load": load(gateway),
    }


def render_completion(gateway: Gateway, request: CompletionRequest) -> dict[str, Any]:
    gateway.check_model(request.model)
    return {"token_ids": prompt_ids(gateway, request)}


def render_chat(gateway: Gateway, request: ChatCompletionRequest) -> dict[str, Any]:
    gateway.check_model(request.model)
    return {"token_ids": gateway.chat_token_ids(request.messages, add_generation_prompt=True)}
