"""Gemma 4 through ``vllm serve`` with the connector (needs ``.venv-vllm``).

The zoo's ``gemma4`` text model has what the original system's model family has:
sliding layers of 2 KV heads x 32 beside full layers of 1 KV head x 64 (vLLM makes
KV cache groups of two page shapes), KV-shared layers (the last two read layers 3
and 2: vLLM gives them no cache of their own) and full layers whose values come
from the key projection (``attention_k_eq_v``: V is still cached apart from K).
A kvmesh page is one block index over every group, each owning layer's page at its
own shape in the model's order; the card lists every layer (``shared`` for a
layer that reads another's KV) as the torch head's does.

Server A (vLLM's defaults: its hybrid manager, its process layout) computes a
700-token prompt and publishes its pages to a ``kvmesh peer``; a fresh server B
gets at least 80% of the prompt from the mesh with the tokens and
log-probabilities of A's own prefix-cache hit, bit for bit.
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

BLOCK = 128  # vLLM's CPU page
PROMPT = 700
LAYERS = ["kv:2x32:w96", "kv:2x32:w96", "kv:1x64", "kv:2x32:w96", "shared", "shared"]


def test_a_fresh_vllm_serve_gets_a_gemma4_prompt_from_the_mesh(tmp_path):
    from kvmesh.vllm.pages import CacheSpec, model_card

    model = zoo.hf_model("gemma4")
    prompt = zoo.prompt_tokens(model, PROMPT)
    peer = Peer(alias="cache", log_dir=tmp_path)
    try:
        conn = {"seed": peer.address}
        with APIServer(str(model), conn, tmp_path / "a.log", max_model_len=2048) as a:
            cold = a.complete(prompt, 4)
            again = a.complete(prompt, 4)  # vLLM's own prefix-cache hit
        with APIServer(str(model), conn, tmp_path / "b.log", max_model_len=2048) as b:
            warm = b.complete(prompt, 4)
    finally:
        peer.kill()
    log = (tmp_path / "a.log").read_text(errors="replace")
    assert "Hybrid KV cache manager is disabled" not in log  # vLLM's groups, as it made them
    assert cold[2] == 0 and cold[3]["loaded"] == 0
    assert again[3] is None and again[2] >= 0.8 * PROMPT
    assert warm[3]["source"] == "remote", warm[3]
    assert warm[2] == again[2] == (PROMPT - 1) // BLOCK * BLOCK >= 0.8 * PROMPT  # 640 of 700
    assert warm[:2] == again[:2]  # tokens and log-probabilities, bit for bit
    assert warm[0] == cold[0]

    engine, namespace = warm[3]["cards"]["0"]
    kv = ((2, 32), (2, 32), (1, 64), (2, 32), (0, 0), (0, 0))
    spec = CacheSpec(6, 2, 32, BLOCK, "float32", windows=(96, 96, 0, 96, 0, 0), kv=kv)
    card = model_card(model, model, spec, engine=engine)
    assert [g.encode() for g in card.geometry] == LAYERS
    assert card.namespace_hex == namespace
