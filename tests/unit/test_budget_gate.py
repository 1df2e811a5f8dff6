"""The budget and idempotency gates' pure halves: what a decision asks of Redis, and what
Redis's answer turns the decision into. Redis itself is exercised in the integration
tests (tests/integration/test_limits.py); here nothing runs but the mapping."""

from __future__ import annotations

from typing import Any

import orjson
import pytest

from processor.approval_flow import ApprovalInput, outcome_decision, parked_entry
from processor.contracts.registry import ContractSet
from processor.gates.budget import (
    admission_item,
    apply_verdict,
    cached_answer,
    release_item,
    runtime_of,
)
from processor.gates.semantic import RefEntry
from processor.model import Decision, Gate, Outcome, SourceRecord, TaxonomyClass
from processor.policy import Budgets, PolicyError, parse_policy
from processor.state.admission import SETTLED_TTL_MS, lapse_item
from processor.state.approvals import OpResult
from tests.unit.helpers import NOW_MS, decide_envelope, envelope, existing_references

BUDGETS = Budgets(financial_tools=frozenset({"refund_order"}))


def _decide(contracts: ContractSet, tool: str = "lookup_order", **fields: Any) -> Decision:
    return decide_envelope(envelope(tool, **fields), contracts)


def _contract(contracts: ContractSet, d: Decision) -> Any:
    assert d.contract_name and d.contract_version
    return contracts.get(d.contract_name, d.contract_version)


def test_a_routed_call_is_admitted_under_its_principals_tenant(contracts: ContractSet) -> None:
    d = _decide(contracts)
    assert d.outcome is Outcome.ROUTED and d.call is not None
    tenant, item = admission_item(d, _contract(contracts, d), BUDGETS, NOW_MS) or ("", {})
    assert tenant == "tenant-1"
    assert item["kind"] == "call" and item["group"] == "read"
    assert item["ikey"] == d.call.idempotency_key and item["hash"] == d.call.payload_hash
    assert item["deadline"] == d.call.deadline_ms and item["park"] is False
    assert item["steps"] == 12 and item["class_budget"] == 30 and item["repeats"] == 2
    assert item["pos"] == "tool.proposals/3/42"
    # GCRA from the contract: max_requests per window as (interval, burst).
    window = _contract(contracts, d).raw["runtime"]["rate_limits"]
    assert item["rate"] == (window["window_sec"] * 1000 // window["max_requests"],
                            window["max_requests"])  # fmt: skip


def test_the_same_arguments_in_any_key_order_are_one_signature(contracts: ContractSet) -> None:
    a = _decide(contracts, "search_kb", arguments={"query": "q", "limit": 3})
    b = _decide(contracts, "search_kb", arguments={"limit": 3, "query": "q"})
    c = _decide(contracts, "search_kb", arguments={"limit": 4, "query": "q"})
    sig = [admission_item(d, _contract(contracts, d), BUDGETS, NOW_MS)[1]["sig"]  # type: ignore[index]
           for d in (a, b, c)]  # fmt: skip
    assert sig[0] == sig[1] != sig[2]


def test_financial_tools_count_as_financial_and_parked_calls_until_their_approval_lapses(
    contracts: ContractSet,
) -> None:
    d = _decide(contracts, "refund_order")
    assert d.outcome is Outcome.PARKED
    _, item = admission_item(d, _contract(contracts, d), BUDGETS, NOW_MS) or ("", {})
    assert item["group"] == "financial" and item["class_budget"] == 0
    assert item["park"] is True
    assert item["deadline"] == d.approval_request["expires_at"]


def test_only_the_hand_off_and_a_compensation_are_exempt_from_the_runs_budgets(
    contracts: ContractSet,
) -> None:
    """A compensating call is the processor's clean-up, not the agent spending its run:
    refused by the run's financial budget (its one call was the failed charge), it would
    leave the charge committed. Admission only takes a call under a compensation key
    when the original's record asked for exactly that call."""
    refund = _decide(contracts, "refund_order")
    _, item = admission_item(refund, _contract(contracts, refund), BUDGETS, NOW_MS) or ("", {})
    assert item["exempt"] is False
    comp = _decide(contracts, "refund_order", idempotency_key="compensate:ik:abc")
    _, item = admission_item(comp, _contract(contracts, comp), BUDGETS, NOW_MS) or ("", {})
    assert item["exempt"] is True and item["ikey"] == "compensate:ik:abc"
    assert item["rate"] is None  # refused for a moment, it would be refused for good
    arguments = {"reason_code": "customer_requested", "queue": "billing",
                 "summary": "The customer wants a person."}  # fmt: skip
    handoff = _decide(contracts, "handoff_to_human", arguments=arguments)
    _, item = admission_item(handoff, _contract(contracts, handoff), BUDGETS, NOW_MS) or ("", {})
    assert item["exempt"] is True


