"""`vllm serve` with and without kvmesh, measured by vLLM's own serving benchmark.

    .venv-vllm/bin/python bench/vllm.py [--smoke] [--json bench/results/vllm.json]
        [--markdown docs/benchmarks.md]

Three OpenAI servers (``python -m vllm.entrypoints.openai.api_server``, vLLM's
default process layout, what ``vllm serve`` runs), one after the other, each
driven by ``vllm.benchmarks.serve`` with ``--dataset-name prefix_repetition``
(2 prefixes x 512 tokens + 64, 8 prompts, concurrency 2, 16 output tokens, the
same seed, so the same prompts every time), vLLM's prefix cache on:

  plain   vLLM without a connector
  A       vLLM + KVMeshConnector on a cold fleet (one ``kvmesh peer``, empty):
          every lookup misses, every computed prompt is copied out and published
  B       a fresh vLLM + KVMeshConnector on the same peer, now warm: the prefixes
          A published are fetched instead of computed

Then A and B again on a sliding-window model (the zoo's Gemma-3, sliding layers
with a 128-token window beside full ones; a fresh peer), the same prompts.

It reports mean and p99 time to first token of each, B / A and A / plain, and
each kvmesh server's counters (read from its log at shutdown: where the cold
path's time goes). ``--smoke``: the tiny model, 128 + 32 tokens, 4 prompts.
Every process it starts is stopped on every exit (errors and Ctrl-C included).
The CPU may be shared with other work: compare rows of one run, not runs.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import platform
import re
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path[0:1] = [str(ROOT)]  # not bench/: this file's name would shadow the vllm package

from bench._common import write_section  # noqa: E402
from kvmesh.engine.embedded import ensure_demo  # noqa: E402
from tests import zoo  # noqa: E402
from tests.procs import Peer  # noqa: E402
from tests.vllm.serve import APIServer  # noqa: E402

FULL = {"model": "demo", "prefix": 512, "suffix": 64, "prompts": 8, "out": 16, "len": 2048}
SMOKE = {"model": "demo-tiny", "prefix": 128, "suffix": 32, "prompts": 4, "out": 4, "len": 512}
MARK, END = "<!-- bench/vllm.py -->", "<!-- /bench/vllm.py -->"
SLIDING_WINDOW = 128


def serve_bench(url: str, model: str, shape: dict[str, Any], seed: int) -> dict[str, Any]:
    """vLLM's own serving benchmark against ``url``: its result dict."""
    from vllm.benchmarks.serve import add_cli_args, main
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser()
    add_cli_args(parser)
    args = parser.parse_args(
        [
            "--backend",
            "vllm",
            "--base-url",
            url,
            "--endpoint",
            "/v1/completions",
            "--model",
            model,
            "--tokenizer",
            model,
            "--dataset-name",
            "prefix_repetition",
            "--prefix-repetition-prefix-len",
            str(shape["prefix"]),
            "--prefix-repetition-suffix-len",
            str(shape["suffix"]),
            "--prefix-repetition-num-prefixes",
            "2",
            "--prefix-repetition-output-len",
            str(shape["out"]),
            "--num-prompts",
            str(shape["prompts"]),
            "--max-concurrency",
            "2",
            "--seed",
            str(seed),
            "--percentile-metrics",
            "ttft,e2el",
            "--metric-percentiles",
            "50,99",
            "--ignore-eos",
            "--disable-tqdm",
            "--save-detailed",  # each request's TTFT in the result
        ]
    )
    return main(args)


def counters(log: Path) -> dict[str, int]:
    """The last ``kvmesh counters {...}`` line a server's worker logged at shutdown."""
    found: dict[str, int] = {}
    for line in log.read_text(errors="replace").splitlines():
        m = re.search(r"kvmesh counters (\{.*\})", line)
        if m:
            found = json.loads(m.group(1))
    return found


def run(
    name: str, model: str, kvmesh: dict[str, Any] | None, shape: dict[str, Any], logs: Path
) -> dict[str, Any]:
    log = logs / f"{name.replace(' ', '-')}.log"
    t0 = time.perf_counter()
    with APIServer(
        model,
        kvmesh,
        log,
        "--enable-prefix-caching",
        "--shutdown-timeout",
        "10",
        max_model_len=shape["len"],
    ) as srv:
        start_s = time.perf_counter() - t0
        res = serve_bench(srv.url, model, shape, seed=0)
    row = {
        "server": name,
        "model": Path(model).name,
        "start_s": round(start_s, 1),
        "completed": res["completed"],
        "mean_ttft_ms": round(res["mean_ttft_ms"], 1),
        "p50_ttft_ms": round(res["median_ttft_ms"], 1),
        "p99_ttft_ms": round(res["p99_ttft_ms"], 1),
        "mean_e2el_ms": round(res["mean_e2el_ms"], 1),
    }
    if kvmesh is not None:
        row["kvmesh"] = counters(log)
    print(json.dumps(row), flush=True)
    return row


