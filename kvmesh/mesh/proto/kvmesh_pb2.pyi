from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class LookupRequest(_message.Message):
    __slots__ = ("namespace", "block_keys", "tail_keys", "quiet")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    BLOCK_KEYS_FIELD_NUMBER: _ClassVar[int]
    TAIL_KEYS_FIELD_NUMBER: _ClassVar[int]
    QUIET_FIELD_NUMBER: _ClassVar[int]
    namespace: bytes
    block_keys: _containers.RepeatedScalarFieldContainer[bytes]
    tail_keys: _containers.RepeatedScalarFieldContainer[bytes]
    quiet: bool
    def __init__(self, namespace: _Optional[bytes] = ..., block_keys: _Optional[_Iterable[bytes]] = ..., tail_keys: _Optional[_Iterable[bytes]] = ..., quiet: _Optional[bool] = ...) -> None: ...

class BlockInfo(_message.Message):
    __slots__ = ("key", "nbytes", "digest", "tokens", "states")
    KEY_FIELD_NUMBER: _ClassVar[int]
    NBYTES_FIELD_NUMBER: _ClassVar[int]
    DIGEST_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    STATES_FIELD_NUMBER: _ClassVar[int]
    key: bytes
    nbytes: int
    digest: bytes
    tokens: int
    states: bool
    def __init__(self, key: _Optional[bytes] = ..., nbytes: _Optional[int] = ..., digest: _Optional[bytes] = ..., tokens: _Optional[int] = ..., states: _Optional[bool] = ...) -> None: ...

class LookupResponse(_message.Message):
    __slots__ = ("epoch", "blocks", "tail", "matched_tokens", "replicas")
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    TAIL_FIELD_NUMBER: _ClassVar[int]
    MATCHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    REPLICAS_FIELD_NUMBER: _ClassVar[int]
    epoch: str
    blocks: _containers.RepeatedCompositeFieldContainer[BlockInfo]
    tail: BlockInfo
    matched_tokens: int
    replicas: int
    def __init__(self, epoch: _Optional[str] = ..., blocks: _Optional[_Iterable[_Union[BlockInfo, _Mapping]]] = ..., tail: _Optional[_Union[BlockInfo, _Mapping]] = ..., matched_tokens: _Optional[int] = ..., replicas: _Optional[int] = ...) -> None: ...

class FetchRequest(_message.Message):
    __slots__ = ("namespace", "keys", "epoch", "chunk_bytes", "lease_ttl_s", "keep_from", "codecs")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    CHUNK_BYTES_FIELD_NUMBER: _ClassVar[int]
    LEASE_TTL_S_FIELD_NUMBER: _ClassVar[int]
    KEEP_FROM_FIELD_NUMBER: _ClassVar[int]
    CODECS_FIELD_NUMBER: _ClassVar[int]
    namespace: bytes
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    epoch: str
    chunk_bytes: int
    lease_ttl_s: float
    keep_from: _containers.RepeatedScalarFieldContainer[int]
    codecs: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, namespace: _Optional[bytes] = ..., keys: _Optional[_Iterable[bytes]] = ..., epoch: _Optional[str] = ..., chunk_bytes: _Optional[int] = ..., lease_ttl_s: _Optional[float] = ..., keep_from: _Optional[_Iterable[int]] = ..., codecs: _Optional[_Iterable[str]] = ...) -> None: ...

class FetchChunk(_message.Message):
    __slots__ = ("block", "data", "lease_id")
    BLOCK_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    block: int
    data: bytes
    lease_id: str
    def __init__(self, block: _Optional[int] = ..., data: _Optional[bytes] = ..., lease_id: _Optional[str] = ...) -> None: ...

class PublishChunk(_message.Message):
    __slots__ = ("card_json", "block", "nbytes", "digest", "data")
    CARD_JSON_FIELD_NUMBER: _ClassVar[int]
    BLOCK_FIELD_NUMBER: _ClassVar[int]
    NBYTES_FIELD_NUMBER: _ClassVar[int]
    DIGEST_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    card_json: str
    block: int
    nbytes: int
    digest: bytes
    data: bytes
    def __init__(self, card_json: _Optional[str] = ..., block: _Optional[int] = ..., nbytes: _Optional[int] = ..., digest: _Optional[bytes] = ..., data: _Optional[bytes] = ...) -> None: ...

class PublishResponse(_message.Message):
    __slots__ = ("stored", "duplicates", "rejected", "reason")
    STORED_FIELD_NUMBER: _ClassVar[int]
    DUPLICATES_FIELD_NUMBER: _ClassVar[int]
    REJECTED_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    stored: int
    duplicates: int
    rejected: int
    reason: str
    def __init__(self, stored: _Optional[int] = ..., duplicates: _Optional[int] = ..., rejected: _Optional[int] = ..., reason: _Optional[str] = ...) -> None: ...

class BulkPublish(_message.Message):
    __slots__ = ("card_json", "blocks")
    CARD_JSON_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    card_json: str
    blocks: _containers.RepeatedCompositeFieldContainer[BlockInfo]
    def __init__(self, card_json: _Optional[str] = ..., blocks: _Optional[_Iterable[_Union[BlockInfo, _Mapping]]] = ...) -> None: ...

