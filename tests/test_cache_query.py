"""POST /v1/cache/query on real head and peer processes: the answer equals what
the next completion of the same prompt reports (local, disk and remote)."""

from __future__ import annotations

import random
import time

import pytest

from .procs import Peer
from .test_api import Head

VOCAB = 320  # demo-tiny's
B = 32  # demo-tiny's block tokens


def prompt(seed: int, n: int = 3 * B + 5) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(VOCAB) for _ in range(n)]


def query(head: Head, tokens: list[int]) -> dict:
    r = head.http.post("/v1/cache/query", json={"model": "demo-tiny", "token_ids": tokens})
    assert r.status_code == 200, r.text
    return r.json()


def complete(head: Head, tokens: list[int]) -> dict:
    body = {"model": "demo-tiny", "prompt": tokens, "max_tokens": 1, "temperature": 0}
    r = head.http.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    return r.json()


def agree(head: Head, tokens: list[int], source: str) -> dict:
    """The query's answer, checked against the completion that follows it."""
    q = query(head, tokens)
    c = complete(head, tokens)
    assert q["source"] == c["kvmesh"]["source"] == source, (q, c["kvmesh"])
    assert q["cached_tokens"] == c["usage"]["prompt_tokens_details"]["cached_tokens"], (q, c)
    assert q["peer"] == c["kvmesh"]["peer"]
    assert q["fallback"] == c["kvmesh"]["fallback"]
    head.wait(lambda s: s["publish_pending"] == 0)
    deadline = time.time() + 15
    while head.metric('kvmesh_tier_queued_bytes{tier="disk"}') and time.time() < deadline:
        time.sleep(0.05)  # the disk writer is done: the next answer is not a race
    return q


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    logs = tmp_path_factory.mktemp("query")
    peer = Peer(alias="qpeer", log_dir=logs)
    heads: list[Head] = []
    try:
        # a keyless caller's exact tails are its own only where its address is one user
        mine = "--exact-reuse-by-address"
        heads.append(Head("--seed", peer.address, mine, "--alias", "qhead"))
        # RAM for two blocks: a prompt's first blocks live on disk only
        heads.append(
            Head("--disk", str(logs / "disk"), "--budget", "64KiB", mine, "--alias", "dhead")
        )
        heads[0].wait(lambda s: s["peers"] >= 1)
        yield peer, *heads
    finally:
        for h in heads:
            h.stop()
        peer.kill()


def test_local_then_remote(fleet):
    peer, head, _ = fleet
    tokens = prompt(1)
    cold = agree(head, tokens, "compute")
    assert cold["cached_tokens"] == 0 and cold["prefix"]["local"] == 0
    assert cold["block_size"] == B and cold["prompt_tokens"] == len(tokens)
    warm = agree(head, tokens, "local")
    assert warm["cached_tokens"] == warm["prefix"]["local"] == len(tokens)  # with the tail
    assert warm["prefix"]["qpeer"] == len(tokens)  # published to the peer too
    longer = tokens + prompt(2, B)  # the stored prefix, then tokens nobody holds
    live = agree(head, longer, "session")  # the last request's live state holds more
    assert live["cached_tokens"] == live["prefix"]["session"] == len(tokens)
    assert live["prefix"]["local"] == 3 * B
    second = Head("--seed", peer.address, "--exact-reuse-by-address", "--alias", "other")
    try:
        second.wait(lambda s: s["compatible_peers"] >= 2)  # the peer and the first head
        remote = agree(second, tokens, "remote")
        assert remote["cached_tokens"] == len(tokens)
        assert remote["prefix"]["local"] == 0 and remote["prefix"]["qpeer"] == len(tokens)
    finally:
        second.stop()


def test_disk(fleet):
    _, _, head = fleet
    tokens = prompt(3, 4 * B + 7)
    agree(head, tokens, "compute")
    q = agree(head, tokens, "disk")
    assert q["prefix"]["local"] < q["prefix"]["disk"] == len(tokens) == q["cached_tokens"]


@pytest.mark.parametrize(
    "body,param",
    [
        ({"model": "demo-tiny"}, "prompt"),
        ({"model": "demo-tiny", "prompt": "a", "token_ids": [1]}, "token_ids"),
        ({"model": "demo-tiny", "token_ids": [1, VOCAB]}, "token_ids"),
        ({"model": "demo-tiny", "token_ids": []}, "token_ids"),
        ({"model": "demo-tiny", "token_ids": "abc"}, "token_ids"),
        ({"model": "demo-tiny", "messages": []}, "messages"),
        ({"model": "demo-tiny", "token_ids": [1] * 100_000}, "token_ids"),
    ],
)
def test_bad_queries_are_400s_naming_the_field(fleet, body, param):
    _, head, _ = fleet
    r = head.http.post("/v1/cache/query", json=body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


def test_unknown_model_is_a_404_and_messages_use_the_chat_template(fleet):
    _, head, _ = fleet
    r = head.http.post("/v1/cache/query", json={"model": "nope", "prompt": "x"})
    assert r.status_code == 404 and r.json()["error"]["param"] == "model"
    msgs = [{"role": "user", "content": "the same tokens as a chat completion"}]
    q = head.http.post("/v1/cache/query", json={"model": "demo-tiny", "messages": msgs}).json()
    c = head.http.post(
        "/v1/chat/completions", json={"model": "demo-tiny", "messages": msgs, "max_tokens": 1}
    ).json()
    assert q["prompt_tokens"] == c["usage"]["prompt_tokens"]


def test_peek_reads_the_index_and_touches_nothing(tmp_path):
    from kvmesh.blocks import BlockKeyer
    from kvmesh.store import BlockStore, DiskConfig

    from .helpers import small_card, synthetic_chain

    card = small_card()
    b = card.block_tokens
    tokens = list(range(3 * b + 1))
    chain = synthetic_chain(card, tokens)  # three blocks and a tail
    store = BlockStore(chain[0].nbytes * 2, disk=DiskConfig(str(tmp_path), 1 << 20))
    for blk in chain:
        store.put(blk)
        store.flush(5)  # on disk before RAM lets it go
    keys = BlockKeyer(card.namespace, b).keys(tokens)
    stats = (store.stats.hits, store.stats.misses, store.disk_stats.hits)
    peek = store.peek(keys)
    assert (peek.tokens, peek.whole) == (len(tokens), True)
    assert peek.ram_tokens == 0  # the first blocks' bytes are on disk only
    assert (store.stats.hits, store.stats.misses, store.disk_stats.hits) == stats
    other = BlockKeyer(card.namespace, b).keys(tokens[:b] + [0] * (2 * b))
    assert store.peek(other).tokens == b and not store.peek(other).whole  # up to the fork
