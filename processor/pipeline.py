"""The decision core: one input record in, one ``Decision`` out. Pure.

A decision is a function of the record, the gates' configuration (contracts,
keys, policy, approvers), the reference data and the clock, so a batch
replayed after a crash decides the same way, and replay against other
contracts is exact. Gates run in the product's order; the first refusal
decides, but each gate reports all of its own violations at once.

The reference data lives in Redis, so a batch is decided in two passes:
``prepare`` runs the gates that need nothing but the record (parse, resolve,
schema, identity) and says which entities the rest need; the caller fetches
all of them in one round trip; ``finish`` runs semantic, policy, state and
confirmation gates on the answers.

Two checks run earlier than the seed's order, on purpose: credentials in the
arguments are refused before the schema gate, whose answers quote arguments
back (a secret must never travel on in an observation); and identity runs
before the semantic gate, so a caller whose token does not verify learns
nothing about which ids exist.
"""

from __future__ import annotations

import hashlib
import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import orjson

from processor.approvals import Approver
from processor.config import IdentitySettings
from processor.contracts.registry import Contract, ContractSet
from processor.gates.confirmation import Approved, Park, check_confirmation
from processor.gates.identity import check_scopes, identify
from processor.gates.parse import DeadLetter, Limits, parse_proposal
from processor.gates.policy import check_policy, check_secrets
from processor.gates.resolve import resolve_tool
from processor.gates.schema import check_arguments
from processor.gates.semantic import (
    RefAnswers,
    RefKey,
    before_state,
    check_semantics,
    check_state,
    reference_keys,
    resolve_references,
    uncarriable,
)
from processor.identity import DEVELOPMENT_WARNING, Verifier
from processor.model import (
    ApprovedCall,
    Decision,
    FieldError,
    Gate,
    Outcome,
    Principal,
    Proposal,
    Rejection,
    SourceRecord,
    TaxonomyClass,
)
from processor.policy import Policy

logger = logging.getLogger(__name__)


def canonical_json(value: object) -> bytes:
    """Sorted keys, no whitespace: the bytes the payload hash is taken over."""
    return orjson.dumps(value, option=orjson.OPT_SORT_KEYS)


@dataclass(frozen=True)
class Gates:
    """Everything the gates consult besides the record and the reference data."""

    contracts: ContractSet
    limits: Limits
    verifier: Verifier
    policy: Policy = field(default_factory=Policy)
    approvers: dict[str, Approver] = field(default_factory=dict)

    @classmethod
    def development(
        cls, contracts: ContractSet, limits: Limits | None = None, **kw: object
    ) -> Gates:
        """Gates that trust the envelope's tenant: tests of the other gates, laptops."""
        verifier = Verifier(IdentitySettings(mode="development"), {})
        return cls(contracts, limits or Limits(), verifier, **kw)  # type: ignore[arg-type]

    def with_contracts(self, contracts: ContractSet) -> Gates:
        return Gates(contracts, self.limits, self.verifier, self.policy, self.approvers)


def idempotency_key(
    p: Proposal, contract: Contract, payload_hash: str, principal_id: str | None = None
) -> str:
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
            principal_id,
            contract.name,
            contract.version,
            p.logical_operation_id,
            payload_hash,
        ]
    )
    return "ik:" + hashlib.sha256(material).hexdigest()


def hash_payload(canonical: bytes) -> str:
    """A call's payload hash, from its canonical arguments (``canonical_json``): what
    idempotency records, approvals and compensation keys are bound to."""
    return "sha256:" + hashlib.sha256(canonical).hexdigest()


def _route(
    p: Proposal, contract: Contract, now_ms: int, principal: Principal | None = None
) -> ApprovedCall:
    args = canonical_json(p.arguments)
    payload_hash = hash_payload(args)
    return ApprovedCall(
        call_id=p.proposal_id,
        tool_name=contract.name,
        tool_version=contract.version,
        side_effect_class=contract.side_effect_class,
        canonical_arguments=args.decode(),
        payload_hash=payload_hash,
        idempotency_key=idempotency_key(
            p, contract, payload_hash, principal.user_id if principal else None
        ),
        deadline_ms=now_ms + contract.timeout_ms,
    )


def _routable(
    p: Proposal, contract: Contract, now_ms: int, principal: Principal | None
) -> ApprovedCall | Rejection:
    """The call, or the refusal of arguments it could not carry (``uncarriable``)."""
    try:
        return _route(p, contract, now_ms, principal)
    except orjson.JSONEncodeError:
        return uncarriable(p.arguments)


