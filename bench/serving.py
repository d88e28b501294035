"""Serving several clients at once: a real `kvmesh head` process, its HTTP API.

    python bench/serving.py --json bench/results/serving.json [--engines torch,mlx]
    python bench/serving.py --smoke --json /tmp/serving.json   # CI: demo-tiny, torch, short

For each engine, on the `demo` model (a fresh head with --no-publish, distinct
short prompts, ~60 tokens with the demo's byte-level tokenizer, so no request
reuses another's prefix and decode, not prefill, is what is measured):

- **interference**: a 48-token generation alone, then again with a 1-token
  request ("Hi") sent one second into it; the short request's latency against the
  long generation's time (the issue's target: <= 0.2x);
- **throughput**: 1, 2, 4 and 8 concurrent 32-token streams (ignore_eos): tokens
  decoded per second over the wall time of the whole wave, and its ratio to one
  stream (target: >= 2.5x at four streams).
- **step costs** (this machine, in this process, before the head starts): one
  batched decode step (``Engine.decode_batch``) of 1, 2, 4 and 8 ~60-token
  sequences, the median of a few rounds run interleaved, wall and CPU time; for
  torch also where one step's time goes (a profiled step: linear layers,
  attention, cache copies) and the LM head alone on that many rows, and the
  linear kernel the engine measured fastest at start for each batch size; then
  the same steps with each linear kernel forced in turn, side by side.
  ``--step-threads 1`` measures them on one thread, whose CPU time a busy machine
  hardly moves (wall time it stretches by whole time slices).

Every request is greedy, so each wave's work is the same on every run; what
differs between waves is only how many sequences share the engine's steps.
Writes JSON and a PNG beside it. Exits non-zero (an assertion) if a request does
not decode exactly the tokens it asked for.
"""

from __future__ import annotations

import argparse
import json
import threading
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from _common import machine, run_main, spawn_kvmesh, stop

from kvmesh.engine import load_engine
from kvmesh.engine.base import Engine, KVState


@dataclass
class Size:
    """The sizes of a run; --smoke makes them small."""

    model: str = "demo"
    long: int = 48
    stream: int = 32
    waves: tuple[int, ...] = (1, 2, 4, 8)
    rounds: int = 5  # step-cost rounds (the median is reported)
    step_threads: int = 0  # torch threads for the step costs (0: torch's default)


SIZE = Size()

WORDS = [
    "alpha",
    "bravo",
    "charlie",
    "delta",
    "echo",
    "foxtrot",
    "golf",
    "hotel",
    "india",
    "juliet",
    "kilo",
    "lima",
]


def prompt(i: int, words: int = 8) -> str:
    """A distinct prompt per request (no shared prefix beyond a few tokens)."""
    return f"Request {i}: " + " ".join(WORDS[(i * 7 + j * 3) % len(WORDS)] for j in range(words))


