"""What vLLM carries between the connector's two roles, every step: the scheduler's
metadata for the workers (asks, loads, saves, drops) and the workers' answers
(pages promised, pages ready to load in a step, load reports, cards, KV events),
merged over the ranks. Plain dataclasses: vLLM pickles them across its processes.

A request's block ids are kept per KV cache group (:data:`GroupIds`): page ``i`` of
group ``g`` is ``ids[g][i]``, 0 (vLLM's null block) where the group holds none.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorMetadata,
    KVConnectorWorkerMetadata,
)

from .spec import PLAIN, Scope

# -- scheduler -> workers (every step) ----------------------------------------------


@dataclass
class Ask:
    req_id: str
    tokens: list[int]  # the prompt's full pages that vLLM does not compute itself
    scope: Scope = PLAIN  # what its keys hash besides tokens (salt, adapter, media)


#: A request's vLLM block ids, one list per KV cache group: page i of group g in
#: ``ids[g][i]``, 0 (vLLM's null block) where the group holds none (a sliding
#: window's pages behind it).
GroupIds = list[list[int]]


@dataclass
class LoadSpec:
    req_id: str
    block_ids: GroupIds  # the request's vLLM blocks
    first_page: int  # pages before this are vLLM's own prefix cache
    pages: int  # load pages [first_page, pages)
    # in this step, before its forward (every page was verified in memory when offered:
    # the request is in this step's batch); else on a load thread, reported finished
    sync: bool = False


@dataclass
class SaveSpec:
    """Pages [first, first + len(block_ids[0])) of a prompt, computed by this step's
    end: copied now (a sliding window frees its pages at the next step), stored and
    published with the rest of the chain once ``final`` (the prefill is complete)."""

    req_id: str
    tokens: list[int]  # the prompt's full pages up to this step's last
    block_ids: GroupIds  # per group, the ids of pages [first, ...)
    first: int = 0
    final: bool = True
    scope: Scope = PLAIN
    state_page: int = -1  # the page this step's forward ended on, its state vLLM's checkpoint


@dataclass
class KVMeshMetadata(KVConnectorMetadata):
    asks: list[Ask] = field(default_factory=list)  # find these prompts' pages
    loads: list[LoadSpec] = field(default_factory=list)
    saves: list[SaveSpec] = field(default_factory=list)
    drops: list[str] = field(default_factory=list)  # finished: forget their pages
    step_tokens: int = 0


# -- workers -> scheduler (every step, merged over the ranks) ------------------------


@dataclass
class KVMeshWorkerMeta(KVConnectorWorkerMetadata):
    answers: dict[str, dict[int, int]] = field(default_factory=dict)  # req -> rank -> pages
    # req -> rank -> pages verified in memory, from the first, once its acquisition
    # ended (only where vLLM can take a failed page back by its block id)
    ready: dict[str, dict[int, int]] = field(default_factory=dict)
    reports: dict[str, dict[int, dict[str, Any]]] = field(default_factory=dict)  # load results
    cards: dict[int, list[str]] = field(default_factory=dict)  # rank -> [engine, namespace]
    # KV events (rank 0 only: the other ranks hold the same prefixes): msgpack lists
    # of vLLM events, and the store changes dropped before they could be sent
    events: list[bytes] = field(default_factory=list)
    events_dropped: int = 0

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVMeshWorkerMeta:
        assert isinstance(other, KVMeshWorkerMeta)
        pairs = (
            (self.answers, other.answers),
            (self.ready, other.ready),
            (self.reports, other.reports),
        )
        for mine, theirs in pairs:
            for req_id, by_rank in theirs.items():
                mine.setdefault(req_id, {}).update(by_rank)  # type: ignore[arg-type]
        self.cards.update(other.cards)
        self.events.extend(other.events)
        self.events_dropped += other.events_dropped
        return self


# -- block ids ------------------------------------------------------------------------


def group_ids(ids: Iterable[Iterable[int]]) -> GroupIds:
    """vLLM's block ids (a tuple with one list per KV cache group) as kvmesh keeps them."""
    return [list(g) for g in ids]


def page_ids(ids: GroupIds, page: int, first: int = 0) -> list[int | None]:
    """Page ``page``'s block id in each group (lists starting at page ``first``), None
    where vLLM holds none (its null block, 0)."""
    return [g[page - first] or None for g in ids]


def ids_of(ids: GroupIds, start: int, stop: int) -> list[int]:
    """The real (non-null) block ids of pages [start, stop) over every group."""
    return [b for g in ids for b in g[start:stop] if b]
