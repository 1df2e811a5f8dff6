"""Gates: budget and idempotency. What a batch asks of Redis, and what Redis answers.

After every other gate has accepted a proposal, its call is admitted against the
run's and the tenant's budgets, the tool's rate limit, the loop guard and the
idempotency record of its key (``state/admission.py``). A proposal an earlier gate
refused is still a step of its run and, when it failed on its own arguments, a
repair: a run that keeps failing the same way is stopped and escalated.

Both functions here are pure: ``admission_item`` says what to ask, ``apply_verdict``
turns the answer into the decision. Redis sits between them, once per batch.
"""

from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass
from typing import Any

import orjson

from processor.approval_flow import PARKED_AS, PARKED_UNTIL
from processor.approvals import parse_iso_ms
from processor.contracts.registry import Contract
from processor.gates.confirmation import reissue
from processor.gates.parse import COMPENSATION_PREFIX
from processor.identity import grant_of
from processor.model import (
    Decision,
    FieldError,
    Final,
    Gate,
    Outcome,
    Proposal,
    Rejection,
    TaxonomyClass,
)
from processor.pipeline import canonical_json, hash_payload
from processor.policy import Budgets
from processor.state.admission import SETTLED_TTL_MS, Item, Verdict, call_item, rate_of
from processor.state.approvals import retain_ms

_REPAIRS = frozenset({
    TaxonomyClass.SYNTACTIC_PARSE_FAIL, TaxonomyClass.STRUCTURAL_VIOLATION,
    TaxonomyClass.TYPE_MISMATCH, TaxonomyClass.OUT_OF_BOUNDS,
    TaxonomyClass.SEMANTIC_INVALIDITY,
})  # fmt: skip
"""Refusals the model is expected to repair by proposing again with other arguments."""

HANDOFF_TOOL = "handoff_to_human"
"""What a run out of steps or budget is told to call: never refused for steps, budgets or
costs (its idempotency key and rate limit still apply)."""
UNREQUESTED_COMPENSATION = "compensation_not_requested"
"""The code of the refusal of a call that borrows a compensation key (see admission.lua)."""


@dataclass(frozen=True, slots=True)
class Runtime:
    """The admission-relevant part of a contract, computed once per contract version."""

    rate: tuple[int, int] | None
    cost: float
    ttl_ms: int


def runtime_of(c: Contract) -> Runtime:
    return c.once("admission.runtime", _runtime)


def _runtime(c: Contract) -> Runtime:
    raw = c.raw
    limits = raw["runtime"].get("rate_limits") or {}
    cost = (raw["runtime"].get("cost_profile") or {}).get("cost_per_call", 0) or 0
    ttl_s = (raw.get("idempotency") or {}).get("ttl_seconds") or 86_400
    return Runtime(
        rate_of(int(limits.get("window_sec", 0)), int(limits.get("max_requests", 0))),
        float(cost),
        int(ttl_s) * 1000,
    )


def _signature(tool: str, args: bytes) -> str:
    return hashlib.blake2b(tool.encode() + b"\0" + args, digest_size=12).hexdigest()


def _scaled(rate: tuple[int, int] | None, scale: float) -> tuple[int, int] | None:
    if rate is None or scale == 1.0:
        return rate
    interval, burst = rate
    return max(1, int(interval / scale)), max(1, int(burst * scale))


def position(d: Decision) -> str:
    s = d.source
    return f"{s.topic}/{s.partition}/{s.offset}"


def utc_day(now_ms: int) -> str:
    return time.strftime("%Y%m%d", time.gmtime(now_ms / 1000))


