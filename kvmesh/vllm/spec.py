"""What a vLLM deployment is, read from its config, in kvmesh's terms: the cache
spec the connector serves (or a clear refusal), the card's engine string, layer
order and windows, the model's files, and which requests kvmesh's keys describe.
"""

from __future__ import annotations

import hashlib
import logging
import threading
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..blocks import (
    ADAPTER_FILES,
    BlockKeyer,
    Media,
    PrefixKeys,
    adapter_digest,
    check_cache_salt,
    request_root,
)
from ..errors import ConfigError
from .pages import DTYPES, FP8, CacheSpec

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

log = logging.getLogger("kvmesh.vllm")


def cache_spec(kv_cache_config: KVCacheConfig, cache_dtype: str = "auto") -> CacheSpec:
    """Attention KV in one or more groups, each at its own page shape (KV heads and
    head dim: Gemma 4's full and sliding layers differ) but of one dtype and one
    block size, plus recurrent state groups, or a clear error. The scalar heads and
    dim are the first group's; each layer's come from :func:`layer_kv` once the
    worker knows the layers' order. With vLLM's hybrid manager sliding-window layers are a
    group of their own (pages behind the window are freed: a page is saved in the
    step that computes it); without it they are full-attention pages that keep
    every position. Gated DeltaNet / Mamba state is served in vLLM's
    ``--mamba-cache-mode align`` (a state kept at block boundaries), MLA's latent
    pages like any page; chunked-local attention, DeepSeek-V4's sparse MLA and
    quantized KV other than per-tensor FP8 are not."""
    groups = kv_cache_config.kv_cache_groups
    if not groups:
        raise ConfigError("vLLM gave KVMeshConnector no KV cache group")
    specs = [g.kv_cache_spec for g in groups]
    attention = [s for s in specs if not _is_state(s)]
    for spec in specs:
        _check_served(spec)
    if not attention:
        raise ConfigError("KVMeshConnector serves models with attention layers; this has none")
    kinds = {(s.dtype, int(getattr(s, "kv_quant_mode", 0))) for s in attention}
    if len(kinds) != 1:
        raise ConfigError(
            "KVMeshConnector serves KV cache groups of one dtype; these differ: "
            f"{sorted(map(str, kinds))}"
        )
    sizes = {int(s.block_size) for s in specs}
    if len(sizes) != 1:
        raise ConfigError(
            "KVMeshConnector needs one block size over all KV cache groups (a kvmesh block "
            f"is one page of every layer); vLLM made {sorted(sizes)} (it scales a group's "
            "block size when the groups' page sizes differ)"
        )
    spec = attention[0]
    heads, dim = _page_shape(spec)
    return CacheSpec(
        num_layers=sum(len(g.layer_names) for g in groups),
        num_kv_heads=int(heads),
        head_dim=int(dim),
        block_size=int(spec.block_size),
        kv_dtype=kv_dtype(spec, cache_dtype),
    )


def _page_shape(spec: Any) -> tuple[int, int]:
    """A KV group's (heads, head dim) in the card. MLA's page is one latent vector per
    token: it travels as the two halves of its bytes under the codec's K and V specs
    (the backend in the engine string says MLA)."""
    if _is_latent(spec):
        return 1, int(spec.head_size) // 2
    return int(spec.num_kv_heads), int(spec.head_size)


def layer_kv(kv_cache_config: KVCacheConfig, names: list[str]) -> tuple[tuple[int, int], ...]:
    """Each layer's (KV heads, head dim) in ``names``' order: (0, 0) for a recurrent
    layer, and for a layer in no group (one that reads another layer's KV)."""
    by_layer: dict[str, tuple[int, int]] = {}
    for g in kv_cache_config.kv_cache_groups:
        spec = g.kv_cache_spec
        if not _is_state(spec):
            by_layer.update(dict.fromkeys(g.layer_names, _page_shape(spec)))
    return tuple(by_layer.get(n, (0, 0)) for n in names)


def shared_layers(
    vllm_config: VllmConfig, registered: list[str], grouped: dict[str, int]
) -> dict[str, str]:
    """The layers vLLM registered a cache for outside every KV cache group: those
    that read another layer's KV (Gemma 3n/4's KV sharing; vLLM hands them their
    target's tensor), each with its target. Any other is a clear error."""
    ctx = vllm_config.compilation_config.static_forward_context
    out: dict[str, str] = {}
    for name in registered:
        if name in grouped:
            continue
        target = getattr(ctx.get(name), "kv_sharing_target_layer_name", None)
        if not target or target not in grouped:
            raise ConfigError(
                f"vLLM registered a cache for layer {name!r}, which is in no KV cache group "
                "and reads no grouped layer's KV"
            )
        out[name] = target
    return out


def _is_state(spec: Any) -> bool:
    from vllm.v1.kv_cache_interface import MambaSpec

    return isinstance(spec, MambaSpec)


def _is_latent(spec: Any) -> bool:
    from vllm.v1.kv_cache_interface import MLAAttentionSpec

    return isinstance(spec, MLAAttentionSpec)


