"""``/v1/cache/query`` and a head's request take the same decision for the same
prompt, in the states where the query's plan once was a second spelling of it:

- a cache-time budget that forbids fetching (the plan ignored the budget and
  said ``remote``; the request fell back with ``budget``);
- a prefix held here (the plan asked the fleet before the "seek more?" check,
  teaching the planner from a lookup the request never makes);
- a link measured too slow whose recheck is due (the plan's question took the
  recheck, so the request after it computed what the query said it would fetch).

Real head processes and a real peer process on loopback (as
``tests/test_cache_query.py``); the recheck on the planner a head asks.
"""

from __future__ import annotations

from kvmesh.runtime.planner import RECHECK_S, Planner

from .procs import Peer
from .test_api import Head
from .test_cache_query import B, agree, complete, prompt, query

MINE = "--exact-reuse-by-address"  # a keyless caller's tails are its own (as test_cache_query)


def test_budget_and_a_prefix_held_here(tmp_path):
    """A peer holds the prompt; a head whose fetch deadline leaves no budget
    falls back (``budget``) in the query and the completion alike; then, holding
    the prompt itself, both take it from here, and the fleet is not what decides."""
    peer = Peer(alias="apeer", log_dir=tmp_path)
    heads: list[Head] = []
    try:
        first = Head("--seed", peer.address, MINE, "--alias", "afirst")
        heads.append(first)
        first.wait(lambda s: s["peers"] >= 1)
        tokens = prompt(11, 3 * B + 9)
        agree(first, tokens, "compute")  # computed, published to the peer
        # a deadline no fetch can meet: the budget (at most the deadline, less the
        # lookup's time) is spent before any candidate is tried
        tight = Head("--seed", peer.address, MINE, "--alias", "atight", "--fetch-timeout", "1e-6")
        heads.append(tight)
        tight.wait(lambda s: s["compatible_peers"] >= 2)  # the peer and the first head
        q = query(tight, tokens)
        assert q["prefix"]["apeer"] == len(tokens)  # the peer holds it all: a fetch would pay
        c = complete(tight, tokens)
        assert (q["source"], q["fallback"], q["peer"]) == ("compute", "budget", None), q
        assert (c["kvmesh"]["source"], c["kvmesh"]["fallback"]) == ("compute", "budget")
        assert q["cached_tokens"] == c["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        tight.wait(lambda s: s["publish_pending"] == 0)
        # now held here, whole: no fleet asked for the decision; the report still
        # shows what the peer holds
        held = agree(tight, tokens, "local")
        assert held["cached_tokens"] == held["prefix"]["local"] == len(tokens)
        assert held["fallback"] is None and held["prefix"]["apeer"] == len(tokens)
        # a longer prompt: more is wanted, the fleet holds no more than here, so
        # the budget never comes into it; both take the stored blocks
        longer = tokens + prompt(12, 2 * B)
        more = agree(tight, longer, "session")
        assert more["fallback"] is None
    finally:
        for h in heads:
            h.stop()
        peer.kill()


def test_a_plans_question_takes_no_recheck():
    """A link measured too slow is fetched from once more after ``RECHECK_S``: a
    plan asking the planner (``remember=False``) leaves that recheck to the
    request, which takes it once."""
    now = [0.0]
    planner = Planner(prefill_tps=100.0, wall=lambda: now[0])
    # 1 MiB in 100 s: fetching 1,000 tokens' blocks loses to computing them (10 s)
    planner.observe_link(
        "p", wire_bytes=1 << 20, raw_bytes=1 << 20, link_s=100.0, interface="loopback"
    )
    args = ("p", "loopback", 1000, 1 << 20)
    assert not planner.choose(*args).fetch  # just measured: no recheck yet
    now[0] = RECHECK_S + 1
    asked = [planner.choose(*args, remember=False).fetch for _ in range(3)]
    assert asked == [True, True, True]  # what the request would do, each time
    assert planner.choose(*args).fetch  # the request takes the recheck
    assert not planner.choose(*args).fetch  # and only once
