"""A chat message's ``image_url`` content parts, as OpenAI's API writes them.

Only ``data:`` URLs are taken (base64, an ``image/*`` media type): a head never
fetches from the network on a client's behalf. Sizes are checked before anything
is decoded: at most :data:`MAX_IMAGES` images per request, each URL at most what
:data:`~kvmesh.engine.vision.MAX_IMAGE_BYTES` encodes to. Every refusal is a 400
naming ``messages``.
"""

from __future__ import annotations

import base64
import binascii
from collections.abc import Callable
from typing import Any

from ..engine.vision import MAX_IMAGE_BYTES, BadImage, Picture
from .errors import APIError

MAX_IMAGES = 32  # per request
_MAX_URL_CHARS = (MAX_IMAGE_BYTES + 2) // 3 * 4 + 256


def _refuse(message: str, code: str = "invalid_image") -> APIError:
    return APIError(400, message, param="messages", code=code)


def image_url_bytes(part: dict[str, Any]) -> bytes:
    """The image file bytes of one ``{"type": "image_url", "image_url": ...}`` part
    (``image_url`` an object with ``url``, or the URL itself)."""
    ref = part.get("image_url")
    url = ref.get("url") if isinstance(ref, dict) else ref
    if not isinstance(url, str) or not url:
        raise _refuse("an image_url part needs image_url.url")
    if len(url) > _MAX_URL_CHARS:
        raise _refuse(f"an image is larger than {MAX_IMAGE_BYTES} bytes")
    if not url.startswith("data:"):
        raise _refuse(
            "only data: URLs are accepted for images (base64); this head fetches nothing",
            code="unsupported_image_url",
        )
    head, comma, body = url[5:].partition(",")
    kind, *params = head.split(";")
    if not comma or "base64" not in params or not kind.startswith("image/"):
        raise _refuse("an image data: URL is data:image/<type>;base64,<data>")
    try:
        return base64.b64decode(body, validate=True)
    except (binascii.Error, ValueError):
        raise _refuse("an image data: URL holds invalid base64") from None


def image_reader(
    vision: Any, tokenizer: Any, into: list[Picture], root: bytes | None
) -> Callable[[dict[str, Any]], str]:
    """What an ``image_url`` part becomes in a chat's rendered text: ``vision``'s
    image placeholder (``vision`` None: the model takes no images, a 400), its
    processed picture (the chain ``root``'s own) appended to ``into``."""

    def read(part: dict[str, Any]) -> str:
        if vision is None:
            raise _refuse("this model takes no images")
        if len(into) >= MAX_IMAGES:
            raise _refuse(f"at most {MAX_IMAGES} images per request")
        try:
            into.append(vision.picture(image_url_bytes(part), root))
        except BadImage as e:
            raise _refuse(str(e)) from None
        return str(vision.text(tokenizer))

    return read


def expand_pictures(vision: Any, tokens: list[int], pictures: list[Picture]) -> list[int]:
    """``tokens`` with each picture's placeholder widened to its media token ids."""
    if vision is None:
        return tokens
    try:
        return list(vision.expand(tokens, pictures))
    except ValueError as e:  # e.g. the placeholder typed as text
        raise _refuse(str(e)) from None
