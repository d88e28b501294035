"""Agent traffic on a head fleet: a synthetic agent trace replayed with and without kvmesh reuse.

    python bench/agents.py --json bench/results/agents.json [--model DIR] [--agents 3]
                           [--turns 8] [--system-tokens 3000] [--result-tokens 200,2000]
                           [--heads 2] [--modes kvmesh,off,vllm,vllm-off]
    python bench/agents.py --smoke          # CI: 2 agents x 3 turns, short prompts
    python bench/agents.py --probes [--smoke] [--json F]   # hostile clients instead:
                                            # bench/agent_probes.py (issue #50's probes)

The trace (seeded, the same in both modes): a system prompt with tool schemas of about
``--system-tokens`` tokens shared by every agent, each agent its own task; each turn
the agent asks with ``tools`` and a forced call (``tool_choice`` a named function,
streamed, ``temperature`` 0, a few tokens), then appends the trace's assistant tool
call and a ``role: "tool"`` result of ``--result-tokens`` tokens (uniform in the
range) and asks again. The agents run in parallel; turn t of agent a goes to head
(a + t) % ``--heads``: a router that does not pin sessions.

Modes (``--modes``), each on fresh processes:

  kvmesh    one peer and ``--heads`` heads seeded to it (``--exact-reuse-by-address``:
            each agent's own tail too; sessions kept, prefixes published)
  off       ``--heads`` heads with no peer, ``--no-publish`` and ``--max-sessions 0``:
            every prompt computed
  vllm      one ``vllm serve`` (under ``--vllm-python``, default ``.venv-vllm``) on the
            same model and tools: ``--enable-auto-tool-choice --tool-call-parser
            hermes``, prefix caching on, float32; every turn goes to it (one server
            keeps every agent's prefix: the best case for its cache)
  vllm-off  the same with ``--no-enable-prefix-caching``
            (vLLM's log: ``kvmesh-bench-agents-MODE.log`` in the temporary directory)

By default the vLLM modes run when the vLLM venv exists (``tests/vllm/setup_venv.sh``)
and the JSON says why not otherwise; ``--smoke`` runs kvmesh and off unless
``--modes`` names others.

Constrained decoding's cost per step, per server (``grammar_per_step``): on an idle
server after the replay, one prompt answered with 1 and with ``GRAMMAR_TOKENS`` tokens
(``ignore_eos``), with and without a ``response_format`` JSON schema that cannot end
sooner, alternated ``GRAMMAR_ROUNDS`` times; a step is the difference of the median
latencies over the steps between (not streamed: vLLM sends tokens in bursts).

Per mode: TTFT (client-side, to the first token's chunk, not the role's) mean / p50 / p99, over all
turns and from turn 2 on; prompt tokens, tokens reused (``cached_tokens``) and
computed; the reuse fraction of each turn from turn 2 on (min / median), and of what
could be reused: the agent's previous prompt (a 2,000-token tool result on a
3,000-token prompt caps a turn's own fraction well below 90%); the heads' prefills by
source (``/metrics``). In ``off`` a turn may still reuse some: concurrent prompts on
one head share their common prefix's forwards (counted as ``session``). Every
process started is stopped on any exit (``_common.run_main``). A PNG beside the JSON
(matplotlib, the ``bench`` extra): TTFT per turn per mode, and tokens computed.
The model defaults to the test zoo's qwen2 with Qwen2.5-Instruct's tools template
(``tests/zoo.py`` ``tools_model()``): random weights, so the answers are noise, but
the prompts, the template and the reuse are real.
"""

from __future__ import annotations

