"""vLLM's FP8 KV cache (``--kv-cache-dtype fp8``) through the connector (needs ``.venv-vllm``).

vLLM's CPU build stores FP8 KV as uint8 pages with one K and one V scale per layer
(``FP8_PER_TENSOR``); it runs only on x86 with AVX-512 or AMX. The pages travel as
stored; the card says ``float8_e4m3fn`` and its engine string carries a digest of
every layer's scales, so FP8 pages never meet full-precision ones, nor FP8 pages
under other scales. Server A (``vllm serve``) computes a prompt and publishes; a
fresh server B gets its full pages from the mesh with the tokens and
log-probabilities of A's own prefix-cache hit, bit for bit.
"""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip(
    "vllm",
    reason="needs vLLM: tests/vllm/setup_venv.sh, then .venv-vllm/bin/python -m pytest tests/vllm",
)

from ..procs import Peer  # noqa: E402
from .serve import APIServer  # noqa: E402

BLOCK = 128
PROMPT = [5] + [(5 * 31 + i * 7) % 250 + 3 for i in range(419)]  # 420 tokens, 3 full pages


def cpu_flags() -> set[str]:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


@pytest.mark.skipif(
    not cpu_flags() & {"avx512f", "amx_tile"},
    reason="vLLM's CPU build runs an FP8 KV cache only on x86 with AVX-512 or AMX",
)
def test_fp8_pages_travel_as_stored_under_their_own_card(tiny_dir, tmp_path):
    from kvmesh.vllm.pages import CacheSpec, model_card

    peer = Peer(alias="cache", log_dir=tmp_path)
    fp8 = ("--kv-cache-dtype", "fp8")
    try:
        conn = {"seed": peer.address}
        with APIServer(str(tiny_dir), conn, tmp_path / "a.log", *fp8) as a:
            cold = a.complete(PROMPT)
            again = a.complete(PROMPT)  # vLLM's own prefix-cache hit
        with APIServer(str(tiny_dir), conn, tmp_path / "b.log", *fp8) as b:
            warm = b.complete(PROMPT)
    finally:
        peer.kill()
    assert cold[2] == 0 and cold[3]["loaded"] == 0 and again[3] is None
    assert warm[3]["source"] == "remote" and warm[3]["loaded"] == (len(PROMPT) - 1) // BLOCK
    assert warm[2] == again[2] >= BLOCK * warm[3]["loaded"]
    assert warm[:2] == again[:2]  # tokens and top log-probabilities, bit for bit

    engine, namespace = warm[3]["cards"]["0"]
    assert "/kv_scales=" in engine
    spec = dict(num_layers=4, num_kv_heads=1, head_dim=32, block_size=BLOCK)
    card = model_card(
        tiny_dir, tiny_dir, CacheSpec(**spec, kv_dtype="float8_e4m3fn"), engine=engine
    )
    assert card.namespace_hex == namespace and card.kv_dtype == "float8_e4m3fn"
    full = model_card(tiny_dir, tiny_dir, CacheSpec(**spec, kv_dtype="float32"), engine=engine)
    assert full.namespace_hex != namespace
