"""What the end of an approval request answers, through the processor's own paths
(``Processor._end_requests`` and ``_admit_releases``) against a real redis-server and a
real Redis Cluster: a parked proposal gets its final observation once, whichever way its
request ends, and none where it was answered already."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from processor.app import Processor
from processor.approval_flow import EXPIRY_CHECK, ApprovalInput, outcome_decision
from processor.config import Settings
from processor.metrics import Metrics
from processor.model import Decision, Outcome, SourceRecord
from processor.state.approvals import OpResult
from tests.integration.test_admission import NOW, TENANT, call
from tests.unit.helpers import CONTRACTS_DIR

pytestmark = pytest.mark.integration

LIMITS = {"sig": "cancel", "group": "write", "class_budget": 5}


@pytest.fixture
def processor(redis_backend: str) -> Iterator[Processor]:
    settings = Settings(contracts_dir=CONTRACTS_DIR, policy_file=None, metrics_port=0,
                        redis_url=redis_backend,
                        redis_namespace=f"ends-{uuid.uuid4().hex[:8]}")  # fmt: skip
    yield Processor(settings, metrics=Metrics(CollectorRegistry()))


_offsets = iter(range(10**9))


def _entry(parked: dict[str, Any], state: str, attempt: int = 1) -> dict[str, Any]:
    """The parked entry the approval store returns for ``parked``'s request."""
    return {"tenant_id": TENANT, "request_id": parked["rid"], "proposal_id": parked["call"],
            "run_id": parked["run"], "trace_id": "t-1", "traceparent": None,
            "tool_name": "cancel_order", "tool_version": "1.0.0",
            "side_effect_class": "HIGH_RISK_EXTERNAL", "idempotency_key": parked["ikey"],
            "payload_hash": parked["hash"], "arguments": "{}",
            "expires_at": parked["deadline"], "timeout_ms": 8000, "state": state,
            "approvers": [{"id": "ops-1", "approval_id": "a-1"}], "rejected_by": "ops-2",
            "reason": "no", "first_request_id": parked["rid"], "attempt": attempt}  # fmt: skip


def _answer(p: Processor, parked: dict[str, Any], end: str) -> Decision:
    """What the processor makes of ``end`` (a rejection, an expiry check or a release) of
    ``parked``'s request."""
    src = SourceRecord("tool.approvals", 0, next(_offsets), b"run-1", b"{}", NOW)
    kind = EXPIRY_CHECK if end == "expiry" else "decision"
    item = ApprovalInput(src, kind, TENANT, parked["rid"], None if end == "expiry" else {})
    state = {"rejection": "rejected", "expiry": "expired", "release": "released"}[end]
    result = OpResult(state, None, _entry(parked, state))
    if end == "release":
        d = outcome_decision(item, result, NOW)
        assert d is not None
        decisions = [d]
        p._admit_releases(decisions, NOW)
        return decisions[0]
    out: list[Decision | None] = [None]
    p._end_requests([(0, item, result)], [], out, NOW)
    assert out[0] is not None
    return out[0]


def _codes(d: Decision) -> list[str]:
    return [e.code for e in d.rejection.errors] if d.rejection else []


ENDS = ["rejection", "expiry", "release"]


@pytest.mark.parametrize("end", ENDS)
def test_a_request_whose_key_went_ahead_as_another_proposal_answers_its_own_once(
    processor: Processor, end: str
) -> None:
    """Parked, then resubmitted with approvals attached as another proposal, which took the
    key over and runs. The parked proposal was told it waits and will hear either way: its
    request's end, whichever it is, tells it that its call went ahead as another proposal
    (one answer for all three: a rejection used to land on the DLQ, leaving it unanswered,
    and a release answered it "in flight, retry now")."""
    parked = call(park=True, rid="req_parked", deadline=NOW + 600_000, **LIMITS)[1]
    resubmitted = call(ikey=parked["ikey"], now=NOW + 1000, **LIMITS)
    assert processor.admission.apply([(TENANT, parked), resubmitted]) == [
        {"ok": True, "attempt": 1},
        {"ok": True, "attempt": 1},
    ]
    d = _answer(processor, parked, end)
    assert d.outcome is Outcome.REJECTED and d.proposal is not None
    assert d.proposal.proposal_id == parked["call"]
    assert "approval_request_superseded" in _codes(d), _codes(d)


@pytest.mark.parametrize("end", ENDS)
def test_a_request_whose_own_proposal_went_ahead_answers_nothing_twice(
    processor: Processor, end: str
) -> None:
    """The parked proposal itself, sent again with approvals attached, took the key over:
    its own observations answered it. Its request's end answers it no second time."""
    parked = call(park=True, rid="req_parked", deadline=NOW + 600_000, **LIMITS)[1]
    again = call(ikey=parked["ikey"], call=parked["call"], now=NOW + 1000, **LIMITS)
    processor.admission.apply([(TENANT, parked), again])
    d = _answer(processor, parked, end)
    expected = Outcome.IGNORED if end == "expiry" else Outcome.DEAD_LETTER
    assert d.outcome is expected, (d.outcome, _codes(d))
    if end != "expiry":
        assert d.dlq_reason == "approval_request_superseded"


@pytest.mark.parametrize("end", ["rejection", "expiry"])
def test_a_request_that_lapsed_unseen_answers_its_proposal_when_it_ends(
    processor: Processor, end: str
) -> None:
    """Parked; its expiry check late, another run's call took the key past the request's
    expiry and the grace. The parked proposal has had no final answer: its request's end
    gives it, once (it was answered "moved on" and left unanswered)."""
    parked = call(park=True, rid="req_parked", deadline=NOW + 60_000, **LIMITS)[1]
    other = call(ikey=parked["ikey"], run="run-2", now=NOW + 62_000, **LIMITS)
    processor.admission.apply([(TENANT, parked), other])
    d = _answer(processor, parked, end)
    assert d.outcome is Outcome.REJECTED and d.proposal is not None
    assert d.proposal.proposal_id == parked["call"]
    code = "approval_rejected" if end == "rejection" else "approval_expired"
    assert _codes(d) == [code]


@pytest.mark.parametrize("end", ENDS)
def test_a_request_whose_park_was_given_back_answers_nothing_of_a_later_park(
    processor: Processor, end: str
) -> None:
    """Parked, then given back (its batch aborted, its position decided again as something
    else, which answered it); the key is parked again under another request. The first
    request's end answers nothing a second time and leaves the second park waiting."""
    parked = call(park=True, rid="req_first", deadline=NOW + 600_000, **LIMITS)[1]
    processor.admission.apply([(TENANT, parked)])
    changed = {"kind": "step", "pos": parked["pos"], "now": NOW, "run": "run-1", "sig": "x",
               "steps": 1000, "repair": False, "max_repairs": 3}  # fmt: skip
    later = call(park=True, ikey=parked["ikey"], rid="req_later", now=NOW + 1000,
                 deadline=NOW + 601_000, **LIMITS)  # fmt: skip
    processor.admission.apply([(TENANT, changed)])
    assert processor.admission.apply([later]) == [{"ok": True, "attempt": 2}]
    d = _answer(processor, parked, end)
    expected = Outcome.IGNORED if end == "expiry" else Outcome.DEAD_LETTER
    assert d.outcome is expected, (d.outcome, _codes(d))
    if end != "expiry":
        assert d.dlq_reason == "approval_request_withdrawn"
    record = processor.admission.record(TENANT, parked["ikey"], NOW)
    assert (record["awaiting"], record["request"]) == ("1", "req_later")
