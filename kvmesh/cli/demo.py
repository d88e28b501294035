"""``kvmesh demo``: a cache peer and a head as real processes on one machine.

A ~1000-token prompt is sent cold to a head and published to the peer; the head
is restarted as a new process with an empty store and the same prompt is sent
again: a remote hit, fetched and digest-verified, with identical output. Then a
two-turn chat in which turn 2 reuses turn 1's prompt and answer.

The hit's time to first token is reported with its stages (the head's
``kvmesh.breakdown``; they sum to it) and beside a reference measured in this
process once the others are gone: ``kvmesh demo --local`` on the same prompt (a
cold prefill, then an import of the same blocks from a local store) in a heap set
up as a head's (:mod:`kvmesh.memory`).

``kvmesh demo --local`` (:func:`run_local`) is that reference alone: a cold
prefill against an import of the same prefix from a local block store.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from ..blocks import BlockKeyer
from ..engine import Engine, KVState, Sampling
from ..store import BlockStore

DEMO_TOKENS = 8  # tokens each demo request decodes

TOPICS = (
    "prefill is the expensive part of a long prompt",
    "idle memory across a small fleet becomes a shared cache",
    "immutable blocks are verified before they are imported",
    "decode always stays local and makes no remote call",
    "a peer that fails only costs a local recompute",
)


def demo_prompt(engine: Engine, target_tokens: int = 1000) -> list[int]:
    """A deterministic chat prompt of about ``target_tokens`` tokens."""
    lines: list[str] = []
    i = 0
    while True:
        lines.append(f"Note {i}: {TOPICS[i % len(TOPICS)]}.")
        msgs = [
            {"role": "system", "content": "You are a concise assistant for operators."},
            {"role": "user", "content": "\n".join(lines) + "\nSummarise the notes."},
        ]
        ids = engine.encode_chat(msgs)
        if len(ids) >= target_tokens:
            return ids
        i += 1


@dataclass(frozen=True)
class LocalResult:
    prompt_tokens: int
    reused_tokens: int
    cold_ttft_s: float
    hit_ttft_s: float
    speedup: float
    outputs_identical: bool
    bytes_stored: int
    blocks: int


def run_local(
    engine: Engine,
    prompt_tokens: int = 1000,
    gen_tokens: int = DEMO_TOKENS,
    progress: Callable[[str], None] = lambda _: None,
    tokens: Sequence[int] | None = None,
) -> LocalResult:
    """Cold prefill, then an import of the same prefix from a local store, of
    ``tokens`` (default: :func:`demo_prompt` of ``prompt_tokens``)."""
    tokens = list(tokens) if tokens is not None else demo_prompt(engine, prompt_tokens)
    sampling = Sampling(max_tokens=gen_tokens)
    keyer = BlockKeyer(engine.card.namespace, engine.card.block_tokens)
    if engine.reuse_off is not None:
        progress(f"prefix reuse is off for this model: {engine.reuse_off}")
    engine.prefill(tokens[:8])  # warm up kernels: the baseline is the engine's best path

    progress(f"cold prefill of {len(tokens)} tokens")
    t0 = time.perf_counter()
    cold = engine.prefill(tokens)
    prompt_view = KVState(list(tokens), cold.cache, cold.logits, len(tokens))
    gen = engine.generate(cold, sampling)
    first = next(gen)
    cold_ttft = time.perf_counter() - t0
    cold_out = [first, *gen]

    progress("exporting blocks into the local store")
    store = BlockStore(budget_bytes=1 << 30)
    for blk in engine.export(prompt_view, keyer):
        store.put(blk)

    progress("importing the prefix into a fresh state")
    t0 = time.perf_counter()
    match = store.longest_prefix(keyer.keys(tokens))
    hit = engine.prefill(tokens, match.all())
    gen = engine.generate(hit, sampling)
    first = next(gen)
    hit_ttft = time.perf_counter() - t0
    hit_out = [first, *gen]
    return LocalResult(
        prompt_tokens=len(tokens),
        reused_tokens=hit.imported_tokens,  # a hybrid's: up to its last state checkpoint
        cold_ttft_s=round(cold_ttft, 6),
        hit_ttft_s=round(hit_ttft, 6),
        speedup=round(cold_ttft / hit_ttft, 1),
        outputs_identical=cold_out == hit_out,
        bytes_stored=store.stats.used_bytes,
        blocks=store.stats.entries,
    )


def as_dict(result: LocalResult) -> dict[str, object]:
    return asdict(result)


def _spawn(
    args: list[str], pattern: str, timeout: float = 600
) -> tuple[subprocess.Popen[str], re.Match[str]]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvmesh.cli", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL if not os.environ.get("KVMESH_DEMO_VERBOSE") else None,
        text=True,
    )
    assert proc.stdout is not None
    deadline = time.time() + timeout
    while time.time() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        m = re.search(pattern, line)
        if m:
            return proc, m
    proc.kill()
    raise RuntimeError(f"{args[0]} did not start")


def _http(url: str, body: dict[str, Any] | None = None, timeout: float = 600) -> Any:
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


def head_metric(url: str, name: str) -> float:
    """One unlabelled series of the head's /metrics (0 when it has none)."""
    with urllib.request.urlopen(url + "/metrics", timeout=30) as r:
        found = re.search(rf"^{re.escape(name)} (\S+)$", r.read().decode(), re.M)
    return float(found.group(1)) if found else 0.0


