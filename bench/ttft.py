"""Time to first token: kvmesh against what users do today, side by side in one run.

    python bench/ttft.py --json bench/results/ttft.json [--lengths 128,512,1024,2048,4096]
                         [--model demo] [--device cpu|cuda] [--dtype bfloat16]
                         [--sliding-window 128]
    python bench/ttft.py --smoke --json /tmp/ttft.json   # CI: demo-tiny, 64 tokens
    GPU: python bench/ttft.py --device cuda --model demo-8b --lengths 1024,4096,16384

For each prompt length, on the ~0.5B-shaped demo model:
  cold_s            cold local prefill, the engine's best path (inference mode,
                    logits of the last position only) + first token
  inprocess_s       in-process reuse, the floor: the live cache of the same prompt
  file_cache_s      a file-based prompt cache (KV + logits in safetensors, written by
                    this process, read into the cache by a fresh one: llama.cpp's slot
                    save/restore and mlx-lm's save/load_prompt_cache pattern); also
                    file_cache_mmap_s (left memory-mapped, the KV is not read before the
                    first token of an exact repeat) and file_cache_cold_s (page cache
                    dropped first; root only)
  kvmesh_remote_s   a kvmesh head with an empty store, remote hit from a real peer
                    process over loopback (lookup, fetch, BLAKE3, import)
  kvmesh_netns_<rate>_s  the same from a peer in another network namespace over a
                    veth link capped with tbf (10 and 40 Gbit/s; root only)
  *_extend_s        the same for the cached prompt plus 64 new tokens
Prompt lengths are multiples of the 32-token block, so the extension reuses the
whole prompt; other lengths recompute up to 31 more tokens.

``--sliding-window W`` runs on a copy of ``--model`` whose config gives its layers
Gemma-3's pattern (five sliding-window layers of W tokens per full-attention
layer), the same weights: a sliding-window model of exactly the full model's size,
to compare the two JSON files side by side. Its file-cache baseline is left out
(``_filecache.py`` restores full-attention caches only).

The fleet runs the secure path: a fleet key generated for the run (a file in a
temp dir) authenticates every call and keys the block hashes; the namespace's peer
listens off loopback, so it needs one. Peers and namespaces are removed on any exit.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from _common import (
    fail_point,
    machine,
    own_link,
    own_netns,
    run_main,
    spawn_kvmesh,
    spawn_peer,
    stop,
    wait_for,
)
from safetensors.torch import save_file

from kvmesh.blocks import BlockKeyer
from kvmesh.compat import CompatCard
from kvmesh.engine import KVState, Sampling, load_engine
from kvmesh.mesh.node import NodeConfig, NodeThread
from kvmesh.mesh.security import Security
from kvmesh.runtime.head import HeadRuntime

ONE = Sampling(max_tokens=1)
EXT = 64
HERE = Path(__file__).resolve().parent


def tokens(engine, n: int, salt: str) -> list[int]:  # type: ignore[no-untyped-def]
    text = f"[{salt}] " + " ".join(
        f"fact {i}: blocks are immutable and verified." for i in range(n)
    )
    out = engine.encode(text)[:n]
    assert len(out) == n
    return out


def sliding_variant(model: str, window: int) -> str:
    """A copy of ``model``'s directory with five sliding layers of ``window`` tokens
    per full one (``layer_types``), the same weight files (hard links where possible)."""
    import shutil

    from kvmesh.engine.demo import resolve_model

    src = resolve_model(model)
    dst = Path(tempfile.gettempdir()) / f"kvmesh-bench-{src.name}-swa{window}"
    cfg = json.loads((src / "config.json").read_text())
    layers = int(cfg["num_hidden_layers"])
    types = ["full_attention" if i % 6 == 5 else "sliding_attention" for i in range(layers)]
    dst.mkdir(exist_ok=True)
    for f in src.iterdir():
        if f.is_file() and not (dst / f.name).exists():
            try:
                os.link(f, dst / f.name)
            except OSError:
                shutil.copy2(f, dst / f.name)
    cfg.update(
        sliding_window=window,
        use_sliding_window=True,
        max_window_layers=layers,
        layer_types=types,
        _name_or_path=dst.name,
    )
    (dst / "config.json").unlink(missing_ok=True)  # a link to the source's: never write through it
    (dst / "config.json").write_text(json.dumps(cfg, indent=1))
    return str(dst)


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def timed(fn, device: str) -> float:  # type: ignore[no-untyped-def]
    sync(device)
    t0 = time.perf_counter()
    fn()
    sync(device)
    return time.perf_counter() - t0


def fleet_key(directory: str) -> tuple[str, Security]:
    """A fresh fleet key in a file (as `openssl rand -hex 32 > fleet.key` makes one)."""
    path = os.path.join(directory, "fleet.key")
    with open(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "w") as f:
        f.write(secrets.token_hex(32) + "\n")
    with open(path, "rb") as f:
        return path, Security(fleet_key=f.read().strip())


def fresh_head(engine, peer: str, ns_hex: str, security: Security) -> HeadRuntime:  # type: ignore[no-untyped-def]
    node = NodeThread(
        NodeConfig(
            seeds=[peer],
            gossip_interval=0.2,
            ttl=5,
            alias=f"bench-{time.time_ns()}",
            security=security,
        )
    )
    head = HeadRuntime(
        engine, node, max_sessions=0, publish=False, hash_key=security.block_hash_key
    )
    try:
        wait_for(
            lambda: any(ns_hex in c.namespaces for c in node.node.membership.live()),
            10,
            "the peer to advertise the namespace",
        )
    except BaseException:
        close(head)
        raise
    return head


def close(head: HeadRuntime) -> None:
    head.close()
    assert head.node is not None
    head.node.close()


class NetnsPeer:
    """A `kvmesh peer` in its own network namespace behind a veth link, under the
    fleet key (it listens off loopback). Names carry our pid, so runs do not collide;
    the namespace, the link and the peer are owned by `_common` and go on any exit."""

    HOST, PEER = "10.78.0.1", "10.78.0.2"

    def __init__(self, key_file: str) -> None:
        tag = f"kvmb{os.getpid()}"
        self.ns, self.host_if, self.peer_if = tag, tag + "h", tag + "p"
        self.address = f"{self.PEER}:7070"
        own_netns(self.ns)
        own_link(self.host_if, "type", "veth", "peer", "name", self.peer_if)
        run = lambda *c: subprocess.run(c, check=True, capture_output=True, timeout=30)  # noqa: E731
        run("ip", "link", "set", self.peer_if, "netns", self.ns)
        run("ip", "addr", "add", f"{self.HOST}/24", "dev", self.host_if)
        run("ip", "link", "set", self.host_if, "up")
        for c in (
            ["ip", "addr", "add", f"{self.PEER}/24", "dev", self.peer_if],
            ["ip", "link", "set", self.peer_if, "up"],
            ["ip", "link", "set", "lo", "up"],
        ):
            run("ip", "netns", "exec", self.ns, *c)
        fail_point("netns")
        self.proc, _ = spawn_kvmesh(
            "peer",
            "--listen",
            self.address,
            "--plaintext",
            "--fleet-key-file",
            key_file,
            "--budget",
            "8GiB",
            "--gossip-interval",
            "0.2",
            "--advertise",
            f"{self.address},interface=ethernet",
            pattern="listening",
            prefix=("ip", "netns", "exec", self.ns),
        )

    def shape(self, rate: str) -> None:
        """Cap the peer->head direction with a token bucket."""
        subprocess.run(
            [
                "ip",
                "netns",
                "exec",
                self.ns,
                "tc",
                "qdisc",
                "replace",
                "dev",
                self.peer_if,
                "root",
                "tbf",
                "rate",
                rate,
                "burst",
                "4mb",
                "latency",
                "50ms",
            ],
            check=True,
            timeout=30,
        )


def file_cache(args: argparse.Namespace, live: KVState, n: int, ext: list[int]) -> dict:  # type: ignore[type-arg]
    """The file prompt cache: this process saves the prompt's KV, a fresh one loads it."""
    row = {}
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "prompt.safetensors")
        save_file(
            {
                **{
                    f"k{i}": lay.keys[:, :, :n].contiguous().cpu()
                    for i, lay in enumerate(live.cache.layers)
                },
                **{
                    f"v{i}": lay.values[:, :, :n].contiguous().cpu()
                    for i, lay in enumerate(live.cache.layers)
                },
                "logits": live.logits.cpu(),
            },
            path,
        )
        out = subprocess.run(
            [
                sys.executable,
                str(HERE / "_filecache.py"),
                args.model,
                args.device,
                path,
                str(n),
                json.dumps(ext),
                args.dtype or "",
            ],
            capture_output=True,
            text=True,
            check=True,
        )
        fc = json.loads(out.stdout.strip().splitlines()[-1])
    row["file_cache_s"], row["file_cache_extend_s"] = fc["read"], fc["read_extend"]
    row["file_cache_mmap_s"], row["file_cache_mmap_extend_s"] = fc["lazy"], fc["lazy_extend"]
    if "cold" in fc:
        row["file_cache_cold_s"] = fc["cold"]
    return row


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--json", default="bench/results/ttft.json")
    ap.add_argument("--lengths", default="128,512,1024,2048,4096")
    ap.add_argument("--model", default="demo")
    ap.add_argument("--device", default="cpu")
    ap.add_argument(
        "--dtype",
        default=None,
        help="float32 | float16 | bfloat16 (default: the model's on GPU, float32 on CPU)",
    )
    ap.add_argument(
        "--sliding-window",
        type=int,
        default=0,
        help="run on --model's weights with Gemma-3's sliding/full layer pattern",
    )
    ap.add_argument(
        "--netns",
        action=argparse.BooleanOptionalAction,
        default=os.geteuid() == 0,
        help="also measure a peer in another network namespace (needs root)",
    )
    ap.add_argument(
        "--smoke", action="store_true", help="CI: demo-tiny, one 64-token prompt, every path once"
    )
    args = ap.parse_args()
    if args.smoke:  # the page cache is the whole machine's: a smoke run leaves it alone
        os.environ["KVMESH_BENCH_NO_DROP_CACHES"] = "1"
        args.model, args.lengths = "demo-tiny", "64"
    if args.sliding_window:
        args.model = sliding_variant(args.model, args.sliding_window)
    with tempfile.TemporaryDirectory(prefix="kvmesh-ttft-") as keys:
        key_file, security = fleet_key(keys)
        rows, card = measure(args, key_file, security)
    with open(args.json, "w") as fh:
        json.dump(
            {
                "machine": machine(),
                "model": args.model,
                "device": args.device,
                "card": card.summary(),
                "sliding_windows": list(card.sliding_windows),
                "extension_tokens": EXT,
                "fleet_key": True,
                "results": rows,
            },
            fh,
            indent=1,
        )
    plot(rows, Path(args.json).with_suffix(".png"))


