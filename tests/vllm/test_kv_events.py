"""kvmesh's KV events read by vLLM's own decoder (needs the vLLM venv).

The bytes kvmesh sends equal the bytes vLLM's classes encode for the same
events, and the real head and peer scenarios of ``tests/test_events_nodes.py``
pass when every payload is decoded by ``vllm.distributed.kv_events``."""

from __future__ import annotations

import msgspec
import pytest

kv = pytest.importorskip(
    "vllm.distributed.kv_events",
    reason="needs vLLM: tests/vllm/setup_venv.sh, then .venv-vllm/bin/python -m pytest tests/vllm",
)

from kvmesh.mesh import events as ours  # noqa: E402

from ..test_events_nodes import (  # noqa: E402, F401  (the fixture is used by name)
    nodes,
    run_stored_removed_restart,
    run_stuck_subscriber,
)

VLLM = msgspec.msgpack.Decoder(type=kv.KVEventBatch)


def vllm_decode(payload: bytes) -> object:
    return VLLM.decode(payload)


PICTURE = (("ab" * 32, -3),)  # a block's picture: (identifier, offset from the block's start)


def test_the_bytes_are_vllms_own():
    mine = ours.KVEventBatch(
        2.5,
        [
            ours.AllBlocksCleared(),
            ours.BlockStored([7, 8], None, list(range(64)), 32, None, "CPU", None),
            ours.BlockStored([9], 8, [], 32, None, "STORAGE", None),
            ours.BlockStored([10, 11], 9, [5] * 64, 32, None, "CPU", None, [None, PICTURE]),
            ours.BlockRemoved([7], "CPU"),
        ],
        0,
    )
    theirs = kv.KVEventBatch(
        ts=2.5,
        events=[
            kv.AllBlocksCleared(),
            kv.BlockStored(
                block_hashes=[7, 8],
                parent_block_hash=None,
                token_ids=list(range(64)),
                block_size=32,
                lora_id=None,
                medium=kv.MEDIUM_CPU,
                lora_name=None,
            ),
            kv.BlockStored(
                block_hashes=[9],
                parent_block_hash=8,
                token_ids=[],
                block_size=32,
                lora_id=None,
                medium=kv.MEDIUM_STORAGE,
                lora_name=None,
            ),
            kv.BlockStored(
                block_hashes=[10, 11],
                parent_block_hash=9,
                token_ids=[5] * 64,
                block_size=32,
                lora_id=None,
                medium=kv.MEDIUM_CPU,
                lora_name=None,
                extra_keys=[None, PICTURE],
            ),
            kv.BlockRemoved(block_hashes=[7], medium=kv.MEDIUM_CPU),
        ],
        data_parallel_rank=0,
    )
    enc = msgspec.msgpack.Encoder()
    assert enc.encode(mine) == enc.encode(theirs)
    # (decoded, a picture's pair is a list: the same bytes again)
    assert enc.encode(VLLM.decode(enc.encode(mine))) == enc.encode(theirs)
    assert enc.encode(ours.decode_batch(enc.encode(theirs))) == enc.encode(mine)
    assert ours.MEDIUM == {"ram": kv.MEDIUM_CPU, "disk": kv.MEDIUM_STORAGE}


def test_stored_removed_and_restart_through_vllms_decoder(nodes):  # noqa: F811
    run_stored_removed_restart(nodes, vllm_decode)


def test_a_stuck_subscriber_through_vllms_decoder(nodes):  # noqa: F811
    run_stuck_subscriber(nodes, vllm_decode)
