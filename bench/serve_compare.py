"""The kvmesh head against `vllm serve`, both measured by vLLM's own serving benchmark.

    .venv-vllm/bin/python bench/serve_compare.py [--smoke] [--rounds N] [--vllm-bind nobind]
        [--json bench/results/serve_compare.json] [--markdown docs/benchmarks.md]

Two OpenAI servers on the same model directory (float32), one after the other,
each driven by ``vllm.benchmarks.serve`` with the arguments ``bench/vllm.py``
uses (:func:`bench.vllm.serve_bench`: ``prefix_repetition`` 2 prefixes x 512 +
64 tokens, 8 prompts, concurrency 2, 16 output tokens, ``--ignore-eos``, seed 0,
so the same prompts for both):

  vllm   ``python -m vllm.entrypoints.openai.api_server`` (what ``vllm serve``
         runs): vLLM's defaults (its model compiled: minutes at a first start,
         cached after), its prefix cache on, ``--max-model-len``; ``--eager``
         (and ``--smoke``) add ``--enforce-eager``
  head   ``kvmesh head`` alone (no peers; it publishes into its own store, its
         prefix cache), its defaults, ``--dtype float32``

Both run under this interpreter (the vLLM venv: kvmesh is installed there too,
so CI needs nothing else); ``--head-python`` runs the head under another one.
It reports, per server, completed and failed requests, mean / p50 / p99 TTFT,
mean TPOT (end-to-end minus TTFT over the other output tokens, as vLLM
defines it, every request decoding the same count) and the benchmark's
duration, and head / vLLM for each; for the head also what its ``/metrics``
counted during the run (prompt tokens reused vs computed, prefill seconds,
decode steps): where its time goes. ``--rounds N`` alternates the two servers
N times (each round a fresh pair) and reports every round. ``--smoke``: the
tiny model, 128 + 32 tokens, 4 prompts, 4 output tokens.

Every process it starts is stopped on every exit (errors, Ctrl-C, SIGTERM).
The CPU may be shared with other work: compare the rows of one round.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
import time
import traceback
import urllib.request
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path[0:1] = [str(ROOT)]  # not bench/: bench/vllm.py would shadow the vllm package

from bench._common import popen, run_main, spawn_vllm, stop, write_section  # noqa: E402
from bench.vllm import FULL, SMOKE, serve_bench  # noqa: E402
from kvmesh.engine.embedded import ensure_demo  # noqa: E402

MARK, END = "<!-- bench/serve_compare.py -->", "<!-- /bench/serve_compare.py -->"
HEAD_START_S = 300.0  # loading the model and warming up on a loaded 2-core machine
VLLM_START_S = 900.0  # vLLM compiles the model at its first start (minutes when loaded)
# the head's /metrics counters read before and after a run: their difference is the run's
HEAD_COUNTERS = (
    "kvmesh_requests_total",
    "kvmesh_prompt_tokens_total",
    "kvmesh_kv_assisted_tokens_total",
    "kvmesh_computed_prompt_tokens_total",
    "kvmesh_completion_tokens_total",
    "kvmesh_prefill_seconds_total",
    "kvmesh_batch_steps_total",
    "kvmesh_batch_ridden_steps_total",
    "kvmesh_prefill_forwards_total",
)


def loadavg() -> str:
    """The 1-minute load average now (the CPU is shared: said next to each figure)."""
    return Path("/proc/loadavg").read_text().split()[0]


def row(
    server: str, res: dict[str, Any], out_tokens: int, start_s: float, load: str
) -> dict[str, Any]:
    """One server's figures from vLLM's result dict."""
    ttft, e2el = res["mean_ttft_ms"], res["mean_e2el_ms"]
    return {
        "server": server,
        "load": load,
        "start_s": round(start_s, 1),
        "completed": res["completed"],
        "failed": res.get("failed", 0),
        "output_tokens": res["total_output_tokens"],
        "mean_ttft_ms": round(ttft, 1),
        "p50_ttft_ms": round(res["median_ttft_ms"], 1),
        "p99_ttft_ms": round(res["p99_ttft_ms"], 1),
        # vLLM's TPOT of a request is (e2el - ttft) / (tokens - 1); every request
        # decodes out_tokens (--ignore-eos), so the mean of those is this
        "mean_tpot_ms": round((e2el - ttft) / max(1, out_tokens - 1), 1),
        "mean_e2el_ms": round(e2el, 1),
        "duration_s": round(res["duration"], 3),
        # each request's, in the order sent (where a server gains or loses)
        "ttfts_ms": [round(t * 1000, 1) for t in res.get("ttfts", [])],
    }


def scrape(url: str) -> dict[str, float]:
    """The head's counters named in HEAD_COUNTERS, from its /metrics."""
    with urllib.request.urlopen(url + "/metrics", timeout=30) as r:
        text = r.read().decode()
    found = {}
    for name in HEAD_COUNTERS:
        m = re.search(rf"^{name} (\S+)$", text, re.M)
        found[name.removeprefix("kvmesh_").removesuffix("_total")] = float(m.group(1)) if m else 0.0
    return found