def _check_served(spec: Any) -> None:
    """A clear refusal for a group the connector cannot page."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec

    name = type(spec).__name__
    if _is_state(spec):
        if spec.mamba_cache_mode != "align":
            raise ConfigError(
                "KVMeshConnector serves recurrent state (Gated DeltaNet, Mamba) with vLLM's "
                "--mamba-cache-mode align, which keeps a state at block boundaries; with "
                f"{spec.mamba_cache_mode!r} no state a later request could start from is kept"
            )
        if spec.num_prefill_checkpoint_blocks or spec.num_speculative_blocks:
            raise ConfigError(
                f"KVMeshConnector does not serve {name} with checkpoints inside a prefill "
                f"chunk or speculative state blocks: {spec}"
            )
        return
    if _is_latent(spec):
        if spec.head_size % 2 or spec.alignment or spec.model_version or spec.sliding_window:
            raise ConfigError(f"KVMeshConnector does not serve this MLA cache: {spec}")
        return
    plain = (
        type(spec) in (FullAttentionSpec, SlidingWindowSpec)
        and getattr(spec, "attention_chunk_size", None) is None
        and getattr(spec, "head_size_v", spec.head_size) in (None, spec.head_size)
        and getattr(spec, "page_size_padded", None) is None
    )
    if not plain:
        raise ConfigError(f"KVMeshConnector does not serve {name} caches: {spec}")


def layer_states(
    kv_cache_config: KVCacheConfig, names: list[str]
) -> tuple[tuple[tuple[str, tuple[int, ...]], ...], ...]:
    """Each layer's recurrent state tensors, (dtype, shape) in vLLM's page order (()
    for an attention layer); () when no layer holds state."""
    by_layer: dict[str, tuple[tuple[str, tuple[int, ...]], ...]] = {}
    for g in kv_cache_config.kv_cache_groups:
        spec = g.kv_cache_spec
        if _is_state(spec):
            state = tuple(
                (str(d).removeprefix("torch."), tuple(int(n) for n in shape))
                for shape, d in zip(spec.shapes, spec.dtypes, strict=True)
            )
            by_layer.update(dict.fromkeys(g.layer_names, state))
    if not by_layer:
        return ()
    return tuple(by_layer.get(n, ()) for n in names)


def kv_dtype(spec: Any, cache_dtype: str) -> str:
    """The card's KV dtype: the model's, or vLLM's FP8 with one scale per layer for
    K and for V (``FP8_PER_TENSOR``: the page holds FP8 values and nothing else)."""
    mode = getattr(spec, "kv_quant_mode", 0)
    if int(mode) == 0 and spec.dtype in DTYPES:
        return DTYPES[spec.dtype]
    if getattr(mode, "name", "") == "FP8_PER_TENSOR" and cache_dtype in FP8:
        return FP8[cache_dtype]
    raise ConfigError(
        f"KVMeshConnector does not serve a {spec.dtype} KV cache "
        f"(kv_cache_dtype {cache_dtype!r}, {getattr(mode, 'name', mode)})"
    )


def kv_scales(vllm_config: VllmConfig, names: list[str]) -> str:
    """A digest of every layer's K and V scale, for an FP8 card's engine string: the
    same bytes under other scales are other numbers."""
    ctx = vllm_config.compilation_config.static_forward_context
    scales = [
        (
            float(getattr(ctx.get(n), "_k_scale_float", 1.0)),
            float(getattr(ctx.get(n), "_v_scale_float", 1.0)),
        )
        for n in names
    ]
    return hashlib.sha256(repr(scales).encode()).hexdigest()[:12]


def layer_windows(vllm_config: VllmConfig, names: list[str]) -> tuple[int, ...]:
    """Each attention layer's sliding window as vLLM built the layer (0: none)."""
    ctx = vllm_config.compilation_config.static_forward_context
    return tuple(int(getattr(ctx.get(n), "sliding_window", None) or 0) for n in names)


def model_dirs(vllm_config: VllmConfig) -> tuple[Path, Path]:
    mc = vllm_config.model_config
    return _local_dir(mc.model, mc.revision), _local_dir(mc.tokenizer or mc.model, None)


def _local_dir(name: str, revision: str | None) -> Path:
    path = Path(name)
    if path.is_dir():
        return path
    try:  # a hub id vLLM has already downloaded
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(name, revision=revision, local_files_only=True))
    except Exception:
        raise ConfigError(
            f"kvmesh needs the model's files on disk to derive its card; {name!r} is not a "
            "local directory or a downloaded hub snapshot"
        ) from None