def admission_item(
    d: Decision, contract: Contract | None, budgets: Budgets, now_ms: int
) -> tuple[str, Item] | None:
    """What to ask Redis about a decision (None: nothing, it is not a verified run's step).

    Only proposals whose principal verified are counted, and under the token's
    tenant: nobody can spend another tenant's budget by naming its run."""
    p, principal = d.proposal, d.principal
    if p is None or principal is None or d.outcome is Outcome.DEAD_LETTER:
        return None
    tenant = principal.tenant_id
    pos = position(d)
    if d.outcome in (Outcome.ROUTED, Outcome.PARKED) and d.call is not None:
        assert contract is not None
        call, rt = d.call, runtime_of(contract)
        group = budgets.group(contract.name, contract.side_effect_class)
        item = call_item(
            pos=pos,
            run=p.run_id,
            tool=contract.name,
            # The version it is routed as: its result must name the same (see admission.lua,
            # settle), since the version picks the output schema and the compensation.
            version=contract.version,
            group=group,
            cost=rt.cost,
            sig=_signature(contract.name, call.canonical_arguments.encode()),
            now=now_ms,
            # A compensation is not rate limited either: refused for a moment, it would
            # be refused for good (nobody proposes it again).
            rate=None
            if is_compensation_key(call.idempotency_key)
            else _scaled(rt.rate, budgets.rate_limit_scale),
            steps=budgets.steps,
            class_budget=budgets.classes.get(group, 0),
            cost_cap=budgets.run_cost,
            day_cap=budgets.day_cost,
            day=utc_day(now_ms),
            repeats=budgets.repeats,
            ikey=call.idempotency_key,
            hash=call.payload_hash,
            call=call.call_id,
            deadline=_park_deadline(d) if d.outcome is Outcome.PARKED else call.deadline_ms,
            grace=budgets.in_flight_grace_ms,
            ttl=max(rt.ttl_ms, SETTLED_TTL_MS),
            park=d.outcome is Outcome.PARKED,
            # Kept only where a compensating call may have to be proposed in its name:
            # the principal's claims, never its token (no credential at rest).
            grant=grant_of(principal) if contract.compensation_tool else "",
            # The hand-off, which a run out of steps or budget is told to call, and the
            # compensating call the processor itself proposed (admission.lua admits a call
            # under a compensation key only if it is the one the original's record asked
            # for): neither is the agent spending its run's budgets, and refused by them
            # the compensation would leave a committed step for an operator.
            exempt=contract.name == HANDOFF_TOOL or is_compensation_key(call.idempotency_key),
        )
        if d.outcome is Outcome.PARKED and isinstance(d.approval_request, dict):
            # The request it waits for, as first named (a later attempt's is reissued from
            # it, see confirmation.reissue): only that request's end ends this park.
            item["rid"] = str(d.approval_request["request_id"])
        if d.outcome is Outcome.ROUTED and call.approval_ids:
            # Attached approvals, spent by this call when it is admitted (see admission.lua,
            # spent_elsewhere); remembered a day past the latest one's expiry.
            expires = max((_expiry(a) for a in p.approvals if isinstance(a, dict)), default=0)
            item["approvals"] = list(call.approval_ids)
            item["approvals_ttl"] = retain_ms(max(expires, now_ms), now_ms)
        return tenant, item
    if d.outcome is Outcome.REJECTED and d.rejection is not None:
        repair = d.rejection.taxonomy in _REPAIRS
        if p.arguments is None:  # broken model JSON: the text itself, if there was any
            text = p.arguments_text
            body = b"\x00" if text is None else text.encode("utf-8", "surrogatepass")
        else:
            try:
                body = orjson.dumps(p.arguments, option=orjson.OPT_SORT_KEYS)
            except TypeError:
                body = repr(p.arguments).encode()
        step = {
            "kind": "step",
            "pos": pos,
            "now": now_ms,
            "run": p.run_id,
            "sig": _signature(p.tool_name or "", body),
            "steps": budgets.steps,
            "repair": repair,
            "max_repairs": budgets.repairs,
            # A state refusal keeps its call's key: a retry of a call that already ran
            # is answered from that call's record (see pipeline._finish).
            "ikey": d.idempotency[0] if d.idempotency else "",
            "hash": d.idempotency[1] if d.idempotency else "",
            "tool": p.tool_name or "",
            # A refused compensation is checked against the original's record as an
            # admitted one is: only the one the processor proposed counts as failed.
            **_compensation_fields(p),
        }
        return tenant, step
    return None


