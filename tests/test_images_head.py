"""Images on the head: ``image_url`` content parts on a LLaVA (``demo-vl-tiny``), on
Gemma 4 (the zoo's, with its image processor), causal over pictures and attending
both ways within them (``use_bidirectional_attention: "vision"``), on Gemma 3
(the zoo's, both ways within pictures on every layer), and on Qwen2.5-VL, Qwen3-VL and
Qwen3.5 (the zoo's, 3-D rotary positions: M-RoPE; Qwen3.5 a hybrid), whose
positions in every forward (one row or a batch's, prefill or decode) are the
model's own count over the whole sequence.

Engine: a prompt's image positions hold media token ids; its forward (whole, or
in chunks: inside the image where attention is causal, at its edges where it goes
both ways) is the model's own forward with ``pixel_values``; keys see
the pixels (one pixel changed moves every key from the image's first block on and
none before), a prefix cut inside an image keys its blocks as the whole prompt
does, and a forgotten item keys as nothing else.

Head processes with a real peer: the same image and text after a restart is a
remote hit for the whole prompt, tokens and log-probabilities identical to the
cold answer, with no encoder run; one pixel changed reuses nothing past the text
before the image; many concurrent requests with different images each get the
answer they get alone; bad image input is a 400 that leaves the head serving.
"""

from __future__ import annotations

import base64
import concurrent.futures
import dataclasses
import io
import json
import threading
from pathlib import Path

import numpy as np
import pytest
import torch

from kvmesh.blocks import MEDIA_BASE, BlockKeyer, MediaIds, MediaItem
from kvmesh.engine import Decoded, Sampling
from kvmesh.engine.hf import TransformersEngine
from kvmesh.errors import ConfigError
from kvmesh.runtime.audit import Auditor
from kvmesh.runtime.batch import BatchRunner, Job, PrefillPlan

from . import zoo
from .helpers import assert_whole_remote_hit, wait_for
from .procs import Peer
from .test_api import Head

MODEL = "demo-vl-tiny"
BEFORE = "A long stretch of text that comes before the picture, shared by all. " * 3
AFTER = " What is in the picture, in one word?"


def png(seed: int, touch: tuple[int, int] | None = None, size: tuple[int, int] = (40, 50)) -> bytes:
    """A seeded RGB picture of ``size`` (height, width) as PNG; ``touch``: that one
    pixel changed."""
    pixels = (np.random.default_rng(seed).random((*size, 3)) * 255).astype("uint8")
    if touch is not None:
        pixels[touch] = 255 - pixels[touch]
    out = io.BytesIO()
    from PIL import Image

    Image.fromarray(pixels).save(out, "PNG")
    return out.getvalue()


def bmp() -> bytes:
    from PIL import Image

    out = io.BytesIO()
    Image.new("RGB", (8, 8)).save(out, "BMP")
    return out.getvalue()


