"""A session resume computes its new tokens as any prompt's suffix (issue #37), on
real engines with real forward passes; the long case runs in a process of its own.

- A long resume (6,200 new tokens on a kept session of ~1,030) is computed in
  chunks of at most ``prefill_chunk`` tokens, each followed by a decode step of
  the stream running beside it: between two of the stream's tokens there is at
  most one prefill forward, of at most one chunk. Asserted in forwards, tokens and
  positions, never in time.
- Its peak working memory (the process's resident high-water mark over the
  resume, glibc told to hand freed memory back at once) stays inside what the KV
  budget charged the request before admitting it. Computing the 6,200 tokens in
  one forward (the old path) peaked at +314 MiB on demo-tiny, for ~51 MiB charged.
- Its answer is the cold run's (the same prompt computed from nothing, in chunks):
  the same tokens, each token's top logprobs within float32 rounding.
- Sliding-window models the same (a session past the window, resumed in chunks).
"""

from __future__ import annotations

import gc
import json
import math
import os
import subprocess
import sys
import threading

from kvmesh.engine import Sampling, load_engine
from kvmesh.engine.base import Decoded
from kvmesh.engine.embedded import ensure_demo
from kvmesh.runtime.head import Generation, HeadRuntime

from . import zoo

GREEDY = Sampling(max_tokens=4, stop_on_eos=False, logprobs=5)