def settled(url: str, requests: float, timeout_s: float = 30.0) -> dict[str, float]:
    """The counters once the head has recorded ``requests`` (the benchmark's prompts; it
    sends no test prompt first): a stream's last event can reach the client just before
    its request is counted. After ``timeout_s`` (a hang guard), whatever they say then."""
    deadline = time.monotonic() + timeout_s
    found = scrape(url)
    while found["requests"] < requests and time.monotonic() < deadline:
        time.sleep(0.1)
        found = scrape(url)
    return found


def start_head(python: str, model: str, log: Path) -> tuple[Any, str]:
    """``kvmesh head`` on a free loopback port once it serves; (process, URL)."""
    cmd = [
        python,
        "-m",
        "kvmesh.cli",
        "head",
        "--model",
        model,
        "--dtype",
        "float32",
        "--listen",
        "127.0.0.1:0",
    ]
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(
            p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p
        ),
    }
    with open(log, "w") as out:  # the child keeps its own copy
        proc = popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)
    deadline = time.monotonic() + HEAD_START_S
    while time.monotonic() < deadline:
        m = re.search(r"kvmesh head \S+ (http://\S+) grpc", log.read_text(errors="replace"))
        if m:
            return proc, m.group(1)
        if proc.poll() is not None:
            break
        time.sleep(0.5)
    stop(proc)
    raise RuntimeError(f"kvmesh head did not start (log: {log})")


def run_head(python: str, model: str, shape: dict[str, Any], logs: Path) -> dict[str, Any]:
    t0 = time.perf_counter()
    proc, url = start_head(python, model, logs / "head.log")
    try:
        start_s = time.perf_counter() - t0
        before, load = scrape(url), loadavg()
        res = serve_bench(url, model, shape, seed=0)
        after = settled(url, before["requests"] + res["completed"])
    finally:
        stop(proc, grace_s=30)
    r = row("head", res, shape["out"], start_s, load)
    r["metrics"] = {k: round(after[k] - before[k], 3) for k in after}
    return r


def start_vllm(model: str, shape: dict[str, Any], eager: bool, log: Path) -> tuple[Any, str]:
    """``vllm serve`` with prefix caching, once healthy; (process, URL). vLLM's
    defaults (its compiled model) unless ``eager``."""
    args = ["--dtype", "float32", "--max-model-len", str(shape["len"]), "--seed", "0"]
    args += ["--enable-prefix-caching", *(["--enforce-eager"] if eager else [])]
    return spawn_vllm(sys.executable, model, args, log, VLLM_START_S)


def run_vllm(model: str, shape: dict[str, Any], eager: bool, logs: Path) -> dict[str, Any]:
    t0 = time.perf_counter()
    proc, url = start_vllm(model, shape, eager, logs / "vllm.log")
    try:
        start_s, load = time.perf_counter() - t0, loadavg()
        res = serve_bench(url, model, shape, seed=0)
    finally:
        stop(proc, grace_s=30)
    r = row("vllm", res, shape["out"], start_s, load)
    r["compiled"] = not eager
    return r


def ratios(head: dict[str, Any], vllm: dict[str, Any]) -> dict[str, float | None]:
    """head / vLLM for each time figure (lower is better for the head); None where
    vLLM's figure rounds to 0 (on a loaded machine vLLM may stream a short answer's
    tokens in one chunk: a TPOT of 0 ms, no ratio to take)."""
    keys = ("mean_ttft_ms", "p99_ttft_ms", "mean_tpot_ms", "duration_s")
    return {k: round(head[k] / vllm[k], 3) if vllm[k] else None for k in keys}


def _times(q: float | None) -> str:
    return "n/a" if q is None else f"{q:.2f}x"


