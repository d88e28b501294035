"""A prompt with two pictures: time to first token cold, as a remote hit after a
restart, with one pixel of one picture changed, and the same pictures after other
text; the vision encoder's time in each.

    python bench/images.py --json bench/results/images.json [--model demo-vl] [--rounds 3]
    python bench/images.py --smoke --json /tmp/images.json   # CI: demo-vl-tiny, one round

A real peer and ``kvmesh head`` processes on loopback, as ``kvmesh demo --vision``:
the prompt (``--prompt-tokens`` of text, then two 224x224 pictures) is sent to a
head, which publishes it; a new head process with an empty store gets it again
(``hit``) and then the same text with one pixel of the second picture changed
(``pixel``: the text before the pictures and the first picture are reused, the
second is encoded and computed), then other text with the same two pictures
(``rows``: no KV of the pictures anywhere, their encoder rows taken from the fleet
instead of encoded). Every round starts fresh processes. The
encoder's seconds are the heads' own (``kvmesh_image_encoder_seconds_total``),
part of the time to first token. Exits non-zero unless every hit reused the whole
prompt with no encoder run and the same answer as the cold one, and the other text
took both pictures' rows and ran no encoder.
"""

from __future__ import annotations

import argparse
import base64
import io
import json
import statistics
import sys
from pathlib import Path
from typing import Any

import httpx
from _common import machine, run_main, spawn_kvmesh, spawn_peer, stop, wait_for

from kvmesh.cli.demo import demo_messages, demo_pictures, head_metric, with_pictures


