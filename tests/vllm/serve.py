"""A vLLM process driven over stdin/stdout, for the connector's process tests and bench.

    python tests/vllm/serve.py '{"model": DIR, "kvmesh": {...} | null, ...}'

reads one JSON command per line on stdin and answers each with one line on stdout
that starts with ``@@`` (vLLM's own logs go to stderr and stdout without it):
``{"op": "generate", "prompt": [ids], "max_tokens": n}`` -> token ids, per-token
top log-probabilities, ``num_cached_tokens`` and the time to first token;
``{"op": "flush"}`` waits for publishes; ``{"op": "stats"}`` -> kvmesh counters.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any


def reply(obj: object) -> None:
    sys.stdout.write("@@" + json.dumps(obj) + "\n")
    sys.stdout.flush()


def main() -> None:
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # scheduler + worker here
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    opts = json.loads(sys.argv[1])
    from vllm import LLM, SamplingParams

    kw: dict[str, object] = dict(
        model=opts["model"],
        enforce_eager=True,
        max_model_len=opts.get("max_model_len", 512),
        dtype=opts.get("dtype", "float32"),
        gpu_memory_utilization=0.1,
        enable_prefix_caching=opts.get("prefix_caching", False),
        seed=0,
    )
    if opts.get("block_size"):
        kw["block_size"] = opts["block_size"]
    if opts.get("kvmesh") is not None:
        kw["kv_transfer_config"] = {
            "kv_connector": "KVMeshConnector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": opts["kvmesh"],
        }
    try:
        llm = LLM(**kw)
    except Exception as e:
        reply({"error": repr(e)})
        raise
    from kvmesh.vllm import service

    svc = service.current()
    reply(
        {
            "ready": True,
            "card": svc.card.to_json() if svc else None,
            "address": svc.node.node.address if svc else None,
        }
    )
    for line in sys.stdin:
        cmd = json.loads(line)
        op = cmd["op"]
        if op == "generate":
            sp = SamplingParams(max_tokens=cmd.get("max_tokens", 4), temperature=0, logprobs=5)
            t0 = time.perf_counter()
            out = llm.generate([{"prompt_token_ids": cmd["prompt"]}], sp, use_tqdm=False)[0]
            dt = time.perf_counter() - t0
            comp = out.outputs[0]
            logprobs = [
                sorted([[int(t), float(lp.logprob)] for t, lp in step.items()])
                for step in comp.logprobs
            ]
            reply(
                {
                    "tokens": list(comp.token_ids),
                    "logprobs": logprobs,
                    "num_cached_tokens": out.num_cached_tokens,
                    "seconds": dt,
                }
            )
        elif op == "flush":
            if svc:
                svc.flush(cmd.get("timeout", 30))
            reply({"flushed": True})
        elif op == "stats":
            reply(
                {
                    "counters": dict(svc.counters) if svc else {},
                    "store_entries": svc.fleet.store.stats.entries if svc else 0,
                }
            )
        elif op == "quit":
            service.stop()  # a clean stop: the mesh node says goodbye, peers drop it at once
            reply({"bye": True})
            break


class VLLMProcess:
    """Client side: start ``serve.py`` in a fresh process and send it commands."""

    def __init__(self, model: str, kvmesh: dict[str, Any] | None, log: Path, **opts: Any) -> None:
        if kvmesh is not None:  # a loaded CI machine must not turn a slow lookup into a miss
            kvmesh = {"lookup_timeout": 5.0, **kvmesh}
        arg = json.dumps({"model": model, "kvmesh": kvmesh, **opts})
        self.log = log
        self.proc = subprocess.Popen(
            [sys.executable, __file__, arg],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=open(log, "a"),  # noqa: SIM115
            text=True,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
        self.ready = self._read()
        if "error" in self.ready:
            raise RuntimeError(f"vLLM did not start: {self.ready['error']} (log: {log})")

    def _read(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith("@@"):
                return json.loads(line[2:])  # type: ignore[no-any-return]
        raise RuntimeError(f"vLLM process ended (rc={self.proc.wait()}); log: {self.log}")

    def call(self, op: str, **kw: Any) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"op": op, **kw}) + "\n")
        self.proc.stdin.flush()
        return self._read()

    def generate(self, prompt: list[int], max_tokens: int = 4) -> dict[str, Any]:
        return self.call("generate", prompt=prompt, max_tokens=max_tokens)

    def counters(self) -> dict[str, int]:
        return self.call("stats")["counters"]  # type: ignore[no-any-return]

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.call("quit")
                self.proc.wait(30)
            except Exception:
                self.proc.kill()
                self.proc.wait(10)


if __name__ == "__main__":
    main()
    os._exit(0)  # vLLM's engine threads need not be joined
