"""The mask-free prefill attention (kvmesh.engine.attention): the split of a
continuing forward's attention into history and new positions equals the masked
pass within float rounding, runs only where the pattern is exactly a lone
sequence continuing its cache, and a real model served with it continues within
1e-5 of SDPA's masked pass (deterministically)."""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F
from transformers.masking_utils import causal_mask_function, sliding_window_causal_mask_function

from kvmesh.engine import attention, load_engine

from . import zoo

pytestmark = pytest.mark.skipif(
    not attention.has_flash_kernel(), reason="torch lacks the CPU flash kernel"
)


def masked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """The reference: SDPA with the explicit causal mask, queries at the end."""
    n_q, n_kv = q.shape[2], k.shape[2]
    keep = torch.ones(n_q, n_kv, dtype=torch.bool).tril(n_kv - n_q)
    g = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    return F.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=keep)


@pytest.mark.parametrize(
    ("heads", "kv_heads", "dtype", "tol"),
    [
        (2, 1, torch.float32, 1e-5),
        (4, 2, torch.float32, 1e-5),
        (3, 3, torch.float32, 1e-5),
        (4, 1, torch.bfloat16, 2e-2),
    ],
)
@pytest.mark.parametrize(("past", "new"), [(1, 2), (37, 5), (700, 129), (64, 600)])
def test_split_equals_the_masked_pass(heads, kv_heads, dtype, tol, past, new):
    g = torch.Generator().manual_seed(past * 1000 + new)
    q = torch.randn(1, heads, new, 16, generator=g).to(dtype)
    k = torch.randn(1, kv_heads, past + new, 16, generator=g).to(dtype)
    v = torch.randn(1, kv_heads, past + new, 16, generator=g).to(dtype)
    got = attention.split(q, k, v, None)
    assert got.dtype == dtype and got.shape == q.shape
    err = float((got.float() - masked(q, k, v)).abs().max())
    assert err <= tol, err
    assert torch.equal(got, attention.split(q, k, v, None))  # the same bits again


def mask_of(q_length, kv_length, **kw):
    return attention.mask(1, q_length, kv_length, kv_length - q_length, 0, **kw)


def test_the_mask_is_skipped_only_for_a_continuing_plain_causal_pass():
    assert mask_of(5, 40) is not None  # outside the engine's forward: SDPA's own
    with attention.continuing():
        assert mask_of(5, 40, mask_function=causal_mask_function) is None
        window = mask_of(5, 40, mask_function=sliding_window_causal_mask_function(8))
        assert window is not None and window.dtype == torch.bool
        padded = mask_of(5, 40, attention_mask=torch.ones(1, 40, dtype=torch.bool))
        assert padded is not None  # a batch's padding: SDPA's mask
        # queries not at the end (an empty static cache): spelled out, never None
        top_left = attention.mask(1, 5, 40, 0, 0)
        assert (
            top_left is not None and bool(top_left[0, 0, 0, 0]) and not bool(top_left[0, 0, 0, 1])
        )
    assert mask_of(5, 40) is not None


class _Module(torch.nn.Module):
    def __init__(self, causal: bool) -> None:
        super().__init__()
        self.is_causal = causal
        self.num_key_value_groups = 1


def test_a_bidirectional_module_is_never_split():
    """With no mask and more keys than queries an encoder attends to all of them:
    inside the engine's forward too, the attention stays SDPA's."""
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, 2, n, 8, generator=g) for n in (4, 9, 9))
    with attention.continuing():
        out, _ = attention.attention(_Module(causal=False), q, k, v, None)
        causal, _ = attention.attention(_Module(causal=True), q, k, v, None)
    full = F.scaled_dot_product_attention(q, k, v).transpose(1, 2)
    assert torch.allclose(out, full, atol=1e-6)
    assert not torch.allclose(causal, full, atol=1e-3)  # the split did apply there


def test_a_zoo_model_continues_within_rounding_of_sdpa():
    """qwen2 (grouped heads) served with the split: the card names it, a prefill
    continuing a cache is within 1e-5 of the same model on SDPA's masked pass,
    and computing it twice gives the same bits."""
    engine = load_engine(str(zoo.hf_model("qwen2")), engine="torch")
    assert engine.card.engine == f"transformers/{attention.NAME}"
    rng = random.Random(0)
    vocab = engine.model.config.vocab_size
    head = [rng.randrange(10, vocab - 10) for _ in range(300)]
    tail = [rng.randrange(10, vocab - 10) for _ in range(90)]

    def continued(impl: str) -> torch.Tensor:
        engine.model.set_attn_implementation(impl)
        return engine.resume(engine.prefill(head), len(head), head + tail).logits

    split = continued(attention.NAME)
    assert torch.equal(split, continued(attention.NAME))
    sdpa = continued("sdpa")
    engine.model.set_attn_implementation(attention.NAME)
    err = float((split - sdpa).abs().max())
    assert 0 < err <= 1e-5, err  # not the masked pass, within rounding of it
