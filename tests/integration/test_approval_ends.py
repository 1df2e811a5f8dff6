"""What the end of an approval request answers, through the processor's own paths
(``Processor._end_requests`` and ``_admit_releases``) against a real redis-server and a
real Redis Cluster: a parked proposal gets its final observation once, whichever way its
request ends, and none where it was answered already; and a result for a call whose
request ended without it going (``Processor._admit``) settles nothing. And a failure held
for a later attempt that never ran goes back on tool.results (``Processor._redelivered``)
only as a record the processor can write."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import orjson
import pytest
from prometheus_client import CollectorRegistry

from processor.app import REDELIVERY_OF, Processor
from processor.approval_flow import EXPIRY_CHECK, ApprovalInput, outcome_decision
from processor.codec.records import encode_result
from processor.config import Settings
from processor.metrics import Metrics
from processor.model import Decision, Gate, Outcome, SourceRecord, TaxonomyClass
from processor.results import ResultInput, parse_result
from processor.state.admission import withdraw_item
from processor.state.approvals import OpResult
from tests.integration.test_admission import NOW, TENANT, _written_before, call
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


def cancelled_then_failed(
    p: Processor, c: dict[str, Any], message: str = "cancelled, but nobody was told"
) -> tuple[Decision, SourceRecord]:
    """What the processor makes of a result for call ``c``'s first attempt, as an executor
    would report it had the call run: it cancelled the order, then failed (with
    ``message``). The decision, and the result's record."""
    datum = {
        "result_id": uuid.uuid4().hex, "call_id": c["call"], "proposal_id": c["call"],
        "run_id": c["run"], "tenant_id": TENANT, "trace_id": "t-1",
        "tool_name": "cancel_order", "tool_version": "1.0.0",
        "side_effect_class": "HIGH_RISK_EXTERNAL", "idempotency_key": c["ikey"],
        "payload_hash": c["hash"], "attempt": 1, "outcome": "FAILED", "retryable": False,
        "error_code": "notify_failed", "error_message": message,
        "taxonomy_class": None, "committed_steps": ["order_cancelled"], "data": None,
        "compensation_arguments": orjson.dumps({"order_id": "WO-1"}).decode(),
        "started_at": NOW - 20, "finished_at": NOW, "executor_id": "exec-1",
        "contract_set": None,
    }  # fmt: skip
    src = SourceRecord("tool.results", 0, next(_offsets), b"run-1", encode_result(datum), NOW)
    res = parse_result(src, p.contracts)
    assert isinstance(res, ResultInput), res
    [d] = p._admit([res], NOW)
    assert isinstance(d, Decision)
    return d, src


def _result(p: Processor, parked: dict[str, Any]) -> Decision:
    return cancelled_then_failed(p, parked)[0]


def _ended(p: Processor, parked: dict[str, Any], how: str) -> None:
    """End ``parked``'s request without its call going, through the processor's paths:
    declined ("rejected"), ended as a request an earlier version parked, which names no
    request id ("rejected_as_parked_before"), or released and routed, then, its batch
    aborted, refused at its recheck on the replay ("unreleased")."""
    src = SourceRecord("tool.approvals", 0, next(_offsets), b"run-1", b"{}", NOW)
    item = ApprovalInput(src, "decision", TENANT, parked["rid"], {})
    out: list[Decision | None] = [None]
    if how == "unreleased":
        released = OpResult("released", None, _entry(parked, "released"))
        d = outcome_decision(item, released, NOW)
        assert d is not None
        decisions = [d]
        p._admit_releases(decisions, NOW)
        assert decisions[0].outcome is Outcome.ROUTED, _codes(decisions[0])
        p._end_requests([], [(0, item, released)], out, NOW)  # (at the release's position)
        return
    entry = _entry(parked, "rejected")
    if how == "rejected_as_parked_before":
        del entry["first_request_id"], entry["attempt"]
    p._end_requests([(0, item, OpResult("rejected", None, entry))], [], out, NOW)
    assert out[0] is not None and out[0].outcome is Outcome.REJECTED, out[0]


@pytest.mark.parametrize("before", [False, True], ids=["current", "written_before"])
@pytest.mark.parametrize("how", ["rejected", "rejected_as_parked_before", "unreleased"])
def test_a_result_for_a_call_whose_request_ended_without_it_is_dead_lettered(
    processor: Processor, how: str, before: bool
) -> None:
    """The call never ran: declined, or ended as a request an earlier version parked (its
    end named by its deadline alone), or released, its batch aborted and the release refused
    at its recheck on the replay (undone). A result that says it ran and committed a step
    settles nothing, and asks for no compensation: result_unrouted_call. So too where the
    record was left by the version before (``before``), which marked none of these."""
    parked = call(park=True, rid="req_parked", deadline=NOW + 600_000, tool="cancel_order",
                  **LIMITS)[1]  # fmt: skip
    assert processor.admission.apply([(TENANT, parked)]) == [{"ok": True, "attempt": 1}]
    _ended(processor, parked, how)
    if before:
        _written_before(processor.admission, parked["ikey"], "u")
    d = _result(processor, parked)
    assert (d.outcome, d.dlq_reason) == (Outcome.DEAD_LETTER, "result_unrouted_call")
    record = processor.admission.record(TENANT, parked["ikey"], NOW)
    assert (record["state"], record["awaiting"]) == ("PENDING", "0")
    assert "compensation" not in record