def complete(url: str, text: str, max_tokens: int) -> dict:  # type: ignore[type-arg]
    body = {
        "model": SIZE.model,
        "prompt": text,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
    }
    req = urllib.request.Request(
        url + "/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    t0 = time.perf_counter()
    with urllib.request.urlopen(req, timeout=600) as r:
        out = json.loads(r.read())
    got = out["usage"]["completion_tokens"]
    assert got == max_tokens, f"asked for {max_tokens} tokens (ignore_eos), got {got}"
    out["_latency_s"] = time.perf_counter() - t0
    return out


def wave(url: str, texts: list[str], max_tokens: int, delays: list[float] | None = None) -> list:  # type: ignore[type-arg]
    """Send ``texts`` concurrently (each after its delay); their answers, in order."""
    outs: list = [None] * len(texts)  # type: ignore[type-arg]
    t0 = time.perf_counter()

    def one(i: int) -> None:
        if delays:
            time.sleep(max(0.0, t0 + delays[i] - time.perf_counter()))
        short = delays and i > 0  # the case: "Hi", one token
        outs[i] = complete(url, "Hi" if short else texts[i], 1 if short else max_tokens)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(texts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return outs


def bench_engine(engine: str, seq: int) -> dict:  # type: ignore[type-arg]
    head, m = spawn_kvmesh(
        "head",
        "--model",
        SIZE.model,
        "--engine",
        engine,
        "--listen",
        "127.0.0.1:0",
        "--no-publish",
        "--max-batch",
        "8",
        pattern=r"(http://\S+)",
    )
    url = m.group(1)
    n = [seq]

    def texts(k: int) -> list[str]:
        n[0] += k
        return [prompt(n[0] + i) for i in range(k)]

    try:
        wave(url, texts(1), 4)  # first-request setup is nobody's cost
        long = SIZE.long
        alone = wave(url, texts(1), long)[0]["_latency_s"]
        both = wave(url, texts(2), long, delays=[0.0, min(1.0, alone / 2)])
        long_s, short_s = both[0]["_latency_s"], both[1]["_latency_s"]
        streams = throughput(url, texts)
        # the same with "Hi"-sized prompts: what batching does to decode alone
        tiny = throughput(url, lambda k: [f"Hi {n[0] + i}" for i in range(k)])
    finally:
        stop(head, grace_s=30)
    return {
        "engine": engine,
        "long_alone_s": alone,
        "long_with_short_s": long_s,
        "short_during_long_s": short_s,
        "short_vs_long": short_s / alone,
        "streams": streams,
        "streams_tiny_prompts": tiny,
    }


def throughput(url: str, texts) -> dict:  # type: ignore[no-untyped-def, type-arg]
    """1, 2, 4 and 8 concurrent 32-token streams: tokens/s over each wave's wall time."""
    out = {}
    for k in SIZE.waves:
        t0 = time.perf_counter()
        outs = wave(url, texts(k), SIZE.stream)
        dt = time.perf_counter() - t0
        tokens = sum(o["usage"]["completion_tokens"] for o in outs)
        out[k] = {"tokens": tokens, "wall_s": dt, "tokens_per_s": tokens / dt}
    for s in out.values():
        s["vs_one_stream"] = s["tokens_per_s"] / out[1]["tokens_per_s"]
    return out


# aten ops by where a decode step spends them (self CPU time of a profiled step)
PARTS = {
    "linear": ("aten::mm", "aten::addmm", "mkldnn::_linear_pointwise", "kvmesh::streamed_linear"),
    "attention": ("aten::_scaled_dot_product", "aten::bmm", "aten::_softmax", "aten::where"),
    "cache_copy": ("aten::cat", "aten::copy_", "aten::zeros", "aten::new_zeros", "aten::fill_"),
}


def step_states(eng: Engine, k: int) -> list[KVState]:
    """``k`` prefilled ~60-token sequences, each with a pending token to decode."""
    out = []
    for i in range(k):
        st = eng.prefill(eng.encode(prompt(9000 + i, words=9)))
        st.tokens.append(st.tokens[-1])
        out.append(st)
    return out


def step_costs(engine: str) -> dict:  # type: ignore[type-arg]
    """One decode step at each wave size, in this process (see the docstring)."""
    import torch

    extra = {"threads": SIZE.step_threads} if SIZE.step_threads else {}
    eng = load_engine(SIZE.model, engine, **extra)  # type: ignore[arg-type]
    batches = {k: step_states(eng, k) for k in SIZE.waves}

    def step(states: list[KVState]) -> tuple[float, float]:
        t0, c0 = time.perf_counter(), time.process_time()
        eng.decode_batch(states)
        dt, dc = time.perf_counter() - t0, time.process_time() - c0
        for st in states:
            st.tokens.append(st.tokens[-1])
        return dt, dc

    times: dict[int, list[tuple[float, float]]] = {k: [] for k in SIZE.waves}
    for states in batches.values():  # warm-up: first-call setup is not a step's cost
        step(states)
    for _ in range(SIZE.rounds):  # interleaved: a burst of other load hits every size
        for k, states in batches.items():
            times[k].append(step(states))
    kernels = getattr(eng, "kernels", {})  # batch size -> linear kernel, measured at start
    out: dict = {"kernels": {k: kernels.get(k, "linear") for k in SIZE.waves}, "steps": {}}  # type: ignore[type-arg]
    out["threads"] = torch.get_num_threads()
    if isinstance(getattr(eng, "model", None), torch.nn.Module):
        out["by_kernel"] = kernel_steps(eng, batches, step)
    for k, ts in times.items():
        row = {
            "wall_ms": 1000 * sorted(t for t, _ in ts)[len(ts) // 2],
            "cpu_ms": 1000 * sorted(c for _, c in ts)[len(ts) // 2],
        }
        model = getattr(eng, "model", None)
        if isinstance(model, torch.nn.Module):
            row.update(step_parts(batches[k], step))
            x = torch.zeros((k, 1, model.config.hidden_size))
            row["lm_head_ms"] = lm_head_ms(model.get_output_embeddings(), x)
        out["steps"][k] = row
    for row in out["steps"].values():
        row["vs_one"] = row["wall_ms"] / out["steps"][SIZE.waves[0]]["wall_ms"]
    return out


def kernel_steps(eng, batches, step) -> dict:  # type: ignore[no-untyped-def, type-arg]
    """Each linear kernel forced in turn for every batched size, interleaved: the
    median step (wall and CPU ms) of each, side by side, so one run shows what the
    start-up choice gained and what it left (the choice is restored after). Weights
    packed at start (the ``packed`` kernel) have no plain copy: only it runs."""
    from kvmesh.engine.hf import KERNELS
    from kvmesh.engine.kernels import PACKED, packs

    chosen = eng.kernels
    names = [PACKED] if packs(chosen) else ["linear", *(k for k in KERNELS if k != PACKED)]
    times: dict = {(k, n): [] for k in batches if k > 1 for n in names}  # type: ignore[type-arg]
    try:
        for _ in range(SIZE.rounds):
            for k, n in times:
                eng.kernels = {} if n == "linear" else {k: n}
                times[k, n].append(step(batches[k]))
    finally:
        eng.kernels = chosen
    out: dict = {}  # type: ignore[type-arg]
    for (k, n), ts in times.items():
        out.setdefault(k, {})[n] = {
            "wall_ms": 1000 * sorted(t for t, _ in ts)[len(ts) // 2],
            "cpu_ms": 1000 * sorted(c for _, c in ts)[len(ts) // 2],
        }
    return out


def lm_head_ms(head, x) -> float:  # type: ignore[no-untyped-def]
    """The LM head alone on ``x``'s rows: the best of three (ms)."""
    import torch

    best = float("inf")
    with torch.inference_mode():
        for _ in range(3):
            t0 = time.perf_counter()
            head(x)
            best = min(best, time.perf_counter() - t0)
    return 1000 * best


def step_parts(states: list[KVState], step) -> dict[str, float]:  # type: ignore[no-untyped-def]
    """Milliseconds of one profiled step's self CPU time, by :data:`PARTS`, and each
    part's share of all of it (the profiler slows a step and another process's
    burst inflates one: the shares compare across sizes and machines)."""
    from torch.profiler import profile

    with profile() as prof:
        step(states)
    parts = dict.fromkeys(PARTS, 0.0)
    total = 0.0
    for ev in prof.key_averages():
        total += ev.self_cpu_time_total / 1000
        for part, prefixes in PARTS.items():
            if ev.key.startswith(prefixes):
                parts[part] += ev.self_cpu_time_total / 1000
    out = {f"{part}_ms": ms for part, ms in parts.items()}
    out.update({f"{part}_share": ms / max(total, 1e-9) for part, ms in parts.items()})
    return out


def print_steps(engine: str, costs: dict) -> None:  # type: ignore[type-arg]
    print(
        f"{engine}: one decode step (~60-token sequences, {costs.get('threads')} threads; "
        f"linear kernels {costs['kernels']}):"
    )
    for k, r in costs["steps"].items():
        parts = "  ".join(f"{p} {100 * r[p + '_share']:.0f}%" for p in PARTS if p + "_share" in r)
        if "lm_head_ms" in r:
            parts += f"  (LM head alone {r['lm_head_ms']:.1f} ms)"
        print(
            f"  {k} seq: {r['wall_ms']:.1f} ms wall ({r['vs_one']:.2f}x one), "
            f"{r['cpu_ms']:.1f} ms CPU; profiled: {parts}",
            flush=True,
        )
    for k, by in costs.get("by_kernel", {}).items():
        text = "  ".join(f"{n} {v['wall_ms']:.0f}/{v['cpu_ms']:.0f}" for n, v in by.items())
        print(f"  {k} seq, each kernel forced (wall/CPU ms): {text}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--json", default="bench/results/serving.json")
    ap.add_argument("--engines", default="torch,mlx")
    ap.add_argument("--model", default="demo")
    ap.add_argument("--smoke", action="store_true", help="CI: demo-tiny, torch, short waves")
    ap.add_argument(
        "--step-threads",
        type=int,
        default=0,
        help="torch threads for the in-process step costs (1: CPU time is stable on a busy "
        "machine; the head keeps its default)",
    )
    args = ap.parse_args()
    SIZE.model = args.model
    SIZE.step_threads = args.step_threads
    if args.smoke:
        args.engines = "torch"
        SIZE.model, SIZE.long, SIZE.stream, SIZE.waves = "demo-tiny", 12, 8, (1, 2)
        SIZE.rounds = 2
    rows = []
    for i, engine in enumerate(args.engines.split(",")):
        costs = step_costs(engine)
        print_steps(engine, costs)
        r = bench_engine(engine, 1000 * i)
        r["step_costs"] = costs
        rows.append(r)
        print(
            f"{engine}: {SIZE.long} tokens alone {r['long_alone_s']:.2f} s; a 1-token request during it "
            f"{r['short_during_long_s']:.2f} s ({r['short_vs_long']:.2f}x)",
            flush=True,
        )
        for key in ("streams", "streams_tiny_prompts"):
            waves = r[key].items()
            text = "  ".join(
                f"{k}: {v['tokens_per_s']:.1f} ({v['vs_one_stream']:.2f}x)" for k, v in waves
            )
            print(f"  {key} tok/s: {text}", flush=True)
    out = {"machine": machine(), "model": SIZE.model, "results": rows}
    Path(args.json).write_text(json.dumps(out, indent=1))
    plot(rows, Path(args.json).with_suffix(".png"))


def plot(rows: list, path: Path) -> None:  # type: ignore[type-arg]
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, ax = plt.subplots(figsize=(6, 4))
    for r in rows:
        for key, what in (
            ("streams", "~60-token prompts"),
            ("streams_tiny_prompts", '"Hi" prompts'),
        ):
            ks = sorted(r[key], key=int)
            ys = [r[key][k]["tokens_per_s"] for k in ks]
            ax.plot([int(k) for k in ks], ys, marker="o", label=f"{r['engine']}, {what}")
    ax.set_xlabel("concurrent 32-token streams")
    ax.set_ylabel("tokens decoded per second (all streams)")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_title("kvmesh head on the ~0.5B demo model, 2-core CPU")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    run_main(main)
