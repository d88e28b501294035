"""Helper of bench/ttft.py: the file-based prompt cache as users do it today.

Run in a fresh process: load the model (not timed), then time loading a
safetensors file of KV + logits saved by another process and producing the first
token, for an exact repeat and for the cached prompt plus new tokens.

``lazy``: tensors stay memory-mapped (the exact repeat then never reads the KV
before its first token). ``read``: KV is read into the cache, as llama.cpp's slot
restore does. ``cold``: ``read`` after dropping the page cache (a restart, or
another machine's disk); needs root, else it is left out, and is left out too
under ``KVMESH_BENCH_NO_DROP_CACHES=1`` (smoke runs: dropping the page cache
slows everything else on the machine).
"""

from __future__ import annotations

import json
import os
import sys
import time

import torch
from safetensors.torch import load_file

from kvmesh.engine import KVState, Sampling, load_engine


def main() -> None:
    model, device, path, n, ext_json, dtype = sys.argv[1:7]
    ext = json.loads(ext_json)
    engine = load_engine(model, device=device, dtype=dtype or None)
    engine.prefill(list(range(16)))  # warm up, as every other path is
    one = Sampling(max_tokens=1)
    out = {}

    def first_token(extra: list[int], materialize: bool) -> float:
        t0 = time.perf_counter()
        tensors = load_file(path, device=device)
        if materialize:
            tensors = {k: v.clone() for k, v in tensors.items()}
        cache = engine._new_cache()
        for i, layer in enumerate(cache.layers):
            k, v = tensors[f"k{i}"], tensors[f"v{i}"]
            layer.lazy_initialization(k, v)
            layer.keys, layer.values = k, v
        toks = list(range(int(n)))  # token ids do not matter to the timing; the count does
        state = KVState(toks, cache, tensors["logits"], int(n))
        if extra:
            state = engine.extend(state, extra)
        next(engine.generate(state, one))
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        return time.perf_counter() - t0

    for mode, materialize in (("lazy", False), ("read", True)):
        out[mode] = first_token([], materialize)
        out[mode + "_extend"] = first_token(ext, materialize)
    if os.environ.get("KVMESH_BENCH_NO_DROP_CACHES") == "1":
        print(json.dumps(out))
        return
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("1\n")
        out["cold"] = first_token([], True)
    except OSError:
        pass
    print(json.dumps(out))


if __name__ == "__main__":
    main()
