"""Avro single-object encoding: fingerprints, framing, round trips, a second library's view."""

from __future__ import annotations

import dataclasses
import datetime as dt
import hashlib
import io
import json
import struct
from typing import Any

import fastavro
import fastavro.schema
import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from processor.codec.avro import MAGIC, codec, crc64_avro, decode_any
from processor.codec.records import (
    DLQ_HEADERS,
    approved_call_record,
    dlq_headers,
    encode_approved_call,
    encode_observation,
    observation_id,
    observation_record,
    unencodable,
)
from processor.contracts.registry import ContractSet
from processor.identity import DEVELOPMENT_WARNING
from processor.model import Decision, Gate, Outcome, SideEffectClass, SourceRecord
from processor.pipeline import Gates, decide
from tests.unit.helpers import (
    LIMITS,
    NOW_MS,
    OFFSET,
    PARTITION,
    SCHEMAS_DIR,
    TOPIC,
    approvals_for,
    decide_arguments,
    decide_envelope,
    envelope,
    record,
)

TIMESTAMP_FIELDS = {"deadline", "created_at"}
CANONICAL_REFUND = (
    '{"amount":19.99,"currency":"USD","order_id":"WO-12345-A","reason_code":"damaged"}'
)
TRACEPARENT = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"


def _millis(value: int) -> dt.datetime:
    return dt.datetime.fromtimestamp(value / 1000, tz=dt.UTC)


def as_decoded(datum: dict[str, Any], timestamps: set[str]) -> dict[str, Any]:
    """What a reader gets back: timestamp-millis fields come back as aware datetimes."""
    return {k: _millis(v) if k in timestamps else v for k, v in datum.items()}


def observation_as_decoded(datum: dict[str, Any]) -> dict[str, Any]:
    out = dict(datum)
    meta = dict(out["execution_metadata"])
    meta["timestamp"] = _millis(meta["timestamp"])
    out["execution_metadata"] = meta
    return out


def independent(name: str) -> Any:
    """The .avsc parsed by fastavro alone, without the processor's codec."""
    return fastavro.parse_schema(json.loads((SCHEMAS_DIR / f"{name}.avsc").read_text()))


def field_names(name: str) -> set[str]:
    return {f["name"] for f in orjson.loads((SCHEMAS_DIR / f"{name}.avsc").read_bytes())["fields"]}


def read_independently(name: str, data: bytes) -> Any:
    return fastavro.schemaless_reader(io.BytesIO(data[10:]), independent(name), None)


@pytest.fixture(scope="module")
def routed(contracts: ContractSet) -> Decision:
    env = envelope(
        "refund_order",
        arguments={
            "order_id": "WO-12345-A",
            "amount": 19.99,
            "currency": "USD",
            "reason_code": "damaged",
        },
        traceparent=TRACEPARENT,
        idempotency_key="ik-explicit",
    )
    env["approvals"] = approvals_for(env, contracts, "ops-1", "ops-2")
    d = decide_envelope(env, contracts)
    assert d.outcome is Outcome.ROUTED, d.rejection
    return d


@pytest.fixture(scope="module")
def rejected(contracts: ContractSet) -> Decision:
    d = decide_arguments(
        contracts, "cancel_order", {"order_id": "ORD-12345", "notify": "é ✓"}, unknown_field=1
    )
    assert d.outcome is Outcome.REJECTED
    return d


# --- fingerprints and framing -----------------------------------------------------------------


@pytest.mark.parametrize("name", ["observation", "approved_call"])
def test_fingerprint_matches_fastavro(name: str) -> None:
    c = codec(name)
    canonical = fastavro.schema.to_parsing_canonical_form(independent(name))
    assert canonical == c.canonical
    theirs = fastavro.schema.fingerprint(canonical, "CRC-64-AVRO")
    # fastavro prints the fingerprint's bytes in little-endian order.
    assert bytes.fromhex(theirs) == struct.pack("<Q", crc64_avro(canonical.encode()))
    assert c.fingerprint == crc64_avro(canonical.encode())


