"""A library ``HeadRuntime`` in a process of its own, as a ``MeshClient`` user runs one
(``bench/ttft.py``'s client, a program embedding kvmesh): for tests/test_ready.py.

    python -m tests.library_head PEER TOKENS bare|ready

``ready``: :func:`kvmesh.runtime.ready.prepare_process` first thing (before torch
loads), then what follows gets the rest through ``HeadRuntime.warm_up``; ``bare``:
neither. A first runtime computes a prompt and publishes it to the cache peer at
``PEER``; once the process has been idle as long as a head's first idle pass
(:data:`kvmesh.memory.IDLE_S`, and that pass if the heap is kept warm), a fresh
runtime (a new node, an empty store) fetches it. Prints one JSON line: the hit's
source, bytes fetched and reused tokens, and the minor page faults this process
took during that request (``/proc/self/stat``).
"""

from __future__ import annotations

import json
import sys
import time


def minor_faults(pid: int | str = "self") -> int:
    """Minor page faults of process ``pid`` so far, all its threads."""
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[7])


def main(peer: str, n_tokens: int, mode: str) -> dict[str, object]:
    if mode == "ready":  # first thing: torch's threads must find one heap
        from kvmesh.runtime.ready import prepare_process

        prepare_process()
    from kvmesh import memory
    from kvmesh.engine import Sampling, load_engine
    from kvmesh.mesh.node import NodeConfig, NodeThread
    from kvmesh.runtime.head import HeadRuntime

    engine = load_engine("demo-tiny", "torch")
    prompt = [5 + (i * 7) % 200 for i in range(n_tokens)]
    one = Sampling(max_tokens=1)

    def runtime(alias: str, publish: bool) -> HeadRuntime:
        cfg = NodeConfig(seeds=[peer], alias=alias, gossip_interval=0.3, ttl=2, roles=("head",))
        rt = HeadRuntime(engine, NodeThread(cfg), max_sessions=0, publish=publish)
        _wait(lambda: rt.fleet is not None and bool(rt.fleet.compatible_peers(rt.card)))
        return rt

    first = runtime("library-first", True)
    try:
        assert first.complete(prompt, one).report is not None
        first.flush(60)
        time.sleep(memory.IDLE_S)  # as idle as the head it is compared with
        if memory.report(None, None, 0)["warm_bytes"]:  # its first idle pass, as the head's
            _wait(lambda: memory.report(None, None, 0)["idle_passes"] >= 1)
    finally:  # (after that pass: a closed runtime's engine loop never says it is idle)
        _close(first)
    fresh = runtime("library-fresh", False)
    try:
        before = minor_faults()
        hit = fresh.complete(prompt, one)
        faults = minor_faults() - before
    finally:
        _close(fresh)
    r = hit.report
    assert r is not None
    return {
        "source": r.source,
        "bytes_fetched": r.bytes_fetched,
        "reused_tokens": r.reused_tokens,
        "faults": faults,
    }


def _wait(pred, timeout: float = 30.0) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            raise TimeoutError("library head: condition not met")
        time.sleep(0.05)


def _close(rt) -> None:  # type: ignore[no-untyped-def]
    rt.close()
    rt.node.close()


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1], int(sys.argv[2]), sys.argv[3])), flush=True)
