"""Codec throughput and the choice of block size, on the ~0.5B demo KV shape.

    python bench/codec.py --json bench/results/codec.json
    python bench/codec.py --smoke --json /tmp/codec.json   # CI: 128 tokens, B=16 and 32

For each block size: encode (copy KV out of cache tensors into blobs + digest),
decode (validate header + verify the digest), import (copy into cache tensors), and
the key chain + store lookup, for a 1024-token prefix; plus the tokens of reuse
lost on average at a divergence point (B/2). Writes JSON.
"""

from __future__ import annotations

import argparse
import json
import platform
import time

import torch
from _common import demo_card, fake_engine, random_state, run_main

from kvmesh.blocks import BlockKeyer
from kvmesh.codec import decode_block
from kvmesh.engine.base import EngineBase
from kvmesh.store import BlockStore

REPS = [5]  # best of; 1 in --smoke


def _best(fn, reps: int = 0) -> float:
    best = float("inf")
    for _ in range(reps or REPS[0]):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def measure(block_tokens: int, n_tokens: int) -> dict[str, float]:
    card = demo_card(block_tokens)
    eng = fake_engine(card)
    state = random_state(card, n_tokens)
    keyer = BlockKeyer(card.namespace, block_tokens)
    blocks = EngineBase.export(eng, state, keyer)  # type: ignore[arg-type]
    nbytes = sum(b.nbytes for b in blocks)
    enc = _best(lambda: EngineBase.export(eng, state, keyer))  # type: ignore[arg-type]
    dec = _best(lambda: [decode_block(b.blob, eng.layout, b.digest) for b in blocks])
    imp = _best(lambda: eng._import(blocks, n_tokens))
    store = BlockStore(1 << 32)
    for b in blocks:
        store.put(b)
    look = _best(lambda: store.longest_prefix(keyer.keys(state.tokens)), 4 * REPS[0])
    assert store.longest_prefix(keyer.keys(state.tokens)).tokens == n_tokens  # all reused
    return {
        "block_tokens": block_tokens,
        "block_bytes": blocks[0].nbytes,
        "blocks": len(blocks),
        "bytes": nbytes,
        "encode_gbps": nbytes / enc / 1e9,
        "decode_verify_gbps": nbytes / dec / 1e9,
        "import_gbps": nbytes / imp / 1e9,
        "keys_and_lookup_ms": look * 1e3,
        "mean_tokens_lost_at_divergence": block_tokens / 2,
    }


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--json", default="bench/results/codec.json")
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--sizes", default="8,16,32,64,128")
    ap.add_argument("--smoke", action="store_true", help="CI: 128 tokens, B=16,32, best of 1")
    args = ap.parse_args()
    if args.smoke:
        args.tokens, args.sizes, REPS[0] = 128, "16,32", 1
    rows = [measure(int(b), args.tokens) for b in args.sizes.split(",")]
    for r in rows:
        print(
            f"B={r['block_tokens']:4d} block={r['block_bytes'] / 2**10:7.0f} KiB  "
            f"encode {r['encode_gbps']:.2f} GB/s  decode+verify {r['decode_verify_gbps']:.2f} GB/s  "
            f"import {r['import_gbps']:.2f} GB/s  keys+lookup {r['keys_and_lookup_ms']:.3f} ms"
        )
    out = {
        "machine": platform.processor() or platform.machine(),
        "threads": torch.get_num_threads(),
        "prompt_tokens": args.tokens,
        "results": rows,
    }
    with open(args.json, "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    run_main(main)