class Endpoint(_message.Message):
    __slots__ = ("address", "interface", "priority")
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    INTERFACE_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    address: str
    interface: str
    priority: int
    def __init__(self, address: _Optional[str] = ..., interface: _Optional[str] = ..., priority: _Optional[int] = ...) -> None: ...

class CapabilityCard(_message.Message):
    __slots__ = ("node_id", "alias", "epoch", "roles", "endpoints", "namespaces", "card_summaries", "budget_bytes", "used_bytes", "entries", "load", "version", "heartbeat", "region", "hits", "misses", "mac", "data_port", "fetches_served", "bytes_served", "host", "codecs", "links")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    ALIAS_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    ROLES_FIELD_NUMBER: _ClassVar[int]
    ENDPOINTS_FIELD_NUMBER: _ClassVar[int]
    NAMESPACES_FIELD_NUMBER: _ClassVar[int]
    CARD_SUMMARIES_FIELD_NUMBER: _ClassVar[int]
    BUDGET_BYTES_FIELD_NUMBER: _ClassVar[int]
    USED_BYTES_FIELD_NUMBER: _ClassVar[int]
    ENTRIES_FIELD_NUMBER: _ClassVar[int]
    LOAD_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_FIELD_NUMBER: _ClassVar[int]
    REGION_FIELD_NUMBER: _ClassVar[int]
    HITS_FIELD_NUMBER: _ClassVar[int]
    MISSES_FIELD_NUMBER: _ClassVar[int]
    MAC_FIELD_NUMBER: _ClassVar[int]
    DATA_PORT_FIELD_NUMBER: _ClassVar[int]
    FETCHES_SERVED_FIELD_NUMBER: _ClassVar[int]
    BYTES_SERVED_FIELD_NUMBER: _ClassVar[int]
    HOST_FIELD_NUMBER: _ClassVar[int]
    CODECS_FIELD_NUMBER: _ClassVar[int]
    LINKS_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    alias: str
    epoch: str
    roles: _containers.RepeatedScalarFieldContainer[str]
    endpoints: _containers.RepeatedCompositeFieldContainer[Endpoint]
    namespaces: _containers.RepeatedScalarFieldContainer[str]
    card_summaries: _containers.RepeatedScalarFieldContainer[str]
    budget_bytes: int
    used_bytes: int
    entries: int
    load: float
    version: int
    heartbeat: float
    region: str
    hits: int
    misses: int
    mac: bytes
    data_port: int
    fetches_served: int
    bytes_served: int
    host: bytes
    codecs: _containers.RepeatedScalarFieldContainer[str]
    links: _containers.RepeatedCompositeFieldContainer[LinkRate]
    def __init__(self, node_id: _Optional[str] = ..., alias: _Optional[str] = ..., epoch: _Optional[str] = ..., roles: _Optional[_Iterable[str]] = ..., endpoints: _Optional[_Iterable[_Union[Endpoint, _Mapping]]] = ..., namespaces: _Optional[_Iterable[str]] = ..., card_summaries: _Optional[_Iterable[str]] = ..., budget_bytes: _Optional[int] = ..., used_bytes: _Optional[int] = ..., entries: _Optional[int] = ..., load: _Optional[float] = ..., version: _Optional[int] = ..., heartbeat: _Optional[float] = ..., region: _Optional[str] = ..., hits: _Optional[int] = ..., misses: _Optional[int] = ..., mac: _Optional[bytes] = ..., data_port: _Optional[int] = ..., fetches_served: _Optional[int] = ..., bytes_served: _Optional[int] = ..., host: _Optional[bytes] = ..., codecs: _Optional[_Iterable[str]] = ..., links: _Optional[_Iterable[_Union[LinkRate, _Mapping]]] = ...) -> None: ...

class LinkRate(_message.Message):
    __slots__ = ("node_id", "bytes_per_s", "rtt_s", "fetches")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    BYTES_PER_S_FIELD_NUMBER: _ClassVar[int]
    RTT_S_FIELD_NUMBER: _ClassVar[int]
    FETCHES_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    bytes_per_s: float
    rtt_s: float
    fetches: int
    def __init__(self, node_id: _Optional[str] = ..., bytes_per_s: _Optional[float] = ..., rtt_s: _Optional[float] = ..., fetches: _Optional[int] = ...) -> None: ...

class ExchangeRequest(_message.Message):
    __slots__ = ("cards",)
    CARDS_FIELD_NUMBER: _ClassVar[int]
    cards: _containers.RepeatedCompositeFieldContainer[CapabilityCard]
    def __init__(self, cards: _Optional[_Iterable[_Union[CapabilityCard, _Mapping]]] = ...) -> None: ...

class ExchangeResponse(_message.Message):
    __slots__ = ("cards",)
    CARDS_FIELD_NUMBER: _ClassVar[int]
    cards: _containers.RepeatedCompositeFieldContainer[CapabilityCard]
    def __init__(self, cards: _Optional[_Iterable[_Union[CapabilityCard, _Mapping]]] = ...) -> None: ...
