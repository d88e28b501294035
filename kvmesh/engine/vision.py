"""Images for a LLaVA-style vision-language model on the torch engine.

:class:`Vision` turns an image file's bytes into a :class:`Picture`: the pixels
the model's own image processor makes of it (a transformers PIL processor; no
torchvision), their digest, and the media token ids (:data:`~kvmesh.blocks.MEDIA_IDS`)
that stand for its positions in a prompt. A prompt's token list carries those ids,
so keys, sessions and shared prefills tell images apart with no more bookkeeping;
:meth:`Vision.embed` gives a forward its input embeddings: the text embeddings,
with each image position's row of that image's encoder output.

The encoder runs only when a forward computes an image position (a prefix fetched
through the image needs none) and its output is kept, by digest, for the next
prompt with the same image anywhere. The digest hashes the processor's config and
the processed pixels, so the same picture through another preprocessing is
another image. Decoding is bounded (file bytes, pixel count) before any pixel is
allocated; what cannot be decoded is a :class:`BadImage`.
"""

from __future__ import annotations

import hashlib
import io
import json
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..blocks import MEDIA_BASE, MEDIA_IDS, MediaItem

#: model types whose image features replace placeholder rows of the text embeddings
#: under plain causal attention (so a prefill may stop inside an image)
VISION_MODEL_TYPES = frozenset({"llava"})
MAX_IMAGE_BYTES = 20 << 20  # one image file, as sent
MAX_IMAGE_PIXELS = 40_000_000  # width x height before decoding (PIL's bomb check is 89M)
_DIGEST_DOMAIN = b"kvmesh/image/v1\x00"


class BadImage(ValueError):
    """Image bytes that are not an image this head can read (the API's 400)."""


class ImageGone(RuntimeError):
    """A forward needs the pixels of an image no longer held (too many images at once)."""


@dataclass(frozen=True)
class Picture:
    """One processed image: its digest and its pixels as the vision tower takes them."""

    digest: bytes
    pixels: torch.Tensor  # [channels, height, width]

    @property
    def nbytes(self) -> int:
        return self.pixels.numel() * self.pixels.element_size()


