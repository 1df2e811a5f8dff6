"""Decisions to wire records: the observation, the approved call, the DLQ entry.

One function per record kind, used by the processor and by replay alike, so
an observation is built in exactly one place.
"""

from __future__ import annotations

import hashlib
from typing import Any

from processor.codec.avro import codec
from processor.model import RESPONSE_VECTORS, Decision, Outcome, TaxonomyClass

_ROUTED_ACTION = (
    "The call was accepted and sent for execution; wait for its result before "
    "proposing a dependent step."
)


def observation_id(d: Decision) -> str:
    s = d.source
    return hashlib.sha256(f"{s.topic}/{s.partition}/{s.offset}".encode()).hexdigest()[:32]


def observation_record(d: Decision, contract_set: str | None) -> dict[str, Any]:
    """The Avro datum of the observation for a decision (never for a DLQ entry)."""
    p = d.proposal
    assert p is not None, "dead letters have no observation"
    taxonomy = d.taxonomy
    vector = RESPONSE_VECTORS[taxonomy]
    rejection = d.rejection
    routed = d.outcome is Outcome.ROUTED
    call = d.call
    return {
        "observation_id": observation_id(d),
        "proposal_id": p.proposal_id,
        "run_id": p.run_id,
        "tenant_id": p.tenant_id,
        "decision": "ROUTED" if routed else "REJECTED",
        "gate": d.gate.value,
        "tool_identity": {
            "name": p.tool_name or "",
            "version": d.contract_version,
            "call_id": p.proposal_id,
            "side_effect_class": d.side_effect_class.value if d.side_effect_class else None,
        },
        "execution_metadata": {
            "timestamp": d.decided_at_ms,
            "latency_ms": d.latency_ms,
            "idempotency_hit": False,
            "idempotency_key": call.idempotency_key if call else None,
            "trace_id": p.trace_id,
            "attempt_number": 1,
            "source_partition": d.source.partition,
            "source_offset": d.source.offset,
        },
        "status": {
            "code": 202 if routed else vector.code,
            "is_error": taxonomy is not TaxonomyClass.SUCCESS,
            "taxonomy_class": taxonomy.value,
            "retryable": vector.retryable,
            "repairable": vector.repairable,
            "requires_approval": vector.requires_approval,
            "fail_closed": vector.fail_closed,
            "escalate": vector.escalate,
        },
        "result_payload": {
            "data": None,
            "errors": [
                {
                    "field": e.field,
                    "message": e.message,
                    "code": e.code,
                    "expected": e.expected,
                    "actual": e.actual,
                    "hint": e.hint,
                }
                for e in (rejection.errors if rejection else ())
            ],
            "warnings": list(d.warnings),
        },
        "verification": {
            "post_action_verification_required": d.post_action_verification,
            "target_state_reference": None,
            "expected_state": None,
            "delay_seconds": 0,
        },
        "next_action": rejection.next_action if rejection else _ROUTED_ACTION,
        "allowed_tools": list(rejection.allowed_tools) if rejection else [],
        "contract_set": contract_set,
    }


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


def encode_observation(d: Decision, contract_set: str | None) -> bytes:
    return codec("observation").encode(observation_record(d, contract_set))


def encode_approved_call(d: Decision, contract_set: str | None) -> bytes:
    return codec("approved_call").encode(approved_call_record(d, contract_set))


def dlq_headers(d: Decision) -> list[tuple[str, str | bytes | None]]:
    s = d.source
    return [
        ("toolsentry.error.class", b"SYNTACTIC_PARSE_FAIL"),
        ("toolsentry.error.reason", (d.dlq_reason or "unknown").encode()),
        ("toolsentry.error.detail", (d.dlq_detail or "").encode("utf-8", "replace")[:1000]),
        ("toolsentry.source.topic", s.topic.encode()),
        ("toolsentry.source.partition", str(s.partition).encode()),
        ("toolsentry.source.offset", str(s.offset).encode()),
    ]
