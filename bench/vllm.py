"""Time to first token of vLLM: cold prefill against a kvmesh remote hit.

    .venv-vllm/bin/python bench/vllm.py --json bench/results/vllm.json
        [--lengths 128,256,512,1024,2048,4096] [--model demo] [--dtype float32] [--repeats 2]

Three fresh vLLM processes (``tests/vllm/serve.py``), each warmed up with one short
request; every prompt is new to the process that times it, except where said:

  vllm_cold_s          vLLM without a connector: its best local path
  kvmesh_cold_s        vLLM with KVMeshConnector and an empty mesh: a lookup that
                       misses, the prefill, then the full pages copied out (on the
                       model's path) and sealed and published (off it)
  vllm_prefix_cache_s  the same process, the same prompt again: vLLM's own local
                       prefix-cache hit (the floor)
  kvmesh_remote_s      a fresh vLLM process with an empty cache: the full pages found
                       on a ``kvmesh peer`` process over loopback, fetched, verified
                       and copied into vLLM's pages; only the rest is computed

TTFT is one ``LLM.generate`` with ``max_tokens=1`` (lookup, load, prefill, first
token), the fastest of ``--repeats`` distinct prompts. ``identical``: the remote
hit's log-probabilities equal, bit for bit, those of vLLM's own prefix-cache hit
in the producer (kvmesh's promise); ``identical_to_cold``: equal to the cold run's
too (vLLM computing a prompt in two pieces need not be bitwise one pass).
``crossover_tokens`` is the shortest measured length at which the remote hit
beats vLLM's cold prefill. The CPU may be shared with other work: compare rows
of one run, not runs.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[0:1] = [str(ROOT)]  # not bench/: this file's name would shadow the vllm package

from tests.procs import Peer  # noqa: E402
from tests.vllm.serve import VLLMProcess  # noqa: E402


def prompt(n: int, salt: int) -> list[int]:
    return [(salt * 7919 + i * 31) % 250 + 3 for i in range(n)]


def timed(proc: VLLMProcess, tokens: list[int]) -> dict[str, object]:
    t0 = time.perf_counter()
    out = proc.generate(tokens, max_tokens=1)
    out["ttft_s"] = time.perf_counter() - t0
    return out


def crossover(rows: list[dict[str, object]]) -> int | None:
    """The shortest length from which on every measured length reuses pages and the
    remote hit beats vLLM's cold prefill."""
    best = None
    for r in sorted(rows, key=lambda r: int(r["tokens"]), reverse=True):  # type: ignore[call-overload]
        if not r["reused_tokens"] or r["kvmesh_remote_s"] >= r["vllm_cold_s"]:  # type: ignore[operator]
            break
        best = int(r["tokens"])  # type: ignore[call-overload]
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--lengths", default="128,256,512,1024,2048,4096")
    ap.add_argument("--model", default="demo")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--repeats", type=int, default=2, help="distinct prompts per length")
    ap.add_argument("--json", default=str(ROOT / "bench/results/vllm.json"))
    args = ap.parse_args()
    from kvmesh.engine.demo import DEMOS, ensure_demo

    model = str(ensure_demo(args.model)) if args.model in DEMOS else args.model
    lengths = [int(x) for x in args.lengths.split(",")]
    max_len = max(lengths) + 64
    logs = Path(tempfile.mkdtemp(prefix="kvmesh-bench-vllm-"))
    common = dict(dtype=args.dtype, max_model_len=max_len)
    warm = prompt(16, 999)
    peer = Peer(alias="bench-cache", log_dir=logs)
    rows: dict[int, dict[str, object]] = {n: {"tokens": n} for n in lengths}
    reps = range(args.repeats)

    def best(proc: VLLMProcess, n: int, key: str, outs: dict | None = None) -> None:
        """The fastest of ``repeats`` distinct prompts of ``n`` tokens."""
        runs = []
        for r in reps:
            out = timed(proc, prompt(n, n * 10 + r))
            proc.call("flush", timeout=300)  # publishing never overlaps the next timing
            runs.append(out)
            if outs is not None:
                outs[n, r] = out
        rows[n][key] = round(min(float(o["ttft_s"]) for o in runs), 4)  # type: ignore[arg-type]

    cold: dict[tuple[int, int], dict[str, object]] = {}
    cached: dict[tuple[int, int], dict[str, object]] = {}
    remote: dict[tuple[int, int], dict[str, object]] = {}
    try:
        plain = VLLMProcess(model, None, logs / "plain.log", **common)
        try:
            plain.generate(warm, 1)
            for n in lengths:
                best(plain, n, "vllm_cold_s")
        finally:
            plain.close()
        kv = {"seed": peer.address}
        # vLLM's own prefix cache on in A: its second run of a prompt is vLLM's local hit
        a = VLLMProcess(model, kv, logs / "a.log", prefix_caching=True, **common)
        try:
            card = a.ready["card"]
            a.generate(warm, 1)
            for n in lengths:
                best(a, n, "kvmesh_cold_s", cold)
                best(a, n, "vllm_prefix_cache_s", cached)
            a.call("flush", timeout=300)
        finally:
            a.close()
        b = VLLMProcess(model, kv, logs / "b.log", prefix_caching=True, **common)
        try:
            b.generate(warm, 1)
            for n in lengths:
                best(b, n, "kvmesh_remote_s", remote)
                rows[n]["reused_tokens"] = remote[n, 0]["num_cached_tokens"]
                # the promise: equal to continuing from the producer's own cache
                rows[n]["identical"] = all(
                    remote[n, r]["logprobs"] == cached[n, r]["logprobs"] for r in reps
                )
                rows[n]["identical_to_cold"] = all(
                    remote[n, r]["logprobs"] == cold[n, r]["logprobs"] for r in reps
                )
            counters = b.counters()
        finally:
            b.close()
    finally:
        peer.kill()
    for r in rows.values():
        r["speedup"] = round(float(r["vllm_cold_s"]) / float(r["kvmesh_remote_s"]), 2)  # type: ignore[arg-type]
    result_rows = [rows[n] for n in lengths]
    result = {
        "bench": "vllm",
        "model": Path(model).name,
        "card": card["engine"] if card else None,
        "block_tokens": card["block_tokens"] if card else None,
        "kv_bytes_per_token": None,
        "vllm": card["engine"].split("/")[1] if card else None,
        "machine": {"platform": platform.platform(), "python": sys.version.split()[0]},
        "repeats": args.repeats,
        "rows": result_rows,
        "crossover_tokens": crossover(result_rows),
        "remote_counters": counters,
    }
    if card:
        from kvmesh.compat import CompatCard

        result["kv_bytes_per_token"] = CompatCard.from_json(card).kv_bytes_per_token
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
    for r in result["rows"]:  # type: ignore[attr-defined]
        print(
            f"{r['tokens']:>6} tok  cold {r['vllm_cold_s']:.3f}s  +kvmesh cold "
            f"{r['kvmesh_cold_s']:.3f}s  vLLM prefix cache {r['vllm_prefix_cache_s']:.3f}s  "
            f"remote hit {r['kvmesh_remote_s']:.3f}s ({r['reused_tokens']} reused, "
            f"x{r['speedup']}, identical={r['identical']}/{r['identical_to_cold']})"
        )
    print("crossover:", result["crossover_tokens"], "->", args.json)


if __name__ == "__main__":
    main()