class _Bounded:
    """Digest -> tensor, least recently used first dropped past ``capacity`` bytes."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._items: OrderedDict[bytes, torch.Tensor] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()

    def get(self, digest: bytes) -> torch.Tensor | None:
        with self._lock:
            found = self._items.get(digest)
            if found is not None:
                self._items.move_to_end(digest)
            return found

    def put(self, digest: bytes, value: torch.Tensor) -> None:
        size = value.numel() * value.element_size()
        with self._lock:
            if digest in self._items:
                self._items.move_to_end(digest)
                return
            self._items[digest] = value
            self._bytes += size
            while self._bytes > self.capacity and len(self._items) > 1:
                _, old = self._items.popitem(last=False)
                self._bytes -= old.numel() * old.element_size()


def decode_image(data: bytes) -> Any:
    """``data`` as an RGB PIL image, its size checked before its pixels are read."""
    from PIL import Image

    if not data:
        raise BadImage("the image is empty")
    if len(data) > MAX_IMAGE_BYTES:
        raise BadImage(f"the image is larger than {MAX_IMAGE_BYTES} bytes")
    try:
        img = Image.open(io.BytesIO(data))
        if img.width * img.height > MAX_IMAGE_PIXELS:
            raise BadImage(f"the image has more than {MAX_IMAGE_PIXELS} pixels")
        img.load()
        return img.convert("RGB")
    except BadImage:
        raise
    except (OSError, ValueError, SyntaxError, Image.DecompressionBombError) as e:
        raise BadImage(f"the image cannot be decoded ({type(e).__name__})") from None


class Vision:
    """A vision-language model's images: processing, ids, encoder and embeddings."""

    def __init__(
        self,
        model: Any,
        path: Path,
        pixels_bytes: int = 512 << 20,
        features_bytes: int = 256 << 20,
    ) -> None:
        from transformers import AutoImageProcessor

        cfg = model.config
        if cfg.model_type not in VISION_MODEL_TYPES:
            raise ValueError(f"images on {cfg.model_type} models are not supported")
        self.model = model
        self.processor = AutoImageProcessor.from_pretrained(str(path), local_files_only=True)
        vision = cfg.vision_config
        patches = (vision.image_size // vision.patch_size) ** 2
        self.select = cfg.vision_feature_select_strategy
        self.layer = cfg.vision_feature_layer
        self.tokens_per_image = patches + (1 if self.select == "full" else 0)
        self.placeholder = int(cfg.image_token_id)
        config = json.dumps(self.processor.to_dict(), sort_keys=True, default=str)
        self._salt = _DIGEST_DOMAIN + hashlib.sha256(config.encode()).digest()
        self._pixels = _Bounded(pixels_bytes)
        self._features = _Bounded(features_bytes)
        self.encoded = 0  # images run through the encoder
        self.encoder_seconds = 0.0

    def picture(self, data: bytes) -> Picture:
        """The processed image of ``data`` (an image file's bytes), held for forwards."""
        img = decode_image(data)
        out = self.processor(images=[img], return_tensors="pt")
        pixels = out["pixel_values"][0].contiguous()
        h = hashlib.sha256(self._salt)
        h.update(repr((tuple(pixels.shape), str(pixels.dtype))).encode())
        h.update(pixels.numpy().tobytes())
        picture = Picture(h.digest(), pixels)
        self._pixels.put(picture.digest, pixels)
        return picture

    def ids(self, picture: Picture) -> list[int]:
        """The media token ids of ``picture``'s positions in a prompt."""
        return MEDIA_IDS.ids(MediaItem(picture.digest, self.placeholder, self.tokens_per_image))

    def expand(self, tokens: Sequence[int], pictures: Sequence[Picture]) -> list[int]:
        """``tokens`` with its ``i``-th placeholder id replaced by ``pictures[i]``'s ids;
        ValueError unless there is one placeholder per picture."""
        at = [i for i, t in enumerate(tokens) if t == self.placeholder]
        if len(at) != len(pictures):
            raise ValueError(
                f"the prompt has {len(at)} image placeholders for {len(pictures)} images"
            )
        out: list[int] = []
        last = 0
        for i, picture in zip(at, pictures, strict=True):
            out += tokens[last:i]
            out += self.ids(picture)
            last = i + 1
        return out + list(tokens[last:])

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """Input embeddings of ``ids`` [rows, n] (media ids among them)."""
        media = ids >= MEDIA_BASE
        plain = torch.where(media, torch.full_like(ids, self.placeholder), ids)
        embeds = self.model.get_input_embeddings()(plain)
        if not bool(media.any()):
            return embeds
        rows = []
        for token in ids[media].tolist():
            item, index = MEDIA_IDS.item(token)
            rows.append(self._encoded(item.digest)[index])
        embeds[media] = torch.stack(rows).to(embeds.dtype)
        return embeds

    def _encoded(self, digest: bytes) -> torch.Tensor:
        found = self._features.get(digest)
        if found is not None:
            return found
        pixels = self._pixels.get(digest)
        if pixels is None:
            raise ImageGone("an image of this prompt is no longer held: send it again")
        begun = time.perf_counter()
        out = self.model.get_image_features(
            pixel_values=pixels[None].to(self.model.dtype),
            vision_feature_layer=self.layer,
            vision_feature_select_strategy=self.select,
            return_dict=True,
        )
        feats = out.pooler_output if hasattr(out, "pooler_output") else out
        if isinstance(feats, list | tuple):
            feats = torch.cat(list(feats), dim=0)
        feats = feats.reshape(-1, feats.shape[-1])
        if feats.shape[0] != self.tokens_per_image:
            raise ValueError(f"the encoder gave {feats.shape[0]} rows for an image")
        self.encoder_seconds += time.perf_counter() - begun
        self.encoded += 1
        self._features.put(digest, feats)
        return feats
