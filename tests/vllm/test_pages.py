"""The connector's pieces that need no vLLM: settings, the card, and page copies.

These run in the main environment too; the process tests in ``test_procs.py``
need ``.venv-vllm`` (``tests/vllm/setup_venv.sh``).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from kvmesh.blocks import BlockKeyer
from kvmesh.codec import Layout, decode_block, new_blob
from kvmesh.compat import STATE_WHERE_SAVED
from kvmesh.errors import ConfigError, IncompatibleCard, MalformedPayload
from kvmesh.vllm.config import parse_settings
from kvmesh.vllm.pages import (
    PAGED,
    SPLIT_KV,
    CacheSpec,
    Pages,
    StateCut,
    check_position,
    model_card,
    page_keys,
)

from ..helpers import small_card

ENGINE = "vllm/0.32.0/cpu/CPU_ATTN/paged/float32/compile=NONE"


def test_settings_use_the_head_flag_names():
    s = parse_settings(
        {
            "seed": "10.0.0.2:7070,10.0.0.3:7070",
            "budget": "4GiB",
            "alias": "gpu-1",
            "listen": "127.0.0.1:0",
            "no-publish": "true",
            "advertise": "10.0.0.9:7070,interface=ethernet",
        }
    )
    assert s["seed"] == ["10.0.0.2:7070", "10.0.0.3:7070"]
    assert s["advertise"] == ["10.0.0.9:7070,interface=ethernet"]
    assert s["grpc_listen"] == "127.0.0.1:0" and not s.publish
    cfg = s.node_config()
    assert cfg.budget_bytes == 4 << 30 and cfg.alias == "gpu-1" and "head" in cfg.roles


@pytest.mark.parametrize(
    "extra",
    [
        {"sed": "x:1"},
        {"budget": "lots"},
        {"seed": 7},
        {"ttl": -1},
        {"plaintext": "maybe"},
        {"listen": "0.0.0.0:7070"},
        {"max_pending_publishes": 0},
    ],
)
def test_bad_settings_are_one_clear_error(extra):
    with pytest.raises(ConfigError, match="kv_connector_extra_config"):
        parse_settings(extra).node_config()


def test_the_vllm_card_is_another_namespace_than_the_heads(tiny_dir):
    from kvmesh.engine.base import CacheGeometry, card_from_hf_dir

    spec = CacheSpec(num_layers=4, num_kv_heads=1, head_dim=32, block_size=32, kv_dtype="float32")
    vcard = model_card(tiny_dir, tiny_dir, spec, engine=ENGINE)
    hcard = card_from_hf_dir(
        tiny_dir,
        "transformers/sdpa",
        CacheGeometry.attention("float32", 1, 32, (0,) * 4),
        "none",
        32,
    )
    same = {"model_id", "weights_digest", "tokenizer_digest", "rope", "num_layers", "block_tokens"}
    assert all(getattr(vcard, f) == getattr(hcard, f) for f in same)
    assert vcard.namespace != hcard.namespace
    # and a block of one is refused under the other's layout
    keyer = BlockKeyer(vcard.namespace, 32)
    cache = torch.randn(3, 1, 32, 64)
    pages = Pages(vcard, [cache] * 4)
    blob, header = pages.copy_out(keyer, keyer.keys(list(range(32))), 0, 1)
    blk = pages.seal(blob, header)
    with pytest.raises(IncompatibleCard):
        decode_block(blk.blob, Layout(hcard))


def _card(**over):
    return small_card(num_layers=2, num_kv_heads=2, head_dim=4, block_tokens=4, **over)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_pages_round_trip_through_the_codec(dtype):
    name = str(dtype).removeprefix("torch.")
    card = _card(kv_dtype=name)
    src = [torch.randn(5, 2, 4, 8).to(dtype) for _ in range(2)]  # [blocks, heads, B, 2*D]
    dst = [torch.zeros_like(t) for t in src]
    out, into = Pages(card, src), Pages(card, dst)
    assert out.kind == PAGED
    keyer = BlockKeyer(card.namespace, 4)
    keys = keyer.keys(list(range(8)))
    for i, (b_src, b_dst) in enumerate([(3, 0), (1, 4)]):
        blob, header = out.copy_out(keyer, keys, i, b_src)
        blk = decode_block(out.seal(blob, header).blob, out.layout)  # the wire checks pass
        check_position(blk, keyer, keys, i)
        into.copy_in(blk, b_dst)
        for s, d in zip(src, dst, strict=True):
            assert torch.equal(s[b_src].view(torch.uint8), d[b_dst].view(torch.uint8))
    assert not dst[0][1].any()  # nothing else written


def test_split_kv_layout_moves_k_and_v_pages():
    card = _card()
    src = [torch.randn(2, 6, 4, 2, 4) for _ in range(2)]  # [2, blocks, B, heads, D]
    dst = [torch.zeros_like(t) for t in src]
    out, into = Pages(card, src), Pages(card, dst)
    assert out.kind == SPLIT_KV
    keyer = BlockKeyer(card.namespace, 4)
    keys = keyer.keys([1, 2, 3, 4])
    blob, header = out.copy_out(keyer, keys, 0, 5)
    into.copy_in(out.seal(blob, header), 2)
    assert all(torch.equal(s[:, 5], d[:, 2]) for s, d in zip(src, dst, strict=True))


# Run in a process of its own (nothing else starts threads there): a page's copies
# on a thread of the connector's own, then a torch copy as large, each followed by
# the count of the process's threads while that thread lives (a team adds workers).
_TEAM_PROBE = """
import os, threading, torch
from kvmesh.blocks import BlockKeyer
from kvmesh.vllm.pages import Pages
from tests.helpers import small_card

