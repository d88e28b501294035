"""Torch's parallel work belongs to the engine thread, on as many cores as others
leave idle (kvmesh/engine/threads.py).

- In a fresh process that reserved the threads: the main thread and every thread
  that starts computing later run torch single-threaded; the engine thread computes
  with the count it is given (torch's own at most, one at least: set in torch's own
  OpenMP runtime, not the one a tokenizer's wheel brings), and a real engine's
  forward computes the same bits at every count; without a reservation nothing
  changes.
- With every core kept busy by other (real, busy-looping) processes, the engine
  thread takes one thread, and the load it measures counts those processes.
- The rule: one thread per core others leave idle, within [1, the count reserved].
- A real head process reports its engine thread's count in /healthz and serves.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from kvmesh.engine import threads

from . import zoo
from .test_api import Head

PROBE = r"""
import json, sys, threading, time, torch
from kvmesh.engine import threads, load_engine
own = torch.get_num_threads()
if RESERVE:
    threads.reserve()
out = {"own": own, "main": torch.get_num_threads()}
# a real engine: its tokenizer's libraries bring their own OpenMP runtime into the process
engine = load_engine(MODEL)
prompt = engine.encode("the engine thread computes this prompt " * 40)
want = engine.prefill(prompt).logits

def engine_thread():
    et = threads.EngineThreads()
    out["took"] = et.take()
    out["engine"] = {}
    for n in range(1, own + 1):
        used = et.use(n)
        same = torch.equal(engine.prefill(prompt).logits, want)
        out["engine"][n] = [used, torch.get_num_threads(), same]
    later = threading.Thread(target=lambda: out.setdefault("later", torch.get_num_threads()))
    later.start(); later.join()
    out["engine_after"] = torch.get_num_threads()
    sys.stdin.readline()  # the test's busy processes run from now on
    et.fit(); time.sleep(2 * threads.WINDOW_S)
    out["fit_busy"], out["others"] = et.fit(), et.load.others

t = threading.Thread(target=engine_thread); t.start(); t.join()
out["main_after"] = torch.get_num_threads()
print(json.dumps(out), flush=True)
"""


def probe(reserve: bool, busy: int = 0) -> dict:
    """Run PROBE in a fresh process; ``busy`` busy-looping processes (pinned to its
    CPUs) run while it measures the load."""
    code = PROBE.replace("RESERVE", str(reserve)).replace("MODEL", repr("demo-tiny"))
    loops = []
    p = subprocess.Popen(
        [sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        for _ in range(busy):
            loops.append(subprocess.Popen([sys.executable, "-c", "while True: pass"]))
        time.sleep(0.3 if busy else 0.0)
        out, _ = p.communicate("go\n", timeout=120)
    finally:
        for q in loops:
            q.kill()
            q.wait()
        if p.poll() is None:
            p.kill()
    return json.loads(out)


def test_reserved_threads_go_to_the_engine_thread_alone():
    out = probe(reserve=True)
    own = out["own"]
    assert out["main"] == out["main_after"] == out["later"] == 1
    assert 1 <= out["took"] <= own
    for n, (used, seen, same) in out["engine"].items():
        assert used == seen == int(n), out["engine"]  # the thread's own count, as torch sees it
        assert same  # a forward computes the same at every count
    assert out["engine_after"] == own  # a later thread's start left it alone


def test_without_a_reservation_nothing_changes():
    out = probe(reserve=False)
    own = out["own"]
    assert out["took"] == 0
    assert out["main"] == out["later"] == out["engine_after"] == own
    assert all(used == 0 and seen == own for used, seen, _ in out["engine"].values())


def test_with_every_core_busy_elsewhere_the_engine_takes_one_thread():
    cores = len(os.sched_getaffinity(0))
    out = probe(reserve=True, busy=cores)
    assert out["fit_busy"] == 1
    assert out["others"] >= 0.5 * cores  # the busy loops, measured as others' load


@pytest.mark.parametrize(
    ("free", "most", "want"),
    [(2.0, 2, 2), (1.6, 2, 2), (1.4, 2, 1), (0.0, 2, 1), (-0.5, 2, 1), (7.9, 4, 4), (3.2, 8, 3)],
)
def test_one_thread_per_core_others_leave_idle(free, most, want):
    assert threads.threads_for(free, most) == want


def test_a_head_reports_its_engine_thread_s_count_and_serves():
    own = probe(reserve=False)["own"]
    head = Head(model=str(zoo.hf_model("qwen2")))
    try:
        model = head.http.get("/v1/models").json()["data"][0]["id"]
        body = {"model": model, "prompt": "one two", "max_tokens": 2}
        r = head.http.post("/v1/completions", json=body)
        assert r.status_code == 200, r.text
        assert 1 <= head.health()["batch"]["torch_threads"] <= own
    finally:
        head.stop()
