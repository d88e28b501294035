"""Images through ``vllm serve`` with the connector (needs ``.venv-vllm``).

A request's multimodal items are keyed by their placeholder spans and vLLM's own
hash of each item (``kvmesh.vllm.spec.Scope``): server A answers chat messages
with images (``image_url`` data URLs, as clients send them), four at once, and
publishes their pages; a fresh server B, asked for the four at once, then for the
same text with one of the images changed in one pixel and with no image, gets
each prompt's pages from the mesh (the same tokens as A's; asked again alone, from
those pages, the tokens and log-probabilities of A's own prefix-cache hit, bit for
bit: vLLM's batched steps round otherwise than lone ones), and the other two find
nothing (the zoo's
BLIP-2 puts its 32 image tokens first, so every page overlaps the image).
"""

from __future__ import annotations

import base64
import io
from concurrent.futures import ThreadPoolExecutor

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


def image_url(seed: int, flip: bool = False) -> dict:
    """A seeded 32x32 PNG as a data URL; ``flip``: one bit of one pixel changed."""
    import numpy as np
    from PIL import Image

    pixels = np.random.default_rng(seed).integers(0, 256, (32, 32, 3), dtype=np.uint8)
    if flip:
        pixels[5, 9, 1] ^= 1
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="PNG")
    url = "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
    return {"type": "image_url", "image_url": {"url": url}}


def at_once(srv: APIServer, contents: list[list[dict]]) -> list[tuple]:
    """The chats sent together (vLLM schedules them in the same steps)."""
    with ThreadPoolExecutor(len(contents)) as pool:
        return list(pool.map(srv.chat, contents))


def test_image_prompts_are_shared_for_their_own_image_only(tmp_path):
    """Four images served at once by A, then fetched at once by B, then a changed
    image and no image: each gets its own pages, bit for bit, never another's."""
    model = str(zoo.blip2_model())
    text = {"type": "text", "text": TEXT}
    args = ("--limit-mm-per-prompt", '{"image": 1}')
    seeds = range(4)
    peer = Peer(alias="cache", log_dir=tmp_path)
    try:
        conn = {"seed": peer.address}
        with APIServer(model, conn, tmp_path / "a.log", *args, max_model_len=1024) as srv:
            cold = at_once(srv, [[image_url(s), text] for s in seeds])
            again = [srv.chat([image_url(s), text]) for s in seeds]  # vLLM's own cache hits
        with APIServer(model, conn, tmp_path / "b.log", *args, max_model_len=1024) as srv:
            # the four first, at once: a miss computed among them would teach B's planner
            # that this tiny model prefills in a blink, and a loaded machine's fetch can
            # then lose to computing (rightly, and no page would be loaded to compare)
            warm = at_once(srv, [[image_url(s), text] for s in seeds])
            flipped, bare = at_once(srv, [[image_url(0, flip=True), text], [text]])
            # alone, from the pages it fetched (vLLM's own cache now): A's lone hit exactly
            fetched = [srv.chat([image_url(s), text]) for s in seeds]
    finally:
        peer.kill()
    pages = again[0][2] // BLOCK
    assert pages >= 2 and again[0][2] == pages * BLOCK
    for c, a, w, f in zip(cold, again, warm, fetched, strict=True):
        assert c[2] == 0 and c[3]["loaded"] == 0
        assert a[3] is None and a[2] == pages * BLOCK
        assert w[3]["source"] == "remote" and w[3]["loaded"] == pages, w[3]
        assert w[2] == a[2] and w[0] == a[0]  # batched with three others: the same tokens
        assert f[3] is None and f[2] == a[2]
        assert f[:2] == a[:2]  # tokens and log-probabilities, bit for bit
    assert len({str(a[1]) for a in again}) == len(seeds)  # each image's own answer
    for miss in (flipped, bare):  # another image, or none: not one page of it
        assert miss[2] == 0 and miss[3]["pages"] == miss[3]["loaded"] == 0, miss[3]
