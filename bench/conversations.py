"""Long conversations on one head: stalls, reuse and memory, sessions on and off.

    python bench/conversations.py --json bench/results/conversations.json [--model demo]
                                  [--budget 512MiB] [--kv-budget 1GiB] [--modes on,off]
    python bench/conversations.py --smoke --json /tmp/conversations.json   # CI: demo-tiny
    python bench/conversations.py --plot-only bench/results/conversations.json  # the PNG again

Issue #37 item 5. A real ``kvmesh head`` process per mode, the same script of
concurrent multi-turn chats against each:

- **on**: the head's defaults (a finished request's KV is kept as a session; the
  chat's next turn resumes it);
- **off**: the same head with sessions off (``--max-sessions 0``), so a turn
  reuses only the whole blocks the head stored.

Each chat is one API key (token-exact reuse is a key's own) and runs its turns one
after another, with a 3 s pause (the user's) between an answer and the next turn:
without it a sessions-off head has often not stored the last turn's blocks yet.
Turn k+1's messages are turn k's plus the assistant's streamed answer and a new
user message of 200 to 4,000 tokens (varied text, sized with the head's own
tokenizer), so every turn after the first is a resume. Some turns are *long
resumes* (a new message of at least ``--long`` tokens on a conversation already
going). Every request streams (``stream: true``, greedy, ``ignore_eos``) and the
arrival time of every SSE chunk is recorded; before each turn ``/v1/cache/query``
says which source the head will take the prefix from (the stream carries no
``kvmesh`` field) and the final usage event gives ``cached_tokens``.

Measured per mode:

- every stream's longest inter-token gap, and the longest gap of any *other*
  stream while a long resume was prefilling (between its request and its first
  token): what the issue's stall was (25.6 s and 33.5 s before resumes were
  chunked);
- TTFT per turn (median, p90; first turns, resumes, long resumes);
- reuse per turn: ``cached_tokens`` of ``prompt_tokens`` and the predicted source;
- the head's RSS (``VmRSS`` of ``/proc/<pid>/status``) every ~0.5 s from ready,
  through the load and an idle wait after the last request (idle RSS: the last
  sample), and its peak (``VmHWM``); against model + ``--budget`` + ``--kv-budget``
  (``/healthz``'s memory report when the head has one, else the weight files'
  size and the flags).

Targets (issue #37, reported, never enforced): the longest gap during long resumes
within 1.5x of the run without sessions; idle RSS after load within 1.5x of model
+ budgets. Writes JSON and a PNG beside it (matplotlib, the ``bench`` extra; without
it the PNG is skipped: ``--plot-only`` draws it later from the JSON). Every head
is stopped on every exit. Exits non-zero when a stream errs or does not decode the
tokens it asked for, or when the sessions-off head kept a session.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import select
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx
from _common import START_TIMEOUT_S, fail_point, machine, popen, run_main, stop

from kvmesh.units import parse_size

TARGET = 1.5  # the bar for both ratios


@dataclass
class Chat:
    start_s: float  # when its first turn is sent, after the run starts
    turns: list[tuple[int, int]]  # (new user tokens, max_tokens) per turn
    think_s: float = 0.0  # the user's pause between an answer and the next turn


@dataclass
class Size:
    model: str = "demo"
    budget: str = "512MiB"
    kv_budget: str = "1GiB"
    prefill_chunk: int = 512
    long: int = 2000  # a resume with a new message this long is a "long resume"
    idle_s: float = 6.0  # quiet after the last request before idle RSS is read
    sample_s: float = 0.5
    chats: list[Chat] = field(
        default_factory=lambda: [
            Chat(0.0, [(800, 32), (200, 32), (4000, 24)], think_s=3.0),
            Chat(1.0, [(300, 64), (2000, 24), (200, 32)], think_s=3.0),
            Chat(3.0, [(400, 48), (300, 64)], think_s=3.0),
        ]
    )


SMOKE = Size(
    model="demo-tiny",
    budget="64MiB",
    kv_budget="64MiB",
    prefill_chunk=128,
    long=600,
    idle_s=2.0,
    chats=[
        Chat(0.0, [(300, 8), (200, 8), (1200, 8)]),
        Chat(0.2, [(200, 24), (600, 8)]),
    ],
)

_VOCABULARY = (
    "the of and to in is was for on that with as by at from his her they have had "
    "river market winter garden signal copper lantern harbor meadow engine orchard "
    "thunder pocket silver ladder canvas shadow ticket marble bridge candle velvet "
    "spiral desert cobalt feather island jacket kettle lemon mirror needle oyster "
    "pepper quartz rocket saddle tunnel umbrella violin walnut yellow zephyr anchor "
    "basket cactus dolphin ember falcon glacier hammer iris jungle koala lagoon mango "
    "nectar onyx parrot quiver raven salmon tiger urchin vessel willow xenon yarrow "
    "measured quietly across beneath between during without toward against around "
    "seven eleven thirty ninety hundred thousand million first second third last"
)
WORDS = _VOCABULARY.split()


def text(n_chars: int, seed: str) -> str:
    """Varied prose of exactly ``n_chars`` characters (words, numbers, punctuation),
    distinct for each seed: no two messages share more than a few tokens."""
    rng = random.Random(seed)
    out: list[str] = []
    size = 0
    while size < n_chars:
        w = rng.choice(WORDS)
        r = rng.random()
        if r < 0.08:
            w = str(rng.randint(0, 99999))
        elif r < 0.14:
            w = w.capitalize()
        if rng.random() < 0.1:
            w += rng.choice(".,;:?!")
        out.append(w)
        size += len(w) + 1
    return " ".join(out)[:n_chars]


# -- the head ---------------------------------------------------------------------------


def start_head(args: list[str], sessions: bool, log: Path) -> tuple[subprocess.Popen[str], str]:
    cmd = [
        sys.executable,
        "-m",
        "kvmesh.cli",
        *args,
        *(() if sessions else ("--max-sessions", "0")),
    ]
    with open(log, "w") as err:  # the head's log: shown if the mode fails
        p = popen(cmd, stdout=subprocess.PIPE, stderr=err, text=True)
    assert p.stdout is not None
    ready, _, _ = select.select([p.stdout], [], [], max(START_TIMEOUT_S, 300.0))
    line = p.stdout.readline() if ready else ""
    m = re.search(r"(https?://\S+) grpc", line)
    if not m:
        stop(p)
        raise RuntimeError(f"kvmesh head did not start: {line!r}")
    fail_point("started")
    return p, m.group(1)


def proc_status(pid: int) -> dict[str, int]:
    """VmRSS and VmHWM of ``pid`` in bytes (empty once it is gone)."""
    out = {}
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                key = line.split(":", 1)[0]
                if key in ("VmRSS", "VmHWM"):
                    out[key] = int(line.split()[1]) * 1024
    except OSError:
        pass
    return out


class Sampler(threading.Thread):
    """The head's RSS every ``every`` seconds: (seconds since ``t0``, bytes)."""

    def __init__(self, pid: int, t0: float, every: float) -> None:
        super().__init__(daemon=True)
        self.pid, self.t0, self.every = pid, t0, every
        self.samples: list[tuple[float, int]] = []
        self.done = threading.Event()

    def run(self) -> None:
        while not self.done.is_set():
            rss = proc_status(self.pid).get("VmRSS")
            if rss:
                self.samples.append((time.perf_counter() - self.t0, rss))
            self.done.wait(self.every)


