"""The in-place gated MLP (:mod:`kvmesh.engine.mlp`) computes exactly what
transformers' own forward does: bit-identical logits on the zoo's gated-SiLU
architectures, batched and chunked, and the MLPs it is not for keep their own."""

from __future__ import annotations

import pytest
import torch

from kvmesh.engine.hf import TransformersEngine
from kvmesh.engine.mlp import GATED, fuse_gated_mlps

from . import zoo


@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral"])
def test_in_place_mlps_give_the_same_numbers(arch):
    from transformers import AutoModelForCausalLM

    path = zoo.hf_model(arch)
    plain = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    fused = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    assert fuse_gated_mlps(fused) == plain.config.num_hidden_layers
    ids = torch.tensor([zoo.prompt_tokens(path, 96, seed=3), zoo.prompt_tokens(path, 96, seed=4)])
    with torch.inference_mode():
        assert torch.equal(plain(ids).logits, fused(ids).logits)
    engine = TransformersEngine(path)  # the engine fuses its own
    tokens = ids[0].tolist()
    whole = engine.prefill(tokens).logits
    state = engine.begin_prefill(tokens)
    engine.prefill_batch([state], [40])
    engine.prefill_batch([state], [56])
    assert torch.allclose(state.logits, whole, atol=1e-5)


def test_other_mlps_keep_their_forward():
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(zoo.hf_model("gemma3")), dtype=torch.float32)
    assert fuse_gated_mlps(model) == 0  # a GELU MLP
    assert not any(type(m).__name__ in GATED for m in model.modules())
