"""``/v1/cache/query`` and a head's request take the same decision for the same
prompt, in the states where the query's plan once was a second spelling of it:

- a cache-time budget that forbids fetching (the plan ignored the budget and
  said ``remote``; the request fell back with ``budget``);
- a prefix held here (the plan asked the fleet before the "seek more?" check,
  teaching the planner from a lookup the request never makes);
- a link measured too slow whose recheck is due (the plan's question took the
  recheck, so the request after it computed what the query said it would fetch).

Real head processes and a real peer process on loopback (as
``tests/test_cache_query.py``); the recheck on a head in this process (its
planner's clock moved past the recheck interval) and on the planner alone.
"""

from __future__ import annotations

import time

from kvmesh.engine import Sampling
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


def test_a_slow_links_recheck_is_left_to_the_request(tiny_engine, tmp_path):
    """A peer holds the prompt over a link measured too slow to fetch from: the
    query and the completion both compute; once the recheck is due, any number of
    queries say ``remote``, and the completion after them does fetch (the plan
    once took the recheck for itself: the completion then computed)."""
    from kvmesh.api.cache_query import cached_prefix

    from .test_mesh import close, fresh_head, published

    peer = Peer(alias="rpeer", log_dir=tmp_path)
    try:
        tokens = prompt(21, 3 * B + 9)
        published(tiny_engine, [peer], tokens)  # its blocks and tail
        now = [time.time()]
        planner = Planner(prefill_tps=1.0, wall=lambda: now[0])  # computing is slow...
        head = fresh_head(tiny_engine, [peer], runtime={"planner": planner, "max_sessions": 0})
        try:
            planner.observe_probe(1, 10.0)  # ...and the budget is the fetch deadline
            (hit,) = head.acquirer.offers(head.card, head.keyer.keys(tokens))
            # measured far slower than computing: ~100 B/s
            slow = {"wire_bytes": 1 << 20, "raw_bytes": 1 << 20, "link_s": 1e4}
            planner.observe_link(hit.node_id, interface=hit.interface, **slow)
            q = cached_prefix(head, tokens)
            assert (q["source"], q["cached_tokens"], q["fallback"]) == ("compute", 0, None)
            now[0] += RECHECK_S + 1  # the link is rechecked once: by the next request
            answers = [cached_prefix(head, tokens) for _ in range(3)]
            out = head.complete(tokens, Sampling(max_tokens=1))
            assert out.report is not None
            assert out.report.source == "remote" and out.report.peer == "rpeer"
            for a in answers:
                assert (a["source"], a["peer"], a["fallback"]) == ("remote", "rpeer", None), a
                assert a["cached_tokens"] == out.report.reused_tokens == len(tokens)
        finally:
            close(head)
    finally:
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
