"""A real head and peer per family of today's models: on torch, Gemma-3 under a
128-token window (sliding and full layers alternating), Gemma 4 (per-layer
head dims, KV-shared layers, k=v, MoE), Qwen3.5 in the hub's layout (Gated
DeltaNet), gpt-oss (sinks, sliding windows, MoE) and Nemotron-H (Mamba2); on mlx,
Gemma 4 in 4 bits (the original system's own setup). A prompt of about 2,000
tokens goes through the model's own chat template.

On one head an exact repeat and the next chat turn reuse the first turn; after a
restart the new head imports at least 90% of the prompt from the peer and answers
the very text the first head did.
"""

from __future__ import annotations

import pytest
from tokenizers import Tokenizer

from . import zoo
from .procs import Peer
from .test_api import Head

PROMPT_TOKENS = 2000
FAMILIES = ("gemma3:w128", "gemma4", "qwen3_5_hub", "gpt_oss", "nemotron_h", "mlx:gemma4:q4")


def _model(arch: str) -> tuple:
    """The model directory, the head's engine flags and the prompt's length of a
    family. mlx's CPU build runs a 4-bit mixture of experts at ~30 ms a token here
    (its quantized gather kernel; 1,000 tokens of the raw mlx-lm model take 29 s),
    so that prompt is 600 tokens: still six 96-token windows."""
    if arch.startswith("mlx:"):  # the original system's setup: Gemma 4, mlx, 4-bit
        _, name, variant = arch.split(":")
        return zoo.mlx_model(name, variant), ("--engine", "mlx"), 600
    if ":w" in arch:  # Gemma-3's alternating windows, 2,000 tokens = 15 of them
        name, window = arch.split(":w")
        return zoo.windowed(zoo.hf_model(name), int(window)), (), PROMPT_TOKENS
    return zoo.hf_model(arch), (), PROMPT_TOKENS


def _chat(head: Head, model: str, messages: list[dict]) -> dict:
    body = {"model": model, "messages": messages, "max_tokens": 8, "temperature": 0}
    r = head.http.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    return r.json()


def _cached(reply: dict) -> int:
    return int(reply["usage"]["prompt_tokens_details"]["cached_tokens"])


@pytest.mark.parametrize("arch", FAMILIES)
def test_a_long_chat_is_reused_on_the_head_and_after_a_restart(tmp_path, arch):
    path, engine, length = _model(arch)
    tok = Tokenizer.from_file(str(path / "tokenizer.json"))
    text = tok.decode(zoo.prompt_tokens(path, length))
    model = str(path)
    turn1 = [{"role": "user", "content": text}]
    peer = Peer(alias=f"{arch.replace(':', '-')}-peer", log_dir=tmp_path)
    try:
        h1 = Head("--seed", peer.address, "--exact-reuse-by-address", *engine, model=model)
        try:
            h1.wait(lambda s: s["peers"] >= 1)
            cold = _chat(h1, model, turn1)
            n = cold["usage"]["prompt_tokens"]
            assert n >= length and _cached(cold) == 0
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
            assert _cached(second) >= 0.9 * second["usage"]["prompt_tokens"]
            h1.wait(lambda s: s["publish_pending"] == 0)
        finally:
            h1.stop()

        h2 = Head("--seed", peer.address, "--exact-reuse-by-address", *engine, model=model)
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
