"""LoRA adapters through ``vllm serve`` with the connector (needs ``.venv-vllm``).

A request with an adapter is keyed from a root of the adapter's weights digest
(:func:`kvmesh.blocks.adapter_digest`): server A serves a prompt with adapter
``a`` and publishes its pages; a fresh server B, where the same adapter files are
served under another name, gets the prompt from the mesh with the tokens and
log-probabilities of A's own prefix-cache hit, bit for bit; on B the same prompt
with another adapter, or with none, finds nothing (its KV is not ``a``'s).
"""

from __future__ import annotations

import shutil

import pytest

pytest.importorskip(
    "vllm",
    reason="needs vLLM: tests/vllm/setup_venv.sh, then .venv-vllm/bin/python -m pytest tests/vllm",
)

from .. import zoo  # noqa: E402
from ..procs import Peer  # noqa: E402
from .serve import APIServer  # noqa: E402

BLOCK = 128  # vLLM's CPU page
PROMPT = [5 + (i * 7) % 200 for i in range(420)]
PAGES = (len(PROMPT) - 1) // BLOCK


def lora_args(**adapters: object) -> list[str]:
    return ["--enable-lora", "--max-lora-rank", "8", "--lora-modules"] + [
        f"{name}={path}" for name, path in adapters.items()
    ]


def test_an_adapters_prompt_is_shared_under_its_weights_and_no_others(tmp_path, tiny_dir):
    a, b = zoo.lora_adapter(tiny_dir, 1), zoo.lora_adapter(tiny_dir, 2)
    renamed = shutil.copytree(a, tmp_path / "renamed-a")  # the same files elsewhere
    peer = Peer(alias="cache", log_dir=tmp_path)
    try:
        conn = {"seed": peer.address}
        with APIServer(str(tiny_dir), conn, tmp_path / "a.log", *lora_args(a=a, b=b)) as srv:
            cold = srv.complete(PROMPT, 4, model="a")
            again = srv.complete(PROMPT, 4, model="a")  # vLLM's own prefix-cache hit
        args = lora_args(mine=renamed, b=b)
        with APIServer(str(tiny_dir), conn, tmp_path / "b.log", *args) as srv:
            warm = srv.complete(PROMPT, 4, model="mine")
            other = srv.complete(PROMPT, 4, model="b")
            base = srv.complete(PROMPT, 4)
    finally:
        peer.kill()
    assert cold[2] == 0 and cold[3]["loaded"] == 0
    assert again[3] is None and again[2] == PAGES * BLOCK
    assert warm[3]["source"] == "remote" and warm[3]["loaded"] == PAGES, warm[3]
    assert warm[2] == PAGES * BLOCK
    assert warm[:2] == again[:2]  # tokens and log-probabilities, bit for bit
    for miss in (other, base):  # neither finds a's pages, nor anything else
        assert miss[2] == 0 and miss[3]["pages"] == miss[3]["loaded"] == 0, miss[3]
    # the adapters do change the model: a's answer is neither b's nor the base's
    assert len({str(warm[1]), str(other[1]), str(base[1])}) == 3
