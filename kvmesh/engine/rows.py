"""Which sequence each row of a forward is, for what a forward's own tokens cannot
tell: inside :func:`forward_rows`, row ``i`` of every forward continues ``sequences[i]``
(its tokens from position 0, through at least the forward's last real position)
and takes LoRA adapter ``adapters[i]`` (:func:`kvmesh.engine.lora.rows`).

A sequence's rotary positions under M-RoPE (Qwen2-VL's) depend on every picture
before a forward's first position (:meth:`kvmesh.engine.vision.Vision.positions`);
an engine reads them from :func:`sequences` rather than from state kept on the model
between calls, which concurrent sequences would share.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator, Sequence

from . import lora

_local = threading.local()  # .sequences: each row's tokens in forwards within forward_rows()


@contextlib.contextmanager
def forward_rows(
    adapters: Sequence[str | None], sequences: Sequence[Sequence[int]]
) -> Iterator[None]:
    """Within it, row ``i`` of every forward is ``sequences[i]`` with adapter
    ``adapters[i]`` (None: none)."""
    if len(adapters) != len(sequences):
        raise ValueError(f"{len(adapters)} adapters for {len(sequences)} sequences")
    before = getattr(_local, "sequences", None)
    _local.sequences = tuple(sequences)
    try:
        with lora.rows(adapters):
            yield
    finally:
        _local.sequences = before


def sequences() -> tuple[Sequence[int], ...] | None:
    """Each row's sequence in the :func:`forward_rows` this thread is within (None: none)."""
    return getattr(_local, "sequences", None)
