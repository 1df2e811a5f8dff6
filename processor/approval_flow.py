"""The second half of confirmation: decisions on ``tool.approvals`` and parked calls.

``tool.approvals`` carries two kinds of record, both JSON (any other ``type`` goes to
the DLQ as ``approval_unknown_type``):

- an approval decision (``processor.approvals``), naming the ``request_id``
  of a parked call, signed by an approver;
- an expiry check, ``{"type": "expiry_check", "tenant_id": ..., "request_id":
  ...}``, which the processors' sweeper publishes when a parked call's expiry
  passes. It carries no authority: the stored expiry and the processor's own
  clock decide (never the record's timestamp, which its producer sets), so a
  forged check can do nothing early.

Both are consumed by the same transactional loop as the proposals, so a
release (approved call plus observation) is written exactly once. Invalid
decisions go to the DLQ with the reason; the parked call is untouched.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import orjson
from confluent_kafka import Producer

from processor.approvals import Approver, Binding, VerifiedApproval, verify_approval
from processor.config import Settings
from processor.contracts.registry import Contract
from processor.gates.identity import check_signing_key
from processor.gates.policy import check_policy
from processor.gates.resolve import resolve_tool
from processor.gates.schema import check_arguments
from processor.gates.semantic import (
    FOREIGN,
    RefAnswers,
    RefKey,
    Resolved,
    check_semantics,
    check_state,
    reference_keys,
    resolve_references,
)
from processor.kafka.produce import deliver
from processor.model import (
    CLEARANCE_LEVELS,
    ApprovedCall,
    Decision,
    FieldError,
    Gate,
    Outcome,
    Principal,
    Proposal,
    Rejection,
    SideEffectClass,
    SourceRecord,
    TaxonomyClass,
)

if TYPE_CHECKING:
    from processor.pipeline import Gates
from processor.state.admission import ATTEMPT, FIRST_REQUEST_ID, park_identity
from processor.state.approvals import OpResult

EXPIRY_CHECK = "expiry_check"

PARKED_UNTIL = "parked_until"
"""``Decision.extra`` key of a released call: its request's expiry, the deadline it was
parked until (see release_item)."""

PARKED_AS = "parked_as"
"""``Decision.extra`` key of a released call: the (first request id, attempt) that name its
request in its key's record (see state.admission.park_identity)."""


@dataclass(frozen=True, slots=True)
class ApprovalInput:
    src: SourceRecord
    kind: str
    tenant_id: str
    request_id: str
    approval: dict[str, Any] | None


def parse_approval_record(src: SourceRecord) -> ApprovalInput | str:
    """The record, or the reason it is unusable (a DLQ reason code)."""
    try:
        doc = orjson.loads(src.value or b"")
    except orjson.JSONDecodeError:
        return "approval_not_json"
    if not isinstance(doc, dict):
        return "approval_not_object"
    tenant, rid = doc.get("tenant_id"), doc.get("request_id")
    if not isinstance(tenant, str) or not tenant or not isinstance(rid, str) or not rid:
        return "approval_without_request"
    if doc.get("type") == EXPIRY_CHECK:
        return ApprovalInput(src, EXPIRY_CHECK, tenant, rid, None)
    if doc.get("type") is not None:
        # A kind of record this version does not know (a withdrawal of an approval, say,
        # carrying the approval's signed fields) is not read as the decision it names: the
        # type is not signed, and that reading could count an approval its sender meant
        # to take back.
        return "approval_unknown_type"
    return ApprovalInput(src, "decision", tenant, rid, doc)


def publish_approvals(settings: Settings, run_id: str, approvals: list[dict[str, Any]]) -> None:
    """Put approval decisions on ``tool.approvals`` (keyed by run), as an operator does."""
    producer = Producer(settings.client_config(**{"enable.idempotence": True}))
    key = run_id.encode()
    deliver(producer, settings.topics.approvals, [(key, orjson.dumps(a)) for a in approvals], 15)


def position(src: SourceRecord) -> str:
    return f"{src.topic}/{src.partition}/{src.offset}"


def verify_decision(
    item: ApprovalInput,
    entry: dict[str, Any],
    approvers: dict[str, Approver],
    now_ms: int,
    max_lifetime_s: int,
) -> VerifiedApproval | FieldError:
    binding = Binding(
        entry["tenant_id"],
        entry["trace_id"],
        entry["tool_name"],
        entry["tool_version"],
        entry["payload_hash"],
        SideEffectClass(entry["side_effect_class"]),
        entry["requested_by_user"],
        entry["requested_by_agent"],
    )
    return verify_approval(
        item.approval, approvers, binding, _requester(entry), now_ms, max_lifetime_s=max_lifetime_s
    )


def _requester(entry: dict[str, Any]) -> Principal:
    """Who proposed the parked call: nobody of theirs may approve it."""
    user, agent = entry["requested_by_user"], entry["requested_by_agent"]
    return Principal(entry["tenant_id"], user, agent, frozenset(), "public")