import argparse
import json
import random
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx
from _common import (
    START_TIMEOUT_S,
    machine,
    run_main,
    spawn_kvmesh,
    spawn_peer,
    spawn_vllm,
    stop,
)

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
VLLM_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"
VLLM_START_S = 900.0  # vLLM compiles the model at its first start (minutes when loaded)
MODES = ("kvmesh", "off", "vllm", "vllm-off")
GRAMMAR_TOKENS, GRAMMAR_ROUNDS = 32, 5
# a JSON document that cannot end within GRAMMAR_TOKENS tokens: every step is masked
LONG_NOTES = {
    "type": "json_schema",
    "json_schema": {
        "name": "notes",
        "strict": True,
        "schema": {
            "type": "object",
            "properties": {"notes": {"type": "string", "minLength": 2000}},
            "required": ["notes"],
            "additionalProperties": False,
        },
    },
}

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "read_file",
            "description": "Read a file of the repository.",
            "parameters": {
                "type": "object",
                "properties": {"path": {"type": "string", "maxLength": 24}},
                "required": ["path"],
                "additionalProperties": False,
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "search",
            "description": "Search the repository for a string.",
            "parameters": {
                "type": "object",
                "properties": {"query": {"type": "string", "maxLength": 16}},
                "required": ["query"],
                "additionalProperties": False,
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "run_tests",
            "description": "Run the test files named, return their output.",
            "parameters": {
                "type": "object",
                "properties": {"paths": {"type": "array", "items": {"type": "string"}}},
                "required": ["paths"],
                "additionalProperties": False,
            },
        },
    },
]
WORDS = [
    "cache",
    "block",
    "prefix",
    "token",
    "head",
    "peer",
    "store",
    "publish",
    "fetch",
    "import",
    "export",
    "session",
    "turn",
    "agent",
    "tool",
    "result",
    "search",
    "file",
    "test",
    "fix",
    "change",
    "report",
    "module",
    "function",
]


class Sizer:
    """Text of about n tokens of the model's tokenizer."""

    def __init__(self, model: str) -> None:
        from transformers import AutoTokenizer

        self.tok = AutoTokenizer.from_pretrained(model)

    def text(self, n: int, rng: random.Random, head: str = "") -> str:
        words: list[str] = [head] if head else []
        while True:
            words += [rng.choice(WORDS) for _ in range(32)]
            s = " ".join(words)
            if len(self.tok(s)["input_ids"]) >= n:
                return s


def make_trace(
    model: str, agents: int, turns: int, system_tokens: int, result: tuple[int, int], seed: int
) -> dict[str, Any]:
    """The system prompt, each agent's task and per turn its call and result."""
    rng = random.Random(seed)
    sizer = Sizer(model)
    probe = [{"role": "system", "content": ""}, {"role": "user", "content": ""}]
    frame = len(sizer.tok.apply_chat_template(probe, tools=TOOLS, tokenize=True))
    system = sizer.text(
        max(64, system_tokens - frame), rng, "You are a coding agent. Use the tools."
    )
    out = []
    for a in range(agents):
        steps = []
        for t in range(turns):
            name = TOOLS[rng.randrange(len(TOOLS))]["function"]["name"]
            args = {"read_file": {"path": f"src/m{a}_{t}.py"}, "search": {"query": f"q{a}{t}"}}
            steps.append(
                {
                    "name": name,
                    "arguments": json.dumps(args.get(name, {"paths": [f"tests/t{a}_{t}.py"]})),
                    "result": sizer.text(rng.randint(*result), rng, f"[{name} output {a}.{t}]"),
                }
            )
        out.append({"task": f"Agent {a}: fix issue {1000 + a} and report.", "steps": steps})
    return {"system": system, "agents": out}


def start_head(args: list[str]) -> tuple[subprocess.Popen[str], str]:
    """A head, once it prints its URL (a model build on first use may take minutes)."""
    p, m = spawn_kvmesh(
        "head",
        "--listen",
        "127.0.0.1:0",
        *args,
        pattern=r"(https?://\S+) grpc",
        timeout_s=max(START_TIMEOUT_S, 300.0),
    )
    return p, m.group(1)