def test_a_result_for_a_call_its_approvers_released_settles_it(processor: Processor) -> None:
    """Released, the call ran: its result settles it, on a record the version before left
    too (no mark either way)."""
    parked = call(park=True, rid="req_parked", deadline=NOW + 600_000, tool="cancel_order",
                  **LIMITS)[1]  # fmt: skip
    processor.admission.apply([(TENANT, parked)])
    assert _answer(processor, parked, "release").outcome is Outcome.ROUTED
    _written_before(processor.admission, parked["ikey"], "u")
    d = _result(processor, parked)
    assert d.outcome is Outcome.SETTLED, d.dlq_reason
    assert processor.admission.record(TENANT, parked["ikey"], NOW)["state"] == "FAILED_FINAL"


def test_a_release_voided_when_its_record_failed_alone_answers_its_replay_alike(
    processor: Processor,
) -> None:
    """Released, then its approval record failed alone on a defect: the release was voided
    (see Processor._void) and its proposal told of the internal error. The batch's
    transaction then aborted, and its replay decides the record without the defect: the
    proposal is told the same, not that something changed and it may simply propose again
    (the one answer that commits must be the one the first decision gave), and nothing
    runs."""
    parked = call(park=True, rid="req_parked", deadline=NOW + 600_000, tool="cancel_order",
                  **LIMITS)[1]  # fmt: skip
    processor.admission.apply([(TENANT, parked)])
    src = SourceRecord("tool.approvals", 0, next(_offsets), b"run-1", b"{}", NOW)
    item = ApprovalInput(src, "decision", TENANT, parked["rid"], {})
    result = OpResult("released", None, _entry(parked, "released"))
    for attempt in ("first", "replay"):
        d = outcome_decision(item, result, NOW)
        assert d is not None
        decisions = [d]
        processor._admitted = []
        processor._admit_releases(decisions, NOW)
        if attempt == "first":
            assert decisions[0].outcome is Outcome.ROUTED, _codes(decisions[0])
            assert processor._void() is True
    d = decisions[0]
    assert (d.outcome, d.gate, d.taxonomy) == (
        Outcome.REJECTED, Gate.INTERNAL, TaxonomyClass.UNKNOWN_ERROR
    )  # fmt: skip
    assert _codes(d) == ["internal_error"] and d.call is None
    assert processor.admission.record(TENANT, parked["ikey"], NOW)["state"] == "FAILED_RETRYABLE"


@pytest.mark.parametrize("size", ["fits", "too_large"])
def test_a_held_failure_is_delivered_again_only_as_a_record_the_processor_can_write(
    processor: Processor, size: str
) -> None:
    """The first attempt's failure after a committed step is held for the second, which is
    then given back without running (withdrawn on a replay). Its record goes back on
    tool.results as it came. An executor may write a larger record than the processor's
    producer takes (its own message.max.bytes, the topic's): written back, it would fail
    every transaction that carried it, and the batch would be aborted and decided again
    for ever. Such a failure is held as before, with no record kept to deliver again."""
    p = processor
    first = call(deadline=NOW + 8000, tool="cancel_order", **LIMITS)[1]
    second = call(ikey=first["ikey"], call=first["call"], now=NOW + 9001,
                  deadline=NOW + 600_000, tool="cancel_order", **LIMITS)[1]  # fmt: skip
    assert p.admission.apply([(TENANT, first)]) == [{"ok": True, "attempt": 1}]
    assert p.admission.apply([(TENANT, second)]) == [{"ok": True, "attempt": 2}]
    message = "cancelled, but nobody was told; " * (1 if size == "fits" else 31_200)
    held, src = cancelled_then_failed(p, first, message)
    assert (held.outcome, held.dlq_reason) == (Outcome.DEAD_LETTER, "result_held_for_later_attempt")
    withdrawn = withdraw_item(TENANT, second["pos"], second["run"], NOW + 10_000)
    assert p.admission.apply([withdrawn]) == [{"status": "withdrawn"}]
    again = p._redelivered()
    assert all(len(key or b"") + len(v) <= p._max_message_bytes for _, key, v, _ in again)
    if size == "fits":
        of = f"{src.topic}/{src.partition}/{src.offset}".encode()
        assert again == [("tool.results", src.key, src.value, [(REDELIVERY_OF, of)])]
    else:
        assert len(src.value or b"") > p._max_message_bytes
        assert again == []
