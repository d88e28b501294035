"""Reasons, sources and counter names are typed (``StrEnum``), and read exactly as
the plain strings they replaced: in counters, JSON and metric labels."""

import json

import pytest

from kvmesh import errors
from kvmesh.errors import Reason
from kvmesh.mesh import bulk_wire as bulk
from kvmesh.runtime.telemetry import Count, Family, PrefillReport, Source, Telemetry, labelled

from .test_errors import _all_typed


def test_every_typed_error_has_a_reason_member():
    assert bulk.FetchStalled.reason is Reason.STALLED
    for cls in _all_typed():
        assert isinstance(cls.reason, Reason), cls
    assert errors.StaleEpoch.reason == "stale_epoch" and f"{errors.PeerBusy.reason}" == "busy"
    assert json.dumps([errors.OversizePayload.reason]) == '["oversize_payload"]'


def test_telemetry_counts_under_the_plain_names():
    t = Telemetry()
    report = PrefillReport(
        source="compute",
        prompt_tokens=10,
        reused_tokens=0,
        computed_tokens=10,
        fallback=errors.ChecksumMismatch.reason,
    )
    t.record(report, completion_tokens=3)
    t.record(
        PrefillReport(
            source=Source.REMOTE,
            prompt_tokens=10,
            reused_tokens=8,
            computed_tokens=2,
            bytes_fetched=100,
        ),
        completion_tokens=1,
    )
    t.count(labelled(Family.PEER_FAILED, Reason.TIMEOUT))
    snap = json.loads(json.dumps(t.snapshot()))  # as /v1/network and the dashboard see it
    c = snap["counters"]
    assert c["requests"] == 2 and c["prompt_tokens"] == 20 and c["completion_tokens"] == 4
    assert c["prefill_source:compute"] == 1 and c["prefill_source:remote"] == 1
    assert c["fallback:checksum_mismatch"] == 1 and c["peer_failed:timeout"] == 1
    assert c[Count.BYTES_FETCHED] == 100 and snap["timers"].keys() >= {"import_s", "saved_s"}
    assert t.fallbacks == {"checksum_mismatch": 1}
    assert t.family(Family.PEER_FAILED) == {"timeout": 1}
    row = json.loads(json.dumps(t.recent[0]))
    assert row["source"] == "compute" and row["fallback"] == "checksum_mismatch"


def test_a_report_with_an_unknown_source_is_refused():
    with pytest.raises(ValueError, match="'cloud' is not a valid Source"):
        PrefillReport(source="cloud", prompt_tokens=1, reused_tokens=0, computed_tokens=1)
    assert PrefillReport("remote", 1, 1, 0).source is Source.REMOTE