def touched(url: str) -> str:
    """The picture of data: URL ``url`` with its top-left pixel inverted."""
    from PIL import Image

    img = Image.open(io.BytesIO(base64.b64decode(url.split(",", 1)[1]))).convert("RGB")
    img.putpixel((0, 0), tuple(255 - c for c in img.getpixel((0, 0))))
    buf = io.BytesIO()
    img.save(buf, "PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def start_head(model: str, peer: str) -> tuple[Any, httpx.Client]:
    proc, m = spawn_kvmesh(
        "head",
        "--model",
        model,
        "--listen",
        "127.0.0.1:0",
        "--seed",
        peer,
        "--gossip-interval",
        "0.3",
        "--exact-reuse-by-address",
        pattern=r"(http://\S+) grpc",
    )
    return proc, httpx.Client(base_url=m.group(1), timeout=600)


def metric(http: httpx.Client, name: str) -> float:
    return head_metric(str(http.base_url).rstrip("/"), name)


def ask(http: httpx.Client, model: str, msgs: list[dict[str, Any]]) -> dict[str, Any]:
    """One request: its TTFT, reuse, the encoder's seconds for it, and its answer."""
    before = metric(http, "kvmesh_image_encoder_seconds_total")
    taken = metric(http, "kvmesh_image_rows_taken_total")
    body = {"model": model, "messages": msgs, "max_tokens": 4, "temperature": 0}
    r = http.post("/v1/chat/completions", json={**body, "logprobs": True})
    r.raise_for_status()
    out = r.json()
    return {
        "ttft_s": out["kvmesh"]["ttft_s"],
        "source": out["kvmesh"]["source"],
        "prompt_tokens": out["usage"]["prompt_tokens"],
        "reused_tokens": out["usage"]["prompt_tokens_details"]["cached_tokens"],
        "encoder_s": metric(http, "kvmesh_image_encoder_seconds_total") - before,
        "rows_taken": metric(http, "kvmesh_image_rows_taken_total") - taken,
        "answer": [c["logprob"] for c in out["choices"][0]["logprobs"]["content"]],
    }


def one_round(model: str, msgs: list[dict], moved: list[dict], other: list[dict]) -> dict:
    peer, address = spawn_peer()
    heads = []
    try:
        proc, http = start_head(model, address)
        heads.append(proc)
        wait_for(lambda: http.get("/healthz").json()["peers"] >= 1, 60, "head 1 to see the peer")
        cold = ask(http, model, msgs)
        wait_for(lambda: http.get("/healthz").json()["publish_pending"] == 0, 120, "publishing")
        stop(proc)
        proc, http = start_head(model, address)
        heads.append(proc)
        wait_for(lambda: http.get("/healthz").json()["compatible_peers"] >= 1, 60, "head 2")
        hit = ask(http, model, msgs)
        pixel = ask(http, model, moved)
        rows = ask(http, model, other)
    finally:
        for p in (*heads, peer):
            stop(p)
    return {"cold": cold, "hit": hit, "pixel": pixel, "rows": rows}


def summary(rounds: list[dict]) -> dict[str, Any]:
    def median(case: str, key: str) -> float:
        return statistics.median(r[case][key] for r in rounds)

    out = {
        case: {k: median(case, k) for k in ("ttft_s", "encoder_s", "reused_tokens")}
        for case in ("cold", "hit", "pixel", "rows")
    }
    for case in ("hit", "pixel", "rows"):
        out[f"{case}_vs_cold"] = out[case]["ttft_s"] / out["cold"]["ttft_s"]
    return out


def failures(rounds: list[dict]) -> list[str]:
    bad = []
    for i, r in enumerate(rounds):
        hit, cold = r["hit"], r["cold"]
        if hit["reused_tokens"] != hit["prompt_tokens"] or hit["source"] != "remote":
            bad.append(
                f"round {i}: the hit reused {hit['reused_tokens']} of {hit['prompt_tokens']}"
            )
        if hit["encoder_s"] != 0 or cold["encoder_s"] <= 0:
            bad.append(
                f"round {i}: encoder seconds cold {cold['encoder_s']} hit {hit['encoder_s']}"
            )
        if hit["answer"] != cold["answer"]:
            bad.append(f"round {i}: the hit's answer is not the cold one's")
        if not 0 < r["pixel"]["reused_tokens"] < hit["prompt_tokens"]:
            bad.append(f"round {i}: one pixel changed reused {r['pixel']['reused_tokens']}")
        if r["rows"]["rows_taken"] != 2 or r["rows"]["encoder_s"] != 0:
            bad.append(f"round {i}: the other text encoded its pictures again")
    return bad


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", default="demo-vl", help="demo-vl or demo-vl-tiny (or a LLaVA dir)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--prompt-tokens", type=int, default=1000, help="text before the pictures")
    ap.add_argument("--json", type=Path)
    ap.add_argument("--smoke", action="store_true", help="CI: demo-vl-tiny, one round")
    a = ap.parse_args()
    if a.smoke:
        a.model, a.rounds, a.prompt_tokens = "demo-vl-tiny", 1, 300
    pictures = demo_pictures(2)
    msgs = with_pictures(demo_messages(a.prompt_tokens), pictures)
    moved = with_pictures(demo_messages(a.prompt_tokens), [pictures[0], touched(pictures[1])])
    *system, user = demo_messages(a.prompt_tokens)
    elsewhere = [
        *system,
        {**user, "content": "Another question, the same pictures.\n" + user["content"]},
    ]
    other = with_pictures(elsewhere, pictures)
    rounds = [one_round(a.model, msgs, moved, other) for _ in range(a.rounds)]
    result = {
        "benchmark": "a two-picture prompt: cold, remote hit, one pixel changed, other text",
        "model": a.model,
        "images": 2,
        "machine": machine(),
        "rounds": rounds,
        "median": summary(rounds),
    }
    print(json.dumps(result["median"], indent=1))
    if a.json:
        a.json.parent.mkdir(parents=True, exist_ok=True)
        a.json.write_text(json.dumps(result, indent=1) + "\n")
    if bad := failures(rounds):
        sys.exit("; ".join(bad))


if __name__ == "__main__":
    run_main(main)