@pytest.mark.parametrize("text", ['"int"', '"string"', '{"type":"fixed","name":"f","size":4}', ""])
def test_crc64_avro_matches_fastavro_on_any_text(text: str) -> None:
    theirs = bytes.fromhex(fastavro.schema.fingerprint(text, "CRC-64-AVRO"))
    assert struct.pack("<Q", crc64_avro(text.encode())) == theirs


def test_crc64_avro_of_nothing_is_the_empty_fingerprint() -> None:
    assert crc64_avro(b"") == 0xC15D213AA4D7A795


@pytest.mark.parametrize("name", ["observation", "approved_call"])
def test_single_object_header(name: str, routed: Decision) -> None:
    c = codec(name)
    assert MAGIC == b"\xc3\x01"
    assert c.header == b"\xc3\x01" + struct.pack("<Q", c.fingerprint)
    assert len(c.header) == 10
    data = (
        encode_observation(routed, "set")
        if name == "observation"
        else encode_approved_call(routed, "set")
    )
    assert data[:10] == c.header


def test_the_two_schemas_have_different_fingerprints() -> None:
    assert codec("observation").fingerprint != codec("approved_call").fingerprint


# --- round trips ------------------------------------------------------------------------------


def test_approved_call_record_fields(routed: Decision) -> None:
    datum = approved_call_record(routed, "sha256:abc")
    assert datum == {
        "call_id": "prop-1",
        "proposal_id": "prop-1",
        "run_id": "run-1",
        "tenant_id": "tenant-1",
        "trace_id": "4bf92f3577b34da6a3ce929d0e0e4736",
        "traceparent": TRACEPARENT,
        "tool_name": "refund_order",
        "tool_version": "1.0.0",
        "side_effect_class": "CRITICAL_MUTATION",
        "arguments": CANONICAL_REFUND,
        "payload_hash": "sha256:" + hashlib.sha256(CANONICAL_REFUND.encode()).hexdigest(),
        "idempotency_key": "ik-explicit",
        "deadline": NOW_MS + 8000,
        "created_at": NOW_MS,
        "attempt": 1,
        "approval_ids": list(routed.call.approval_ids),  # type: ignore[union-attr]
        "contract_set": "sha256:abc",
    }


def test_approved_call_round_trip(routed: Decision) -> None:
    datum = approved_call_record(routed, "sha256:abc")
    data = encode_approved_call(routed, "sha256:abc")
    expected = as_decoded(datum, TIMESTAMP_FIELDS)
    assert codec("approved_call").decode(data) == expected
    assert decode_any(data) == expected
    assert read_independently("approved_call", data) == expected


def test_routed_observation_round_trip(routed: Decision) -> None:
    datum = observation_record(routed, "sha256:abc")
    assert datum["decision"] == "ROUTED"
    assert datum["gate"] == "route"
    assert datum["status"]["code"] == 202
    assert datum["status"]["is_error"] is False
    assert datum["status"]["taxonomy_class"] == "SUCCESS"
    assert datum["tool_identity"] == {
        "name": "refund_order",
        "version": "1.0.0",
        "call_id": "prop-1",
        "side_effect_class": "CRITICAL_MUTATION",
    }
    assert datum["execution_metadata"]["idempotency_key"] == "ik-explicit"
    assert datum["execution_metadata"]["source_partition"] == PARTITION
    assert datum["execution_metadata"]["source_offset"] == OFFSET
    assert datum["execution_metadata"]["latency_ms"] == routed.latency_ms
    assert datum["verification"]["post_action_verification_required"] is True
    assert datum["result_payload"]["errors"] == []
    data = encode_observation(routed, "sha256:abc")
    expected = observation_as_decoded(datum)
    assert codec("observation").decode(data) == expected
    assert decode_any(data) == expected
    assert read_independently("observation", data) == expected


