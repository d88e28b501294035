"""The credential a client presented on an HTTP request (no checking here: see
:class:`kvmesh.api.network.APIKeys`). A leaf module, so the OpenAI routes and the
network routes both read keys the same way without importing each other."""

from __future__ import annotations

from collections.abc import Mapping


def presented_key(headers: Mapping[str, str]) -> str | None:
    """The key a client presented: ``X-API-Key``, else ``Authorization: Bearer``."""
    key = headers.get("x-api-key")
    if key:
        return key
    auth = headers.get("authorization", "")
    return auth[7:].strip() if auth.lower().startswith("bearer ") else None


__all__ = ["presented_key"]
