"""Torch's parallel work belongs to the engine thread (kvmesh/engine/threads.py), and
the batch runner runs a caller's function there (BatchRunner.on_engine).

- In a fresh process that reserved the threads: the main thread and every thread
  that starts computing later run torch single-threaded; the thread that takes
  them gets torch's own count, and keeps it after later threads start; without a
  reservation taking changes nothing.
- A real head process reports its engine thread's count in /healthz: torch's own
  count for a fresh process (a thread count the lazy per-thread set-up had undone
  once read 1 there).
- ``on_engine`` runs on the engine thread with a real engine, returns the result,
  hands back what was raised, and refuses after close without hanging.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading

import pytest

from kvmesh.engine import threads
from kvmesh.runtime.batch import BatchRunner, EngineFailed

from . import zoo
from .test_api import Head
from .test_batch import engine

PROBE = r"""
import json, threading, torch
from kvmesh.engine import threads
own = torch.get_num_threads()
if RESERVE:
    threads.reserve()
out = {"own": own, "main": torch.get_num_threads()}
def engine_thread():
    out["took"] = threads.take()
    out["engine"] = torch.get_num_threads()
    later = threading.Thread(target=lambda: out.setdefault("later", torch.get_num_threads()))
    later.start(); later.join()
    out["engine_after"] = torch.get_num_threads()
t = threading.Thread(target=engine_thread); t.start(); t.join()
out["main_after"] = torch.get_num_threads()
print(json.dumps(out))
"""


def probe(reserve: bool) -> dict:
    code = PROBE.replace("RESERVE", str(reserve))
    run = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    return json.loads(run.stdout)


def test_reserved_threads_go_to_the_thread_that_takes_them():
    out = probe(reserve=True)
    own = out["own"]
    assert out["took"] == own >= 1
    assert out["engine"] == out["engine_after"] == own
    assert out["main"] == out["main_after"] == out["later"] == 1


def test_without_a_reservation_taking_changes_nothing():
    out = probe(reserve=False)
    assert out["took"] == out["own"]
    assert out["main"] == out["engine"] == out["later"] == out["own"]


def test_on_engine_runs_there_and_hands_back_results_and_errors():
    eng = engine("torch", "qwen2")
    runner = BatchRunner(eng, threading.RLock())
    try:
        assert runner.on_engine(lambda: threading.current_thread().name) == "kvmesh-engine"
        tokens = eng.encode("the engine thread computes this")
        logits = runner.on_engine(lambda: eng.prefill(tokens).logits)
        assert float((logits - eng.prefill(tokens).logits).abs().max()) == 0.0

        def fails() -> None:
            raise ValueError("on purpose")

        with pytest.raises(ValueError, match="on purpose"):
            runner.on_engine(fails)
        assert runner.on_engine(lambda: 7) == 7  # the engine thread went on
    finally:
        runner.close()
    with pytest.raises(EngineFailed):
        runner.on_engine(lambda: 1)


def test_a_library_process_keeps_torch_s_threads():
    """Nothing reserved in this (test) process: a runner's engine thread changes
    no thread count."""
    import torch

    before = torch.get_num_threads()
    assert threads.reserved() is None
    eng = engine("torch", "qwen2")
    runner = BatchRunner(eng, threading.RLock())
    try:
        assert runner.on_engine(torch.get_num_threads) == before
    finally:
        runner.close()
    assert torch.get_num_threads() == before


def test_a_head_s_engine_thread_computes_with_torch_s_threads():
    own = probe(reserve=False)["own"]
    head = Head(model=str(zoo.hf_model("qwen2")))
    try:
        assert head.health()["batch"]["torch_threads"] == own
        model = head.http.get("/v1/models").json()["data"][0]["id"]
        body = {"model": model, "prompt": "one two", "max_tokens": 2}
        r = head.http.post("/v1/completions", json=body)
        assert r.status_code == 200, r.text
    finally:
        head.stop()
