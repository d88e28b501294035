"""Time to first token of a remote hit, as a head and as a library get it, over
real links: what a ``kvmesh head`` does, measured beside the library client, a
cold prefill and the planner's choice, on loopback and on shaped links.

    python bench/ttft.py --json bench/results/ttft.json   # demo, then demo with
                         # --sliding-window 512, at 1024,4096,16384 tokens, on
                         # loopback, 10gbit, 1gbit and 100mbit (long: hours on 2 cores)
    python bench/ttft.py --lengths 1024 --links loopback,1gbit --json /tmp/t.json
    python bench/ttft.py --model shape:gemma4,demo --sliding-window 512 ...
    python bench/ttft.py --smoke --json /tmp/ttft.json    # CI: demo-tiny, 64 tokens

One row per (model, prompt length, link) in ``results`` (all times in seconds;
each path runs once per round, all of them in turn, so a noisy moment on a
shared machine costs them alike; 3 rounds, the medians, where every path took
under a second in the first, else one):

  cold_s            cold local prefill in this process (the engine's best path) +
                    first token; the best of 3 where the first took under 2 s
  head_remote_s     a real ``kvmesh head`` process (empty store), one
                    ``POST /v1/completions`` with the prompt's token ids and
                    ``max_tokens`` 1: the response's ``kvmesh.ttft_s`` (the head's
                    clock, as ``kvmesh demo`` reads it)
  library_remote_s  an in-process ``HeadRuntime`` in a process prepared as a head
                    is (:func:`kvmesh.runtime.ready.prepare_process` before the
                    model loads, :func:`~kvmesh.runtime.ready.ready` once it runs)
  library_bare_s    the same in a child process without either, a new
                    ``HeadRuntime`` per hit: the library path as it was measured
                    before issue #41 (what the 54 ms against 27 ms was)
  fetch_forced_s    the library path with ``Planner(force="fetch")``; a forced fetch
                    that computed (``fetch_forced_source`` not remote) fails its row
                    (``failed`` names the report's fallback reason) and the run
                    exits non-zero once the JSON is written
  compute_forced_s  the library path with ``Planner(force="compute")``: a head's own
                    compute (chunked prefill in its batch), the planner's other choice
  untrimmed_remote_s  a second head with ``--no-window-trim`` (ships every
                    position, the reference); on a model without sliding layers
                    nothing is trimmed and it is the head's own figure
                    (``untrimmed_measured`` false)
  kv_bytes          n x card.kv_bytes_per_token: all positions, all layers
  bytes_sent        what the head's hit moved over the link, counted where it
                    moved: the veth's received bytes on a namespace link (IP
                    packets: headers and a little gossip in), else the head's
                    transport's count of frame bytes (the report's ``bytes_wire``),
                    else the peer's served-bytes counter (its gossiped card);
                    ``bytes_sent_by`` says which, ``bytes_counted_*`` has each
                    count taken. ``bytes_sent_untrimmed``: the same for the reference
  planner_choice    fetch or compute, the library head's (its report's planner, or
                    where its prefix came from); ``planner_regret``: its time over
                    ``min(fetch_forced_s, compute_forced_s)`` (1.0: it chose the better)

Links: ``loopback`` (TCP, ``--no-local-socket``: the bytes cross a socket), and
``10gbit``, ``1gbit``, ``100mbit``: a peer in its own network namespace behind a
veth capped with ``tc`` tbf on the peer->head direction (burst 1/100 s of the
rate, latency 50 ms; root), or, without root, a loopback peer pacing its own
sends (``--serve-rate``, shaper ``pace``). Every link has its own peer and its
prompts under its own ``cache_salt``, so a hit can only come over that link.

The consumers live through a model's whole run, as a serving head does: a head
process (and the untrimmed one), the prepared library head, the forced one and
the bare child; each fetches a 512-token prompt on each link first (its planner
learns the link), then the lengths in order. Heads and library nodes run with a
1-byte store budget and no sessions, so nothing fetched is kept: every hit is a
remote one and no consumer can serve another. Every hit is an exact repeat of
its client's own prompt (heads run ``--exact-reuse-by-address``, as ``kvmesh
demo``'s; the library heads call as that client), so the stored logits give the
first token and the figure is the hit's alone, no forward pass. The library
planner and the child's know this machine's prefill speed from the cold runs, as
a head that served such prompts would.

``--sliding-window W`` runs on a copy of each ``--model`` whose config gives its
layers Gemma-3's pattern (five sliding-window layers of W tokens per full one),
the same weights. ``--model`` takes a comma-separated list; besides a model
directory or a demo name, ``shape:NAME`` is a random-weight model of a today's
architecture at a bench scale, built once under ``$KVMESH_HOME/bench-models``
(``SHAPES``). ``--baselines`` adds, on loopback rows, the in-process floor and a
file-based prompt cache (``_filecache.py``: llama.cpp's slot save/restore and
mlx-lm's prompt cache pattern), as earlier runs of this benchmark measured.

``summarize()`` prints the issue's checks: library/head at 1,024 tokens on
loopback <= 1.3; on a sliding model at 4,096 tokens over 1gbit,
bytes_sent/bytes_sent_untrimmed <= 0.30 and untrimmed/trimmed time >= 2.5;
planner_regret <= 1.2 on 100mbit; also under ``checks`` in the JSON.

The fleet runs the secure path: a fleet key generated for the run authenticates
every call and keys the block hashes. Peers, heads, the child, namespaces, links
and the heads' temporary ``KVMESH_HOME`` go on any exit (``_common.OWNED``;
``KVMESH_BENCH_FAIL=head`` fails once the first head is up, for the tests).
``KVMESH_BENCH_VERBOSE=1`` lets the children's logs through.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import secrets
import select
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from _common import (
    FAIL_ENV,
    NetnsPeer,
    await_start,
    fail_point,
    launch_kvmesh,
    machine,
    netns_works,
    own_tempdir,
    popen,
    run_main,
    stop,
    wait_for,
)
from safetensors.torch import save_file

from kvmesh.blocks import BlockKeyer, request_root
from kvmesh.compat import CompatCard
from kvmesh.engine import KVState, Sampling, load_engine
from kvmesh.mesh.node import NodeConfig, NodeThread
from kvmesh.mesh.options import NODE
from kvmesh.mesh.security import Security
from kvmesh.runtime.head import CacheScope, Generation, HeadRuntime
from kvmesh.runtime.head import _caller as caller_key  # the head's own derivation, not a copy
from kvmesh.runtime.planner import Planner

ONE = Sampling(max_tokens=1)
HERE = Path(__file__).resolve().parent
LINKS = ("loopback", "10gbit", "1gbit", "100mbit")
RATE_BITS = {"10gbit": 10e9, "1gbit": 1e9, "100mbit": 100e6}
# every hit is an exact repeat of this caller's own prompt (its stored logits give the
# first token), as a head with --exact-reuse-by-address sees a client on 127.0.0.1
CALLER = "host:127.0.0.1"
FETCH_DEADLINE_S = 120.0  # a whole 16k-token demo prompt at 100 Mbit/s takes ~32 s
LEARN_TOKENS = 512  # each consumer's first fetch on a link: its planner learns the link
REPEAT_UNDER_S = 1.0  # a hit this fast is measured 3 times (the median)
PEER_BUDGET = "6GiB"
GOSSIP_S = 0.2
HEAD_START_S = 600.0  # a head loads its model first (minutes for a large one)
CHECKS = {  # the done-when targets
    "library_vs_head_1024_loopback": 1.3,
    "trimmed_share_4096_1gbit": 0.30,
    "untrimmed_vs_trimmed_4096_1gbit": 2.5,
    "planner_regret_100mbit": 1.2,
}


T0 = time.monotonic()


def say(text: str) -> None:
    """A progress line, stamped with the seconds since the run began."""
    print(f"[{time.monotonic() - T0:7.1f}s] {text}", flush=True)


def node_option(name: str) -> bool:
    """The mesh nodes of this checkout have option ``name`` (``--no-window-trim``,
    ``--serve-rate``: the benchmark runs without them, saying so)."""
    return name in NODE


def tokens(engine, n: int, salt: str) -> list[int]:  # type: ignore[no-untyped-def]
    text = f"[{salt}] " + " ".join(
        f"fact {i}: blocks are immutable and verified." for i in range(n)
    )
    out = engine.encode(text)[:n]
    assert len(out) == n
    return out


_S, _F, _L = "sliding_attention", "full_attention", "linear_attention"
SHAPE_RECIPE = 1  # bump to rebuild the shape models
# name -> (the zoo model whose tokenizer, templates and config it starts from, the config
# changes). Hidden 512, ~63M parameters each; the layer patterns are the real families'.
SHAPES: dict[str, tuple[str, dict]] = {  # type: ignore[type-arg]
    "gemma4": (  # gemma-4-E4B's layout at a bench scale (no MoE, as E4B)
        "gemma4",
        {
            "hidden_size": 512,
            "intermediate_size": 2048,
            "num_hidden_layers": 12,
            "layer_types": ([_S] * 5 + [_F]) * 2,
            "num_attention_heads": 8,
            "num_key_value_heads": 2,
            "head_dim": 64,
            "global_head_dim": 128,  # full layers: 2 KV heads of 128 (E4B: 2 of 512)
            "attention_k_eq_v": False,
            "num_global_key_value_heads": None,
            "num_kv_shared_layers": 5,  # E4B: the last 18 of 42
            "hidden_size_per_layer_input": 64,
            "enable_moe_block": False,
            "sliding_window": 512,  # E4B's
        },
    ),
    "qwen3_5": (  # Qwen3.5-9B's layout at a bench scale
        "qwen3_5",
        {
            "hidden_size": 512,
            "intermediate_size": 2560,  # the others' ~63M parameters
            "num_hidden_layers": 12,
            "layer_types": ([_L] * 3 + [_F]) * 3,
            "full_attention_interval": 4,
            "num_attention_heads": 8,
            "num_key_value_heads": 2,
            "head_dim": 128,
            # 9B (hidden 4096): 16 key heads and 32 value heads of 128, i.e. key dims
            # hidden / 2 and value dims = hidden; the same ratios here
            "linear_num_key_heads": 2,
            "linear_key_head_dim": 128,
            "linear_num_value_heads": 4,
            "linear_value_head_dim": 128,
        },
    ),
    "attention": (  # a Qwen3-shaped full-attention model of similar size
        "qwen2",
        {
            "architectures": ["Qwen3ForCausalLM"],
            "model_type": "qwen3",
            "hidden_size": 512,
            "intermediate_size": 2048,
            "num_hidden_layers": 14,  # 14 x 4.5M: the hybrids' ~63M parameters
            "num_attention_heads": 8,
            "num_key_value_heads": 2,
            "head_dim": 128,
            "max_window_layers": 14,
        },
    ),
}


def shape_model(name: str) -> Path:
    """The directory of ``SHAPES[name]``: built once (seeded transformers init,
    float32), atomically, under ``$KVMESH_HOME/bench-models``."""
    import shutil

    import transformers

    sys.path.insert(0, str(HERE.parent))  # tests.zoo: the tokenizers and base configs
    from kvmesh.engine.embedded import kvmesh_home
    from tests import zoo

    if name not in SHAPES:
        raise SystemExit(f"unknown shape {name!r}; one of {', '.join(SHAPES)}")
    base, changes = SHAPES[name]
    root = kvmesh_home() / "bench-models"
    dst = root / f"{name}-shape-r{SHAPE_RECIPE}"
    if dst.is_dir():
        return dst
    src = zoo.hf_model(base)
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=root))
    try:
        for f in src.iterdir():
            if f.is_file() and not f.name.endswith(".safetensors") and f.name != "config.json":
                shutil.copy2(f, tmp / f.name)
        cfg = json.loads((src / "config.json").read_text())
        cfg.update(changes, _name_or_path=f"kvmesh-bench-{name}-shape")
        cfg = {k: v for k, v in cfg.items() if v is not None}
        if not cfg.get("enable_moe_block", True):
            for k in ("moe_intermediate_size", "num_experts", "top_k_experts"):
                cfg.pop(k, None)
        (tmp / "config.json").write_text(json.dumps(cfg, indent=1, sort_keys=True))
        torch.manual_seed(SHAPE_RECIPE)
        conf = transformers.AutoConfig.from_pretrained(tmp)
        cls = getattr(transformers, cfg["architectures"][0])
        cls._from_config(conf, dtype=torch.float32).save_pretrained(tmp)
        (tmp / "config.json").write_text(json.dumps(cfg, indent=1, sort_keys=True))
        try:
            os.rename(tmp, dst)
        except OSError:  # another run built it first: the same recipe
            shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return dst


def label(model: str) -> str:
    """A short name for tables: the shape's, the demo's, or the directory's."""
    return model.removeprefix("shape:") if model.startswith("shape:") else Path(model).name