def _lifecycle_warnings(c: Contract) -> tuple[str, ...]:
    if c.lifecycle.status != "deprecated":
        return ()
    when = f" on {c.lifecycle.sunset_date}" if c.lifecycle.sunset_date else ""
    repl = f"; move to {c.lifecycle.replacement}" if c.lifecycle.replacement else ""
    return (f"{c.name}@{c.version} is deprecated and will be sunsetted{when}{repl}",)


@dataclass(slots=True)
class Pending:
    """A proposal that passed the record-only gates and waits for reference data."""

    src: SourceRecord
    proposal: Proposal
    contract: Contract
    principal: Principal
    warnings: tuple[str, ...]
    keys: list[RefKey]
    spent: float
    """Seconds its gates took so far (the batch's lookup and other records' gates are not
    its own: ``finish`` adds only its own time)."""


def prepare(src: SourceRecord, gates: Gates, now_ms: int) -> Decision | Pending:
    """Parse, resolve, schema, identity. Never raises."""
    started = time.perf_counter()
    try:
        result = _prepare(src, gates, now_ms, started)
    except Exception as exc:  # the consumer must never stop on one record
        logger.exception("decision failed for %s/%s@%s", src.topic, src.partition, src.offset)
        result = internal_error(src, gates.limits, now_ms, exc)
    if isinstance(result, Decision):
        result.latency_ms = (time.perf_counter() - started) * 1000
    return result


def finish(pending: Pending, gates: Gates, answers: RefAnswers, now_ms: int) -> Decision:
    """Semantic, policy, state, confirmation, route. Never raises."""
    started = time.perf_counter()
    try:
        decision = _finish(pending, gates, answers, now_ms)
    except Exception as exc:
        src = pending.src
        logger.exception("decision failed for %s/%s@%s", src.topic, src.partition, src.offset)
        decision = internal_error(src, gates.limits, now_ms, exc)
    decision.latency_ms = (pending.spent + time.perf_counter() - started) * 1000
    return decision


def decide(
    src: SourceRecord,
    gates: Gates,
    now_ms: int | None = None,
    answers: RefAnswers | None = None,
) -> Decision:
    """Every gate over one record, with the reference data given (none: nothing exists)."""
    if now_ms is None:
        now_ms = int(time.time() * 1000)
    prepared = prepare(src, gates, now_ms)
    if isinstance(prepared, Decision):
        return prepared
    return finish(prepared, gates, answers or {}, now_ms)


Lookup = Callable[[set[RefKey]], RefAnswers]


def decide_batch(
    records: Iterable[SourceRecord], gates: Gates, now_ms: int, lookup: Lookup
) -> list[Decision]:
    """A batch: one reference lookup for all of it, however many records need one."""
    return decide_batch_at(records, gates, lambda _: now_ms, lookup)


def decide_batch_at(
    records: Iterable[SourceRecord],
    gates: Gates,
    then: Callable[[SourceRecord], int],
    lookup: Lookup,
) -> list[Decision]:
    """``decide_batch`` with each record decided at its own time, ``then(record)``: a
    replay decides each at the time it was decided first."""
    prepared = [prepare(r, gates, then(r)) for r in records]
    keys = {k for x in prepared if isinstance(x, Pending) for k in x.keys}
    answers = lookup(keys) if keys else {}
    return [
        x if isinstance(x, Decision) else finish(x, gates, answers, then(x.src)) for x in prepared
    ]


def _prepare(src: SourceRecord, gates: Gates, now_ms: int, started: float) -> Decision | Pending:
    parsed = parse_proposal(src, gates.limits)
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
    if gates.verifier.development:
        warnings = (DEVELOPMENT_WARNING, *warnings)
    # Identity is worked out once, here; it decides nothing until the identity gate, but a
    # proposal refused before it still counts as a step of a run its token proves.
    who = identify(p, gates.verifier, now_ms / 1000)
    principal = who if isinstance(who, Principal) else None
    if rejection is not None:
        return _rejected(src, p, rejection, warnings, now_ms, None, principal)

    resolved = resolve_tool(p, gates.contracts, now_ms)
    if isinstance(resolved, Rejection):
        return _rejected(src, p, resolved, warnings, now_ms, None, principal)
    contract = resolved
    warnings += _lifecycle_warnings(contract)

    refusal = check_secrets(p, gates.policy) or check_arguments(p.arguments, contract)
    if refusal is not None:
        return _rejected(src, p, refusal, warnings, now_ms, contract, principal)

    if isinstance(who, Rejection):
        return _rejected(src, p, who, warnings, now_ms, contract)
    principal = who
    refusal = check_scopes(p, contract, principal)
    if refusal is not None:
        return _rejected(src, p, refusal, warnings, now_ms, contract, principal)
    keys = reference_keys(p, contract, principal.tenant_id)
    return Pending(src, p, contract, principal, warnings, keys, time.perf_counter() - started)


