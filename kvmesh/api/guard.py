"""The head's front door (ASGI middleware), checked before any route runs.

- Who: the request's :class:`~kvmesh.api.credentials.Identity` is decided here,
  once (:meth:`Credentials.identify`), and put in ``scope["state"]["identity"]``
  for every route to read (:func:`identity_of`); credentials it refuses are a
  400 or 401 before any route runs. A path that ``protected`` names needs a key
  (``Authorization: Bearer KEY`` as vLLM's ``--api-key``, or ``X-API-Key``).
- Body size: a request body larger than ``max_body_bytes`` is a 413, decided from
  its ``Content-Length`` before a byte is buffered, or as soon as a chunked body
  passes the cap. Nothing larger is held in memory; the rest of a refused body
  is read and dropped (up to a bound) so that the client sees the answer.

Every refusal has an OpenAI-style error body.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable, Coroutine
from typing import Any

from fastapi.routing import APIRoute
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from .credentials import ANONYMOUS, BadCredentials, Credentials, Identity, Role

DRAIN_MIN = 16 << 20
INLINE_JSON_BYTES = 64 << 10  # a larger body is parsed on a thread, not the event loop
INVALID_KEY = "a valid API key is required (Authorization: Bearer KEY or X-API-Key)"


def error_body(
    message: str, type_: str, code: str | None = None, param: str | None = None
) -> bytes:
    err = {"message": message, "type": type_, "param": param, "code": code}
    return json.dumps({"error": err}).encode()


def too_large(limit: int) -> str:
    return f"the request body is larger than this server accepts ({limit} bytes)"


class Guard:
    def __init__(
        self,
        app: ASGIApp,
        credentials: Credentials,
        protected: Callable[[str], bool],
        max_body_bytes: int,
    ) -> None:
        self.app = app
        self.credentials = credentials
        self.protected = protected
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        length = headers.get("content-length", "")
        client = scope.get("client")
        try:
            who = self.credentials.identify(scope["headers"], client[0] if client else None)
        except BadCredentials as e:
            kind = "authentication_error" if e.status == 401 else "invalid_request_error"
            extra = {"www-authenticate": "Bearer"} if e.status == 401 else {}
            body = error_body(e.message, kind, e.code, e.param)
            await self._refuse(receive, send, e.status, body, length, extra)
            return
        scope.setdefault("state", {})["identity"] = who
        if self.protected(scope["path"]) and who.role is Role.ANONYMOUS:
            body = error_body(INVALID_KEY, "authentication_error", "invalid_api_key")
            await self._refuse(receive, send, 401, body, length, {"www-authenticate": "Bearer"})
        elif length.isdigit() and int(length) > self.max_body_bytes:
            msg = too_large(self.max_body_bytes)
            body = error_body(msg, "invalid_request_error", "body_too_large")
            await self._refuse(receive, send, 413, body, length, {})
        else:
            await self.app(scope, self._capped(receive), send)

    @property
    def drain_limit(self) -> int:
        """Bytes of a refused body read and dropped before answering, so the client
        reads the answer instead of a connection reset; a larger body gets the reset."""
        return max(4 * self.max_body_bytes, DRAIN_MIN)

    async def _refuse(
        self,
        receive: Receive,
        send: Send,
        status: int,
        body: bytes,
        length: str,
        extra: dict[str, str],
    ) -> None:
        if not length.isdigit() or int(length) <= self.drain_limit:  # chunked: drop up to the limit
            await _discard(receive, self.drain_limit)
        await _send(send, status, body, {**extra, "connection": "close"})

    def _capped(self, receive: Receive) -> Receive:
        seen = 0
        limit = self.max_body_bytes

        async def capped() -> Message:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > limit:  # a chunked body: stop buffering, drop the rest, refuse
                    if message.get("more_body"):
                        await _discard(receive, self.drain_limit - seen)
                    raise HTTPException(413, too_large(limit), {"connection": "close"})
            return message

        return capped


def identity_of(request: Request) -> Identity:
    """The identity the guard decided for ``request`` (anonymous if it did not run)."""
    return getattr(request.state, "identity", ANONYMOUS)


async def _discard(receive: Receive, budget: int) -> None:
    """Read and drop the request body, at most ``budget`` bytes of it."""
    while budget > 0:
        message = await receive()
        if message["type"] != "http.request":
            return
        budget -= len(message.get("body", b""))
        if not message.get("more_body"):
            return


async def _send(send: Send, status: int, body: bytes, extra: dict[str, str]) -> None:
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    headers += [(k.encode(), v.encode()) for k, v in extra.items()]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


class _OffLoopRequest(Request):
    async def json(self) -> Any:
        if not hasattr(self, "_json"):
            body = await self.body()
            small = len(body) <= INLINE_JSON_BYTES
            self._json = json.loads(body) if small else await asyncio.to_thread(json.loads, body)
        return self._json


class BodyOffLoop(APIRoute):
    """A route whose JSON body, when large, is parsed on a thread: a 4 MB body
    never stalls the event loop (health checks, other streams) while it parses."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def run(request: Request) -> Response:
            return await handler(_OffLoopRequest(request.scope, request.receive))

        return run