def test_a_tool_name_that_is_a_credential_is_not_quoted_in_the_observation(
    contracts: ContractSet,
) -> None:
    secret = "sk_live_4eC39HqLyjWDarjtT1zdp7dc"
    d = decide_envelope(envelope(secret), contracts)
    datum = observation_record(d, None)
    assert datum["tool_identity"]["name"] == "sk_l…"
    assert secret not in orjson.dumps(datum).decode()
    known = observation_record(decide_envelope(envelope("cancel_ordr"), contracts), None)
    assert known["tool_identity"]["name"] == "cancel_ordr"


def test_rejected_observation_round_trip(rejected: Decision) -> None:
    datum = observation_record(rejected, None)
    assert datum["decision"] == "REJECTED"
    assert datum["gate"] == "schema"
    assert datum["status"]["code"] == 422
    assert datum["status"]["is_error"] is True
    assert datum["status"]["repairable"] is True
    assert datum["status"]["taxonomy_class"] == "STRUCTURAL_VIOLATION"
    assert datum["execution_metadata"]["idempotency_key"] is None
    assert datum["result_payload"]["warnings"] == [
        DEVELOPMENT_WARNING,  # the unit tests decide without tokens, and every answer says so
        "ignored unknown envelope fields: unknown_field",
    ]
    assert {e["code"] for e in datum["result_payload"]["errors"]} == {
        "unknown_field",
        "missing_field",
        "pattern_mismatch",
    }
    assert datum["contract_set"] is None
    data = encode_observation(rejected, None)
    expected = observation_as_decoded(datum)
    assert decode_any(data) == expected
    assert read_independently("observation", data) == expected


def test_parse_rejection_observation_round_trip(contracts: ContractSet) -> None:
    env = envelope()
    del env["tenant_id"], env["proposal_id"], env["tool"]
    d = decide_envelope(env, contracts)
    assert d.outcome is Outcome.REJECTED
    datum = observation_record(d, "fp")
    assert datum["tenant_id"] is None
    assert datum["proposal_id"] == f"unidentified:{TOPIC}:{PARTITION}:{OFFSET}"
    assert datum["tool_identity"] == {
        "name": "",
        "version": None,
        "call_id": datum["proposal_id"],
        "side_effect_class": None,
    }
    assert datum["status"]["taxonomy_class"] == "SYNTACTIC_PARSE_FAIL"
    assert datum["status"]["code"] == 400
    data = encode_observation(d, "fp")
    assert decode_any(data) == observation_as_decoded(datum)


def test_observation_id_is_deterministic_per_source_record(contracts: ContractSet) -> None:
    a = decide_envelope(envelope(), contracts, offset=7)
    b = decide_envelope(envelope(proposal_id="other"), contracts, offset=7)
    c = decide_envelope(envelope(), contracts, offset=8)
    assert observation_id(a) == observation_id(b)
    assert observation_id(a) != observation_id(c)
    assert len(observation_id(a)) == 32


def test_dlq_headers(contracts: ContractSet) -> None:
    d = decide(record(b'{"run_id":"r","run_id":"s"}'), Gates.development(contracts, LIMITS), NOW_MS)
    assert d.outcome is Outcome.DEAD_LETTER
    assert dict(dlq_headers(d)) == {
        "toolsentry.error.class": b"SYNTACTIC_PARSE_FAIL",
        "toolsentry.error.gate": b"parse",
        "toolsentry.error.reason": b"duplicate_key",
        "toolsentry.error.detail": b"envelope is not strict JSON: duplicate key 'run_id'",
        "toolsentry.source.topic": TOPIC.encode(),
        "toolsentry.source.partition": str(PARTITION).encode(),
        "toolsentry.source.offset": str(OFFSET).encode(),
    }