def resolve(model: str) -> str:
    return str(shape_model(model[len("shape:") :])) if model.startswith("shape:") else model


def sliding_variant(model: str, window: int) -> str:
    """A copy of ``model``'s directory with five sliding layers of ``window`` tokens
    per full one (``layer_types``), the same weight files (hard links where possible)."""
    import shutil

    from kvmesh.engine.embedded import resolve_model

    src = resolve_model(model)
    dst = Path(tempfile.gettempdir()) / f"kvmesh-bench-{src.name}-swa{window}"
    cfg = json.loads((src / "config.json").read_text())
    layers = int(cfg["num_hidden_layers"])
    types = ["full_attention" if i % 6 == 5 else "sliding_attention" for i in range(layers)]
    dst.mkdir(exist_ok=True)
    for f in src.iterdir():
        if f.is_file() and not (dst / f.name).exists():
            try:
                os.link(f, dst / f.name)
            except OSError:
                shutil.copy2(f, dst / f.name)
    cfg.update(
        sliding_window=window,
        use_sliding_window=True,
        max_window_layers=layers,
        layer_types=types,
        _name_or_path=dst.name,
    )
    (dst / "config.json").unlink(missing_ok=True)  # a link to the source's: never write through it
    (dst / "config.json").write_text(json.dumps(cfg, indent=1))
    return str(dst)


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def timed(fn, device: str) -> float:  # type: ignore[no-untyped-def]
    sync(device)
    t0 = time.perf_counter()
    fn()
    sync(device)
    return time.perf_counter() - t0


