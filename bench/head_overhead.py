"""What the mesh costs a head when it does not help.

    python bench/head_overhead.py --json bench/results/head_overhead.json

1. Async publishing: back-to-back distinct prompts on a head with a live peer,
   publishing on vs. off, interleaved; median time to first token of each.
2. A full miss: the same head path (keys, local store, concurrent lookup on two
   live peers that hold nothing for the prompt) vs. the engine's plain prefill
   with no mesh at all; median TTFT of each and the difference in ms.
"""

from __future__ import annotations

import argparse
import json
import signal
import statistics
import time

from _common import machine, spawn_peer

from kvmesh.engine import Sampling, load_engine
from kvmesh.mesh.node import NodeConfig, NodeThread
from kvmesh.runtime.head import HeadRuntime

ONE = Sampling(max_tokens=1)


def prompts(engine, n: int, tokens: int, tag: str) -> list[list[int]]:  # type: ignore[no-untyped-def]
    out = []
    for i in range(n):
        text = f"[{tag} {i}] " + " ".join(f"item-{tag}-{i}-{j}" for j in range(tokens))
        out.append(engine.encode(text)[:tokens])
    return out


def ttft(head: HeadRuntime, toks: list[int]) -> float:
    out = head.complete(toks, Sampling(max_tokens=4))
    return out.ttft_s


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--json", default="bench/results/head_overhead.json")
    ap.add_argument("--model", default="demo")
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--n", type=int, default=6)
    args = ap.parse_args()
    engine = load_engine(args.model)
    engine.prefill(list(range(16)))  # warm up
    procs = [spawn_peer("--gossip-interval", "0.3") for _ in range(2)]
    try:
        node = NodeThread(
            NodeConfig(seeds=[a for _, a in procs], gossip_interval=0.3, ttl=3, alias="bench")
        )
        head = HeadRuntime(engine, node, max_sessions=0)
        time.sleep(1.0)
        assert len(node.node.membership.live()) == 2
        on, off = [], []
        for i, toks in enumerate(prompts(engine, 2 * args.n, args.tokens, "pub")):
            head.publish_enabled = i % 2 == 0
            (on if head.publish_enabled else off).append(ttft(head, toks))
            print(
                f"publish {'on ' if head.publish_enabled else 'off'} ttft {on[-1] if head.publish_enabled else off[-1]:.3f} s",
                flush=True,
            )
        head.flush()
        head.publish_enabled = False
        miss, plain = [], []
        for toks in prompts(engine, args.n, args.tokens, "miss"):
            miss.append(ttft(head, toks))
            assert head.telemetry.recent[-1]["source"] == "compute"
            t0 = time.perf_counter()
            st = engine.prefill(toks)
            next(engine.generate(st, ONE))
            plain.append(time.perf_counter() - t0)
            print(f"miss ttft {miss[-1]:.3f} s  plain {plain[-1]:.3f} s", flush=True)
        lookup_ms = (
            statistics.median(r["lookup_s"] for r in list(head.telemetry.recent)[-args.n :]) * 1e3
        )
        node.close()
    finally:
        for p, _ in procs:
            p.send_signal(signal.SIGTERM)
            p.wait(10)
    med = statistics.median
    out = {
        "machine": machine(),
        "model": args.model,
        "prompt_tokens": args.tokens,
        "n": args.n,
        "publish_on_ttft_s": med(on),
        "publish_off_ttft_s": med(off),
        "publish_overhead_pct": (med(on) / med(off) - 1) * 100,
        "miss_ttft_s": med(miss),
        "plain_prefill_ttft_s": med(plain),
        "miss_cost_ms": (med(miss) - med(plain)) * 1e3,
        "miss_lookup_ms": lookup_ms,
        "raw": {"on": on, "off": off, "miss": miss, "plain": plain},
    }
    print(
        f"publishing: TTFT {out['publish_on_ttft_s']:.3f} s vs {out['publish_off_ttft_s']:.3f} s "
        f"({out['publish_overhead_pct']:+.1f}%); full miss: {out['miss_ttft_s']:.3f} s vs plain "
        f"{out['plain_prefill_ttft_s']:.3f} s ({out['miss_cost_ms']:+.1f} ms; lookup {lookup_ms:.2f} ms)"
    )
    with open(args.json, "w") as fh:
        json.dump(out, fh, indent=1)


if __name__ == "__main__":
    main()
