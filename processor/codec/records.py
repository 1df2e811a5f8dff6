"""Decisions to wire records: the observation, the approved call, the DLQ entry.

One function per record kind, used by the processor and by replay alike, so
an observation is built in exactly one place.
"""

from __future__ import annotations

import datetime as dt
import hashlib
from collections.abc import Iterable, Mapping
from functools import cache, lru_cache
from typing import Any, NamedTuple

from processor import faults
from processor.codec.avro import _DOUBLE, _timestamp_varint, codec
from processor.codec.avro import _zigzag_varint as _varint
from processor.gates.policy_scan import quotable
from processor.model import (
    RESPONSE_VECTORS,
    Decision,
    Gate,
    Outcome,
    SideEffectClass,
    TaxonomyClass,
)

_ROUTED_ACTION = (
    "The call was accepted and sent for execution; wait for its result before "
    "proposing a dependent step."
)


_TEXT = 512
_ACTION = 2048
_WARNINGS = 20


def _clip(text: str | None, limit: int = _TEXT) -> str | None:
    """Bound free text taken from a proposal, so an observation always fits a record."""
    if text is None or len(text) <= limit:
        return text
    return text[: limit - 1] + "\u2026"


def observation_id(d: Decision) -> str:
    s = d.source
    return position_id(s.topic, s.partition, s.offset)


def position_id(topic: str, partition: int, offset: int) -> str:
    """The id of the observation that answers the record at this position: the same on
    every replay of it, so a consumer can drop a copy."""
    return hashlib.sha256(f"{topic}/{partition}/{offset}".encode()).hexdigest()[:32]


def observation_record(d: Decision, contract_set: str | None) -> dict[str, Any]:
    """The Avro datum of the observation for a decision (never for a DLQ entry)."""
    p = d.proposal
    assert p is not None, "dead letters have no observation"
    taxonomy = d.taxonomy
    vector = RESPONSE_VECTORS[taxonomy]
    rejection = d.rejection
    routed = d.outcome is Outcome.ROUTED
    parked = d.outcome is Outcome.PARKED
    final = d.final
    call = d.call
    if final is not None:
        kind = "COMPLETED" if final.completed else "FAILED"
    else:
        kind = "ROUTED" if routed else "PENDING_APPROVAL" if parked else "REJECTED"
    return {
        "observation_id": observation_id(d),
        "proposal_id": p.proposal_id,
        "run_id": p.run_id,
        "tenant_id": p.tenant_id,
        "decision": kind,
        "gate": d.gate.value,
        "tool_identity": {
            "name": tool_name(d),
            "version": d.contract_version,
            "call_id": p.proposal_id,
            "side_effect_class": d.side_effect_class.value if d.side_effect_class else None,
        },
        "execution_metadata": {
            "timestamp": d.decided_at_ms,
            "latency_ms": d.latency_ms,
            "idempotency_hit": bool(final and final.idempotency_hit),
            "idempotency_key": call.idempotency_key if call else p.idempotency_key,
            "trace_id": p.trace_id,
            "attempt_number": final.attempt if final else call.attempt if call else 1,
            "source_partition": d.source.partition,
            "source_offset": d.source.offset,
        },
        "status": {
            "code": 202 if routed else 200 if final and final.completed else vector.code,
            "is_error": taxonomy is not TaxonomyClass.SUCCESS,
            "taxonomy_class": taxonomy.value,
            "retryable": vector.retryable,
            "repairable": vector.repairable,
            "requires_approval": vector.requires_approval,
            "fail_closed": vector.fail_closed,
            "escalate": vector.escalate,
        },
        "result_payload": {
            "data": final.data if final else None,
            "errors": [
                {
                    "field": _clip(e.field),
                    "message": _clip(e.message),
                    "code": e.code,
                    "expected": _clip(e.expected),
                    "actual": _clip(e.actual),
                    "hint": _clip(e.hint),
                }
                for e in (rejection.errors if rejection else ())
            ],
            "warnings": [_clip(w) for w in d.warnings[:_WARNINGS]],
        },
        "verification": {
            "post_action_verification_required": d.post_action_verification,
            "target_state_reference": None,
            "expected_state": None,
            "delay_seconds": 0,
        },
        "next_action": _clip(rejection.next_action, _ACTION) if rejection else _success_action(d),
        "allowed_tools": list(rejection.allowed_tools) if rejection else [],
        "contract_set": contract_set,
        "approval_request_id": d.approval_request["request_id"] if parked else None,
        "retry_after_ms": d.retry_after_ms,
    }