def markdown(out: dict[str, Any]) -> str:
    s = out["shape"]
    lines = [
        MARK,
        "## The head against `vllm serve`, vLLM's serving benchmark (`bench/serve_compare.py`)",
        "",
        "    .venv-vllm/bin/python bench/serve_compare.py --rounds 3 "
        f"--vllm-bind {out.get('vllm_threads_bind', 'auto')} "
        "--json bench/results/serve_compare.json --markdown docs/benchmarks.md",
        "",
        f"vLLM {out['vllm']} CPU (prefix cache on, its defaults, "
        f"`VLLM_CPU_OMP_THREADS_BIND={out.get('vllm_threads_bind', 'auto')}`) and a "
        "`kvmesh head` (alone, "
        f"its defaults), `{s['model']}` float32, one after the other; "
        f"`vllm.benchmarks.serve` prefix_repetition (2 prefixes x {s['prefix']} + "
        f"{s['suffix']} tokens, {s['prompts']} prompts, concurrency 2, {s['out']} output "
        f"tokens, `--ignore-eos`, seed 0); {out['cpus']} CPU cores shared with other work "
        "(load: the 1-minute load average as each run began). Compare the rows of one round.",
        "",
        "| round | server | mean TTFT | p50 | p99 | mean TPOT | duration | completed | load |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for i, rnd in enumerate(out["rounds"], 1):
        for r in (rnd["vllm"], rnd["head"]):
            lines.append(
                f"| {i} | {r['server']} | {r['mean_ttft_ms']:.0f} ms | {r['p50_ttft_ms']:.0f} ms | "
                f"{r['p99_ttft_ms']:.0f} ms | {r['mean_tpot_ms']:.0f} ms | "
                f"{r['duration_s']:.1f} s | {r['completed']} | {r.get('load', '?')} |"
            )
        q = rnd["ratios"]
        lines.append(
            f"| {i} | **head / vLLM** | **{_times(q['mean_ttft_ms'])}** | | "
            f"{_times(q['p99_ttft_ms'])} | {_times(q['mean_tpot_ms'])} | "
            f"**{_times(q['duration_s'])}** | | |"
        )
    overall = out.get("head_over_vllm_all_rounds", {}).get("mean_ttft_ms")
    lines += ["", f"Over all rounds, the head's mean TTFT / vLLM's: **{_times(overall)}**."]
    lines += ["", "The head's counters over each run (its `/metrics`):", ""]
    lines += [
        f"- round {i}: `{json.dumps(r['head']['metrics'])}`" for i, r in enumerate(out["rounds"], 1)
    ]
    lines.append(END)
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--smoke", action="store_true", help="tiny model and prompts (about a minute)")
    ap.add_argument("--rounds", type=int, default=1, help="alternate the two servers N times")
    ap.add_argument(
        "--eager",
        action="store_true",
        help="vLLM with --enforce-eager (the default in --smoke: no compile wait)",
    )
    ap.add_argument(
        "--head-python",
        default=sys.executable,
        help="interpreter that runs the head (default: this one)",
    )
    ap.add_argument(
        "--vllm-bind",
        default=os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "auto"),
        help="vLLM's VLLM_CPU_OMP_THREADS_BIND (default auto, vLLM's: on 2 cores its worker "
        "computes on one; nobind: on every core, as the head does)",
    )
    ap.add_argument("--json", type=Path, default=None, help="write the figures here")
    ap.add_argument("--markdown", type=Path, default=None, help="update this file's section")
    a = ap.parse_args()
    a.eager = a.eager or a.smoke
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = a.vllm_bind  # the vLLM servers inherit it
    shape = dict(SMOKE if a.smoke else FULL)
    model = str(ensure_demo(shape["model"]))
    logs = Path(tempfile.mkdtemp(prefix="kvmesh-bench-compare-"))
    rounds = []
    for i in range(max(1, a.rounds)):
        rnd_logs = logs / f"round{i + 1}"
        rnd_logs.mkdir()
        # alternate who goes first: a machine that gets busier mid-round favours neither
        order = ("vllm", "head") if i % 2 == 0 else ("head", "vllm")
        rnd: dict[str, Any] = {}
        for name in order:
            rnd[name] = (
                run_vllm(model, shape, a.eager, rnd_logs)
                if name == "vllm"
                else run_head(a.head_python, model, shape, rnd_logs)
            )
            print(json.dumps(rnd[name]), flush=True)
        rnd["ratios"] = ratios(rnd["head"], rnd["vllm"])
        print(json.dumps({"round": i + 1, "head_over_vllm": rnd["ratios"]}), flush=True)
        rounds.append(rnd)
    import vllm

    out = {
        "shape": shape,
        "vllm": vllm.__version__,
        "cpus": len(os.sched_getaffinity(0)),
        "platform": platform.platform(),
        "vllm_threads_bind": a.vllm_bind,
        "rounds": rounds,
        "head_over_vllm": rounds[-1]["ratios"],
        # over every round: the head's mean TTFT summed over vLLM's
        "head_over_vllm_all_rounds": {
            "mean_ttft_ms": round(
                sum(r["head"]["mean_ttft_ms"] for r in rounds)
                / sum(r["vllm"]["mean_ttft_ms"] for r in rounds),
                3,
            )
        },
        "logs": str(logs),
    }
    if a.json:
        a.json.parent.mkdir(parents=True, exist_ok=True)
        a.json.write_text(json.dumps(out, indent=1))
    if a.markdown:
        write_section(a.markdown, markdown(out), MARK, END)


def exit_quietly() -> None:
    """Run ``main`` and leave without the interpreter's teardown: vLLM's Triton
    bindings print pages of "leaked" lines then, which would bury a failure's
    traceback (and the tests read stderr's tail). Cleanup is ``run_main``'s."""
    code: int | str | None = 0
    try:
        run_main(main)
    except SystemExit as e:
        code = e.code
    except BaseException:  # noqa: BLE001 (reported here, then the exit status says it)
        traceback.print_exc()
        code = 1
    if isinstance(code, str):
        print(code, file=sys.stderr)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code if isinstance(code, int) else (0 if code is None else 1))


if __name__ == "__main__":
    exit_quietly()