def is_compensation_key(key: str | None) -> bool:
    return key is not None and key.startswith(COMPENSATION_PREFIX)


def _compensation_fields(p: Proposal) -> dict[str, str]:
    key = p.idempotency_key
    if not is_compensation_key(key) or p.arguments is None:
        return {}
    digest = hash_payload(canonical_json(p.arguments))
    return {"comp": key or "", "comp_hash": digest, "tool": p.tool_name or ""}


def release_item(d: Decision) -> tuple[str, Item]:
    """A parked call its approvers released: it takes over its key's record (unless a
    resubmission of its request did: then that one's request has ended)."""
    p, call = d.proposal, d.call
    assert p is not None and call is not None and p.tenant_id is not None
    first, attempt = d.extra.get(PARKED_AS) or ("", 0)
    return p.tenant_id, {
        "kind": "release",
        "pos": position(d),
        "run": p.run_id,
        "ikey": call.idempotency_key,
        "hash": call.payload_hash,
        "call": call.call_id,
        "deadline": call.deadline_ms,
        "ttl": SETTLED_TTL_MS,  # waiting for its result, as long as any call's record
        "parked_until": d.extra.get(PARKED_UNTIL) or "",  # its request's expiry
        "rid": first,  # the request, as its key's record names it
        "attempt": attempt,
        "version": call.tool_version,  # the version it is routed as, as its result must say
    }


def _expiry(approval: dict[str, Any]) -> int:
    try:
        return parse_iso_ms(str(approval.get("expires_at")))
    except ValueError:
        return 0


def _park_deadline(d: Decision) -> int:
    """A parked call is in flight until its approval request lapses."""
    packet = d.approval_request or {}
    expires = packet.get("expires_at")
    if isinstance(expires, int):
        return expires
    assert d.call is not None
    return d.call.deadline_ms


_BUDGET_TEXT = {
    "step_cap": (
        "step_cap",
        "the run has used all {steps} of its steps",
        "This run is out of steps. Stop calling tools: tell the user what was done and "
        "what is left, and call handoff_to_human.",
    ),
    "class_budget": (
        "class_budget",
        "the run may make no more {group} calls (budget {budget})",
        "This run may make no more {group} calls. Do not retry; finish with what you have, "
        "or call handoff_to_human if the task needs more.",
    ),
    "cost_cap": (
        "run_cost_cap",
        "the run's cost cap ({cap}) would be exceeded",
        "This run has spent its cost budget. Do not retry; call handoff_to_human.",
    ),
    "day_cost_cap": (
        "tenant_day_cost_cap",
        "the tenant's cost cap for today would be exceeded",
        "The tenant's daily budget is spent. Do not retry today; call handoff_to_human.",
    ),
    "loop": (
        "repeated_call",
        "this exact call (same tool, same arguments) was already made {repeats} times in this run",
        "Do not repeat this call: change the arguments or use another tool; if neither "
        "helps, call handoff_to_human.",
    ),
    "repair_loop": (
        "repair_loop",
        "the run proposed this same invalid call before",
        "Stop: repeating the same invalid call will not succeed. Do not try again; call "
        "handoff_to_human with what the user asked for.",
    ),
    "repair_cap": (
        "repair_cap",
        "the run has used all {repairs} of its repairs",
        "Stop: this run has failed to repair its calls {repairs} times. Do not try again; "
        "call handoff_to_human with what the user asked for.",
    ),
}


