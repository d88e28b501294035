"""A hybrid Gated DeltaNet model through ``vllm serve`` with the connector (needs ``.venv-vllm``).

The zoo's Qwen3.5 recipe built as Qwen3-Next (three Gated DeltaNet layers, one
gated full-attention layer, one MoE layer): what vLLM 0.32's CPU build runs of
the family (its GDN kernel wants bfloat16 and linear head dims of 128; vLLM's
Qwen3.5 class needs torchvision's image transforms, which have no CPU build for
this torch). vLLM's ``--mamba-cache-mode align`` (its default with prefix caching) keeps a recurrent state where a
prefill chunk ends (a block boundary), in a page of its own KV cache group; the
connector saves that state with the attention pages of the same boundary and a
load ends on a page that carries one. Server A computes a 1,600-token prompt and
publishes; a fresh server B gets the prompt up to vLLM's checkpoint from the mesh
with the tokens and log-probabilities of A's own prefix-cache hit, bit for bit.
"""

from __future__ import annotations

import pytest

pytest.importorskip(
    "vllm",
    reason="needs vLLM: tests/vllm/setup_venv.sh, then .venv-vllm/bin/python -m pytest tests/vllm",
)

from .. import zoo  # noqa: E402
from ..procs import Peer  # noqa: E402
from .serve import APIServer  # noqa: E402

PROMPT = 1600
QWEN3_NEXT = dict(  # the zoo's Qwen3.5 weights recipe, as vLLM's CPU build runs it
    architectures=["Qwen3NextForCausalLM"],
    model_type="qwen3_next",
    linear_key_head_dim=128,
    linear_value_head_dim=128,
    linear_num_value_heads=2,
    head_dim=64,
    mlp_only_layers=[0, 1, 2],  # vLLM's Qwen3-Next wants one MoE layer at least
    num_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=64,
    shared_expert_intermediate_size=64,
    norm_topk_prob=True,
    decoder_sparse_step=1,
    rope_parameters={"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25},
)
# vLLM's defaults otherwise: prefix caching on, so --mamba-cache-mode align
ARGS = ("--dtype", "bfloat16")


def test_a_fresh_vllm_serve_gets_a_hybrid_prompt_and_its_state_from_the_mesh(tmp_path):
    from kvmesh.vllm.pages import CacheSpec, model_card

    model = zoo.reshaped("qwen3_5", **QWEN3_NEXT)
    prompt = zoo.prompt_tokens(model, PROMPT)
    peer = Peer(alias="cache", log_dir=tmp_path)
    try:
        conn = {"seed": peer.address}
        with APIServer(str(model), conn, tmp_path / "a.log", *ARGS, max_model_len=2048) as a:
            cold = a.complete(prompt)
            again = a.complete(prompt)  # vLLM's own prefix-cache hit: its checkpoint
        with APIServer(str(model), conn, tmp_path / "b.log", *ARGS, max_model_len=2048) as b:
            warm = b.complete(prompt)
    finally:
        peer.kill()
    assert cold[2] == 0 and cold[3]["loaded"] == 0
    checkpoint = again[2]  # the last block boundary before the last token
    assert checkpoint >= 0.8 * PROMPT and again[3] is None
    assert warm[2] == checkpoint
    assert warm[3]["source"] == "remote" and warm[3]["loaded"] >= 1, warm[3]
    assert warm[3]["load"] == "async"  # a state cut: a failed page fails the whole request
    assert warm[:2] == again[:2]  # tokens and top-5 log-probabilities, bit for bit
    assert warm[0] == cold[0]

    engine, namespace = warm[3]["cards"]["0"]
    assert "/unknown/" not in engine  # the attention layer's backend, not a GDN layer's
    card = _card(model, engine, CacheSpec, model_card, checkpoint // warm[3]["loaded"])
    assert card.namespace_hex == namespace and card.state_optional
    assert [g.kind for g in card.geometry] == ["state"] * 3 + ["kv"]


def _card(model, engine, CacheSpec, model_card, block):  # noqa: N803
    """The card B served, rebuilt from the model's config and vLLM's state shapes
    (conv state then recurrent state, per Gated DeltaNet layer)."""
    import torch

    cfg = QWEN3_NEXT
    conv = 2 * 2 * cfg["linear_key_head_dim"] + 2 * cfg["linear_value_head_dim"]
    # vLLM's CPU build keeps the recurrent state in float32 where its accelerated GDN
    # runs (AVX-512 BF16 or AMX), else in the model's dtype ("auto")
    recurrent = "float32" if torch.cpu._is_avx512_bf16_supported() else "bfloat16"
    state = (
        ("bfloat16", (3, conv)),  # kernel 4: the last 3 inputs
        (recurrent, (2, cfg["linear_key_head_dim"], cfg["linear_value_head_dim"])),
    )
    spec = CacheSpec(
        num_layers=4,
        num_kv_heads=2,
        head_dim=cfg["head_dim"],
        block_size=block,
        kv_dtype="bfloat16",
        windows=(0,) * 4,
        states=(state,) * 3 + ((),),
    )
    return model_card(model, model, spec, engine=engine)
