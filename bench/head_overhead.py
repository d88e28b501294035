"""What the mesh costs a head when it does not help.

    python bench/head_overhead.py --json bench/results/head_overhead.json
    python bench/head_overhead.py --smoke --json /tmp/head_overhead.json   # CI: demo-tiny

1. Async publishing: back-to-back distinct prompts on a head with a live peer,
   publishing on vs. off, interleaved; median time to first token of each.
2. A full miss: the same head path (keys, local store, concurrent lookup on two
   live peers that hold nothing for the prompt) vs. the engine's plain prefill
   with no mesh at all; median TTFT of each and the difference in ms.
3. A frozen peer: a head whose only peer is stopped by SIGSTOP (it accepts
   connections and never answers) vs. a head with no peer, interleaved, distinct
   prompts of ``--freeze-tokens`` on ``--freeze-model`` (small by default: the
   difference measured is all network wait, and a big model only adds noise);
   the TTFT of the first request after the freeze, and the median of the
   requests after it vs. the head with no peer (issue 12: within 50 ms). The peer's card TTL is long (60 s) so that it stays
   a member throughout: this measures the per-peer health path, not card expiry.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import time
from pathlib import Path

from _common import machine, run_main, spawn_peer, stop

from kvmesh.engine import Engine, Sampling, load_engine
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


def frozen_peer(model: str, n: int, tokens: int, loaded: Engine | None = None) -> dict[str, object]:
    """Section 3, on ``loaded`` if given (``model`` already loaded: one load, not two)."""
    engine = loaded or load_engine(model)
    engine.prefill(list(range(16)))  # warm up
    proc, addr = spawn_peer("--gossip-interval", "0.3", "--ttl", "60")
    heads = {}
    try:
        for name, seeds in (("alone", []), ("paired", [addr])):
            node = NodeThread(NodeConfig(seeds=seeds, gossip_interval=0.3, ttl=60, alias=name))
            heads[name] = HeadRuntime(engine, node, max_sessions=0)
        paired = heads["paired"]
        deadline = time.time() + 10
        while not paired.fleet.members() and time.time() < deadline:  # type: ignore[union-attr]
            time.sleep(0.05)
        assert paired.fleet.members(), "the peer never joined"  # type: ignore[union-attr]
        for name, h in heads.items():  # warm both paths up while the peer answers
            ttft(h, prompts(engine, 1, tokens, f"warm-{name}")[0])
        proc.send_signal(signal.SIGSTOP)
        times: dict[str, list[float]] = {"alone": [], "paired": []}
        lookups: dict[str, list[float]] = {"alone": [], "paired": []}
        for i, toks in enumerate(prompts(engine, 2 * n, tokens, "frozen")):
            name = "paired" if i % 2 == 0 else "alone"  # the frozen side goes first
            times[name].append(ttft(heads[name], toks))
            lookups[name].append(heads[name].telemetry.recent[-1]["lookup_s"])
            print(
                f"frozen: {name:6s} ttft {times[name][-1]:.3f} s lookup "
                f"{lookups[name][-1] * 1e3:.1f} ms",
                flush=True,
            )
        failed = paired.fleet.counters()  # type: ignore[union-attr]
    finally:
        proc.send_signal(signal.SIGCONT)
        for h in heads.values():
            h.close()
            if h.node:
                h.node.close()
        stop(proc)
    med = statistics.median
    later, alone = med(times["paired"][1:]), med(times["alone"])
    return {
        "freeze_model": model,
        "freeze_tokens": tokens,
        "freeze_n": n,
        "freeze_first_ttft_s": times["paired"][0],
        "freeze_later_median_ttft_s": later,
        "no_peer_median_ttft_s": alone,
        "freeze_later_minus_no_peer_ms": (later - alone) * 1e3,
        "freeze_within_50ms": later - alone <= 0.05,
        "freeze_first_lookup_ms": lookups["paired"][0] * 1e3,
        "freeze_later_median_lookup_ms": med(lookups["paired"][1:]) * 1e3,
        "freeze_client_counters": {k: v for k, v in failed.items() if k.startswith("lookup")},
        "freeze_raw": {
            "paired": times["paired"],
            "alone": times["alone"],
            "paired_lookup_s": lookups["paired"],
        },
    }


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--json", default="bench/results/head_overhead.json")
    ap.add_argument("--model", default="demo")
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--n", type=int, default=6)
    ap.add_argument("--freeze-tokens", type=int, default=128)
    ap.add_argument("--freeze-n", type=int, default=10)
    ap.add_argument("--freeze-model", default="demo-tiny")
    ap.add_argument(
        "--only-freeze", action="store_true", help="run section 3 only; merge into --json"
    )
    ap.add_argument("--smoke", action="store_true", help="CI: demo-tiny, two prompts a side")
    args = ap.parse_args()
    if args.smoke:
        args.model, args.tokens, args.n = "demo-tiny", 64, 2
        args.freeze_model, args.freeze_tokens, args.freeze_n = "demo-tiny", 32, 2
    if args.only_freeze:
        old = json.loads(Path(args.json).read_text()) if os.path.exists(args.json) else {}
        frozen = frozen_peer(args.freeze_model, args.freeze_n, args.freeze_tokens)
        report_frozen(frozen)
        with open(args.json, "w") as fh:
            json.dump({**old, "machine": machine(), **frozen}, fh, indent=1)
        return
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
            stop(p)
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
        **frozen_peer(
            args.freeze_model,
            args.freeze_n,
            args.freeze_tokens,
            engine if args.freeze_model == args.model else None,
        ),
    }
    print(
        f"publishing: TTFT {out['publish_on_ttft_s']:.3f} s vs {out['publish_off_ttft_s']:.3f} s "
        f"({out['publish_overhead_pct']:+.1f}%); full miss: {out['miss_ttft_s']:.3f} s vs plain "
        f"{out['plain_prefill_ttft_s']:.3f} s ({out['miss_cost_ms']:+.1f} ms; lookup {lookup_ms:.2f} ms)"
    )
    report_frozen(out)
    with open(args.json, "w") as fh:
        json.dump(out, fh, indent=1)


def report_frozen(r: dict[str, object]) -> None:
    print(
        f"frozen peer: first request {r['freeze_first_ttft_s']:.3f} s, later median "
        f"{r['freeze_later_median_ttft_s']:.3f} s vs no peer {r['no_peer_median_ttft_s']:.3f} s "
        f"({r['freeze_later_minus_no_peer_ms']:+.1f} ms; lookup {r['freeze_later_median_lookup_ms']:.1f} ms)"
    )


if __name__ == "__main__":
    run_main(main)