def test_a_call_waiting_for_its_result_is_kept_as_long_as_a_settled_one(
    contracts: ContractSet,
) -> None:
    """handoff_to_human's contract keeps its key an hour: its record, while it waits for
    its result, lives as long as a settled one, so a result that comes late (an executor
    down for hours) still finds it instead of going to the DLQ as unknown."""
    arguments = {"reason_code": "customer_requested", "queue": "billing",
                 "summary": "The customer wants a person."}  # fmt: skip
    d = _decide(contracts, "handoff_to_human", arguments=arguments)
    assert runtime_of(_contract(contracts, d)).ttl_ms == 3_600_000
    _, item = admission_item(d, _contract(contracts, d), BUDGETS, NOW_MS) or ("", {})
    assert item["ttl"] == SETTLED_TTL_MS


def test_a_refusal_is_a_step_and_an_argument_refusal_a_repair(contracts: ContractSet) -> None:
    bad_args = _decide(contracts, arguments={"order_id": 12})
    assert bad_args.rejection and bad_args.rejection.taxonomy is TaxonomyClass.TYPE_MISMATCH
    _, item = admission_item(bad_args, None, BUDGETS, NOW_MS) or ("", {})
    assert item == {**item, "kind": "step", "repair": True, "max_repairs": 3}

    unknown_id = decide_envelope(envelope("cancel_order"), contracts, answers={})
    assert unknown_id.rejection
    assert unknown_id.rejection.taxonomy is TaxonomyClass.SEMANTIC_INVALIDITY
    _, item = admission_item(unknown_id, None, BUDGETS, NOW_MS) or ("", {})
    assert item["repair"] is True

    other = decide_envelope(
        {**envelope("lookup_order"), "tool": {"name": "drop_tables"}}, contracts
    )
    _, item = admission_item(other, None, BUDGETS, NOW_MS) or ("", {})
    assert item["repair"] is True  # an unknown tool is repaired by picking another

    secret = _decide(contracts, "search_kb", arguments={"query": "sk-live-" + "a1B2" * 8})
    assert secret.rejection and secret.rejection.taxonomy is TaxonomyClass.POLICY_VIOLATION
    _, item = admission_item(secret, None, BUDGETS, NOW_MS) or ("", {})
    assert item["kind"] == "step" and item["repair"] is False


def test_nothing_is_counted_without_a_verified_principal(contracts: ContractSet) -> None:
    d = _decide(contracts)
    d.principal = None
    assert admission_item(d, _contract(contracts, d), BUDGETS, NOW_MS) is None
    broken = decide_envelope({"proposal_id": "x"}, contracts)
    assert admission_item(broken, None, BUDGETS, NOW_MS) is None


@pytest.mark.parametrize(
    ("why", "code", "handoff"),
    [
        ("step_cap", "step_cap", True),
        ("class_budget", "class_budget", False),
        ("cost_cap", "run_cost_cap", False),
        ("day_cost_cap", "tenant_day_cost_cap", False),
        ("loop", "repeated_call", False),
        ("repair_loop", "repair_loop", True),
        ("repair_cap", "repair_cap", True),
    ],
)
def test_budget_refusals(contracts: ContractSet, why: str, code: str, handoff: bool) -> None:
    d = _decide(contracts)
    out = apply_verdict(d, {"ok": False, "why": why}, BUDGETS, _contract(contracts, d))
    assert out.outcome is Outcome.REJECTED and out.call is None and out.gate is Gate.BUDGET
    assert out.rejection and out.rejection.taxonomy is TaxonomyClass.BUDGET_EXHAUSTED
    assert [e.code for e in out.rejection.errors] == [code]
    assert out.rejection.allowed_tools == (("handoff_to_human",) if handoff else ())
    if why == "loop":
        assert "change the arguments or use another tool" in out.rejection.next_action


