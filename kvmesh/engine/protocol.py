"""What the runtime needs of an engine: a tokenizer, a card, prefill (from
imported blocks or a live state), decode steps, sampling, and export of a
state's cached positions as blocks.

The caller serializes forwards (prefill, decode steps, scoring); an importer's
``add`` may run on any thread. :class:`~kvmesh.engine.base.EngineBase` implements
this over a few per-backend hooks; :mod:`kvmesh.engine.registry` names the
backends :func:`kvmesh.engine.load_engine` can load.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, Protocol

import numpy as np

from ..blocks import BlockKeyer, PrefixKeys
from ..codec import Block, Layout
from ..compat import CompatCard
from .decode import Decoded, Sampling, TokenLogprob
from .state import Importer, KVState

PREFILL_CHUNK = 512  # tokens per prefill forward while other sequences are decoding

# (ids, the id after each, top) -> per position: the next id's logprob, the top
# ids and their logprobs (most likely first; ``[len(ids), 0]`` with top 0)
Scorer = Callable[[Sequence[int], Sequence[int], int], tuple[np.ndarray, np.ndarray, np.ndarray]]


class Engine(Protocol):
    """A loaded model: its card and tokenizer, prefill, decode and export."""

    card: CompatCard
    layout: Layout
    tokenizer: Any  # a Hugging Face tokenizer, or one with the same methods
    eos_ids: frozenset[int]
    # why this model's cache cannot be exported or restored exactly; None when it can
    reuse_off: str | None
    vision: Any  # a vision-language model's images (engine.vision.Vision); None: text only
    whole_pictures: bool  # a prefill forward never stops inside a picture (forward_tokens)

    # -- text ------------------------------------------------------------------

    def encode(self, text: str) -> list[int]:
        """A completion prompt's ids, with the tokenizer's own special tokens."""
        ...

    def encode_chat(self, messages: Sequence[dict[str, str]]) -> list[int]:
        """A chat's ids: the chat template alone decides special tokens."""
        ...

    def decode_text(self, tokens: Sequence[int]) -> str: ...

    # -- prefill ---------------------------------------------------------------

    def importer(self, n_tokens: int, keep_from: Sequence[int] | None = None) -> Importer:
        """An empty KV buffer for positions [0, n_tokens) that blocks are copied into.
        With ``keep_from`` (``layout.keep_from(n_tokens)``) layer ``i`` is imported
        from position ``keep_from[i]`` on, from blocks that carry at least
        ``layout.want(header, keep_from)``; without it every block must be whole."""
        ...

    def begin_prefill(
        self,
        tokens: Sequence[int],
        prefix: Sequence[Block] = (),
        imported: Importer | None = None,
        adapter: str | None = None,
    ) -> KVState:
        """The state of ``tokens`` with ``prefix`` imported, before its suffix is
        computed (:meth:`prefill_batch`) with LoRA ``adapter`` (:meth:`load_adapter`)."""
        ...

    def begin_resume(self, state: KVState, keep: int, tokens: Sequence[int]) -> KVState:
        """:meth:`begin_prefill` from the first ``keep`` cached positions of ``state``."""
        ...

    def prefill_batch(self, states: Sequence[KVState], chunks: Sequence[int]) -> None:
        """Compute the next ``chunks[i]`` prompt tokens of each ``states[i]``."""
        ...

    def prefill(
        self,
        tokens: Sequence[int],
        prefix: Sequence[Block] = (),
        imported: Importer | None = None,
        between: Callable[[], None] | None = None,
        chunk: int = PREFILL_CHUNK,
        adapter: str | None = None,
    ) -> KVState:
        """:meth:`begin_prefill` then every chunk of the suffix: a whole state."""
        ...

    def forward_tokens(self, tokens: Sequence[int], start: int, n: int) -> int:
        """How many of ``tokens`` a prefill forward from ``start`` computes when ``n``
        are asked (a forward never stops inside a picture attended both ways)."""
        ...

    # -- decode ----------------------------------------------------------------

    @property
    def batches(self) -> bool:
        """Whether :meth:`decode_batch` runs several sequences in one forward."""
        ...

    def decode_batch(self, states: Sequence[KVState]) -> None:
        """Forward each state's one pending token (the one its decoder just sampled)."""
        ...

    @property
    def rides(self) -> bool:
        """Whether :meth:`prefill_riding` runs the prompt and the steps in one forward."""
        ...

    def prefill_riding(self, state: KVState, n: int, riders: Sequence[KVState]) -> None:
        """The next ``n`` prompt tokens of ``state`` and a decode step of each rider."""
        ...

    def generate(
        self, state: KVState, sampling: Sampling, out: Decoded | None = None
    ) -> Iterator[int]:
        """Decode one sequence locally; ``state`` ends holding all of it."""
        ...

    def fork(self, state: KVState) -> KVState:
        """An independent copy of a live state (``n`` sequences from one prefill)."""
        ...

    def detach(self, state: KVState) -> None:
        """Make ``state`` own its tensors once it leaves a batch."""
        ...

    def load_adapter(self, name: str, path: str) -> bytes:
        """Serve the PEFT LoRA adapter at ``path`` as ``name`` (a state whose
        ``adapter`` is ``name`` computes with it); its weights digest
        (:func:`~kvmesh.blocks.adapter_digest`). ConfigError where it cannot."""
        ...

    def new_rng(self, seed: int | None) -> Any: ...

    def sample(
        self,
        logits: Any,
        sampling: Sampling,
        rng: Any,
        counts: Mapping[int, int] | None = None,
        allowed: np.ndarray | None = None,
    ) -> int:
        """The next token from ``logits``: ``counts`` penalized when ``sampling`` has a
        penalty, tokens outside ``allowed`` (a grammar's mask) never chosen."""
        ...

    def logprob(self, logits: Any, token: int, top: int) -> TokenLogprob:
        """``token``'s logprob under the raw ``logits`` and the ``top`` most likely."""
        ...

    def prompt_scorer(self, adapter: str | None = None) -> Scorer:
        """Prompt log-probabilities chunk by chunk on a fresh cache of its own: each
        call continues where the last ended (:mod:`kvmesh.engine.scoring`)."""
        ...

    # -- export ----------------------------------------------------------------

    def exportable_from(self, state: KVState) -> int:
        """The first position every layer of ``state``'s cache holds: 0 but after a
        trimmed import; :meth:`export`'s ``first_block`` must be at least this over
        the block size, rounded up (:class:`~kvmesh.errors.CacheMiss` otherwise)."""
        ...

    def export(
        self,
        state: KVState,
        keyer: BlockKeyer,
        keys: PrefixKeys | None = None,
        first_block: int = 0,
    ) -> list[Block]:
        """Blocks of ``state``'s cached positions from ``first_block`` on, then its
        tail; none with reuse off."""
        ...
