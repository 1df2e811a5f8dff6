"""What the end of an approval request answers (``Processor._end_requests``), and what a
released call tells admission (``release_item``), with admission stubbed: no Redis."""

from __future__ import annotations

from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from processor.app import Processor
from processor.approval_flow import EXPIRY_CHECK, ApprovalInput, outcome_decision
from processor.config import Settings
from processor.gates.budget import release_item
from processor.metrics import Metrics
from processor.model import Decision, Gate, Outcome, SourceRecord
from processor.state.approvals import OpResult
from tests.unit.helpers import CONTRACTS_DIR, NOW_MS

EXPIRES = NOW_MS + 600_000


def _entry(state: str) -> dict[str, Any]:
    return {"tenant_id": "acme", "request_id": "req-1", "proposal_id": "p-1", "run_id": "run-1",
            "trace_id": "t-1", "traceparent": None, "tool_name": "cancel_order",
            "tool_version": "1.0.0", "side_effect_class": "HIGH_RISK_EXTERNAL",
            "idempotency_key": "ik-1", "payload_hash": "h1", "arguments": "{}",
            "expires_at": EXPIRES, "timeout_ms": 8000, "state": state,
            "approvers": [{"id": "ops-1", "approval_id": "a-1"}], "rejected_by": "ops-2",
            "reason": "no"}  # fmt: skip


def _input(kind: str) -> ApprovalInput:
    src = SourceRecord("tool.approvals", 0, 7, b"run-1", b"{}", NOW_MS)
    return ApprovalInput(src, kind, "acme", "req-1", None if kind == EXPIRY_CHECK else {})


def _ended(monkeypatch: pytest.MonkeyPatch, kind: str, lapse: str) -> Decision:
    settings = Settings(contracts_dir=CONTRACTS_DIR, policy_file=None, metrics_port=0,
                        redis_url="redis://127.0.0.1:1/0")  # fmt: skip
    p = Processor(settings, metrics=Metrics(CollectorRegistry()))
    sent: list[Any] = []

    def apply(items: list[Any], forget: Any = None) -> list[dict[str, Any]]:
        sent.extend(items)
        return [{"status": lapse} for _ in items]

    monkeypatch.setattr(p.admission, "apply", apply)
    state = "expired" if kind == EXPIRY_CHECK else "rejected"
    out: list[Decision | None] = [None]
    p._end_requests([(0, _input(kind), OpResult(state, None, _entry(state)))], [], out, NOW_MS)
    [(_, item)] = sent
    assert (item["kind"], item["deadline"]) == ("lapse", EXPIRES)
    assert out[0] is not None
    return out[0]


@pytest.mark.parametrize(
    ("lapse", "reason"),
    [("moved_on", "approval_request_superseded"), ("given_back", "approval_request_withdrawn")],
)
def test_a_rejection_of_a_call_that_did_not_wait_for_it_answers_no_proposal(
    monkeypatch: pytest.MonkeyPatch, lapse: str, reason: str
) -> None:
    """The call went ahead with approvals attached ("moved_on"), or never ran and its
    proposal was answered otherwise, its position decided again after its batch aborted
    ("given_back"): the rejection goes to the DLQ, saying which, and no observation tells
    the agent its call was declined."""
    d = _ended(monkeypatch, "decision", lapse)
    assert (d.outcome, d.dlq_reason) == (Outcome.DEAD_LETTER, reason)
    expired = _ended(monkeypatch, EXPIRY_CHECK, lapse)
    assert expired.outcome is Outcome.IGNORED


def test_a_rejection_of_a_parked_call_is_its_observation(monkeypatch: pytest.MonkeyPatch) -> None:
    d = _ended(monkeypatch, "decision", "lapsed")
    assert (d.outcome, d.proposal and d.proposal.proposal_id) == (Outcome.REJECTED, "p-1")


