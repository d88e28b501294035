"""A chat's second turn on a hybrid model (Gated DeltaNet beside full attention: a
recurrent state exists only where a forward kept it) reuses its first turn's prompt
from another node, up to the prompt's last whole block.

The first turn's head keeps the state after that block (off the card's checkpoint
grid), the block carries it to the fleet, and a fresh head that gets the second turn
imports every whole block of turn 1 and computes the rest, answering as a cold head
does. Before, the import ended on the grid: up to ``state_every`` blocks earlier.
Real processes: a peer, the turn-1 head, the turn-2 head, a cold head.
"""

from __future__ import annotations

from kvmesh.engine.hf import TransformersEngine

from .procs import Peer
from .test_api import Head
from .zoo import hf_model

SYSTEM = {"role": "system", "content": "You answer from the tools' output."}
FOLLOW_UP = {"role": "user", "content": "And which node failed first?"}


def _tokens(head: Head, messages: list[dict]) -> list[int]:
    r = head.http.post("/tokenize", json={"messages": messages, "add_generation_prompt": True})
    assert r.status_code == 200, r.text
    return r.json()["tokens"]


def _chat(head: Head, model: str, messages: list[dict]) -> dict:
    body = {"model": model, "messages": messages, "max_tokens": 8, "temperature": 0}
    r = head.http.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    return r.json()


def _shared(a: list[int], b: list[int]) -> int:
    return next(
        (i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b))
    )


def _turns(user: dict, answer: str) -> tuple[list[dict], list[dict]]:
    return [SYSTEM, user], [SYSTEM, user, {"role": "assistant", "content": answer}, FOLLOW_UP]


def _first_turn(head: Head, block: int, every: int) -> dict:
    """A first user message whose prompt parts from the next turn's inside its last
    two whole blocks, after a block boundary off the state grid (where the grid
    alone would reuse less)."""
    for k in range(8, 400):
        user = {"role": "user", "content": "Summarize the fleet log: " + "node ok; " * k}
        one, two = (_tokens(head, t) for t in _turns(user, "noted"))
        shared = _shared(one, two)
        if (
            shared > 2 * every * block
            and (shared // block) % every
            and (shared // block >= len(one) // block - 1)
        ):
            return user
    raise AssertionError("no first turn of the wanted length")


def test_turn_two_on_a_fresh_head_reuses_turn_one_up_to_where_the_prompts_part(tmp_path):
    path = hf_model("qwen3_5")
    model = path.name
    peer = Peer(alias="hybrid-peer", log_dir=tmp_path)
    heads: list[Head] = []
    try:
        first = Head("--seed", peer.address, "--alias", "turn-one", model=str(path))
        heads.append(first)
        first.wait(lambda s: s["peers"] >= 1)
        card = TransformersEngine(path).card  # the heads' card (the same load)
        block, every = card.block_tokens, card.state_every
        assert every >= 2, card  # a grid coarser than one block: the case at stake

        user = _first_turn(first, block, every)
        turn_one = _chat(first, model, _turns(user, "")[0])
        first.wait(lambda s: s["publish_pending"] == 0)
        prompt_one, turn_two = _turns(user, turn_one["choices"][0]["message"]["content"])
        shared = _shared(_tokens(first, prompt_one), _tokens(first, turn_two))
        assert shared // block >= turn_one["usage"]["prompt_tokens"] // block - 1

        second = Head("--seed", peer.address, "--alias", "turn-two", model=str(path))
        heads.append(second)
        second.wait(lambda s: s["compatible_peers"] >= 1)
        hit = _chat(second, model, turn_two)
        whole, grid = shared // block * block, shared // (every * block) * every * block
        reused = hit["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert reused == whole > grid, (reused, whole, grid, hit["kvmesh"])
        assert hit["kvmesh"]["source"] == "remote"

        cold = Head("--no-publish", "--alias", "cold", model=str(path))
        heads.append(cold)
        ref = _chat(cold, model, turn_two)
        assert ref["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        assert hit["choices"][0]["message"] == ref["choices"][0]["message"]
    finally:
        for h in heads:
            h.stop()
        peer.kill()