def fleet_key(directory: str) -> tuple[str, Security]:
    """A fresh fleet key in a file (as `openssl rand -hex 32 > fleet.key` makes one)."""
    path = os.path.join(directory, "fleet.key")
    with open(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "w") as f:
        f.write(secrets.token_hex(32) + "\n")
    return path, read_key(path)


def read_key(path: str) -> Security:
    with open(path, "rb") as f:
        return Security(fleet_key=f.read().strip())


# -- links ---------------------------------------------------------------------


@dataclass
class Link:
    """One link's peer: its address, how the link is shaped, and the salt its
    prompts are published under (so a hit comes only over this link)."""

    name: str
    shaper: str  # tbf | pace | none
    address: str
    netns: NetnsPeer | None = None

    @property
    def salt(self) -> str:
        return f"ttft/{self.name}"

    def received(self) -> int | None:
        """The head side's received bytes on a namespace link (None: loopback)."""
        return self.netns.received() if self.netns is not None else None


def link_plan(args: argparse.Namespace, netns: bool) -> list[tuple[str, str]]:
    """(link, shaper) to measure: loopback, then the shaped ones, tbf where network
    namespaces work (unless ``--shaper pace``). Smoke: loopback, 100mbit paced,
    and 1gbit by tbf where it can."""
    if args.smoke:
        return [("loopback", "none"), ("100mbit", "pace")] + ([("1gbit", "tbf")] if netns else [])
    shaper = "tbf" if netns and args.shaper != "pace" else "pace"
    if args.shaper == "tbf" and not netns:
        raise SystemExit("--shaper tbf needs root and iproute2 (network namespaces)")
    out = []
    for name in args.links.split(","):
        if name not in LINKS:
            raise SystemExit(f"unknown link {name!r}: one of {', '.join(LINKS)}")
        out.append((name, "none" if name == "loopback" else shaper))
    return out


def open_links(plan: list[tuple[str, str]], key_file: str) -> list[Link]:
    """Start every link's peer (in parallel) and shape its link; owned."""
    common = ["--fleet-key-file", key_file, "--budget", PEER_BUDGET]
    common += ["--gossip-interval", str(GOSSIP_S)]
    started: list[tuple[Link, Any]] = []
    for i, (name, shaper) in enumerate(plan):
        if shaper == "tbf":
            peer = NetnsPeer(key_file, i + 1, *common)
            started.append((Link(name, shaper, peer.address, peer), peer.proc))
            continue
        pace = []
        if shaper == "pace":
            if node_option("serve_rate"):
                pace = ["--serve-rate", str(int(RATE_BITS[name] / 8))]
            else:
                say(f"{name}: this checkout's peer has no --serve-rate: unshaped")
                shaper = "none"
        proc = launch_kvmesh("peer", "--listen", "127.0.0.1:0", "--no-local-socket", *common, *pace)
        started.append((Link(name, shaper, ""), proc))
    links = []
    for link, proc in started:
        m = await_start(proc, r"listening on (\S+)")
        link.address = link.address or m.group(1)
        if link.netns is not None:  # the link names are tc's spellings of their rates
            link.netns.shape(link.name, RATE_BITS[link.name])
        links.append(link)
    return links


def card_of(node: NodeThread, address: str) -> Any:
    """The live card of the node listening on ``address`` (None: not known yet)."""
    for c in node.node.membership.live():
        if any(e.address == address for e in c.endpoints):
            return c
    return None


def wait_serving(node: NodeThread, addresses: Sequence[str], ns_hex: str, what: str) -> None:
    def ok() -> bool:
        cards = [card_of(node, a) for a in addresses]
        return all(c is not None and ns_hex in c.namespaces for c in cards)

    wait_for(ok, 30, f"{what}: the link peers to advertise the namespace")


def served(node: NodeThread, address: str) -> int:
    """The peer's served-bytes counter, settled: from a card it issued twice after
    this call began (its counters then include every fetch already answered)."""
    card = card_of(node, address)
    assert card is not None
    version = card.version
    wait_for(lambda: card_of(node, address).version >= version + 2, 10, "the peer's card")
    return int(card_of(node, address).bytes_served)


# -- the library path (in process) ---------------------------------------------


def library_head(
    engine,
    links: Sequence[Link],
    security: Security,
    planner: Planner,
    alias: str,
    fetch_deadline: float = FETCH_DEADLINE_S,
) -> HeadRuntime:  # type: ignore[no-untyped-def]
    """A long-lived library head seeing every link's peer: 1-byte store (it keeps
    nothing it fetches), no sessions, no publishing."""
    seeds = [link.address for link in links]
    return _head(
        engine,
        seeds,
        security,
        planner,
        alias,
        gossip_interval=0.5,
        budget_bytes=1,
        fetch_deadline=fetch_deadline,
    )


def fresh_head(  # type: ignore[no-untyped-def]
    engine, peer: str, security: Security, planner: Planner | None = None
) -> HeadRuntime:
    """A new library head on a new node seeded with ``peer`` (the path as this
    benchmark measured it before issue #41: nothing warmed)."""
    return _head(engine, [peer], security, planner, "bench", gossip_interval=0.2)


def _head(  # type: ignore[no-untyped-def]
    engine,
    seeds: list[str],
    security: Security,
    planner: Planner | None,
    alias: str,
    *,
    gossip_interval: float,
    budget_bytes: int = NodeConfig.budget_bytes,
    fetch_deadline: float = FETCH_DEADLINE_S,
) -> HeadRuntime:
    """A library head (no sessions, no publishing) on a new node seeded with
    ``seeds``, returned once their cards advertise the engine's namespace."""
    node = NodeThread(
        NodeConfig(
            seeds=seeds,
            gossip_interval=gossip_interval,
            ttl=5,
            alias=f"{alias}-{time.time_ns()}",
            security=security,
            fetch_deadline=fetch_deadline,
            budget_bytes=budget_bytes,
        )
    )
    head = HeadRuntime(
        engine,
        node,
        max_sessions=0,
        publish=False,
        hash_key=security.block_hash_key,
        planner=planner,
    )
    try:
        wait_serving(node, seeds, engine.card.namespace_hex, alias)
    except BaseException:
        close(head)
        raise
    return head


def close(head: HeadRuntime) -> None:
    head.close()
    assert head.node is not None
    head.node.close()