_IDEMPOTENCY_REFUSALS: dict[str, tuple[TaxonomyClass, str | None, str, str, str]] = {
    "signature_mismatch": (
        TaxonomyClass.SIGNATURE_MISMATCH,
        "idempotency_key",
        "this idempotency key was already used for a call with other arguments",
        "idempotency_key_reused",
        "Nothing ran. An idempotency key names one operation: use a new key for a new "
        "operation, or resend the original arguments to retry the original one.",
    ),
    "compensation_unrequested": (
        TaxonomyClass.PERMISSION_DENIED,
        "idempotency_key",
        "keys starting with 'compensate:' are reserved for the compensating calls the "
        "processor proposes, and none was proposed with this key and these arguments",
        UNREQUESTED_COMPENSATION,
        "Nothing ran. Do not use a 'compensate:' idempotency key: propose the call under a "
        "key of your own, or wait for the compensating call you were told of.",
    ),
    # A parked call whose key went ahead without its request: resubmitted with approvals
    # under another proposal, or taken by a later attempt once the request had lapsed. Its
    # request's end (approved, declined or expired alike) gives its proposal this answer,
    # once: the call did not run for it, and another proposal's observation tells what ran.
    "superseded": (
        TaxonomyClass.IDEMPOTENCY_CONFLICT,
        "idempotency_key",
        "this call's idempotency key went ahead without its approval request: another "
        "proposal of the call took the key over",
        "approval_request_superseded",
        "Nothing ran for this proposal. Do not propose it again: the same call under this "
        "idempotency key went ahead as another proposal, whose observation says what "
        "happened (propose it again under the same key to be told the outcome).",
    ),
    "replay_changed": (
        TaxonomyClass.DEPENDENCY_UNAVAILABLE,
        None,
        "decided again after a failure, and differently: what it depends on changed",
        "replay_changed",
        "Nothing ran. Propose the same call again; it is decided afresh.",
    ),
}
"""Admission's refusals on a key that wait for nothing: class, field, message, code and
next action."""


def _refused(
    d: Decision,
    taxonomy: TaxonomyClass,
    gate: Gate,
    error: FieldError,
    next_action: str,
    allowed: tuple[str, ...] = (),
) -> Decision:
    # A refused proposal keeps what its gates found wrong. A parked one's only "error" is
    # its parking notice (a request is waiting), which stops being true here: no request
    # is written for a call Redis refuses.
    kept = d.rejection.errors if d.rejection is not None and d.outcome is Outcome.REJECTED else ()
    d.rejection = Rejection(taxonomy, gate, (*kept, error), next_action, allowed)
    d.outcome = Outcome.REJECTED
    d.gate = gate
    d.call = None
    d.approval_request = None
    return d