def ask(http: httpx.Client, body: dict[str, Any]) -> dict[str, Any]:
    """One streamed chat turn: TTFT, total time, usage and the answer's text."""
    t0 = time.perf_counter()
    first, usage, text, chunks, report = 0.0, None, [], 0, None
    with http.stream("POST", "/v1/chat/completions", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"{r.status_code}: {r.read()[:500]!r}")
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            event = json.loads(line[6:])
            for c in event.get("choices") or []:
                d = c.get("delta") or {}
                chunks += 1
                # the first token's chunk: one with more than the role, or any after
                # a role-only first chunk (a head sends the role before its prefill,
                # then a chunk a token, empty while it holds a call until it is whole;
                # vLLM sends its role with the first token)
                if not first and (set(d) - {"role"} or c.get("finish_reason") or chunks > 1):
                    first = time.perf_counter() - t0
                text.append(d.get("content") or "")
                for tc in d.get("tool_calls") or []:
                    text.append((tc.get("function") or {}).get("arguments") or "")
            usage = event.get("usage") or usage
            report = event.get("kvmesh") or report  # a head's, with the usage
    if usage is None:
        raise RuntimeError("no usage event")
    return {
        "ttft_s": first,
        "total_s": time.perf_counter() - t0,
        "prompt_tokens": usage["prompt_tokens"],
        "completion_tokens": usage.get("completion_tokens", 0),
        "cached_tokens": (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0,
        "answer": "".join(text),
        # a head's seconds per stage to the first token (vLLM: none)
        "stages": (report or {}).get("breakdown") or None,
        # a head's: where the prefix came from, and the prompt tokens it computed
        "source": (report or {}).get("source"),
        "computed_tokens": (report or {}).get("computed_tokens"),
    }


def prefills(url: str) -> dict[str, int]:
    """The head's prefills so far by source (local, session, remote, compute...)."""
    text = httpx.get(url + "/metrics", timeout=30).text
    return {
        m.group(1): int(float(m.group(2)))
        for m in re.finditer(r'^kvmesh_prefill_total\{source="(\w+)"\} (\S+)$', text, re.M)
    }


def settle(http: httpx.Client, timeout_s: float = 120.0) -> None:
    """Wait until a head has handed its publishes to the fleet (``--settle``)."""
    deadline = time.monotonic() + timeout_s
    while http.get("/healthz").json()["publish_pending"] and time.monotonic() < deadline:
        time.sleep(0.05)


def replay(
    urls: list[str], model: str, trace: dict[str, Any], max_tokens: int, wait: bool = False
) -> list[dict]:
    rows: list[dict[str, Any]] = []
    errors: list[BaseException] = []
    lock = threading.Lock()
    clients = [httpx.Client(base_url=u, timeout=900) for u in urls]

    def agent(a: int, spec: dict[str, Any]) -> None:
        try:
            messages: list[dict[str, Any]] = [
                {"role": "system", "content": trace["system"]},
                {"role": "user", "content": spec["task"]},
            ]
            for t, step in enumerate(spec["steps"]):
                h = (a + t) % len(urls)
                body = {
                    "model": model,
                    "messages": messages,
                    "tools": TOOLS,
                    "tool_choice": {"type": "function", "function": {"name": step["name"]}},
                    "max_tokens": max_tokens,
                    "temperature": 0,
                    "stream": True,
                    "stream_options": {"include_usage": True},
                }
                row = {"agent": a, "turn": t, "head": h, **ask(clients[h], body)}
                with lock:
                    rows.append(row)
                if wait:  # the tool's run outlasts the head's publish
                    settle(clients[h])
                cid = f"call_{a}_{t}"
                call = {"name": step["name"], "arguments": step["arguments"]}
                messages = [
                    *messages,
                    {
                        "role": "assistant",
                        "content": None,
                        "tool_calls": [{"id": cid, "type": "function", "function": call}],
                    },
                    {"role": "tool", "tool_call_id": cid, "content": step["result"]},
                ]
        except BaseException as e:  # reported by the main thread
            errors.append(e)

    threads = [
        threading.Thread(target=agent, args=(a, s), daemon=True)
        for a, s in enumerate(trace["agents"])
    ]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    for c in clients:
        c.close()
    if errors:
        raise errors[0]
    return sorted(rows, key=lambda r: (r["agent"], r["turn"]))


def p99(xs: list[float]) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(0.99 * (len(xs) - 1)))]


def summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    later = [r for r in rows if r["turn"] > 0]

    def ttft(rs: list[dict[str, Any]]) -> dict[str, float]:
        xs = [r["ttft_s"] for r in rs]
        return {"mean_s": statistics.fmean(xs), "p50_s": statistics.median(xs), "p99_s": p99(xs)}

    prompt = sum(r["prompt_tokens"] for r in rows)
    reused = sum(r["cached_tokens"] for r in rows)
    fractions = [r["cached_tokens"] / r["prompt_tokens"] for r in later]
    # what could be reused: the agent's previous turn's prompt (its answer is the trace's)
    prev = {(r["agent"], r["turn"]): r["prompt_tokens"] for r in rows}
    of_prev = [min(1.0, r["cached_tokens"] / prev[r["agent"], r["turn"] - 1]) for r in later]
    return {
        "ttft": {"all": ttft(rows), "turn2_on": ttft(later) if later else None},
        "prompt_tokens": prompt,
        "reused_tokens": reused,
        "computed_tokens": prompt - reused,
        "reused_fraction": reused / prompt,
        "turn2_on_reuse": {
            "min": min(fractions) if fractions else None,
            "median": statistics.median(fractions) if fractions else None,
            "turns_at_least_90pct": sum(f >= 0.9 for f in fractions),
            "turns": len(fractions),
            "of_previous_prompt_min": min(of_prev) if of_prev else None,
            "of_previous_prompt_median": statistics.median(of_prev) if of_prev else None,
            "turns_previous_prompt_at_least_98pct": sum(f >= 0.98 for f in of_prev),
        },
        "sources": {},  # the heads' kvmesh_prefill_total by source, over the replay
        "wall_s": None,
    }


