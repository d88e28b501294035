"""What the vLLM connector keys a request by besides its token ids (``Scope``):
its salt and its LoRA adapter's weights digest root its chain; an adapter whose
files cannot be read, media and prompt embeddings are not keyed at all. Runs in
the main environment: requests are stand-ins with vLLM's ``Request`` attribute
names (the real path runs in tests/vllm/test_lora.py)."""

from __future__ import annotations

import hashlib
from types import SimpleNamespace

from kvmesh.blocks import BlockKeyer, Media, adapter_digest
from kvmesh.mesh.events import RecordingKeyer, TokenMemo
from kvmesh.vllm.pages import page_keys
from kvmesh.vllm.spec import PLAIN, Scope, scope_of

from . import zoo

NS = hashlib.sha256(b"ns").digest()
TOKENS = list(range(40))


def request(**kw: object) -> SimpleNamespace:
    base = {"cache_salt": None, "lora_request": None, "mm_features": None, "prompt_embeds": None}
    return SimpleNamespace(**{**base, **kw})


def feature(modality: str, identifier: str, offset: int, length: int) -> SimpleNamespace:
    """vLLM's ``MultiModalFeatureSpec``'s fields kvmesh reads."""
    pos = SimpleNamespace(offset=offset, length=length)
    return SimpleNamespace(modality=modality, identifier=identifier, mm_position=pos)


def lora(path: object) -> SimpleNamespace:
    return SimpleNamespace(lora_name="x", lora_int_id=1, lora_path=str(path))


def test_a_requests_scope_roots_its_chain_by_salt_and_adapter(tmp_path, tiny_dir):
    a, b = zoo.lora_adapter(tiny_dir, 1), zoo.lora_adapter(tiny_dir, 2)
    assert scope_of(request()) == PLAIN
    assert scope_of(request(cache_salt="s")) == Scope("s")
    assert scope_of(request(lora_request=lora(a))) == Scope(None, adapter_digest(a))
    assert scope_of(request(cache_salt="s", lora_request=lora(b))) == Scope("s", adapter_digest(b))
    keyer = BlockKeyer(NS, 16)
    scopes = [PLAIN, Scope("s"), scope_of(request(lora_request=lora(a))), Scope("s", b"\1" * 32)]
    firsts = {s.keys(keyer, TOKENS).blocks[0] for s in scopes}  # type: ignore[union-attr]
    assert len(firsts) == 4 and PLAIN.keys(keyer, TOKENS) == keyer.keys(TOKENS)


def test_requests_kvmesh_cannot_key_are_not_scoped(tmp_path):
    (tmp_path / "adapter_config.json").write_text("{}")  # no weights
    for r in (
        request(cache_salt=""),
        request(cache_salt="x" * 2000),
        request(mm_features=[object()]),  # not what vLLM makes
        request(mm_features=[feature("image", "h", 3, 0)]),
        request(prompt_embeds=object()),
        request(lora_request=lora(tmp_path)),
        request(lora_request=lora(tmp_path / "missing")),
        request(lora_request=lora("org/hub-adapter-id")),
    ):
        assert scope_of(r) is None


def test_an_adapters_blocks_record_no_tokens_for_kv_events():
    memo = TokenMemo()
    keyer = RecordingKeyer(BlockKeyer(NS, 16), memo)
    Scope("s").keys(keyer, TOKENS)
    assert len(memo) == 2  # a salted chain's tokens, as a plain one's
    Scope(None, b"\1" * 32).keys(keyer, TOKENS)
    assert len(memo) == 2  # none of the adapter's
    Scope(media=(Media(0, 4, b"\2" * 32),)).keys(keyer, TOKENS)
    assert len(memo) == 2  # nor of a prompt with an image


def test_an_unreadable_adapter_is_logged_once(tmp_path, caplog):
    r = request(lora_request=lora(tmp_path / "gone"))
    with caplog.at_level("WARNING", logger="kvmesh.vllm"):
        assert scope_of(r) is None and scope_of(r) is None
    assert [m for m in caplog.messages if "gone" in m and "not cached" in m] == caplog.messages[:1]
    assert len(caplog.messages) == 1


def test_media_are_keyed_by_vllms_hash_at_their_place():
    keyer = BlockKeyer(NS, 16)
    tokens = [1] * 8 + [9] * 20 + list(range(12))  # an image's placeholders at [8, 28)

    def first_keys(*features: SimpleNamespace) -> tuple[bytes, ...]:
        scope = scope_of(request(mm_features=list(features)))
        assert scope is not None and len(scope.media) == len(features)
        return scope.keys(keyer, tokens).blocks

    a = first_keys(feature("image", "hash-a", 8, 20))
    assert a == first_keys(feature("image", "hash-a", 8, 20))
    b = first_keys(feature("image", "hash-b", 8, 20))
    assert a[0] != b[0] and a[1] != b[1]  # both pages overlap the image
    assert first_keys(feature("audio", "hash-a", 8, 20))[0] != a[0]
    later = first_keys(feature("image", "hash-a", 16, 12))  # wholly after page 0
    assert later[0] == keyer.keys(tokens).blocks[0] != a[0]
    # the workers' incremental keys (a save step at a time) agree with the whole chain
    scope = scope_of(request(mm_features=[feature("image", "hash-a", 8, 20)]))
    assert scope is not None
    first = page_keys(scope.keyer(keyer), tokens[:16], None, scope.media)
    assert page_keys(scope.keyer(keyer), tokens, first, scope.media) == scope.keys(keyer, tokens)


def test_an_adapters_new_weights_get_a_new_digest(tmp_path, tiny_dir):
    """Weights rewritten in place, its config untouched: the scope follows the files."""
    src = zoo.lora_adapter(tiny_dir, 1)
    a = tmp_path / "a"
    a.mkdir()
    for f in src.iterdir():
        (a / f.name).write_bytes(f.read_bytes())
    before = scope_of(request(lora_request=lora(a)))
    weights = a / "adapter_model.safetensors"
    weights.write_bytes(zoo.lora_adapter(tiny_dir, 2).joinpath(weights.name).read_bytes())
    after = scope_of(request(lora_request=lora(a)))
    assert before is not None and after is not None and before.adapter != after.adapter
    assert after.adapter == adapter_digest(a)
