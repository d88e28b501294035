"""Trust, but verify: recompute an imported block and compare it with the peer's bytes.

A fleet member that serves well-formed KV (right header, matching digest of its
own bytes) whose values are wrong is invisible to every structural check. With
``--audit-rate R`` a head recomputes, for a fraction R of remote hits, one
randomly chosen imported block locally (a prefill of the prompt up to that
block's end, off the request path) and compares the two. Numerics legitimately
differ a little between machines, so floating-point parts are compared with a
tolerance set by their dtype; integer parts (packed quantized KV) are skipped.
A peer whose bytes disagree is quarantined in this head's view for the life of
the process and counted.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..blocks import MEDIA_IDS, BlockKeyer
from ..codec import Block, TensorSpec, trim
from ..engine import Engine
from .planner import Planner
from .telemetry import Count, Tally

log = logging.getLogger("kvmesh.audit")

# max |a - b| allowed, relative to max(|b|) + 1: loose enough for kernels and
# thread counts that differ between machines, far below a perturbation that matters
TOLERANCE = {"float32": 1e-3, "float16": 1e-2, "bfloat16": 4e-2}


@dataclass(frozen=True)
class AuditJob:
    """One block to re-derive: the tokens up to its end, or to the end of a picture
    it cuts (computed with LoRA ``adapter``, as the request was), and who served it."""

    tokens: tuple[int, ...]
    block: Block
    index: int  # the block's position in its chain
    peer_id: str
    peer: str
    adapter: str | None = None


@dataclass(frozen=True)
class Taken:
    """A picture's encoder rows taken from a peer: its digest, their dtype (a card's
    name) and who served them."""

    digest: bytes
    dtype: str
    peer_id: str
    peer: str


class Auditor:
    def __init__(self, rate: float, seed: int | None = None) -> None:
        if not 0.0 <= rate <= 1.0:
            raise ValueError("the audit rate is a fraction in [0, 1]")
        self.rate = rate
        self._rng = random.Random(seed)

    def pick(
        self,
        tokens: Sequence[int],
        fetched: Sequence[tuple[int, Block]],
        peer_id: str,
        peer: str,
        adapter: str | None = None,
    ) -> AuditJob | None:
        """With probability ``rate``, one of the ``(chain index, block)`` pairs
        fetched from ``peer`` (full blocks only: a tail holds logits as well)."""
        full = [(i, b) for i, b in fetched if b.header.kind == "block"]
        if not full or self._rng.random() >= self.rate:
            return None
        i, blk = self._rng.choice(full)
        end = blk.header.start + blk.header.tokens
        cut = MEDIA_IDS.cut(tokens, end)  # a picture attended both ways is computed whole
        end = cut[1] if cut is not None else end
        return AuditJob(tuple(tokens[:end]), blk, i, peer_id, peer, adapter)

    def check(
        self,
        engine: Engine,
        lock: AbstractContextManager[Any],
        keyer: BlockKeyer,
        job: AuditJob,
        planner: Planner,
        count: Tally,
    ) -> None:
        """Recompute ``job``'s block (off the request path, ``lock``: the engine's,
        held as for any request) and quarantine its peer in ``planner`` when they
        disagree; counted ``audits`` and ``audit_mismatch``. Never raises."""
        try:
            with lock:
                agrees = self.agrees(engine, keyer, job)
        except Exception as e:  # an audit never fails anything else
            log.warning("audit failed: %r", e)
            return
        _verdict(agrees, job.peer_id, job.peer, "KV", planner, count)

    def chance(self) -> bool:
        """True with probability ``rate``: whether to audit one more thing taken."""
        return self._rng.random() < self.rate

    def check_rows(
        self,
        vision: Any,
        lock: AbstractContextManager[Any],
        taken: Taken,
        planner: Planner,
        count: Tally,
    ) -> None:
        """Encode the picture whose rows were ``taken`` from a peer again (``lock``
        held) and compare (:meth:`~kvmesh.engine.vision.Vision.agrees`: ours replace
        theirs where they disagree); the peer is quarantined as for KV, and counted
        alike. Never raises."""
        try:
            with lock:
                agrees = vision.agrees(taken.digest, TOLERANCE.get(taken.dtype, 1e-3))
        except Exception as e:  # an audit never fails anything else
            log.warning("audit of a picture's rows failed: %r", e)
            return
        _verdict(agrees, taken.peer_id, taken.peer, "picture rows", planner, count)

    @staticmethod
    def agrees(engine: Engine, keyer: BlockKeyer, job: AuditJob) -> bool | None:
        """Whether a local recompute of ``job.block`` matches the imported bytes;
        None when the block cannot be re-derived here (e.g. past a window)."""
        state = engine.prefill(list(job.tokens), adapter=job.adapter)
        mine = [
            b for b in engine.export(state, keyer, first_block=job.index) if b.key == job.block.key
        ]
        if not mine:
            return None
        theirs = job.block  # a trimmed block (a window's import) is compared on its parts
        ours = mine[0] if theirs.whole else trim(mine[0], theirs.present)
        return _close(_present(ours), _present(theirs))


def _verdict(
    agrees: bool | None, peer_id: str, peer: str, what: str, planner: Planner, count: Tally
) -> None:
    """Count an audit that could compare (``agrees`` not None); quarantine ``peer``
    in ``planner`` when what it served disagreed."""
    if agrees is None:
        return
    count(Count.AUDITS)
    if not agrees:
        count(Count.AUDIT_MISMATCH)
        planner.quarantine(peer_id)
        log.warning("peer %s served %s that disagrees with a recompute: quarantined", peer, what)


def _present(block: Block) -> list[tuple[TensorSpec, memoryview]]:
    """The tensors of a block's present parts, in payload order."""
    out = [t for _, layer in block.kv_layers() for t in layer]
    out += [(spec, view) for _, spec, view in block.state_tensors()]
    if block.header.logits is not None:
        out.append((block.header.logits, block.logits_bytes()))
    return out


def _close(
    ours: list[tuple[TensorSpec, memoryview]], theirs: list[tuple[TensorSpec, memoryview]]
) -> bool:
    if [s for s, _ in ours] != [s for s, _ in theirs]:
        return False
    for (spec, a), (_, b) in zip(ours, theirs, strict=True):
        tol = TOLERANCE.get(spec.dtype)
        if tol is None:
            continue  # packed integers: a one-step rounding difference is not an attack
        x, y = _floats(a, spec.dtype), _floats(b, spec.dtype)
        if not (
            np.isfinite(y).all()
            and np.abs(x - y).max(initial=0.0) <= tol * (np.abs(x).max(initial=0.0) + 1)
        ):
            return False
    return True


def _floats(view: memoryview, dtype: str) -> np.ndarray:
    if dtype == "bfloat16":  # the upper half of a float32
        return (np.frombuffer(view, np.uint16).astype(np.uint32) << 16).view(np.float32)
    return np.frombuffer(view, np.dtype(dtype)).astype(np.float32)
