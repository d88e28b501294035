"""OpenAI-style error bodies: ``{"error": {"message", "type", "param", "code"}}``.

A handler raises :class:`APIError` (the app turns it into its response); a message
may quote the client's own text, so it is made printable (lone surrogates escaped).
"""

from __future__ import annotations

from collections.abc import Mapping

from fastapi.responses import JSONResponse


class APIError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        type_: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = (
            status,
            message,
            type_,
            param,
            code,
        )
        self.headers = headers  # e.g. a 503's Retry-After

    def response(self) -> JSONResponse:
        return error_response(
            self.status, self.message, self.type, self.param, self.code, self.headers
        )


def error_response(
    status: int,
    message: str,
    type_: str = "invalid_request_error",
    param: str | None = None,
    code: str | None = None,
    headers: Mapping[str, str] | None = None,
) -> JSONResponse:
    message = printable(message)  # it may quote the client's own (broken) text
    body = {"error": {"message": message, "type": type_, "param": param, "code": code}}
    return JSONResponse(body, status_code=status, headers=headers)


def printable(text: str) -> str:
    return text.encode("utf-8", "backslashreplace").decode("utf-8")
