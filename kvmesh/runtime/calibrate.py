"""Codec calibration: what each part codec achieves on this machine's own KV bytes,
and which one a fetch over a given link asks for.

:meth:`Calibrator.calibrate` samples real blocks (a fetched or exported one) off
the request path: on a background thread, one sample at a time, at most once a
minute (:meth:`kvmesh.squeeze.Calibration.sample`). Until a sample lands every
fetch asks for raw parts. :meth:`Calibrator.codec` is the acquisition's question:
the codec that moves a fetch's bytes fastest over a link, and the ratio it gets.
"""

from __future__ import annotations

import threading

from .. import squeeze
from ..codec import Block, part_itemsize


class Calibrator:
    """One process's codec measurements (shared by its acquisitions and exports)."""

    def __init__(self) -> None:
        self._codecs = squeeze.Calibration()
        self._sampling = threading.Lock()  # held while a sample runs: one at a time

    def calibrate(self, block: Block) -> None:
        """Measure the part codecs on ``block``'s KV bytes, off the caller's thread;
        nothing when a sample is already running (or ran within the minute)."""
        if self._sampling.acquire(blocking=False):
            itemsize = max(part_itemsize(block.header, i) for i in range(len(block.header.layers)))
            threading.Thread(
                target=self._sample, args=(block, itemsize), name="kvmesh-calibrate", daemon=True
            ).start()

    def _sample(self, block: Block, itemsize: int) -> None:
        try:
            self._codecs.sample(block.payload(), itemsize)
        finally:
            self._sampling.release()

    def codec(self, rate: float, wire: int) -> tuple[str, float]:
        """The codec that moves ``wire`` bytes fastest over a link of ``rate`` bytes/s
        as measured here, and its ratio (raw: 1.0)."""
        name = self._codecs.best(rate, wire)
        if name == "raw":
            return name, 1.0
        return name, max(self._codecs.stats().get(name, {}).get("ratio", 1.0), 1.0)

    def stats(self) -> dict[str, dict[str, float]]:
        """Per codec, what it achieved here (see :meth:`kvmesh.squeeze.Calibration.stats`)."""
        return self._codecs.stats()