def complete(head: HeadRuntime, toks: list[int], salt: str) -> Generation:
    """The prompt under ``salt`` (as a ``cache_salt`` request) from :data:`CALLER`,
    one token."""
    out = Generation()
    scope = CacheScope(root=request_root(head.card.namespace, None, salt), caller=CALLER)
    for _ in head.generate(toks, ONE, out, scope=scope):
        pass
    assert out.report is not None
    return out


def report_of(g: Generation) -> dict[str, Any]:
    assert g.report is not None
    return {**g.report.as_dict(), "ttft_s": g.ttft_s}


def choice_of(report: dict[str, Any]) -> str:
    """fetch or compute: the planner's word where the report has it, else what
    happened (a failed fetch's fallback then reads as compute)."""
    planner = report.get("planner")
    if isinstance(planner, dict) and planner.get("choice") in ("fetch", "compute"):
        return str(planner["choice"])
    return "fetch" if report["source"] == "remote" else "compute"


def forced_planner() -> Planner:
    try:
        return Planner(force="fetch")  # type: ignore[call-arg]
    except TypeError:  # a checkout before Planner(force=): nothing estimates compute cheap
        return Planner(prefill_tps=1e-9)


def get_ready(head: HeadRuntime) -> None:
    """What a head does at start, for this library head (its fleet, its engine;
    the process-wide part once)."""
    try:
        from kvmesh.runtime.ready import ready
    except ImportError:  # a checkout before runtime/ready: the head's own warm-up
        head.warm_up()
        return
    ready(head.engine, head.fleet, head.engine.layout)


# -- head processes --------------------------------------------------------------


def http(url: str, body: dict[str, Any] | None = None, timeout: float = 900) -> Any:
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


class HeadProc:
    """A ``kvmesh head`` seeded with every link's peer, in a temporary
    ``KVMESH_HOME`` of its own; started by the constructor, waited for by
    :meth:`started` (it listens) and :meth:`connected` (it sees every link's
    peer serving the model). 1-byte store, no sessions, no publishing (see the module)."""

    def __init__(
        self, args: argparse.Namespace, model: str, links: Sequence[Link], key_file: str, trim: bool
    ) -> None:
        self.model, self.links = model, links
        cmd = ["head", "--model", model, "--listen", "127.0.0.1:0", "--fleet-key-file", key_file]
        cmd += ["--gossip-interval", "0.5", "--no-publish", "--max-sessions", "0", "--budget", "1"]
        cmd += ["--exact-reuse-by-address"]  # the prompt's exact tail is CALLER's
        cmd += ["--fetch-timeout", str(FETCH_DEADLINE_S), "--device", args.device]
        cmd += ["--alias", "bench-head" if trim else "bench-head-untrimmed"]
        cmd += ["--dtype", args.dtype] if args.dtype else []
        cmd += ["--no-window-trim"] if not trim else []
        for link in links:
            cmd += ["--seed", link.address]
        self.proc = launch_kvmesh(*cmd, env={"KVMESH_HOME": own_tempdir("home")})
        self.url = ""

    def started(self) -> None:
        self.url = await_start(self.proc, r"(http://\S+)", HEAD_START_S).group(1)

    def connected(self) -> None:
        wait_for(
            lambda: http(self.url + "/healthz")["compatible_peers"] >= len(self.links),
            60,
            "the head to see every link's peer",
        )

    def hit(self, toks: list[int], salt: str) -> dict[str, Any]:
        """One completion of ``toks`` (token ids) under ``salt``: its ``kvmesh`` report."""
        body = {"model": self.model, "prompt": toks, "max_tokens": 1, "temperature": 0}
        out = http(self.url + "/v1/completions", {**body, "cache_salt": salt})
        assert out.get("kvmesh"), out
        return dict(out["kvmesh"])

    def close(self) -> None:
        stop(self.proc)


# -- the bare library path (a child process) -------------------------------------


class BareChild:
    """``ttft.py --library-child``: a process that never called prepare_process
    nor ready(), hitting through a new ``HeadRuntime`` each time (one JSON line
    a command on its stdin, one answer a line on its stdout)."""

    def __init__(self, args: argparse.Namespace) -> None:
        err = None if os.environ.get("KVMESH_BENCH_VERBOSE") else subprocess.DEVNULL
        self.proc = popen(
            [sys.executable, str(Path(__file__).resolve()), "--library-child"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=err,
            text=True,
        )
        self.args = args

    def send(self, **cmd: Any) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()

    def answer(self, timeout_s: float = HEAD_START_S) -> dict[str, Any]:
        assert self.proc.stdout is not None
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout_s)
        line = self.proc.stdout.readline() if ready else ""
        if not line:
            raise RuntimeError("the bare library child did not answer")
        out = json.loads(line)
        if "error" in out:
            raise RuntimeError(f"the bare library child: {out['error']}")
        return dict(out)

    def load(self, model: str, key_file: str) -> None:
        """Load ``model`` (answered later: :meth:`answer`)."""
        a = self.args
        self.send(
            op="load",
            model=model,
            device=a.device,
            dtype=a.dtype,
            threads=a.threads,
            key_file=key_file,
        )

    def teach(self, colds: dict[int, float]) -> None:
        """Its planner learns these cold prefills (answered later: :meth:`answer`)."""
        self.send(op="teach", colds=colds)

    def hit(self, peer: str, toks: list[int], salt: str) -> dict[str, Any]:
        self.send(op="hit", peer=peer, tokens=toks, salt=salt)
        return self.answer()


def child_main() -> None:
    """The bare child's loop (see :class:`BareChild`)."""
    engine: Any = None
    planner, security = Planner(), Security()
    for line in sys.stdin:
        cmd = json.loads(line)
        try:
            if cmd["op"] == "load":
                engine = None
                gc.collect()
                engine = load_engine(
                    cmd["model"], device=cmd["device"], dtype=cmd["dtype"], threads=cmd["threads"]
                )
                engine.prefill(list(range(16)))
                planner, security = Planner(), read_key(cmd["key_file"])
                out: dict[str, Any] = {"ok": True}
            elif cmd["op"] == "teach":
                for n, s in cmd["colds"].items():
                    planner.observe_prefill(int(n), s)
                out = {"ok": True}
            else:
                head = fresh_head(engine, cmd["peer"], security, planner)
                try:
                    out = report_of(complete(head, cmd["tokens"], cmd["salt"]))
                finally:
                    close(head)
        except Exception as e:  # the parent says what failed
            out = {"error": repr(e)}
        print(json.dumps(out), flush=True)