def _status(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(key)


def _reset_peak() -> None:
    """Start the process's resident high-water mark (VmHWM) again from now."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def top(out: Decoded) -> list[list[tuple[int, float]]]:
    return [list(lp.top) for lp in out.logprobs]


def cold(engine, tokens: list[int], chunk: int) -> tuple[list[int], list]:
    """The greedy answer of ``tokens`` computed from nothing, ``chunk`` at a time,
    and each token's top logprobs."""
    state, out = engine.prefill(tokens, between=lambda: None, chunk=chunk), Decoded()
    list(engine.generate(state, GREEDY, out))
    return out.tokens, top(out)


def resume_beside_a_stream(
    engine, turn1: list[int], new: list[int], chunk: int, stream_prompt: list[int]
) -> dict:
    """Turn 1 keeps a session; a stream starts; turn 2 (turn 1, its answer and
    ``new``) resumes the session while the stream decodes. Returns what happened:
    at each of the stream's tokens, the prefill forwards and tokens so far."""
    h = HeadRuntime(engine, publish=False, max_sessions=4, prefill_chunk=chunk)
    try:
        out1 = Generation()  # turn 1, alice's own: turn 2 resumes it token for token
        list(h.generate(turn1, Sampling(max_tokens=8, stop_on_eos=False), out1, client="alice"))
        turn2 = turn1 + out1.tokens + new
        trace: list[tuple[int, int]] = []  # at each stream token: (forwards, prefill tokens)
        resumed_at: list[int] = []  # len(trace) at the resume's first token
        stream, started = Generation(), threading.Event()

        def stream_token() -> None:
            trace.append((h.batch.prefill_forwards, h.batch.prefill_tokens))
            started.set()

        long = Sampling(max_tokens=400, stop_on_eos=False)
        t = threading.Thread(
            target=lambda: list(
                h.generate(stream_prompt, long, stream, client="stream", on_token=stream_token)
            ),
            daemon=True,
        )
        t.start()
        assert started.wait(120)
        h.batch.peak_prefill_chunk = 0  # turn 1 and the stream's prompt ran alone: widened
        gc.collect()
        _reset_peak()
        base = _status("VmRSS")
        before = (len(trace), h.batch.prefill_forwards, h.batch.prefill_tokens)
        out2 = Generation()
        for _ in h.generate(
            turn2,
            GREEDY,
            out2,
            client="alice",
            on_token=lambda: resumed_at.append(len(trace)) if not resumed_at else None,
        ):
            pass
        peak = _status("VmHWM") - base
        kv = h._kv_bytes(len(turn2), GREEDY)
        charged = h.batch.charge(kv, 1, len(turn2))
        t.join(300)
        assert not t.is_alive()
        report = out2.report
        assert report is not None
        return {
            "source": str(report.source),
            "reused": report.reused_tokens,
            "computed": report.computed_tokens,
            "trace": trace,
            "before": before,
            "resumed_at": resumed_at[0],
            "stream_tokens": len(stream.tokens),
            "peak_prefill_chunk": h.batch.peak_prefill_chunk,
            "peak_bytes": peak,
            "charged": charged,
            "answer": [out2.tokens, top(out2.choices[0])],
            "cold": cold(engine, turn2, chunk),
            "turn2": len(turn2),
        }
    finally:
        h.close()


def check_chunked(got: dict, chunk: int, new: int) -> None:
    """The structure every resume keeps: chunks, and the stream's steps between them."""
    assert got["source"] == "session"
    assert got["computed"] >= new and got["reused"] + got["computed"] == got["turn2"]
    assert got["peak_prefill_chunk"] <= chunk
    trace, (mark, forwards0, tokens0) = got["trace"], got["before"]
    # between any two of the stream's tokens: at most one prefill forward, of at
    # most one chunk (the stream waited one chunk and its own step, never more)
    for (f0, n0), (f1, n1) in zip(trace, trace[1:], strict=False):
        assert f1 - f0 <= 1 and n1 - n0 <= chunk, (f0, n0, f1, n1)
    # the resume took at least ceil(new / chunk) forwards, the stream decoding
    # between them: still running when the resume's first token came
    during = trace[mark : got["resumed_at"]]
    assert during and during[-1][1] - tokens0 >= got["computed"]
    assert during[-1][0] - forwards0 >= math.ceil(got["computed"] / chunk)
    assert len(during) >= math.ceil(got["computed"] / chunk) - 1
    assert got["resumed_at"] < got["stream_tokens"] == 400
    (tokens, tops), (want, want_tops) = got["answer"], got["cold"]
    assert tokens == want  # as the cold run answers
    for mine, theirs in zip(tops, want_tops, strict=True):
        assert [t for t, _ in mine] == [t for t, _ in theirs]
        assert all(abs(a[1] - b[1]) <= 1e-4 for a, b in zip(mine, theirs, strict=True))


def demo_scenario() -> dict:
    engine = load_engine(str(ensure_demo("demo-tiny")), "torch")
    text = "".join(f"Turn {i}: a conversation that goes on and on. " for i in range(400))
    toks = engine.encode(text)
    return resume_beside_a_stream(engine, toks[:1024], toks[1024:7224], 512, toks[:20])


def test_a_long_resume_is_chunked_between_a_streams_steps_within_its_charge():
    """In its own process (demo-tiny): glibc returns freed memory at once, so the
    resident high-water mark over the resume is its working memory."""
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536", "MALLOC_TRIM_THRESHOLD_": "0"}
    run = subprocess.run(
        [sys.executable, "-m", "tests.test_sessions_resume"],
        capture_output=True,
        text=True,
        env=env,
        timeout=1200,
        cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
    )
    assert run.returncode == 0, run.stderr[-3000:]
    got = json.loads(run.stdout.strip().splitlines()[-1])
    assert got["reused"] >= 1000 and got["computed"] >= 6000
    check_chunked(got, 512, 6200)
    assert 0 < got["peak_bytes"] <= got["charged"], (got["peak_bytes"], got["charged"])


def test_a_sliding_window_session_past_its_window_resumes_in_chunks():
    path = zoo.hf_model("mistral")  # sliding window 96
    engine = load_engine(str(path), "torch")
    assert any(engine.card.sliding_windows)
    toks = zoo.prompt_tokens(path, 1400, seed=5)
    got = resume_beside_a_stream(engine, toks[:300], toks[300:1300], 64, toks[1300:1320])
    assert got["reused"] >= 300
    check_chunked(got, 64, 1000)


if __name__ == "__main__":  # the long case, in a process of its own (see above)
    print(json.dumps(demo_scenario()))
