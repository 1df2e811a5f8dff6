"""Replay's pure parts: recorded answers read back from the processor's own records, the
comparison (the admission rule among them), grouping and totals."""

from __future__ import annotations

import dataclasses
import io
import json
from datetime import UTC, datetime, timedelta
from typing import Any

import orjson
import pytest
from rich.console import Console

from processor.codec.avro import codec
from processor.codec.records import dlq_record, encode_observation, position_id
from processor.contracts.registry import ContractSet
from processor.gates.budget import apply_verdict
from processor.model import Decision, Gate, Outcome, SourceRecord
from processor.pipeline import decide, decide_batch_at
from processor.policy import Budgets
from processor.replay import (
    DEAD_LETTER,
    Answers,
    Match,
    Recorded,
    Report,
    Verdict,
    at_record_time,
    compare,
    recorded_dead_letter,
    recorded_observation,
    render,
    replayed,
    selection,
    unknown_references,
)
from processor.results import (
    ADMITTED,
    compensation_key,
    compensation_proposal_id,
    refused_compensation,
)
from tests.unit.helpers import NOW_MS, decide_arguments, envelope, gates, record

FP = "sha256:0123456789abcdef"


def _recorded(d: Decision) -> Recorded:
    """What the processor wrote for ``d``, decoded as replay reads it."""
    return recorded_observation(codec("observation").decode(encode_observation(d, FP)))


def _report(examples: int = 3) -> Report:
    return Report(0, None, "contracts", FP, "policy.yaml", True, examples)


def _search(contracts: ContractSet, limit: Any = 10, **fields: Any) -> Decision:
    return decide_arguments(contracts, "search_kb", {"query": "return policy", "limit": limit},
                            **fields)  # fmt: skip


def test_a_decision_replayed_unchanged_is_the_same_as_its_observation(
    contracts: ContractSet,
) -> None:
    for d in (_search(contracts), _search(contracts, limit="10"), _search(contracts, limit=0)):
        recorded = _recorded(d)
        again = replayed(d, FP)
        assert recorded.verdict == again.verdict
        assert recorded.contract_set == FP and not recorded.admission
        assert compare(recorded, again.verdict) is Match.SAME
    assert _recorded(_search(contracts, limit=0)).verdict == Verdict(
        "REJECTED", "OUT_OF_BOUNDS", "schema"
    )


def test_the_replayed_decision_is_worded_as_its_observation_would_be(
    contracts: ContractSet,
) -> None:
    routed = replayed(_search(contracts), FP)
    assert routed.verdict == Verdict("ROUTED", "SUCCESS", "route")
    assert (routed.proposal_id, routed.run_id, routed.tool) == ("prop-1", "run-1", "search_kb")
    assert routed.position == ("tool.proposals", 3, 42)
    assert "wait for its result" in routed.next_action
    cancel = {"order_id": "WO-12345-A", "reason_code": "customer_request", "confirm": True}
    parked = replayed(decide_arguments(contracts, "cancel_order", cancel), FP)
    assert parked.verdict == Verdict("PENDING_APPROVAL", "CONFIRMATION_MISSING", "confirmation")


def test_a_changed_decision_is_grouped_by_tool_and_verdicts_with_capped_examples(
    contracts: ContractSet,
) -> None:
    report = _report(examples=2)
    recorded = _recorded(_search(contracts))
    for n in range(3):
        rejected = replayed(_search(contracts, limit=0, proposal_id=f"p-{n}"), FP)
        assert report.add(rejected, recorded) is Match.CHANGED
    report.add(replayed(_search(contracts), FP), recorded)
    assert (report.changed, report.counts[Match.SAME], report.replayed) == (3, 1, 4)
    [change] = report.sorted_changes()
    assert change.tool == "search_kb" and not change.compensation
    assert str(change.recorded) == "ROUTED SUCCESS @route"
    assert str(change.replayed) == "REJECTED OUT_OF_BOUNDS @schema"
    assert change.count == 3
    assert [e.proposal_id for e in change.examples] == ["p-0", "p-1"]
    assert all("limit" in e.next_action or "allowed" in e.next_action.lower()
               for e in change.examples)  # fmt: skip
    assert report.recorded_sets == {FP: 4}


def _refused_by_admission(d: Decision, why: str) -> Decision:
    return apply_verdict(d, {"ok": False, "why": why}, Budgets(), None)


@pytest.mark.parametrize("why", ["step_cap", "rate_limited", "signature_mismatch", "in_flight"])
def test_a_proposal_redis_decided_is_admission_not_replayed_whatever_the_gates_say(
    contracts: ContractSet, why: str
) -> None:
    recorded = _recorded(_refused_by_admission(_search(contracts), why))
    assert recorded.admission
    for now in (_search(contracts), _search(contracts, limit=0)):
        assert compare(recorded, replayed(now, FP).verdict) is Match.ADMISSION
    report = _report()
    report.add(replayed(_search(contracts), FP), recorded)
    assert report.changed == 0 and report.counts[Match.ADMISSION] == 1
    assert report.changes == {}


