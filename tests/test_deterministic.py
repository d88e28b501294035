"""``kvmesh head --deterministic``: a request's tokens and their log-probabilities are
bitwise those of the same request computed cold and alone (a head with nothing
cached, nothing published, no session, one request at a time), whether the head

(a) computed it itself on an empty fleet,
(b) is a fresh head importing the prompt's prefix from a peer after (a) published it,
(c) extends an earlier prompt and its answer, which it still holds (its session,
    its store), or
(d) decodes it in a batch with 3 concurrent different requests,

on real head processes, for prompts of ~150 and ~2,900 tokens, on the zoo's qwen2
(float32, and bfloat16 where sequences decode one at a time) and gemma3 (sliding
window layers). Without the switch, the same (b)–(d) differ from cold in the last
bits on this machine (the control at the end), so the equalities are the mode's
doing. Equality is of the JSON floats the API returns (float32 logprobs, exact in
JSON).
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

from . import zoo
from .procs import Peer
from .test_api import Head

WORDS = ["agent", "tool", "result", "cache", "turn", "block", "prefix", "store"]
MAX_TOKENS = 12
GRID = "128"
SETUPS = [("qwen2", "float32"), ("qwen2", "bfloat16"), ("gemma3", "float32")]


def text(n_words: int, seed: int) -> str:
    rng = random.Random(seed)
    return " ".join(rng.choice(WORDS) for _ in range(n_words))


SHORT, LONG = text(150, 1), text(2800, 2)
OTHERS = [text(400, 4), text(90, 5), text(1200, 6)]


def answer(head: Head, model: str, prompt: str) -> tuple[list[str], list[float], dict[str, Any]]:
    r = head.http.post(
        "/v1/completions",
        json={
            "model": model,
            "prompt": prompt,
            "max_tokens": MAX_TOKENS,
            "temperature": 0,
            "ignore_eos": True,
            "logprobs": 3,
        },
        timeout=600,
    )
    assert r.status_code == 200, r.text
    body = r.json()
    lp = body["choices"][0]["logprobs"]
    tops = [v for d in lp["top_logprobs"] for v in sorted(d.values())]
    return lp["tokens"], lp["token_logprobs"] + tops, body.get("kvmesh") or {}


def same(got: Any, want: Any) -> bool:
    return got[0] == want[0] and got[1] == want[1]


@pytest.fixture(scope="module", params=SETUPS, ids=lambda s: f"{s[0]}-{s[1]}")
def setup(request: pytest.FixtureRequest) -> Iterator[tuple[str, tuple[str, ...]]]:
    arch, dtype = request.param
    yield str(zoo.hf_model(arch)), ("--dtype", dtype)


def deterministic(*args: str) -> tuple[str, ...]:
    return ("--deterministic", "--deterministic-grid", GRID, *args)


def cold_answers(model: str, *args: str) -> tuple[dict[str, Any], str]:
    """Every prompt's answer from a head with nothing cached, published or kept, one
    request at a time; and the next turn after the long prompt (the prompt, its
    answer: decoded, never reused, and more)."""
    cold = Head(*args, "--no-publish", "--max-sessions", "0", model=model)
    try:
        want = {p: answer(cold, model, p) for p in (SHORT, LONG, *OTHERS)}
        extended = LONG + "".join(want[LONG][0]) + " " + text(300, 3)
        want[extended] = answer(cold, model, extended)
    finally:
        cold.stop()
    return want, extended


def batched(head: Head, model: str, prompts: list[str]) -> list[Any]:
    """``prompts`` sent at once."""
    with ThreadPoolExecutor(len(prompts)) as pool:
        return list(pool.map(lambda p: answer(head, model, p), prompts))


@pytest.mark.timeout(1200)
def test_hits_sessions_and_batches_answer_bitwise_as_a_cold_request_alone(setup):
    model, dtype = setup
    want, extended = cold_answers(model, *deterministic(*dtype))
    peer = Peer()
    a = b = None
    try:
        a = Head(*deterministic(*dtype, "--seed", peer.address), model=model)
        a.wait(lambda h: h["compatible_peers"] >= 1, timeout=60)
        for p in (SHORT, LONG):  # (a) on an empty fleet
            assert same(answer(a, model, p), want[p]), f"(a) {len(p)} chars"
        # (c) the long prompt extended, on the head that holds it
        got = answer(a, model, extended)
        assert same(got, want[extended]), "(c)"
        assert got[2]["source"] in ("session", "local"), got[2]
        assert got[2]["reused_tokens"] > 0, got[2]
        a.wait(lambda h: h["publish_pending"] == 0, timeout=120)

        b = Head(*deterministic(*dtype, "--seed", peer.address), model=model)
        b.wait(lambda h: h["compatible_peers"] >= 1, timeout=60)
        got = answer(b, model, LONG)  # (b) a fresh head, imported from the peer
        assert same(got, want[LONG]), "(b)"
        assert got[2]["source"] == "remote" and got[2]["reused_tokens"] > 0, got[2]
        # (d) four different requests at once
        batch = [SHORT, *OTHERS]
        for p, g in zip(batch, batched(b, model, batch), strict=True):
            assert same(g, want[p]), f"(d) {len(p)} chars"
    finally:
        for h in (a, b):
            if h is not None:
                h.stop()
        peer.stop()


@pytest.mark.timeout(900)
def test_without_the_switch_hits_and_batches_differ_in_the_last_bits():
    """The control: the same (c) and (d) on qwen2 float32 without ``--deterministic``
    are not all bitwise cold (a hit computes its suffix and a batch its rows with
    other matrix shapes than a cold prefill: another summation order on AMD EPYC
    with AVX-512 and on Intel with AMX alike), so the test above proves something."""
    model = str(zoo.hf_model("qwen2"))
    want, extended = cold_answers(model)
    head = Head("--no-publish", model=model)
    try:
        answer(head, model, LONG)
        results = [same(answer(head, model, extended), want[extended])]
        batch = [SHORT, *OTHERS]
        results += [
            same(g, want[p]) for p, g in zip(batch, batched(head, model, batch), strict=True)
        ]
    finally:
        head.stop()
    assert not all(results), "without the switch every hit and batch row was bitwise cold"


def test_the_switch_is_refused_where_it_cannot_hold():
    """mlx, and a grid that is not a multiple of the block size: usage errors."""
    import subprocess
    import sys

    for args, says in (
        (("--engine", "mlx"), "torch engine"),
        (("--deterministic-grid", "100"), "multiple of the block size"),
    ):
        r = subprocess.run(
            [sys.executable, "-m", "kvmesh.cli", "head", "--deterministic", *args],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert r.returncode == 2 and says in r.stderr, r.stderr


def test_a_cache_is_cut_back_only_to_the_grid_and_what_whole_cells_computed():
    """In one engine (demo-tiny, grid 64): a 300-token prompt prefilled in chunks the
    grid does not divide, then 30 decoded tokens, resumes at 256 (not at 300, its
    prompt's end, nor 320, the grid point below 330): 256..300 was its last cell
    computed in part, 300..330 by decode steps; a fork is canonical only as far as its source; a chunk ends on
    the grid (cut back to the last point it reaches, or stretched to the next);
    a hit is cut to whole cells."""
    from kvmesh.blocks import BlockKeyer
    from kvmesh.engine import load_engine
    from kvmesh.engine.deterministic import chunk_end

    e = load_engine("demo-tiny", deterministic_grid=64)
    assert e.card.prefill_grid == 64 and "deterministic:" in e.card.engine
    tokens = [5 + i % 200 for i in range(300)]
    state = e.begin_prefill(tokens)
    e.prefill_batch([state], [100])  # cut to 64: the last grid point it reaches
    assert state.cached == 64
    e.prefill_batch([state], [10])  # stretched to 128: it reaches none
    assert state.cached == 128
    e.prefill_batch([state], [172])
    assert state.cached == 300
    for t in range(30):  # decoded past the grid point 320
        state.tokens.append(7 + t)
        e.decode_batch([state])
    other = e.prefill([9 + i % 100 for i in range(70)])
    for t in range(3):  # decoded in a batch too: no more canonical than before
        state.tokens.append(40 + t)
        other.tokens.append(40 + t)
        e.decode_batch([state, other])
    longer = [*state.tokens, 1, 2, 3]
    assert e.begin_resume(state, len(state.tokens), longer).cached == 256
    assert e.begin_resume(e.fork(state), len(state.tokens), longer).cached == 256
    assert e.begin_resume(other, len(other.tokens), [*other.tokens, 1]).cached == 64
    # published: whole cells only (no block past 256, no tail)
    blocks = e.export(state, BlockKeyer(e.card.namespace, e.card.block_tokens))
    assert [b.header.kind for b in blocks] == ["block"] * 8
    assert [chunk_end(c, q, 300, 64) for c, q in ((0, 100), (0, 10), (256, 10), (0, 999))] == [
        64,
        64,
        300,
        300,
    ]
    assert e.card.importable_blocks(9) == 8  # blocks of 32 tokens, cells of 2 blocks
