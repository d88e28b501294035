"""Codec throughput and the choice of block size, on the ~0.5B demo KV shape.

    python bench/codec.py --json bench/results/codec.json
    python bench/codec.py --smoke --json /tmp/codec.json   # CI: 128 tokens, B=16 and 32

For each block size: encode (copy KV out of cache tensors into blobs + digest),
decode (validate header + verify the digest), import (copy into cache tensors), and
the key chain + store lookup, for a 1024-token prefix; plus the tokens of reuse
lost on average at a divergence point (B/2). Writes JSON.

``compression`` (kvmesh/squeeze.py, lossless codecs for slow links): KV exported by a real
forward of each ``--compression-models`` entry (``MODEL[:DTYPE]``; MODEL a demo name, a
model directory, ``zoo:ARCH`` from tests/zoo.py or ``shape:NAME`` from bench/ttft.py), cut
into the parts the bulk wire sends (one layer's K then V per block); per codec: the ratio
raw/wire of what a sender sends (``encode_or_raw``: raw where a part saves < 5%), encode and
decode MB/s over all parts (one thread), a byte-exact round trip, and what
``Calibration.best`` picks at 10 Gbit/s, 1 Gbit/s and 100 Mbit/s from those figures. Every
model here has seeded random weights (``"weights": "random"``): no trained model is
available offline, and real trained bf16 KV (the issue expects ~1.3-1.5x) is not measured.

    python bench/codec.py --compression-only --json /tmp/codec.json   # the section alone
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path
from typing import Any

import torch
from _common import demo_card, fake_engine, random_state, run_main

from kvmesh import squeeze
from kvmesh.blocks import BlockKeyer
from kvmesh.codec import decode_block, dtype_size
from kvmesh.engine.base import EngineBase
from kvmesh.store import BlockStore

REPS = [5]  # best of; 1 in --smoke
ROOT = Path(__file__).resolve().parents[1]
COMPRESSION_MODELS = "demo:bfloat16,demo:float32,shape:gemma4:bfloat16,zoo:llama:bfloat16"
SMOKE_MODELS = "demo-tiny:bfloat16"
LINKS = {"10gbit": 1.25e9, "1gbit": 125e6, "100mbit": 12.5e6}  # bytes/s
TEXT = (
    "Blocks are immutable and verified; a head imports what a peer computed. "
    "The planner weighs the link against the prefill, and the codec against the link. "
)


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


def _model_dir(name: str) -> str:
    """A model directory for ``name``: a demo name or directory as is (load_engine resolves
    it), ``zoo:ARCH`` from tests/zoo.py, ``shape:NAME`` from bench/ttft.py."""
    if name.startswith("zoo:"):
        sys.path.insert(0, str(ROOT))
        from tests import zoo

        return str(zoo.hf_model(name[4:]))
    if name.startswith("shape:"):
        from ttft import shape_model

        return str(shape_model(name[6:]))
    return name


def kv_parts(spec: str, n_tokens: int) -> tuple[list[tuple[bytes, int]], dict[str, Any]]:
    """The (bytes, itemsize) of every (layer, block) part of the KV a real prefill of
    ``n_tokens`` exports, and what was measured on."""
    from kvmesh.engine import load_engine

    name, _, dtype = spec.partition(":")
    if name in ("zoo", "shape"):  # zoo:ARCH[:DTYPE]
        arch, _, dtype = dtype.partition(":")
        name = f"{name}:{arch}"
    dtype = dtype or "bfloat16"
    eng = load_engine(_model_dir(name), "torch", dtype=dtype)
    text = TEXT * (n_tokens // 16 + 2)
    tokens = eng.encode(text)[:n_tokens]
    state = eng.prefill(tokens)
    blocks = eng.export(state, BlockKeyer(eng.card.namespace, eng.card.block_tokens))
    parts: list[tuple[bytes, int]] = []
    for block in blocks:
        views = block.kv_tensors()
        for layer in block.header.layers:
            specs = [next(views) for _ in layer]
            if specs:  # a layer without KV (shared, recurrent) has no part
                size = dtype_size(specs[0][0].dtype)
                parts.append((b"".join(bytes(v) for _, v in specs), size))
    info = {"model": name, "dtype": dtype, "prompt_tokens": len(tokens), "parts": len(parts)}
    info["part_bytes_max"] = max((len(p) for p, _ in parts), default=0)
    info["raw_bytes"] = sum(len(p) for p, _ in parts)
    return parts, info


def codec_figures(codec: str, parts: list[tuple[bytes, int]]) -> dict[str, Any]:
    """Ratio (raw/wire as sent), encode and decode MB/s over ``parts``, exactness."""
    raw = sum(len(p) for p, _ in parts)
    enc = _best(lambda: [squeeze.encode_or_raw(codec, p, k) for p, k in parts])
    sent = [squeeze.encode_or_raw(codec, p, k) for p, k in parts]
    outs = [memoryview(bytearray(len(p))) for p, _ in parts]
    dec = _best(
        lambda: [
            squeeze.decode_into(c, w, o, k)
            for (c, w), o, (_, k) in zip(sent, outs, parts, strict=True)
        ]
    )
    exact = all(bytes(o) == p for o, (p, _) in zip(outs, parts, strict=True))
    wire = sum(len(w) for _, w in sent)
    return {
        "ratio": raw / wire,
        "encode_mbps": raw / enc / 1e6,
        "decode_mbps": raw / dec / 1e6,
        "parts_compressed": sum(c != "raw" for c, _ in sent) / max(1, len(sent)),
        "exact": exact,
    }


def compression(specs: list[str], n_tokens: int) -> dict[str, Any]:
    rows = []
    for spec in specs:
        parts, row = kv_parts(spec, n_tokens)
        figures = {c: codec_figures(c, parts) for c in squeeze.available_codecs() if c != "raw"}
        cal = squeeze.Calibration()
        for c, f in figures.items():
            raw, wire = row["raw_bytes"], int(row["raw_bytes"] / f["ratio"])
            cal.observe(c, raw, wire, encode_s=raw / f["encode_mbps"] / 1e6)
            cal.observe(c, raw, wire, decode_s=raw / f["decode_mbps"] / 1e6)
        row["codecs"] = figures
        row["choice"] = {k: cal.best(v, row["raw_bytes"]) for k, v in LINKS.items()}
        rows.append(row)
        for c, f in figures.items():
            print(
                f"{row['model']} {row['dtype']} {c:9s} ratio {f['ratio']:.3f}  "
                f"encode {f['encode_mbps']:6.0f} MB/s  decode {f['decode_mbps']:6.0f} MB/s  "
                f"({row['parts']} parts of <= {row['part_bytes_max']} B)"
            )
        print(f"  best codec per link: {row['choice']}")
    return {
        "weights": "random",
        "note": "seeded random weights, not a trained model: the issue's ~1.3-1.5x on real "
        "trained bf16 KV is not measured here",
        "part": "one (layer, block): the layer's K then V, as the bulk PARTS frame sends it",
        "min_saving": 0.05,
        "threads": 1,
        "links_bytes_per_s": LINKS,
        "rows": rows,
    }


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--json", default="bench/results/codec.json")
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--sizes", default="8,16,32,64,128")
    ap.add_argument("--smoke", action="store_true", help="CI: 128 tokens, B=16,32, best of 1")
    ap.add_argument(
        "--compression-models",
        default=None,
        help=f"MODEL[:DTYPE],... for the compression section (default {COMPRESSION_MODELS}; "
        f"--smoke: {SMOKE_MODELS}; empty: no section)",
    )
    ap.add_argument("--compression-tokens", type=int, default=None, help="default 1024; smoke 64")
    ap.add_argument("--compression-only", action="store_true", help="skip the block-size rows")
    args = ap.parse_args()
    if args.smoke:
        args.tokens, args.sizes, REPS[0] = 128, "16,32", 1
    if args.compression_models is None:
        args.compression_models = SMOKE_MODELS if args.smoke else COMPRESSION_MODELS
    if args.compression_tokens is None:
        args.compression_tokens = 64 if args.smoke else 1024
    sizes = [] if args.compression_only else args.sizes.split(",")
    rows = [measure(int(b), args.tokens) for b in sizes]
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
    if args.compression_models:
        out["compression"] = compression(
            args.compression_models.split(","), args.compression_tokens
        )
    with open(args.json, "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    run_main(main)