def metrics(http: httpx.Client) -> dict[str, float]:
    """The head's prefill, sharing and cancellation series from /metrics."""
    out = {}
    for line in http.get("/metrics").text.splitlines():
        if line.startswith(("kvmesh_prefill", "kvmesh_share", "kvmesh_requests_cancelled")):
            name, _, value = line.rpartition(" ")
            out[name] = float(value)
    return out


def weights_bytes(model: str) -> int:
    from kvmesh.engine.embedded import resolve_model

    path = resolve_model(model)
    return sum(
        f.stat().st_size
        for f in path.iterdir()
        if f.suffix in (".safetensors", ".bin", ".pt", ".pth", ".gguf")
    )


# -- the chats --------------------------------------------------------------------------


class Conversation(threading.Thread):
    def __init__(self, i: int, chat: Chat, url: str, size: Size, t0: float, cpt: float) -> None:
        super().__init__(daemon=True)
        self.i, self.chat, self.url, self.size, self.t0, self.cpt = i, chat, url, size, t0, cpt
        self.turns: list[dict[str, Any]] = []
        self.error: BaseException | None = None

    def now(self) -> float:
        return time.perf_counter() - self.t0

    def run(self) -> None:
        try:
            self._run()
        except BaseException as e:  # reported by the main thread
            self.error = e

    def _run(self) -> None:
        key = f"conv-{self.i}"
        auth = {"Authorization": f"Bearer {key}"}
        messages: list[dict[str, str]] = [
            {"role": "system", "content": f"Conversation {self.i}: answer the user briefly."}
        ]
        with httpx.Client(base_url=self.url, timeout=1800, headers=auth) as http:
            time.sleep(max(0.0, self.chat.start_s - self.now()))
            for k, (user_tokens, max_tokens) in enumerate(self.chat.turns):
                if k:
                    time.sleep(self.chat.think_s)
                content = text(round(user_tokens * self.cpt), f"chat {self.i} turn {k}")
                messages.append({"role": "user", "content": content})
                q = http.post(
                    "/v1/cache/query", json={"model": self.size.model, "messages": messages}
                )
                q.raise_for_status()
                query = q.json()
                turn = self.stream(http, messages, max_tokens)
                turn.update(
                    chat=self.i,
                    turn=k,
                    user_tokens=user_tokens,
                    long_resume=k > 0 and user_tokens >= self.size.long,
                    source=query["source"],
                    query_cached_tokens=query["cached_tokens"],
                    query_prefix=query["prefix"],
                )
                self.turns.append(turn)
                messages.append({"role": "assistant", "content": turn.pop("answer")})

    def stream(
        self, http: httpx.Client, messages: list[dict[str, str]], max_tokens: int
    ) -> dict[str, Any]:
        body = {
            "model": self.size.model,
            "messages": messages,
            "max_tokens": max_tokens,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        sent = self.now()
        times: list[float] = []  # arrival of each chunk that carries a token
        answer, usage = [], None
        with http.stream("POST", "/v1/chat/completions", json=body) as r:
            r.raise_for_status()
            for line in r.iter_lines():
                if not line.startswith("data: {"):
                    continue
                at = self.now()
                event = json.loads(line[6:])
                if "error" in event:
                    raise RuntimeError(f"stream failed: {event['error']}")
                usage = event.get("usage") or usage
                for c in event.get("choices", ()):
                    delta = c.get("delta", {})
                    answer.append(delta.get("content", ""))
                    # the role chunk comes before any token; the finish chunk after the last
                    if "role" not in delta and c.get("finish_reason") is None:
                        times.append(at)
        assert usage is not None, "no usage event"
        got = usage["completion_tokens"]
        assert got == max_tokens, f"asked for {max_tokens} tokens (ignore_eos), got {got}"
        gaps = [b - a for a, b in zip(times, times[1:], strict=False)]
        return {
            "sent_s": sent,
            "first_token_s": times[0] if times else None,
            "done_s": self.now(),
            "ttft_s": times[0] - sent if times else None,
            "token_times_s": times,
            "max_gap_s": max(gaps, default=0.0),
            "prompt_tokens": usage["prompt_tokens"],
            "cached_tokens": usage["prompt_tokens_details"]["cached_tokens"],
            "completion_tokens": got,
            "answer": "".join(answer),
        }


def chars_per_token(http: httpx.Client, model: str) -> float:
    """The head's tokenizer on a sample of the benchmark's text: characters a token."""
    sample = text(4000, "calibration")
    r = http.post("/v1/cache/query", json={"model": model, "prompt": sample})
    r.raise_for_status()
    return len(sample) / r.json()["prompt_tokens"]


# -- one mode ---------------------------------------------------------------------------


def run_mode(size: Size, sessions: bool, work: Path) -> dict[str, Any]:
    keys, secret = work / "keys", work / "secret"
    keys.write_text("".join(f"conv-{i}\n" for i in range(len(size.chats))) + "warm-up\n")
    args = [
        "head",
        "--model",
        size.model,
        "--listen",
        "127.0.0.1:0",
        "--api-key-file",
        str(keys),
        "--tenant-secret-file",
        str(secret),
        "--budget",
        size.budget,
        "--kv-budget",
        size.kv_budget,
        "--prefill-chunk",
        str(size.prefill_chunk),
    ]
    load = os.getloadavg()[0]
    head, url = start_head(args, sessions, work / "head.log")
    try:
        with httpx.Client(base_url=url, timeout=1800) as http:
            cpt = chars_per_token(http, size.model)
            warm = {"Authorization": "Bearer warm-up"}  # first-request setup is nobody's cost
            http.post(
                "/v1/chat/completions",
                headers=warm,
                json={
                    "model": size.model,
                    "messages": [{"role": "user", "content": text(200, "warm-up")}],
                    "max_tokens": 4,
                },
            ).raise_for_status()
            before = metrics(http)
            t0 = time.perf_counter()
            sampler = Sampler(head.pid, t0, size.sample_s)
            sampler.start()
            chats = [Conversation(i, c, url, size, t0, cpt) for i, c in enumerate(size.chats)]
            for c in chats:
                c.start()
            for c in chats:
                c.join()
            for c in chats:
                if c.error is not None:
                    raise RuntimeError(f"chat {c.i} failed") from c.error
            last = time.perf_counter() - t0
            time.sleep(size.idle_s)  # idle: the head trims what the load left
            health = http.get("/healthz").json()
            sampler.done.set()
            sampler.join()
            after = metrics(http)
            hwm = proc_status(head.pid).get("VmHWM")
    except Exception:
        tail = (work / "head.log").read_text(errors="replace").splitlines()[-40:]
        print("the head's log, last lines:", *tail, sep="\n  ", file=sys.stderr)
        raise
    finally:
        stop(head, grace_s=30)
    turns = sorted((t for c in chats for t in c.turns), key=lambda t: t["sent_s"])
    return summarize(size, sessions, turns, sampler.samples, last, hwm, health, before, after, load)


def pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(q * (len(xs) - 1)))]


