"""A warm heap is given back once its process goes idle (issue #37), in real processes.

Each case runs a fresh Python process that sets its heap up as a head does
(:func:`kvmesh.memory.one_heap`, :func:`kvmesh.memory.keep_heap_warm`), makes
and frees a burst of buffers the way load does, and tells
:func:`kvmesh.memory.after_request` what the engine would: the freed burst stays
resident (the thresholds that keep imports fast keep it too) until the process
has been idle :data:`kvmesh.memory.IDLE_S`, then the trim gives it back and RSS
returns to what the process holds. Working again cancels a pending trim, a
trim waits for every source of work (engine, publisher), and a process that
never kept its heap warm never trims.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

from kvmesh import memory

MiB = 1 << 20
WARM = 32 * MiB

PRELUDE = textwrap.dedent(
    f"""
    import json, random, threading, time
    from kvmesh import memory

    MiB = 1 << 20

    def burst(n=300, keep_every=10):
        # 1-4 MiB buffers, every tenth kept (what stays held: store, sessions)
        rng = random.Random(0)
        kept, junk = [], []
        for i in range(n):
            b = bytearray(rng.randint(1, 4) * MiB + rng.randrange(4096))
            (kept if i % keep_every == 0 else junk).append(b)
        return kept, junk

    def wait_trims(n, timeout=30.0):
        end = time.monotonic() + timeout
        while memory.report(None, None, 0)["trims"] < n and time.monotonic() < end:
            time.sleep(0.05)

    def out(**kw):
        print(json.dumps(kw), flush=True)

    WARM = {WARM}
    """
)


def run(body: str) -> dict:
    code = PRELUDE + textwrap.dedent(body)
    p = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=False
    )
    assert p.returncode == 0, p.stderr
    return json.loads(p.stdout.strip().splitlines()[-1])


def test_an_idle_trim_gives_back_what_a_burst_freed():
    r = run(
        """
        memory.one_heap()
        assert memory.keep_heap_warm(WARM)
        ready = memory.report(None, None, 0)["ready_bytes"]
        memory.after_request(idle=False)  # a request runs
        kept, junk = burst()
        peak = memory.rss_bytes()
        junk_bytes = sum(len(b) for b in junk)
        del junk
        freed = memory.rss_bytes()  # the thresholds keep it: nothing given back yet
        memory.after_request(idle=True)  # the engine has nothing left to run
        wait_trims(1)
        rep = memory.report(128 * MiB, 64 * MiB, MiB)
        out(ready=ready, peak=peak, freed=freed, junk=junk_bytes, kept=sum(len(b) for b in kept),
            idle=memory.rss_bytes(), rep=rep, threads=[t.name for t in threading.enumerate()])
        """
    )
    rep = r["rep"]
    assert r["junk"] > 500 * MiB and r["freed"] > r["peak"] - 64 * MiB  # kept resident by the heap
    assert rep["trims"] == 1 and rep["released_bytes"] > r["junk"] // 2
    # back to the process as it was ready, plus what it still holds (the pad was
    # touched again: already part of the ready figure)
    assert r["idle"] < r["ready"] + r["kept"] + 64 * MiB, r
    assert rep["warm_bytes"] == WARM and rep["last_trim"] is not None
    assert rep["bound_bytes"] == 193 * MiB and rep["model_bytes"] == MiB
    assert rep["heap"]["free"] >= 0 and rep["heap"]["in_use"] > r["kept"]
    assert "kvmesh-heap-trim" in r["threads"]


def test_a_trim_follows_each_burst_not_each_idle_pass():
    """Free heap a trim released is still free heap: later idle passes with nothing
    new to give back do not trim again; the next burst's leftovers are trimmed."""
    r = run(
        """
        memory.one_heap()
        memory.keep_heap_warm(WARM)
        def idle_pass(n):
            memory.after_request(idle=False)
            memory.after_request(idle=True)
            end = time.monotonic() + 30
            while memory.report(None, None, 0)["idle_passes"] < n and time.monotonic() < end:
                time.sleep(0.05)
        memory.after_request(idle=False)
        kept, junk = burst()
        del junk
        idle_pass(1)
        idle_pass(2)
        idle_pass(3)
        quiet = memory.report(None, None, 0)["trims"]
        memory.after_request(idle=False)
        more, junk = burst(n=200)
        del junk
        idle_pass(4)
        rep = memory.report(None, None, 0)
        out(quiet=quiet, trims=rep["trims"], passes=rep["idle_passes"])
        """
    )
    assert r == {"quiet": 1, "trims": 2, "passes": 4}


def test_working_again_cancels_a_pending_trim():
    r = run(
        """
        memory.one_heap()
        memory.keep_heap_warm(WARM)
        memory.after_request(idle=False)
        kept, junk = burst()
        del junk
        memory.after_request(idle=True)
        memory.after_request(idle=False)  # a request came in before the quiet was over
        time.sleep(3 * memory.IDLE_S)
        busy = memory.report(None, None, 0)["trims"]
        memory.after_request(idle=True)
        wait_trims(1)
        out(busy=busy, after=memory.report(None, None, 0)["trims"])
        """
    )
    assert r == {"busy": 0, "after": 1}


def test_a_trim_waits_for_every_source_of_work():
    """The engine is idle but the publisher still exports: no trim until it is done."""
    r = run(
        """
        memory.one_heap()
        memory.keep_heap_warm(WARM)
        memory.after_request(idle=False)
        memory.after_request(idle=False, source="publish")
        kept, junk = burst()
        del junk
        memory.after_request(idle=True)  # the engine is done, the publisher is not
        time.sleep(3 * memory.IDLE_S)
        publishing = memory.report(None, None, 0)["trims"]
        memory.after_request(idle=True, source="publish")
        wait_trims(1)
        out(publishing=publishing, after=memory.report(None, None, 0)["trims"])
        """
    )
    assert r == {"publishing": 0, "after": 1}


def test_a_process_that_keeps_no_warm_heap_never_trims():
    r = run(
        """
        kept, junk = burst()
        del junk
        memory.after_request(idle=True)
        time.sleep(3 * memory.IDLE_S)
        rep = memory.report(None, None, 0)
        out(trims=rep["trims"], warm=rep["warm_bytes"], ready=rep["ready_bytes"],
            threads=[t.name for t in threading.enumerate()])
        """
    )
    assert r["trims"] == 0 and r["warm"] == 0 and r["ready"] == 0
    assert "kvmesh-heap-trim" not in r["threads"]


def test_the_report_reads_rss_against_the_budgets():
    rep = memory.report(128 * MiB, None, 3 * MiB)  # no --kv-budget: counts 0
    assert rep["bound_bytes"] == 131 * MiB and rep["kv_budget_bytes"] is None
    assert rep["rss_bytes"] > 0 and rep["ratio"] == round(rep["rss_bytes"] / (131 * MiB), 3)
    assert memory.report(None, None, 0)["ratio"] is None  # nothing to compare with
    json.dumps(rep)  # as /healthz serves it


def test_model_bytes_counts_shared_weights_once():
    import torch

    emb = torch.nn.Embedding(100, 16)
    head = torch.nn.Linear(16, 100, bias=False)
    head.weight = emb.weight  # tied, as many small models are
    model = torch.nn.Sequential(emb, head)
    model.register_buffer("scale", torch.ones(4))
    assert memory.model_bytes(model) == 100 * 16 * 4 + 4 * 4
    assert memory.model_bytes(None) == 0  # an engine without a model object