def test_a_record_the_platform_failed_on_is_an_unknown_error_in_the_dlq(
    contracts: ContractSet, routed: Decision
) -> None:
    """The taxonomy classes internal faults UNKNOWN_ERROR: a dead letter of a defect while
    deciding, or of outputs that could not be written, says nothing wrong of the record."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr("processor.pipeline.parse_proposal", _raise)
        internal = decide(
            record(orjson.dumps(envelope())), Gates.development(contracts, LIMITS), NOW_MS
        )
    assert internal.dlq_reason == "internal_error"
    assert dict(dlq_headers(internal))["toolsentry.error.class"] == b"UNKNOWN_ERROR"
    unwritten = dict(dlq_headers(unencodable(dataclasses.replace(routed), ValueError("big"))))
    assert unwritten["toolsentry.error.class"] == b"UNKNOWN_ERROR"
    assert unwritten["toolsentry.error.gate"] == b"route"


def _raise(*args: object) -> None:
    raise RuntimeError("a defect")


def test_dead_letter_headers_cut_long_text_on_a_character_boundary() -> None:
    """A reason's detail and the named headers are cut at a byte limit: never inside a
    character, so every header is UTF-8 still, as Kafka tools and other clients read it."""
    d = Decision(SourceRecord(TOPIC, PARTITION, OFFSET, None, b"x", 0), Outcome.DEAD_LETTER,
                 Gate.RESULT, None, dlq_reason="result_mismatch", dlq_detail="a" + "\u00e9" * 600,
                 extra={DLQ_HEADERS: [("toolsentry.result.call_id", "\u20ac" * 200)]})  # fmt: skip
    headers = dict(dlq_headers(d))
    detail, call_id = headers["toolsentry.error.detail"], headers["toolsentry.result.call_id"]
    assert isinstance(detail, bytes) and isinstance(call_id, bytes)
    assert detail.decode() == "a" + "\u00e9" * 499
    assert call_id.decode() == "\u20ac" * 85


# --- decode_any -------------------------------------------------------------------------------


def test_decode_any_picks_the_schema_by_fingerprint(routed: Decision) -> None:
    call = decode_any(encode_approved_call(routed, None))
    obs = decode_any(encode_observation(routed, None))
    assert set(call) == field_names("approved_call")
    assert set(obs) == field_names("observation")
    assert call["payload_hash"].startswith("sha256:")
    assert obs["observation_id"] == observation_id(routed)


def test_decode_any_restricted_to_other_names_refuses(routed: Decision) -> None:
    with pytest.raises(ValueError, match="unknown schema fingerprint"):
        decode_any(encode_approved_call(routed, None), names=("observation",))


@pytest.mark.parametrize(
    "data",
    [
        b"",
        b"garbage",
        b"\xc3\x01" + b"\x00" * 8 + b"\x02",
        b"\xc3\x02" + struct.pack("<Q", 0) + b"\x00",
        b'{"call_id": "x"}',
    ],
)
def test_garbage_raises_value_error(data: bytes) -> None:
    with pytest.raises(ValueError):
        decode_any(data)


def test_wrong_codec_refuses(routed: Decision) -> None:
    with pytest.raises(
        ValueError, match=r"not a single-object dev\.toolsentry\.v1\.Observation record"
    ):
        codec("observation").decode(encode_approved_call(routed, None))


def test_header_with_the_wrong_fingerprint_byte_order_is_refused(routed: Decision) -> None:
    data = encode_approved_call(routed, None)
    swapped = data[:2] + data[2:10][::-1] + data[10:]
    with pytest.raises(ValueError):
        decode_any(swapped)


@pytest.mark.parametrize("cut", [10, 11, 20])
def test_truncated_body_raises_value_error(cut: int, routed: Decision) -> None:
    data = encode_approved_call(routed, None)
    with pytest.raises(ValueError):
        decode_any(data[:cut])


def test_trailing_bytes_are_refused(routed: Decision) -> None:
    with pytest.raises(ValueError):
        decode_any(encode_approved_call(routed, None) + b"trailing")


def test_observations_stay_small_whatever_the_proposal_carries() -> None:
    from processor.contracts.registry import load_contracts
    from processor.gates.parse import Limits
    from processor.model import SourceRecord
    from processor.pipeline import Gates, decide
    from tests.integration.harness import ROOT

    huge_key = "k" * 200_000
    env = {
        "proposal_id": "p",
        "run_id": "r",
        "tenant_id": "t",
        "tool": {"name": "search_kb"},
        "arguments": {"query": "returns", huge_key: 1},
        huge_key + "x": 1,
    }
    record = SourceRecord("tool.proposals", 0, 1, b"r", orjson.dumps(env), 0)
    d = decide(
        record,
        Gates.development(load_contracts(ROOT / "contracts"), Limits(max_arguments_bytes=1 << 20)),
    )
    assert d.rejection is not None and d.rejection.errors[0].code == "unknown_field"
    assert len(encode_observation(d, None)) < 16_000


def test_dead_letters_keep_a_bounded_copy_with_size_and_digest() -> None:
    from processor.codec.records import DLQ_MAX_VALUE_BYTES, dlq_headers, dlq_value
    from processor.gates.parse import Limits
    from processor.model import SourceRecord
    from processor.pipeline import Gates, decide

    _NO_CONTRACTS = Gates.development(ContractSet({}, "sha256:none"), Limits())

    value = b"\xff" * 999_900
    d = decide(SourceRecord("tool.proposals", 2, 9, None, value, 0), _NO_CONTRACTS)
    assert dlq_value(value) == value[:DLQ_MAX_VALUE_BYTES]
    headers = dict(dlq_headers(d))
    assert headers["toolsentry.value.truncated_from"] == b"999900"
    assert headers["toolsentry.value.sha256"] == hashlib.sha256(value).hexdigest().encode()
    assert dlq_value(b"small") == b"small"
    assert "toolsentry.value.truncated_from" not in dict(
        dlq_headers(decide(SourceRecord("t", 0, 0, None, b"small", 0), _NO_CONTRACTS))
    )


@pytest.mark.parametrize("size", [0, 63, 64, 127, 128, 8191, 8192, 70_000])
def test_lengths_and_numbers_at_the_varint_boundaries_match_fastavro(size: int) -> None:
    """The generated encoder writes one- and two-byte varints inline and calls the general
    one beyond: every boundary must decode, with fastavro, to what was written."""
    c = codec("tool_result")
    datum = {
        "result_id": "r" * size, "call_id": "c", "proposal_id": "p", "run_id": "x" * size,
        "tenant_id": "t", "trace_id": "tr", "tool_name": "lookup_order", "tool_version": "1.0.0",
        "side_effect_class": "READ_ONLY", "idempotency_key": "k", "payload_hash": "h",
        "attempt": size, "outcome": "SUCCEEDED", "retryable": False, "error_code": None,
        "error_message": None, "taxonomy_class": None, "committed_steps": ["s"] * (size % 70),
        "data": "d" * size, "compensation_arguments": None, "started_at": size,
        "finished_at": -size - 1, "executor_id": "e", "contract_set": None,
    }  # fmt: skip
    decoded = fastavro.schemaless_reader(io.BytesIO(c.encode(datum)[10:]), c.parsed, None)
    assert decoded["result_id"] == datum["result_id"] and decoded["data"] == datum["data"]
    assert decoded["attempt"] == size and len(decoded["committed_steps"]) == size % 70
    assert decoded["finished_at"].timestamp() * 1000 == pytest.approx(-size - 1)


@pytest.mark.parametrize(
    "n",
    [0, -1, 63, -64, 64, 8191, 8192, -8193, 16383, 16384, 1_048_575, 1_048_576, -1_048_577,
     2_097_151, 2_097_152, 1_795_337_955_740, -1_795_337_955_740, 2**63 - 1, -(2**63)],
)  # fmt: skip
def test_every_varint_width_matches_fastavro(n: int) -> None:
    """The unrolled two- and three-byte cases, and the cached timestamps, write what
    fastavro's own long encoder writes."""
    from fastavro.io.binary_encoder import BinaryEncoder

    from processor.codec.avro import _timestamp_varint, _zigzag_varint

    buf = io.BytesIO()
    BinaryEncoder(buf).write_long(n)
    assert _zigzag_varint(n) == buf.getvalue() == _timestamp_varint(n)


