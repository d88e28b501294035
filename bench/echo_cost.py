"""Prompt log-probabilities on a cached prefix: recompute them when asked, or record
them in every published block? Both measured on one engine, side by side.

    python bench/echo_cost.py --json bench/results/echo_cost.json [--model demo]
                              [--tokens 512,2048] [--rounds 3] [--vocab 151936]
    python bench/echo_cost.py --smoke --json /tmp/echo_cost.json   # demo-tiny, 128 tokens

An imported prefix holds keys and values, not the logits of its positions; an
``echo`` + ``logprobs`` request (lm-evaluation-harness's loglikelihood) needs each
prompt token's log-probability. Two designs:

  recompute  what kvmesh does (``kvmesh.engine.scoring``): a forward over the whole
             prompt with logits at every position, when an echo asks; nothing else
             pays anything.
  record     every producer computes the logits at every position of every prefill
             it publishes (the LM head over all positions, a log-softmax, the top
             ``k``) and ships ``(logprob, top-k ids, top-k logprobs)`` per token in
             its blocks; an echo on a hit then costs only those bytes.

Per prompt length, alternated ``--rounds`` times (medians): ``prefill_s``, the
engine's prefill (logits at the last position: what every request pays);
``score_s``, the scoring forward (``prompt_logprobs``, top 1: what an echo costs
under recompute); ``record_tax_s``, the LM head at every position with its
log-softmax and top 1 (what recording adds to *every* published prefill). The demo
models' vocabulary is 320 bytes, no real LM head: the tax is measured with a head of
``--vocab`` rows (Qwen2.5's 151,936 by default) at the model's hidden size, and
``score_at_vocab_s`` is the scoring forward with that head in place of its own
(its own head's time, measured the same way, swapped for it). Derived:
the tax against the prefill, the bytes recording adds per token (top 1 and top 5)
against the KV's, and the break-even: recording costs less only when more than
``record_tax_s / score_s`` of published prefills are later echoed.
"""

from __future__ import annotations

import argparse
import functools
import json
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from _common import machine, run_main

from kvmesh.engine import load_engine
from kvmesh.engine.scoring import SCORE_CHUNK, prompt_logprobs

ROOT = Path(__file__).resolve().parents[1]
# what a recorded token would carry: its logprob (f32), then per alternative an id
# (i32) and a logprob (f32)
RECORD_BYTES = {"top1": 4 + 1 * 8, "top5": 4 + 5 * 8}
QWEN_VOCAB = 151_936  # Qwen2.5's tokenizer; the demo models' byte vocab (320) is no LM head


def timed(fn: Any) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def lm_head_all(hidden: int, vocab: int, dtype: Any, n: int) -> None:
    """What recording adds to a prefill: an LM head of ``vocab`` rows at every position
    (not only the last), a float32 log-softmax and the top 1, ``SCORE_CHUNK`` rows at
    a time (random weights: the cost does not depend on them)."""
    import torch

    head = _head(hidden, vocab, dtype)
    with torch.inference_mode():
        for start in range(0, n, SCORE_CHUNK):
            h = torch.randn(min(SCORE_CHUNK, n - start), hidden, dtype=dtype)
            lp = torch.log_softmax(head(h).float(), dim=-1)
            torch.topk(lp, 1, dim=-1)


@functools.cache
def _head(hidden: int, vocab: int, dtype: Any) -> Any:
    import torch

    return torch.nn.Linear(hidden, vocab, bias=False, dtype=dtype)


def measure(engine: Any, n: int, vocab: int, rounds: int, seed: int) -> dict[str, Any]:
    rng = random.Random(seed)
    tokens = [rng.randrange(4, engine.card.vocab_size) for _ in range(n)]
    weight = engine.model.get_output_embeddings().weight
    hidden, own, dtype = int(weight.shape[1]), int(weight.shape[0]), weight.dtype
    runs: dict[str, list[float]] = {"prefill": [], "score": [], "tax_own": [], "tax": []}
    work = {
        "prefill": lambda: engine.prefill(tokens),
        "score": lambda: prompt_logprobs(engine, tokens, top=1),
        "tax_own": lambda: lm_head_all(hidden, own, dtype, n),
        "tax": lambda: lm_head_all(hidden, vocab, dtype, n),
    }
    for fn in work.values():  # first-call set-up of each at this length, not counted
        fn()
    for _ in range(rounds):
        for name, fn in work.items():
            runs[name].append(timed(fn))
    p, s, t_own, t = (statistics.median(runs[k]) for k in ("prefill", "score", "tax_own", "tax"))
    # the scoring forward with a vocab-sized head: its own head's share swapped out
    s_vocab = s - t_own + t
    kv = engine.card.kv_bytes_per_token
    return {
        "tokens": n,
        "hidden": hidden,
        "model_vocab": own,
        "vocab": vocab,
        "prefill_s": p,
        "score_s": s,
        "score_at_vocab_s": s_vocab,
        "record_tax_s": t,
        "record_tax_of_prefill": t / p,
        "break_even_echo_fraction": t / s_vocab,
        "kv_bytes_per_token": kv,
        "record_bytes_per_token": RECORD_BYTES,
        "record_bytes_of_kv": {k: v / kv for k, v in RECORD_BYTES.items()},
        "rounds_s": runs,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="demo", help="demo, demo-tiny or a model directory")
    ap.add_argument("--tokens", default="512,2048", help="prompt lengths, comma-separated")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument(
        "--vocab",
        type=int,
        default=QWEN_VOCAB,
        help="the LM head's rows for the recording tax (default: Qwen2.5's)",
    )
    ap.add_argument("--json", type=Path)
    ap.add_argument("--smoke", action="store_true", help="demo-tiny, 128 tokens, 1 round")
    a = ap.parse_args()
    if a.smoke:
        a.model, a.tokens, a.rounds = "demo-tiny", "128", 1
    engine = load_engine(a.model)
    rows = []
    for i, n in enumerate(int(x) for x in a.tokens.split(",")):
        r = measure(engine, n, a.vocab, a.rounds, seed=i)
        rows.append(r)
        print(
            f"{n} tokens: prefill {r['prefill_s'] * 1e3:.0f} ms, score "
            f"{r['score_at_vocab_s'] * 1e3:.0f} ms at vocab {r['vocab']}; "
            f"recording adds {r['record_tax_of_prefill']:.0%} to every prefill; it pays only "
            f"if > {r['break_even_echo_fraction']:.0%} of prefills are echoed; "
            f"{r['record_bytes_of_kv']['top1']:.2%} of the KV's bytes (top 1)",
            flush=True,
        )
    result = {
        "model": a.model,
        "rounds": a.rounds,
        "vocab": a.vocab,
        "smoke": a.smoke,
        "results": rows,
        "chosen": "recompute",
        "machine": machine(),
    }
    if a.json:
        a.json.parent.mkdir(parents=True, exist_ok=True)
        a.json.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    run_main(main)
