"""Disk tier figures: time to first token of a disk hit on the real engine beside a
RAM hit, cold prefill and a file prompt cache; store-level prefix reads; index
rebuild for 10^5 blocks; write throughput under churn.

    python bench/disk.py [--ttft 1024,2048,4096] [--model demo] [--tokens 1024,4096]
                         [--rebuild-blocks 100000] [--churn-blocks 200] [--json PATH]
    python bench/disk.py --smoke --json /tmp/disk.json   # CI: demo-tiny, small sizes

``ttft`` (per prompt length, on the ~0.5B-shaped demo model, float32 on CPU; the
engine loaded once and warmed up; each figure is the head's own time to first
token of one request, ``HeadRuntime.complete``, no sessions, no publishing):

  cold_s               cold local prefill (the engine's best path) + first token
  ram_hit_s            the head's own store holds the prompt in RAM (source local)
  disk_warm_s          a restarted head (empty RAM) whose disk tier holds it, page
                       cache warm (source disk: read, verify, promote, import)
  disk_dropped_s       the same after dropping the page cache (root only)
  file_cache_s         KV + logits in safetensors, read into the cache by a fresh
                       process (bench/_filecache.py, as bench/ttft.py); also
                       file_cache_mmap_s (left mapped) and file_cache_cold_s

Store-level blocks have the demo model's geometry (24 layers, 2 KV heads of 64,
float32: 24 KiB per token, 768 KiB per 32-token block). Writes results to --json
(default bench/results/disk.json). Nothing here asserts a time; it exits non-zero
if a hit comes from the wrong tier or the rebuilt index misses a block file.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _common import run_main  # noqa: E402

from kvmesh.blocks import BlockKeyer  # noqa: E402
from kvmesh.store import (  # noqa: E402
    BlockStore,  # noqa: E402
    DiskConfig,
    DiskFiles,
)
from tests.helpers import small_card, synthetic_chain  # noqa: E402

if TYPE_CHECKING:
    from kvmesh.engine import KVState

DEMO = small_card(
    num_layers=24,
    num_kv_heads=2,
    head_dim=64,
    sliding_windows=(0,) * 24,
    vocab_size=151936,
    block_tokens=32,
)
TINY = small_card()  # 4-token blocks of a few hundred bytes: the rebuild test


def drop_caches() -> str:
    if os.environ.get("KVMESH_BENCH_NO_DROP_CACHES") == "1":
        return "not dropped: KVMESH_BENCH_NO_DROP_CACHES=1"
    os.sync()
    try:
        Path("/proc/sys/vm/drop_caches").write_text("1\n")
        return "dropped"
    except OSError as e:
        return f"not dropped: {e}"


def prefix_reads(root: Path, n_tokens: int) -> dict[str, object]:
    toks = list(range(n_tokens))
    chain = synthetic_chain(DEMO, toks, tail=False)
    keys = BlockKeyer(DEMO.namespace, DEMO.block_tokens).keys(toks)
    d = root / f"prefix-{n_tokens}"
    s = BlockStore(1 << 34, disk=DiskConfig(str(d), 1 << 34))
    for b in chain:
        s.put(b)
    s.flush()
    t0 = time.perf_counter()
    ram = s.longest_prefix(keys)
    ram_s = time.perf_counter() - t0
    s.close()
    out: dict[str, object] = {"tokens": n_tokens, "bytes": ram.nbytes, "ram_s": ram_s}
    for label in ("disk_warm", "disk_dropped"):
        note = drop_caches() if label == "disk_dropped" else "warm"
        s = BlockStore(1 << 34, disk=DiskConfig(str(d), 1 << 34))  # a restart: empty RAM
        t0 = time.perf_counter()
        m = s.longest_prefix(keys)  # read, verify, promote
        out[f"{label}_s"] = time.perf_counter() - t0
        out[f"{label}_note"] = note
        assert m.tokens == n_tokens
        s.close()
    shutil.rmtree(d)
    return out


def ttft(
    root: Path, model: str, lengths: list[int], file_cache: bool = True
) -> list[dict[str, object]]:
    """Real engine time to first token: cold, RAM hit, disk hit (warm, dropped), file cache."""
    from kvmesh.engine import Sampling, load_engine
    from kvmesh.mesh.node import NodeConfig, NodeThread
    from kvmesh.runtime.head import HeadRuntime

    one = Sampling(max_tokens=1)
    engine = load_engine(model)
    engine.prefill(list(range(16)))  # warm up, as every path is
    rows = []
    for n in lengths:
        text = f"[disk {n}] " + " ".join(
            f"fact {i}: a block outlives its process." for i in range(n)
        )
        toks = engine.encode(text)[:n]
        d = root / f"ttft-{n}"
        row: dict[str, object] = {
            "prompt_tokens": n,
            "kv_bytes": n * engine.card.kv_bytes_per_token,
        }

        def head(disk: bool) -> HeadRuntime:
            cfg = NodeConfig(alias=f"bench-{time.time_ns()}", budget_bytes=8 << 30)
            if disk:
                cfg.disk_path, cfg.disk_budget_bytes = str(d), 8 << 30
            return HeadRuntime(engine, NodeThread(cfg), max_sessions=0, publish=False)

        def close(h: HeadRuntime) -> None:
            h.close()
            assert h.node is not None
            h.node.close()

        t0 = time.perf_counter()
        state = engine.prefill(toks)
        engine.sample(state.logits, one, None)
        row["cold_s"] = time.perf_counter() - t0
        h = head(disk=True)
        blocks = engine.export(state, h.keyer)
        assert h.fleet is not None
        h.fleet.keep(blocks)
        assert h.fleet.store.flush()
        g = h.complete(toks, one)
        assert g.report is not None and g.report.source == "local", g.report
        row["ram_hit_s"] = g.ttft_s
        close(h)
        for label in ("disk_warm", "disk_dropped"):
            row[f"{label}_note"] = drop_caches() if label == "disk_dropped" else "warm"
            h = head(disk=True)  # a restart: the index rebuilt from headers, RAM empty
            g = h.complete(toks, one)
            assert g.report is not None and g.report.source == "disk", g.report
            assert g.report.reused_tokens == n
            row[f"{label}_s"] = g.ttft_s
            close(h)
        shutil.rmtree(d)
        if file_cache:
            row.update(file_cache_row(root, model, state, n))
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def file_cache_row(root: Path, model: str, state: KVState, n: int) -> dict[str, object]:
    """The same prompt from a safetensors file, read by a fresh process."""
    import subprocess

    from safetensors.torch import save_file

    path = root / "prompt.safetensors"
    layers = state.cache.layers
    save_file(
        {
            **{f"k{i}": lay.keys[:, :, :n].contiguous() for i, lay in enumerate(layers)},
            **{f"v{i}": lay.values[:, :, :n].contiguous() for i, lay in enumerate(layers)},
            "logits": state.logits,
        },
        str(path),
    )
    helper = Path(__file__).parent / "_filecache.py"
    out = subprocess.run(
        [sys.executable, str(helper), model, "cpu", str(path), str(n), "[]", ""],
        capture_output=True,
        text=True,
        check=True,
        timeout=600,
    )
    fc = json.loads(out.stdout.strip().splitlines()[-1])
    path.unlink()
    row = {"file_cache_s": fc["read"], "file_cache_mmap_s": fc["lazy"]}
    if "cold" in fc:
        row["file_cache_cold_s"] = fc["cold"]
    return row


def rebuild(root: Path, n_blocks: int) -> dict[str, object]:
    d = root / "rebuild"
    files = DiskFiles(d)
    made, i = 0, 0
    while made < n_blocks:  # many short chains; files written without fsync (setup only)
        for b in synthetic_chain(TINY, [i % 7] + list(range(i, i + 39))):
            (files.blocks / (b.digest.hex() + ".kvb")).write_bytes(b.blob)
            made += 1
        i += 1
    t0 = time.perf_counter()
    s = BlockStore(1 << 30, disk=DiskConfig(str(d), 1 << 34))
    dt = time.perf_counter() - t0
    out = {"files": made, "indexed": s.disk_stats.entries, "rebuild_s": dt}
    s.close()
    shutil.rmtree(d)
    return out


def churn(root: Path, n_blocks: int) -> dict[str, object]:
    """Distinct 768 KiB blocks through 16 MiB of RAM into a 64 MiB disk tier."""
    d = root / "churn"
    s = BlockStore(16 << 20, disk=DiskConfig(str(d), 64 << 20))
    blocks = []
    i = 0
    while len(blocks) < n_blocks:
        blocks += synthetic_chain(DEMO, [i] + list(range(1, 8 * 32)), tail=False)
        i += 1
    t0 = time.perf_counter()
    for b in blocks[:n_blocks]:
        s.put(b)
    put_s = time.perf_counter() - t0
    s.flush()
    dt = time.perf_counter() - t0
    ds = s.disk_stats
    out = {
        "blocks": n_blocks,
        "bytes": sum(b.nbytes for b in blocks[:n_blocks]),
        "put_s": put_s,
        "written_s": dt,
        "admissions": ds.admissions,
        "dropped_queue_full": ds.dropped,
        "disk_evictions": ds.evictions,
        "written_mib_s": ds.admissions * blocks[0].nbytes / dt / 2**20,
    }
    s.close()
    shutil.rmtree(d)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ttft", default="1024,2048,4096", help="prompt lengths ('' to skip)")
    ap.add_argument("--model", default="demo")
    ap.add_argument("--tokens", default="1024,4096")
    ap.add_argument("--rebuild-blocks", type=int, default=100_000)
    ap.add_argument("--churn-blocks", type=int, default=200)
    ap.add_argument("--dir", help="where to write (default: a temp dir)")
    ap.add_argument("--json", type=Path, default=Path(__file__).parent / "results" / "disk.json")
    ap.add_argument("--smoke", action="store_true", help="CI: demo-tiny, small sizes")
    args = ap.parse_args()
    if args.smoke:  # the page cache is the whole machine's: a smoke run leaves it alone
        os.environ["KVMESH_BENCH_NO_DROP_CACHES"] = "1"
        args.model, args.ttft, args.tokens = "demo-tiny", "64", "128"
        args.rebuild_blocks, args.churn_blocks = 400, 24
    root = Path(args.dir or tempfile.mkdtemp(prefix="kvmesh-disk-bench-"))
    root.mkdir(parents=True, exist_ok=True)
    try:
        res: dict[str, object] = {
            "ttft": ttft(
                root,
                args.model,
                [int(n) for n in args.ttft.split(",") if n],
                file_cache=not args.smoke,
            ),  # smoke: bench/ttft.py covers _filecache.py
            "prefix_reads": [prefix_reads(root, int(n)) for n in args.tokens.split(",")],
            "rebuild": rebuild(root, args.rebuild_blocks),
            "churn": churn(root, args.churn_blocks),
        }
    finally:
        if not args.dir:
            shutil.rmtree(root, ignore_errors=True)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(res, indent=2) + "\n")
    print(json.dumps(res, indent=2))
    rebuilt = res["rebuild"]
    assert isinstance(rebuilt, dict)
    if rebuilt["indexed"] != rebuilt["files"]:
        sys.exit(f"the rebuilt index holds {rebuilt['indexed']} of {rebuilt['files']} block files")


if __name__ == "__main__":
    run_main(main)