def tool_name(d: Decision) -> str:
    """The tool a decision's observation names. A name no contract has is the model's own
    text: quoted back only when it does not look like a credential."""
    p = d.proposal
    assert p is not None, "dead letters have no observation"
    return (p.tool_name or "") if d.contract_name else quotable(p.tool_name or "")


def _success_action(d: Decision) -> str:
    if d.final is None:
        return _ROUTED_ACTION
    again = " (an earlier call with this idempotency key)" if d.final.idempotency_hit else ""
    action = f"The call completed{again}; use its result, and do not repeat it."
    if d.post_action_verification:
        action += " Confirm the new state with the lookup tool before telling the user."
    return action


def approved_call_record(d: Decision, contract_set: str | None) -> dict[str, Any]:
    p, call = d.proposal, d.call
    assert p is not None and call is not None and p.tenant_id is not None
    return {
        "call_id": call.call_id,
        "proposal_id": p.proposal_id,
        "run_id": p.run_id,
        "tenant_id": p.tenant_id,
        "trace_id": p.trace_id,
        "traceparent": p.traceparent,
        "tool_name": call.tool_name,
        "tool_version": call.tool_version,
        "side_effect_class": call.side_effect_class.value,
        "arguments": call.canonical_arguments,
        "payload_hash": call.payload_hash,
        "idempotency_key": call.idempotency_key,
        "deadline": call.deadline_ms,
        "created_at": d.decided_at_ms,
        "attempt": call.attempt,
        "approval_ids": list(call.approval_ids),
        "contract_set": contract_set,
    }


def approval_request_record(d: Decision, contract_set: str | None) -> dict[str, Any]:
    assert d.approval_request is not None
    return {**d.approval_request, "contract_set": contract_set}


def encode_approval_request(d: Decision, contract_set: str | None) -> bytes:
    return codec("approval_request").encode(approval_request_record(d, contract_set))


def encode_observation(d: Decision, contract_set: str | None) -> bytes:
    if d.outcome is Outcome.ROUTED and d.rejection is None and d.final is None and d.call:
        return _encode_routed(d, contract_set)
    return codec("observation").encode(observation_record(d, contract_set))


class _RoutedSegments:
    """The parts of a routed call's observation that do not depend on the call, encoded
    once by the schema's own encoders: a routed observation is most of what the
    processor writes, and building its datum cost as much as deciding the call."""

    def __init__(self) -> None:
        c = codec("observation")
        self.header = c.header
        self.routed = c.field_encoder("decision")("ROUTED")
        self.gate = {g: c.field_encoder("gate")(g.value) for g in Gate}
        side_effect = c.field_encoder("tool_identity", "side_effect_class")
        self.side_effect = {s: side_effect(s and s.value) for s in (None, *SideEffectClass)}
        success = RESPONSE_VECTORS[TaxonomyClass.SUCCESS]
        self.status = c.field_encoder("status")(
            {
                "code": 202,
                "is_error": False,
                "taxonomy_class": TaxonomyClass.SUCCESS.value,
                "retryable": success.retryable,
                "repairable": success.repairable,
                "requires_approval": success.requires_approval,
                "fail_closed": success.fail_closed,
                "escalate": success.escalate,
            }
        )
        no_payload: dict[str, Any] = {"data": None, "errors": [], "warnings": []}
        self.empty_payload = c.field_encoder("result_payload")(no_payload)
        self.payload = c.field_encoder("result_payload")
        verification = c.field_encoder("verification")
        self.verification = {
            flag: verification(
                {
                    "post_action_verification_required": flag,
                    "target_state_reference": None,
                    "expected_state": None,
                    "delay_seconds": 0,
                }
            )
            for flag in (False, True)
        }
        self.action = c.field_encoder("next_action")(_ROUTED_ACTION)
        self.no_tools = c.field_encoder("allowed_tools")([])
        self.contract_set = c.field_encoder("contract_set")
        self.no_request = c.field_encoder("approval_request_id")(None)
        self.retry_after = c.field_encoder("retry_after_ms")

    @lru_cache(maxsize=64)  # noqa: B019 - one instance, for the life of the process
    def tail(self, verify: bool, contract_set: str | None) -> bytes:
        """verification .. approval_request_id: fixed for a contract set."""
        return b"".join(
            (
                self.verification[verify],
                self.action,
                self.no_tools,
                self.contract_set(contract_set),
                self.no_request,
            )
        )