# --- the routed observation's direct writer ---------------------------------------------------

_text = st.text(max_size=90)  # across the one/two-byte length boundary (64 bytes)


@settings(max_examples=300, deadline=None)
@given(
    tenant=st.none() | _text,
    tool=_text,
    version=st.none() | _text,
    side_effect=st.none() | st.sampled_from(list(SideEffectClass)),
    key=_text,
    trace=_text,
    attempt=st.integers(1, 2**31 - 1),
    partition=st.integers(0, 2**31 - 1),
    offset=st.integers(0, 2**63 - 1),
    decided=st.integers(0, 2**45),
    latency=st.floats(allow_nan=False),
    warnings=st.lists(st.text(max_size=700), max_size=25),
    verify=st.booleans(),
    contract_set=st.none() | _text,
    retry_after=st.none() | st.integers(0, 2**40),
)
def test_a_routed_observation_is_written_as_the_generic_encoder_writes_it(
    routed: Decision,
    tenant: str | None,
    tool: str,
    version: str | None,
    side_effect: SideEffectClass | None,
    key: str,
    trace: str,
    attempt: int,
    partition: int,
    offset: int,
    decided: int,
    latency: float,
    warnings: list[str],
    verify: bool,
    contract_set: str | None,
    retry_after: int | None,
) -> None:
    """Routed observations skip building a datum; every field must come out as the
    schema-driven encoder writes it from ``observation_record``."""
    assert routed.proposal is not None and routed.call is not None
    d = dataclasses.replace(
        routed,
        proposal=dataclasses.replace(routed.proposal, tenant_id=tenant, tool_name=tool,
                                     trace_id=trace),
        call=dataclasses.replace(routed.call, idempotency_key=key, attempt=attempt),
        source=dataclasses.replace(routed.source, partition=partition, offset=offset),
        contract_version=version,
        side_effect_class=side_effect,
        decided_at_ms=decided,
        latency_ms=latency,
        warnings=tuple(warnings),
        post_action_verification=verify,
        retry_after_ms=retry_after,
    )  # fmt: skip
    generic = codec("observation").encode(observation_record(d, contract_set))
    assert encode_observation(d, contract_set) == generic