def file_cache(  # type: ignore[type-arg]
    args: argparse.Namespace, model: str, live: KVState, n: int, ext: list[int]
) -> dict:
    """The file prompt cache: this process saves the prompt's KV, a fresh one loads it."""
    row = {}
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "prompt.safetensors")
        save_file(
            {
                **{
                    f"k{i}": lay.keys[:, :, :n].contiguous().cpu()
                    for i, lay in enumerate(live.cache.layers)
                },
                **{
                    f"v{i}": lay.values[:, :, :n].contiguous().cpu()
                    for i, lay in enumerate(live.cache.layers)
                },
                "logits": live.logits.cpu(),
            },
            path,
        )
        out = subprocess.run(
            [
                sys.executable,
                str(HERE / "_filecache.py"),
                model,
                args.device,
                path,
                str(n),
                json.dumps(ext),
                args.dtype or "",
            ],
            capture_output=True,
            text=True,
            check=True,
        )
        fc = json.loads(out.stdout.strip().splitlines()[-1])
    row["file_cache_s"], row["file_cache_extend_s"] = fc["read"], fc["read_extend"]
    row["file_cache_mmap_s"], row["file_cache_mmap_extend_s"] = fc["lazy"], fc["lazy_extend"]
    if "cold" in fc:
        row["file_cache_cold_s"] = fc["cold"]
    return row


def file_cache_skipped(card: CompatCard) -> str | None:
    """Why ``_filecache.py`` cannot restore this model's cache (None: it can)."""
    if not card.uniform:
        kinds = sorted({g.kind for g in card.geometry} - {"kv"})
        return (
            "left out: _filecache.py restores full-attention caches of one geometry; "
            f"this model has per-layer geometry ({', '.join(kinds) or 'mixed KV shapes'})"
        )
    if any(card.sliding_windows):
        return "left out: _filecache.py restores full-attention caches only (sliding layers)"
    return None


def parameters(model: str) -> int:
    from safetensors import safe_open

    from kvmesh.engine.embedded import resolve_model

    total = 0
    for f in sorted(resolve_model(model).rglob("*.safetensors")):
        with safe_open(str(f), "pt") as st:
            for k in st.keys():  # noqa: SIM118 (a safe_open handle is not a mapping)
                n = 1
                for d in st.get_slice(k).get_shape():
                    n *= d
                total += n
    return total


def baselines(args: argparse.Namespace, engine, model: str, live: KVState, n: int) -> dict:  # type: ignore[no-untyped-def, type-arg]
    """What earlier runs of this benchmark set beside kvmesh (``--baselines``): the
    in-process floor (the live cache of the same prompt) and, for a model whose
    every layer is full attention of one geometry, the file prompt cache."""
    row: dict[str, Any] = {
        "inprocess_s": min(
            timed(lambda: engine.sample(live.logits, ONE, None), args.device) for _ in range(5)
        )
    }
    skipped = file_cache_skipped(engine.card)
    if skipped is None:
        row.update(file_cache(args, model, live, n, tokens(engine, 64, f"ext{n}")))
    else:
        row["file_cache"] = skipped
    return row


# -- one model -------------------------------------------------------------------


@dataclass
class Bench:
    """What a run shares between its models."""

    args: argparse.Namespace
    links: list[Link]
    key_file: str
    security: Security
    publisher: NodeThread
    child: BareChild

    def publish(self, card: CompatCard, address: str, blocks: list[Any]) -> None:
        target = card_of(self.publisher, address)
        assert target is not None, address
        self.publisher.call(self.publisher.node.client.publish(target, card, blocks))

    def publish_all(self, engine, state: KVState, suffix: str = "") -> int:  # type: ignore[no-untyped-def]
        """``state``'s blocks on every link's peer, under the link's salt (+
        ``suffix``): the blob bytes of one link's copy."""
        card = engine.card
        keyer = BlockKeyer(card.namespace, card.block_tokens, self.security.block_hash_key)
        nbytes = 0
        for link in self.links:
            root = request_root(card.namespace, None, link.salt + suffix)
            assert root is not None
            blocks = engine.export(state, keyer.rooted(root, caller_key(CALLER)))
            self.publish(card, link.address, blocks)
            nbytes = sum(b.nbytes for b in blocks)
        return nbytes


@dataclass
class Model:
    """One model's prompts and cold times, and the consumers that hit them."""

    name: str
    path: str
    engine: Any = None
    prompts: dict[int, list[int]] = field(default_factory=dict)
    colds: dict[int, float] = field(default_factory=dict)
    blob_bytes: dict[int, int] = field(default_factory=dict)
    extra: dict[int, dict[str, Any]] = field(default_factory=dict)
    learn: list[int] = field(default_factory=list)
    lib: HeadRuntime | None = None
    forced: HeadRuntime | None = None
    computing: HeadRuntime | None = None
    head: HeadProc | None = None
    untrimmed: HeadProc | None = None

    @property
    def sliding(self) -> bool:
        return any(self.engine.card.sliding_windows)


def maybe_sliding(path: str) -> bool:
    """Whether the model's config may give it sliding-window layers (before it
    loads; its card decides: an untrimmed head started for nothing is stopped)."""
    from kvmesh.engine.embedded import resolve_model

    try:
        cfg = json.loads((resolve_model(path) / "config.json").read_text())
    except (OSError, ValueError):
        return True
    cfg = cfg.get("text_config", cfg)
    return "sliding_attention" in (cfg.get("layer_types") or []) or bool(
        cfg.get("use_sliding_window", "sliding_window" in cfg and cfg["sliding_window"])
    )


def load(bench: Bench, m: Model, first: bool) -> None:
    """Start the head process(es) and the child's load of the model, load it here
    meanwhile; once they are up (idle), time its cold prefills and publish every
    prompt on every link."""
    a = bench.args
    m.head = HeadProc(a, m.path, bench.links, bench.key_file, trim=True)
    if node_option("no_window_trim") and maybe_sliding(m.path):
        m.untrimmed = HeadProc(a, m.path, bench.links, bench.key_file, trim=False)
    bench.child.load(m.path, bench.key_file)
    engine = m.engine = load_engine(
        m.path, device=a.device, dtype=a.dtype, threads=a.threads or None
    )
    engine.prefill(list(range(16)))
    settle_process(engine, first)
    say(engine.card.summary())
    if m.untrimmed is not None and not m.sliding:  # nothing to trim after all
        m.untrimmed.close()
        m.untrimmed = None
    m.head.started()
    fail_point("head")
    if m.untrimmed is not None:
        m.untrimmed.started()
    bench.child.answer()
    say("the head process(es) and the bare child are up")
    lengths = [int(x) for x in a.lengths.split(",")]
    for n in lengths:
        toks = m.prompts[n] = tokens(engine, n, f"len{n}")
        state: KVState | None = None

        def cold() -> None:
            nonlocal state
            state = engine.prefill(toks)  # noqa: B023 (called here, in this iteration)
            engine.sample(state.logits, ONE, None)

        m.colds[n] = best_of(lambda: timed(cold, a.device))
        assert state is not None
        if a.baselines:
            m.extra[n] = baselines(a, engine, m.path, state, n)
        m.blob_bytes[n] = bench.publish_all(engine, state)
        say(f"{n:6d} tok  cold {m.colds[n]:.3f}s  published")
    m.learn = tokens(engine, min(LEARN_TOKENS, min(lengths)), "learn")
    bench.publish_all(engine, engine.prefill(m.learn), "/learn")


