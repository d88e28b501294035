"""Several sequences' rows in one forward, packed end to end (no padding).

Segment ``i`` of a packed forward is the next ``q_i`` tokens of sequence ``i``,
after the ``p_i`` positions its own cache holds. The model's linear layers and
per-row ops see one row of ``sum(q_i)`` tokens; :class:`PackedRows` stands in for
the cache, so each layer's keys and values go into each sequence's own cache, and
each segment attends over its own cache only, as that sequence's lone forward
would (:meth:`PackedRows.attend`: the split pass of :mod:`.attention` over a
history, else transformers' SDPA, which a lone forward takes there too).

The caller passes each row's position (:meth:`PackedRows.positions`), the mask
:meth:`PackedRows.mask` (a placeholder: the segments are the mask) and keeps the
logits at :meth:`PackedRows.last_rows`, inside :func:`kvmesh.engine.attention.packed`.
Plain softmax attention of full-attention layers only: a call with a sliding
window, sinks, a soft cap or a bias raises :class:`NotPackable`. A forward that
raises leaves each cache as it was once :meth:`PackedRows.rollback` ran (a cache
layer's update concatenates into new tensors: the old ones are intact).
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import accumulate
from typing import Any

import torch

from .attention import plain, split


class NotPackable(RuntimeError):
    """An attention call packed rows cannot compute as a lone forward would."""


class PackedRows:
    """One packed forward's segments: the caches they continue, where each starts
    (its cached positions) and how many rows it has."""

    def __init__(self, caches: Sequence[Any], pasts: Sequence[int], lengths: Sequence[int]) -> None:
        if not len(caches) == len(pasts) == len(lengths) or min(lengths, default=0) < 1:
            raise ValueError("one cache, past and length (at least 1) per segment")
        self.caches, self.pasts, self.lengths = list(caches), list(pasts), list(lengths)
        ends = list(accumulate(self.lengths))
        self.bounds = list(zip([0, *ends[:-1]], ends, strict=True))
        self._kept = [[_layer_refs(ly) for ly in c.layers] for c in self.caches]
        self._kv: list[tuple[torch.Tensor, torch.Tensor]] = []

    def positions(self) -> torch.Tensor:
        """``[1, sum(q_i)]``: each segment's positions after its cached ones."""
        return torch.cat(
            [torch.arange(p, p + q) for p, q in zip(self.pasts, self.lengths, strict=True)]
        )[None]

    def last_rows(self) -> torch.Tensor:
        """The row of each segment's last token (its next-token logits)."""
        return torch.tensor([b - 1 for _, b in self.bounds])

    @staticmethod
    def mask() -> torch.Tensor:
        """The mask a packed forward passes: a 4-D placeholder, which transformers
        hands through untouched (the segments are the mask; :meth:`attend` never
        reads it)."""
        return torch.ones((1, 1, 1, 1), dtype=torch.bool)

    # -- the cache's part --------------------------------------------------------------

    def update(
        self, keys: torch.Tensor, values: torch.Tensor, layer_idx: int, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Each segment's keys and values into its own cache; the whole keys and
        values back (the attention reads each segment's from :meth:`attend`)."""
        self._kv = [
            cache.update(keys[:, :, a:b], values[:, :, a:b], layer_idx)
            for cache, (a, b) in zip(self.caches, self.bounds, strict=True)
        ]
        return keys, values

    def attend(
        self, module: Any, query: torch.Tensor, scaling: float | None, kwargs: dict[str, Any]
    ) -> torch.Tensor:
        """Each segment's attention over its own cache: ``[1, sum(q_i), heads, dim]``."""
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        if (
            not plain(kwargs)
            or kwargs.get("sliding_window")
            or not getattr(module, "is_causal", True)
        ):
            raise NotPackable("packed rows need plain causal attention of full layers")
        out = []
        for (k, v), (a, b), past in zip(self._kv, self.bounds, self.pasts, strict=True):
            q = query[:, :, a:b]
            if b - a > 1 and past:
                out.append(split(q, k, v, scaling).transpose(1, 2))
            else:
                out.append(sdpa_attention_forward(module, q, k, v, None, 0.0, scaling, None)[0])
        return torch.cat(out, 1)

    def rollback(self) -> None:
        """Every cache as it was before the forward."""
        for cache, kept in zip(self.caches, self._kept, strict=True):
            for layer, refs in zip(cache.layers, kept, strict=True):
                layer.__dict__.update(refs)


def _layer_refs(layer: Any) -> dict[str, Any]:
    return {k: getattr(layer, k) for k in ("keys", "values", "is_initialized") if hasattr(layer, k)}