@given(st.text(max_size=300), st.text(max_size=300))
@settings(max_examples=200, deadline=None)
def test_leading_strings_read_what_a_full_decode_reads(
    routed: Decision, proposal_id: str, run_id: str
) -> None:
    datum = observation_record(routed, "sha256:abc")
    datum["proposal_id"], datum["run_id"] = proposal_id, run_id
    data = codec("observation").encode(datum)
    decoded = codec("observation").decode(data)
    assert codec("observation").leading_strings(data, 3) == [
        decoded["observation_id"],
        proposal_id,
        run_id,
    ]


def test_leading_strings_refuse_what_is_not_such_a_record(routed: Decision) -> None:
    obs = codec("observation")
    data = encode_observation(routed, "sha256:abc")
    head = len(obs.header)
    for bad in (
        b"",
        encode_approved_call(routed, "sha256:abc"),  # another schema's header
        data[: head + 3],  # cut inside the first string
        obs.header + b"\xff" * 11,  # a length that never ends
        obs.header + b"\x01",  # a negative length
        obs.header + b"\x04\xff\xfe",  # not UTF-8
    ):
        with pytest.raises(ValueError):
            obs.leading_strings(bad, 2)
    with pytest.raises(TypeError):  # the fourth field is a union, not a string
        obs.leading_strings(data, 4)