def data_url(data: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(data).decode()


def messages(*images: bytes) -> list[dict]:
    parts = [{"type": "text", "text": BEFORE}]
    parts += [{"type": "image_url", "image_url": {"url": data_url(i)}} for i in images]
    return [{"role": "user", "content": [*parts, {"type": "text", "text": AFTER}]}]


def model_path(name: str) -> str:
    """A model the head serves with images: the embedded LLaVA, or the zoo's Gemma 3
    or Gemma 4 (causal over pictures, or ``BIDIR``)."""
    from kvmesh.engine.embedded import ensure_demo

    if name == MODEL:
        return str(ensure_demo(MODEL))
    if name == "gemma3":
        return str(zoo.gemma3_vision_model())
    if name == QWEN:
        return str(zoo.qwen2_5_vl_model())
    if name == QWEN35:
        return str(zoo.qwen3_5_vision_model())
    if name == QWEN3:
        return str(zoo.qwen3_vl_model())
    return str(zoo.gemma4_vision_model(bidirectional=name == BIDIR))


BIDIR = "gemma4-bidir"  # its sliding layers attend both ways within a picture
QWEN = "qwen2_5_vl"  # positions in 3-D (M-RoPE)
QWEN35 = "qwen3_5"  # M-RoPE over gated DeltaNet and attention layers (a hybrid)
QWEN3 = "qwen3_vl"  # M-RoPE interleaved, and the encoder feeds early layers too (deepstack)
# Gemma 3: both ways within a picture, every layer
MODELS = [MODEL, "gemma4", BIDIR, "gemma3", QWEN, QWEN35, QWEN3]
MARKS = {
    MODEL: "<image>",
    "gemma4": "<|image|>",
    BIDIR: "<|image|>",
    "gemma3": "<image_soft_token>",
    QWEN: "<|image_pad|>",
    QWEN35: "<|image_pad|>",
    QWEN3: "<|image_pad|>",
}


@pytest.fixture(scope="module", params=MODELS)
def engine(request) -> TransformersEngine:
    return TransformersEngine(Path(model_path(request.param)))


def prompt(engine, *images: bytes) -> list[int]:
    mark = engine.tokenizer.convert_ids_to_tokens(engine.vision.placeholder)
    text = BEFORE + mark * len(images) + AFTER
    tokens = engine.encode_chat([{"role": "user", "content": text}])
    return engine.vision.expand(tokens, [engine.vision.picture(i) for i in images])


def own_forward(engine, tokens: list[int], *pictures: bytes) -> torch.Tensor:
    """The last logits of transformers' own forward of ``tokens`` with the pictures'
    encoder inputs (and, attended both ways or rotated in 3-D, which positions are
    the pictures': the model then counts their positions itself)."""
    plain = torch.tensor([_as_text(engine, tokens)])
    vision = engine.vision
    each = [vision.encoder_inputs(vision.picture(p)) for p in pictures]
    own = {k: torch.cat([e[k] for e in each]) for k in each[0]}
    if vision.bidirectional or vision.mrope:
        own[vision.family.types] = (plain == vision.placeholder).long()
    with torch.inference_mode():
        return engine.model(input_ids=plain, **own).logits[0, -1]


def test_an_image_prompts_forward_is_the_models_own(engine):
    tokens = prompt(engine, png(1))
    ref = own_forward(engine, tokens, png(1))
    whole = engine.prefill(tokens).logits
    assert torch.allclose(whole, ref, atol=1e-4), (whole - ref).abs().max()
    inside = tokens.index(next(t for t in tokens if t >= MEDIA_BASE)) + 5
    state = engine.begin_prefill(tokens)
    first = engine.forward_tokens(tokens, 0, inside)  # five positions into the image
    assert first == (inside - 5 if engine.vision.bidirectional else inside)
    engine.prefill_batch([state], [first])
    engine.prefill_batch([state], [len(tokens) - first])
    assert torch.allclose(state.logits, whole, atol=1e-4)  # another chunking: rounding apart
    other = engine.prefill(prompt(engine, png(2))).logits
    assert (other - whole).abs().max() > 1e-3  # the image is seen


@pytest.mark.parametrize("name", [BIDIR, "gemma3"])
def test_a_picture_attended_both_ways_is_computed_whole_and_reused_inside(name):
    """Gemma 4 with ``use_bidirectional_attention: "vision"`` (its sliding layers) and
    Gemma 3 (every layer): a forward that stopped inside a picture would compute
    other numbers, so none does (chunks move to the picture's start, or through its
    end); reuse that ends inside the picture (a hit up to a block boundary there)
    continues it as a cold prompt computes it."""
    engine = TransformersEngine(Path(model_path(name)))
    assert engine.whole_pictures
    tokens = prompt(engine, png(3))
    start = next(i for i, t in enumerate(tokens) if t >= MEDIA_BASE)
    end = start + engine.vision.picture(png(3)).length
    whole = engine.prefill(tokens).logits
    split = engine.begin_prefill(tokens)  # what a forward stopping inside would compute
    engine.prefill_batch([split], [start + 5])
    engine.prefill_batch([split], [len(tokens) - start - 5])
    assert (split.logits - whole).abs().max() > 1e-3  # (so the rest is not vacuous)
    assert engine.forward_tokens(tokens, 0, start + 5) == start
    assert engine.forward_tokens(tokens, start, 5) == end - start  # starts at it: through it
    assert engine.forward_tokens(tokens, start + 2, 5) == end - start - 2  # within it
    assert engine.forward_tokens(tokens, 0, end + 1) == end + 1  # text: as asked
    chunked = engine.prefill(tokens, chunk=start + 5, between=lambda: None)
    assert torch.allclose(chunked.logits, whole, atol=1e-4)
    other = tokens[:end] + engine.encode(" and something else entirely")
    reused = engine.begin_resume(chunked, start + 7, other)  # 7 positions into the picture
    engine.prefill_batch([reused], [len(other) - reused.cached])
    cold = engine.prefill(other).logits
    assert torch.allclose(reused.logits, cold, atol=1e-4), (reused.logits - cold).abs().max()
    causal = TransformersEngine(Path(model_path("gemma4")))
    assert not causal.whole_pictures
    assert causal.forward_tokens(prompt(causal, png(3)), 0, start + 5) == start + 5
    with pytest.raises(ConfigError, match="both ways"):  # its grid would cut pictures
        TransformersEngine(Path(model_path(name)), deterministic_grid=engine.block_tokens)


def test_an_audit_of_a_block_inside_a_picture_attended_both_ways_computes_it_whole():
    """An honest peer's block that ends inside such a picture passes its audit: the
    recompute runs through the picture's end (stopping at the block's end would
    compute other numbers and quarantine the peer)."""
    engine = TransformersEngine(Path(model_path(BIDIR)))
    tokens = prompt(engine, png(5))
    start = next(i for i, t in enumerate(tokens) if t >= MEDIA_BASE)
    end = start + engine.vision.picture(png(5)).length
    keyer = BlockKeyer(engine.card.namespace, engine.card.block_tokens)
    blocks = engine.export(engine.prefill(tokens), keyer)
    b = engine.card.block_tokens
    index = next(i for i, k in enumerate(blocks) if start < (i + 1) * b < end)  # ends inside
    job = Auditor(1.0).pick(tokens, [(index, blocks[index])], "peer-id", "peer")
    assert job is not None and len(job.tokens) == end
    assert Auditor.agrees(engine, keyer, job) is True
    cut = dataclasses.replace(job, tokens=tuple(tokens[: (index + 1) * b]))
    assert Auditor.agrees(engine, keyer, cut) is False  # what stopping there would say


def test_the_batch_runner_stops_no_forward_inside_a_picture_attended_both_ways():
    engine = TransformersEngine(Path(model_path(BIDIR)))
    tokens = prompt(engine, png(4))
    start = next(i for i, t in enumerate(tokens) if t >= MEDIA_BASE)
    lock = threading.RLock()
    runner = BatchRunner(engine, lock, prefill_chunk=start + 5)  # five into the picture
    try:
        one = Sampling(max_tokens=1, stop_on_eos=False)  # its last token is not forwarded
        plan = lambda: PrefillPlan(engine.begin_prefill(tokens))  # noqa: E731
        job = runner.submit(Job(one, [Decoded()], plan, 1 << 24))
        assert len(list(job.tokens())) == 1
        assert runner.peak_prefill_chunk == start  # the first forward stopped before it
    finally:
        runner.close()
    whole = engine.prefill(tokens).logits
    assert torch.allclose(job.state.logits, whole, atol=1e-4)


def encoded(image, fmt: str = "PNG", **options) -> bytes:
    out = io.BytesIO()
    image.save(out, fmt, **options)
    return out.getvalue()


def odd_pictures() -> dict[str, bytes]:
    """Pictures a client may send that are not plain RGB rectangles."""
    from PIL import Image

    frame = Image.new("P", (40, 30))
    deep = (np.random.default_rng(3).random((30, 40)) * 65535).astype("uint16")
    return {
        "grey": encoded(Image.new("L", (40, 30), 7)),
        "grey+alpha": encoded(Image.new("LA", (40, 30))),
        "palette+transparency": encoded(frame, transparency=0),
        "16-bit": encoded(Image.fromarray(deep)),
        "CMYK JPEG": encoded(Image.new("CMYK", (40, 30)), "JPEG"),
        "RGBA WebP": encoded(Image.new("RGBA", (40, 30)), "WEBP"),
        "GIF of 50 frames": encoded(frame, "GIF", save_all=True, append_images=[frame] * 49),
        "one pixel": encoded(Image.new("RGB", (1, 1))),
        "1x4000": encoded(Image.new("RGB", (1, 4000))),
    }


@pytest.mark.parametrize("name", [QWEN, QWEN35, QWEN3])
def test_qwen_positions_in_3d_are_the_models_own_in_every_forward(name):
    """Qwen2.5-VL rotates by 3-D positions (M-RoPE) that depend on every picture
    before a position; transformers keeps that offset on the model between calls,
    the engine counts each row's from its own sequence. Two prompts, each with two
    pictures of other shapes (so other offsets), prefilled in one batch in chunks that
    cut pictures, then decoded in one batch: each row's logits are transformers' own
    forward of its whole sequence."""
    engine = TransformersEngine(Path(model_path(name)))
    shown = [
        [png(1, size=(24, 64)), png(2, size=(64, 16))],
        [png(3, size=(48, 40)), png(4, size=(16, 56))],
    ]
    prompts = [prompt(engine, *pictures) for pictures in shown]
    vision = engine.vision
    for tokens, pictures in zip(prompts, shown, strict=True):
        plain = torch.tensor([_as_text(engine, tokens)])
        grids = torch.stack([vision.picture(p).inputs["image_grid_thw"] for p in pictures])
        types = (plain == vision.placeholder).long()
        own, _ = engine.model.model.get_rope_index(plain, types, grids)
        assert torch.equal(vision.positions(tokens, 0, len(tokens)), own[:, 0])
    states = [engine.begin_prefill(tokens) for tokens in prompts]
    firsts = [prompts[0].index(first_media_id(prompts[0])) + 7, len(BEFORE) // 9]
    engine.prefill_batch(states, firsts)  # one row stops inside a picture, one before both
    engine.prefill_batch(states, [len(t) - n for t, n in zip(prompts, firsts, strict=True)])
    for state, pictures in zip(states, shown, strict=True):
        assert torch.allclose(state.logits, own_forward(engine, state.tokens, *pictures), atol=1e-4)
    for _ in range(3):
        for state in states:
            state.tokens.append(int(state.logits.argmax()))
        engine.decode_batch(states)
    for state, pictures in zip(states, shown, strict=True):
        assert torch.allclose(state.logits, own_forward(engine, state.tokens, *pictures), atol=1e-4)


def first_media_id(tokens: list[int]) -> int:
    """The first media id of ``tokens``."""
    return next(t for t in tokens if t >= MEDIA_BASE)


def test_odd_pictures_are_served_or_refused_before_any_forward(engine):
    """Every mode and shape is served (a finite forward) or a :class:`BadImage` at
    decoding, never an encoder failure: Gemma 4's vision tower indexes a table of
    patch positions, so a picture too long and thin for it is refused up front, and
    Qwen's processor refuses an aspect over 200."""
    from kvmesh.engine.vision import BadImage

    aspect = "aspect ratio must be smaller"
    refused = {"gemma4": "too long and thin", "qwen2_5_vl": aspect, "qwen3_5": aspect}
    refused["qwen3_vl"] = aspect

    text = BEFORE + engine.tokenizer.convert_ids_to_tokens(engine.vision.placeholder)
    tokens = engine.encode_chat([{"role": "user", "content": text}])
    for name, data in odd_pictures().items():
        try:
            picture = engine.vision.picture(data)
        except BadImage as e:
            why = refused.get(engine.model.config.model_type)
            assert name == "1x4000" and why is not None and why in str(e), (name, e)
            continue
        logits = engine.prefill(engine.vision.expand(tokens, [picture])).logits
        assert torch.isfinite(logits).all(), name


def test_a_gemma3_prompt_tokenizes_as_its_processor_makes_it():
    """Gemma 3's processor widens each picture to ``\\n\\n<boi>`` + soft tokens +
    ``<eoi>\\n\\n`` in the text (``Gemma3Processor.full_image_sequence``); a head's
    prompt for the same chat is those ids, the picture's positions its media ids."""
    engine = TransformersEngine(Path(model_path("gemma3")))
    picture = engine.vision.picture(png(1))
    text = BEFORE + engine.vision.text(engine.tokenizer) + AFTER
    ours = engine.vision.expand(engine.encode_chat([{"role": "user", "content": text}]), [picture])
    boi, eoi, soft = zoo.GEMMA3_IMAGE_TOKENS
    full = f"\n\n{boi}{soft * picture.length}{eoi}\n\n"
    theirs = engine.encode_chat([{"role": "user", "content": BEFORE + full + AFTER}])
    assert _as_text(engine, ours) == theirs
    assert sum(t >= MEDIA_BASE for t in ours) == picture.length == 16


def test_keys_see_the_pixels_and_nothing_before_them(engine):
    keyer = BlockKeyer(engine.card.namespace, 8)
    a, b = prompt(engine, png(1)), prompt(engine, png(1, touch=(3, 4)))
    at = next(i for i, t in enumerate(a) if t >= MEDIA_BASE)
    ka, kb = keyer.keys(a), keyer.keys(b)
    first = at // 8  # the first block holding an image position
    assert ka.blocks[:first] == kb.blocks[:first]
    assert all(x != y for x, y in zip(ka.blocks[first:], kb.blocks[first:], strict=True))
    assert keyer.keys(prompt(engine, png(1))) == ka  # the same image again: the same keys
    cut = keyer.keys(a[: at + 5])  # a prefix ending inside the image
    assert cut.blocks == ka.blocks[: len(cut.blocks)]
    text = keyer.keys(_as_text(engine, a))  # the placeholder ids with no image
    assert text.blocks[:first] == ka.blocks[:first] and text.blocks[first] != ka.blocks[first]


def test_a_picture_is_its_chain_roots_own(engine):
    """A tenant's cache is its own: another root's same picture is another image (its
    encoder output neither reused nor timed across roots), the same root's the same."""
    vision, data = engine.vision, png(21)
    a, b = vision.picture(data, b"a" * 32), vision.picture(data, b"b" * 32)
    assert a.digest != b.digest and vision.picture(data, b"a" * 32).digest == a.digest
    before = vision.encoded
    for picture in (a, b, a):
        text = BEFORE + engine.tokenizer.convert_ids_to_tokens(vision.placeholder)
        tokens = engine.encode_chat([{"role": "user", "content": text}])
        engine.prefill(vision.expand(tokens, [picture]))
    assert vision.encoded - before == 2  # once per root; a's second time from its own cache


def _as_text(engine, tokens: list[int]) -> list[int]:
    """``tokens`` with every media id as the bare placeholder id (no image)."""
    return [engine.vision.placeholder if t >= MEDIA_BASE else t for t in tokens]


def test_an_image_no_longer_held_is_a_clear_error_not_a_wrong_answer():
    from kvmesh.engine.embedded import ensure_demo
    from kvmesh.engine.vision import ImageGone

    engine = TransformersEngine(ensure_demo(MODEL))  # its own stores, shrunk
    engine.vision._pixels.capacity = engine.vision._features.capacity = 1
    first = prompt(engine, png(11))
    prompt(engine, png(12))  # holds picture 12's pixels instead
    with pytest.raises(ImageGone, match="send it again"):
        engine.prefill(first)
    again = prompt(engine, png(11))
    assert again == first  # the same ids: the same picture
    assert torch.isfinite(engine.prefill(again).logits).all()


def test_a_forgotten_item_keys_as_nothing_else():
    ids = MediaIds(capacity=2)
    items = [MediaItem(bytes([i]) * 32, 7, 4) for i in range(3)]
    first = ids.ids(items[0])
    keyer = BlockKeyer(b"n" * 32, 4)
    before = keyer.keys([1, 2, 3, *first]).blocks  # (the process table keys first: a miss)
    spans_then = ids.split([1, *first])[1]
    ids.ids(items[1]), ids.ids(items[2])  # item 0 is forgotten
    spans_now = ids.split([1, *first])[1]
    assert spans_then[0].digest == items[0].digest
    assert spans_now[0].digest not in {i.digest for i in items}
    assert ids.ids(items[0]) != first  # named again: new ids, never the old ones
    assert len(before) == 1


def complete(head: Head, *images: bytes, model: str = MODEL, **extra) -> dict:
    body = {"model": model, "messages": messages(*images), "max_tokens": 6, "temperature": 0}
    body |= {"logprobs": True, "top_logprobs": 2, **extra}
    r = head.http.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    return r.json()


def answer(out: dict) -> tuple:
    c = out["choices"][0]
    return c["message"]["content"], c["logprobs"]


def first_image_position(head: Head, model: str, mark: str, picture: bytes) -> int:
    """Where the picture's first position is in :func:`messages`' prompt (/tokenize:
    the first placeholder id, ``mark``'s)."""
    body = {"model": model, "messages": messages(picture)}
    ids = head.http.post("/tokenize", json=body).json()["tokens"]
    placeholder = head.http.post("/tokenize", json={"model": model, "prompt": mark}).json()
    return ids.index(placeholder["tokens"][-1])


# Across processes: the embedded model and the most particular family (both ways within a
# picture); every family's forward and keys are checked in-process above (the fleet's path is
# one for all, and each head start here costs CI a model load)
@pytest.mark.parametrize("name", [MODEL, BIDIR, QWEN35])
def test_an_image_prompt_is_a_remote_hit_after_a_restart_and_a_pixel_is_a_miss(tmp_path, name):
    model = model_path(name)
    peer = Peer(alias="vl-peer", log_dir=tmp_path)
    picture, touched = png(7), png(7, touch=(20, 30))
    try:
        h1 = Head("--seed", peer.address, "--exact-reuse-by-address", model=model)
        try:
            h1.wait(lambda s: s["peers"] >= 1)
            cold = complete(h1, picture, model=model)
            assert cold["kvmesh"]["source"] == "compute"
            h1.wait(lambda s: s["publish_pending"] == 0)
        finally:
            h1.stop()
        h2 = Head("--seed", peer.address, "--exact-reuse-by-address", model=model)
        try:
            h2.wait(lambda s: s["compatible_peers"] >= 1)
            warm = complete(h2, picture, model=model)
            encoded = h2.metric("kvmesh_images_encoded_total")
            moved = complete(h2, touched, model=model)
            at = first_image_position(h2, model, MARKS[name], picture)
        finally:
            h2.stop()
    finally:
        peer.kill()
    assert_whole_remote_hit(warm, cold, answer)
    assert encoded == 0  # the whole prompt came from the peer: no encoder run
    reused = moved["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert reused <= at, (reused, at)  # at most the text before the image
    # (Gemma 4's sliding layers cannot crop a session back to it: it may reuse none)
    assert reused > 0 or name != MODEL


def logprobs(out: dict) -> np.ndarray:
    """The answer's tokens' log-probabilities and their top two's."""
    rows = out["choices"][0]["logprobs"]["content"]
    return np.array([[t["logprob"]] + [x["logprob"] for x in t["top_logprobs"]] for t in rows])


@pytest.mark.parametrize("name", [MODEL, QWEN])
def test_many_images_at_once_each_get_their_own_answer(name):
    """Sixteen requests at once, eight pictures (of eight shapes: on Qwen eight grids,
    so eight offsets of the 3-D positions after them), batched by the head: each
    answer is the one its request gets alone."""
    model = model_path(name)
    head = Head(model=model)
    try:
        pictures = [png(100 + i, size=(24 + 8 * i, 72 - 6 * i)) for i in range(8)]
        alone = [complete(head, p, model=model) for p in pictures]
        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            both = list(pool.map(lambda p: complete(head, p, model=model), pictures * 2))
    finally:
        head.stop()
    # batched rows compute in another order than a lone one: equal to rounding, while
    # another image's blocks would move them by what separates two images' answers
    apart = min(
        np.abs(logprobs(a) - logprobs(b)).max() for i, a in enumerate(alone) for b in alone[:i]
    )
    for got, want in zip(both, alone * 2, strict=True):
        assert got["choices"][0]["message"] == want["choices"][0]["message"]
        assert np.abs(logprobs(got) - logprobs(want)).max() < min(1e-3, apart / 10), apart


def test_bad_images_are_400s_and_the_head_goes_on():
    head = Head(model=MODEL)
    text = Head(model="demo-tiny")
    try:
        cases = [
            ({"url": "https://example.com/cat.png"}, "unsupported_image_url"),
            ({"url": "data:image/png;base64,!!!"}, "invalid_image"),
            ({"url": "data:text/plain;base64,aGk="}, "invalid_image"),
            ({"url": data_url(b"\x89PNG\r\n\x1a\nnot really")}, "invalid_image"),
            ({"url": data_url(png(1)[:60])}, "invalid_image"),  # truncated
            ({"url": data_url(bmp())}, "invalid_image"),  # a format OpenAI does not take
            ({}, "invalid_image"),
        ]
        for image_url, code in cases:
            content = [{"type": "image_url", "image_url": image_url}]
            body = {"model": MODEL, "messages": [{"role": "user", "content": content}]}
            r = head.http.post("/v1/chat/completions", json=body)
            assert r.status_code == 400 and r.json()["error"]["code"] == code, (image_url, r.text)
        typed = {"model": MODEL, "messages": [{"role": "user", "content": "a <image> typed"}]}
        r = head.http.post("/v1/chat/completions", json=typed)
        assert r.status_code == 400 and "placeholder" in r.json()["error"]["message"]
        many = messages(*[png(1)] * 33)
        r = head.http.post("/v1/chat/completions", json={"model": MODEL, "messages": many})
        assert r.status_code == 400 and "at most 32" in r.json()["error"]["message"]
        r = text.http.post("/v1/chat/completions", json={"model": "demo-tiny", "messages": many})
        assert r.status_code == 400 and "no images" in r.json()["error"]["message"]
        assert complete(head, png(1))["choices"][0]["finish_reason"] == "length"  # still serving
        # /tokenize shows an image's positions as the placeholder id, as vLLM does
        body = {"model": MODEL, "messages": messages(png(1))}
        ids = head.http.post("/tokenize", json=body).json()["tokens"]
        placeholder = head.http.post("/tokenize", json={"prompt": "<image>"}).json()["tokens"]
        assert ids.count(placeholder[-1]) == 16 and max(ids) < MEDIA_BASE
        wait_for(lambda: head.health()["status"] == "ok", 10, "a healthy head")
    finally:
        head.stop()
        text.stop()


# -- a picture's encoder rows, shared as blocks (kvmesh.runtime.pictures) ----------------------


@pytest.mark.parametrize("name", [MODEL, QWEN3])
def test_a_pictures_encoder_rows_are_a_block_another_engine_takes_instead_of_encoding(name):
    """The rows one engine encoded, as a block of their own card (over the wire
    codec), are what another engine computes the prompt with, its encoder not run:
    the same logits (Qwen3-VL's deepstack rows included)."""
    from kvmesh.codec import Layout, decode_block

    a, b = (TransformersEngine(Path(model_path(name))) for _ in range(2))
    tokens = prompt(a, png(1))
    want = a.prefill(tokens).logits
    assert prompt(b, png(1)) == tokens  # the same picture: the same media ids
    [(digest, length)] = b.vision.needed(tokens, 0)
    assert a.vision.needed(tokens, 0) == []  # a holds its rows
    end = tokens.index(first_media_id(tokens)) + length
    assert b.vision.needed(tokens, end) == []  # past the picture: not needed
    card = a.vision.rows_card(a.card)
    keyer = BlockKeyer(card.namespace, card.block_tokens)
    blocks = a.vision.rows_blocks(card, keyer, digest)
    assert len(blocks) == -(-length // card.block_tokens)  # the last padded to a block
    wire = [decode_block(blk.blob, Layout(card), blk.digest) for blk in blocks]
    with pytest.raises(ValueError):  # a picture's rows are its whole chain
        b.vision.take(digest, length, wire[:-1])
    b.vision.take(digest, length, wire)
    assert b.vision.needed(tokens, 0) == []
    got = b.prefill(tokens).logits
    assert b.vision.encoded == 0 and b.vision.taken == 1
    assert torch.equal(got, want)


def test_encoder_rows_that_are_not_a_pictures_are_refused_and_nothing_is_held():
    """Another card's block (a prompt's KV) and rows with a NaN are refused: the
    engine holds nothing for the picture and encodes it."""
    from kvmesh.engine.vision import _Bounded

    engine = TransformersEngine(Path(model_path(MODEL)))
    tokens = prompt(engine, png(2))
    [(digest, length)] = engine.vision.needed(tokens, 0)
    kv = engine.export(engine.prefill(tokens), engine_keyer(engine))
    engine.vision._features = _Bounded(1 << 30)  # forget the rows the prefill encoded
    with pytest.raises(ValueError, match="encoder rows"):
        engine.vision.take(digest, length, kv[:-1])
    card = engine.vision.rows_card(engine.card)
    keyer = BlockKeyer(card.namespace, card.block_tokens)
    engine.vision._features.put(digest, torch.full((length, 64), float("nan")), 1)
    poisoned = engine.vision.rows_blocks(card, keyer, digest)
    engine.vision._features = _Bounded(1 << 30)
    with pytest.raises(ValueError, match="not finite"):
        engine.vision.take(digest, length, poisoned)
    assert engine.vision.needed(tokens, 0) == [(digest, length)]
    encoded = engine.vision.encoded
    assert torch.isfinite(engine.prefill(tokens).logits).all()
    assert engine.vision.encoded == encoded + 1


def engine_keyer(engine) -> BlockKeyer:
    return BlockKeyer(engine.card.namespace, engine.card.block_tokens)


def test_a_picture_encoded_on_one_head_is_not_encoded_on_another(tmp_path):
    """Head 1 answers a prompt with a picture and publishes; head 2, a new process,
    gets the same picture after other text (so no KV of it is anywhere): it takes
    the picture's encoder rows from the fleet and does not encode it, and answers
    exactly as a head alone encoding it does. A picture one pixel apart is encoded."""
    model = model_path(MODEL)
    peer = Peer(alias="rows-peer", log_dir=tmp_path)
    picture = png(9)
    other = [{"type": "text", "text": "Another question entirely, then the same picture. "}]
    other += [{"type": "image_url", "image_url": {"url": data_url(picture)}}]
    other_body = {"model": model, "messages": [{"role": "user", "content": other}]}
    other_body |= {"max_tokens": 6, "temperature": 0, "logprobs": True, "top_logprobs": 2}
    try:
        h1 = Head("--seed", peer.address, model=model)
        try:
            h1.wait(lambda s: s["peers"] >= 1)
            complete(h1, picture, model=model)
            h1.wait(lambda s: s["publish_pending"] == 0)
        finally:
            h1.stop()
        h2 = Head("--seed", peer.address, model=model)
        try:
            h2.wait(lambda s: s["compatible_peers"] >= 1)
            shared = h2.http.post("/v1/chat/completions", json=other_body).json()
            taken = h2.metric("kvmesh_image_rows_taken_total")
            encoded = h2.metric("kvmesh_images_encoded_total")
            complete(h2, png(9, touch=(3, 4)), model=model)
            encoded_after = h2.metric("kvmesh_images_encoded_total")
        finally:
            h2.stop()
    finally:
        peer.kill()
    alone = Head(model=model)
    try:
        cold = alone.http.post("/v1/chat/completions", json=other_body).json()
        assert alone.metric("kvmesh_images_encoded_total") == 1
    finally:
        alone.stop()
    assert (taken, encoded, encoded_after) == (1, 0, 1)
    assert shared["usage"]["prompt_tokens_details"]["cached_tokens"] == 0  # no KV of it
    assert answer(shared) == answer(cold)


def test_wrong_picture_rows_from_a_peer_are_caught_by_an_audit_and_replaced(tmp_path):
    """A peer serving a picture's rows scaled (well-formed, sealed, digest right:
    no structural check can tell) is caught by ``--audit-rate``'s encode again: the
    peer is quarantined and the engine holds its own rows from then on."""
    from kvmesh.runtime.pictures import PictureRows

    from .test_mesh import SAMPLING, close, make_head

    forger_engine, engine = (TransformersEngine(Path(model_path(MODEL))) for _ in range(2))
    peer = Peer(alias="rows-forger-peer", log_dir=tmp_path)
    picture = png(13)
    forger = make_head(forger_engine, [peer.address], alias="rows-forger")
    try:
        wait_for(lambda: len(forger.fleet.members()) >= 1, what="gossip")
        tokens = prompt(forger_engine, picture)
        [(digest, _)] = forger_engine.vision.needed(tokens, 0)
        true_rows = forger_engine.vision._encoded(digest)
        forger_engine.vision._features.put(digest, true_rows * 1.5, 1, replace=True)
        rows = PictureRows(forger_engine.vision, forger_engine.card, forger.fleet)
        blocks = forger_engine.vision.rows_blocks(rows.rows_card, rows.keyer, digest)
        forger.fleet.publish(rows.rows_card, blocks)
        forger.flush()
    finally:
        close(forger)
    h = make_head(engine, [peer.address], runtime={"audit_rate": 1.0})
    try:
        wait_for(lambda: len(h.fleet.members()) >= 1, what="gossip")
        out = h.complete(prompt(engine, picture), SAMPLING)
        assert out.report.source == "compute" and engine.vision.taken == 1
        wait_for(lambda: h.telemetry.counters["audits"] >= 1, what="the audit")
        assert h.telemetry.counters["audit_mismatch"] == 1
        peer_id = next(c.node_id for c in h.fleet.members() if c.alias == peer.alias)
        assert not h.planner.usable(peer_id)
        assert torch.equal(engine.vision._features.get(digest), true_rows)
    finally:
        close(h)
        peer.kill()


def test_picture_rows_are_kept_and_published_but_never_announced_as_kv(tmp_path):
    """KV events (vLLM's format, for routers) name KV blocks only: a head keeping
    (and publishing) a picture's rows blocks queues no event for them, while a KV
    block it keeps is announced; a peer is told of a published rows card before
    storing any of its blocks."""
    from kvmesh.mesh.events import EventsConfig
    from kvmesh.mesh.server import CacheService
    from kvmesh.store import BlockStore

    from .procs import free_port
    from .test_mesh import close, make_head

    engine = TransformersEngine(Path(model_path(MODEL)))
    events = EventsConfig(f"tcp://127.0.0.1:{free_port()}", "", "kv")
    h = make_head(engine, [], kv_events=events)
    try:
        tokens = prompt(engine, png(21))
        [(digest, length)] = engine.vision.needed(tokens, 0)
        state = engine.prefill(tokens)  # encodes the picture here: its rows are fresh
        before = h.fleet.announced()
        h.pictures.publish(h.give_back)  # as after a request
        h.flush()
        keyer = h.pictures.keyer
        rows = keyer.keys(engine.vision.rows_tokens(digest, length, keyer.block_tokens))
        assert h.telemetry.counters["picture_rows_blocks"] == len(rows.blocks)  # one picture
        assert len(h.fleet.local_prefix(rows).blocks) == len(rows.blocks) > 0  # kept here
        assert h.fleet.announced() == before  # and never announced
        kv = engine.export(state, h.keyer)
        assert h.fleet.keep(kv[:1]) == 1 and h.fleet.announced() == before + 1
    finally:
        close(h)
    card = engine.vision.rows_card(engine.card)
    told: list[bytes] = []
    service = CacheService(BlockStore(1 << 20), quiet=told.append)
    service.layout_of(json.dumps(engine.card.to_json()))
    service.layout_of(json.dumps(card.to_json()))
    assert told == [card.namespace]
