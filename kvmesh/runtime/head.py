"""The head runtime: one engine, its live sessions, and the fleet behind it.

``generate`` is the path of one request (DESIGN.md, "The path of one request"):
a live session holding a prefix is extended without any lookup; otherwise the
local store and the live compatible peers are asked concurrently, the planner
decides whether fetching beats computing, the chosen prefix is fetched and
verified, the suffix is computed, and decode runs locally. Every cache failure
is caught here, counted as a fallback reason, and answered by local prefill
(invariant 1). Publishing starts only after the last token (invariant 3: the
decode loop makes no remote call) and runs on a background thread.
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import numpy as np

from ..blocks import BlockKeyer
from ..codec import Block
from ..engine import Engine, KVState, Sampling
from ..errors import KVMeshError
from ..mesh.node import NodeThread
from ..store import Match
from .planner import Planner
from .telemetry import PrefillReport, Telemetry

log = logging.getLogger("kvmesh.head")


@dataclass
class Generation:
    """Filled in while a request runs; final once its iterator is exhausted."""

    report: PrefillReport | None = None
    tokens: list[int] = field(default_factory=list)
    ttft_s: float = 0.0
    finish_reason: str = "length"


class HeadRuntime:
    def __init__(
        self,
        engine: Engine,
        node: NodeThread | None = None,
        *,
        hash_key: bytes | None = None,
        planner: Planner | None = None,
        telemetry: Telemetry | None = None,
        max_sessions: int = 8,
        fetch_timeout: float = 30.0,
        publish: bool = True,
        max_pending_publishes: int = 2,
    ) -> None:
        self.engine = engine
        self.card = engine.card
        self.node = node
        self.keyer = BlockKeyer(self.card.namespace, self.card.block_tokens, hash_key)
        self.planner = planner or Planner()
        self.telemetry = telemetry or Telemetry()
        self.max_sessions = max_sessions
        self.fetch_timeout = node.node.client.fetch_deadline if node else fetch_timeout
        self.publish_enabled = publish
        self._lock = threading.Lock()  # one sequence at a time on the engine
        self._sessions: OrderedDict[int, KVState] = OrderedDict()
        self._next_session = 0
        self._publisher = concurrent.futures.ThreadPoolExecutor(
            1, thread_name_prefix="kvmesh-publish"
        )
        self._pending = 0
        self._max_pending = max_pending_publishes
        self._pending_lock = threading.Lock()
        if node is not None:
            node.node.extra_namespaces[self.card.namespace_hex] = self.card.summary()
            node.node.config.roles = tuple(sorted({"head", *node.node.config.roles}))

    # -- the request path ------------------------------------------------------

    def generate(self, tokens: Sequence[int], sampling: Sampling, out: Generation) -> Iterator[int]:
        """Prefill (planned) then decode locally, yielding tokens; publish after."""
        tokens = list(tokens)
        with self._lock:
            t0 = time.perf_counter()
            state, report, chain = self.prefill(tokens)
            out.report = report
            prompt_view = KVState(list(tokens), state.cache, state.logits, len(tokens))
            for i, tok in enumerate(self.engine.generate(state, sampling)):
                if i == 0:
                    out.ttft_s = time.perf_counter() - t0
                out.tokens.append(tok)
                yield tok
                if tok in self.engine.eos_ids and sampling.stop_on_eos:
                    out.finish_reason = "stop"
            self.telemetry.record(report, len(out.tokens))
            self._keep_session(state)
        if self.publish_enabled:
            self._publish_later(prompt_view, state, chain)

    def complete(self, tokens: Sequence[int], sampling: Sampling) -> Generation:
        out = Generation()
        for _ in self.generate(tokens, sampling, out):
            pass
        return out

    def prefill(self, tokens: list[int]) -> tuple[KVState, PrefillReport, tuple[Block, ...]]:
        """State for ``tokens`` and how it was obtained; also the reused block chain."""
        t0 = time.perf_counter()
        session = self._take_session(tokens)
        if session is not None:
            state, keep = session
            try:
                st = self.engine.resume(state, keep, tokens)
            except Exception as e:  # e.g. a rotated sliding-window cache: plan as usual
                log.info("session not reusable (%r); planning the prefill", e)
            else:
                dt = time.perf_counter() - t0
                self.planner.observe_prefill(st.computed_tokens, dt)
                report = PrefillReport(
                    "session", len(tokens), st.imported_tokens, st.computed_tokens, compute_s=dt
                )
                return st, report, ()

        keys = self.keyer.keys(tokens)
        local = self.node.node.store.longest_prefix(keys) if self.node else Match((), None)
        prefix: tuple[Block, ...] = local.all()
        source = "local" if local.tokens else "compute"
        fallback = peer = importer = None
        fetched_bytes = 0
        lookup_s = fetch_s = 0.0
        if self.node is not None and local.tokens < len(tokens):
            t1 = time.perf_counter()
            hits, errors = self._remote_lookup(keys)
            lookup_s = time.perf_counter() - t1
            best = hits[0] if hits and hits[0].tokens > local.tokens else None
            if best is None and errors:
                fallback = errors[0]
            if best is not None:
                skip = len(local.blocks) if local.tail is None else 0
                infos = best.infos[skip:]
                nbytes = sum(i.nbytes for i in infos)
                est = self.planner.estimate(best.node_id, best.tokens - local.tokens, nbytes)
                if not est.worth_it:
                    self.telemetry.count("planned_compute")
                else:
                    t2 = time.perf_counter()
                    try:
                        # blocks are copied into the engine's KV as each one verifies
                        importer = self.engine.importer(best.tokens)
                        for blk in local.blocks[:skip]:
                            importer.add(blk)
                        blocks = self.node.call(
                            self.node.node.client.fetch(
                                self.engine.layout, best, skip, on_block=importer.add
                            ),
                            timeout=self.fetch_timeout + 1,
                        )
                        fetch_s = time.perf_counter() - t2
                        self.planner.observe_fetch(best.node_id, nbytes, fetch_s)
                        prefix = (local.blocks[:skip] if skip else ()) + tuple(blocks)
                        source, peer, fetched_bytes = "remote", best.alias, nbytes
                        self._store_fetched(blocks)
                    except KVMeshError as e:
                        fallback = e.reason
                    except (TimeoutError, concurrent.futures.TimeoutError):
                        fallback = "timeout"
                    except Exception as e:  # never let the cache fail a request
                        log.warning("fetch failed unexpectedly: %r", e)
                        fallback = "error"
        t3 = time.perf_counter()
        try:
            state = self.engine.prefill(tokens, prefix, importer if source == "remote" else None)
        except Exception as e:  # any failure to use the prefix: compute it all (invariant 1)
            fallback, source, prefix = getattr(e, "reason", "error"), "compute", ()
            if not isinstance(e, KVMeshError):
                log.warning("prefix import failed unexpectedly: %r", e)
            state = self.engine.prefill(tokens)
        dt = time.perf_counter() - t3
        if state.computed_tokens:
            per_token = dt / state.computed_tokens
            self.planner.observe_prefill(state.computed_tokens, dt)
        else:
            per_token = 1 / (self.planner.prefill_tps or self.planner._prior_tps)
        if fallback:
            log.info("prefill fell back to local compute: %s", fallback)
        report = PrefillReport(
            source=source,
            prompt_tokens=len(tokens),
            reused_tokens=state.imported_tokens,
            computed_tokens=state.computed_tokens,
            peer=peer,
            bytes_fetched=fetched_bytes,
            fallback=fallback,
            lookup_s=lookup_s,
            fetch_s=fetch_s,
            import_s=dt if not state.computed_tokens else 0.0,
            compute_s=dt,
            saved_s=state.imported_tokens * per_token,
            used_stored_logits=state.used_stored_logits,
        )
        return state, report, tuple(b for b in prefix if b.header.kind == "block")

    def _remote_lookup(self, keys):  # type: ignore[no-untyped-def]
        assert self.node is not None
        client = self.node.node.client
        try:
            return self.node.call(
                client.lookup(self.card, keys), timeout=client.lookup_deadline + 1
            )
        except Exception as e:  # the cache never decides correctness
            log.warning("lookup failed: %r", e)
            return [], ["timeout" if isinstance(e, TimeoutError) else "error"]

    def _store_fetched(self, blocks: Sequence[Block]) -> None:
        assert self.node is not None
        for blk in blocks:
            try:
                self.node.node.store.put(blk)
            except KVMeshError:
                break  # budget or orphan: the local copy is optional

    # -- sessions --------------------------------------------------------------

    def _take_session(self, tokens: list[int]) -> tuple[KVState, int] | None:
        best, best_len = None, 0
        for sid, st in self._sessions.items():
            n = _common_prefix(st.tokens[: st.cached], tokens)
            if n > best_len:
                best, best_len = sid, n
        if best is None or best_len < self.card.block_tokens:
            return None
        return self._sessions.pop(best), best_len

    def _keep_session(self, state: KVState) -> None:
        self._sessions[self._next_session] = state
        self._next_session += 1
        while len(self._sessions) > self.max_sessions:
            self._sessions.popitem(last=False)

    def clear_sessions(self) -> None:
        with self._lock:
            self._sessions.clear()

    # -- publishing ------------------------------------------------------------

    def _publish_later(self, prompt: KVState, final: KVState, reused: tuple[Block, ...]) -> None:
        with self._pending_lock:
            if self._pending >= self._max_pending:
                self.telemetry.count("publish_dropped")
                return
            self._pending += 1
        self._publisher.submit(self._publish, prompt, final, reused)

    def _publish(self, prompt: KVState, final: KVState, reused: tuple[Block, ...]) -> None:
        try:
            n_reused = len(reused)
            blocks = list(reused) + self.engine.export(prompt, self.keyer, first_block=n_reused)
            prompt_full = [b for b in blocks if b.header.kind == "block"]
            more = self.engine.export(
                KVState(final.tokens[: final.cached], final.cache, None, final.cached),
                self.keyer,
                first_block=len(prompt_full),
            )
            chains = [blocks, prompt_full + more] if more else [blocks]
            if self.node is None:
                return
            store = self.node.node.store
            for chain in chains:
                for blk in chain:
                    try:
                        store.put(blk)
                    except KVMeshError:
                        break
                self.node.call(self._enqueue(chain), timeout=10)
            self.telemetry.count("published_blocks", len(blocks) + len(more))
        except Exception as e:
            log.warning("publish failed: %r", e)
            self.telemetry.count("publish_failed")
        finally:
            with self._pending_lock:
                self._pending -= 1

    async def _enqueue(self, chain: list[Block]) -> None:
        assert self.node is not None
        self.node.node.client.enqueue_publish(self.card, chain)

    def publish_pending(self) -> int:
        """Publishes not yet handed to peers (exports running or queued sends)."""
        with self._pending_lock:
            n = self._pending
        if self.node is not None:
            n += self.node.node.client.queued()
        return n

    def flush(self, timeout: float = 30.0) -> None:
        """Wait for queued publishes to reach the peers (tests and the demo)."""
        deadline = time.time() + timeout
        while True:
            with self._pending_lock:
                if self._pending == 0:
                    break
            if time.time() > deadline:
                raise TimeoutError("publish did not finish")
            time.sleep(0.01)
        if self.node is not None:
            self.node.call(self.node.node.client.drain(), timeout=timeout)

    def close(self) -> None:
        self._publisher.shutdown(wait=True)


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    diff = np.flatnonzero(np.asarray(a[:n], np.int64) != np.asarray(b[:n], np.int64))
    return int(diff[0]) if diff.size else n