_routed_segments = cache(_RoutedSegments)


def _string(b: bytearray, text: str) -> None:
    data = text.encode()
    n = len(data)
    if n < 64:
        b.append(n << 1)
    else:
        b += _varint(n)
    b += data


def _encode_routed(d: Decision, contract_set: str | None) -> bytes:
    """``encode_observation`` for a routed call, without building its datum: the same
    bytes (a differential test holds them equal), the fields written in schema order."""
    seg = _routed_segments()
    p, call, src = d.proposal, d.call, d.source
    assert p is not None and call is not None
    b = bytearray(seg.header)
    _string(b, observation_id(d))
    _string(b, p.proposal_id)
    _string(b, p.run_id)
    if p.tenant_id is None:
        b.append(0)
    else:
        b.append(2)
        _string(b, p.tenant_id)
    b += seg.routed
    b += seg.gate[d.gate]
    # tool_identity
    _string(b, p.tool_name or "")
    if d.contract_version is None:
        b.append(0)
    else:
        b.append(2)
        _string(b, d.contract_version)
    _string(b, p.proposal_id)
    b += seg.side_effect[d.side_effect_class]
    # execution_metadata
    b += _timestamp_varint(d.decided_at_ms)
    b += _DOUBLE(d.latency_ms)
    b.append(0)  # not an idempotency hit: a hit is answered as settled, not routed
    b.append(2)
    _string(b, call.idempotency_key)
    _string(b, p.trace_id)
    b += _varint(call.attempt)
    b += _varint(src.partition)
    b += _varint(src.offset)
    b += seg.status
    if d.warnings:
        b += seg.payload(
            {"data": None, "errors": [], "warnings": [_clip(w) for w in d.warnings[:_WARNINGS]]}
        )
    else:
        b += seg.empty_payload
    b += seg.tail(d.post_action_verification, contract_set)
    b += seg.retry_after(d.retry_after_ms)
    return bytes(b)


def encode_approved_call(d: Decision, contract_set: str | None) -> bytes:
    return codec("approved_call").encode(approved_call_record(d, contract_set))


class Outputs(NamedTuple):
    """What a decision writes besides a dead letter, encoded: the key every output is
    written under, its observation, and the approved call, the approval request and the
    compensating proposal where it has one. A tuple: one is made for every record the
    processor answers."""

    key: bytes | None
    observation: bytes
    call: bytes | None = None
    request: bytes | None = None
    compensation: bytes | None = None


ENCODING_FAILED = "encoding_failed"
"""The reason of the dead letter of a decision whose outputs cannot be written."""


def encode_outputs(d: Decision, contract_set: str | None, max_bytes: int) -> Outputs:
    """Every output of a decision that is not a dead letter, as the processor writes them
    and replay words them: one function, so a decision replayed fails to encode exactly
    where the processor's did. Raises whatever the encoders raise, and ValueError for an
    output whose key and value together exceed ``max_bytes``, which the broker would
    refuse. Every output is keyed by the run the proposal names (the record's own key when
    it names none), and the broker counts a key against its limit as it does the value: a
    result's answer goes to the run the result names."""
    if faults.POISON_ENCODING:
        faults.poison_encoding(d.source.value)
    key = d.proposal.run_id.encode() if d.proposal else d.source.key
    call = request = None
    if d.outcome is Outcome.ROUTED and d.side_effect_class is not None:
        call = encode_approved_call(d, contract_set)
    if d.outcome is Outcome.PARKED:
        request = encode_approval_request(d, contract_set)
    observation = encode_observation(d, contract_set)
    compensation: bytes | None = d.extra.get("compensation")
    largest = len(key or b"") + max(len(observation), len(call or b""), len(request or b""),
                                    len(compensation or b""))  # fmt: skip
    if largest > max_bytes:
        raise ValueError(f"an output of {largest} bytes with its key, over message.max.bytes")
    return Outputs(key, observation, call, request, compensation)