def ttft_stats(turns: list[dict[str, Any]]) -> dict[str, Any]:
    xs = [t["ttft_s"] for t in turns if t["ttft_s"] is not None]
    return {
        "n": len(xs),
        "median_s": statistics.median(xs) if xs else None,
        "p90_s": pct(xs, 0.9),
        "max_s": max(xs, default=None),
    }


def long_resume_gaps(turns: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """For each long resume, the longest gap between two tokens of any other stream
    that overlaps its prefill (its request to its first token), and how many tokens
    the other streams received meanwhile (a resume computed in one forward: none)."""
    out = []
    for lr in turns:
        if not lr["long_resume"] or lr["first_token_s"] is None:
            continue
        a, b = lr["sent_s"], lr["first_token_s"]
        worst, streams, tokens = 0.0, 0, 0
        for t in turns:
            if t is lr:
                continue
            ts = t["token_times_s"]
            overlapping = [y - x for x, y in zip(ts, ts[1:], strict=False) if x < b and y > a]
            tokens += sum(a < x < b for x in ts)
            if overlapping:
                streams += 1
                worst = max(worst, *overlapping)
        out.append(
            {
                "chat": lr["chat"],
                "turn": lr["turn"],
                "new_tokens": lr["prompt_tokens"] - lr["cached_tokens"],
                "cached_tokens": lr["cached_tokens"],
                "prompt_tokens": lr["prompt_tokens"],
                "ttft_s": lr["ttft_s"],
                "streams_decoding": streams,
                "tokens_to_others": tokens,
                "max_gap_s": worst if streams else None,
            }
        )
    return out


def summarize(
    size: Size,
    sessions: bool,
    turns: list[dict[str, Any]],
    samples: list[tuple[float, int]],
    last_request_s: float,
    hwm: int | None,
    health: dict[str, Any],
    before: dict[str, float],
    after: dict[str, float],
    load: float,
) -> dict[str, Any]:
    mem = health.get("memory") if isinstance(health.get("memory"), dict) else None
    budget, kv_budget = parse_size(size.budget), parse_size(size.kv_budget)
    model_bytes = (mem or {}).get("model_bytes") or weights_bytes(size.model)
    bound = model_bytes + budget + kv_budget
    idle = samples[-1][1] if samples else None
    lrs = long_resume_gaps(turns)
    lr_gaps = [g["max_gap_s"] for g in lrs if g["max_gap_s"] is not None]
    per_stream = [t["max_gap_s"] for t in turns if len(t["token_times_s"]) > 1]
    resumes = [t for t in turns if t["turn"] > 0]
    tps = after.get("kvmesh_prefill_tokens_per_second")
    return {
        "sessions": sessions,
        "load_at_start": load,
        "turns": turns,
        "max_gap_s": max(per_stream, default=None),
        "per_stream_max_gap_s": {
            "median": statistics.median(per_stream) if per_stream else None,
            "p90": pct(per_stream, 0.9),
        },
        "long_resumes": lrs,
        "max_gap_during_long_resumes_s": max(lr_gaps, default=None),
        "ttft": {
            "all": ttft_stats(turns),
            "first_turns": ttft_stats([t for t in turns if t["turn"] == 0]),
            "resumes": ttft_stats(resumes),
            "long_resumes": ttft_stats([t for t in turns if t["long_resume"]]),
        },
        "reuse": {
            "resume_prompt_tokens": sum(t["prompt_tokens"] for t in resumes),
            "resume_cached_tokens": sum(t["cached_tokens"] for t in resumes),
            "resume_cached_fraction": (
                sum(t["cached_tokens"] for t in resumes)
                / max(1, sum(t["prompt_tokens"] for t in resumes))
            ),
            "sources": {
                s: sum(t["source"] == s for t in turns) for s in {t["source"] for t in turns}
            },
            "session_prefix_tokens": sum(t["query_prefix"].get("session", 0) for t in turns),
        },
        "prefill": {
            k.removeprefix("kvmesh_"): v - before.get(k, 0.0)
            for k, v in after.items()
            if k != "kvmesh_prefill_tokens_per_second" and k != "kvmesh_prefill_peak_chunk_tokens"
        }
        | {
            "peak_chunk_tokens": after.get("kvmesh_prefill_peak_chunk_tokens"),
            "tokens_per_second": tps,
            "chunk_s_estimate": size.prefill_chunk / tps if tps else None,
        },
        "rss": {
            "samples": samples,
            "last_request_s": last_request_s,
            "ready_bytes": samples[0][1] if samples else None,
            "peak_sampled_bytes": max((b for _, b in samples), default=None),
            "peak_hwm_bytes": hwm,
            "idle_bytes": idle,
            "idle_after_s": size.idle_s,
            "model_bytes": model_bytes,
            "model_bytes_from": "healthz" if mem and mem.get("model_bytes") else "weight files",
            "budget_bytes": budget,
            "kv_budget_bytes": kv_budget,
            "bound_bytes": bound,
            "idle_vs_bound": idle / bound if idle else None,
            "peak_vs_bound": (hwm or 0) / bound,
        },
        "healthz_memory": mem,
    }


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--json", type=Path, default=Path("bench/results/conversations.json"))
    ap.add_argument("--model")
    ap.add_argument("--budget")
    ap.add_argument("--kv-budget")
    ap.add_argument("--prefill-chunk", type=int)
    ap.add_argument("--modes", default="on,off", help="on, off or both, in this order")
    ap.add_argument("--smoke", action="store_true", help="CI: demo-tiny, short chats")
    ap.add_argument("--plot-only", type=Path, metavar="JSON", help="draw the PNG of a result")
    a = ap.parse_args()
    if a.plot_only:
        plot(json.loads(a.plot_only.read_text()), a.plot_only.with_suffix(".png"))
        return
    size = SMOKE if a.smoke else Size()
    for name in ("model", "budget", "kv_budget", "prefill_chunk"):
        if getattr(a, name) is not None:
            setattr(size, name, getattr(a, name))
    modes: dict[str, Any] = {}
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as d:
        for mode in a.modes.split(","):
            work = Path(d) / mode
            work.mkdir()
            r = run_mode(size, mode == "on", work)
            modes[mode] = r
            print_mode(mode, r)
    off = modes.get("off")
    if off is not None:  # the claim this benchmark checks: sessions really were off
        assert off["reuse"]["session_prefix_tokens"] == 0, "the sessions-off head kept a session"
        assert "session" not in off["reuse"]["sources"], "the sessions-off head resumed a session"
    on = modes.get("on", {})
    result: dict[str, Any] = {
        "model": size.model,
        "size": asdict(size),
        "sessions_off_via": "--max-sessions 0",
        "modes": modes,
        "gap_long_resume_on_vs_off": ratio(
            on.get("max_gap_during_long_resumes_s"),
            (off or {}).get("max_gap_during_long_resumes_s"),
        ),
        "gap_overall_on_vs_off": ratio(on.get("max_gap_s"), (off or {}).get("max_gap_s")),
        "idle_rss_vs_bound": {m: r["rss"]["idle_vs_bound"] for m, r in modes.items()},
        "target": TARGET,
        "wall_s": time.perf_counter() - t0,
        "machine": machine(),
    }
    result["targets_met"] = {
        "gap_long_resume": (
            result["gap_long_resume_on_vs_off"] <= TARGET
            if result["gap_long_resume_on_vs_off"] is not None
            else None
        ),
        "idle_rss": all(
            v is not None and v <= TARGET for v in result["idle_rss_vs_bound"].values()
        ),
    }
    print(
        f"longest gap during long resumes, on/off: {fmt(result['gap_long_resume_on_vs_off'], 'x')}"
        f" (target <= {TARGET}x); overall on/off: {fmt(result['gap_overall_on_vs_off'], 'x')}; "
        f"idle RSS / (model + budgets): "
        + ", ".join(f"{m} {fmt(v, 'x')}" for m, v in result["idle_rss_vs_bound"].items())
        + f" (target <= {TARGET}x); {result['wall_s']:.0f} s in all",
        flush=True,
    )
    a.json.parent.mkdir(parents=True, exist_ok=True)
    a.json.write_text(json.dumps(result, indent=1) + "\n")
    plot(result, a.json.with_suffix(".png"))


def fmt(v: float | None, unit: str = " s", digits: int = 2) -> str:
    return "-" if v is None else f"{v:.{digits}f}{unit}"


def print_mode(mode: str, r: dict[str, Any]) -> None:
    mib = 1 << 20
    rss = r["rss"]
    print(f"sessions {mode} (load {r['load_at_start']:.1f}):", flush=True)
    for t in r["turns"]:
        print(
            f"  chat {t['chat']} turn {t['turn']}: {t['prompt_tokens']} prompt tokens, "
            f"{t['cached_tokens']} cached ({t['source']}), TTFT {fmt(t['ttft_s'])}, "
            f"longest gap {fmt(t['max_gap_s'])}{'  [long resume]' if t['long_resume'] else ''}",
            flush=True,
        )
    for g in r["long_resumes"]:
        print(
            f"  long resume chat {g['chat']} turn {g['turn']} ({g['new_tokens']} new on "
            f"{g['cached_tokens']}): {g['streams_decoding']} streams decoding got "
            f"{g['tokens_to_others']} tokens meanwhile, their longest gap {fmt(g['max_gap_s'])}",
            flush=True,
        )
    tt = r["ttft"]
    print(
        f"  longest gap {fmt(r['max_gap_s'])}, during long resumes "
        f"{fmt(r['max_gap_during_long_resumes_s'])}; TTFT median {fmt(tt['all']['median_s'])} "
        f"p90 {fmt(tt['all']['p90_s'])}; resumes cached "
        f"{100 * r['reuse']['resume_cached_fraction']:.0f}%; RSS ready "
        f"{(rss['ready_bytes'] or 0) / mib:.0f} MiB, peak {(rss['peak_hwm_bytes'] or 0) / mib:.0f}"
        f" MiB, idle {(rss['idle_bytes'] or 0) / mib:.0f} MiB against "
        f"{rss['bound_bytes'] / mib:.0f} MiB model + budgets ({fmt(rss['idle_vs_bound'], 'x')})",
        flush=True,
    )


def plot(result: dict[str, Any], path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no PNG (pip install matplotlib; --plot-only)")
        return
    modes = result["modes"]
    fig, axes = plt.subplots(
        len(modes) + 1, 1, figsize=(9, 3.0 * (len(modes) + 1)), sharex=True, squeeze=False
    )
    top = max(
        (g for r in modes.values() for t in r["turns"] for g in gaps(t["token_times_s"])[1]),
        default=1.0,
    )
    for ax, (mode, r) in zip(axes[:, 0], modes.items(), strict=False):
        for t in r["turns"]:
            xs, ys = gaps(t["token_times_s"])
            ax.plot(xs, ys, ".", ms=3, color=f"C{t['chat']}")
        for t in r["turns"]:
            if t["long_resume"] and t["first_token_s"] is not None:
                ax.axvspan(t["sent_s"], t["first_token_s"], color=f"C{t['chat']}", alpha=0.12)
        ax.set_ylim(0, top * 1.1)
        ax.set_ylabel("inter-token gap (s)")
        worst = r["max_gap_during_long_resumes_s"]
        ax.set_title(
            f"sessions {mode}: gaps of every stream (colour: chat; shaded: a long resume "
            f"prefilling); worst during long resumes {fmt(worst)}",
            fontsize=8,
        )
        ax.grid(True, alpha=0.3)
    ax = axes[-1, 0]
    for i, (mode, r) in enumerate(modes.items()):
        s = r["rss"]["samples"]
        ax.plot(
            [x for x, _ in s],
            [b / 2**30 for _, b in s],
            label=f"sessions {mode}",
            color=f"C{i + 5}",
        )
        ax.axvline(r["rss"]["last_request_s"], color=f"C{i + 5}", ls=":", lw=1)
    bound = next(iter(modes.values()))["rss"]["bound_bytes"] / 2**30
    ax.axhline(bound, color="k", ls="--", lw=1, label="model + --budget + --kv-budget")
    ax.axhline(bound * TARGET, color="r", ls="--", lw=1, label=f"{TARGET}x that")
    ax.set_ylabel("head RSS (GiB)")
    ax.set_xlabel("seconds since the chats started (dotted: last answer)")
    ax.set_ylim(0, None)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7)
    fig.suptitle(
        f"bench/conversations.py: {result['model']}, {len(next(iter(modes.values()))['turns'])} turns a mode",
        fontsize=9,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


def gaps(times: list[float]) -> tuple[list[float], list[float]]:
    """(arrival of each token after the first, its gap since the one before)."""
    return times[1:], [b - a for a, b in zip(times, times[1:], strict=False)]


if __name__ == "__main__":
    run_main(main)
