"""Time to first token: kvmesh against what users do today, side by side in one run.

    python bench/ttft.py --json bench/results/ttft.json [--lengths 128,512,1024,2048,4096]
                         [--model demo] [--device cpu|cuda]

For each prompt length, on the ~0.5B-shaped demo model:
  cold_s            cold local prefill, the engine's best path (inference mode,
                    logits of the last position only) + first token
  inprocess_s       in-process reuse, the floor: the live cache of the same prompt
  file_cache_s      a file-based prompt cache (KV + logits in safetensors, written by
                    this process, loaded by a fresh one: mlx-lm's save/load_prompt_cache
                    and llama.cpp's slot save/restore pattern)
  kvmesh_remote_s   a kvmesh head with an empty store, remote hit from a real peer
                    process over loopback (lookup, fetch, SHA-256, import)
  *_extend_s        the same for the cached prompt plus 64 new tokens
Prompt lengths are multiples of the 32-token block, so the extension reuses the
whole prompt; other lengths recompute up to 31 more tokens.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from _common import machine, spawn_peer
from safetensors.torch import save_file

from kvmesh.engine import KVState, Sampling, load_engine
from kvmesh.mesh.node import NodeConfig, NodeThread
from kvmesh.runtime.head import HeadRuntime

ONE = Sampling(max_tokens=1)
EXT = 64
HERE = Path(__file__).resolve().parent


def tokens(engine, n: int, salt: str) -> list[int]:  # type: ignore[no-untyped-def]
    text = f"[{salt}] " + " ".join(f"fact {i}: blocks are immutable and verified." for i in range(n))
    out = engine.encode(text)[:n]
    assert len(out) == n
    return out


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def timed(fn, device: str) -> float:  # type: ignore[no-untyped-def]
    sync(device)
    t0 = time.perf_counter()
    fn()
    sync(device)
    return time.perf_counter() - t0


def fresh_head(engine, peer: str, ns_hex: str) -> HeadRuntime:  # type: ignore[no-untyped-def]
    node = NodeThread(NodeConfig(seeds=[peer], gossip_interval=0.2, ttl=5, alias=f"bench-{time.time_ns()}"))
    head = HeadRuntime(engine, node, max_sessions=0, publish=False)
    deadline = time.time() + 10
    while not any(ns_hex in c.namespaces for c in node.node.membership.live()):
        if time.time() > deadline:
            raise RuntimeError("peer never advertised the namespace")
        time.sleep(0.05)
    return head


def close(head: HeadRuntime) -> None:
    head.close()
    assert head.node is not None
    head.node.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", default="bench/results/ttft.json")
    ap.add_argument("--lengths", default="128,512,1024,2048,4096")
    ap.add_argument("--model", default="demo")
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args()
    engine = load_engine(args.model, device=args.device)
    engine.prefill(list(range(16)))
    card = engine.card
    proc, peer = spawn_peer("--gossip-interval", "0.2", "--budget", "8GiB")
    publisher = NodeThread(NodeConfig(seeds=[peer], gossip_interval=0.2, alias="bench-publisher"))
    rows = []
    try:
        time.sleep(0.5)
        for n in (int(x) for x in args.lengths.split(",")):
            toks = tokens(engine, n, f"len{n}")
            ext = tokens(engine, EXT, f"ext{n}")
            row: dict[str, float | int] = {"prompt_tokens": n, "kv_bytes": n * card.kv_bytes_per_token}
            state: KVState | None = None

            def cold() -> None:
                nonlocal state
                state = engine.prefill(toks)
                engine.sample(state.logits, ONE, None)

            row["cold_s"] = min(timed(cold, args.device) for _ in range(1 if n >= 2048 else 2))
            assert state is not None
            live = state
            row["inprocess_s"] = min(timed(lambda: engine.sample(live.logits, ONE, None), args.device)
                                     for _ in range(5))  # fmt: skip
            row["inprocess_extend_s"] = min(
                timed(lambda: engine.sample(engine.extend(live, ext).logits, ONE, None), args.device)
                for _ in range(2)
            )
            # publish the prompt's blocks to the peer, as a head would after answering
            blocks = engine.export(live, HeadRuntime(engine, None).keyer)
            target = publisher.node.membership.live()[0]
            publisher.call(publisher.node.client.publish(target, card, blocks))
            # file cache: one process saves, a fresh one loads
            with tempfile.TemporaryDirectory() as d:
                path = os.path.join(d, "prompt.safetensors")
                save_file({**{f"k{i}": lay.keys[:, :, :n].contiguous().cpu() for i, lay in enumerate(live.cache.layers)},
                           **{f"v{i}": lay.values[:, :, :n].contiguous().cpu() for i, lay in enumerate(live.cache.layers)},
                           "logits": live.logits.cpu()}, path)  # fmt: skip
                out = subprocess.run(
                    [sys.executable, str(HERE / "_filecache.py"), args.model, args.device, path, str(n), json.dumps(ext)],
                    capture_output=True, text=True, check=True,
                )  # fmt: skip
                fc = json.loads(out.stdout.strip().splitlines()[-1])
                row["file_cache_s"], row["file_cache_extend_s"] = fc["exact"], fc["extend"]
            # kvmesh: heads with empty stores, remote hits over loopback
            for key, prompt in (("kvmesh_remote_s", toks), ("kvmesh_extend_s", toks + ext)):
                head = fresh_head(engine, peer, card.namespace_hex)
                try:
                    g = head.complete(prompt, ONE)
                    assert g.report is not None and g.report.source == "remote", g.report
                    row[key] = g.ttft_s
                    if key == "kvmesh_remote_s":
                        row["fetch_s"] = g.report.fetch_s
                finally:
                    close(head)
            row["speedup_remote"] = row["cold_s"] / row["kvmesh_remote_s"]
            row["remote_vs_file"] = row["file_cache_s"] / row["kvmesh_remote_s"]
            row["extend_vs_floor"] = row["kvmesh_extend_s"] / row["inprocess_extend_s"]
            rows.append(row)
            print(
                f"{n:5d} tok  cold {row['cold_s']:.3f}s  in-proc {row['inprocess_s'] * 1e3:.2f}ms  "
                f"file {row['file_cache_s'] * 1e3:.1f}ms  kvmesh {row['kvmesh_remote_s'] * 1e3:.1f}ms "
                f"({row['speedup_remote']:.0f}x cold, {row['remote_vs_file']:.2f}x file)  "
                f"extend: kvmesh {row['kvmesh_extend_s'] * 1e3:.0f}ms vs floor "
                f"{row['inprocess_extend_s'] * 1e3:.0f}ms ({row['extend_vs_floor']:.2f}x)",
                flush=True,
            )
    finally:
        publisher.close()
        proc.send_signal(signal.SIGTERM)
        proc.wait(10)
    with open(args.json, "w") as fh:
        json.dump({"machine": machine(), "model": args.model, "device": args.device, "card": card.summary(),
                   "extension_tokens": EXT, "results": rows}, fh, indent=1)  # fmt: skip
    plot(rows, Path(args.json).with_suffix(".png"))


def plot(rows: list[dict], path: Path) -> None:  # type: ignore[type-arg]
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    n = [r["prompt_tokens"] for r in rows]
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for key, label in (("cold_s", "cold local prefill"), ("file_cache_s", "file prompt cache (fresh process)"),
                       ("kvmesh_remote_s", "kvmesh remote hit (loopback)"),
                       ("kvmesh_extend_s", "kvmesh hit + 64 new tokens"),
                       ("inprocess_extend_s", "in-process + 64 new tokens (floor)")):  # fmt: skip
        ax.plot(n, [r[key] for r in rows], marker="o", label=label)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("prompt tokens")
    ax.set_ylabel("time to first token (s)")
    ax.set_title("TTFT on the ~0.5B demo model, 2-core CPU")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
