"""What ``--deterministic`` costs: cold TTFT, hit TTFT and 4-stream decode throughput
with and without it, side by side in one process (kvmesh.engine.deterministic).

    python bench/deterministic.py --json bench/results/deterministic.json [--model demo]
                                  [--tokens 1024,3000] [--grids 128,256,512] [--rounds 3]
    python bench/deterministic.py --smoke --json /tmp/det.json     # demo-tiny, short

One engine per setting (``off``, and ``--deterministic`` on each grid of
``--grids``), all loaded in this process; every measure alternates the settings
round by round (medians), so load on a shared machine falls on all alike.

- ``cold_s``: a prompt of each ``--tokens`` length prefilled from nothing (the
  engine's prefill: what a head's cold TTFT is, less HTTP).
- ``hit_repeat_s``: the same prompt again from its own exported blocks (an exact
  repeat: off imports all of it with its stored logits; deterministic rounds the
  hit down to the grid and computes the rest).
- ``hit_extend_s``: the prompt plus ``EXTEND`` new tokens from those blocks (an
  agent's next turn).
- ``streams``: ``STREAMS`` different prompts decoded together for ``STEPS`` steps
  (greedy), tokens per second; and one stream alone, for scale.

Ratios against ``off`` for each grid; ``chosen_grid``: the largest grid whose cold
TTFT ratio is the best within noise is the default (a larger grid rounds hits
down further).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from pathlib import Path
from typing import Any

import torch
from _common import machine, run_main

from kvmesh.blocks import BlockKeyer
from kvmesh.engine import load_engine

EXTEND = 100
STREAMS, STEPS = 4, 16


def timed(fn: Any) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def prompt(engine: Any, n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(4, min(engine.card.vocab_size, 32000)) for _ in range(n)]


def decode(engine: Any, prompts: list[list[int]], steps: int) -> float:
    """Tokens per second of ``prompts`` decoded together (prefill not counted)."""
    states = [engine.prefill(list(p)) for p in prompts]
    t = time.perf_counter()
    for _ in range(steps):
        for s in states:
            s.tokens.append(int(torch.argmax(s.logits)))
        engine.decode_batch(states)
    return len(states) * steps / (time.perf_counter() - t)


def measure(engines: dict[str, Any], n: int, rounds: int) -> dict[str, Any]:
    tokens = prompt(next(iter(engines.values())), n, seed=n)
    more = tokens + prompt(next(iter(engines.values())), EXTEND, seed=n + 1)
    blocks = {}
    for name, e in engines.items():  # warm each at this length; its blocks to hit on
        state = e.prefill(list(tokens))
        blocks[name] = e.export(state, BlockKeyer(e.card.namespace, e.card.block_tokens))
    runs: dict[str, dict[str, list[float]]] = {
        name: {"cold_s": [], "hit_repeat_s": [], "hit_extend_s": []} for name in engines
    }
    for _ in range(rounds):
        for name, e in engines.items():
            r, b = runs[name], blocks[name]
            r["cold_s"].append(timed(lambda e=e: e.prefill(list(tokens))))
            r["hit_repeat_s"].append(timed(lambda e=e, b=b: e.prefill(list(tokens), b)))
            full = [x for x in b if x.header.kind == "block"]
            r["hit_extend_s"].append(timed(lambda e=e, f=full: e.prefill(list(more), f)))
    return {
        name: {k: statistics.median(v) for k, v in r.items()} | {"rounds_s": r}
        for name, r in runs.items()
    }


def streams(engines: dict[str, Any], rounds: int, n: int) -> dict[str, Any]:
    first = next(iter(engines.values()))
    prompts = [prompt(first, n + 17 * i, seed=100 + i) for i in range(STREAMS)]
    out: dict[str, dict[str, list[float]]] = {e: {"one": [], "four": []} for e in engines}
    for _ in range(rounds):
        for name, e in engines.items():
            out[name]["one"].append(decode(e, prompts[:1], STEPS))
            out[name]["four"].append(decode(e, prompts, STEPS))
    return {
        name: {
            "one_tok_s": statistics.median(r["one"]),
            "four_tok_s": statistics.median(r["four"]),
            "rounds_tok_s": r,
        }
        for name, r in out.items()
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="demo")
    ap.add_argument("--dtype", default=None, help="float32 (default) or bfloat16")
    ap.add_argument("--tokens", default="1024,3000")
    ap.add_argument("--grids", default="128,256,512")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json", type=Path)
    ap.add_argument("--smoke", action="store_true", help="demo-tiny, 200 tokens, grid 64, 1 round")
    a = ap.parse_args()
    if a.smoke:
        a.model, a.tokens, a.grids, a.rounds = "demo-tiny", "200", "64", 1
    grids = [int(g) for g in a.grids.split(",")]
    engines = {"off": load_engine(a.model, dtype=a.dtype)}
    for g in grids:
        engines[f"grid{g}"] = load_engine(a.model, dtype=a.dtype, deterministic_grid=g)
    lengths = [int(x) for x in a.tokens.split(",")]
    ttft = {str(n): measure(engines, n, a.rounds) for n in lengths}
    decode_rates = streams(engines, a.rounds, n=min(lengths))
    ratios = {}
    for g in grids:
        name = f"grid{g}"
        ratios[name] = (
            {
                f"cold_{n}": ttft[str(n)][name]["cold_s"] / ttft[str(n)]["off"]["cold_s"]
                for n in lengths
            }
            | {
                f"hit_extend_{n}": ttft[str(n)][name]["hit_extend_s"]
                / ttft[str(n)]["off"]["hit_extend_s"]
                for n in lengths
            }
            | {
                "four_streams": decode_rates[name]["four_tok_s"]
                / decode_rates["off"]["four_tok_s"],
                "one_stream": decode_rates[name]["one_tok_s"] / decode_rates["off"]["one_tok_s"],
            }
        )
        print(name, json.dumps({k: round(v, 3) for k, v in ratios[name].items()}), flush=True)
    worst = {g: max(ratios[f"grid{g}"][f"cold_{n}"] for n in lengths) for g in grids}
    best = min(worst.values())
    chosen = max(g for g in grids if worst[g] <= best * 1.03)
    result = {
        "model": a.model,
        "dtype": a.dtype or "float32",
        "rounds": a.rounds,
        "smoke": a.smoke,
        "grids": grids,
        "decode": {name: e.card.engine.rsplit("decode=", 1)[-1] for name, e in engines.items()},
        "ttft": ttft,
        "streams": decode_rates,
        "ratios_vs_off": ratios,
        "worst_cold_ratio": worst,
        "chosen_grid": chosen,
        "machine": machine(),
    }
    print(f"chosen grid {chosen}: worst cold ratio {worst[chosen]:.3f}")
    if a.json:
        a.json.parent.mkdir(parents=True, exist_ok=True)
        a.json.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    run_main(main)
