"""A ``kvmesh head`` computes on the only OpenMP team in its process.

libgomp keeps a team for every thread that ran a parallel region, for as long as
that thread lives, and once it manages more threads than there are CPUs it stops
spinning between regions: each small op of the engine thread's forwards then waits
for its workers' futex wake-up (measured on 2 cores: a 68-token forward over 512
cached 15-20% slower, thousands of context switches where a lone team has tens). A
head loads, probes and warms its engine, and scores echoed prompts, on passing
threads (:func:`kvmesh.runtime.ready.on_passing_thread`). Here a real head serves
cold and cached prompts, two at once (a decode step riding a prefill), a stream
and an echoed prompt's log-probabilities; then its native stacks (gdb) hold the
workers of one team only: threads started by ``gomp_thread_start``, one per team
with ``OMP_NUM_THREADS=2`` whatever the machine's CPU count.
"""

from __future__ import annotations

import shutil
import subprocess
import threading

import pytest

from kvmesh.runtime.ready import on_passing_thread

from .test_api import Head


def gomp_workers(pid: int) -> int:
    """libgomp worker threads in process ``pid`` now (gdb attaches and leaves)."""
    gdb = shutil.which("gdb")
    assert gdb, "gdb reads the head's native stacks (.ci/run installs it)"
    out = subprocess.run(
        [gdb, "-p", str(pid), "-batch", "-ex", "thread apply all bt"],
        capture_output=True,
        text=True,
        timeout=120,
    ).stdout
    assert out.count("\nThread ") > 2, out[-2000:]  # attached: the threads are listed
    return out.count("gomp_thread_start")


def _serve_every_kind(head: Head) -> None:
    prompt = [5 + (i * 11) % 250 for i in range(300)]
    body = {"model": "demo-tiny", "prompt": prompt, "max_tokens": 8, "temperature": 0}
    for _ in range(2):  # cold, then its prefix imported
        assert head.http.post("/v1/completions", json=body).status_code == 200
    errors: list[int] = []

    def long_one(i: int) -> None:
        r = head.http.post(
            "/v1/completions",
            json={**body, "prompt": [7 + i] + prompt, "max_tokens": 24, "ignore_eos": True},
        )
        errors.extend([r.status_code] if r.status_code != 200 else [])

    pair = [threading.Thread(target=long_one, args=(i,)) for i in range(2)]
    for t in pair:
        t.start()
    for t in pair:
        t.join()
    assert not errors
    chat = {"model": "demo-tiny", "messages": [{"role": "user", "content": "hi"}], "stream": True}
    with head.http.stream("POST", "/v1/chat/completions", json={**chat, "max_tokens": 4}) as r:
        assert r.status_code == 200 and "[DONE]" in r.read().decode()
    echo = {**body, "echo": True, "logprobs": 2, "max_tokens": 1}
    r = head.http.post("/v1/completions", json=echo)
    assert r.status_code == 200
    assert len(r.json()["choices"][0]["logprobs"]["token_logprobs"]) == len(prompt) + 1


def test_a_head_keeps_one_openmp_team_through_start_and_every_kind_of_request(monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "2")  # a team: the thread and one worker
    head = Head()
    try:
        assert gomp_workers(head.proc.pid) == 0  # nothing left of load and warm-up
        _serve_every_kind(head)
        assert head.metric("kvmesh_batch_ridden_steps_total") >= 1
        assert gomp_workers(head.proc.pid) == 1
    finally:
        head.stop()


def test_a_passing_thread_returns_or_raises_on_the_caller_and_has_ended():
    ran: list[threading.Thread] = []

    def work() -> int:
        ran.append(threading.current_thread())
        return 7

    assert on_passing_thread(work) == 7
    assert ran[0] is not threading.current_thread() and not ran[0].is_alive()

    def fail() -> None:
        ran.append(threading.current_thread())
        raise KeyError("inside")

    with pytest.raises(KeyError, match="inside"):
        on_passing_thread(fail, name="kvmesh-test")
    assert ran[1].name == "kvmesh-test" and not ran[1].is_alive()