def test_a_released_call_names_the_deadline_its_request_parked_it_until() -> None:
    """A release refused as superseded ends the request for the resubmission that took
    the key over only if that resubmission is this request's (see admission.lua, release)."""
    d = outcome_decision(_input("decision"), OpResult("released", None, _entry("released")),
                         NOW_MS)  # fmt: skip
    assert d is not None and d.outcome is Outcome.ROUTED
    tenant, item = release_item(d)
    assert (tenant, item["kind"], item["parked_until"]) == ("acme", "release", EXPIRES)
    assert item["deadline"] == NOW_MS + 8000


@pytest.mark.parametrize(
    ("verdict", "expected"),
    [
        ({"ok": True, "attempt": 1}, ("ROUTED", None)),
        # The key went ahead as another proposal: this one is told so (see _end_requests).
        ({"ok": False, "why": "superseded", "retry_after_ms": 0},
         ("REJECTED", "approval_request_superseded")),
        # It went ahead as this very proposal, sent again: answered by that, not twice.
        ({"ok": False, "why": "moved_on", "retry_after_ms": 0},
         ("DEAD_LETTER", "approval_request_superseded")),
        ({"ok": False, "why": "replay_changed", "retry_after_ms": 0},
         ("REJECTED", "replay_changed")),
        # A verdict of another kind of item at the release's position: never a go-ahead.
        ({"status": "lapsed"}, ("REJECTED", "replay_changed")),
        ({"ok": False, "why": "given_back", "retry_after_ms": 0},
         ("DEAD_LETTER", "approval_request_withdrawn")),
    ],
)  # fmt: skip
def test_a_released_call_goes_only_on_admissions_go_ahead(
    monkeypatch: pytest.MonkeyPatch, verdict: dict[str, Any], expected: tuple[str, str | None]
) -> None:
    settings = Settings(contracts_dir=CONTRACTS_DIR, policy_file=None, metrics_port=0,
                        redis_url="redis://127.0.0.1:1/0")  # fmt: skip
    p = Processor(settings, metrics=Metrics(CollectorRegistry()))
    monkeypatch.setattr(p.admission, "apply", lambda items, forget=None: [verdict for _ in items])
    d = outcome_decision(_input("decision"), OpResult("released", None, _entry("released")),
                         NOW_MS)  # fmt: skip
    assert d is not None
    decisions = [d]
    p._admit_releases(decisions, NOW_MS)
    [d] = decisions
    codes = [e.code for e in d.rejection.errors] if d.rejection else [d.dlq_reason]
    assert (d.outcome.value, codes[0] if codes else None) == expected, (d.outcome, codes)


@pytest.mark.parametrize(
    ("lapse", "reason"),
    [("lapsed", None), ("unchanged", None), ("moved_on", "approval_request_superseded"),
     ("given_back", "approval_request_withdrawn")],
)  # fmt: skip
def test_a_call_refused_at_release_keeps_its_refusal_unless_it_was_answered_otherwise(
    monkeypatch: pytest.MonkeyPatch, lapse: str, reason: str | None
) -> None:
    """Released, then refused at its recheck: the refusal answers the proposal, unless the
    call went ahead meanwhile with approvals attached, or was given back and answered on
    a replay: then a second answer would contradict the first, and the release lands on
    the DLQ as a rejection would."""
    settings = Settings(contracts_dir=CONTRACTS_DIR, policy_file=None, metrics_port=0,
                        redis_url="redis://127.0.0.1:1/0")  # fmt: skip
    p = Processor(settings, metrics=Metrics(CollectorRegistry()))
    monkeypatch.setattr(p.admission, "apply",
                        lambda items, forget=None: [{"status": lapse} for _ in items])  # fmt: skip
    refusal = Decision(_input("decision").src, Outcome.REJECTED, Gate.APPROVAL, None)
    out: list[Decision | None] = [refusal]
    released = OpResult("released", None, _entry("released"))
    p._end_requests([], [(0, _input("decision"), released)], out, NOW_MS)
    if reason is None:
        assert out[0] is refusal
    else:
        assert out[0] is not None and (out[0].outcome, out[0].dlq_reason) == (
            Outcome.DEAD_LETTER,
            reason,
        )
