"""Gate: confirmation. ``CONFIRMATION_MISSING`` until a valid approval is in hand.

A call needs approval when its contract says so or its side-effect class does
(policy: ``HIGH_RISK_EXTERNAL`` and ``CRITICAL_MUTATION`` by default), and
``CRITICAL_MUTATION`` needs two distinct approvers. Without an approval the
call is *parked*: the processor holds it in Redis and publishes a
confirmation packet; a decision on ``tool.approvals`` later releases or ends
it. A proposal may instead carry its approvals; they are checked here, and
their single use is enforced against Redis when the batch is written.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import orjson

from processor.approvals import APPROVED, Approver, Binding, verify_approval
from processor.contracts.registry import Contract
from processor.model import (
    ApprovedCall,
    Decision,
    FieldError,
    Gate,
    Principal,
    Proposal,
    Rejection,
    TaxonomyClass,
)
from processor.policy import Policy
from processor.state.admission import FIRST_REQUEST_ID


@dataclass(frozen=True, slots=True)
class Approved:
    approval_ids: tuple[str, ...]
    approver_ids: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class Park:
    rejection: Rejection
    packet: dict[str, Any]


def request_id_for(
    p: Proposal, contract: Contract, principal: Principal, payload_hash: str, key: str
) -> str:
    """One request per call as its approvers see it and as its release would run it:
    tenant, proposal, run, trace, tool version, payload, idempotency key and requester.
    Another proposal that reuses a parked one's id (another run, tool or requester) gets
    a request of its own, never the votes already cast on the first (and a replay of the
    same record, the same id)."""
    material = orjson.dumps(
        [
            principal.tenant_id,
            p.proposal_id,
            p.run_id,
            p.trace_id,
            contract.name,
            contract.version,
            payload_hash,
            key,
            principal.user_id,
            principal.agent_id,
        ]
    )
    return "req_" + hashlib.sha256(material).hexdigest()[:24]


def _missing(errors: tuple[FieldError, ...], next_action: str) -> Rejection:
    return Rejection(TaxonomyClass.CONFIRMATION_MISSING, Gate.CONFIRMATION, errors, next_action)


def _first_sentence(text: str) -> str:
    head = text.strip().split(". ")[0].rstrip(".")
    return head + "."


def _consequence(contract: Contract) -> str:
    return _consequence_of(
        contract.description,
        contract.raw["transactional"]["semantics"],
        contract.compensation_tool,
    )


@lru_cache(maxsize=1024)
def _consequence_of(description: str, semantics: str, compensation_tool: str | None) -> str:
    if semantics == "irreversible_pivot":
        tail = "It cannot be undone once it runs."
    elif compensation_tool:
        tail = f"It can be reversed afterwards with {compensation_tool}."
    else:
        tail = "Reversing it needs manual work."
    return f"{_first_sentence(description)} {tail}"


def check_confirmation(
    p: Proposal,
    contract: Contract,
    principal: Principal,
    policy: Policy,
    approvers: dict[str, Approver],
    call: ApprovedCall,
    before_state: str,
    now_ms: int,
) -> Approved | Rejection | Park | None:
    needed = policy.approvals_needed(contract.side_effect_class, contract.confirmation_required)
    if needed == 0:
        return None
    if p.approvals:
        binding = Binding(
            principal.tenant_id,
            p.trace_id,
            contract.name,
            contract.version,
            call.payload_hash,
            contract.side_effect_class,
            principal.user_id,
            principal.agent_id,
        )
        errors: list[FieldError] = []
        good: dict[str, str] = {}
        for i, approval in enumerate(p.approvals):
            verified = verify_approval(
                approval, approvers, binding, principal, now_ms, i, policy.approval_max_lifetime_s
            )
            if isinstance(verified, FieldError):
                errors.append(verified)
            elif verified.decision != APPROVED:
                errors.append(
                    FieldError(
                        f"approvals/{i}",
                        f"{verified.approver_id} rejected this call"
                        + (f": {verified.reason}" if verified.reason else ""),
                        "approval_rejected",
                    )
                )
            else:
                good.setdefault(verified.approver_id, verified.approval_id)
        if errors:
            return _missing(
                tuple(errors),
                "The attached approval is not valid for this exact call; nothing ran. Do not "
                "alter or reuse approvals: propose the call without one to request a fresh "
                "approval, and tell the user it is waiting for sign-off.",
            )
        if len(good) < needed:
            return _missing(
                (
                    FieldError(
                        "approvals",
                        f"{contract.side_effect_class.value} calls need {needed} distinct "
                        f"approvers; {len(good)} approved",
                        "approvals_insufficient",
                        expected=str(needed),
                        actual=str(len(good)),
                    ),
                ),
                f"This call needs {needed} different approvers; wait for the remaining "
                "approval before proposing it again.",
            )
        return Approved(tuple(good.values()), tuple(good))
    request_id = request_id_for(p, contract, principal, call.payload_hash, call.idempotency_key)
    expires_at = now_ms + policy.approval_ttl_s * 1000
    packet = {
        "request_id": request_id,
        "proposal_id": p.proposal_id,
        "tenant_id": principal.tenant_id,
        "run_id": p.run_id,
        "trace_id": p.trace_id,
        "tool_name": contract.name,
        "tool_version": contract.version,
        "side_effect_class": contract.side_effect_class.value,
        "action": f"{contract.name}@{contract.version}",
        "consequence": _consequence(contract),
        "arguments": call.canonical_arguments,
        "before_state": before_state or None,
        "payload_hash": call.payload_hash,
        "idempotency_key": call.idempotency_key,
        "approvals_required": needed,
        "requested_by_user": principal.user_id,
        "requested_by_agent": principal.agent_id,
        "created_at": now_ms,
        "expires_at": expires_at,
        "risk_reason": (
            "the contract requires confirmation"
            if contract.confirmation_required
            else f"{contract.side_effect_class.value} calls need approval"
        ),
        "rejection_path": (
            "If rejected, the call never runs and the agent is told it was declined; "
            "if nobody answers by the expiry, it lapses the same way."
        ),
    }
    return Park(_waiting(contract.name, needed, request_id), packet)


def _waiting(tool: str, needed: int, request_id: str) -> Rejection:
    return _missing(
        (
            FieldError(
                None,
                f"{tool} needs {needed} approval(s); request {request_id} is waiting",
                "approval_required",
                expected=str(needed),
            ),
        ),
        f"Tell the user that {tool} is waiting for approval (request {request_id}) "
        "and do not propose it again: it runs by itself once approved, and you will get an "
        "observation either way.",
    )


def reissue(d: Decision, attempt: int) -> None:
    """A parked call admitted as a later attempt of its key: the same proposal sent again
    once its first request ended (expired, or declined and its hold lapsed). It asks its
    approvers afresh under a request id of its own. Under the first one's id, every answer
    would find that request ended (and an approver's answer, whose id is derived from the
    request id, would count as spent), and the call would wait for ever. The id follows
    from the attempt, which a replay of the batch is given again: so does the request."""
    packet = d.approval_request
    if attempt <= 1 or not isinstance(packet, dict):
        return
    first = packet["request_id"]
    material = f"{first}/attempt/{attempt}".encode()
    request_id = "req_" + hashlib.sha256(material).hexdigest()[:24]
    d.approval_request = {**packet, "request_id": request_id}
    # (the idempotency record names the request by the first id and the attempt: see
    # approval_flow.parked_entry)
    d.extra[FIRST_REQUEST_ID] = first
    d.rejection = _waiting(packet["tool_name"], packet["approvals_required"], request_id)
