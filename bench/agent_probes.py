"""Hostile and careless agent clients against a real head, each with a streaming bystander.

    python bench/agent_probes.py --json bench/results/agent_probes.json [--model DIR]
    python bench/agent_probes.py --smoke     # CI: the small probes, 3 distinct schemas
    python bench/agents.py --probes ...      # the same, from the agent benchmark

One head on the test zoo's tools model (``--no-publish``), started with a
``KVMESH_HOME`` whose ``links.json`` is hostile (a 400-digit rate, a planted 1 B/s
link, world-writable): ``links_json_start`` says it started anyway. Then each probe
(:data:`SCHEMAS`, :func:`tool_probes`) is sent while a bystander streams a long
completion; per probe: the HTTP status, the error's code and first line, the
seconds it took, and the longest gap between the bystander's chunks. Then RSS
before and after ``--distinct`` distinct ~1 MB schemas (``/healthz`` memory, with
its grammar caches). What the issue asks of each (issue #50): no 5xx, no bystander
gap over 1.5 s, RSS within 150 MB, the big-integer answer valid or a 400.
``verdict`` in the JSON checks exactly that. Every process is stopped on any exit
(``_common.run_main``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from _common import machine, own_tempdir, run_main, spawn_kvmesh  # noqa: E402

MAX_GAP_S = 1.5
MAX_RSS_GROWTH_MB = 150
SERVED = "tools"


def _ints(n: int, required: bool, note: int = 0) -> dict[str, Any]:
    """``n`` integer properties (each described by ``note`` characters)."""
    names = [f"p{i}" for i in range(n)]
    prop = {"type": "integer", **({"description": "d" * note} if note else {})}
    schema: dict[str, Any] = {"type": "object", "properties": dict.fromkeys(names, prop)}
    return {**schema, "required": names} if required else schema


def _optional(n: int) -> dict[str, Any]:
    props = {f"p{i}": {"type": "string", "description": "d" * 120} for i in range(n)}
    return {"type": "object", "properties": props}


#: probe -> (its response_format schema, whether it is big: left out of ``--smoke``)
SCHEMAS: dict[str, tuple[Callable[[], dict[str, Any]], bool]] = {
    # just under the 4 MiB body limit, as the issue's: 16,250 required integers
    "schema_4mb_16250_required_ints": (lambda: _ints(16_250, True, 195), True),
    "schema_1mb_6000_optional": (lambda: _optional(6000), True),
    "schema_self_ref": (lambda: {"$ref": "#"}, False),
    "pattern_nested_repeats": (
        lambda: {"type": "string", "pattern": "^((x{1,50}){1,50}){1,50}y$"},
        False,
    ),
    "pattern_a1000_x1000": (lambda: {"type": "string", "pattern": "^(a{1000}){1000}$"}, False),
    "integer_1e30": (lambda: {"type": "integer", "minimum": 10**30, "maximum": 10**30 + 5}, False),
}

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 12}},
            "required": ["city"],
        },
    },
}


def _deep_tool(depth: int) -> dict[str, Any]:
    schema: dict[str, Any] = {"type": "string"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"x": schema}}
    return {"type": "function", "function": {"name": "deep", "parameters": schema}}


def hostile_home() -> str:
    """A ``KVMESH_HOME`` whose ``links.json`` would stop a careless head."""
    home = own_tempdir("probes-home")
    now = time.time()
    doc = {
        "version": 1,
        "links": {
            "big": {"bytes_per_s": int("9" * 400), "at": now, "interface": "ethernet"},
            "planted": {"bytes_per_s": 1, "at": now, "interface": "ethernet"},
        },
        "prefill": {"x": {"at": int("9" * 400), "samples": [[100, 1]]}},
    }
    path = Path(home) / "links.json"
    path.write_text(json.dumps(doc))
    path.chmod(0o666)
    return home


class Bystander:
    """A long streamed completion; the longest gap between its chunks while open."""

    def __init__(self, url: str) -> None:
        self.url, self.gaps = url, [0.0]
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        body = {"model": SERVED, "prompt": "hello", "max_tokens": 4000, "ignore_eos": True}
        with (
            httpx.Client(base_url=self.url, timeout=300) as c,
            c.stream("POST", "/v1/completions", json={**body, "stream": True}) as r,
        ):
            last = time.perf_counter()
            for _ in r.iter_lines():
                now = time.perf_counter()
                self.gaps.append(now - last)
                last = now
                if self.stop.is_set():
                    return

    def __enter__(self) -> Bystander:
        self.thread.start()
        time.sleep(1.0)  # streaming by now
        self.gaps = [0.0]
        return self

    def __exit__(self, *exc: object) -> None:
        time.sleep(0.3)
        self.stop.set()
        self.thread.join(60)


def probe(http: httpx.Client, url: str, path: str, body: dict[str, Any]) -> dict[str, Any]:
    """``body`` posted to ``path`` beside a bystander: status, error, time, longest gap."""
    with Bystander(url) as b:
        t0 = time.perf_counter()
        r = http.post(path, json={"model": SERVED, **body}, timeout=300)
        took = time.perf_counter() - t0
    row: dict[str, Any] = {
        "status": r.status_code,
        "seconds": round(took, 3),
        "bystander_max_gap_s": round(max(b.gaps), 3),
        "body_bytes": len(json.dumps(body)),
    }
    if r.status_code != 200:
        err = r.json().get("error", {})
        row.update(code=err.get("code"), error=str(err.get("message", ""))[:160])
    else:
        row["answer"] = _answer(r.json())
    return row


def _answer(doc: dict[str, Any]) -> Any:
    choice = doc["choices"][0]
    if "text" in choice:
        return choice["text"][:200]
    m = choice["message"]
    return {"content": (m.get("content") or "")[:200], "tool_calls": m.get("tool_calls")}


def schema_probes(http: httpx.Client, url: str, smoke: bool) -> dict[str, Any]:
    out = {}
    for name, (make, big) in SCHEMAS.items():
        if smoke and big:
            continue
        fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": make()}}
        body = {"prompt": "x", "max_tokens": 8, "response_format": fmt}
        out[name] = probe(http, url, "/v1/completions", body)
        print(f"{name}: {out[name]}", flush=True)
    row = out["integer_1e30"]
    if row["status"] == 200:
        row["valid"] = _in_range(row["answer"], 10**30, 10**30 + 5)
    return out


def _in_range(text: str, lo: int, hi: int) -> bool:
    try:
        value = json.loads(text)
    except ValueError:
        return False
    return isinstance(value, int) and lo <= value <= hi


def tool_probes(http: httpx.Client, url: str) -> dict[str, Any]:
    ask = [{"role": "user", "content": "What is the weather in Oslo?"}]
    chat = "/v1/chat/completions"
    out = {
        "tool_parameters_400_deep": probe(
            http, url, chat, {"messages": ask, "tools": [_deep_tool(400)], "max_tokens": 4}
        ),
        "stop_strings_6": probe(
            http,
            url,
            "/v1/completions",
            {"prompt": "x", "max_tokens": 4, "stop": [f"<stop{i}>" for i in range(6)]},
        ),
    }
    cut = {"messages": ask, "tools": [WEATHER], "tool_choice": "required", "max_tokens": 6}
    out["required_cut_by_max_tokens"] = probe(http, url, chat, {**cut, "seed": 1})
    out["required_cut_by_max_tokens"]["stream_agrees"] = _stream_agrees(http, cut)
    for k in ("tool_parameters_400_deep", "stop_strings_6", "required_cut_by_max_tokens"):
        print(f"{k}: {out[k]}", flush=True)
    return out


def _stream_agrees(http: httpx.Client, body: dict[str, Any]) -> bool:
    """The same request whole and streamed: the same content, calls and finish."""
    body = {"model": SERVED, **body, "seed": 1}
    whole = http.post("/v1/chat/completions", json=body, timeout=300).json()["choices"][0]
    content, calls, finish = "", 0, None
    with http.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as r:
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            for c in json.loads(line[6:])["choices"]:
                content += c["delta"].get("content") or ""
                calls += len(c["delta"].get("tool_calls") or [])
                finish = c.get("finish_reason") or finish
    m = whole["message"]
    return (content, calls, finish) == (
        m.get("content") or "",
        len(m.get("tool_calls") or []),
        whole["finish_reason"],
    )


def memory_probe(http: httpx.Client, distinct: int) -> dict[str, Any]:
    """RSS before and after ``distinct`` distinct ~1 MB schemas (each compiled once)."""

    def rss_mb() -> float:
        return http.get("/healthz").json()["memory"]["rss_bytes"] / 2**20

    start, statuses = rss_mb(), []
    for i in range(distinct):
        props = {f"s{i}_{j}": {"type": "integer", "description": "d" * 100} for j in range(6000)}
        fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"properties": props}}}
        body = {"model": SERVED, "prompt": "x", "max_tokens": 2, "response_format": fmt}
        statuses.append(http.post("/v1/completions", json=body, timeout=300).status_code)
    end = rss_mb()
    grammars = http.get("/healthz").json()["memory"].get("grammars")
    row = {
        "distinct": distinct,
        "rss_start_mb": round(start),
        "rss_end_mb": round(end),
        "statuses": sorted(set(statuses)),
        "grammars": grammars,
    }
    print(f"memory: {row}", flush=True)
    return row


def verdict(result: dict[str, Any]) -> dict[str, bool]:
    rows = {**result["schemas"], **result["tools"]}
    mem = result["memory"]
    integer = result["schemas"]["integer_1e30"]
    return {
        "links_json_start": result["links_json_start"],
        "no_5xx": all(r["status"] < 500 for r in rows.values()),
        "no_gap_over_1_5_s": all(r["bystander_max_gap_s"] <= MAX_GAP_S for r in rows.values()),
        "rss_within_150_mb": mem["rss_end_mb"] - mem["rss_start_mb"] <= MAX_RSS_GROWTH_MB,
        "integer_valid_or_400": integer["status"] == 400 or bool(integer.get("valid")),
        "stops_accepted": rows["stop_strings_6"]["status"] == 200,
        "cut_call_stream_agrees": bool(rows["required_cut_by_max_tokens"]["stream_agrees"]),
    }


def run(model: str, smoke: bool, distinct: int) -> dict[str, Any]:
    home = hostile_home()
    _, m = spawn_kvmesh(
        "head",
        "--model",
        model,
        "--listen",
        "127.0.0.1:0",
        "--no-publish",
        "--served-model-name",
        SERVED,
        pattern=r"(https?://\S+) grpc",
        timeout_s=300.0,
        env={"KVMESH_HOME": home},
    )
    url = m.group(1)
    with httpx.Client(base_url=url, timeout=300) as http:
        result: dict[str, Any] = {"links_json_start": http.get("/healthz").status_code == 200}
        result["schemas"] = schema_probes(http, url, smoke)
        result["tools"] = tool_probes(http, url)
        result["memory"] = memory_probe(http, distinct)
    result["verdict"] = verdict(result)
    return result


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", help="model directory (default: the test zoo's tools model)")
    ap.add_argument("--distinct", type=int, default=20, help="distinct ~1 MB schemas (RSS)")
    ap.add_argument("--smoke", action="store_true", help="the small probes, 3 schemas, for CI")
    ap.add_argument("--json", type=Path)
    a = ap.parse_args(argv)
    if a.model is None:
        import zoo

        a.model = str(zoo.tools_model())
    result = run(a.model, a.smoke, 3 if a.smoke else a.distinct)
    result.update(model=a.model, smoke=a.smoke, machine=machine())
    print(f"verdict: {result['verdict']}", flush=True)
    if a.json:
        a.json.parent.mkdir(parents=True, exist_ok=True)
        a.json.write_text(json.dumps(result, indent=1) + "\n")
    if not all(result["verdict"].values()) and not os.environ.get("KVMESH_PROBES_NO_FAIL"):
        raise SystemExit(1)


if __name__ == "__main__":
    run_main(main)