def cold_then_warm(
    prefix: str, model: str, shape: dict[str, Any], logs: Path
) -> list[dict[str, Any]]:
    """A (a cold fleet: one fresh ``kvmesh peer``) then a fresh B on the warm fleet."""
    peer = Peer(alias=f"{prefix}cache".replace(" ", "-"), log_dir=logs)
    try:
        return [
            run(f"{prefix}{name}", model, {"seed": peer.address, "alias": name}, shape, logs)
            for name in ("A", "B")
        ]
    finally:
        with contextlib.suppress(Exception):
            peer.kill()


def markdown(out: dict[str, Any]) -> str:
    rows = {r["server"]: r for r in out["rows"]}
    s = out["shape"]
    lines = [
        MARK,
        "## vLLM: `vllm serve` with kvmesh (`bench/vllm.py`)",
        "",
        f"vLLM {out['vllm']} CPU, `{s['model']}` float32, vLLM's prefix cache on, the OpenAI "
        f"server in vLLM's default process layout; `vllm.benchmarks.serve` prefix_repetition "
        f"(2 prefixes x {s['prefix']} + {s['suffix']} tokens, {s['prompts']} prompts, "
        f"concurrency 2, {s['out']} output tokens, seed 0); {out['cpus']} CPU cores shared "
        "with other work (compare rows of one run, not runs).",
        "",
        "| server | mean TTFT | p50 | p99 | mean E2E |",
        "|---|---:|---:|---:|---:|",
    ]
    label = {
        "plain": "plain vLLM",
        "A": "vLLM + kvmesh, cold fleet (A)",
        "B": "fresh vLLM + kvmesh, warm fleet (B)",
    }
    label["sliding A"] = f"sliding window {SLIDING_WINDOW} (Gemma-3): vLLM + kvmesh, cold (A)"
    label["sliding B"] = f"sliding window {SLIDING_WINDOW} (Gemma-3): fresh vLLM + kvmesh, warm (B)"
    for name in ("plain", "A", "B", "sliding A", "sliding B"):
        r = rows[name]
        lines.append(
            f"| {label[name]} | {r['mean_ttft_ms']:.0f} ms | {r['p50_ttft_ms']:.0f} ms | "
            f"{r['p99_ttft_ms']:.0f} ms | {r['mean_e2el_ms']:.0f} ms |"
        )
    lines += [
        "",
        f"B / A mean TTFT: **{out['b_over_a']:.2f}x**; A / plain: **{out['a_over_plain']:.2f}x**; "
        f"on the sliding-window model B / A: **{out['sliding_b_over_a']:.2f}x** (the zoo's "
        "tiny Gemma-3, hidden 64: its whole prefill takes tens of ms, less than a lookup "
        "and fetch, so this row shows the path working, not a speed-up; vLLM's hybrid "
        "manager on, sliding pages behind the window freed).",
        "",
        f"A's counters: `{json.dumps(rows['A'].get('kvmesh', {}))}`",
        "",
        f"B's counters: `{json.dumps(rows['B'].get('kvmesh', {}))}`",
        END,
    ]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--smoke", action="store_true", help="tiny model and prompts (seconds)")
    ap.add_argument("--json", type=Path, default=None, help="write the figures here")
    ap.add_argument("--markdown", type=Path, default=None, help="update this file's section")
    a = ap.parse_args()
    shape = dict(SMOKE if a.smoke else FULL)
    model = str(ensure_demo(shape["model"]))
    # SIGTERM ends the run like Ctrl-C: every process below is stopped on the way out
    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
    logs = Path(tempfile.mkdtemp(prefix="kvmesh-bench-vllm-"))
    sliding = str(zoo.windowed(zoo.hf_model("gemma3"), SLIDING_WINDOW))
    rows = [run("plain", model, None, shape, logs)]
    rows += cold_then_warm("", model, shape, logs)
    rows += cold_then_warm("sliding ", sliding, shape, logs)
    import vllm

    by = {r["server"]: r for r in rows}
    out = {
        "shape": shape,
        "vllm": vllm.__version__,
        "cpus": len(__import__("os").sched_getaffinity(0)),
        "platform": platform.platform(),
        "rows": rows,
        "b_over_a": by["B"]["mean_ttft_ms"] / by["A"]["mean_ttft_ms"],
        "a_over_plain": by["A"]["mean_ttft_ms"] / by["plain"]["mean_ttft_ms"],
        "sliding_b_over_a": by["sliding B"]["mean_ttft_ms"] / by["sliding A"]["mean_ttft_ms"],
        "logs": str(logs),
    }
    print(json.dumps({k: out[k] for k in ("b_over_a", "a_over_plain", "sliding_b_over_a")}))
    if a.json:
        a.json.parent.mkdir(parents=True, exist_ok=True)
        a.json.write_text(json.dumps(out, indent=1))
    if a.markdown:
        write_section(a.markdown, markdown(out), MARK, END)


if __name__ == "__main__":
    main()