def start_heads(mode: str, model: str, heads: int) -> tuple[list[Any], list[str]]:
    """The mode's kvmesh processes (a peer first for ``kvmesh``); (processes, head URLs)."""
    procs, urls = [], []
    try:
        if mode == "kvmesh":
            peer, address = spawn_peer("--gossip-interval", "0.3", "--ttl", "3")
            procs.append(peer)
            common = ["--seed", address, "--exact-reuse-by-address", "--gossip-interval", "0.3"]
        else:
            common = ["--no-publish", "--max-sessions", "0"]
        for i in range(heads):
            p, url = start_head(["--model", model, "--alias", f"{mode}-{i}", *common])
            procs.append(p)
            urls.append(url)
        with httpx.Client(timeout=30) as http:
            deadline = time.time() + 120
            for u in urls if mode == "kvmesh" else []:  # every head sees the fleet
                while http.get(u + "/healthz").json()["compatible_peers"] < heads:
                    if time.time() > deadline:
                        raise RuntimeError(f"{u} never saw the fleet")
                    time.sleep(0.1)
    except BaseException:
        for p in reversed(procs):
            stop(p)
        raise
    return procs, urls


def start_vllm(mode: str, python: str, model: str, log: Path) -> tuple[list[Any], list[str]]:
    """One ``vllm serve`` with the head's tool parser, prefix caching on or off."""
    args = ["--dtype", "float32", "--seed", "0", "--max-model-len", "32768"]
    args += ["--enable-auto-tool-choice", "--tool-call-parser", "hermes"]
    args += ["--enable-prompt-tokens-details"]  # usage's cached_tokens
    args += ["--enable-prefix-caching" if mode == "vllm" else "--no-enable-prefix-caching"]
    proc, url = spawn_vllm(python, model, args, log, VLLM_START_S)
    return [proc], [url]


def warm(urls: list[str], model: str) -> None:
    """First-call set-up, not counted."""
    with httpx.Client(timeout=300) as http:
        for u in urls:
            body = {"model": model, "messages": [{"role": "user", "content": "hi"}]}
            http.post(u + "/v1/chat/completions", json={**body, "max_tokens": 1}).raise_for_status()


def latency(http: httpx.Client, body: dict[str, Any]) -> tuple[float, int]:
    """(seconds for the whole answer, completion tokens): not streamed, so a server
    that sends tokens in bursts is timed as one that sends them one by one."""
    t0 = time.perf_counter()
    r = http.post("/v1/chat/completions", json=body)
    if r.status_code != 200:
        raise RuntimeError(f"{r.status_code}: {r.text[:500]!r}")
    return time.perf_counter() - t0, r.json()["usage"]["completion_tokens"]


def grammar_per_step(url: str, model: str) -> dict[str, Any]:
    """A decode step with and without a JSON-schema constraint on one idle server: the
    answer's time at ``GRAMMAR_TOKENS`` tokens minus at 1, over the steps between;
    medians of ``GRAMMAR_ROUNDS`` alternated rounds (the prompt is cached after the
    first, the schema compiled)."""
    body = {
        "model": model,
        "messages": [{"role": "user", "content": "Write the release notes as JSON."}],
        "temperature": 0,
        "ignore_eos": True,
    }
    kinds = {"free": body, "constrained": {**body, "response_format": LONG_NOTES}}
    times: dict[tuple[str, int], list[float]] = {}
    with httpx.Client(base_url=url, timeout=300) as http:
        latency(http, {**kinds["constrained"], "max_tokens": 1})  # compile and cache, uncounted
        for _ in range(GRAMMAR_ROUNDS):
            for kind, b in kinds.items():
                for n in (1, GRAMMAR_TOKENS):
                    t, got = latency(http, {**b, "max_tokens": n})
                    if got != n:
                        raise RuntimeError(f"{kind}: {got} tokens for max_tokens {n}")
                    times.setdefault((kind, n), []).append(t)

    def step(kind: str) -> float:
        med = {n: statistics.median(times[kind, n]) for n in (1, GRAMMAR_TOKENS)}
        return (med[GRAMMAR_TOKENS] - med[1]) / (GRAMMAR_TOKENS - 1)

    f, c = step("free"), step("constrained")
    return {
        "tokens": GRAMMAR_TOKENS,
        "rounds": GRAMMAR_ROUNDS,
        "free_step_ms": f * 1e3,
        "constrained_step_ms": c * 1e3,
        "extra_per_step_ms": (c - f) * 1e3,
        "ratio": c / f,
    }