def apply_verdict(
    d: Decision, verdict: Verdict, budgets: Budgets, contract: Contract | None
) -> Decision:
    """The decision once Redis has answered; unchanged when the call may go."""
    if verdict.get("ok", True):
        if d.call is not None and "attempt" in verdict:
            d.call.attempt = int(verdict["attempt"])
            if d.outcome is Outcome.PARKED:
                reissue(d, d.call.attempt)
        return d
    why = str(verdict.get("why"))
    if why in _BUDGET_TEXT:
        code, message, action = _BUDGET_TEXT[why]
        group = budgets.group(contract.name, contract.side_effect_class) if contract else ""
        facts: dict[str, Any] = {
            "steps": budgets.steps,
            "group": group,
            "budget": budgets.classes.get(group, 0),
            "cap": budgets.run_cost,
            "repeats": budgets.repeats,
            "repairs": budgets.repairs,
        }
        error = FieldError(None, message.format(**facts), code)
        handoff = (HANDOFF_TOOL,) if why in ("step_cap", "repair_loop", "repair_cap") else ()
        return _refused(
            d, TaxonomyClass.BUDGET_EXHAUSTED, Gate.BUDGET, error, action.format(**facts), handoff
        )
    if why == "rate_limited":
        wait = int(verdict.get("retry_after_ms", 0))
        d.retry_after_ms = wait
        tool = d.contract_name or ""
        error = FieldError(None, f"{tool} is rate limited for this tenant", "rate_limited")
        action = (
            f"Wait {wait / 1000:.1f} s, then propose the same call again unchanged. "
            "Do not switch to another tool to get around the limit."
        )
        return _refused(d, TaxonomyClass.RATE_LIMITED, Gate.BUDGET, error, action)
    if why == "in_flight":
        wait = int(verdict.get("retry_after_ms", 0))
        d.retry_after_ms = wait
        error = FieldError(
            "idempotency_key", "a call with this idempotency key is still in flight",
            "idempotency_in_flight",
        )  # fmt: skip
        action = (
            "The same operation is already running; do not propose it again now. Wait for "
            f"its result, or retry with the same idempotency key after {wait / 1000:.1f} s."
        )
        return _refused(d, TaxonomyClass.IDEMPOTENCY_CONFLICT, Gate.IDEMPOTENCY, error, action)
    refusal = _IDEMPOTENCY_REFUSALS.get(why)
    if refusal is not None:
        taxonomy, field, message, code, action = refusal
        return _refused(d, taxonomy, Gate.IDEMPOTENCY, FieldError(field, message, code), action)
    if why == "idempotent_hit":
        return cached_answer(d, verdict)
    if why == "approval_reused":
        ids = d.call.approval_ids if d.call is not None else ()
        which = f"approval {ids[0]} was" if len(ids) == 1 else "an attached approval was"
        return _refused(
            d,
            TaxonomyClass.CONFIRMATION_MISSING,
            Gate.CONFIRMATION,
            FieldError("approvals", f"{which} already used", "approval_reused"),
            "An approval is good for one execution only; nothing ran. Propose the call "
            "without an approval to request a new one.",
        )
    if why == "voided":  # decided again after it failed alone on a defect (see Processor._void)
        error = FieldError(None, "an earlier attempt to decide it met a defect", "internal_error")
    else:
        error = FieldError(None, f"admission refused ({why})", "admission_refused")
    return _refused(
        d, TaxonomyClass.UNKNOWN_ERROR, Gate.INTERNAL, error,
        "Nothing was executed; do not retry this call automatically, hand off to a human.",
    )  # fmt: skip


def cached_answer(d: Decision, verdict: Verdict) -> Decision:
    """A call whose key already has a final answer: that answer again, flagged as an
    idempotency hit, and nothing routed."""
    try:
        cached = orjson.loads(verdict.get("cached") or b"{}")
    except orjson.JSONDecodeError:
        cached = {}
    d.outcome = Outcome.SETTLED
    d.gate = Gate.IDEMPOTENCY
    d.call = None
    d.approval_request = None
    taxonomy = TaxonomyClass(cached.get("class", TaxonomyClass.SUCCESS.value))
    d.final = Final(
        completed=taxonomy is TaxonomyClass.SUCCESS,
        data=cached.get("data"),
        idempotency_hit=True,
        attempt=int(cached.get("attempt", 1)),
    )
    d.rejection = None
    if taxonomy is TaxonomyClass.SUCCESS:
        return d
    errors = tuple(FieldError(**e) for e in cached.get("errors", ()))
    action = cached.get("next_action", "")
    tools: tuple[str, ...] = ()
    # The answer was cached when the call failed after committing a step, and said to wait
    # for the compensating call: what that call did since decides what a retry is told.
    tool = d.contract_name or (d.proposal.tool_name if d.proposal else None) or "the call"
    if verdict.get("state") == "COMPENSATED":
        action = (
            f"{tool} failed after committing a step, and its compensating call completed: "
            "nothing of it stays committed. Do not retry it unchanged; tell the user it did "
            "not go through."
        )
    elif verdict.get("state") == "COMPENSATION_FAILED":
        taxonomy, tools = TaxonomyClass.COMPENSATION_FAILED, (HANDOFF_TOOL,)
        errors += (
            FieldError(
                None,
                "its compensating call did not complete, so an earlier step stays committed",
                "compensation_failed",
            ),
        )
        action = (
            f"{tool} failed after committing a step, and its compensation did not complete. "
            "Do not retry; tell the user an operator will reconcile it and call "
            "handoff_to_human."
        )
    d.rejection = Rejection(taxonomy, Gate.RESULT, errors, action, tools)
    return d
