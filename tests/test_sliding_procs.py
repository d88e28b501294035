"""A real head and peer on a sliding-window model (issue 29): the zoo's Gemma-3
(sliding and full layers alternating) under a 128-token window, a prompt of
about 2,000 tokens (15 windows).

On one head an exact repeat and the next chat turn reuse the first turn; after a
restart the new head imports the whole prompt from the peer and answers the very
text the first head did.
"""

from __future__ import annotations

from tokenizers import Tokenizer

from . import zoo
from .procs import Peer
from .test_api import Head

W = 128
PROMPT_TOKENS = 2000


def _chat(head: Head, model: str, messages: list[dict]) -> dict:
    body = {"model": model, "messages": messages, "max_tokens": 8, "temperature": 0}
    r = head.http.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    return r.json()


def _cached(reply: dict) -> int:
    return int(reply["usage"]["prompt_tokens_details"]["cached_tokens"])


def test_a_long_prompt_past_the_window_is_reused_and_survives_a_restart(tmp_path):
    path = zoo.windowed(zoo.hf_model("gemma3"), W)
    tok = Tokenizer.from_file(str(path / "tokenizer.json"))
    text = tok.decode(zoo.prompt_tokens(path, PROMPT_TOKENS))
    model = str(path)
    turn1 = [{"role": "user", "content": text}]
    peer = Peer(alias="sw-peer", log_dir=tmp_path)
    try:
        h1 = Head(
            "--seed", peer.address, "--exact-reuse-by-address", "--alias", "sw-first", model=model
        )
        try:
            h1.wait(lambda s: s["peers"] >= 1)
            cold = _chat(h1, model, turn1)
            n = cold["usage"]["prompt_tokens"]
            assert n >= PROMPT_TOKENS and _cached(cold) == 0
            answer = cold["choices"][0]["message"]["content"]

            again = _chat(h1, model, turn1)  # an exact repeat on the same head
            assert _cached(again) >= 0.9 * n
            assert again["choices"][0]["message"]["content"] == answer

            turn2 = [
                *turn1,
                {"role": "assistant", "content": answer},
                {"role": "user", "content": "And then?"},
            ]
            second = _chat(h1, model, turn2)
            assert second["kvmesh"]["source"] in ("session", "local")
            assert _cached(second) >= n >= 0.9 * second["usage"]["prompt_tokens"]
            h1.wait(lambda s: s["publish_pending"] == 0)
        finally:
            h1.stop()

        h2 = Head(
            "--seed",
            peer.address,
            "--exact-reuse-by-address",
            "--alias",
            "sw-restarted",
            model=model,
        )
        try:
            h2.wait(lambda s: s["compatible_peers"] >= 1)
            hit = _chat(h2, model, turn1)
            assert hit["kvmesh"]["source"] == "remote" and hit["kvmesh"]["bytes_fetched"] > 0
            assert _cached(hit) >= 0.9 * n
            assert hit["choices"][0]["message"]["content"] == answer
        finally:
            h2.stop()
    finally:
        peer.kill()