def engine_name(vllm_config: VllmConfig, layer: str, kind: str, rank: int, world: int) -> str:
    """vLLM version, platform, attention backend, page layout, model dtype, compilation,
    and which tensor-parallel shard of the KV heads (rank of world size) the pages hold."""
    import vllm
    from vllm.platforms import current_platform

    ctx = vllm_config.compilation_config.static_forward_context.get(layer)
    backend = getattr(getattr(ctx, "attn_backend", None), "get_name", lambda: "unknown")()
    dtype = str(vllm_config.model_config.dtype).removeprefix("torch.")
    mode = vllm_config.compilation_config.mode
    return (
        f"vllm/{vllm.__version__}/{current_platform.device_type}/{backend}/{kind}/{dtype}/"
        f"compile={getattr(mode, 'name', mode)}/tp={rank}of{world}"
    )


def model_order(names: list[str]) -> list[str]:
    """Layer names in the model's order (vLLM lists them group by group)."""
    from vllm.model_executor.models.utils import extract_layer_index

    try:
        return sorted(names, key=extract_layer_index)
    except (AssertionError, ValueError):  # names without one layer number: vLLM's order
        return names


@dataclass(frozen=True)
class Scope:
    """What a request's keys hash besides its token ids (picklable: the scheduler
    hands it to the workers): vLLM's ``cache_salt`` and its LoRA adapter's weights
    digest (:func:`~kvmesh.blocks.adapter_digest`), which root its chain where the
    head's API roots it (:func:`~kvmesh.blocks.request_root`), and its multimodal
    items' placeholder spans (:class:`~kvmesh.blocks.Media`), hashed into the
    pages that overlap them."""

    salt: str | None = None
    adapter: bytes | None = None
    media: tuple[Media, ...] = ()

    def keyer(self, keyer: BlockKeyer) -> BlockKeyer:
        """``keyer`` rooted for this scope; ``keyer`` itself for the plain one. The
        keyer of an adapter or of media records no tokens, so their blocks' KV events
        carry none: a router that hashes token ids would take them for text blocks
        of the base model."""
        root = request_root(keyer.namespace, None, self.salt, self.adapter)
        if self.adapter or self.media:
            return BlockKeyer.rooted(keyer, keyer.root if root is None else root)
        return keyer if root is None else keyer.rooted(root)

    def keys(self, keyer: BlockKeyer, tokens: list[int]) -> PrefixKeys:
        return self.keyer(keyer).keys(tokens, self.media)


PLAIN = Scope()


def scope_of(request: Request) -> Scope | None:
    """The scope of a request whose KV kvmesh's keys describe, else None: a bad
    ``cache_salt``, prompt embeddings, or a LoRA adapter whose files cannot be read
    (vLLM resolved it to no local directory). Each multimodal item is keyed by its
    placeholder span and vLLM's own hash of it (``identifier``: of the item's data
    and processor options, as vLLM's prefix cache keys it; a client's
    ``multi_modal_uuids`` replace it, as they do there)."""
    salt = getattr(request, "cache_salt", None)
    if salt is not None:
        try:
            check_cache_salt(salt)
        except ValueError:
            return None
    if getattr(request, "prompt_embeds", None) is not None:
        return None
    try:
        media = tuple(_media(f) for f in getattr(request, "mm_features", None) or ())
    except (AttributeError, TypeError, ValueError):  # not the feature vLLM 0.32 makes
        return None
    lora = getattr(request, "lora_request", None)
    if lora is None:
        return Scope(salt, None, media) if salt or media else PLAIN
    digest = _ADAPTERS.digest(str(getattr(lora, "lora_path", "") or ""))
    return None if digest is None else Scope(salt, digest, media)


def _media(feature: Any) -> Media:
    """One of vLLM's ``MultiModalFeatureSpec`` as a span kvmesh's keys hash."""
    pos = feature.mm_position
    ident = f"{feature.modality}\x00{feature.identifier}".encode()
    return Media(int(pos.offset), int(pos.length), hashlib.sha256(ident).digest())


class _AdapterDigests:
    """:func:`~kvmesh.blocks.adapter_digest` per adapter directory, read once (again
    when any of its files changes: a stale digest would key new weights' KV under the
    old ones'; the first request of an adapter reads its files in the scheduler),
    failures too (logged once), at most ``size`` kept."""

    def __init__(self, size: int = 64) -> None:
        self._size = size
        self._lock = threading.Lock()
        self._digests: OrderedDict[tuple[object, ...], bytes | None] = OrderedDict()

    def digest(self, path: str) -> bytes | None:
        key = (path, *map(_stamp, (Path(path) / name for name in ADAPTER_FILES)))
        with self._lock:
            if key in self._digests:
                self._digests.move_to_end(key)
                return self._digests[key]
        try:
            digest: bytes | None = adapter_digest(path)
        except (OSError, ValueError) as e:
            log.warning("kvmesh: LoRA adapter %r is not cached (%s): its requests compute", path, e)
            digest = None
        with self._lock:
            self._digests[key] = digest
            while len(self._digests) > self._size:
                self._digests.popitem(last=False)
        return digest


def _stamp(path: Path) -> tuple[int, int]:
    """What tells a file changed: its mtime and size ((-1, -1): absent)."""
    try:
        st = path.stat()
    except OSError:
        return (-1, -1)
    return (st.st_mtime_ns, st.st_size)


_ADAPTERS = _AdapterDigests()
