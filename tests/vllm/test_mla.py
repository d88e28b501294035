"""Multi-head latent attention (DeepSeek-V3's MLA) through ``vllm serve`` with the
connector (needs ``.venv-vllm``).

The zoo's tiny DeepSeek-V3 with the latent vLLM's CPU MLA kernel runs (512 + 64:
``kv_lora_rank`` + ``qk_rope_head_dim``). An MLA page holds one latent vector per
token and layer; it travels as the two halves of its bytes under the card's K and
V specs, the backend (``CPU_MLA``) in the card's engine string. vLLM's CPU build
turns prefix caching (and chunked prefill) off for MLA, so the reference is the
cold prefill: server A computes a 1,600-token prompt and publishes, a fresh
server B gets all its full pages from the mesh (bytes verified as A wrote them)
and decodes the same tokens.
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
BLOCK = 16  # vLLM CPU MLA's page
LATENT = dict(kv_lora_rank=512, qk_rope_head_dim=64, topk_method="noaux_tc")
# on a CPU with AMX vLLM prefers its AMX MLA kernel, which takes bf16 weights and head
# dims of 32 and more: the float32 test model runs on the portable one, as on CPUs without
MLA_BACKEND = ("--attention-backend", "CPU_MLA")


def test_a_fresh_vllm_serve_gets_an_mla_prompt_from_the_mesh(tmp_path):
    model = zoo.latent_model(**LATENT)
    prompt = zoo.prompt_tokens(model, PROMPT)
    peer = Peer(alias="cache", log_dir=tmp_path)
    try:
        conn = {"seed": peer.address}
        with APIServer(str(model), conn, tmp_path / "a.log", *MLA_BACKEND, max_model_len=2048) as a:
            cold = a.complete(prompt)
        with APIServer(str(model), conn, tmp_path / "b.log", *MLA_BACKEND, max_model_len=2048) as b:
            warm = b.complete(prompt)
    finally:
        peer.kill()
    assert "prefix caching to be disabled" in (tmp_path / "a.log").read_text()
    assert cold[2] == 0 and cold[3]["loaded"] == 0
    assert warm[3]["source"] == "remote", warm[3]
    assert warm[3]["loaded"] == (PROMPT - 1) // BLOCK and warm[2] >= 0.8 * PROMPT
    assert "CPU_MLA" in warm[3]["cards"]["0"][0]
    assert warm[0] == cold[0]
    for got, ref in zip(warm[1], cold[1], strict=True):
        assert [t for t, _ in got] == [t for t, _ in ref]
        # vLLM's CPU MLA attends over cached latents (up-projected, partial results
        # merged) on another path than a cold prefill's: the same tokens, log-
        # probabilities apart in the last digits (measured up to 0.009)
        assert max(abs(x - y) for (_, x), (_, y) in zip(got, ref, strict=True)) < 0.05