def run_mode(
    mode: str, model: str, heads: int, trace: dict[str, Any], max_tokens: int, a: Any
) -> dict[str, Any]:
    if mode.startswith("vllm"):
        log = Path(tempfile.gettempdir()) / f"kvmesh-bench-agents-{mode}.log"
        procs, urls = start_vllm(mode, str(a.vllm_python), model, log)
    else:
        procs, urls = start_heads(mode, model, heads)
    try:
        warm(urls, model)
        kvmesh = not mode.startswith("vllm")
        before = [prefills(u) for u in urls] if kvmesh else []
        t0 = time.perf_counter()
        rows = replay(urls, model, trace, max_tokens, wait=a.settle and kvmesh)
        out = summary(rows)
        out["wall_s"] = time.perf_counter() - t0
        out["servers"] = len(urls)
        for b, u in zip(before, urls if kvmesh else [], strict=True):
            for k, v in prefills(u).items():
                out["sources"][k] = out["sources"].get(k, 0) + v - b.get(k, 0)
        if mode in ("kvmesh", "vllm"):
            out["grammar_per_step"] = grammar_per_step(urls[0], model)
        out["turns"] = rows
        return out
    finally:
        for p in reversed(procs):
            stop(p)


def modes_to_run(a: Any) -> tuple[list[str], str | None]:
    """The modes asked for, and why the vLLM ones do not run (None when they do)."""
    if a.modes:
        modes = a.modes.split(",")
        bad = [m for m in modes if m not in MODES]
        if bad:
            raise SystemExit(f"--modes: unknown {bad}; choose from {','.join(MODES)}")
        if any(m.startswith("vllm") for m in modes) and not Path(a.vllm_python).exists():
            raise SystemExit(f"--modes {a.modes}: no vLLM at {a.vllm_python}")
        return modes, None
    if a.smoke:
        return ["kvmesh", "off"], "not run: --smoke runs kvmesh and off (--modes vllm,...)"
    if not Path(a.vllm_python).exists():
        return ["kvmesh", "off"], f"not run: no {a.vllm_python} (tests/vllm/setup_venv.sh)"
    return list(MODES), None


