"""A vLLM process driven over stdin/stdout, for the connector's process tests and bench.

    python tests/vllm/serve.py '{"model": DIR, "kvmesh": {...} | null, ...}'

reads one JSON command per line on stdin and answers each with one line on stdout
that starts with ``@@`` (vLLM's own logs go to stderr and stdout without it):
``{"op": "generate", "prompt": [ids], "max_tokens": n, "cache_salt": s}`` -> token ids, per-token
top log-probabilities, ``num_cached_tokens``, the time it took and what kvmesh did
for the request (``kvmesh``: vLLM's ``kv_transfer_params``).

vLLM runs with its default process layout (its engine core and its worker in
processes of their own): nothing here reaches into them, everything observed comes
back through vLLM's own outputs. ``{"inprocess": true}`` sets
``VLLM_ENABLE_V1_MULTIPROCESSING=0`` (everything in this process) to test that too.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any


def reply(obj: object) -> None:
    sys.stdout.write("@@" + json.dumps(obj) + "\n")
    sys.stdout.flush()


def main() -> None:
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    opts = json.loads(sys.argv[1])
    if opts.get("inprocess"):
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
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
    if opts.get("tensor_parallel_size"):
        kw["tensor_parallel_size"] = opts["tensor_parallel_size"]
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
    reply({"ready": True})
    for line in sys.stdin:
        cmd = json.loads(line)
        op = cmd["op"]
        if op == "generate":
            sp = SamplingParams(max_tokens=cmd.get("max_tokens", 4), temperature=0, logprobs=5)
            t0 = time.perf_counter()
            prompt: dict[str, Any] = {"prompt_token_ids": cmd["prompt"]}
            if cmd.get("cache_salt"):
                prompt["cache_salt"] = cmd["cache_salt"]
            out = llm.generate([prompt], sp, use_tqdm=False)[0]
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
                    "kvmesh": (out.kv_transfer_params or {}).get("kvmesh"),
                }
            )
        elif op == "quit":
            # a clean stop: each worker's connector flushes its publishes and its
            # mesh node says goodbye
            llm.llm_engine.engine_core.shutdown()
            reply({"bye": True})
            break


def _log_tail(log: Path) -> str:
    from ..procs import log_tail  # client side only: this file also runs as a script

    return log_tail(log)


def _lost_port_race(log: Path, since: int) -> bool:
    from ..procs import lost_port_race  # client side only (as above)

    return lost_port_race(log, since)


def _size(log: Path) -> int:
    return log.stat().st_size if log.exists() else 0


class VLLMProcess:
    """Client side: start ``serve.py`` in a fresh process and send it commands."""

    def __init__(
        self,
        model: str,
        kvmesh: dict[str, Any] | None,
        log: Path,
        env: dict[str, str] | None = None,
        **opts: Any,
    ) -> None:
        if kvmesh is not None:  # a loaded CI machine must not turn a slow lookup into a miss
            kvmesh = {"lookup_timeout": 5.0, **kvmesh}
        self.log = log
        arg = json.dumps({"model": model, "kvmesh": kvmesh, **opts})
        env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        self.ready = self._start(arg, env, retry=True)
        if "error" in self.ready:
            raise RuntimeError(f"vLLM did not start: {self.ready['error']}; {_log_tail(log)}")

    def _start(self, arg: str, env: dict[str, str], retry: bool) -> dict[str, Any]:
        """A fresh ``serve.py`` process; its first answer (ready, or the error, the
        process killed then). Started once more after a lost port race."""
        since = _size(self.log)
        self.proc = subprocess.Popen(
            [sys.executable, __file__, arg],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=open(self.log, "a"),  # noqa: SIM115
            text=True,
            env=env,
            start_new_session=True,  # vLLM's own processes go with it on kill()
        )
        try:
            ready = self._read()
        except BaseException:
            self.kill()
            raise
        if "error" in ready:
            self.kill()
            if retry and _lost_port_race(self.log, since):
                return self._start(arg, env, retry=False)
        return ready

    def _read(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith("@@"):
                return json.loads(line[2:])  # type: ignore[no-any-return]
        raise RuntimeError(f"vLLM process ended (rc={self.proc.wait()}); {_log_tail(self.log)}")

    def call(self, op: str, **kw: Any) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"op": op, **kw}) + "\n")
        self.proc.stdin.flush()
        return self._read()

    def generate(
        self, prompt: list[int], max_tokens: int = 4, cache_salt: str | None = None
    ) -> dict[str, Any]:
        return self.call("generate", prompt=prompt, max_tokens=max_tokens, cache_salt=cache_salt)

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.call("quit")
                self.proc.wait(30)
            except Exception:
                self.kill()

    def kill(self) -> None:
        """This process and every process vLLM started under it."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(10)