def test_a_spent_approval_is_admission_though_named_after_the_confirmation_gate(
    contracts: ContractSet,
) -> None:
    recorded = _recorded(_refused_by_admission(_search(contracts), "approval_reused"))
    assert recorded.verdict.gate == "confirmation" and recorded.admission
    assert compare(recorded, replayed(_search(contracts), FP).verdict) is Match.ADMISSION


def test_a_gate_refusal_recorded_is_compared_not_excused(contracts: ContractSet) -> None:
    """Only Redis's answers are excused: a schema refusal the replay would route is a change."""
    recorded = _recorded(_search(contracts, limit=0))
    assert not recorded.admission
    assert compare(recorded, replayed(_search(contracts), FP).verdict) is Match.CHANGED


def test_no_recorded_decision_is_neither_same_nor_changed(contracts: ContractSet) -> None:
    report = _report()
    assert report.add(replayed(_search(contracts), FP), None) is Match.UNRECORDED
    assert report.changed == 0 and report.counts[Match.SAME] == 0
    assert report.as_dict()["totals"]["no_recorded_decision"] == 1


def _dead_letter(contracts: ContractSet) -> Decision:
    d = decide(record(b"\xff not json"), gates(contracts), NOW_MS)
    assert d.outcome is Outcome.DEAD_LETTER
    return d


def test_a_dead_letter_is_matched_by_the_position_its_headers_name(
    contracts: ContractSet,
) -> None:
    d = _dead_letter(contracts)
    _, _, headers = dlq_record(b"run-1", d, 1_000_000)
    position, recorded = recorded_dead_letter(headers)
    again = replayed(d, FP)
    assert position == again.position == ("tool.proposals", 3, 42)
    assert (
        again.verdict == recorded.verdict == Verdict(DEAD_LETTER, "SYNTACTIC_PARSE_FAIL", "parse")
    )
    assert compare(recorded, again.verdict) is Match.SAME
    assert again.tool == "(dead letter)" and again.proposal_id is None


def test_a_dead_letter_recorded_for_a_proposal_now_routed_is_a_change(
    contracts: ContractSet,
) -> None:
    _, _, headers = dlq_record(b"run-1", _dead_letter(contracts), 1_000_000)
    _, recorded = recorded_dead_letter(headers)
    assert compare(recorded, replayed(_search(contracts), FP).verdict) is Match.CHANGED


@pytest.mark.parametrize(
    "headers",
    [
        [],
        [("toolsentry.source.topic", b"tool.proposals")],
        {
            "toolsentry.source.topic": "t",
            "toolsentry.source.partition": "x",
            "toolsentry.source.offset": "1",
            "toolsentry.error.reason": "r",
            "toolsentry.error.class": "c",
        },
    ],
)
def test_a_dead_letter_whose_headers_do_not_say_is_unreadable(headers: Any) -> None:
    with pytest.raises((KeyError, ValueError)):
        recorded_dead_letter(headers)


def test_a_compensation_is_labelled(contracts: ContractSet) -> None:
    d = _search(contracts, idempotency_key=compensation_key("ik:abc"))
    again = replayed(d, FP)
    assert again.compensation
    report = _report()
    report.add(again, _recorded(_search(contracts, limit=0)))
    assert report.as_dict()["changes"][0]["compensation"] is True


def test_a_hostile_tool_name_is_shown_escaped_and_clipped(contracts: ContractSet) -> None:
    d = decide_arguments(contracts, "x\x1b[31mred\nline" + "y" * 100, {})
    shown = replayed(d, FP).tool
    assert "\x1b" not in shown and "\n" not in shown and "\\u001b" in shown
    assert len(shown) == 64


def test_each_record_is_decided_at_its_own_time(contracts: ContractSet) -> None:
    """A version sunsetted since a proposal was made is judged as it stood then."""
    c = contracts.get("charge_customer_card_v2", "2.0.0")
    assert c is not None and c.lifecycle.status == "deprecated" and c.lifecycle.sunset_date
    sunset = datetime.fromisoformat(str(c.lifecycle.sunset_date)).replace(tzinfo=UTC)
    env = orjson.dumps({**envelope(c.name), "tool": {"name": c.name, "version": c.version}})
    at = [int((sunset + timedelta(days=days)).timestamp() * 1000) for days in (-2, 2)]
    srcs = [SourceRecord("tool.proposals", 0, n, b"run-1", env, t) for n, t in enumerate(at)]
    before, after = decide_batch_at(srcs, gates(contracts), at_record_time, unknown_references)
    assert before.gate is not Gate.RESOLVE, before.rejection
    assert after.gate is Gate.RESOLVE
    assert after.rejection is not None and after.rejection.errors[0].code == "tool_sunsetted"
    # Decided then after the sunset (a backlog): the recorded time wins over the record's.
    answers = Answers()
    answers.observations[position_id("tool.proposals", 0, 0)] = Recorded(
        Verdict("REJECTED", "STRUCTURAL_VIOLATION", "resolve"), False, FP, at[1]
    )
    late, _ = decide_batch_at(srcs, gates(contracts), answers.decided_at, unknown_references)
    assert late.gate is Gate.RESOLVE