def best_of(measure: Callable[[], float], within_s: float = 2.0) -> float:
    """The fastest of three runs where the first took under ``within_s`` (a first
    run at a new size pays one-time costs a short prefill cannot hide), else the one."""
    first = measure()
    return first if first >= within_s else min(first, measure(), measure())


_READY = {"process": False}


def settle_process(engine, first: bool) -> None:  # type: ignore[no-untyped-def]
    """This process as a head's (see ``prepare``): the first model gets ready()'s
    process-wide part; a later one's objects are frozen as a head freezes its model's
    (ready() does that part once per process)."""
    try:
        from kvmesh.runtime.ready import ready
    except ImportError:
        return
    if first or not _READY["process"]:
        ready(engine, None, None)
        _READY["process"] = True
    else:
        gc.collect()
        gc.freeze()


def start_consumers(bench: Bench, m: Model) -> None:
    """The library heads (made ready) and the child's planner taught this machine's
    prefill speed, as a head that served such prompts would know it; the head
    processes seeing every link's peer."""
    bench.child.teach(m.colds)
    planner = Planner()
    for n, s in m.colds.items():
        planner.observe_prefill(n, s)
    m.lib = library_head(m.engine, bench.links, bench.security, planner, "bench-library")
    # KVMESH_BENCH_FAIL=forced-fetch: its fetches overrun a deadline no fetch meets
    # (the tests' way to a forced fetch that computes: a failed row, a non-zero exit)
    deadline = 1e-6 if os.environ.get(FAIL_ENV) == "forced-fetch" else FETCH_DEADLINE_S
    m.forced = library_head(
        m.engine, bench.links, bench.security, forced_planner(), "bench-forced", deadline
    )
    computing = Planner(force="compute")
    m.computing = library_head(m.engine, bench.links, bench.security, computing, "bench-computing")
    for head in (m.lib, m.forced, m.computing):
        get_ready(head)
    for proc in (m.head, m.untrimmed):
        if proc is not None:
            proc.connected()
    bench.child.answer()
    say("every consumer sees every link's peer")


def stop_consumers(m: Model) -> None:
    for head in (m.lib, m.forced, m.computing):
        if head is not None:
            close(head)
    for proc in (m.head, m.untrimmed):
        if proc is not None:
            proc.close()
    m.lib = m.forced = m.computing = m.head = m.untrimmed = None


def learn_link(bench: Bench, m: Model, link: Link) -> None:
    """Every consumer's first fetch over ``link``: a prompt of its own salt."""
    salt = link.salt + "/learn"
    assert m.lib is not None and m.forced is not None and m.head is not None
    for lib in (m.lib, m.forced, m.computing):  # the computing one: its first compute
        if lib is not None:
            complete(lib, m.learn, salt)
    bench.child.hit(link.address, m.learn, salt)
    for head in (m.head, m.untrimmed):
        if head is not None:
            head.hit(m.learn, salt)


def measure_model(bench: Bench, name: str, path: str, first: bool) -> tuple[list[dict], dict]:  # type: ignore[type-arg]
    say(f"== {name}")
    m = Model(name, path)
    rows = []
    try:
        load(bench, m, first)
        start_consumers(bench, m)
        for link in bench.links:
            learn_link(bench, m, link)
            say(f"{link.name}: every consumer fetched once (learning the link)")
            for n in m.prompts:
                row = measure_row(bench, m, link, n)
                rows.append(row)
                print_row(row)
    finally:
        stop_consumers(m)
    card = m.engine.card
    meta = {
        "model": name,
        "path": path,
        "parameters": parameters(path),
        "card": card.summary(),
        "layer_geometry": list(card.layer_geometry),
        "sliding_windows": [g.window for g in card.geometry],
        "kv_dtype": card.kv_dtype,
        "block_tokens": card.block_tokens,
        "card_bytes_per_token": card.kv_bytes_per_token,
        "untrimmed_head": m.sliding and node_option("no_window_trim"),
    }
    m.engine = None
    gc.unfreeze()  # the next model's objects are frozen in their turn (settle_process)
    gc.collect()
    return rows, meta


# -- one row -----------------------------------------------------------------------