def revoked_votes(entry: dict[str, Any], approvers: dict[str, Approver]) -> list[str]:
    """The approval ids of the votes already counted on ``entry``'s request whose approvers
    no longer may cast them: gone from the approvers file since they voted, no longer
    allowed to approve this class of call for this tenant, or holding another key than
    the one the vote was verified with (votes recorded before keys were, none). A vote
    counts when the request is released, not only when it was cast: an operator who
    removes a compromised approver, or replaces their leaked key, expects a call that
    key half-released to need someone else's vote, not to go on the next one. (By
    approval id: the same approver's vote with their new key, cast in the same batch,
    stays.)"""
    cls = SideEffectClass(entry["side_effect_class"])
    tenant = entry["tenant_id"]
    requester = _requester(entry)
    out = []
    for vote in entry.get("approvers") or []:
        approver = approvers.get(vote.get("id"))
        key = vote.get("key")
        if (
            approver is None
            or not approver.may_approve(cls, tenant)
            or approver.is_requester(requester)
            or (isinstance(key, str) and key != approver.key_print)
        ):
            out.append(str(vote.get("approval_id")))
    return out


def entry_proposal(entry: dict[str, Any]) -> Proposal:
    return Proposal(
        proposal_id=entry["proposal_id"],
        run_id=entry["run_id"],
        tenant_id=entry["tenant_id"],
        created_at=None,
        tool_name=entry["tool_name"],
        tool_version=entry["tool_version"],
        arguments=None,
        idempotency_key=entry.get("idempotency_key"),
        traceparent=entry.get("traceparent"),
        trace_id=entry["trace_id"],
    )


def parked_entry(d: Decision) -> dict[str, Any]:
    """What Redis keeps of a parked call: enough to release it without the proposal."""
    assert d.call is not None and d.proposal is not None
    packet = dict(d.approval_request)
    call = d.call
    entry = {
        **packet,
        "traceparent": d.proposal.traceparent,
        "timeout_ms": call.deadline_ms - d.decided_at_ms,
        "needed": packet["approvals_required"],
        "post_action_verification": d.post_action_verification,
        # The request as its key's record names it (see admission.lua, holds): an end of
        # this request then ends nothing of a later park of the key.
        FIRST_REQUEST_ID: d.extra.get(FIRST_REQUEST_ID) or packet["request_id"],
        ATTEMPT: call.attempt,
    }
    if d.principal is not None:  # what the gates are run against again at release
        entry["scopes"] = sorted(d.principal.scopes)
        entry["clearance"] = d.principal.clearance
        if d.principal.verified and d.principal.delegated_for is None and d.principal.key_id:
            entry["key_id"] = d.principal.key_id
    return entry


def _release_subject(
    entry: dict[str, Any], gates: Gates, now_ms: int
) -> tuple[Proposal, Contract] | Rejection:
    p = entry_proposal(entry)
    p.arguments = orjson.loads(entry["arguments"])
    resolved = resolve_tool(p, gates.contracts, now_ms)
    return resolved if isinstance(resolved, Rejection) else (p, resolved)


def release_keys(entry: dict[str, Any], gates: Gates, now_ms: int) -> list[RefKey]:
    """The reference data a released call is checked against again."""
    subject = _release_subject(entry, gates, now_ms)
    if isinstance(subject, Rejection):
        return []
    p, contract = subject
    return reference_keys(p, contract, entry["tenant_id"])


def recheck_release(
    entry: dict[str, Any], gates: Gates, answers: RefAnswers, now_ms: int
) -> Rejection | None:
    """The gates that depend on the world, run again when approvers release a parked call:
    the key that signed its token may have been withdrawn, the contract version
    sunsetted, the policy changed, the order shipped since the approvers were asked. The
    approvers said yes to the call as their packet described it (its ``before_state``); a
    call that no longer passes is refused, as a fresh proposal would be, and does not
    run."""
    key_id = entry.get("key_id")
    untrusted = check_signing_key(key_id if isinstance(key_id, str) else None, gates.verifier)
    if untrusted is not None:
        return untrusted
    subject = _release_subject(entry, gates, now_ms)
    if isinstance(subject, Rejection):
        return subject
    p, contract = subject
    # The version may have been edited in place since (reloaded under the same number with
    # another schema): arguments it no longer accepts are refused as a fresh proposal's
    # would be, and before the rules, which read only arguments the schema has checked.
    malformed = check_arguments(p.arguments, contract)
    if malformed is not None:
        return malformed
    tenant = entry["tenant_id"]
    scopes, clearance = entry.get("scopes"), entry.get("clearance")
    resolved = resolve_references(p, contract, tenant, answers)
    if isinstance(scopes, list) and clearance in CLEARANCE_LEVELS:
        principal = Principal(tenant, entry["requested_by_user"], entry["requested_by_agent"],
                              frozenset(scopes), clearance)  # fmt: skip
        refusal = check_semantics(p, contract, principal, resolved) or check_policy(
            p, contract, principal, gates.policy
        )
    else:
        # Parked by an earlier version, which kept no scopes: the rules that read the
        # principal cannot be run again; the references and the policy can (its clearance
        # was checked when the call was parked and a token's does not change).
        principal = Principal(tenant, entry["requested_by_user"], entry["requested_by_agent"],
                              frozenset(), CLEARANCE_LEVELS[-1])  # fmt: skip
        refusal = _unknown_references(p, contract, principal, resolved) or check_policy(
            p, contract, principal, gates.policy
        )
    return refusal or check_state(contract, resolved)


