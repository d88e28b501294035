"""The engine-neutral half of every engine: prefill from imported blocks or a live
state, decode, fork, export; a backend supplies the forward, the cache's layout
and sampling (:class:`EngineBase`'s abstract methods).

Prefill from imported blocks (``prefix``) is exact: the blocks' bytes become the
cache's tensors unchanged (invariant 2). A block carries its positions' KV for
every layer, so a prefix of any length is restorable: a sliding layer of window
``W`` gets what it holds after computing that prefix itself (transformers: the
last ``W - 1`` positions; mlx-lm's rotating cache: the last ``W``). Backends keep
a sliding layer's positions past the window (a per-layer record) so they can be
exported and cropped. A recurrent state is restorable only where it was kept
(:meth:`EngineBase.restorable`).

An import may leave out a sliding layer's positions before its window
(``keep_from``, :class:`~kvmesh.engine.state.Importer`): its cache then holds
that layer from a low bound on, which export and crops never read below
(:class:`~kvmesh.errors.CacheMiss`), and :meth:`EngineBase.restorable` says 0
for a cut whose window would reach below it, so sessions and crops compute
instead.
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import numpy as np

from ..blocks import MEDIA_IDS, BlockKeyer, PrefixKeys
from ..codec import Block, BlockHeader, Layout, new_blob
from ..compat import CompatCard
from ..errors import ConfigError, MalformedPayload, NoChatTemplate
from .decode import Decoded, Decoder, Sampling, StopScanner, TokenLogprob
from .geometry import MAX_STATE_EVERY, CacheGeometry, card_from_hf_dir, model_name
from .protocol import PREFILL_CHUNK, Engine, Scorer
from .rows import forward_rows
from .state import Importer, KVState, check_chain

# names callers import from here
__all__ = [
    "MAX_STATE_EVERY",
    "PREFILL_CHUNK",
    "CacheGeometry",
    "Decoded",
    "Decoder",
    "Engine",
    "EngineBase",
    "Importer",
    "KVState",
    "Sampling",
    "StopScanner",
    "TokenLogprob",
    "card_from_hf_dir",
    "check_chain",
    "model_name",
]


class EngineBase(abc.ABC):
    """:class:`~kvmesh.engine.protocol.Engine` over a backend's hooks (the abstract
    methods, and the overridable ``_write_state``, ``_positions``, ``restorable``,
    ``exportable``, ``prefill_batch``, ``decode_batch``, ``detach``)."""

    name: str  # the backend's registry name
    card: CompatCard
    layout: Layout
    eos_ids: frozenset[int]
    # why this model's cache cannot be exported or restored exactly (a cache type
    # kvmesh does not know yet): it is served with reuse off; None when it can
    reuse_off: str | None = None
    # a vision-language model's images (:class:`~kvmesh.engine.vision.Vision`); None: text only
    vision: Any = None
    whole_pictures = False  # attention within a picture goes both ways (forward_tokens)

    tokenizer: Any  # a Hugging Face tokenizer, or one with the same methods

    # -- text (chat template applied by the tokenizer) --------------------------

    def encode(self, text: str) -> list[int]:
        """Completions: the tokenizer's own special-token convention (BOS where it
        adds one), as vLLM and transformers tokenize a prompt."""
        return list(self.tokenizer.encode(text, add_special_tokens=True))

    def encode_chat(self, messages: Sequence[dict[str, str]]) -> list[int]:
        """Chat: the chat template alone decides special tokens (it writes BOS
        itself when the model wants one), so none is added twice."""
        if not getattr(self.tokenizer, "chat_template", None):
            raise NoChatTemplate(
                "this model has no chat template; use /v1/completions with a plain prompt"
            )
        text = self.tokenizer.apply_chat_template(
            list(messages), tokenize=False, add_generation_prompt=True
        )
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def decode_text(self, tokens: Sequence[int]) -> str:
        return str(self.tokenizer.decode(MEDIA_IDS.model_ids(tokens), skip_special_tokens=True))

    # -- KV -------------------------------------------------------------------

    @abc.abstractmethod
    def importer(self, n_tokens: int, keep_from: Sequence[int] | None = None) -> Importer:
        """An empty KV buffer for positions [0, n_tokens) that blocks are copied into;
        with ``keep_from`` (:meth:`Layout.keep_from` of ``n_tokens``), layer ``i``'s
        from position ``keep_from[i]`` on only, from trimmed blocks
        (:class:`~kvmesh.engine.state.Importer`)."""

    def _import(self, blocks: Sequence[Block], n_tokens: int) -> Any:
        # trimmed blocks handed over without an importer: trimmed as the card says
        whole = all(b.whole for b in blocks)
        imp = self.importer(n_tokens, None if whole else self.layout.keep_from(n_tokens))
        for blk in blocks:
            imp.add(blk)
        return imp.cache()

    @abc.abstractmethod
    def _forward(self, state_cache: Any, tokens: Sequence[int], start: int) -> tuple[Any, Any]:
        """Run ``tokens`` at positions ``start...`` on ``state_cache`` (None = empty);
        return (cache, float32 logits of the last position)."""

    @abc.abstractmethod
    def _crop(self, cache: Any, n_tokens: int) -> Any: ...

    @abc.abstractmethod
    def _write_kv(self, cache: Any, start: int, stop: int, out: memoryview) -> None:
        """Write positions [start, stop) of every layer, K then V, into ``out``."""

    def _write_state(self, cache: Any, pos: int, out: memoryview) -> None:
        """Write every recurrent layer's state after position ``pos`` into ``out``
        (the card's ``states`` order). Only engines whose cards have state."""
        raise ConfigError(f"the {self.name} engine keeps no recurrent state")

    def _kept_state(self, cache: Any, pos: int) -> bool:
        """Whether ``cache`` kept the recurrent state after position ``pos`` off the
        card's grid (after a prompt's last whole blocks): the block ending there carries it."""
        return False

    def _positions(self, cache: Any) -> int | None:
        """How many positions ``cache`` holds, where the engine tracks it (None:
        ask :meth:`restorable`)."""
        return None

    def exportable(self, state: KVState) -> int:
        """How many of ``state``'s positions may be exported: those in its cache."""
        return state.cached

    def exportable_from(self, state: KVState) -> int:
        """The first position every layer of ``state``'s cache holds: 0, except after
        a trimmed import (a sliding layer's low bound, a block boundary). An export
        from an earlier block is a :class:`~kvmesh.errors.CacheMiss`."""
        return 0

    def restorable(self, cache: Any, n: int) -> int:
        """The most positions, at most ``n``, that ``cache`` can be cut back to: ``n``
        for attention caches; a recurrent state exists only where it was kept (a
        checkpoint, or where the cache ends); none with reuse off."""
        return n if cache is not None and self.reuse_off is None else 0

    @abc.abstractmethod
    def _write_logits(self, logits: Any, out: memoryview) -> None: ...

    @abc.abstractmethod
    def _read_logits(self, view: memoryview) -> Any: ...

    @abc.abstractmethod
    def sample(
        self,
        logits: Any,
        sampling: Sampling,
        rng: Any,
        counts: Mapping[int, int] | None = None,
        allowed: np.ndarray | None = None,
    ) -> int:
        """The next token from ``logits``; ``counts`` (tokens generated so far, how
        often) are penalized first when ``sampling`` has a penalty. ``allowed`` (a
        grammar's mask, a bool per logit) sets the others to -inf on a copy first;
        the Decoder passes it only with a grammar."""

    @abc.abstractmethod
    def _log_softmax(self, logits: Any) -> np.ndarray:
        """Float32 log-probabilities of ``logits`` (as a NumPy vector)."""

    def logprob(self, logits: Any, token: int, top: int) -> TokenLogprob:
        """``token``'s logprob under the raw ``logits`` and the ``top`` most likely."""
        lp = self._log_softmax(logits)
        best: tuple[tuple[int, float], ...] = ()
        if top > 0:
            idx = np.argpartition(-lp, top - 1)[:top]
            idx = idx[np.argsort(-lp[idx], kind="stable")]
            best = tuple((int(j), float(lp[j])) for j in idx)
        return TokenLogprob(int(token), float(lp[token]), best)

    @abc.abstractmethod
    def new_rng(self, seed: int | None) -> Any: ...

    @abc.abstractmethod
    def prompt_scorer(self, adapter: str | None = None) -> Scorer: ...

    def load_adapter(self, name: str, path: str) -> bytes:
        """Serve a PEFT LoRA adapter as ``name``; its weights digest. Only the torch
        engine applies adapters."""
        raise ConfigError(f"--lora needs the torch engine (this head runs {self.name})")

    # -- engine-neutral -------------------------------------------------------

    def begin_prefill(
        self,
        tokens: Sequence[int],
        prefix: Sequence[Block] = (),
        imported: Importer | None = None,
        adapter: str | None = None,
    ) -> KVState:
        """The state of ``tokens`` before its computed suffix: ``prefix`` imported
        (``imported``: already copied in, see :meth:`importer`), ``cached`` the
        positions it holds, ``logits`` None until :meth:`prefill_batch` computed the
        rest. An exact tail (stored logits) leaves nothing to compute: the state is
        whole (``cached == len(tokens)``, logits set)."""
        tokens = list(tokens)
        if not tokens:
            raise ValueError("cannot prefill an empty sequence")
        checked = imported is not None and imported.layout is self.layout
        p = check_chain(prefix, self.layout, len(tokens), checked) if prefix else 0
        if imported is not None and (imported.n_tokens != p or imported.added != len(prefix)):
            raise MalformedPayload("the imported buffer does not hold this prefix")
        cache = (
            (imported.cache() if imported is not None else self._import(prefix, p)) if p else None
        )
        tail = prefix[-1] if prefix and prefix[-1].header.kind == "tail" else None
        if p == len(tokens) and tail is not None and self.restorable(cache, p) == p:
            logits = self._read_logits(tail.logits_bytes())
            return KVState(tokens, cache, logits, p, p, 0, True, adapter=adapter)
        # no stored logits: recompute the last token; a recurrent state restarts
        # from the last checkpoint the prefix carries
        q = self.restorable(cache, p - 1 if p == len(tokens) else p)
        if q != p and q != self._positions(cache):  # an importer may have stopped there
            cache = self._crop(cache, q) if q else None
        return KVState(tokens, cache, None, q, q, len(tokens) - q, adapter=adapter)

    def begin_resume(self, state: KVState, keep: int, tokens: Sequence[int]) -> KVState:
        """:meth:`begin_prefill` from the first ``keep`` cached positions of a live
        ``state`` (their common prefix with ``tokens``). Nothing is mutated in place."""
        tokens = list(tokens)
        keep = self.restorable(state.cache, min(keep, len(tokens) - 1, state.cached))
        cache = self._crop(state.cache, keep) if keep else None
        return KVState(tokens, cache, None, keep, keep, len(tokens) - keep, adapter=state.adapter)

    def prefill(
        self,
        tokens: Sequence[int],
        prefix: Sequence[Block] = (),
        imported: Importer | None = None,
        between: Callable[[], None] | None = None,
        chunk: int = PREFILL_CHUNK,
        adapter: str | None = None,
    ) -> KVState:
        """KV and next-token logits for ``tokens``, importing ``prefix`` first.
        ``imported`` is ``prefix`` already copied in (see :meth:`importer`). With
        ``between``, a suffix longer than ``chunk`` tokens is computed ``chunk`` at
        a time and ``between()`` runs after each chunk but the last (a batch keeps
        decoding while a long prompt is prefilled)."""
        state = self.begin_prefill(tokens, prefix, imported, adapter)
        while between is not None and len(state.tokens) - state.cached > chunk:
            self.prefill_batch([state], [self.forward_tokens(state.tokens, state.cached, chunk)])
            between()
        if state.cached < len(state.tokens):
            self.prefill_batch([state], [len(state.tokens) - state.cached])
        return state

    def prefill_batch(self, states: Sequence[KVState], chunks: Sequence[int]) -> None:
        """Compute the next ``chunks[i]`` prompt tokens of each ``states[i]``
        (``tokens[cached : cached + chunks[i]]``), updating its cache, ``cached`` and
        logits (those of its last computed position). Engines that can run several
        prompts in one forward override this; one state alone always takes the
        single-sequence path (:meth:`_forward`), so a lone prompt computes exactly
        as unbatched. This default runs them one after another."""
        if len(states) != len(chunks):
            raise ValueError("one chunk per state")
        for state, n in zip(states, chunks, strict=True):
            at = state.cached
            if n < 1 or at + n > len(state.tokens):
                raise ValueError(f"chunk of {n} tokens at {at} of {len(state.tokens)}")
            with forward_rows([state.adapter], [state.tokens]):
                state.cache, state.logits = self._forward(
                    state.cache, state.tokens[at : at + n], at
                )
            state.cached = at + n

    def extend(self, state: KVState, tokens: Sequence[int]) -> KVState:
        """Append ``tokens`` to a live state (sessions: no lookup needed). The
        state's cache is extended in place: ``state`` is spent (:meth:`fork` it
        first to keep it; a hybrid's kept state at its end may be gone)."""
        if not tokens:
            return state
        if state.cached < len(state.tokens):  # last token not in the cache yet
            tokens = state.tokens[state.cached :] + list(tokens)
        all_tokens = state.tokens + list(tokens[len(state.tokens) - state.cached :])
        with forward_rows([state.adapter], [all_tokens]):
            cache, logits = self._forward(state.cache, tokens, state.cached)
        return KVState(all_tokens, cache, logits, len(all_tokens), adapter=state.adapter)

    def resume(self, state: KVState, keep: int, tokens: Sequence[int]) -> KVState:
        """Reuse the first ``keep`` cached positions of a live ``state`` for ``tokens``
        (their common prefix), computing the rest. Nothing is mutated in place."""
        out = self.begin_resume(state, keep, tokens)
        self.prefill_batch([out], [len(out.tokens) - out.cached])
        return out

    def fork(self, state: KVState) -> KVState:
        """An independent copy of a live ``state`` (``n`` sequences from one
        prefill): the same cached tensors (a crop shares them; decoding one copy
        never writes into another) and the same logits."""
        if self.reuse_off is not None:  # a cache it cannot copy: computed again
            n, adapter = state.cached, state.adapter
            again = self.prefill(state.tokens[:n], adapter=adapter) if n else None
            cache = again.cache if again is not None else None
            return KVState(list(state.tokens), cache, state.logits, n, adapter=adapter)
        cache = self._crop(state.cache, state.cached) if state.cached else None
        return KVState(list(state.tokens), cache, state.logits, state.cached, adapter=state.adapter)

    def generate(
        self, state: KVState, sampling: Sampling, out: Decoded | None = None
    ) -> Iterator[int]:
        """Decode locally, one sequence. Mutates ``state`` so it ends holding the
        whole sequence. ``out``, when given, is filled in before each token is
        yielded (see :class:`Decoder`)."""
        decoder = Decoder(self, state, sampling, out)
        while True:
            tok, last = decoder.next()
            yield tok
            if last:
                return  # the last token is not forwarded: its KV is never needed here
            self.decode_batch([state])

    def decode_batch(self, states: Sequence[KVState]) -> None:
        """Forward each state's one pending token (the one its decoder just
        sampled), updating its cache, logits and ``cached``. Engines that can run
        several sequences in one forward override this; one state alone always
        takes the single-sequence path, so a lone request decodes exactly as
        without batching. This default runs them one after another."""
        for state in states:
            self._advance(state)

    def _advance(self, state: KVState) -> None:
        pending = state.tokens[state.cached :]
        with forward_rows([state.adapter], [state.tokens]):
            state.cache, state.logits = self._forward(state.cache, pending, state.cached)
        state.cached = len(state.tokens)

    @property
    def batches(self) -> bool:
        """Whether :meth:`decode_batch` runs several sequences in one forward."""
        return False

    @property
    def rides(self) -> bool:
        """Whether :meth:`prefill_riding` computes the riders' steps in the prompt's
        forward (else one after the other)."""
        return False

    def prefill_riding(self, state: KVState, n: int, riders: Sequence[KVState]) -> None:
        """The next ``n`` prompt tokens of ``state`` (:meth:`prefill_batch`) and a
        decode step of each of ``riders`` (:meth:`decode_batch`); an engine that
        :attr:`rides` runs them in one forward and, if it raises, leaves every
        state as it was."""
        self.prefill_batch([state], [n])
        if riders:
            self.decode_batch(riders)

    def forward_tokens(self, tokens: Sequence[int], start: int, n: int) -> int:
        """How many of ``tokens`` a prefill forward from ``start`` computes when ``n``
        are asked: ``n``, unless the model attends both ways within a picture
        (:attr:`whole_pictures`: a picture's keys and values depend on all of it) and
        the forward would stop inside one; then up to the picture's start, or through
        its end when the forward starts at or within it (more than ``n``)."""
        if not self.whole_pictures:
            return n
        span = MEDIA_IDS.cut(tokens, start + n)
        if span is None:
            return n
        first, end = span
        return first - start if first > start else end - start

    def detach(self, state: KVState) -> None:
        """Make ``state`` own its tensors once it leaves a batch (a session or an
        export must not keep a whole batch's tensors alive)."""
        return None  # engines whose batched rows are copies already have nothing to do

    def export(
        self,
        state: KVState,
        keyer: BlockKeyer,
        keys: PrefixKeys | None = None,
        first_block: int = 0,
    ) -> list[Block]:
        """Blocks for ``state``: full blocks from ``first_block`` on, then the tail.
        Only positions already in the cache are exported; none with reuse off."""
        if self.reuse_off is not None:
            return []
        tokens, limit = state.tokens, self.exportable(state)
        if limit < len(tokens):  # e.g. a generated last token: no KV yet, no logits for it
            tokens = tokens[:limit]
            logits = None
        else:
            logits = state.logits
        keys = keys or keyer.keys(tokens)
        b = self.card.block_tokens
        out: list[Block] = []
        for i in range(first_block, min(len(keys.blocks), limit // b)):
            kept = self._kept_state(state.cache, (i + 1) * b)
            hdr = self.layout.header(
                "block", keys.blocks[i], keyer.parent_of(keys, i), i * b, b, kept
            )
            out.append(self._seal(state.cache, hdr))
        if logits is not None:
            n_full = len(keys.blocks)
            parent = keys.blocks[-1] if n_full else keyer.namespace
            hdr = self.layout.header("tail", keys.tail, parent, n_full * b, keys.tail_tokens)
            out.append(self._seal(state.cache, hdr, logits))
        return out

    def _seal(self, cache: Any, header: BlockHeader, logits: Any = None) -> Block:
        blob, view = new_blob(header)
        kv, state = header.kv_bytes, header.state_bytes
        end = header.start + header.tokens
        if header.tokens:
            self._write_kv(cache, header.start, end, view[:kv])
        if state:
            self._write_state(cache, end, view[kv : kv + state])
        if logits is not None:
            self._write_logits(logits, view[kv + state :])
        return self.layout.seal(header, blob)
