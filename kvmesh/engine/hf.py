"""The transformers (PyTorch) engine adapter.

KV layout in a block is ``[kv_heads, tokens, head_dim]`` per layer, K then V: the
cache's own layout less the batch axis, so export is one strided copy per layer
and import is one copy into a preallocated ``[1, kv_heads, n, head_dim]`` tensor
per layer, handed to the cache as is (no concatenation).
"""

from __future__ import annotations

import json
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..blocks import DEFAULT_BLOCK_TOKENS
from ..codec import Block, Layout
from .base import Engine, Importer, Sampling, card_from_hf_dir

_DTYPES = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}
_BY_NAME = {v: k for k, v in _DTYPES.items()}
_NP = {torch.float32: np.float32, torch.float16: np.float16, torch.bfloat16: np.uint16}


def _np(t: torch.Tensor) -> np.ndarray:
    """A NumPy view sharing memory (bfloat16 as its raw 16-bit pattern)."""
    return (t.view(torch.int16) if t.dtype == torch.bfloat16 else t).detach().cpu().numpy()


def _frombuffer(view: memoryview, dtype: torch.dtype) -> torch.Tensor:
    with warnings.catch_warnings():  # blobs are read-only bytes; we never write through this
        warnings.simplefilter("ignore", UserWarning)
        return torch.frombuffer(view, dtype=dtype)


class _TorchImporter(Importer):
    def __init__(self, engine: TransformersEngine, n_tokens: int) -> None:
        super().__init__(n_tokens)
        c = engine.card
        self.engine = engine
        shape = (1, c.num_kv_heads, n_tokens, c.head_dim)
        self.ks = [torch.empty(shape, dtype=engine.dtype) for _ in range(c.num_layers)]
        self.vs = [torch.empty(shape, dtype=engine.dtype) for _ in range(c.num_layers)]
        self._np_dtype = _NP[engine.dtype]
        self._dsts = [_np(t)[0] for pair in zip(self.ks, self.vs, strict=True) for t in pair]

    def _copy(self, block: Block) -> None:
        t, a = block.header.tokens, block.header.start
        # numpy slice assignment: ~1 µs per copy instead of torch's ~10 µs dispatch
        for dst, (spec, view) in zip(self._dsts, block.tensors(), strict=False):
            dst[:, a : a + t] = np.frombuffer(view, self._np_dtype).reshape(spec.shape)

    def cache(self) -> Any:
        cache = self.engine._new_cache()
        dev = self.engine.device
        for layer, (k, v) in enumerate(zip(self.ks, self.vs, strict=True)):
            lay = cache.layers[layer]
            lay.lazy_initialization(k, v)
            lay.keys, lay.values = k.to(dev), v.to(dev)
        return cache


class TransformersEngine(Engine):
    name = "torch"

    def __init__(
        self,
        path: Path,
        block_tokens: int | None = None,
        device: str = "cpu",
        dtype: str | None = None,
        threads: int | None = None,
    ) -> None:
        from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
        hf_logging.set_verbosity_error()

        if threads:
            torch.set_num_threads(threads)
        self.path = Path(path)
        self.device = torch.device(device)
        cfg = json.loads((self.path / "config.json").read_text())
        want = (
            _BY_NAME[dtype] if dtype else _BY_NAME.get(str(cfg.get("torch_dtype")), torch.float32)
        )
        if self.device.type == "cpu" and want != torch.float32 and dtype is None:
            want = torch.float32  # half-precision matmuls are slow on CPU
        self.model = AutoModelForCausalLM.from_pretrained(
            str(self.path), dtype=want, local_files_only=True
        )
        self.model.to(self.device)  # type: ignore[arg-type]  # (transformers types .to oddly)
        self.model.eval()
        self.tokenizer = AutoTokenizer.from_pretrained(str(self.path), local_files_only=True)
        self._cache_cls = DynamicCache
        self.dtype = want
        quant = cfg.get("quantization_config")
        self.card = card_from_hf_dir(
            self.path,
            engine="transformers",
            kv_dtype=_DTYPES[want],
            quantization=json.dumps(quant, sort_keys=True) if quant else "none",
            block_tokens=block_tokens or DEFAULT_BLOCK_TOKENS,
        )
        if any(self.card.sliding_windows):
            raise NotImplementedError(
                "sliding-window layers are not supported by the transformers adapter yet"
            )
        self.layout = Layout(self.card)
        eos = self.model.generation_config.eos_token_id
        eos_list = eos if isinstance(eos, list) else [eos] if eos is not None else []
        if self.tokenizer.eos_token_id is not None:
            eos_list.append(self.tokenizer.eos_token_id)
        self.eos_ids = frozenset(int(e) for e in eos_list)

    # -- KV -------------------------------------------------------------------

    def _new_cache(self) -> Any:
        return self._cache_cls(config=self.model.config)

    def importer(self, n_tokens: int) -> _TorchImporter:
        return _TorchImporter(self, n_tokens)

    @torch.inference_mode()
    def _forward(self, cache: Any, tokens: Sequence[int], start: int) -> tuple[Any, Any]:
        if cache is None:
            cache = self._new_cache()
        ids = torch.tensor([list(tokens)], dtype=torch.long, device=self.device)
        out = self.model(input_ids=ids, cache=cache, use_cache=True, logits_to_keep=1)
        return cache, out.logits[0, -1].float()  # the cache was extended in place

    def _crop(self, cache: Any, n_tokens: int) -> Any:
        """A new cache viewing the first ``n_tokens`` positions; ``cache`` is untouched
        (a session or a background export may still be reading it)."""
        out = self._new_cache()
        for src, dst in zip(cache.layers, out.layers, strict=True):
            k, v = src.keys[:, :, :n_tokens], src.values[:, :, :n_tokens]
            dst.lazy_initialization(k, v)
            dst.keys, dst.values = k, v
        return out

    def _write_kv(self, cache: Any, start: int, stop: int, out: memoryview) -> None:
        c = self.card
        per = c.num_kv_heads * (stop - start) * c.head_dim
        dst = np.frombuffer(out, _NP[self.dtype])
        off = 0
        for layer in cache.layers:
            for src in (layer.keys, layer.values):
                src_np = _np(src[0, :, start:stop])
                dst[off : off + per].reshape(src_np.shape)[...] = src_np
                off += per

    def _write_logits(self, logits: Any, out: memoryview) -> None:
        _frombuffer(out, torch.float32).copy_(logits.detach().to("cpu", torch.float32))

    def _read_logits(self, view: memoryview) -> Any:
        return _frombuffer(view, torch.float32).to(self.device)

    # -- sampling -------------------------------------------------------------

    def new_rng(self, seed: int | None) -> Any:
        g = torch.Generator(device="cpu")
        if seed is not None:
            g.manual_seed(seed)
        else:
            g.seed()
        return g

    def sample(self, logits: Any, sampling: Sampling, rng: Any) -> int:
        if sampling.temperature <= 0:
            return int(torch.argmax(logits).item())
        probs = torch.softmax(logits.float().cpu() / sampling.temperature, dim=-1)
        if sampling.top_p < 1.0:
            sp, idx = torch.sort(probs, descending=True)
            keep = torch.cumsum(sp, 0) - sp < sampling.top_p
            probs = torch.zeros_like(probs).scatter_(0, idx[keep], sp[keep])
        return int(torch.multinomial(probs, 1, generator=rng).item())