def plot(result: dict[str, Any], path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no PNG (pip install matplotlib)")
        return
    modes = result["modes"]
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(12, 4.2), width_ratios=(2, 1))
    for i, (mode, r) in enumerate(modes.items()):
        by_turn: dict[int, list[float]] = {}
        for t in r["turns"]:
            by_turn.setdefault(t["turn"], []).append(t["ttft_s"])
        xs = sorted(by_turn)
        ax.plot(
            xs, [statistics.fmean(by_turn[x]) for x in xs], "o-", ms=3, label=mode, color=f"C{i}"
        )
    ax.set_yscale("log")
    ax.set_xlabel("turn")
    ax.set_ylabel("TTFT, mean over agents (s)")
    ax.legend(fontsize=8)
    size = result["size"]
    ax.set_title(
        f"{size['agents']} agents x {size['turns']} turns, tool results "
        f"{size['result_tokens'][0]}-{size['result_tokens'][1]} tokens",
        fontsize=9,
    )
    names = list(modes)
    bx.bar(
        names,
        [modes[m]["computed_tokens"] for m in names],
        color=[f"C{i}" for i in range(len(names))],
    )
    bx.set_ylabel("prompt tokens computed")
    bx.tick_params(axis="x", labelsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", help="model directory (default: the test zoo's tools model)")
    ap.add_argument("--agents", type=int, default=3)
    ap.add_argument("--turns", type=int, default=8)
    ap.add_argument("--system-tokens", type=int, default=3000)
    ap.add_argument("--result-tokens", default="200,2000", help="LOW,HIGH")
    ap.add_argument("--heads", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--modes", help=f"comma-separated, of {','.join(MODES)} (default: see above)")
    ap.add_argument("--vllm-python", type=Path, default=VLLM_PYTHON, help="vLLM's interpreter")
    ap.add_argument("--json", type=Path)
    ap.add_argument(
        "--settle",
        action="store_true",
        help="after each turn, wait for the head's publishes (a tool that runs that long); "
        "on with --smoke, so its heads reuse through the fleet on a loaded machine too",
    )
    ap.add_argument("--smoke", action="store_true", help="2 agents x 3 turns, short, for CI")
    ap.add_argument(
        "--probes", action="store_true", help="hostile and careless clients (agent_probes.py)"
    )
    a = ap.parse_args()
    if a.probes:
        import agent_probes

        model = ["--model", a.model] if a.model else []
        out = ["--json", str(a.json)] if a.json else []
        agent_probes.main([*model, *out, *(["--smoke"] if a.smoke else [])])
        return
    if a.smoke:
        a.agents, a.turns, a.system_tokens, a.result_tokens = 2, 3, 400, "40,120"
        a.settle = True
    if a.model is None:
        import zoo

        a.model = str(zoo.tools_model())
    modes_list, vllm_why = modes_to_run(a)
    if a.json:
        a.json.parent.mkdir(parents=True, exist_ok=True)
    low, high = (int(x) for x in a.result_tokens.split(","))
    trace = make_trace(a.model, a.agents, a.turns, a.system_tokens, (low, high), a.seed)
    modes = {}
    for mode in modes_list:
        modes[mode] = run_mode(mode, a.model, a.heads, trace, a.max_tokens, a)
        s = modes[mode]
        later = s["ttft"]["turn2_on"] or s["ttft"]["all"]
        g = s.get("grammar_per_step")
        print(
            f"{mode}: TTFT mean {s['ttft']['all']['mean_s'] * 1e3:.0f} ms, p99 "
            f"{s['ttft']['all']['p99_s'] * 1e3:.0f} ms (turn 2 on: mean "
            f"{later['mean_s'] * 1e3:.0f} ms, p99 {later['p99_s'] * 1e3:.0f} ms); "
            f"{s['computed_tokens']} of {s['prompt_tokens']} prompt tokens computed, "
            f"{s['reused_tokens']} reused; turn 2 on reuse min "
            f"{s['turn2_on_reuse']['min']}; sources {s['sources']}; wall {s['wall_s']:.1f} s"
            + (
                f"; step {g['free_step_ms']:.1f} ms, constrained {g['constrained_step_ms']:.1f} ms"
                if g
                else ""
            ),
            flush=True,
        )
    result = {
        "model": a.model,
        "size": {
            "agents": a.agents,
            "turns": a.turns,
            "system_tokens": a.system_tokens,
            "result_tokens": [low, high],
            "heads": a.heads,
            "max_tokens": a.max_tokens,
            "seed": a.seed,
            "smoke": a.smoke,
            "settle": a.settle,
        },
        "modes": modes,
        "ratios": ratios(modes),
        "machine": machine(),
    }
    if vllm_why:
        result["vllm"] = vllm_why
    if a.json:
        a.json.write_text(json.dumps(result, indent=1) + "\n")
        plot(result, a.json.with_suffix(".png"))


def ratios(modes: dict[str, Any]) -> dict[str, dict[str, float]]:
    """Each other mode over kvmesh: mean and p99 TTFT, tokens computed (> 1: kvmesh ahead)."""
    if "kvmesh" not in modes:
        return {}
    on = modes["kvmesh"]
    return {
        f"{m}_vs_kvmesh": {
            "ttft_mean": r["ttft"]["all"]["mean_s"] / on["ttft"]["all"]["mean_s"],
            "ttft_p99": r["ttft"]["all"]["p99_s"] / on["ttft"]["all"]["p99_s"],
            "computed_tokens": r["computed_tokens"] / max(1, on["computed_tokens"]),
        }
        for m, r in modes.items()
        if m != "kvmesh"
    }


if __name__ == "__main__":
    run_main(main)