def _finish(pending: Pending, gates: Gates, answers: RefAnswers, now_ms: int) -> Decision:
    src, p, contract, principal = pending.src, pending.proposal, pending.contract, pending.principal
    warnings = pending.warnings
    resolved = resolve_references(p, contract, principal.tenant_id, answers)
    refusal = check_semantics(p, contract, principal, resolved) or check_policy(
        p, contract, principal, gates.policy
    )
    if refusal is not None:
        return _rejected(src, p, refusal, warnings, now_ms, contract, principal)
    refusal = check_state(contract, resolved)
    if refusal is not None:
        # A retry of a call that already ran finds the world changed by that very call
        # (the order it cancelled is cancelled): its key is kept, so admission can answer
        # from the call's record instead.
        d = _rejected(src, p, refusal, warnings, now_ms, contract, principal)
        would_be = _routable(p, contract, now_ms, principal)
        if isinstance(would_be, ApprovedCall):
            d.idempotency = (would_be.idempotency_key, would_be.payload_hash)
        return d

    call = _routable(p, contract, now_ms, principal)
    if not isinstance(call, ApprovedCall):
        return _rejected(src, p, call, warnings, now_ms, contract, principal)
    confirmation = check_confirmation(
        p,
        contract,
        principal,
        gates.policy,
        gates.approvers,
        call,
        before_state(resolved),
        now_ms,
    )
    if isinstance(confirmation, Rejection):
        return _rejected(src, p, confirmation, warnings, now_ms, contract, principal)
    if isinstance(confirmation, Park):
        d = _rejected(src, p, confirmation.rejection, warnings, now_ms, contract, principal)
        d.outcome = Outcome.PARKED
        d.call = call
        d.post_action_verification = contract.post_action_verification_required
        d.approval_request = confirmation.packet
        return d
    if isinstance(confirmation, Approved):
        call.approval_ids = confirmation.approval_ids
    return Decision(
        src,
        Outcome.ROUTED,
        Gate.ROUTE,
        p,
        contract_name=contract.name,
        contract_version=contract.version,
        side_effect_class=contract.side_effect_class,
        call=call,
        warnings=warnings,
        decided_at_ms=now_ms,
        post_action_verification=contract.post_action_verification_required,
        principal=principal,
    )


def _rejected(
    src: SourceRecord,
    p: Proposal,
    rejection: Rejection,
    warnings: tuple[str, ...],
    now_ms: int,
    contract: Contract | None = None,
    principal: Principal | None = None,
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
        principal=principal,
    )


def _internal_rejection(exc: Exception) -> Rejection:
    return Rejection(
        TaxonomyClass.UNKNOWN_ERROR,
        Gate.INTERNAL,
        (FieldError(None, f"internal error: {type(exc).__name__}", "internal_error"),),
        "Nothing was executed; do not retry this call automatically, hand off to a human.",
    )


def internal_error(src: SourceRecord, limits: Limits, now_ms: int, exc: Exception) -> Decision:
    """The answer to a proposal a defect stopped from being decided: nothing is routed;
    an observation when the proposal names its run, the DLQ otherwise."""
    rejection = _internal_rejection(exc)
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


def parked_internal_error(answer: Decision, now_ms: int, exc: Exception) -> Decision:
    """The answer to a parked proposal whose request a record of tool.approvals ended (a
    release, a rejection, an expiry), when a defect then stopped that record from being
    decided: ``answer``, what the record would have told the proposal, is not given, and
    nothing is routed. The request has ended, so nothing else will answer the proposal:
    it is told of the internal error, once, rather than left waiting for ever."""
    return Decision(
        answer.source,
        Outcome.REJECTED,
        Gate.INTERNAL,
        answer.proposal,
        contract_name=answer.contract_name,
        contract_version=answer.contract_version,
        side_effect_class=answer.side_effect_class,
        rejection=_internal_rejection(exc),
        decided_at_ms=now_ms,
    )
