"""Time to first token: kvmesh against what users do today, side by side in one run.

    python bench/ttft.py --json bench/results/ttft.json [--lengths 128,512,1024,2048,4096]
                         [--model demo] [--device cpu|cuda] [--dtype bfloat16]
                         [--sliding-window 128]
    python bench/ttft.py --smoke --json /tmp/ttft.json   # CI: demo-tiny, 64 tokens
    GPU: python bench/ttft.py --device cuda --model demo-8b --lengths 1024,4096,16384
    Today's models: python bench/ttft.py --model shape:gemma4,shape:qwen3_5,shape:attention \
                         --lengths 1024,2048,4096,8192 --json bench/results/ttft_today.json

For each prompt length, on the ~0.5B-shaped demo model:
  cold_s            cold local prefill, the engine's best path (inference mode,
                    logits of the last position only) + first token
  inprocess_s       in-process reuse, the floor: the live cache of the same prompt
  file_cache_s      a file-based prompt cache (KV + logits in safetensors, written by
                    this process, read into the cache by a fresh one: llama.cpp's slot
                    save/restore and mlx-lm's save/load_prompt_cache pattern); also
                    file_cache_mmap_s (left memory-mapped, the KV is not read before the
                    first token of an exact repeat) and file_cache_cold_s (page cache
                    dropped first; root only)
  kvmesh_remote_s   a kvmesh head with an empty store, remote hit from a real peer
                    process over loopback (lookup, fetch, BLAKE3, import)
  kvmesh_netns_<rate>_s  the same from a peer in another network namespace over a
                    veth link capped with tbf (10 and 40 Gbit/s; root only)
  *_extend_s        the same for the cached prompt plus 64 new tokens
Prompt lengths are multiples of the 32-token block, so the extension reuses the
whole prompt; other lengths recompute up to 31 more tokens.

``--sliding-window W`` runs on a copy of ``--model`` whose config gives its layers
Gemma-3's pattern (five sliding-window layers of W tokens per full-attention
layer), the same weights: a sliding-window model of exactly the full model's size,
to compare the two JSON files side by side. Its file-cache baseline is left out
(``_filecache.py`` restores full-attention caches only).

``--model`` takes a comma-separated list (one peer, publisher and set of heads per
model, run one after the other; the JSON then lists every model under ``runs`` and
every row, tagged with its model, under ``results``). Besides a model directory or
a demo name, ``shape:NAME`` is a random-weight model of a today's architecture at
a bench scale (hidden 512, 12-14 layers, ~63M parameters, float32 ~0.25 GB), built
once under ``$KVMESH_HOME/bench-models`` with the tiny zoo model's tokenizer
(``tests/zoo.py``; see ``SHAPES``): ``gemma4`` (Gemma 4's layout: five sliding
layers of 512 tokens per full one, per-layer head dims, KV shared by the last
layers, per-layer inputs), ``qwen3_5`` (Qwen3.5's: three Gated-DeltaNet layers per
gated full-attention one) and ``attention`` (a Qwen3-shaped full-attention model
of similar size, to set beside them).

Per point, besides the times: what the exact-repeat remote hit shipped, counted
header by header over the blocks it fetched (``Block.header.kv_bytes`` /
``state_bytes``; ``bytes_fetched`` is the wire's count, logits and headers
included), per prompt token, and the tokens each hit reused: a model with
recurrent layers (``state_every`` > 0) imports up to its last state checkpoint
and computes the rest, so the extension's hit may reuse less than the prompt.
The file-cache baseline runs only on a model whose every layer holds
full-attention KV of one geometry (``_filecache.py`` restores just that); for any
other the output says it is left out, and why.

The fleet runs the secure path: a fleet key generated for the run (a file in a
temp dir) authenticates every call and keys the block hashes; the namespace's peer
listens off loopback, so it needs one. Peers and namespaces are removed on any exit.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from _common import (
    fail_point,
    machine,
    own_link,
    own_netns,
    run_main,
    spawn_kvmesh,
    spawn_peer,
    stop,
    wait_for,
)
from safetensors.torch import save_file

from kvmesh.blocks import BlockKeyer
from kvmesh.compat import CompatCard
from kvmesh.engine import KVState, Sampling, load_engine
from kvmesh.mesh.node import NodeConfig, NodeThread
from kvmesh.mesh.security import Security
from kvmesh.runtime.head import HeadRuntime

ONE = Sampling(max_tokens=1)
EXT = 64
HERE = Path(__file__).resolve().parent


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
    from kvmesh.engine.demo import kvmesh_home
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

    from kvmesh.engine.demo import resolve_model

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
    with open(path, "rb") as f:
        return path, Security(fleet_key=f.read().strip())


def fresh_head(engine, peer: str, ns_hex: str, security: Security) -> HeadRuntime:  # type: ignore[no-untyped-def]
    node = NodeThread(
        NodeConfig(
            seeds=[peer],
            gossip_interval=0.2,
            ttl=5,
            alias=f"bench-{time.time_ns()}",
            security=security,
        )
    )
    head = HeadRuntime(
        engine, node, max_sessions=0, publish=False, hash_key=security.block_hash_key
    )
    try:
        wait_for(
            lambda: any(ns_hex in c.namespaces for c in node.node.membership.live()),
            10,
            "the peer to advertise the namespace",
        )
    except BaseException:
        close(head)
        raise
    return head


def close(head: HeadRuntime) -> None:
    head.close()
    assert head.node is not None
    head.node.close()


class NetnsPeer:
    """A `kvmesh peer` in its own network namespace behind a veth link, under the
    fleet key (it listens off loopback). Names carry our pid, so runs do not collide;
    the namespace, the link and the peer are owned by `_common` and go on any exit."""

    HOST, PEER = "10.78.0.1", "10.78.0.2"

    def __init__(self, key_file: str) -> None:
        tag = f"kvmb{os.getpid()}"
        self.ns, self.host_if, self.peer_if = tag, tag + "h", tag + "p"
        self.address = f"{self.PEER}:7070"
        own_netns(self.ns)
        own_link(self.host_if, "type", "veth", "peer", "name", self.peer_if)
        run = lambda *c: subprocess.run(c, check=True, capture_output=True, timeout=30)  # noqa: E731
        run("ip", "link", "set", self.peer_if, "netns", self.ns)
        run("ip", "addr", "add", f"{self.HOST}/24", "dev", self.host_if)
        run("ip", "link", "set", self.host_if, "up")
        for c in (
            ["ip", "addr", "add", f"{self.PEER}/24", "dev", self.peer_if],
            ["ip", "link", "set", self.peer_if, "up"],
            ["ip", "link", "set", "lo", "up"],
        ):
            run("ip", "netns", "exec", self.ns, *c)
        fail_point("netns")
        self.proc, _ = spawn_kvmesh(
            "peer",
            "--listen",
            self.address,
            "--plaintext",
            "--fleet-key-file",
            key_file,
            "--budget",
            "8GiB",
            "--gossip-interval",
            "0.2",
            "--advertise",
            f"{self.address},interface=ethernet",
            pattern="listening",
            prefix=("ip", "netns", "exec", self.ns),
        )

    def shape(self, rate: str) -> None:
        """Cap the peer->head direction with a token bucket."""
        subprocess.run(
            [
                "ip",
                "netns",
                "exec",
                self.ns,
                "tc",
                "qdisc",
                "replace",
                "dev",
                self.peer_if,
                "root",
                "tbf",
                "rate",
                rate,
                "burst",
                "4mb",
                "latency",
                "50ms",
            ],
            check=True,
            timeout=30,
        )


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


def shipped(blocks, reused: int, tail: bool) -> dict[str, int]:  # type: ignore[no-untyped-def]
    """What a hit reusing ``reused`` tokens fetched of the published ``blocks``: the
    whole blocks up to it (and the tail, for an exact repeat), counted header by
    header: KV, recurrent state, checkpoints among them, and their blob bytes."""
    got = [
        b
        for b in blocks
        if b.header.start + b.header.tokens <= reused
        and (b.header.kind == "block" or (tail and b.header.start + b.header.tokens == reused))
    ]
    return {
        "kv": sum(b.header.kv_bytes for b in got),
        "state": sum(b.header.state_bytes for b in got),
        "checkpoints": sum(1 for b in got if b.header.state_bytes),
        "blobs": sum(b.nbytes for b in got),
    }


def parameters(model: str) -> int:
    from safetensors import safe_open

    from kvmesh.engine.demo import resolve_model

    total = 0
    for f in sorted(resolve_model(model).rglob("*.safetensors")):
        with safe_open(str(f), "pt") as st:
            for k in st.keys():  # noqa: SIM118 (a safe_open handle is not a mapping)
                n = 1
                for d in st.get_slice(k).get_shape():
                    n *= d
                total += n
    return total


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--json", default="bench/results/ttft.json")
    ap.add_argument("--lengths", default="128,512,1024,2048,4096")
    ap.add_argument(
        "--model",
        default="demo",
        help="comma-separated: a model directory, a demo name, or shape:gemma4|qwen3_5|attention",
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
        help="torch threads (0: torch's default); the file-cache process gets OMP_NUM_THREADS",
    )
    ap.add_argument(
        "--netns",
        action=argparse.BooleanOptionalAction,
        default=os.geteuid() == 0,
        help="also measure a peer in another network namespace (needs root)",
    )
    ap.add_argument(
        "--smoke", action="store_true", help="CI: demo-tiny, one 64-token prompt, every path once"
    )
    ap.add_argument(
        "--plot-only", metavar="JSON", help="draw the PNG beside an earlier run's JSON, run nothing"
    )
    args = ap.parse_args()
    if args.plot_only:
        done = json.loads(Path(args.plot_only).read_text())
        draw(done.get("runs") or [{"model": done["model"], "results": done["results"]}], args)
        return
    if args.smoke:  # the page cache is the whole machine's: a smoke run leaves it alone
        os.environ["KVMESH_BENCH_NO_DROP_CACHES"] = "1"
        args.model, args.lengths = "demo-tiny", "64"
    if args.threads:  # on a loaded 2-core machine one thread is often faster (see the docs)
        os.environ["OMP_NUM_THREADS"] = str(args.threads)
    models = [resolve(m) for m in args.model.split(",")]
    if args.sliding_window:
        models = [sliding_variant(m, args.sliding_window) for m in models]
    runs = []
    with tempfile.TemporaryDirectory(prefix="kvmesh-ttft-") as keys:
        key_file, security = fleet_key(keys)
        for name, model in zip(args.model.split(","), models, strict=True):
            print(f"== {name}", flush=True)
            rows, card = measure(args, model, key_file, security)
            skipped = file_cache_skipped(card)
            runs.append(
                {
                    "model": label(name),
                    "path": model,
                    "parameters": parameters(model),
                    "card": card.summary(),
                    "layer_geometry": list(card.layer_geometry),
                    "sliding_windows": [g.window for g in card.geometry],
                    "kv_dtype": card.kv_dtype,
                    "block_tokens": card.block_tokens,
                    "state_every": card.state_every,
                    "state_bytes_per_checkpoint": card.state_bytes,
                    "card_bytes_per_token": card.kv_bytes_per_token,
                    "file_cache": skipped or "measured",
                    "results": rows,
                }
            )
    out = {
        "machine": machine(),
        "model": args.model,
        "device": args.device,
        "extension_tokens": EXT,
        "torch_threads": args.threads or torch.get_num_threads(),
        "fleet_key": True,
        # one model: the keys its JSON always had
        **({k: runs[0][k] for k in ("card", "sliding_windows")} if len(runs) == 1 else {}),
        "runs": runs,
        "results": [{"model": r["model"], **row} for r in runs for row in r["results"]],
    }
    with open(args.json, "w") as fh:
        json.dump(out, fh, indent=1)
    if len(runs) > 1:
        summarize(runs)
    draw(runs, args)


def draw(runs: list[dict], args: argparse.Namespace) -> None:  # type: ignore[type-arg]
    """The PNG beside the JSON (matplotlib, the ``bench`` extra; without it, none)."""
    path = Path(args.plot_only or args.json).with_suffix(".png")
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        print("matplotlib is not installed: no PNG (pip install matplotlib; --plot-only)")
        return
    if len(runs) > 1:
        plot_models(runs, path)
    else:
        plot(runs[0]["results"], path, runs[0]["model"])
    print(f"plot: {path}")


def measure(
    args: argparse.Namespace, model: str, key_file: str, security: Security
) -> tuple[list[dict], CompatCard]:  # type: ignore[type-arg]
    engine = load_engine(model, device=args.device, dtype=args.dtype, threads=args.threads or None)
    engine.prefill(list(range(16)))
    card = engine.card
    skipped = file_cache_skipped(card)
    print(card.summary(), flush=True)
    if skipped:
        print(f"file-cache baseline {skipped}", flush=True)
    keyer = BlockKeyer(card.namespace, card.block_tokens, security.block_hash_key)
    proc, peer = spawn_peer(  # TCP on loopback, as its results always measured
        "--gossip-interval",
        "0.2",
        "--budget",
        "8GiB",
        "--fleet-key-file",
        key_file,
        "--no-local-socket",
    )
    publisher = NodeThread(
        NodeConfig(seeds=[peer], gossip_interval=0.2, alias="bench-publisher", security=security)
    )
    netns = NetnsPeer(key_file) if args.netns else None

    def publish_to(address: str, blocks) -> None:  # type: ignore[no-untyped-def]
        target = next(
            c
            for c in publisher.node.membership.live()
            if any(e.address == address for e in c.endpoints)
        )
        publisher.call(publisher.node.client.publish(target, card, blocks))

    if netns is not None:
        publisher.node.config.seeds.append(netns.address)
    rows = []
    try:
        time.sleep(0.5)
        for n in (int(x) for x in args.lengths.split(",")):
            toks = tokens(engine, n, f"len{n}")
            ext = tokens(engine, EXT, f"ext{n}")
            row: dict[str, float | int | bool] = {
                "prompt_tokens": n,
                "kv_bytes": n * card.kv_bytes_per_token,
            }
            state: KVState | None = None

            def cold() -> None:
                nonlocal state
                state = engine.prefill(toks)
                engine.sample(state.logits, ONE, None)

            row["cold_s"] = min(timed(cold, args.device) for _ in range(1 if n >= 2048 else 2))
            assert state is not None
            live = state
            row["inprocess_s"] = min(
                timed(lambda: engine.sample(live.logits, ONE, None), args.device) for _ in range(5)
            )

            def floor_extend() -> float:
                # extend() appends to the cache it is given (and, with recurrent layers,
                # drops the prompt end's off-grid state): each run extends its own fork
                own = engine.fork(live)
                return timed(
                    lambda: engine.sample(engine.extend(own, ext).logits, ONE, None), args.device
                )

            row["inprocess_extend_s"] = min(floor_extend() for _ in range(2))
            # publish the prompt's blocks to the peer, as a head would after answering
            blocks = engine.export(live, keyer)
            publish_to(peer, blocks)
            if skipped is None:
                row.update(file_cache(args, model, live, n, ext))
            # kvmesh: heads with empty stores, remote hits over loopback
            for key, prompt in (("kvmesh_remote_s", toks), ("kvmesh_extend_s", toks + ext)):
                head = fresh_head(engine, peer, card.namespace_hex, security)
                try:
                    g = head.complete(prompt, ONE)
                    assert g.report is not None and g.report.source == "remote", g.report
                    row[key] = g.ttft_s
                    exact = key == "kvmesh_remote_s"
                    got = shipped(blocks, g.report.reused_tokens, tail=exact)
                    pre = "" if exact else "extend_"
                    row[pre + "reused_tokens"] = g.report.reused_tokens
                    row[pre + "computed_tokens"] = g.report.computed_tokens
                    row[pre + "bytes_fetched"] = g.report.bytes_fetched
                    row[pre + "fetched_is_counted"] = got["blobs"] == g.report.bytes_fetched
                    row[pre + "shipped_kv_bytes"] = got["kv"]
                    row[pre + "shipped_state_bytes"] = got["state"]
                    row[pre + "state_checkpoints"] = got["checkpoints"]
                    if exact:
                        row["fetch_s"] = g.report.fetch_s
                        row["shipped_kv_bytes_per_token"] = round(got["kv"] / n, 1)
                        row["shipped_state_bytes_per_token"] = round(got["state"] / n, 1)
                        row["shipped_bytes_per_token"] = round((got["kv"] + got["state"]) / n, 1)
                        row["bytes_fetched_per_token"] = round(g.report.bytes_fetched / n, 1)
                finally:
                    close(head)
            if netns is not None:
                publish_to(netns.address, blocks)
                for rate in ("10gbit", "40gbit"):
                    netns.shape(rate)
                    head = fresh_head(engine, netns.address, card.namespace_hex, security)
                    try:
                        g = head.complete(toks, ONE)
                        assert g.report is not None and g.report.source == "remote", g.report
                        row[f"kvmesh_netns_{rate}_s"] = g.ttft_s
                    finally:
                        close(head)
            row["speedup_remote"] = row["cold_s"] / row["kvmesh_remote_s"]
            if "file_cache_s" in row:
                row["remote_vs_file"] = row["file_cache_s"] / row["kvmesh_remote_s"]
            row["extend_vs_floor"] = row["kvmesh_extend_s"] / row["inprocess_extend_s"]
            rows.append(row)
            print(
                f"{n:5d} tok  cold {row['cold_s']:.3f}s  in-proc {row['inprocess_s'] * 1e3:.2f}ms  "
                + (
                    f"file {row['file_cache_s'] * 1e3:.1f}ms  "
                    if "file_cache_s" in row
                    else "file -  "
                )
                + f"kvmesh {row['kvmesh_remote_s'] * 1e3:.1f}ms ({row['speedup_remote']:.0f}x cold"
                + (f", {row['remote_vs_file']:.2f}x file)  " if "remote_vs_file" in row else ")  ")
                + f"extend: kvmesh {row['kvmesh_extend_s'] * 1e3:.0f}ms vs floor "
                f"{row['inprocess_extend_s'] * 1e3:.0f}ms ({row['extend_vs_floor']:.2f}x, "
                f"reused {row['extend_reused_tokens']} of {n + EXT})  "
                f"shipped/token: KV {row['shipped_kv_bytes_per_token'] / 1024:.2f} KiB + "
                f"state {row['shipped_state_bytes_per_token'] / 1024:.2f} KiB"
                + "".join(
                    f"  netns {r}: {row[f'kvmesh_netns_{r}_s'] * 1e3:.1f}ms"
                    for r in ("10gbit", "40gbit")
                    if f"kvmesh_netns_{r}_s" in row
                ),
                flush=True,
            )
    finally:
        publisher.close()
        stop(proc)  # the namespace's peer, namespace and link: run_main
        if netns is not None:
            stop(netns.proc)
    return rows, card


def summarize(runs: list[dict]) -> None:  # type: ignore[type-arg]
    """The models side by side: speedup and what the exact-repeat hit shipped."""
    w = max(10, *(len(r["model"]) for r in runs))
    print(
        f"\n{'model':{w}s} params  tokens  cold      kvmesh    speedup  KV/tok     state/tok  "
        "total/tok  reused  extend reused"
    )
    for r in runs:
        for row in r["results"]:
            print(
                f"{r['model']:{w}s} {r['parameters'] / 1e6:5.1f}M  {row['prompt_tokens']:6d}  "
                f"{row['cold_s']:7.2f}s  {row['kvmesh_remote_s'] * 1e3:7.1f}ms  "
                f"{row['speedup_remote']:6.0f}x  "
                f"{row['shipped_kv_bytes_per_token'] / 1024:6.2f}KiB  "
                f"{row['shipped_state_bytes_per_token'] / 1024:6.2f}KiB  "
                f"{row['shipped_bytes_per_token'] / 1024:6.2f}KiB  "
                f"{row['reused_tokens']:6d}  {row['extend_reused_tokens']:6d}/"
                f"{row['prompt_tokens'] + EXT}"
            )
        if r["file_cache"] != "measured":
            print(f"{'':{w}s} file-cache baseline {r['file_cache']}")


def plot_models(runs: list[dict], path: Path) -> None:  # type: ignore[type-arg]
    """TTFT (cold and remote hit) and bytes shipped per prompt token, per model."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(11, 4.2))
    for i, r in enumerate(runs):
        rows, colour = r["results"], f"C{i}"
        n = [x["prompt_tokens"] for x in rows]
        ax.plot(n, [x["cold_s"] for x in rows], "--", marker="o", color=colour)
        ax.plot(n, [x["kvmesh_remote_s"] for x in rows], marker="o", color=colour, label=r["model"])
        kv = [x["shipped_kv_bytes_per_token"] / 1024 for x in rows]
        total = [x["shipped_bytes_per_token"] / 1024 for x in rows]
        if any(x["shipped_state_bytes"] for x in rows):
            bx.plot(n, total, marker="o", color=colour, label=f"{r['model']}: KV + state")
            bx.plot(n, kv, ":", marker=".", color=colour, label=f"{r['model']}: KV only")
        else:
            bx.plot(n, total, marker="o", color=colour, label=f"{r['model']}: KV")
    ax.set_title("TTFT: cold prefill (dashed), kvmesh remote hit (solid)")
    ax.set_yscale("log")
    ax.set_ylabel("time to first token (s)")
    bx.set_title("bytes shipped per prompt token (exact-repeat hit)")
    bx.set_ylabel("KiB / token")
    bx.set_ylim(bottom=0)
    for a in (ax, bx):
        a.set_xscale("log", base=2)
        a.set_xlabel("prompt tokens")
        a.grid(True, which="both", alpha=0.3)
        a.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def plot(rows: list[dict], path: Path, model: str = "demo") -> None:  # type: ignore[type-arg]
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    n = [r["prompt_tokens"] for r in rows]
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for key, label in (
        ("cold_s", "cold local prefill"),
        ("file_cache_s", "file prompt cache, read (fresh process)"),
        ("file_cache_mmap_s", "file prompt cache, mmap (fresh process)"),
        ("kvmesh_remote_s", "kvmesh remote hit (loopback)"),
        ("kvmesh_extend_s", "kvmesh hit + 64 new tokens"),
        ("inprocess_extend_s", "in-process + 64 new tokens (floor)"),
    ):
        if all(key in r for r in rows):
            ax.plot(n, [r[key] for r in rows], marker="o", label=label)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("prompt tokens")
    ax.set_ylabel("time to first token (s)")
    ax.set_title(f"TTFT on {'the ~0.5B demo model' if model == 'demo' else model}, 2-core CPU")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    run_main(main)