def test_a_repair_loop_keeps_the_original_errors_first(contracts: ContractSet) -> None:
    d = _decide(contracts, arguments={"order_id": 12})
    out = apply_verdict(d, {"ok": False, "why": "repair_loop"}, BUDGETS, None)
    codes = [e.code for e in out.rejection.errors]  # type: ignore[union-attr]
    assert codes[-1] == "repair_loop" and len(codes) >= 2
    assert "handoff_to_human" in out.rejection.next_action  # type: ignore[union-attr]


def test_rate_limits_and_conflicts_carry_a_retry_after(contracts: ContractSet) -> None:
    d = _decide(contracts)
    out = apply_verdict(d, {"ok": False, "why": "rate_limited", "retry_after_ms": 1500},
                        BUDGETS, _contract(contracts, d))  # fmt: skip
    assert out.rejection and out.rejection.taxonomy is TaxonomyClass.RATE_LIMITED
    assert out.retry_after_ms == 1500 and "1.5 s" in out.rejection.next_action
    d = _decide(contracts)
    out = apply_verdict(d, {"ok": False, "why": "in_flight", "retry_after_ms": 8000}, BUDGETS, None)
    assert out.rejection and out.rejection.taxonomy is TaxonomyClass.IDEMPOTENCY_CONFLICT
    assert out.gate is Gate.IDEMPOTENCY and out.retry_after_ms == 8000
    d = _decide(contracts)
    out = apply_verdict(d, {"ok": False, "why": "signature_mismatch"}, BUDGETS, None)
    assert out.rejection and out.rejection.taxonomy is TaxonomyClass.SIGNATURE_MISMATCH
    assert out.call is None


def test_a_call_voided_after_a_defect_is_refused_on_replay(contracts: ContractSet) -> None:
    """Its record failed alone once (see Processor._void): decided again, it does not go."""
    d = _decide(contracts)
    out = apply_verdict(d, {"ok": False, "why": "voided", "retry_after_ms": 0}, BUDGETS, None)
    assert out.outcome is Outcome.REJECTED and out.call is None
    assert out.rejection and out.rejection.taxonomy is TaxonomyClass.UNKNOWN_ERROR
    assert out.gate is Gate.INTERNAL
    assert [e.code for e in out.rejection.errors] == ["internal_error"]
    assert "hand off to a human" in out.rejection.next_action


def test_an_admitted_call_keeps_its_route_and_takes_its_attempt(contracts: ContractSet) -> None:
    d = _decide(contracts)
    out = apply_verdict(d, {"ok": True, "attempt": 3}, BUDGETS, _contract(contracts, d))
    assert out.outcome is Outcome.ROUTED and out.call is not None and out.call.attempt == 3


def test_a_hit_answers_with_the_cached_result(contracts: ContractSet) -> None:
    cached = {"class": "SUCCESS", "data": '{"status":"shipped"}', "attempt": 2}
    d = cached_answer(_decide(contracts), {"cached": orjson.dumps(cached).decode()})
    assert d.outcome is Outcome.SETTLED and d.call is None and d.rejection is None
    assert d.final and d.final.completed and d.final.idempotency_hit and d.final.attempt == 2
    error = {"field": None, "message": "shipped", "code": "order_shipped"}
    failed = {"class": "STALE_STATE", "data": None, "next_action": "Refresh.", "errors": [error]}
    d = cached_answer(_decide(contracts), {"cached": orjson.dumps(failed).decode()})
    assert d.final and not d.final.completed
    assert d.rejection and d.rejection.taxonomy is TaxonomyClass.STALE_STATE


