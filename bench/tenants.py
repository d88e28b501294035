"""Cross-tenant timing: does another tenant's identical prompt run as cold as a new one?

    python bench/tenants.py --json bench/results/tenants.json [--model demo]
                            [--prompt-tokens 512] [--trials 3]
    python bench/tenants.py --smoke          # CI: demo-tiny, short prompts, same checks

One real ``kvmesh head`` process with two tenant keys (A and B), measured over HTTP
as a client sees it: time to the first streamed token. Each trial uses a fresh
prompt P and a fresh control prompt Q, in this order:

  cold_s     B sends Q (never sent by anyone): a cold prefill
  first_s    A sends P (cold too: counted with cold_s)
  cross_s    B sends P, which A just sent: what a prober in another tenant sees
  repeat_s   A sends P again: her own cache

and prints cross/cold (the claim: within noise of 1, no cross-tenant speed-up)
beside repeat/cold (what a hit looks like), and every request's cached_tokens. The
head is killed on every exit.
"""

from __future__ import annotations

import argparse
import json
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
from _common import machine


def start_head(model: str, keys: Path, secret: Path) -> tuple[subprocess.Popen[str], str]:
    p = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "kvmesh.cli",
            "head",
            "--model",
            model,
            "--listen",
            "127.0.0.1:0",
            "--api-key-file",
            str(keys),
            "--tenant-secret-file",
            str(secret),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    assert p.stdout is not None
    m = re.search(r"(https?://\S+) grpc", p.stdout.readline())
    if not m:
        p.kill()
        raise RuntimeError("kvmesh head did not start")
    return p, m.group(1)


def prompt(n_words: int, salt: str) -> str:
    return f"[{salt}] " + " ".join(f"note {i}: figures for the board." for i in range(n_words))


def ttft(http: httpx.Client, key: str, text: str, model: str) -> tuple[float, int, int]:
    """(seconds to the first streamed token, cached_tokens, prompt_tokens)."""
    body = {
        "model": model,
        "max_tokens": 1,
        "prompt": text,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    t0 = time.perf_counter()
    first, usage = 0.0, None
    with http.stream(
        "POST", "/v1/completions", json=body, headers={"Authorization": f"Bearer {key}"}
    ) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            event = json.loads(line[6:])
            if not first and event.get("choices"):
                first = time.perf_counter() - t0
            usage = event.get("usage") or usage
    assert usage is not None, "no usage event"
    return first, usage["prompt_tokens_details"]["cached_tokens"], usage["prompt_tokens"]


def wait_idle(http: httpx.Client) -> None:
    deadline = time.time() + 30
    while http.get("/healthz").json()["publish_pending"] and time.time() < deadline:
        time.sleep(0.02)


def run(model: str, words: int, trials: int) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as d:
        keys, secret = Path(d) / "keys", Path(d) / "secret"
        keys.write_text("key-a tenant-a\nkey-b tenant-b\n")
        proc, url = start_head(model, keys, secret)

        def stop(*_: object) -> None:
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)
            if _:
                sys.exit(1)

        signal.signal(signal.SIGTERM, stop)
        signal.signal(signal.SIGINT, stop)
        try:
            with httpx.Client(base_url=url, timeout=600) as http:
                ttft(http, "key-a", prompt(4, "warm-up"), model)  # first-call setup, not counted
                rows = []
                for t in range(trials):
                    p, q = prompt(words, f"p{t}"), prompt(words, f"q{t}")
                    row: dict[str, Any] = {}
                    for name, key, text in (
                        ("cold", "key-b", q),
                        ("first", "key-a", p),
                        ("cross", "key-b", p),
                        ("repeat", "key-a", p),
                    ):
                        s, cached, n = ttft(http, key, text, model)
                        row[f"{name}_s"], row[f"{name}_cached"], row["prompt_tokens"] = s, cached, n
                        wait_idle(http)
                    rows.append(row)
                    print(json.dumps(row), flush=True)
        finally:
            stop()
    med = {
        k: statistics.median(r[f"{k}_s"] for r in rows)
        for k in ("cold", "first", "cross", "repeat")
    }
    cold = statistics.median([r["cold_s"] for r in rows] + [r["first_s"] for r in rows])
    return {
        "model": model,
        "prompt_tokens": rows[0]["prompt_tokens"],
        "trials": rows,
        "median_s": med,
        "cold_median_s": cold,
        "cross_vs_cold": med["cross"] / cold,
        "repeat_vs_cold": med["repeat"] / cold,
        "cross_cached_tokens": [r["cross_cached"] for r in rows],
        "repeat_cached_fraction": min(r["repeat_cached"] / r["prompt_tokens"] for r in rows),
        "machine": machine(),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="demo")
    ap.add_argument("--prompt-tokens", type=int, default=512, help="about this many tokens")
    ap.add_argument("--trials", type=int, default=3)
    ap.add_argument("--json", type=Path)
    ap.add_argument("--smoke", action="store_true", help="demo-tiny, short prompts, for CI")
    a = ap.parse_args()
    model, n, trials = ("demo-tiny", 256, 2) if a.smoke else (a.model, a.prompt_tokens, a.trials)
    result = run(model, max(1, n // 32), trials)  # a "note" is ~32 byte-level tokens
    print(
        f"{result['model']} {result['prompt_tokens']} prompt tokens, {trials} trials: "
        f"cold {result['cold_median_s'] * 1e3:.0f} ms, cross-tenant "
        f"{result['median_s']['cross'] * 1e3:.0f} ms (x{result['cross_vs_cold']:.2f} of cold), "
        f"own repeat {result['median_s']['repeat'] * 1e3:.0f} ms "
        f"(x{result['repeat_vs_cold']:.2f}); cross-tenant cached_tokens "
        f"{result['cross_cached_tokens']}"
    )
    if a.json:
        a.json.parent.mkdir(parents=True, exist_ok=True)
        a.json.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