class APIServer:
    """``python -m vllm.entrypoints.openai.api_server`` (what ``vllm serve`` runs) in a
    process group of its own, with the connector when ``kvmesh`` is given; tokens come
    back as ``token_id:N`` so outputs compare with :class:`VLLMProcess`'s exactly."""

    def __init__(
        self,
        model: str,
        kvmesh: dict[str, Any] | None,
        log: Path,
        *extra: str,
        max_model_len: int = 512,
        timeout: float = 600,
    ) -> None:
        self.model = model
        cmd = [
            sys.executable,
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            model,
            "--host",
            "127.0.0.1",
            "--dtype",
            "float32",
            "--max-model-len",
            str(max_model_len),
            "--enforce-eager",
            "--seed",
            "0",
            "--return-tokens-as-token-ids",
            "--enable-prompt-tokens-details",
            *extra,
        ]
        if kvmesh is not None:
            cfg = {
                "kv_connector": "KVMeshConnector",
                "kv_role": "kv_both",
                "kv_connector_extra_config": {"lookup_timeout": 5.0, **kvmesh},
            }
            cmd += ["--kv-transfer-config", json.dumps(cfg)]
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        self.log = log
        self._start(cmd, env, timeout, retry=True)

    def _start(self, cmd: list[str], env: dict[str, str], timeout: float, retry: bool) -> None:
        """The server on a free port, once ready. Started once more on another port when
        it lost a port race: vLLM takes its own internal ports by ``bind(0)`` and release
        (a port another process may take first), which nothing outside it can close."""
        from ..procs import free_port

        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        since = _size(self.log)
        out = open(self.log, "a")  # noqa: SIM115
        self.proc = subprocess.Popen(
            [*cmd, "--port", str(self.port)],
            stdout=out,
            stderr=out,
            env=env,
            start_new_session=True,
        )
        try:
            self._wait_ready(timeout)
        except BaseException as e:
            self.close()
            if not (retry and isinstance(e, RuntimeError) and _lost_port_race(self.log, since)):
                raise
            self._start(cmd, env, timeout, retry=False)

    def _wait_ready(self, timeout: float) -> None:
        import urllib.request

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                rc = self.proc.returncode
                raise RuntimeError(f"vLLM server exited ({rc}); {_log_tail(self.log)}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                    if r.status == 200:
                        return
            except OSError:
                time.sleep(1)
        raise TimeoutError(f"vLLM server not ready in {timeout} s; {_log_tail(self.log)}")

    def complete(
        self, prompt: list[int], max_tokens: int = 4, model: str | None = None
    ) -> tuple[Any, ...]:
        """A greedy completion of token ids through the ``openai`` client: its tokens, top-5
        log-probabilities (as :func:`token_ids`), cached prompt tokens and what kvmesh did
        (None when it was not asked: vLLM's own prefix cache held the prompt). ``model``:
        a served name (a LoRA adapter's); default the base model."""
        import openai

        client = openai.OpenAI(base_url=self.url + "/v1", api_key="none", timeout=600)
        resp = client.completions.create(
            model=model or self.model,
            prompt=prompt,
            max_tokens=max_tokens,
            temperature=0,
            logprobs=5,
        )
        tokens, top = token_ids(resp.choices[0])
        report = ((resp.model_extra or {}).get("kv_transfer_params") or {}).get("kvmesh")
        return tokens, top, resp.usage.prompt_tokens_details.cached_tokens, report

    def chat(self, content: list[dict[str, Any]], max_tokens: int = 4) -> tuple[Any, ...]:
        """:meth:`complete` for one user message of OpenAI content parts (text,
        ``image_url``) through the chat endpoint."""
        import openai

        client = openai.OpenAI(base_url=self.url + "/v1", api_key="none", timeout=600)
        resp = client.chat.completions.create(
            model=self.model,
            messages=[{"role": "user", "content": content}],
            max_tokens=max_tokens,
            temperature=0,
            logprobs=True,
            top_logprobs=5,
        )
        steps = resp.choices[0].logprobs.content
        tid = lambda t: int(t.removeprefix("token_id:"))  # noqa: E731
        tokens = [tid(s.token) for s in steps]
        top = [sorted([[tid(t.token), float(t.logprob)] for t in s.top_logprobs]) for s in steps]
        report = ((resp.model_extra or {}).get("kv_transfer_params") or {}).get("kvmesh")
        return tokens, top, resp.usage.prompt_tokens_details.cached_tokens, report

    def close(self) -> None:
        """A clean stop (SIGTERM: the connector flushes its publishes), else killed."""
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(60)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)  # whatever vLLM left behind
        self.proc.wait(10)

    def __enter__(self) -> APIServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def token_ids(choice: Any) -> tuple[list[int], list[list[list[float]]]]:
    """An OpenAI completion choice's tokens and top log-probabilities, by token id,
    in :class:`VLLMProcess`'s form (``--return-tokens-as-token-ids``)."""

    def tid(t: str) -> int:
        return int(t.removeprefix("token_id:"))

    lp = choice.logprobs
    top = [sorted([[tid(k), float(v)] for k, v in d.items()]) for d in lp.top_logprobs]
    return [tid(t) for t in lp.tokens], top


if __name__ == "__main__":
    main()
    os._exit(0)  # vLLM's engine threads need not be joined
