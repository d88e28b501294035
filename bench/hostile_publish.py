"""A small peer under hostile publishers: what it holds in memory, and whether it serves.

    python bench/hostile_publish.py --json bench/results/hostile_publish.json
    python bench/hostile_publish.py --smoke --json /tmp/hostile.json   # CI: 2 publishers, 2 s

A real ``kvmesh peer`` with a 64 MiB budget, 8 MiB blocks and a 16 MiB in-flight
cap. Its resident set (VmRSS) is read once it is up (the baseline); its peak
(VmHWM) is reset there. An honest publisher then fills 60 MiB of the budget, and
``--publishers`` concurrent hostile publishers stream for ``--seconds``: oversize
announcements, blocks just over the cap, truncated blocks, garbage, wrong
digests, bad cards, orphans, and silent half-blocks that hold their reservation
until the peer's publish progress deadline cuts them off. Meanwhile a client
looks up the honest chain every 20 ms. Reported: the baseline, the peak RSS and
the bound it must stay under (baseline + budget + in-flight cap), lookups served
(latency, all answered with the honest chain), and the peer's own count of each
refusal (its /metrics). Exits non-zero if the peak passed the bound, the peer
died, or a lookup answered anything but the honest chain.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path

from _common import machine, run_main, spawn_peer, stop

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # the hostile tooling lives beside the tests

from kvmesh.mesh.proto import kvmesh_pb2 as pb  # noqa: E402
from kvmesh.mesh.proto import kvmesh_pb2_grpc as pbg  # noqa: E402
from tests.helpers import small_card, synthetic_chain  # noqa: E402
from tests.hostile_peer import (  # noqa: E402
    ATTACKS,
    Target,
    attack,
    own_connection,
    peak_rss,
    publish,
    reset_peak_rss,
    rss,
    scrape,
)
from tests.procs import free_port  # noqa: E402

MiB = 1 << 20
BUDGET, MAX_BLOCK, INFLIGHT = 64 * MiB, 8 * MiB, 16 * MiB


def spawn(metrics: str) -> tuple[subprocess.Popen[str], str]:
    p, address = spawn_peer(
        "--budget",
        "64MiB",
        "--max-block-bytes",
        "8MiB",
        "--max-inflight",
        "16MiB",
        "--metrics",
        metrics,
    )
    for _ in range(100):
        try:
            scrape(metrics)
            break
        except OSError:
            time.sleep(0.05)
    return p, address


def target(address: str) -> Target:
    card = small_card(
        num_layers=24, num_kv_heads=2, head_dim=64, sliding_windows=(0,) * 24, block_tokens=256
    )  # 6 MiB blocks
    honest = synthetic_chain(card, list(range(256 * 10)), tail=False)
    foreign = synthetic_chain(card, [7] * 256 * 3, tail=False)
    return Target(address, card, honest, foreign, MAX_BLOCK)


class Sampler(threading.Thread):
    """VmRSS every 20 ms: a cross-check of VmHWM."""

    def __init__(self, pid: int) -> None:
        super().__init__(daemon=True)
        self.pid, self.max, self.stop = pid, 0, threading.Event()

    def run(self) -> None:
        while not self.stop.is_set():
            self.max = max(self.max, rss(self.pid))
            time.sleep(0.02)


async def lookups(t: Target, stop: asyncio.Event) -> tuple[list[float], list[int]]:
    req = pb.LookupRequest(namespace=t.card.namespace, block_keys=[b.key for b in t.honest])
    lat, matched = [], []
    async with own_connection(t.address) as ch:
        stub = pbg.PrefillCacheStub(ch)
        while not stop.is_set():
            t0 = time.perf_counter()
            resp = await stub.Lookup(req, timeout=10)
            lat.append(time.perf_counter() - t0)
            matched.append(resp.matched_tokens)
            await asyncio.sleep(0.02)
    return lat, matched


async def attacker(i: int, t: Target, until: float, kinds: list[str]) -> list[tuple[str, str]]:
    rng = random.Random(i)
    out = []
    async with own_connection(t.address) as ch:
        while time.monotonic() < until:
            kind = rng.choice(kinds)
            out.append((kind, await attack(ch, kind, t, rng)))
    return out


async def run(t: Target, publishers: int, seconds: float, kinds: list[str]) -> dict[str, object]:
    async with own_connection(t.address) as ch:
        honest = await publish(ch, t.card, t.honest)
    assert honest.stored == len(t.honest), honest
    stop = asyncio.Event()
    looking = asyncio.ensure_future(lookups(t, stop))
    until = time.monotonic() + seconds
    t0 = time.perf_counter()
    per = await asyncio.gather(*(attacker(i, t, until, kinds) for i in range(publishers)))
    elapsed = time.perf_counter() - t0
    stop.set()
    lat, matched = await looking
    results = [r for rs in per for r in rs]
    return {"results": results, "lookup_s": lat, "matched": matched, "attack_s": elapsed}


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--json", default="bench/results/hostile_publish.json")
    ap.add_argument("--publishers", type=int, default=8)
    ap.add_argument("--seconds", type=float, default=20.0)
    ap.add_argument("--kinds", default=",".join(ATTACKS), help="attacks to mix (comma-separated)")
    ap.add_argument("--smoke", action="store_true", help="CI: 2 publishers for 2 s")
    args = ap.parse_args()
    if args.smoke:
        args.publishers, args.seconds = 2, 2.0
    metrics = f"127.0.0.1:{free_port()}"
    proc, address = spawn(metrics)
    try:
        t = target(address)
        time.sleep(1.0)  # let start-up settle before the baseline
        baseline = rss(proc.pid)
        reset_peak_rss(proc.pid)
        sampler = Sampler(proc.pid)
        sampler.start()
        got = asyncio.run(run(t, args.publishers, args.seconds, args.kinds.split(",")))
        sampler.stop.set()
        sampler.join()
        peak = peak_rss(proc.pid)
        seen = scrape(metrics)
        alive = proc.poll() is None
    finally:
        stop(proc)
    results: list[tuple[str, str]] = got["results"]  # type: ignore[assignment]
    lat: list[float] = got["lookup_s"]  # type: ignore[assignment]
    matched: list[int] = got["matched"]  # type: ignore[assignment]
    bound = baseline + BUDGET + INFLIGHT
    rejected = {
        k.split("reason=")[1].split(",")[0]: v
        for k, v in seen.items()
        if k.startswith("kvmesh_rejections_total") and "surface=publish" in k and v
    }
    by_kind: dict[str, dict[str, int]] = {}
    for (kind, reason), n in Counter(results).items():
        by_kind.setdefault(kind, {})[reason] = n
    out = {
        "machine": machine(),
        "budget_mib": BUDGET / MiB,
        "max_block_mib": MAX_BLOCK / MiB,
        "inflight_cap_mib": INFLIGHT / MiB,
        "honest_stored_mib": sum(b.nbytes for b in t.honest) / MiB,
        "publishers": args.publishers,
        "attack_s": got["attack_s"],
        "hostile_publishes": len(results),
        "hostile_bytes_announced_note": "oversize announcements claim 1 TiB each",
        "baseline_rss_mib": baseline / MiB,
        "peak_rss_mib": peak / MiB,
        "peak_rss_sampled_mib": sampler.max / MiB,
        "bound_mib": bound / MiB,
        "headroom_mib": (bound - peak) / MiB,
        "peak_over_baseline_mib": (peak - baseline) / MiB,
        "within_bound": peak <= bound,
        "peer_alive": alive,
        "store_entries_after": seen["kvmesh_store_entries"],
        "inflight_bytes_after": seen["kvmesh_publish_inflight_bytes"],
        "lookups": len(lat),
        "lookups_all_honest": set(matched) == {256 * len(t.honest)},
        "lookup_p50_ms": statistics.median(lat) * 1e3,
        "lookup_p99_ms": sorted(lat)[int(0.99 * (len(lat) - 1))] * 1e3,
        "lookup_max_ms": max(lat) * 1e3,
        "outcomes_by_kind": by_kind,
        "peer_counted_publish_rejections": rejected,
    }
    print(
        f"baseline {out['baseline_rss_mib']:.1f} MiB, peak {out['peak_rss_mib']:.1f} MiB "
        f"(bound {out['bound_mib']:.1f}, headroom {out['headroom_mib']:.1f}); "
        f"{len(results)} hostile publishes in {out['attack_s']:.1f} s; {len(lat)} lookups, "
        f"p50 {out['lookup_p50_ms']:.2f} ms, max {out['lookup_max_ms']:.1f} ms; "
        f"stored after: {out['store_entries_after']:.0f} blocks (the honest 10)"
    )
    print(json.dumps(rejected))
    with open(args.json, "w") as fh:
        json.dump(out, fh, indent=1)
    failed = [k for k in ("within_bound", "peer_alive", "lookups_all_honest") if not out[k]]
    if failed or not lat:
        sys.exit(f"checks failed: {failed or ['no lookup answered']}")


if __name__ == "__main__":
    run_main(main)