def unencodable(d: Decision, exc: Exception) -> Decision:
    """``d`` turned into the dead letter of a record whose outputs cannot be written: it
    must neither stop its partition nor be routed. It keeps the gate that decided it, which
    its dead letter names."""
    d.dlq_reason, d.dlq_detail = ENCODING_FAILED, f"{type(exc).__name__}: {exc}"[:500]
    d.outcome = Outcome.DEAD_LETTER
    return d


DLQ_MAX_VALUE_BYTES = 512 * 1024
"""A dead letter keeps at most this much of the original value, so that value plus
headers always fits under the broker's default message size limit (1 MB); a
larger original is cut and its size and digest recorded."""


DLQ_MAX_KEY_BYTES = 1024
"""A dead letter keeps at most this much of the original key (a run id is at most 256
characters): the broker counts the key against its message size limit too, and a huge key
would otherwise make the dead letter itself too large to write."""


ID_MAX_CHARS = 1024
"""The longest id (run, call, tenant, key, tool, version, hash) an approved call or a
result may name: four times the longest the processor writes (1-256 characters; a
compensation's key a few more). A record naming a longer one was not written for a call
the processor routed. An executor's answer naming all of a call's ids, keyed by its run,
then always fits under the broker's message size limit: one that did not could not be
delivered at all, its transaction would never commit, and its batch would come back for
ever."""


def oversized_id(datum: dict[str, Any], names: tuple[str, ...]) -> str | None:
    """The first of the string fields ``names`` of ``datum`` longer than ``ID_MAX_CHARS``."""
    for name in names:
        value = datum.get(name)
        if isinstance(value, str) and len(value) > ID_MAX_CHARS:
            return name
    return None


def dlq_value(value: bytes | None, limit: int = DLQ_MAX_VALUE_BYTES) -> bytes | None:
    if value is None or len(value) <= limit:
        return value
    return value[:limit]


def dlq_record(
    key: bytes | None, d: Decision, room: int
) -> tuple[bytes | None, bytes | None, list[tuple[str, str | bytes | None]]]:
    """The dead letter of an input record: its key and value, each cut where it would not
    fit (``room``: the bytes a record may take, less the headers' share), the size and
    digest of what was cut, and the reason, in headers."""
    extra: list[tuple[str, str | bytes | None]] = []
    if key is not None and len(key) > DLQ_MAX_KEY_BYTES:
        extra = [
            ("toolsentry.key.truncated_from", str(len(key)).encode()),
            ("toolsentry.key.sha256", hashlib.sha256(key).hexdigest().encode()),
        ]
        key = key[:DLQ_MAX_KEY_BYTES]
    limit = max(0, min(DLQ_MAX_VALUE_BYTES, room - len(key or b"")))
    return key, dlq_value(d.source.value, limit), [*extra, *dlq_headers(d, limit)]


PLATFORM_FAULTS = frozenset({"internal_error", ENCODING_FAILED})
"""Dead letters that say nothing of the record, only that the platform failed on it."""


def _dlq_class(d: Decision) -> bytes:
    """A record the platform failed on (a defect while deciding it, outputs it could not
    write) is an ``UNKNOWN_ERROR``, as the taxonomy classes internal faults; an unusable
    approval decision is a confirmation problem; anything else, a parse one."""
    if d.dlq_reason in PLATFORM_FAULTS:
        return TaxonomyClass.UNKNOWN_ERROR.value.encode()
    if d.gate is Gate.APPROVAL:
        return TaxonomyClass.CONFIRMATION_MISSING.value.encode()
    return TaxonomyClass.SYNTACTIC_PARSE_FAIL.value.encode()


DLQ_HEADERS = "dlq_headers"
"""``Decision.extra`` key: more headers for a dead letter, (name, value) pairs, each value
cut at ``DLQ_HEADER_MAX_BYTES`` (a result's names its call and attempt, so an operator can
find it without decoding it)."""
DLQ_HEADER_MAX_BYTES = 256