card = small_card(num_kv_heads=2, head_dim=64, block_tokens=128)  # 64 KiB a part
src = [torch.randn(3, 2, 128, 128) for _ in range(2)]
dst = [torch.zeros_like(t) for t in src]
out, into = Pages(card, src), Pages(card, dst)
keyer = BlockKeyer(card.namespace, 128)
keys = keyer.keys(list(range(128)))
block = out.seal(*out.copy_out(keyer, keys, 0, 1))
tasks = lambda: len(os.listdir("/proc/self/task"))

def load():
    before = tasks()
    into.copy_in(block, 2)
    out.copy_out(keyer, keys, 0, 0)
    pages = tasks() - before
    torch.empty(1 << 20, dtype=torch.uint8).copy_(torch.ones(1 << 20, dtype=torch.uint8))
    print(pages, tasks() - before - pages, all(torch.equal(s[1], d[2]) for s, d in zip(src, dst)))

t = threading.Thread(target=load)
t.start()
t.join()
"""


def test_page_copies_on_a_connector_thread_build_no_openmp_team():
    """A torch copy of a 64 KiB page part on a thread builds an OpenMP team there for
    the thread's life (the probe's control adds its worker); the connector's copies
    go through NumPy and add none."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "OMP_NUM_THREADS": "2", "PYTHONPATH": str(root)}
    run = subprocess.run(
        [sys.executable, "-c", _TEAM_PROBE], capture_output=True, text=True, env=env, cwd=root
    )
    assert run.returncode == 0, run.stderr[-2000:]
    pages, control, equal = run.stdout.split()
    assert (pages, control, equal) == ("0", "1", "True")


@pytest.mark.parametrize(
    "tensors, match",
    [
        ([torch.zeros(5, 2, 4, 8)], "the card says 2"),
        ([torch.zeros(5, 2, 4, 8, dtype=torch.float16)] * 2, "float16"),
        ([torch.zeros(5, 2, 4, 6)] * 2, "does not hold"),
        ([torch.zeros(5, 8, 4, 2).transpose(1, 3)] * 2, "not contiguous"),
    ],
)
def test_cache_tensors_that_disagree_with_the_card_are_refused(tensors, match):
    with pytest.raises(ConfigError, match=match):
        Pages(_card(), tensors)


def test_a_block_is_used_only_where_its_key_says():
    card = _card()
    keyer = BlockKeyer(card.namespace, 4)
    keys = keyer.keys(list(range(12)))
    pages = Pages(card, [torch.randn(3, 2, 4, 8)] * 2)
    blob, header = pages.copy_out(keyer, keys, 1, 0)
    blk = pages.seal(blob, header)
    check_position(blk, keyer, keys, 1)
    with pytest.raises(MalformedPayload):
        check_position(blk, keyer, keys, 2)
    other = Pages(dataclasses.replace(card, num_layers=1), [torch.randn(3, 2, 4, 8)])
    with pytest.raises(MalformedPayload):
        pages.copy_in(other.seal(*other.copy_out(BlockKeyer(card.namespace, 4), keys, 1, 0)), 0)