def _wait(url: str, cond: Any, timeout: float = 60) -> dict[str, Any]:
    deadline = time.time() + timeout
    while True:
        h = _http(url + "/healthz")
        if cond(h):
            return h
        if time.time() > deadline:
            raise TimeoutError(f"head not ready: {h}")
        time.sleep(0.1)


def demo_messages(target_tokens: int) -> list[dict[str, str]]:
    # the byte-level demo tokenizer gives one token per byte; ~60 bytes of template
    n = max(1, (target_tokens - 100) // 52)
    notes = "\n".join(f"Note {i}: {TOPICS[i % len(TOPICS)]}." for i in range(n))
    return [
        {"role": "system", "content": "You are a concise assistant for operators."},
        {"role": "user", "content": notes + "\nSummarise the notes."},
    ]


def demo_pictures(n: int, size: int = 224) -> list[str]:
    """``n`` seeded pictures (smooth colour fields with a few discs) as PNG data: URLs."""
    import base64
    import io

    import numpy as np
    from PIL import Image

    out = []
    for i in range(n):
        rng = np.random.default_rng(1000 + i)
        y, x = np.mgrid[0:size, 0:size] / size
        img = np.stack([np.sin(6 * x + c * rng.random() * 6) * 0.5 + 0.5 for c in (1, 2, 3)], -1)
        for cx, cy, r in rng.random((4, 3)):
            img[(x - cx) ** 2 + (y - cy) ** 2 < (r / 4) ** 2] = rng.random(3)
        buf = io.BytesIO()
        Image.fromarray((img * 255).astype("uint8")).save(buf, "PNG")
        out.append("data:image/png;base64," + base64.b64encode(buf.getvalue()).decode())
    return out


def with_pictures(msgs: list[dict[str, Any]], urls: Sequence[str]) -> list[dict[str, Any]]:
    """``msgs`` with ``urls`` as image parts after the last message's text."""
    *head, last = msgs
    parts: list[dict[str, Any]] = [{"type": "text", "text": last["content"]}]
    parts += [{"type": "image_url", "image_url": {"url": u}} for u in urls]
    return [*head, {**last, "content": parts}]


def run_two_node(
    model: str,
    engine: str,
    prompt_tokens: int,
    as_json: bool,
    grid: int = 0,
    images: int = 0,
) -> dict[str, Any]:
    """A peer and two heads in turn (``grid`` > 0: ``--deterministic`` on that grid;
    ``images``: that many pictures in the prompt, and no in-process reference)."""
    from rich.console import Console

    console = Console(stderr=True)
    procs: list[subprocess.Popen[str]] = []
    msgs: list[dict[str, Any]] = list(demo_messages(prompt_tokens))
    if images:
        msgs = with_pictures(msgs, demo_pictures(images))
    with console.status("starting a cache peer") as status:
        try:
            cold, hit, turn2 = _run_heads(model, engine, msgs, grid, procs, status.update)
        finally:
            _stop(procs)
        local = None
        if not images:
            status.update("the reference: a local import of the same prompt in one process")
            local = local_hit(model, engine, msgs, grid)
    result = _summary(cold, hit, turn2, local)
    result |= {"images": images, "hit_images_encoded": int(hit["images_encoded"])}
    if as_json:
        print(json.dumps(result))
    else:
        _table(result, console)
    return result


def _head_args(model: str, engine: str, peer_addr: str, grid: int) -> list[str]:
    return [
        "head",
        "--model",
        model,
        "--engine",
        engine,
        "--listen",
        "127.0.0.1:0",
        "--seed",
        peer_addr,
        "--gossip-interval",
        "0.5",
        # one user on loopback: its own prompt's exact tail is its own to reuse
        "--exact-reuse-by-address",
        *(["--deterministic", "--deterministic-grid", str(grid)] if grid else []),
    ]


def _run_heads(
    model: str,
    engine: str,
    msgs: list[dict[str, Any]],
    grid: int,
    procs: list[subprocess.Popen[str]],
    say: Callable[[str], Any],
) -> tuple[Any, Any, Any]:
    """Start the peer (its process joins ``procs``), send ``msgs`` cold to head 1,
    restart the head, send them again, then chat two turns: the three answers."""
    peer, m = _spawn(
        ["peer", "--listen", "127.0.0.1:0", "--alias", "cache-peer", "--gossip-interval", "0.5"],
        r"listening on (\S+)",
    )
    procs.append(peer)
    head_args = _head_args(model, engine, m.group(1), grid)
    say(f"starting head 1 on model {model} (building it on first use)")
    head, m = _spawn([*head_args, "--alias", "head-1"], r"(http://\S+)")
    procs.append(head)
    url = m.group(1)
    _wait(url, lambda h: h["peers"] >= 1)
    body = {"model": model, "messages": msgs, "max_tokens": DEMO_TOKENS, "temperature": 0}
    say("cold prefill on head 1")
    cold = _http(url + "/v1/chat/completions", body)
    say("publishing the prefix to the peer")
    _wait(url, lambda h: h["publish_pending"] == 0)
    head.send_signal(signal.SIGTERM)
    head.wait(30)
    say("restarting the head as a new process with an empty store")
    head, m = _spawn([*head_args, "--alias", "head-2"], r"(http://\S+)")
    procs.append(head)
    url = m.group(1)
    _wait(url, lambda h: h["compatible_peers"] >= 1)
    say("same prompt on the restarted head")
    hit = _http(url + "/v1/chat/completions", body)
    hit["images_encoded"] = head_metric(url, "kvmesh_images_encoded_total")
    say("two-turn chat")
    return cold, hit, _two_turns(url, body, msgs)


def _two_turns(url: str, body: dict[str, Any], msgs: list[dict[str, Any]]) -> Any:
    """A question, then a follow-up after its answer: the second turn's answer."""
    question = {"role": "user", "content": "Name three uses of idle memory in a fleet."}
    turn1 = _http(url + "/v1/chat/completions", {**body, "messages": msgs[:1] + [question]})
    answer = turn1["choices"][0]["message"]["content"]
    turn2_msgs = msgs[:1] + [
        question,
        {"role": "assistant", "content": answer},
        {"role": "user", "content": "And one risk?"},
    ]
    return _http(url + "/v1/chat/completions", {**body, "messages": turn2_msgs})


def _summary(cold: Any, hit: Any, turn2: Any, local: LocalResult | None) -> dict[str, Any]:
    """The demo's figures from the answers and the local reference (None: none)."""
    kc, kh = cold["kvmesh"], hit["kvmesh"]
    here = local.hit_ttft_s if local else None
    return {
        "prompt_tokens": cold["usage"]["prompt_tokens"],
        "reused_tokens": hit["usage"]["prompt_tokens_details"]["cached_tokens"],
        "cold_ttft_s": round(kc["ttft_s"], 6),
        "hit_ttft_s": round(kh["ttft_s"], 6),
        "speedup": round(kc["ttft_s"] / kh["ttft_s"], 1) if kh["ttft_s"] else None,
        "bytes_transferred": kh["bytes_fetched"],
        "checksum_ok": kh["source"] == "remote" and kh["fallback"] is None,
        "outputs_identical": cold["choices"][0]["message"]["content"]
        == hit["choices"][0]["message"]["content"],
        "source": kh["source"],
        "fetch_s": round(kh["fetch_s"], 6),
        "turn2_prompt_tokens": turn2["usage"]["prompt_tokens"],
        "turn2_cached_tokens": turn2["usage"]["prompt_tokens_details"]["cached_tokens"],
        "turn2_source": turn2["kvmesh"]["source"],
        "hit_breakdown_ms": {k: round(v * 1000, 3) for k, v in kh["breakdown"].items()},
        "local_hit_ttft_s": round(here, 6) if here is not None else None,
        "local_reused_tokens": local.reused_tokens if local else None,
        "hit_vs_local": round(kh["ttft_s"] / here, 2) if here else None,
    }


def _stop(procs: list[subprocess.Popen[str]]) -> None:
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    for p in procs:
        try:
            p.wait(15)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait(5)


def local_hit(
    model: str, engine: str, messages: list[dict[str, Any]], grid: int = 0
) -> LocalResult:
    """What ``kvmesh demo --local`` measures, for the chat prompt ``messages``, in
    this process: a cold prefill, then the same blocks imported from a local store."""
    from ..engine import load_engine
    from ..memory import keep_heap_warm

    eng = load_engine(model, engine, deterministic_grid=grid)
    keep_heap_warm()  # as a head does once its model is loaded (the caller set up one heap)
    return run_local(eng, gen_tokens=DEMO_TOKENS, tokens=eng.encode_chat(messages))


def _table(r: dict[str, Any], console: Any) -> None:
    from rich.console import Console
    from rich.table import Table

    t = Table(title="kvmesh demo: cache peer + head restart (one machine, loopback)")
    t.add_column("measure")
    t.add_column("value", justify="right")
    t.add_row("prompt tokens", str(r["prompt_tokens"]))
    t.add_row("cold local prefill (TTFT)", f"{r['cold_ttft_s']:.3f} s")
    t.add_row("remote snapshot import (TTFT)", f"{r['hit_ttft_s']:.3f} s")
    stages = ", ".join(f"{k} {v:.1f}" for k, v in r["hit_breakdown_ms"].items())
    t.add_row("  its stages (ms)", stages)
    if r["local_hit_ttft_s"] is not None:
        t.add_row(
            "local import, same prompt (TTFT)",
            f"{r['local_hit_ttft_s'] * 1000:.1f} ms (remote {r['hit_vs_local']:.2f}×)",
        )
    if r["images"]:
        encoded = r["hit_images_encoded"]
        t.add_row("pictures in the prompt", f"{r['images']}: {encoded} encoded on the hit")
    t.add_row("observed acceleration", f"~{r['speedup']:.0f}×")
    t.add_row("reused tokens", f"{r['reused_tokens']} of {r['prompt_tokens']}")
    t.add_row(
        "transferred", f"{r['bytes_transferred'] / 1e6:.1f} MB in {r['fetch_s'] * 1000:.1f} ms"
    )
    t.add_row("checksum validated", "yes" if r["checksum_ok"] else "NO")
    t.add_row("identical output", "yes" if r["outputs_identical"] else "NO")
    t.add_row(
        "chat turn 2 reused",
        f"{r['turn2_cached_tokens']} of {r['turn2_prompt_tokens']} tokens ({r['turn2_source']})",
    )
    Console().print(t)
