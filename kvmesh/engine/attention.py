"""Prefill attention over a cached history without a mask (transformers, CPU).

A lone sequence's forward that continues a cache attends with its ``q`` new
positions to all ``p`` cached ones and causally among themselves. transformers
builds that as a ``q × (p + q)`` boolean mask, and SDPA's CPU kernel turns it into
an additive float mask in every layer and reads it for every score: on a long
history that is a third of the forward. :func:`attention` computes it as two
mask-free flash passes, the history (no mask) and the new positions (causal),
merged by their log-sum-exps; within 1e-5 of the masked pass in float32, and
deterministic (the same cache and tokens give the same bits).

The split runs only inside :func:`continuing` (the engine's lone-sequence forward,
no padding) and only where it is exactly that pattern: the mask function is
transformers' plain causal one and the queries are the last positions (else, and
for every other call, transformers' SDPA with its own mask, unchanged). Installed
as the attention implementation :data:`NAME` (:func:`install`), which the card's
engine names, so blocks computed this way are a namespace of their own.

Within :func:`packed` every call of the implementation is handed to the packed
rows' own ``attend`` (:mod:`kvmesh.engine.packed`: several sequences' rows end to
end in one forward, each attending over its own cache).
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from typing import Any

import torch

NAME = "kvmesh_sdpa"
_CONTINUING: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "kvmesh_continuing", default=False
)
_PACKED: contextvars.ContextVar[Any] = contextvars.ContextVar("kvmesh_packed", default=None)
_FLASH = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)


def has_flash_kernel() -> bool:
    """Whether this torch has the CPU flash kernel that returns log-sum-exps."""
    return _FLASH is not None


@contextlib.contextmanager
def continuing() -> Iterator[None]:
    """Marks a forward as one unpadded sequence continuing its own cache."""
    token = _CONTINUING.set(True)
    try:
        yield
    finally:
        _CONTINUING.reset(token)


@contextlib.contextmanager
def packed(rows: Any) -> Iterator[None]:
    """Within it, attention is ``rows.attend(module, query, scaling, kwargs)``."""
    token = _PACKED.set(rows)
    try:
        yield
    finally:
        _PACKED.reset(token)


def mask(
    batch_size: int,
    q_length: int,
    kv_length: int,
    q_offset: Any = 0,
    kv_offset: int = 0,
    mask_function: Any = None,
    attention_mask: torch.Tensor | None = None,
    **kwargs: Any,
) -> torch.Tensor | None:
    """transformers' SDPA mask, except ``None`` for a continuing forward's plain
    causal mask with queries at the end (:func:`attention` then splits)."""
    from transformers.masking_utils import causal_mask_function, sdpa_mask

    mask_function = mask_function or causal_mask_function
    if (
        _CONTINUING.get()
        and mask_function is causal_mask_function
        and attention_mask is None
        and kv_offset == 0
        and 1 < q_length < kv_length
        and isinstance(q_offset, int)
        and q_offset == kv_length - q_length
    ):
        return None
    args = dict(kwargs, mask_function=mask_function, attention_mask=attention_mask)
    m = sdpa_mask(batch_size, q_length, kv_length, q_offset, kv_offset, **args)
    if m is None and 1 < q_length < kv_length:
        # SDPA's own skip here means top-left causal (an empty static cache):
        # spelled out, so that ``None`` with a history always means the split
        m = sdpa_mask(
            batch_size, q_length, kv_length, q_offset, kv_offset, **args, allow_is_causal_skip=False
        )
    return m


def attention(
    module: Any,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' attention-function contract: ``[batch, q, heads, dim]``."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if (rows := _PACKED.get()) is not None:
        return rows.attend(module, query, scaling, kwargs), None
    q, kv = query.shape[2], key.shape[2]
    if (
        attention_mask is None
        and 1 < q < kv
        and _CONTINUING.get()
        and plain(kwargs)
        and dropout == 0.0
        and is_causal is not False
        and getattr(module, "is_causal", True)
        and query.shape[-1] == key.shape[-1] == value.shape[-1]
    ):
        return split(query, key, value, scaling).transpose(1, 2).contiguous(), None
    return sdpa_attention_forward(  # type: ignore[no-any-return]
        module, query, key, value, attention_mask, dropout, scaling, is_causal, **kwargs
    )


def plain(kwargs: dict[str, Any]) -> bool:
    """Whether an attention call's extra arguments leave it plain softmax attention
    (no sinks, no soft cap, no position bias)."""
    return not any(kwargs.get(k) is not None for k in ("s_aux", "softcap", "position_bias"))


def split(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float | None
) -> torch.Tensor:
    """Causal attention of ``query`` (the last positions of ``key``/``value``):
    ``[batch, heads, q, dim]``. Grouped heads share their key head: the history's
    pass folds a group's queries into one (no copy of the cache)."""
    assert _FLASH is not None
    b, h, q, d = query.shape
    hk, p = key.shape[1], key.shape[2] - q
    g = h // hk
    past = _FLASH(
        query.reshape(b, hk, g * q, d), key[:, :, :p], value[:, :, :p], 0.0, False, scale=scale
    )
    k_new, v_new = _grouped(key[:, :, p:], g), _grouped(value[:, :, p:], g)
    new = _FLASH(query, k_new, v_new, 0.0, True, scale=scale)
    o1, l1 = past[0].reshape(b, h, q, d).float(), past[1].reshape(b, h, q).float()
    o2, l2 = new[0].float(), new[1].float()
    top = torch.maximum(l1, l2)
    w1, w2 = torch.exp(l1 - top), torch.exp(l2 - top)
    out = (o1 * w1.unsqueeze(-1) + o2 * w2.unsqueeze(-1)) / (w1 + w2).unsqueeze(-1)
    return out.to(query.dtype)


def _grouped(x: torch.Tensor, g: int) -> torch.Tensor:
    """``[b, hk, n, d]`` → ``[b, hk * g, n, d]``, each key head for its g queries."""
    if g == 1:
        return x
    b, hk, n, d = x.shape
    if hk == 1:
        return x.expand(b, g, n, d)
    return x[:, :, None].expand(b, hk, g, n, d).reshape(b, hk * g, n, d)


def implementations(config: Any) -> dict[str, Any]:
    """For ``set_attn_implementation``: :data:`NAME` for a config (and each of its
    sub-configs: text, vision, audio) that runs SDPA, the others' own kept."""
    own = config._attn_implementation
    out: dict[str, Any] = {"": NAME if own == "sdpa" else own}
    for key in config.sub_configs:
        sub = getattr(config, key, None)
        if sub is not None:
            out[key] = implementations(sub)
    return out


def install() -> bool:
    """Registers :data:`NAME` with transformers (once per process); False where
    this torch lacks the kernel."""
    if not has_flash_kernel():
        return False
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(NAME, attention)
    AttentionMaskInterface.register(NAME, mask)
    return True