def test_a_hit_on_a_call_awaiting_its_compensation_says_what_the_compensation_did(
    contracts: ContractSet,
) -> None:
    """The answer cached when the call failed after a committed step says to wait for
    the compensating call; a retry afterwards is told how that call ended."""
    error = {"field": None, "message": "card charged, receipt failed", "code": "failed"}
    wait = "refund_order has been proposed for you; wait for its result."
    waiting = {"class": "COMPENSATION_REQUIRED", "data": None, "errors": [error],
               "next_action": wait}  # fmt: skip
    blob = orjson.dumps(waiting).decode()
    pending = cached_answer(_decide(contracts), {"cached": blob, "state": "FAILED_FINAL"})
    assert pending.rejection and pending.rejection.next_action == waiting["next_action"]
    done = cached_answer(_decide(contracts), {"cached": blob, "state": "COMPENSATED"})
    assert done.rejection and done.rejection.taxonomy is TaxonomyClass.COMPENSATION_REQUIRED
    assert "compensating call completed" in done.rejection.next_action
    failed = cached_answer(_decide(contracts), {"cached": blob, "state": "COMPENSATION_FAILED"})
    assert failed.rejection and failed.rejection.taxonomy is TaxonomyClass.COMPENSATION_FAILED
    assert failed.rejection.allowed_tools == ("handoff_to_human",)
    assert [e.code for e in failed.rejection.errors] == ["failed", "compensation_failed"]
    assert failed.final and failed.final.idempotency_hit and not failed.final.completed


def test_contract_runtime_is_read_once_per_version(contracts: ContractSet) -> None:
    c = contracts.versions("refund_order")[0]
    assert runtime_of(c) is runtime_of(c)
    assert runtime_of(c).cost == 0.05 and runtime_of(c).ttl_ms == 604_800_000


def test_budgets_are_data_with_per_tenant_overrides() -> None:
    policy = parse_policy({
        "budgets": {
            "steps": 20, "classes": {"critical": 1}, "day_cost": None,
            "tenants": {"acme": {"classes": {"write": 9}, "rate_limit_scale": 10}},
        },
    })  # fmt: skip
    base, acme = policy.budgets_for("other"), policy.budgets_for("acme")
    assert base.steps == 20 and base.classes["critical"] == 1 and base.day_cost is None
    assert base.classes["read"] == 30 and base.rate_limit_scale == 1.0
    assert acme.steps == 20 and acme.classes["critical"] == 1 and acme.classes["write"] == 9
    assert acme.rate_limit_scale == 10


@pytest.mark.parametrize(
    "budgets",
    [
        {"steps": -1},
        {"classes": {"gold": 3}},
        {"classes": {"read": "many"}},
        {"run_cost": True},
        {"financial_tools": "refund_order"},
        {"speed": 3},
        {"run_cost": float("inf")},  # YAML's .inf: null in the script's JSON
        {"run_cost": float("nan")},
        {"day_cost": float("inf")},
        {"rate_limit_scale": float("inf")},
        {"run_cost": 10**400},
        {"steps": 2**64},  # past what the script's JSON carries
        {"in_flight_grace_ms": 10**30},
    ],
)
def test_unusable_budgets_are_refused(budgets: dict[str, Any]) -> None:
    with pytest.raises(PolicyError):
        parse_policy({"budgets": budgets})


def test_the_shipped_policy_grants_what_its_comments_say() -> None:
    from processor.policy import load_policy
    from tests.unit.helpers import ROOT

    b = load_policy(ROOT / "policy" / "policy.yaml").budgets
    assert (b.steps, b.repeats, b.repairs) == (12, 2, 3)
    assert b.classes == {"read": 30, "write": 5, "external": 3, "financial": 1, "critical": 1}


def test_a_state_refusal_routes_nothing_but_keeps_its_key(contracts: ContractSet) -> None:
    env = envelope("cancel_order")
    refs = existing_references(env, contracts)
    answers = {k: RefEntry(k[0], "shipped", "owner-1", {}) for k in refs}
    d = decide_envelope(env, contracts, answers=answers)
    assert d.rejection and d.rejection.taxonomy is TaxonomyClass.STALE_STATE
    assert d.call is None and d.idempotency is not None
    routed = decide_envelope(env, contracts)
    assert routed.call is not None
    assert d.idempotency == (routed.call.idempotency_key, routed.call.payload_hash)
    _, item = admission_item(d, None, BUDGETS, NOW_MS) or ("", {})
    assert (item["kind"], item["ikey"], item["hash"]) == ("step", *d.idempotency)