def _unknown_references(
    p: Proposal, contract: Contract, principal: Principal, resolved: Resolved
) -> Rejection | None:
    if any(entry is None or entry is FOREIGN for _, _, entry in resolved):
        return check_semantics(p, replace(contract, rules=()), principal, resolved)
    return None


def refused_release(src: SourceRecord, entry: dict[str, Any], refusal: Rejection,
                    now_ms: int) -> Decision:  # fmt: skip
    """A released call that no longer passes a gate: not routed, and the agent told why."""
    why = FieldError(
        None,
        f"approved (request {entry['request_id']}), but refused when released: "
        f"{refusal.taxonomy.value} at the {refusal.gate.value} gate",
        "release_refused",
    )
    rejection = Rejection(
        refusal.taxonomy,
        refusal.gate,
        (*refusal.errors, why),
        f"{entry['tool_name']} was approved but did not run: "
        + (
            "its identity is no longer proven. "
            if refusal.gate is Gate.IDENTITY
            else "what it acts on changed while it waited. "
        )
        + refusal.next_action,
        refusal.allowed_tools,
    )
    return Decision(
        src,
        Outcome.REJECTED,
        refusal.gate,
        entry_proposal(entry),
        rejection=rejection,
        contract_name=entry["tool_name"],
        contract_version=entry["tool_version"],
        side_effect_class=SideEffectClass(entry["side_effect_class"]),
        decided_at_ms=now_ms,
    )


def outcome_decision(item: ApprovalInput, result: OpResult, now_ms: int) -> Decision | None:
    """The observation (and, for a release, the approved call) an approval result yields."""
    entry = result.entry
    if entry is None or result.status not in ("released", "rejected", "expired"):
        return None
    src = item.src
    p = entry_proposal(entry)
    cls = SideEffectClass(entry["side_effect_class"])
    common: dict[str, Any] = {
        "contract_name": entry["tool_name"],
        "contract_version": entry["tool_version"],
        "side_effect_class": cls,
        "decided_at_ms": now_ms,
    }
    if result.status == "released":
        approvers = entry.get("approvers") or []
        call = ApprovedCall(
            call_id=entry["proposal_id"],
            tool_name=entry["tool_name"],
            tool_version=entry["tool_version"],
            side_effect_class=cls,
            canonical_arguments=entry["arguments"],
            payload_hash=entry["payload_hash"],
            idempotency_key=entry["idempotency_key"],
            deadline_ms=now_ms + int(entry["timeout_ms"]),
            approval_ids=tuple(a["approval_id"] for a in approvers),
        )
        return Decision(
            src,
            Outcome.ROUTED,
            Gate.APPROVAL,
            p,
            call=call,
            extra={PARKED_UNTIL: entry["expires_at"], PARKED_AS: park_identity(entry)},
            post_action_verification=bool(entry.get("post_action_verification")),
            warnings=(
                f"released by {', '.join(a['id'] for a in approvers)} "
                f"(request {entry['request_id']})",
            ),
            **common,
        )
    if result.status == "rejected":
        reason = entry.get("reason")
        error = FieldError(
            None,
            f"{entry.get('rejected_by')} rejected the call"
            + (f": {reason}" if isinstance(reason, str) and reason else ""),
            "approval_rejected",
        )
        action = (
            f"The approver declined {entry['tool_name']}; it did not run. Do not propose it "
            "again; tell the user it was declined and why."
        )
    else:
        error = FieldError(
            None,
            f"no approval arrived before request {entry['request_id']} expired",
            "approval_expired",
        )
        action = (
            f"{entry['tool_name']} was not approved in time and did not run. Ask the user "
            "whether it is still wanted before proposing it again."
        )
    rejection = Rejection(TaxonomyClass.CONFIRMATION_MISSING, Gate.APPROVAL, (error,), action)
    return Decision(src, Outcome.REJECTED, Gate.APPROVAL, p, rejection=rejection, **common)


def dead_letter(
    src: SourceRecord, reason: str, detail: str = "", gate: Gate = Gate.APPROVAL
) -> Decision:
    """A record of tool.approvals (or, with its gate, tool.results) that changes nothing:
    it goes to the DLQ with the reason."""
    return Decision(src, Outcome.DEAD_LETTER, gate, None, dlq_reason=reason, dlq_detail=detail)


def ignored(src: SourceRecord, why: str) -> Decision:
    return Decision(src, Outcome.IGNORED, Gate.APPROVAL, None, dlq_detail=why)
