"""Images through ``vllm serve`` with the connector (needs ``.venv-vllm``).

A request's multimodal items are keyed by their placeholder spans and vLLM's own
hash of each item (``kvmesh.vllm.spec.Scope``): server A answers a chat message
with an image (an ``image_url`` data URL, as clients send it) and publishes its
pages; a fresh server B gets the whole prompt's pages from the mesh with the
tokens and log-probabilities of A's own prefix-cache hit, bit for bit, while the
same text with that image changed in one pixel, or with no image, finds nothing
(the zoo's BLIP-2 puts its 32 image tokens first, so every page overlaps the image).
"""

from __future__ import annotations

import base64
import io

import pytest

pytest.importorskip(
    "vllm",
    reason="needs vLLM: tests/vllm/setup_venv.sh, then .venv-vllm/bin/python -m pytest tests/vllm",
)

from .. import zoo  # noqa: E402
from ..procs import Peer  # noqa: E402
from .serve import APIServer  # noqa: E402

BLOCK = 128  # vLLM's CPU page
TEXT = "Describe what the picture shows, then list the colours in it. " * 24


def image_url(flip: bool = False) -> dict:
    """A seeded 32x32 PNG as a data URL; ``flip``: one bit of one pixel changed."""
    import numpy as np
    from PIL import Image

    pixels = np.random.default_rng(7).integers(0, 256, (32, 32, 3), dtype=np.uint8)
    if flip:
        pixels[5, 9, 1] ^= 1
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="PNG")
    url = "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
    return {"type": "image_url", "image_url": {"url": url}}


def test_an_image_prompt_is_shared_for_that_image_only(tmp_path):
    model = str(zoo.blip2_model())
    text = {"type": "text", "text": TEXT}
    args = ("--limit-mm-per-prompt", '{"image": 1}')
    peer = Peer(alias="cache", log_dir=tmp_path)
    try:
        conn = {"seed": peer.address}
        with APIServer(model, conn, tmp_path / "a.log", *args, max_model_len=1024) as srv:
            cold = srv.chat([image_url(), text])
            again = srv.chat([image_url(), text])  # vLLM's own prefix-cache hit
        with APIServer(model, conn, tmp_path / "b.log", *args, max_model_len=1024) as srv:
            warm = srv.chat([image_url(), text])
            flipped = srv.chat([image_url(flip=True), text])
            bare = srv.chat([text])
    finally:
        peer.kill()
    assert cold[2] == 0 and cold[3]["loaded"] == 0
    pages = again[2] // BLOCK
    assert again[3] is None and pages >= 2 and again[2] == pages * BLOCK
    assert warm[3]["source"] == "remote" and warm[3]["loaded"] == pages, warm[3]
    assert warm[2] == again[2]
    assert warm[:2] == again[:2]  # tokens and log-probabilities, bit for bit
    for miss in (flipped, bare):  # another image, or none: not one page of it
        assert miss[2] == 0 and miss[3]["pages"] == miss[3]["loaded"] == 0, miss[3]
