"""Sliding-window models through ``vllm serve`` with the connector (needs ``.venv-vllm``).

Two of the zoo's shapes vLLM's CPU build runs: a Gemma-3 whose sliding layers read a
128-token window beside full layers, and a gpt-oss (alternating sliding and full
layers, attention sinks, MoE, YaRN; head dim 32, the least vLLM's CPU attention
runs). Without a connector that speaks vLLM's hybrid manager, vLLM serves them as
one group of full-attention pages that keep every position, and so does kvmesh.
Server A (vLLM's default process layout) computes a 1,600-token prompt and
publishes its pages to a ``kvmesh peer``; a fresh server B gets at least 80% of
the prompt from the mesh, with the tokens and log-probabilities of A's own
prefix-cache hit on it (bit for bit where vLLM itself is; a cold prefill differs
from both in the last bits: vLLM's CPU attention over a window, not the cache). The card
both ran under carries each layer's window, so these pages never meet those of
the same weights without windows.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip(
    "vllm",
    reason="needs vLLM: tests/vllm/setup_venv.sh, then .venv-vllm/bin/python -m pytest tests/vllm",
)

from .. import zoo  # noqa: E402
from ..procs import Peer  # noqa: E402
from .serve import APIServer, token_ids  # noqa: E402

BLOCK = 128  # vLLM's CPU page
# vLLM 0.32's CPU build decodes gpt-oss differently from one request to the next in
# one process (two requests from its own cache part ways at the second token, and a
# fresh process's first decode step gives zero hidden states): on gpt-oss only the
# first token, the prefill's, is vLLM's to repeat bit for bit
TOKENS = {"gemma3": 4, "gpt_oss": 1}
PROMPT = 1600
WINDOW = 128

MODELS = {
    "gemma3": lambda: zoo.windowed(zoo.hf_model("gemma3"), WINDOW),
    "gpt_oss": lambda: zoo.reshaped("gpt_oss", head_dim=32),
}


def complete(srv: APIServer, model: str, prompt: list[int], max_tokens: int):
    import openai

    client = openai.OpenAI(base_url=srv.url + "/v1", api_key="none", timeout=600)
    resp = client.completions.create(
        model=model, prompt=prompt, max_tokens=max_tokens, temperature=0, logprobs=5
    )
    tokens, top = token_ids(resp.choices[0])
    report = ((resp.model_extra or {}).get("kv_transfer_params") or {}).get("kvmesh")
    return tokens, top, resp.usage.prompt_tokens_details.cached_tokens, report


def windows_of(model: Path) -> tuple[int, ...]:
    """Per layer, the window the config asks for (Gemma-3's pattern, gpt-oss's types)."""
    cfg = json.loads((model / "config.json").read_text())
    n = cfg["num_hidden_layers"]
    if "layer_types" in cfg:
        kinds = cfg["layer_types"]
    else:  # Gemma-3 as the hub ships it: every sliding_window_pattern-th layer is full
        kinds = [
            "full_attention" if (i + 1) % cfg["sliding_window_pattern"] == 0 else "sliding"
            for i in range(n)
        ]
    return tuple(0 if k == "full_attention" else cfg["sliding_window"] for k in kinds)


@pytest.mark.parametrize("arch", list(MODELS))
def test_a_fresh_vllm_serve_gets_a_sliding_window_prompt_from_the_mesh(arch, tmp_path):
    from kvmesh.vllm.pages import CacheSpec, model_card

    model = MODELS[arch]()
    prompt = zoo.prompt_tokens(model, PROMPT)
    peer = Peer(alias="cache", log_dir=tmp_path)
    try:
        conn = {"seed": peer.address}
        with APIServer(str(model), conn, tmp_path / "a.log", max_model_len=2048) as a:
            cold = complete(a, str(model), prompt, TOKENS[arch])
            again = complete(a, str(model), prompt, TOKENS[arch])  # vLLM's own prefix-cache hit
        with APIServer(str(model), conn, tmp_path / "b.log", max_model_len=2048) as b:
            warm = complete(b, str(model), prompt, TOKENS[arch])
    finally:
        peer.kill()
    assert cold[2] == 0 and cold[3]["loaded"] == 0
    # vLLM's CPU attention computes a sliding layer's last bits differently for a
    # prompt continued from cached pages than for a cold one; the reference is
    # vLLM's own prefix cache, which the mesh matches bit for bit
    assert again[2] == warm[2] and again[3] is None
    assert warm[:2] == again[:2]  # tokens and top log-probabilities, bit for bit
    assert warm[0] == cold[0]
    assert warm[2] >= 0.8 * PROMPT
    assert warm[3]["source"] == "remote" and warm[3]["loaded"] == (PROMPT - 1) // BLOCK

    engine, namespace = warm[3]["cards"]["0"]
    windows = windows_of(model)
    assert 0 in windows and len(set(windows)) == 2  # sliding layers beside full ones
    cfg = json.loads((model / "config.json").read_text())
    spec = dict(
        num_layers=len(windows),
        num_kv_heads=cfg["num_key_value_heads"],
        head_dim=cfg["head_dim"],
        block_size=BLOCK,
        kv_dtype="float32",
    )
    card = model_card(model, model, CacheSpec(**spec, windows=windows), engine=engine)
    assert card.namespace_hex == namespace and card.sliding_windows == windows
    unwindowed = model_card(model, model, CacheSpec(**spec), engine=engine)
    assert unwindowed.namespace_hex != namespace