def headers_by_name(
    given: Mapping[str, str | bytes | None] | Iterable[tuple[str, str | bytes | None]],
) -> tuple[dict[str, str | bytes], set[str]]:
    """A record's headers by name (those without a value left out), and the names given
    twice with different values, which are left out too: a dead letter that names two
    positions, or two verdicts, names none for sure."""
    pairs = given.items() if isinstance(given, Mapping) else given
    headers: dict[str, str | bytes] = {}
    twice: set[str] = set()
    for k, v in pairs:
        if v is not None and headers.setdefault(k, v) != v:
            twice.add(k)
    for k in twice:
        del headers[k]
    return headers, twice


def _cut(text: str, limit: int) -> bytes:
    """``text`` as UTF-8 (a lone surrogate replaced), cut at ``limit`` bytes on a character
    boundary: a header cut inside a character is not UTF-8, and other clients read it so."""
    data = text.encode("utf-8", "replace")
    if len(data) <= limit:
        return data
    return data[:limit].decode("utf-8", "ignore").encode()


def dlq_headers(
    d: Decision, limit: int = DLQ_MAX_VALUE_BYTES
) -> list[tuple[str, str | bytes | None]]:
    """Why and where: the taxonomy class, the gate that decided the record (``parse``,
    ``internal``, ``approval``, ``result``; for an output that could not be encoded, the
    gate whose decision it was), the reason and its detail, and the record's position."""
    s = d.source
    extra: list[tuple[str, str | bytes | None]] = []
    if s.value is not None and len(s.value) > limit:
        extra = [
            ("toolsentry.value.truncated_from", str(len(s.value)).encode()),
            ("toolsentry.value.sha256", hashlib.sha256(s.value).hexdigest().encode()),
        ]
    named = [
        (name, _cut(value, DLQ_HEADER_MAX_BYTES)) for name, value in d.extra.get(DLQ_HEADERS, ())
    ]
    return [
        *extra,
        ("toolsentry.error.class", _dlq_class(d)),
        ("toolsentry.error.gate", d.gate.value.encode()),
        ("toolsentry.error.reason", (d.dlq_reason or "unknown").encode()),
        ("toolsentry.error.detail", _cut(d.dlq_detail or "", 1000)),
        ("toolsentry.source.topic", s.topic.encode()),
        ("toolsentry.source.partition", str(s.partition).encode()),
        ("toolsentry.source.offset", str(s.offset).encode()),
        *named,
    ]


_EPOCH = dt.datetime(1970, 1, 1, tzinfo=dt.UTC)
_MILLISECOND = dt.timedelta(milliseconds=1)


def millis(value: Any) -> int:
    """A timestamp-millis field in epoch milliseconds: fastavro reads them as aware
    datetimes, the encoders take ints. Converted exactly, without float rounding, so a
    decoded record can be encoded again unchanged and compared with the clock as an int."""
    if isinstance(value, dt.datetime):
        return (value - _EPOCH) // _MILLISECOND
    return int(value)


def _as_millis(datum: dict[str, Any], fields: tuple[str, ...]) -> dict[str, Any]:
    for name in fields:
        datum[name] = millis(datum[name])
    return datum


def printable(text: str, limit: int | None = None) -> str:
    """Text read from a record as a terminal may show it: anyone may have written it, so a
    character that is not printable (an escape sequence, a line break, a lone surrogate
    no terminal encoding takes) is shown as its code; cut at ``limit``."""
    shown = "".join(c if c.isprintable() else f"\\u{ord(c):04x}" for c in text)
    if limit is None or len(shown) <= limit:
        return shown
    return shown[: limit - 1] + "\u2026"


def decode_approved_call(value: bytes) -> dict[str, Any]:
    """An approved call as executors read it, ``deadline`` and ``created_at`` in epoch ms.
    Raises ``ValueError`` for anything that is not a single-object ApprovedCall."""
    return _as_millis(codec("approved_call").decode(value), ("deadline", "created_at"))


def encode_result(datum: dict[str, Any]) -> bytes:
    """A ``ToolResult`` (``schemas/tool_result.avsc``); timestamps in epoch ms. Checked by
    fastavro's validating writer: results are built by executor code, not by us."""
    return codec("tool_result").encode_checked(datum)


def decode_result(value: bytes) -> dict[str, Any]:
    """A ``ToolResult``, ``started_at`` and ``finished_at`` in epoch ms."""
    return _as_millis(codec("tool_result").decode(value), ("started_at", "finished_at"))
