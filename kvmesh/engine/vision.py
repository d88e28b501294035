"""Images for a vision-language model on the torch engine (LLaVA, Gemma 3, Gemma 4,
Qwen2-VL, Qwen2.5-VL, Qwen3-VL and Qwen3.5).

:class:`Vision` turns an image file's bytes into a :class:`Picture`: what the
model's own image processor makes of it (a transformers PIL processor; no
torchvision), its digest, and how many positions it takes in a prompt; its
positions hold media token ids (:data:`~kvmesh.blocks.MEDIA_IDS`), so keys,
sessions and shared prefills tell images apart with no more bookkeeping.
:meth:`Vision.inputs` gives a forward the model's own inputs: the placeholder ids,
and the encoder's rows for the image positions that forward computes, which the
model scatters into its embeddings itself (``mm_encoder_outputs``), so a forward
may start or stop inside an image.

The encoder runs only when a forward computes an image position (a prefix fetched
through the image needs none) and its output is kept, by digest, for the next
prompt with the same image under the same chain root. The digest hashes the
request's chain root (a tenant's cache is its own: another tenant's picture is
neither reused nor timed), the processor's config and the processed pixels, so the
same picture through another preprocessing is another image. Decoding is bounded
(file bytes, pixel count) before any pixel is allocated, and only PNG, JPEG, WebP
and GIF are decoded; anything else is a :class:`BadImage`. Models whose attention
over an image goes both ways (Gemma 3's; Gemma 4's with
``use_bidirectional_attention: "vision"``: within a picture each position sees all
of it) are :attr:`Vision.bidirectional`:
a picture's keys and values depend on the whole picture, so a forward never stops
inside one (the engine's ``forward_tokens``), and each forward says which of its
positions are a picture's (Gemma 4's ``mm_token_type_ids``, Gemma 3's
``token_type_ids``). Reuse may still end inside a
picture: what was computed there saw the whole picture, which the key's digest
names. Attention both ways over everything (``"all"``) is not a causal model:
served as text only.

Qwen2-VL's family rotates by 3-D positions (M-RoPE: a picture's positions are its
rows and columns from the position where it starts, and the text after it goes on
from the largest of those), so a position depends on every picture before it.
transformers keeps that offset on the model object between calls (``rope_deltas``),
which concurrent sequences would share; here every forward is given its positions
instead (:meth:`Vision.positions`), computed from the whole sequence of each row
(:func:`kvmesh.engine.rows.sequences`) and each picture's grid, which its digest
names.

A picture's encoder rows can be shared like KV (:mod:`kvmesh.runtime.pictures`): as
a chain of blocks of a card of their own (:meth:`Vision.rows_card`: the model's card,
one "layer" per kind of row, the encoder's then each deepstack layer's, K the first
half of each row and V the second; the last block zero-padded), keyed by the
picture's media ids, so they travel, are verified and are stored as any block is. :meth:`Vision.needed`
names the pictures a prefill would encode; :meth:`Vision.take` holds rows fetched
for one (checked: shape, finite values), :meth:`Vision.rows_blocks` makes the blocks
of rows held, and :meth:`Vision.fresh` hands over the pictures encoded here since.
"""

from __future__ import annotations

import dataclasses
import hashlib
import io
import json
import threading
import time
import warnings
from collections import OrderedDict, deque
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..blocks import MEDIA_BASE, MEDIA_IDS, MEDIA_MAX_LENGTH, BlockKeyer, MediaItem
from ..codec import Block, Layout, new_blob
from ..compat import ROWS_ENGINE, CompatCard

MAX_IMAGE_BYTES = 20 << 20  # one image file, as sent
MAX_IMAGE_PIXELS = 40_000_000  # width x height before decoding (PIL's bomb check is 89M)
#: the formats decoded (what OpenAI's API takes): no other PIL parser sees a client's bytes
FORMATS = ("PNG", "JPEG", "WEBP", "GIF")
_DIGEST_DOMAIN = b"kvmesh/image/v1\x00"
FRESH = 256  # pictures encoded here and not yet handed over (the oldest dropped past it)
_TORCH = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class BadImage(ValueError):
    """Image bytes that are not an image this head can read (the API's 400)."""