def test_layers_of_other_page_shapes_and_shared_layers_travel_in_one_block():
    """Gemma 4's cache as vLLM's CPU build lays it out: sliding layers 2 KV heads x 32,
    full ones 1 x 64, each a view of one buffer at its own shape, and KV-shared layers
    (their target's tensor, nothing of their own). A block is every owning layer's
    page at its own shape, in the model's order; the card lists each layer as the
    heads' cards do (tests/test_mlx_today.py, tests/test_today_torch.py)."""
    from .. import zoo

    model = zoo.hf_model("gemma4")
    kv = ((2, 32), (2, 32), (1, 64), (2, 32), (0, 0), (0, 0))
    windows = (96, 96, 0, 96, 0, 0)
    spec = CacheSpec(6, 2, 32, 128, "float32", windows=windows, kv=kv)
    card = model_card(model, model, spec, engine=ENGINE)
    want = ["kv:2x32:w96", "kv:2x32:w96", "kv:1x64", "kv:2x32:w96", "shared", "shared"]
    assert [g.encode() for g in card.geometry] == want

    def cache(fill):  # [blocks, heads, B, 2 * D] per owning layer
        owning = [fill(4, *shape) for shape in [(2, 128, 64)] * 2 + [(1, 128, 128), (2, 128, 64)]]
        return [*owning, owning[3], owning[2]]  # layers 4 and 5 read layers 3 and 2

    src, dst = cache(torch.randn), cache(torch.zeros)
    groups = [1, 1, 0, 1, 1, 0]  # the full layer's group and the sliding ones'
    out, into = Pages(card, src, groups), Pages(card, dst, groups)
    assert out.page_bytes == 4 * 2 * 128 * 64 * 4  # the owning layers' pages, no more
    keyer = BlockKeyer(card.namespace, 128)
    keys = keyer.keys(list(range(256)))
    blob, header = out.copy_out(keyer, keys, 1, [3, 2])  # full group page 3, sliding 2
    blk = decode_block(out.seal(blob, header).blob, out.layout)
    into.copy_in(blk, [0, 1])
    for layer, (s, d) in enumerate(zip(src[:4], dst[:4], strict=True)):
        at = 3 if layer == 2 else 2
        assert torch.equal(s[at], d[0 if layer == 2 else 1]), layer
    assert not dst[2][1:].any() and not dst[0][0].any()  # nothing else written


def test_an_import_is_cut_to_the_last_page_that_carries_the_state():
    """On a card that leaves the state to its producer, a hit is cut to the last page
    its lookup answer flags with the state (from a peer that sets no flag, the last
    whose announced size says so; never past a stateless last page), and so are the
    stored chain and the verified pages a load takes; on another card nothing is."""
    from kvmesh.mesh.hits import PeerHit, info_of
    from kvmesh.mesh.proto import kvmesh_pb2 as pb

    card = small_card(
        num_kv_heads=0,
        head_dim=0,
        layer_geometry=("state:float32[2,8]", "kv:1x8"),
        state_every=STATE_WHERE_SAVED,
    )
    layout = Layout(card)
    blocks = []
    for i, state in enumerate((True, False, True, False)):
        header = layout.header("block", bytes([i]) * 32, bytes(32), i * 4, 4, state)
        blob, view = new_blob(header)
        view[:] = bytes(len(view))
        blocks.append(layout.seal(header, blob))
    cut = StateCut(layout)
    assert cut.end([False, True, False]) == 2 and cut.end([False, False]) == 0
    assert cut.blocks(blocks) == 3 and cut.blocks(blocks[1:2]) == 0

    infos = tuple(info_of(b) for b in blocks)
    hit = PeerHit("n", "p", "a", "ethernet", "e", infos, None, 16)
    assert [b.states for b in cut.hit(hit).blocks] == [True, False, True]
    assert cut.hit(hit).tokens == 12
    old = tuple(pb.BlockInfo(key=b.key, nbytes=b.nbytes, tokens=4) for b in infos)  # no flag
    assert len(cut.hit(dataclasses.replace(hit, blocks=old)).blocks) == 3
    lying = tuple(pb.BlockInfo(key=b.key, nbytes=b.nbytes, tokens=4, states=False) for b in infos)
    assert cut.hit(dataclasses.replace(hit, blocks=lying)).tokens == 0

    plain = StateCut(Layout(small_card()))
    assert not plain.applies and plain.end([False, False]) == 2
    assert plain.hit(hit) is hit and plain.blocks(blocks) == 4


class _CountingKeyer(BlockKeyer):
    """A keyer that counts the pages it hashes."""

    hashed = 0

    def block_key(self, parent, tokens, media=b""):
        self.hashed += 1
        return super().block_key(parent, tokens, media)


@pytest.mark.parametrize("root", [None, bytes(range(32))])
def test_a_prompts_page_keys_are_hashed_once_over_its_save_steps(root):
    """Keys grown step by step from the ask's are the keys of the whole prompt (salted
    or not), and each page is hashed once: a step hashes only the pages past the
    keys it is given."""
    keyer = _CountingKeyer(bytes(32), 4, root=root)
    tokens = list(range(100, 140))  # ten pages
    asked = keyer.keys(tokens[:24])  # the ask: six pages
    assert keyer.hashed == 6
    keys = page_keys(keyer, tokens[:8], asked)  # a first chunk: already hashed
    assert keys is asked and keyer.hashed == 6
    for end in (28, 28, 36, 40):  # the save steps
        keys = page_keys(keyer, tokens[:end], keys)
        assert (
            keys.blocks[: end // 4] == BlockKeyer(bytes(32), 4, root=root).keys(tokens[:end]).blocks
        )
    assert keyer.hashed == 10
    assert page_keys(keyer, tokens[:8]).blocks == asked.blocks[:2]  # none known: all hashed