def measure(
    args: argparse.Namespace, key_file: str, security: Security
) -> tuple[list[dict], CompatCard]:  # type: ignore[type-arg]
    engine = load_engine(args.model, device=args.device, dtype=args.dtype)
    engine.prefill(list(range(16)))
    card = engine.card
    keyer = BlockKeyer(card.namespace, card.block_tokens, security.block_hash_key)
    proc, peer = spawn_peer(  # TCP on loopback, as its results always measured
        "--gossip-interval",
        "0.2",
        "--budget",
        "8GiB",
        "--fleet-key-file",
        key_file,
        "--no-local-socket",
    )
    publisher = NodeThread(
        NodeConfig(seeds=[peer], gossip_interval=0.2, alias="bench-publisher", security=security)
    )
    netns = NetnsPeer(key_file) if args.netns else None

    def publish_to(address: str, blocks) -> None:  # type: ignore[no-untyped-def]
        target = next(
            c
            for c in publisher.node.membership.live()
            if any(e.address == address for e in c.endpoints)
        )
        publisher.call(publisher.node.client.publish(target, card, blocks))

    if netns is not None:
        publisher.node.config.seeds.append(netns.address)
    rows = []
    try:
        time.sleep(0.5)
        for n in (int(x) for x in args.lengths.split(",")):
            toks = tokens(engine, n, f"len{n}")
            ext = tokens(engine, EXT, f"ext{n}")
            row: dict[str, float | int] = {
                "prompt_tokens": n,
                "kv_bytes": n * card.kv_bytes_per_token,
            }
            state: KVState | None = None

            def cold() -> None:
                nonlocal state
                state = engine.prefill(toks)
                engine.sample(state.logits, ONE, None)

            row["cold_s"] = min(timed(cold, args.device) for _ in range(1 if n >= 2048 else 2))
            assert state is not None
            live = state
            row["inprocess_s"] = min(
                timed(lambda: engine.sample(live.logits, ONE, None), args.device) for _ in range(5)
            )
            row["inprocess_extend_s"] = min(
                timed(
                    lambda: engine.sample(engine.extend(live, ext).logits, ONE, None), args.device
                )
                for _ in range(2)
            )
            # publish the prompt's blocks to the peer, as a head would after answering
            blocks = engine.export(live, keyer)
            publish_to(peer, blocks)
            if not any(card.sliding_windows):  # _filecache.py restores full caches only
                row.update(file_cache(args, live, n, ext))
            # kvmesh: heads with empty stores, remote hits over loopback
            for key, prompt in (("kvmesh_remote_s", toks), ("kvmesh_extend_s", toks + ext)):
                head = fresh_head(engine, peer, card.namespace_hex, security)
                try:
                    g = head.complete(prompt, ONE)
                    assert g.report is not None and g.report.source == "remote", g.report
                    row[key] = g.ttft_s
                    if key == "kvmesh_remote_s":
                        row["fetch_s"] = g.report.fetch_s
                finally:
                    close(head)
            if netns is not None:
                publish_to(netns.address, blocks)
                for rate in ("10gbit", "40gbit"):
                    netns.shape(rate)
                    head = fresh_head(engine, netns.address, card.namespace_hex, security)
                    try:
                        g = head.complete(toks, ONE)
                        assert g.report is not None and g.report.source == "remote", g.report
                        row[f"kvmesh_netns_{rate}_s"] = g.ttft_s
                    finally:
                        close(head)
            row["speedup_remote"] = row["cold_s"] / row["kvmesh_remote_s"]
            if "file_cache_s" in row:
                row["remote_vs_file"] = row["file_cache_s"] / row["kvmesh_remote_s"]
            row["extend_vs_floor"] = row["kvmesh_extend_s"] / row["inprocess_extend_s"]
            rows.append(row)
            print(
                f"{n:5d} tok  cold {row['cold_s']:.3f}s  in-proc {row['inprocess_s'] * 1e3:.2f}ms  "
                f"file {row.get('file_cache_s', float('nan')) * 1e3:.1f}ms  "
                f"kvmesh {row['kvmesh_remote_s'] * 1e3:.1f}ms ({row['speedup_remote']:.0f}x cold, "
                f"{row.get('remote_vs_file', float('nan')):.2f}x file)  "
                f"extend: kvmesh {row['kvmesh_extend_s'] * 1e3:.0f}ms vs floor "
                f"{row['inprocess_extend_s'] * 1e3:.0f}ms ({row['extend_vs_floor']:.2f}x)"
                + "".join(
                    f"  netns {r}: {row[f'kvmesh_netns_{r}_s'] * 1e3:.1f}ms"
                    for r in ("10gbit", "40gbit")
                    if f"kvmesh_netns_{r}_s" in row
                ),
                flush=True,
            )
    finally:
        publisher.close()
        stop(proc)  # the namespace's peer, namespace and link: run_main
    return rows, card


def plot(rows: list[dict], path: Path) -> None:  # type: ignore[type-arg]
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    n = [r["prompt_tokens"] for r in rows]
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for key, label in (
        ("cold_s", "cold local prefill"),
        ("file_cache_s", "file prompt cache, read (fresh process)"),
        ("file_cache_mmap_s", "file prompt cache, mmap (fresh process)"),
        ("kvmesh_remote_s", "kvmesh remote hit (loopback)"),
        ("kvmesh_extend_s", "kvmesh hit + 64 new tokens"),
        ("inprocess_extend_s", "in-process + 64 new tokens (floor)"),
    ):
        if all(key in r for r in rows):
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
    run_main(main)