class ImageGone(RuntimeError):
    """A forward needs the pixels of an image no longer held (too many images at once)."""


@dataclass(frozen=True)
class Picture:
    """One processed image: its digest, its encoder inputs (one image's, no batch
    axis) and how many positions it takes in a prompt."""

    digest: bytes
    inputs: dict[str, torch.Tensor]
    length: int
    grid: tuple[int, int, int] = (1, 1, 1)  # (frames, rows, columns) of positions (M-RoPE)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.inputs.values())


@dataclass(frozen=True)
class _Family:
    """How one architecture takes images: the processor outputs its encoder reads,
    and the ids around an image's positions (token ids from the config)."""

    encoder_inputs: tuple[str, ...]
    around: tuple[str, ...] = ()  # config fields of the ids before and after: (begin, end)
    # the vision config's size of the table ``image_position_ids`` index (Gemma 4's): a
    # picture whose patches reach past it (a very long, thin one) is refused, not encoded
    position_table: str = ""
    soft_tokens: str = ""  # the config field of a picture's positions (else the processor's)
    types: str = "mm_token_type_ids"  # the forward's argument naming a picture's positions
    both_ways: bool = False  # attention within a picture always goes both ways (Gemma 3)
    pooled_list: bool = True  # the forward takes pooler_output as a list (else one tensor)
    blank: str = ""  # text on each side of a picture in the prompt (Gemma 3's processor's)
    # the processor gives one picture's patches as rows (no image axis) and their grid
    # (``image_grid_thw``), whose positions rotate in 3-D (Qwen2-VL's M-RoPE)
    patches: bool = False

    def check(self, inputs: dict[str, Any], cfg: Any) -> None:
        """A :class:`BadImage` where the encoder could not take ``inputs``."""
        if not self.position_table:
            return
        table = int(getattr(cfg.vision_config, self.position_table))
        reach = int(inputs["image_position_ids"].max()) + 1
        if reach > table:
            raise BadImage(
                f"the image is too long and thin for this model: {reach} patches along a "
                f"side, its vision tower takes at most {table}"
            )

    @property
    def flat(self) -> tuple[str, ...]:
        """The encoder inputs given with no image axis (one picture's patch rows)."""
        return ("pixel_values",) if self.patches else ()

    def grid(self, out: Any, cfg: Any) -> tuple[int, int, int]:
        """A picture's positions as (frames, rows, columns): merged patches (M-RoPE),
        else one row of :meth:`length`."""
        if not self.patches:
            return (1, 1, self.length(out, cfg))
        merge = int(cfg.vision_config.spatial_merge_size)
        t, h, w = (int(v) for v in out["image_grid_thw"][0])
        return (t, h // merge, w // merge)

    def length(self, out: Any, cfg: Any) -> int:
        if self.patches:
            t, h, w = self.grid(out, cfg)
            return t * h * w
        if self.soft_tokens:
            return int(getattr(cfg, self.soft_tokens))
        if "num_soft_tokens_per_image" in out:
            return int(out["num_soft_tokens_per_image"][0])
        vision = cfg.vision_config  # LLaVA: a patch grid, the CLS row unless "full"
        patches = (vision.image_size // vision.patch_size) ** 2
        return patches + (1 if cfg.vision_feature_select_strategy == "full" else 0)


FAMILIES = {
    "llava": _Family(("pixel_values",)),
    "gemma4": _Family(
        ("pixel_values", "image_position_ids"),
        ("boi_token_id", "eoi_token_id"),
        position_table="position_embedding_size",
    ),
    "gemma3": _Family(
        ("pixel_values",),
        ("boi_token_id", "eoi_token_id"),
        soft_tokens="mm_tokens_per_image",
        types="token_type_ids",
        both_ways=True,
        pooled_list=False,
        blank="\n\n",
    ),
}
_QWEN = _Family(
    ("pixel_values", "image_grid_thw"),
    ("vision_start_token_id", "vision_end_token_id"),
    patches=True,
)
FAMILIES |= {"qwen2_vl": _QWEN, "qwen2_5_vl": _QWEN, "qwen3_5": _QWEN, "qwen3_vl": _QWEN}


def sees_images(path: Path, cfg: dict[str, Any]) -> bool:
    """Whether the model in ``path`` (config ``cfg``) is served with images: a family
    of :data:`FAMILIES` with an image processor, causal over its text."""
    if cfg.get("model_type") not in FAMILIES or not (path / "preprocessor_config.json").is_file():
        return False
    text = cfg.get("text_config") or {}
    return text.get("use_bidirectional_attention") in (None, False, "vision")


def _types(media: torch.Tensor, past: int) -> torch.Tensor:
    """The picture positions of a forward's ``media`` mask [rows, n] as the Gemmas'
    token types (1: a picture's), spanning its ``past`` cached positions as text too:
    transformers looks them up by absolute position, and reads them as covering the
    sequence from its first position. Cached positions need no bidirectional pair
    (causal attention already sees them), so they are text (0) here."""
    types = media.long()
    if past:
        types = torch.cat([types.new_zeros((types.shape[0], past)), types], dim=1)
    return types


class _Bounded:
    """Digest -> value, least recently used first dropped past ``capacity`` bytes."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._items: OrderedDict[bytes, tuple[Any, int]] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()

    def get(self, digest: bytes) -> Any:
        with self._lock:
            found = self._items.get(digest)
            if found is None:
                return None
            self._items.move_to_end(digest)
            return found[0]

    def put(self, digest: bytes, value: Any, size: int, replace: bool = False) -> None:
        with self._lock:
            if digest in self._items and not replace:
                self._items.move_to_end(digest)
                return
            if digest in self._items:
                self._bytes -= self._items.pop(digest)[1]
            self._items[digest] = (value, size)
            self._bytes += size
            while self._bytes > self.capacity and len(self._items) > 1:
                _, (_, old) = self._items.popitem(last=False)
                self._bytes -= old


def _tensor(view: memoryview, dtype: str) -> torch.Tensor:
    """``view``'s values as a tensor of ``dtype`` (a card's name), read in place (the
    block's bytes are read-only; the caller copies them out)."""
    with warnings.catch_warnings():  # a read-only buffer: never written through
        warnings.simplefilter("ignore", UserWarning)
        return torch.frombuffer(view, dtype=_TORCH[dtype])


def _deepstack(rows: torch.Tensor) -> Any:
    """Encoder rows [n, 1 + layers, width] as Qwen3-VL's encoder gives them: the
    rows the prompt's embeddings take, and each deepstack layer's, added to the
    hidden states of the text model's first layers at the picture's positions."""
    from transformers.models.qwen3_vl.modeling_qwen3_vl import (
        BaseModelOutputWithDeepstackFeatures,
    )

    deep: Any = [[rows[:, k]] for k in range(1, rows.shape[1])]
    pooled: Any = [rows[:, 0]]  # per picture, as its encoder splits them (typed as one)
    return BaseModelOutputWithDeepstackFeatures(pooler_output=pooled, deepstack_features=deep)


def decode_image(data: bytes) -> Any:
    """``data`` as an RGB PIL image, its size checked before its pixels are read."""
    from PIL import Image

    if not data:
        raise BadImage("the image is empty")
    if len(data) > MAX_IMAGE_BYTES:
        raise BadImage(f"the image is larger than {MAX_IMAGE_BYTES} bytes")
    try:
        img = Image.open(io.BytesIO(data), formats=FORMATS)
        if img.width * img.height > MAX_IMAGE_PIXELS:
            raise BadImage(f"the image has more than {MAX_IMAGE_PIXELS} pixels")
        img.load()
        return img.convert("RGB")
    except BadImage:
        raise
    except Image.UnidentifiedImageError:
        raise BadImage("the image is not a PNG, JPEG, WebP or GIF file") from None
    except (OSError, ValueError, SyntaxError, Image.DecompressionBombError) as e:
        raise BadImage(f"the image cannot be decoded ({type(e).__name__})") from None


class Vision:
    """A vision-language model's images: processing, ids, encoder and forward inputs."""

    def __init__(
        self,
        model: Any,
        path: Path,
        pixels_bytes: int = 512 << 20,
        features_bytes: int = 256 << 20,
    ) -> None:
        from transformers import AutoImageProcessor

        cfg = model.config
        self.family = FAMILIES[cfg.model_type]
        self.model, self.config = model, cfg
        self.processor = AutoImageProcessor.from_pretrained(str(path), local_files_only=True)
        self.placeholder = int(cfg.image_token_id)
        ends = [int(getattr(cfg, f)) for f in self.family.around]  # e.g. Gemma 4's boi, eoi
        self._before, self._after = ends[:1], ends[1:]
        text = cfg.get_text_config()
        both_ways = getattr(text, "use_bidirectional_attention", None) == "vision"
        self.bidirectional = self.family.both_ways or both_ways
        self.mrope = self.family.patches  # positions in 3-D: :meth:`positions`
        config = json.dumps(self.processor.to_dict(), sort_keys=True, default=str)
        self._salt = _DIGEST_DOMAIN + hashlib.sha256(config.encode()).digest()
        self._pixels = _Bounded(pixels_bytes)
        self._features = _Bounded(features_bytes)
        self._grids = _Bounded(MEDIA_IDS.capacity)  # digest -> Picture.grid (one unit each)
        self.encoded = 0  # images run through the encoder
        self.encoder_seconds = 0.0
        self.taken = 0  # pictures whose encoder rows came from elsewhere (take)
        self._fresh: deque[tuple[bytes, int]] = deque(maxlen=FRESH)  # (digest, length)

    def picture(self, data: bytes, root: bytes | None = None) -> Picture:
        """The processed image of ``data`` (an image file's bytes) for a request under
        chain ``root`` (None: the shared cache), held for forwards."""
        image = decode_image(data)
        try:
            out = self.processor(images=[image], return_tensors="pt")
        except ValueError as e:  # a shape the processor refuses (Qwen's: an aspect over 200)
            raise BadImage(f"the image cannot be processed for this model: {e}") from None
        flat = self.family.flat
        inputs = {
            k: (out[k] if k in flat else out[k][0]).contiguous() for k in self.family.encoder_inputs
        }
        self.family.check(inputs, self.config)
        length = self.family.length(out, self.config)
        grid = self.family.grid(out, self.config)
        h = hashlib.sha256(self._salt + (root or b"") + length.to_bytes(4, "little"))
        for name, t in sorted(inputs.items()):
            h.update(repr((name, tuple(t.shape), str(t.dtype))).encode())
            h.update(t.numpy())  # its bytes in place (contiguous): no copy
        picture = Picture(h.digest(), inputs, length, grid)
        self._pixels.put(picture.digest, picture, picture.nbytes)
        self._grids.put(picture.digest, grid, 1)
        return picture

    def positions(self, tokens: Sequence[int], start: int, n: int) -> torch.Tensor:
        """M-RoPE's positions [3, n] of positions ``[start, start + n)`` of the
        sequence ``tokens`` (from its first position): a text position is its index
        plus what the pictures before it add; a picture's are its (frame, row, column)
        from the position it starts at, and the text after it goes on from the largest
        of them plus one, as the model's own ``get_rope_index`` counts. Positions past
        ``tokens`` (a batch row's padding) go on as text."""
        end = start + n
        out = np.tile(np.arange(start, end, dtype=np.int64), (3, 1))
        seq = np.asarray(tokens[:end], dtype=np.int64)
        at = np.flatnonzero(seq >= MEDIA_BASE)
        shift = 0  # what the pictures so far add to a text position
        for first in np.unique(at - (seq[at] - MEDIA_BASE) % MEDIA_MAX_LENGTH).tolist():
            t, h, w = self._grid(seq, first)
            length, base = t * h * w, first + shift
            lo, hi = max(first, start), min(first + length, end)
            if lo < hi:
                grid = np.meshgrid(np.arange(t), np.arange(h), np.arange(w), indexing="ij")
                own = np.stack(grid).reshape(3, -1) + base
                out[:, lo - start : hi - start] = own[:, lo - first : hi - first]
            after, shift_after = max(first + length, start), base + max(t, h, w) - first - length
            out[:, after - start :] += shift_after - shift
            shift = shift_after
        return torch.from_numpy(out)

    def _grid(self, seq: np.ndarray, first: int) -> tuple[int, int, int]:
        """The grid of the picture starting at ``seq[first]``: an :class:`ImageGone`
        where that is no picture this process still knows (its positions cannot be
        counted, so nothing after it can be computed)."""
        item, index = MEDIA_IDS.item(int(seq[first])) if first >= 0 else (None, -1)
        grid = self._grids.get(item.digest) if item is not None and index == 0 else None
        if grid is None or item is None or grid[0] * grid[1] * grid[2] != item.length:
            raise ImageGone("an image of this prompt is no longer held: send it again")
        t, h, w = grid
        return t, h, w

    def ids(self, picture: Picture) -> list[int]:
        """The media token ids of ``picture``'s positions in a prompt."""
        return MEDIA_IDS.ids(MediaItem(picture.digest, self.placeholder, picture.length))

    def text(self, tokenizer: Any) -> str:
        """What one picture is in a prompt's text, for the chat template: the
        placeholder token (:meth:`expand` widens it), with the family's blank text on
        each side (so the prompt tokenizes as the model's own processor makes it)."""
        mark = str(tokenizer.convert_ids_to_tokens(self.placeholder))
        return self.family.blank + mark + self.family.blank

    def expand(self, tokens: Sequence[int], pictures: Sequence[Picture]) -> list[int]:
        """``tokens`` with its ``i``-th placeholder id replaced by ``pictures[i]``'s ids
        (between the family's begin and end ids); ValueError unless there is one
        placeholder per picture."""
        at = [i for i, t in enumerate(tokens) if t == self.placeholder]
        if len(at) != len(pictures):
            raise ValueError(
                f"the prompt has {len(at)} image placeholders for {len(pictures)} images"
            )
        out: list[int] = []
        last = 0
        for i, picture in zip(at, pictures, strict=True):
            out += [*tokens[last:i], *self._before, *self.ids(picture), *self._after]
            last = i + 1
        return out + list(tokens[last:])

    def inputs(self, ids: torch.Tensor, past: int = 0) -> dict[str, Any]:
        """A forward's inputs for ``ids`` [rows, n] (media ids among them) after
        ``past`` cached positions: the ids the model knows, and the encoder's rows for
        the image positions among them."""
        from transformers.modeling_outputs import BaseModelOutputWithPooling

        media = ids >= MEDIA_BASE
        plain = torch.where(media, torch.full_like(ids, self.placeholder), ids)
        rows = []
        for token in ids[media].tolist():
            item, index = MEDIA_IDS.item(token)
            rows.append(self._encoded(item.digest)[index])
        # the model concatenates pooler_output's per-image tensors (its own encoder's form)
        stacked = torch.stack(rows)
        if stacked.ndim == 3:  # [n, 1 + layers, width]: the deepstack layers' rows too
            image = _deepstack(stacked)
        else:
            pooled = [stacked] if self.family.pooled_list else stacked
            image = BaseModelOutputWithPooling(pooler_output=pooled)  # type: ignore[arg-type]
        out = {"input_ids": plain, "mm_encoder_outputs": {"image": image}}
        if self.bidirectional:  # the positions attended both ways (the processor's type 1)
            out[self.family.types] = _types(media, past)
        return out

    def _encoded(self, digest: bytes) -> torch.Tensor:
        found = self._features.get(digest)
        if found is not None:
            return found
        picture = self._pixels.get(digest)
        if picture is None:
            raise ImageGone("an image of this prompt is no longer held: send it again")
        begun = time.perf_counter()
        feats = self._encode(picture)
        self.encoder_seconds += time.perf_counter() - begun
        self.encoded += 1
        self._features.put(digest, feats, feats.numel() * feats.element_size())
        self._fresh.append((digest, int(feats.shape[0])))
        return feats

    # -- the encoder's rows as blocks (kvmesh.runtime.pictures) -------------------

    def rows_card(self, card: CompatCard) -> CompatCard | None:
        """The card of pictures' encoder rows for the model of ``card`` (see the
        module): its block size, so one namespace holds every picture; None where
        a row cannot be halved."""
        width, kinds = self._row_shape()
        if width % 2:
            return None
        return dataclasses.replace(
            card,
            engine=card.engine + ROWS_ENGINE,
            kv_quant="none",
            num_layers=kinds,
            num_kv_heads=1,
            head_dim=width // 2,
            sliding_windows=(0,) * kinds,
            layer_geometry=(),
            state_every=0,
            prefill_grid=0,
        )

    def _row_shape(self) -> tuple[int, int]:
        """(width, kinds) of an encoder row: the text model's width, and the
        encoder's row plus one per deepstack layer (Qwen3-VL's)."""
        deep = getattr(self.config.vision_config, "deepstack_visual_indexes", None) or ()
        return int(self.config.get_text_config().hidden_size), 1 + len(deep)

    def needed(self, tokens: Sequence[int], start: int) -> list[tuple[bytes, int]]:
        """(digest, positions) of each picture with a position at or after
        ``start`` whose encoder rows are not held here: what a prefill from
        ``start`` encodes."""
        out = []
        for span in MEDIA_IDS.split(tokens)[1]:
            ends = span.offset + span.length
            if ends > start and ends <= len(tokens) and self._features.get(span.digest) is None:
                out.append((span.digest, span.length))
        return out

    def rows_tokens(self, digest: bytes, length: int, block_tokens: int) -> list[int]:
        """What the rows blocks of picture ``digest`` (``length`` positions) are keyed
        by: its media ids, then the placeholder id up to a whole block."""
        ids = MEDIA_IDS.ids(MediaItem(digest, self.placeholder, length))
        return ids + [self.placeholder] * (-length % block_tokens)

    def rows_blocks(self, card: CompatCard, keyer: BlockKeyer, digest: bytes) -> list[Block]:
        """The chain of blocks of the encoder rows held for picture ``digest`` under
        ``card`` (:meth:`rows_card`; the last block's positions past the picture
        zeros), keyed by ``keyer``; none when they are not held."""
        rows = self._features.get(digest)
        if rows is None:
            return []
        length, width, b = int(rows.shape[0]), card.head_dim * 2, card.block_tokens
        keys = keyer.keys(self.rows_tokens(digest, length, b))
        rows = rows.reshape(length, card.num_layers, width).to(_TORCH[card.kv_dtype])
        rows = torch.cat([rows, rows.new_zeros((-length % b, card.num_layers, width))])
        layout, out = Layout(card), []
        for i, key in enumerate(keys.blocks):
            header = layout.header("block", key, keyer.parent_of(keys, i), i * b, b)
            blob, view = new_blob(header)
            at = 0
            for kind in range(card.num_layers):
                part = rows[i * b : (i + 1) * b, kind]
                for half in (part[:, : width // 2], part[:, width // 2 :]):
                    raw = half.contiguous().view(torch.uint8).numpy().reshape(-1)
                    view[at : at + raw.size] = raw.data  # the one copy, into the blob
                    at += raw.size
            out.append(layout.seal(header, blob))
        return out

    def take(self, digest: bytes, length: int, blocks: Sequence[Block]) -> None:
        """Hold the encoder rows of picture ``digest`` (``length`` positions) from
        ``blocks`` (its chain under its :meth:`rows_card`, each checked against it
        and verified by its digest): ValueError, holding nothing, unless they are
        whole, hold that many rows of this model's shape, and every value is finite."""
        width, kinds = self._row_shape()
        held = sum(blk.header.tokens for blk in blocks)
        if (
            not blocks
            or held < length
            or any(not blk.whole or len(blk.header.layers) != kinds for blk in blocks)
        ):
            raise ValueError("not a picture's encoder rows for this model")
        rows = torch.empty((held, kinds, width), dtype=self.model.dtype)
        for blk in blocks:  # each part copied once, into its place
            a, n = blk.header.start, blk.header.tokens
            for kind, parts in blk.kv_layers():
                for half, (spec, view) in enumerate(parts):
                    if spec.shape != (1, n, width // 2):
                        raise ValueError("the encoder rows are not this model's")
                    got = _tensor(view, spec.dtype).view(n, width // 2)
                    rows[a : a + n, kind, half * width // 2 : (half + 1) * width // 2] = got
        rows = rows[:length, 0] if kinds == 1 else rows[:length]
        if not bool(torch.isfinite(rows).all()):
            raise ValueError("the encoder rows are not this model's, or not finite")
        self._features.put(digest, rows, rows.numel() * rows.element_size())
        self.taken += 1

    def agrees(self, digest: bytes, tolerance: float) -> bool | None:
        """Whether the rows held for picture ``digest`` (taken from elsewhere) are
        what this engine's encoder computes from its pixels, within ``tolerance`` of
        the largest held value plus one (machines round differently); where not,
        its own rows replace them. None when the rows or the pixels are gone."""
        held, picture = self._features.get(digest), self._pixels.get(digest)
        if held is None or picture is None:
            return None
        own = self._encode(picture)
        bound = tolerance * (float(held.float().abs().max()) + 1.0)
        if own.shape == held.shape and float((own.float() - held.float()).abs().max()) <= bound:
            return True
        self._features.put(digest, own, own.numel() * own.element_size(), replace=True)
        return False

    def fresh(self) -> list[tuple[bytes, int]]:
        """(digest, length) of each picture encoded here since the last call."""
        out = []
        while self._fresh:
            out.append(self._fresh.popleft())
        return out

    def encoder_inputs(self, picture: Picture) -> dict[str, torch.Tensor]:
        """``picture``'s encoder inputs as the model takes a batch of it alone."""
        flat = self.family.flat
        return {k: v if k in flat else v[None] for k, v in picture.inputs.items()}

    @torch.inference_mode()
    def _encode(self, picture: Picture) -> torch.Tensor:
        """The encoder's output for ``picture``: one row per position it takes."""
        kw = self.encoder_inputs(picture)
        kw["pixel_values"] = kw["pixel_values"].to(self.model.dtype)
        if self.config.model_type == "llava":
            kw["vision_feature_layer"] = self.config.vision_feature_layer
            kw["vision_feature_select_strategy"] = self.config.vision_feature_select_strategy
        out = self.model.get_image_features(**kw, return_dict=True)
        feats = torch.cat(list(out.pooler_output), dim=0)
        feats = feats.reshape(-1, feats.shape[-1])
        if feats.shape[0] != picture.length:
            raise ValueError(f"the encoder gave {feats.shape[0]} rows for {picture.length}")
        deep = getattr(out, "deepstack_features", None)  # Qwen3-VL: rows for early layers
        if deep:
            feats = torch.stack([feats, *(torch.cat(list(d), dim=0) for d in deep)], dim=1)
        return feats
