"""ASGI middleware in front of the routes: the API key (vLLM's ``--api-key``) and the request body's size limit
(``--max-request-bytes``), each answering with an OpenAI-style error body before FastAPI parses anything."""

from __future__ import annotations

import hmac
import json
from http import HTTPStatus

from moetide.serve.protocol import error_body


class ApiKey:
    """ASGI middleware: with an API key, every ``/v1`` route needs ``Authorization: Bearer <key>``, or it is
    answered 401 with an OpenAI error body before the body is parsed (vLLM's ``--api-key``); ``/health`` and
    ``/metrics`` stay open, as in vLLM. The comparison takes the same time whatever the key sent."""

    def __init__(self, app, key: str) -> None:
        self.app, self._expected = app, f"Bearer {key}".encode()

    async def __call__(self, scope, receive, send):
        path = scope.get("path", "")
        if scope["type"] != "http" or not (path == "/v1" or path.startswith("/v1/")):
            return await self.app(scope, receive, send)
        given = dict(scope.get("headers") or ()).get(b"authorization", b"")
        if hmac.compare_digest(given, self._expected):
            return await self.app(scope, receive, send)
        await _drain(receive)
        await _send_error(send, "Incorrect or missing API key: send the server's key as 'Authorization: Bearer "
                                "<key>'", HTTPStatus.UNAUTHORIZED)


class BodyLimit:
    """ASGI middleware: a request body past ``max_bytes`` (by its Content-Length, or counted as it streams in) is
    answered 413 with an OpenAI error body before anything parses it, so one huge prompt cannot take the server's
    memory or time."""

    def __init__(self, app, max_bytes: int) -> None:
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        length = dict(scope.get("headers") or ()).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_bytes:
            await _drain(receive)  # read and drop it, so the client gets the answer rather than a broken pipe
            return await self._refuse(send)
        seen = 0

        async def counted():
            nonlocal seen
            message = await receive()
            seen += len(message.get("body", b""))
            if seen > self.max_bytes:
                raise _TooLarge()
            return message

        try:
            await self.app(scope, counted, send)
        except _TooLarge:
            await _drain(receive)
            await self._refuse(send)

    async def _refuse(self, send) -> None:
        await _send_error(send, f"the request body is larger than this server's limit of {self.max_bytes:,} bytes "
                                f"(--max-request-bytes)", HTTPStatus.REQUEST_ENTITY_TOO_LARGE)


async def _send_error(send, message: str, status: HTTPStatus) -> None:
    """An OpenAI error body sent straight from a middleware, before any route ran."""
    body = json.dumps(error_body(message, status)).encode()
    await send({"type": "http.response.start", "status": int(status),
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})


class _TooLarge(Exception):
    pass


async def _drain(receive) -> None:
    """Read the rest of a request body and keep none of it."""
    while True:
        message = await receive()
        if message.get("type") != "http.request" or not message.get("more_body"):
            return
