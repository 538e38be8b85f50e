"""The request body limit (``CACHEGEN_MAX_BODY_BYTES``): 413 beyond it, read or declared.

A plain ASGI middleware: a declared ``Content-Length`` over the limit is
refused before anything is read; a chunked body is counted as it arrives and
refused as soon as it passes the limit, so no request can make the gateway
buffer more than the limit.
"""

from __future__ import annotations

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from app.errors import APIError, error_response


class BodyTooLarge(APIError):
    status = 413
    code = "request_too_large"


class BodyLimit:
    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    def _error(self) -> BodyTooLarge:
        return BodyTooLarge(
            f"request body exceeds {self.max_bytes} bytes (CACHEGEN_MAX_BODY_BYTES)", code="request_too_large"
        )

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            await error_response(self._error())(scope, receive, send)
            return
        received = 0
        started = False

        async def counting_receive() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    raise self._error()
            return message

        async def tracking_send(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, counting_receive, tracking_send)
        except BodyTooLarge as err:
            if not started:
                await error_response(err)(scope, receive, send)