def test_the_recorded_decision_keeps_the_time_it_was_decided_at(contracts: ContractSet) -> None:
    d = _search(contracts)
    assert _recorded(d).decided_ms == d.decided_at_ms
    assert Answers().decided_at(d.source) == d.source.timestamp_ms


def test_tenant_and_tool_select_on_what_the_proposal_claims(contracts: ContractSet) -> None:
    d = _search(contracts)
    assert selection(None, None)(d) and selection("tenant-1", "search_kb")(d)
    assert not selection("other", None)(d) and not selection(None, "lookup_order")(d)
    assert selection(None, None)(_dead_letter(contracts))
    assert not selection("tenant-1", None)(_dead_letter(contracts))


def test_the_report_is_one_json_document_with_every_total(contracts: ContractSet) -> None:
    report = _report()
    report.unreadable = 2
    report.incomplete = ["p.proposals/0 at 3 of 9"]
    report.add(replayed(_search(contracts, limit=0), FP), _recorded(_search(contracts)))
    doc = json.loads(json.dumps(report.as_dict()))
    assert doc["totals"] == {
        "same": 0,
        "changed": 1,
        "admission_not_replayed": 0,
        "no_recorded_decision": 0,
        "unreadable_records": 2,
        "consume_errors": 0,
    }
    assert doc["contract_set"] == {"replayed": FP, "recorded": {FP: 1}}
    assert "today's reference data" in doc["references"]
    assert any("admission" in line for line in doc["not_replayed"])
    assert doc["partitions_not_read_to_end"] == ["p.proposals/0 at 3 of 9"]
    assert doc["changes"][0]["recorded"] == {
        "decision": "ROUTED", "taxonomy_class": "SUCCESS", "gate": "route"}  # fmt: skip


def test_the_printed_report_names_each_change_and_what_was_not_seen(
    contracts: ContractSet,
) -> None:
    report = _report()
    again = replayed(_search(contracts, limit=0, proposal_id="p-0"), FP)
    hostile = dataclasses.replace(again, next_action="quoted \x1b[2J\nline")
    report.add(hostile, _recorded(_search(contracts)))
    report.incomplete.append("tool.proposals/2 at 5 of 9")
    out = io.StringIO()
    console = Console(file=out, width=200, color_system=None)
    for part in render(report.as_dict()):
        console.print(part)
    text = out.getvalue()
    assert "ROUTED SUCCESS @route" in text and "REJECTED OUT_OF_BOUNDS @schema" in text
    assert "p-0:" in text and "search_kb" in text
    assert "not read to its end: tool.proposals/2 at 5 of 9" in text
    assert "same 0, changed 1," in text
    assert "\x1b" not in text and "quoted \\u001b[2J\\u000aline" in text


def test_a_refused_compensation_is_compared_as_the_processor_answered_it(
    contracts: ContractSet,
) -> None:
    """The processor answers a gate's refusal of its own compensating call as a failed
    compensation (``refused_compensation``: COMPENSATION_FAILED, same gate), once
    admission has taken it as a step of its run, which it does for every verified one.
    The same refusal replayed is the same decision, not a change."""
    key = "ik:abc"

    def compensation() -> Decision:
        d = _search(contracts, limit=0, proposal_id=compensation_proposal_id(key),
                    idempotency_key=compensation_key(key))  # fmt: skip
        assert d.outcome is Outcome.REJECTED and d.principal is not None
        return d

    then = compensation()
    then.extra[ADMITTED] = True  # as Processor._admit marks it
    recorded = _recorded(refused_compensation(then))
    assert recorded.verdict == Verdict("REJECTED", "COMPENSATION_FAILED", "schema")
    again = replayed(compensation(), FP)
    assert again.compensation and again.verdict == recorded.verdict
    assert compare(recorded, again.verdict) is Match.SAME
    # Anyone's proposal that only borrows the key keeps its own answer, then as now.
    borrowed = _search(contracts, limit=0, idempotency_key=compensation_key(key))
    assert replayed(borrowed, FP).verdict == Verdict("REJECTED", "OUT_OF_BOUNDS", "schema")
