"""The decision core: one input record in, one ``Decision`` out. Pure.

``decide`` is a function of the record, the contract set and the clock, so a
batch replayed after a crash decides the same way, and replay against other
contracts is exact. Gates run in the product's order; the first refusal
decides, but each gate reports all of its own violations at once.
"""

from __future__ import annotations

import hashlib
import logging
import time
from collections.abc import Iterable

import orjson

from processor.contracts.registry import Contract, ContractSet
from processor.gates.parse import DeadLetter, Limits, parse_proposal
from processor.gates.resolve import resolve_tool
from processor.gates.schema import check_arguments
from processor.model import (
    ApprovedCall,
    Decision,
    FieldError,
    Gate,
    Outcome,
    Proposal,
    Rejection,
    SourceRecord,
    TaxonomyClass,
)

logger = logging.getLogger(__name__)


def canonical_json(value: object) -> bytes:
    """Sorted keys, no whitespace: the bytes the payload hash is taken over."""
    return orjson.dumps(value, option=orjson.OPT_SORT_KEYS)


def idempotency_key(p: Proposal, contract: Contract, payload_hash: str) -> str:
    """The proposal's own key, or one derived from what makes the operation the same.

    Derived keys bind workflow, run, tenant, principal, tool, version, logical
    operation and payload, so a retry of the same call in the same run maps to
    the same key and a changed payload never does.
    """
    if p.idempotency_key is not None:
        return p.idempotency_key
    material = canonical_json(
        [
            p.workflow_id,
            p.run_id,
            p.tenant_id,
            None,
            contract.name,
            contract.version,
            p.logical_operation_id,
            payload_hash,
        ]
    )
    return "ik:" + hashlib.sha256(material).hexdigest()


def _route(p: Proposal, contract: Contract, now_ms: int) -> ApprovedCall:
    args = canonical_json(p.arguments)
    payload_hash = "sha256:" + hashlib.sha256(args).hexdigest()
    return ApprovedCall(
        call_id=p.proposal_id,
        tool_name=contract.name,
        tool_version=contract.version,
        side_effect_class=contract.side_effect_class,
        canonical_arguments=args.decode(),
        payload_hash=payload_hash,
        idempotency_key=idempotency_key(p, contract, payload_hash),
        deadline_ms=now_ms + contract.timeout_ms,
    )


def _lifecycle_warnings(c: Contract) -> tuple[str, ...]:
    if c.lifecycle.status != "deprecated":
        return ()
    when = f" on {c.lifecycle.sunset_date}" if c.lifecycle.sunset_date else ""
    repl = f"; move to {c.lifecycle.replacement}" if c.lifecycle.replacement else ""
    return (f"{c.name}@{c.version} is deprecated and will be sunsetted{when}{repl}",)


def decide(
    src: SourceRecord, contracts: ContractSet, limits: Limits, now_ms: int | None = None
) -> Decision:
    """Run the gates over one record. Never raises: a bug becomes UNKNOWN_ERROR, fail closed."""
    started = time.perf_counter()
    if now_ms is None:
        now_ms = int(time.time() * 1000)
    try:
        decision = _decide(src, contracts, limits, now_ms)
    except Exception as exc:  # the consumer must never stop on one record
        logger.exception("decision failed for %s/%s@%s", src.topic, src.partition, src.offset)
        decision = _internal_error(src, contracts, limits, now_ms, exc)
    decision.latency_ms = (time.perf_counter() - started) * 1000
    return decision


def _decide(src: SourceRecord, contracts: ContractSet, limits: Limits, now_ms: int) -> Decision:
    parsed = parse_proposal(src, limits)
    if isinstance(parsed, DeadLetter):
        return Decision(
            src,
            Outcome.DEAD_LETTER,
            Gate.PARSE,
            None,
            dlq_reason=parsed.reason,
            dlq_detail=parsed.detail,
            decided_at_ms=now_ms,
        )
    p, rejection, warnings = parsed
    if rejection is not None:
        return _rejected(src, p, rejection, warnings, now_ms)

    resolved = resolve_tool(p, contracts)
    if isinstance(resolved, Rejection):
        return _rejected(src, p, resolved, warnings, now_ms)
    contract = resolved
    warnings += _lifecycle_warnings(contract)

    refusal = check_arguments(p.arguments, contract)
    if refusal is not None:
        return _rejected(src, p, refusal, warnings, now_ms, contract)

    return Decision(
        src,
        Outcome.ROUTED,
        Gate.ROUTE,
        p,
        contract_name=contract.name,
        contract_version=contract.version,
        side_effect_class=contract.side_effect_class,
        call=_route(p, contract, now_ms),
        warnings=warnings,
        decided_at_ms=now_ms,
        post_action_verification=contract.post_action_verification_required,
    )


def _rejected(
    src: SourceRecord,
    p: Proposal,
    rejection: Rejection,
    warnings: tuple[str, ...],
    now_ms: int,
    contract: Contract | None = None,
) -> Decision:
    return Decision(
        src,
        Outcome.REJECTED,
        rejection.gate,
        p,
        contract_name=contract.name if contract else None,
        contract_version=contract.version if contract else None,
        side_effect_class=contract.side_effect_class if contract else None,
        rejection=rejection,
        warnings=warnings,
        decided_at_ms=now_ms,
    )


def _internal_error(
    src: SourceRecord, contracts: ContractSet, limits: Limits, now_ms: int, exc: Exception
) -> Decision:
    rejection = Rejection(
        TaxonomyClass.UNKNOWN_ERROR,
        Gate.INTERNAL,
        (FieldError(None, f"internal error: {type(exc).__name__}", "internal_error"),),
        "Nothing was executed; do not retry this call automatically, hand off to a human.",
    )
    try:
        parsed = parse_proposal(src, limits)
    except Exception:
        parsed = DeadLetter("internal_error", f"{type(exc).__name__}: {exc}"[:500])
    if isinstance(parsed, DeadLetter):
        return Decision(
            src,
            Outcome.DEAD_LETTER,
            Gate.INTERNAL,
            None,
            dlq_reason="internal_error",
            dlq_detail=f"{type(exc).__name__}"[:500],
            decided_at_ms=now_ms,
        )
    return _rejected(src, parsed[0], rejection, (), now_ms)


def decide_batch(
    records: Iterable[SourceRecord], contracts: ContractSet, limits: Limits, now_ms: int
) -> list[Decision]:
    return [decide(r, contracts, limits, now_ms) for r in records]