def counted(bench: Bench, link: Link, hit: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """``hit()``'s report, with the bytes it moved over ``link`` (``bytes_sent``,
    ``bytes_sent_by``, and each count taken as ``bytes_counted_<where>``)."""
    before = link.received()
    peer_before = served(bench.publisher, link.address) if before is None else 0
    report = hit()
    counts: dict[str, int] = {}
    if before is not None:
        counts["veth"] = link.received() - before  # type: ignore[operator]
    else:
        counts["peer"] = served(bench.publisher, link.address) - peer_before
    if isinstance(report.get("bytes_wire"), int) and report["source"] == "remote":
        counts["report"] = report["bytes_wire"]  # the head's transport's count of frame bytes
    by = next(k for k in ("veth", "report", "peer") if k in counts)
    out = {**report, "bytes_sent": counts[by], "bytes_sent_by": by}
    return out | {f"bytes_counted_{k}": v for k, v in counts.items()}


def paths(bench: Bench, m: Model, link: Link, toks: list[int]) -> dict[str, Callable[[], Any]]:
    """Each way to the hit, as a call returning its ``kvmesh`` report."""
    assert m.lib is not None and m.forced is not None and m.head is not None
    assert m.computing is not None
    lib, forced, computing, head, salt = m.lib, m.forced, m.computing, m.head, link.salt
    out: dict[str, Callable[[], Any]] = {
        "library_remote_s": lambda: report_of(complete(lib, toks, salt)),
        "fetch_forced_s": lambda: report_of(complete(forced, toks, salt)),
        "compute_forced_s": lambda: report_of(complete(computing, toks, salt)),
        "library_bare_s": lambda: bench.child.hit(link.address, toks, salt),
        "head_remote_s": lambda: head.hit(toks, salt),
    }
    if m.untrimmed is not None:
        untrimmed = m.untrimmed
        out["untrimmed_remote_s"] = lambda: untrimmed.hit(toks, salt)
    return out


def rounds(bench: Bench, m: Model, link: Link, toks: list[int]) -> dict[str, Any]:
    """Every path once per round, so a noisy moment costs all of them alike; more
    rounds (``--repeats``) when the first took under :data:`REPEAT_UNDER_S` each:
    {path: (median seconds, its first report)}; the heads' first hits count bytes."""
    calls = paths(bench, m, link, toks)
    first: dict[str, dict[str, Any]] = {}
    for name, call in calls.items():
        heads = name in ("head_remote_s", "untrimmed_remote_s")
        first[name] = counted(bench, link, call) if heads else call()
    times = {name: [float(r["ttft_s"])] for name, r in first.items()}
    more = bench.args.repeats - 1 if max(t[0] for t in times.values()) < REPEAT_UNDER_S else 0
    for _ in range(more):
        for name, call in calls.items():
            times[name].append(float(call()["ttft_s"]))
    return {name: (statistics.median(times[name]), first[name]) for name in calls} | {
        "repeats": 1 + more
    }


def measure_row(bench: Bench, m: Model, link: Link, n: int) -> dict[str, Any]:
    card = m.engine.card
    row: dict[str, Any] = {
        "model": m.name,
        "prompt_tokens": n,
        "link": link.name,
        "shaper": link.shaper,
        "sliding": m.sliding,
        "kv_bytes": n * card.kv_bytes_per_token,
        "blob_bytes": m.blob_bytes[n],
        "cold_s": m.colds[n],
    }
    got = rounds(bench, m, link, m.prompts[n])
    row["repeats"] = got.pop("repeats")
    row.update({name: t for name, (t, _) in got.items()})
    lib, forced, head = (got[k][1] for k in ("library_remote_s", "fetch_forced_s", "head_remote_s"))
    row["library_source"], row["planner_choice"] = lib["source"], choice_of(lib)
    row["planner"], row["fetch_forced_source"] = lib.get("planner"), forced["source"]
    if forced["source"] != "remote":  # the forced path computed: every ratio beside it is void
        row["failed"] = (
            f"fetch_forced_s computed ({forced['source']}): "
            f"{forced.get('fallback') or 'no fallback reason in its report'}"
        )
    row["head_source"], row["head_planner_choice"] = head["source"], choice_of(head)
    row["reused_tokens"] = head["reused_tokens"]
    row["bytes_sent"], row["bytes_sent_by"] = head["bytes_sent"], head["bytes_sent_by"]
    row.update({k: v for k, v in head.items() if k.startswith("bytes_counted_")})
    row["library_breakdown_ms"] = ms(lib.get("breakdown"))
    row["head_breakdown_ms"] = ms(head.get("breakdown"))
    for key in ("bytes_fetched", "bytes_wire", "trimmed", "codec", "fallback"):
        if key in head:
            row[f"head_{key}"] = head[key]
    row["codec"] = head.get("codec") or "raw"
    row["untrimmed_measured"] = "untrimmed_remote_s" in got
    if row["untrimmed_measured"]:
        ref = got["untrimmed_remote_s"][1]
        row["bytes_sent_untrimmed"] = ref["bytes_sent"]
        row["untrimmed_source"], row["untrimmed_codec"] = ref["source"], ref.get("codec") or "raw"
    else:  # nothing to trim (or no --no-window-trim here): the head's path is the reference
        row["untrimmed_remote_s"], row["bytes_sent_untrimmed"] = (
            row["head_remote_s"],
            head["bytes_sent"],
        )
    if link.name == "loopback":
        row.update(m.extra.get(n, {}))
    return derive(row)


def ms(stages: Any) -> dict[str, float]:
    """A report's breakdown (seconds per stage to the first token) in ms."""
    return {k: round(v * 1e3, 3) for k, v in (stages or {}).items()}


def derive(row: dict[str, Any]) -> dict[str, Any]:
    """The ratios the checks read."""
    best = min(row["fetch_forced_s"], row.get("compute_forced_s", row["cold_s"]))
    row["planner_regret"] = row["library_remote_s"] / best
    row["library_vs_head"] = row["library_remote_s"] / row["head_remote_s"]
    row["bare_vs_head"] = row["library_bare_s"] / row["head_remote_s"]
    row["speedup_vs_cold"] = row["cold_s"] / row["head_remote_s"]
    if row["bytes_sent_untrimmed"]:
        row["trimmed_share"] = row["bytes_sent"] / row["bytes_sent_untrimmed"]
    row["untrimmed_vs_trimmed"] = row["untrimmed_remote_s"] / row["head_remote_s"]
    return row


def print_row(r: dict[str, Any]) -> None:
    say(
        f"{r['model']:>14s} {r['prompt_tokens']:6d} {r['link']:>8s}/{r['shaper']:4s} "
        f"cold {r['cold_s']:.3f}s  head {r['head_remote_s'] * 1e3:.1f}ms "
        f"({r['head_source']})  library {r['library_remote_s'] * 1e3:.1f}ms "
        f"(x{r['library_vs_head']:.2f}, {r['planner_choice']})  bare "
        f"{r['library_bare_s'] * 1e3:.1f}ms  forced {r['fetch_forced_s'] * 1e3:.1f}ms  "
        f"untrimmed {r['untrimmed_remote_s'] * 1e3:.1f}ms  sent "
        f"{r['bytes_sent'] / 1e6:.2f}/{r['bytes_sent_untrimmed'] / 1e6:.2f} MB "
        f"({r['bytes_sent_by']}) of kv {r['kv_bytes'] / 1e6:.2f} MB  "
        f"regret {r['planner_regret']:.2f}"
    )


# -- the checks ------------------------------------------------------------


def checks(results: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Each done-when target read off the rows (a row missing: not listed)."""
    out: dict[str, dict[str, Any]] = {}

    def put(name: str, r: dict[str, Any], value: float, at_most: bool) -> None:
        target = CHECKS[name]
        ok = value <= target if at_most else value >= target
        at = name.replace("_100mbit", f"_{r['prompt_tokens']}_100mbit")
        out[f"{r['model']}:{at}"] = {
            "value": round(value, 3),
            "target": f"{'<=' if at_most else '>='} {target}",
            "ok": ok,
        }

    for r in results:
        n, link = r["prompt_tokens"], r["link"]
        if n == 1024 and link == "loopback":
            put("library_vs_head_1024_loopback", r, r["library_vs_head"], True)
        if n == 4096 and link == "1gbit" and r["sliding"] and r["untrimmed_measured"]:
            put("trimmed_share_4096_1gbit", r, r["trimmed_share"], True)
            put("untrimmed_vs_trimmed_4096_1gbit", r, r["untrimmed_vs_trimmed"], False)
        if link == "100mbit":
            put("planner_regret_100mbit", r, r["planner_regret"], True)
    return out


def summarize(results: list[dict[str, Any]], found: dict[str, dict[str, Any]]) -> None:
    print("\nthe issue's checks:")
    if not found:
        print("  none of the rows they read was measured (1024/loopback, 4096/1gbit, 100mbit)")
    for name, c in found.items():
        print(f"  {'ok  ' if c['ok'] else 'MISS'} {name}: {c['value']} (target {c['target']})")


def model_list(args: argparse.Namespace) -> list[tuple[str, str]]:
    """(label, path) of each model to run: the default pair (the demo, then the demo
    with sliding windows of 512), ``--model``'s, or their ``--sliding-window`` copies."""
    if args.smoke and args.model:  # a smoke run of one model (a test's failure on purpose)
        return [(label(n), resolve(n)) for n in args.model.split(",")]
    if args.smoke:
        tiny = resolve("demo-tiny")
        return [("demo-tiny", tiny), ("demo-tiny-swa16", sliding_variant(tiny, 16))]
    if args.model is None and not args.sliding_window:
        demo = resolve("demo")
        return [("demo", demo), ("demo-swa512", sliding_variant(demo, 512))]
    names = (args.model or "demo").split(",")
    if args.sliding_window:
        w = args.sliding_window
        return [(f"{label(n)}-swa{w}", sliding_variant(resolve(n), w)) for n in names]
    return [(label(n), resolve(n)) for n in names]


def prepare() -> bool:
    """This process as a head is, before any model loads (one heap); False on a
    checkout without runtime/ready (the library path then gets the head's warm-up)."""
    try:
        from kvmesh.runtime.ready import prepare_process
    except ImportError:
        return False
    prepare_process()
    return True


def parse() -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--json", default="bench/results/ttft.json")
    ap.add_argument("--lengths", default="1024,4096,16384")
    ap.add_argument("--links", default=",".join(LINKS), help=f"some of {', '.join(LINKS)}")
    ap.add_argument(
        "--shaper",
        choices=("auto", "tbf", "pace"),
        default="auto",
        help="how shaped links are made: tbf (network namespaces, root), pace (the peer's "
        "--serve-rate); auto: tbf where it works",
    )
    ap.add_argument(
        "--model",
        default=None,
        help="comma-separated: a model directory, a demo name, or shape:gemma4|qwen3_5|attention "
        "(default: demo, then demo with --sliding-window 512)",
    )
    ap.add_argument("--device", default="cpu")
    ap.add_argument(
        "--dtype",
        default=None,
        help="float32 | float16 | bfloat16 (default: the model's on GPU, float32 on CPU)",
    )
    ap.add_argument(
        "--sliding-window",
        type=int,
        default=0,
        help="run on --model's weights with Gemma-3's sliding/full layer pattern",
    )
    ap.add_argument(
        "--threads",
        type=int,
        default=0,
        help="torch threads (0: torch's default); children get OMP_NUM_THREADS",
    )
    ap.add_argument(
        "--netns",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="shape links with tbf in network namespaces where they work (root)",
    )
    ap.add_argument("--repeats", type=int, default=3, help="hits per figure under 1 s (median)")
    ap.add_argument(
        "--baselines",
        action="store_true",
        help="loopback rows: also the in-process floor and a file prompt cache",
    )
    ap.add_argument(
        "--smoke",
        action="store_true",
        help="CI: demo-tiny and its --sliding-window 16 copy (or --model's), 64 tokens, loopback, a paced "
        "100mbit link and (root) a tbf 1gbit one",
    )
    ap.add_argument(
        "--plot-only", metavar="JSON", help="draw the PNG beside an earlier run's JSON, run nothing"
    )
    ap.add_argument("--library-child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.smoke:  # the page cache is the whole machine's: a smoke run leaves it alone
        os.environ["KVMESH_BENCH_NO_DROP_CACHES"] = "1"
        args.lengths, args.repeats, args.baselines = "64", 1, True
    if args.threads:  # on a loaded 2-core machine one thread is often faster (see the docs)
        os.environ["OMP_NUM_THREADS"] = str(args.threads)
    return args


def main() -> None:
    args = parse()
    if args.library_child:
        child_main()
        return
    if args.plot_only:
        draw(json.loads(Path(args.plot_only).read_text())["results"], args)
        return
    prepared = prepare()
    models = model_list(args)
    netns = args.netns and netns_works()
    key_file, security = fleet_key(own_tempdir("keys"))
    links = open_links(link_plan(args, netns), key_file)
    say(f"links up: {', '.join(f'{link.name} ({link.shaper})' for link in links)}")
    publisher = NodeThread(
        NodeConfig(
            seeds=[link.address for link in links],
            gossip_interval=GOSSIP_S,
            alias="bench-publisher",
            security=security,
        )
    )
    bench = Bench(args, links, key_file, security, publisher, BareChild(args))
    runs, results = [], []
    try:
        wait_for(
            lambda: all(card_of(publisher, link.address) for link in links), 30, "the link peers"
        )
        for i, (name, path) in enumerate(models):
            rows, meta = measure_model(bench, name, path, first=i == 0)
            runs.append(meta)
            results += rows
    finally:
        publisher.close()
    say("measured; stopping the peers")
    found = checks(results)
    out = {
        "machine": machine(),
        "device": args.device,
        "torch_threads": args.threads or torch.get_num_threads(),
        "fleet_key": True,
        "lengths": [int(x) for x in args.lengths.split(",")],
        "links": [{"link": link.name, "shaper": link.shaper} for link in links],
        "window_trim": node_option("no_window_trim"),
        "serve_rate": node_option("serve_rate"),
        "prepared": prepared,
        "runs": runs,
        "results": results,
        "checks": found,
    }
    with open(args.json, "w") as fh:
        json.dump(out, fh, indent=1)
    summarize(results, found)
    draw(results, args)
    failed = [r for r in results if r.get("failed")]
    if failed:  # a figure that did not measure what it names is no figure
        raise SystemExit(
            f"{len(failed)} row(s) failed: "
            + "; ".join(
                f"{r['model']} {r['prompt_tokens']} {r['link']}: {r['failed']}" for r in failed
            )
        )


def draw(results: list[dict[str, Any]], args: argparse.Namespace) -> None:
    """The PNG beside the JSON: per model, TTFT against prompt length, cold and the
    head's hit on each link (matplotlib, the ``bench`` extra; without it, none)."""
    path = Path(args.plot_only or args.json).with_suffix(".png")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no PNG (pip install matplotlib; --plot-only)")
        return
    results = [  # a JSON of this benchmark before issue #41: its loopback hit
        {"link": "loopback", "head_remote_s": r.get("kvmesh_remote_s"), **r} for r in results
    ]
    models = list(dict.fromkeys(r.get("model", "demo") for r in results))
    fig, axes = plt.subplots(1, len(models), figsize=(6 * len(models), 4.2), squeeze=False)
    for ax, model in zip(axes[0], models, strict=True):
        rows = [r for r in results if r.get("model", "demo") == model]
        links = list(dict.fromkeys(r["link"] for r in rows))
        cold = {r["prompt_tokens"]: r["cold_s"] for r in rows}
        ax.plot(list(cold), list(cold.values()), "k--", marker="o", label="cold prefill")
        for i, link in enumerate(links):
            pts = [r for r in rows if r["link"] == link]
            n = [r["prompt_tokens"] for r in pts]
            ax.plot(n, [r["head_remote_s"] for r in pts], marker="o", color=f"C{i}", label=link)
            if any(r.get("untrimmed_measured") for r in pts):
                ax.plot(n, [r["untrimmed_remote_s"] for r in pts], ":", color=f"C{i}")
        ax.set_title(f"{model}: head hit per link (dotted: --no-window-trim)")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("prompt tokens")
        ax.set_ylabel("time to first token (s)")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"plot: {path}")


if __name__ == "__main__":
    if "--library-child" in sys.argv:  # not run_main: its parent owns the cleanup
        main()
    else:
        run_main(main)