@pytest.mark.parametrize("attempt", [1, 3])
def test_a_parked_call_and_its_requests_end_name_the_same_request(
    contracts: ContractSet, attempt: int
) -> None:
    """The key's record names the request a parked call waits for by the id it was first
    parked under and its attempt (a later attempt's id is reissued from both, after
    admission decides the attempt): its parked entry, and so its request's end and its
    release, name it alike, whatever attempt it is."""
    d = _decide(contracts, "refund_order")
    assert d.outcome is Outcome.PARKED and d.approval_request is not None
    first = d.approval_request["request_id"]
    _, item = admission_item(d, _contract(contracts, d), BUDGETS, NOW_MS) or ("", {})
    assert item["rid"] == first
    apply_verdict(d, {"ok": True, "attempt": attempt}, BUDGETS, _contract(contracts, d))
    assert (d.approval_request["request_id"] == first) is (attempt == 1)
    entry = {**parked_entry(d), "state": "released", "approvers": []}
    _, lapse = lapse_item(entry, "tool.approvals/0/1", NOW_MS)
    assert (lapse["rid"], lapse["attempt"]) == (first, attempt)
    src = SourceRecord("tool.approvals", 0, 1, b"r", b"{}", NOW_MS)
    released = outcome_decision(ApprovalInput(src, "decision", "tenant-1", "x", {}),
                                OpResult("released", None, entry), NOW_MS)  # fmt: skip
    assert released is not None
    _, release = release_item(released)
    assert (release["rid"], release["attempt"]) == (first, attempt)
    # Parked by an earlier version, which kept neither: matched by its deadline, as it was.
    old = {k: v for k, v in entry.items() if k not in ("first_request_id", "attempt")}
    assert lapse_item(old, "tool.approvals/0/2", NOW_MS)[1]["rid"] == ""


def test_a_call_and_its_release_name_the_version_they_are_routed_as(
    contracts: ContractSet,
) -> None:
    """The key's record keeps the version its call goes as, parked or released: its result
    is held to it (see admission.lua, settle)."""
    d = _decide(contracts, "refund_order")
    assert d.outcome is Outcome.PARKED and d.call is not None
    _, item = admission_item(d, _contract(contracts, d), BUDGETS, NOW_MS) or ("", {})
    assert item["version"] == d.call.tool_version == d.contract_version
    apply_verdict(d, {"ok": True, "attempt": 1}, BUDGETS, _contract(contracts, d))
    entry = {**parked_entry(d), "state": "released", "approvers": []}
    src = SourceRecord("tool.approvals", 0, 1, b"r", b"{}", NOW_MS)
    released = outcome_decision(ApprovalInput(src, "decision", "tenant-1", "x", {}),
                                OpResult("released", None, entry), NOW_MS)  # fmt: skip
    assert released is not None
    _, release = release_item(released)
    assert release["version"] == d.call.tool_version


def test_a_parked_call_refused_by_its_budget_no_longer_says_a_request_is_waiting(
    contracts: ContractSet,
) -> None:
    """A parked call's only error is its parking notice; refused by admission, no request
    is written for it, so the refusal must not tell the model one is waiting."""
    d = _decide(contracts, "refund_order")
    assert d.outcome is Outcome.PARKED and d.rejection is not None
    assert [e.code for e in d.rejection.errors] == ["approval_required"]
    refused = apply_verdict(d, {"ok": False, "why": "class_budget"}, BUDGETS,
                            _contract(contracts, d))  # fmt: skip
    assert refused.outcome is Outcome.REJECTED and refused.approval_request is None
    assert refused.rejection is not None
    assert [e.code for e in refused.rejection.errors] == ["class_budget"]


def test_a_refused_proposal_refused_again_by_admission_keeps_what_was_wrong(
    contracts: ContractSet,
) -> None:
    """A schema refusal that admission stops as a repair loop still tells the model which
    field was wrong: the repair it needs is the same."""
    d = _decide(contracts, "search_kb", arguments={"query": "q", "limit": "10"})
    assert d.outcome is Outcome.REJECTED and d.rejection is not None
    first = [e.code for e in d.rejection.errors]
    refused = apply_verdict(d, {"ok": False, "why": "repair_loop"}, BUDGETS,
                            _contract(contracts, d))  # fmt: skip
    assert refused.rejection is not None
    assert refused.rejection.taxonomy is TaxonomyClass.BUDGET_EXHAUSTED
    assert [e.code for e in refused.rejection.errors] == [*first, "repair_loop"]
