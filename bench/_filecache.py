"""Helper of bench/ttft.py: the file-based prompt cache as users do it today.

Run in a fresh process: load the model (not timed), then time loading a
safetensors file of KV + logits saved by another process and producing the first
token, for an exact repeat and for the cached prompt plus new tokens.
"""

from __future__ import annotations

import json
import sys
import time

import torch
from safetensors.torch import load_file

from kvmesh.engine import KVState, Sampling, load_engine


def main() -> None:
    model, device, path, n, ext_json = sys.argv[1:6]
    ext = json.loads(ext_json)
    engine = load_engine(model, device=device)
    engine.prefill(list(range(16)))  # warm up, as every other path is
    one = Sampling(max_tokens=1)
    out = {}
    for name, extra in (("exact", []), ("extend", ext)):
        t0 = time.perf_counter()
        tensors = load_file(path, device=device)
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
        out[name] = time.perf_counter() - t0
    print(json.dumps(out))


if __name__ == "__main__":
    main()
