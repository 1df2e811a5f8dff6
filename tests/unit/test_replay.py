"""Replay's pure parts: recorded answers read back from the processor's own records, the
comparison (the admission rule among them), outputs encoded as the processor encodes them,
the gate each dead letter names, grouping and totals, and the range options."""

from __future__ import annotations

import dataclasses
import io
import json
from datetime import UTC, datetime, timedelta
from typing import Any

import orjson
import pytest
from prometheus_client import CollectorRegistry
from rich.console import Console
from typer.testing import CliRunner

from processor.app import Processor, max_output_bytes
from processor.approval_flow import dead_letter
from processor.cli import app
from processor.codec.avro import codec
from processor.codec.records import (
    dlq_headers,
    dlq_record,
    encode_observation,
    observation_record,
    position_id,
    unencodable,
)
from processor.config import Settings
from processor.contracts.registry import ContractSet
from processor.gates.budget import apply_verdict
from processor.kafka.retained import OffsetRange, Reach
from processor.metrics import Metrics
from processor.model import Decision, Gate, Outcome, SourceRecord
from processor.pipeline import decide, decide_batch_at, internal_error
from processor.policy import Budgets
from processor.replay import (
    DEAD_LETTER,
    UNKNOWN_GATE,
    Answers,
    Match,
    Recorded,
    Report,
    Verdict,
    at_record_time,
    compare,
    read_answers,
    recorded_dead_letter,
    recorded_observation,
    render,
    replayed,
    selection,
    span_offsets,
    unknown_references,
)
from processor.results import (
    ADMITTED,
    compensation_key,
    compensation_proposal_id,
    refused_compensation,
)
from tests.unit.helpers import (
    CONTRACTS_DIR,
    LIMITS,
    NOW_MS,
    decide_arguments,
    decide_envelope,
    envelope,
    gates,
    record,
)

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
    report.consume_errors = 2  # records the broker did not give: what they held is not seen
    out = io.StringIO()
    console = Console(file=out, width=200, color_system=None)
    for part in render(report.as_dict()):
        console.print(part)
    text = out.getvalue()
    assert "ROUTED SUCCESS @route" in text and "REJECTED OUT_OF_BOUNDS @schema" in text
    assert "p-0:" in text and "search_kb" in text
    assert "not read to its end: tool.proposals/2 at 5 of 9" in text
    assert "errors while reading: 2 (see the log)" in text
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


# --- outputs the processor could not write ----------------------------------------------------


class _Consumed:
    """What ``Processor._encode`` reads of a consumed record."""

    def __init__(self, src: SourceRecord) -> None:
        self.src = src

    def key(self) -> bytes | None:
        return self.src.key

    def value(self) -> bytes | None:
        return self.src.value

    def partition(self) -> int:
        return self.src.partition

    def offset(self) -> int:
        return self.src.offset


def _summarise(contracts: ContractSet) -> Decision:
    """A routed call whose approved call takes some 3,300 bytes (its observation, 450)."""
    text = "word " * 600
    d = decide_arguments(contracts, "summarise",
                         {"text": text, "max_words": 60, "style": "paragraph"})  # fmt: skip
    assert d.outcome is Outcome.ROUTED
    return d


def _settings(**producer: Any) -> Settings:
    return Settings(contracts_dir=CONTRACTS_DIR, policy_file=None, metrics_port=0,
                    redis_url="redis://127.0.0.1:1/0", producer=producer)  # fmt: skip


def _processor(**producer: Any) -> Processor:
    """It touches no broker or Redis until it runs."""
    return Processor(_settings(**producer), metrics=Metrics(CollectorRegistry()))


def _written(p: Processor, d: Decision) -> list[Any]:
    out: list[Any] = []
    p._encode(out, _Consumed(d.source), d)
    return out


def test_outputs_the_processor_could_not_write_replay_as_the_same_dead_letter(
    contracts: ContractSet,
) -> None:
    """The processor dead-letters a call whose outputs its producer would refuse; replay
    encodes against the same limit, so the same call is the same dead letter, not a
    change, and keeps the proposal and tool it names."""
    p = _processor(**{"message.max.bytes": 5000})
    [(topic, _, _, headers)] = _written(p, _summarise(contracts))
    assert topic == p.settings.topics.dlq
    position, recorded = recorded_dead_letter(headers)
    assert recorded.verdict == Verdict(DEAD_LETTER, "UNKNOWN_ERROR", "route")
    again = replayed(_summarise(contracts), FP, max_output_bytes(p.settings))
    assert again.position == position
    assert again.verdict == recorded.verdict
    assert compare(recorded, again.verdict) is Match.SAME
    assert (again.proposal_id, again.run_id, again.tool) == ("prop-1", "run-1", "summarise")
    assert again.next_action == "dead letter: encoding_failed"
    # Where the processor's limit is librdkafka's own, the call is written and routed: a
    # processor with those settings would decide otherwise today.
    assert max_output_bytes(_settings()) == 1_000_000 - 4096
    routed = replayed(_summarise(contracts), FP, max_output_bytes(_settings()))
    assert routed.verdict == Verdict("ROUTED", "SUCCESS", "route")
    assert compare(recorded, routed.verdict) is Match.CHANGED


def test_outputs_written_are_the_ones_replay_encodes(contracts: ContractSet) -> None:
    p = _processor()
    written = _written(p, _summarise(contracts))
    assert [t for t, *_ in written] == [
        p.settings.topics.execution("READ_ONLY"),
        p.settings.topics.observations,
    ]
    assert replayed(_summarise(contracts), FP).verdict == _recorded(_summarise(contracts)).verdict


def test_an_output_not_written_after_admission_decided_is_admissions(
    contracts: ContractSet,
) -> None:
    """Redis refused the call, then its observation could not be written: its dead letter
    names the admission gate, and is excused as the observation would have been."""
    refused = _refused_by_admission(_summarise(contracts), "rate_limited")
    _, recorded = recorded_dead_letter(dlq_headers(unencodable(refused, ValueError("big"))))
    assert recorded.verdict == Verdict(DEAD_LETTER, "UNKNOWN_ERROR", "budget")
    assert recorded.admission
    assert compare(recorded, replayed(_summarise(contracts), FP).verdict) is Match.ADMISSION


# --- the gate a dead letter names -------------------------------------------------------------


def _dead_letters(contracts: ContractSet) -> dict[str, Decision]:
    """A dead letter of each gate that writes one, by that gate."""
    approvals = record(b"{}", topic="tool.approvals")
    results = record(b"not avro", topic="tool.results")
    return {
        "parse": _dead_letter(contracts),
        "internal": internal_error(record(b"\xff"), LIMITS, NOW_MS, RuntimeError("defect")),
        "approval": dead_letter(approvals, "approval_unknown_request", "req_1"),
        "result": dead_letter(results, "result_invalid", "not a result", Gate.RESULT),
        "route": unencodable(_summarise(contracts), ValueError("over message.max.bytes")),
    }


def test_each_dead_letter_names_the_gate_that_decided_it(contracts: ContractSet) -> None:
    for gate, d in _dead_letters(contracts).items():
        assert d.outcome is Outcome.DEAD_LETTER
        headers = dlq_headers(d)
        assert dict(headers)["toolsentry.error.gate"] == gate.encode()
        _, recorded = recorded_dead_letter(headers)
        assert recorded.verdict.gate == gate, d.dlq_reason
        assert replayed(d, FP).verdict == recorded.verdict


def test_a_dead_letter_written_before_they_named_their_gate_is_read_by_its_reason(
    contracts: ContractSet,
) -> None:
    """Older dead letters carry no gate: the reason and class tell it, except after an
    output that could not be encoded, which any gate may have decided. That one is
    compared on what it says: its decision and class, the class read as today's
    processor writes it (the platform's own faults were once parse failures)."""
    expected = {"parse": "parse", "internal": "internal", "approval": "approval",
                "result": "result", "route": UNKNOWN_GATE}  # fmt: skip
    for gate, d in _dead_letters(contracts).items():
        old = [(k, v) for k, v in dlq_headers(d) if k != "toolsentry.error.gate"]
        _, recorded = recorded_dead_letter(old)
        assert recorded.verdict.gate == expected[gate], d.dlq_reason
    old = [(k, v) for k, v in dlq_headers(_dead_letters(contracts)["route"])
           if k != "toolsentry.error.gate"]  # fmt: skip
    _, recorded = recorded_dead_letter(old)
    small = max_output_bytes(_settings(**{"message.max.bytes": 5000}))
    again = replayed(_summarise(contracts), FP, small)
    assert again.verdict.gate == "route"
    assert compare(recorded, again.verdict) is Match.SAME
    assert compare(recorded, replayed(_summarise(contracts), FP).verdict) is Match.CHANGED
    assert compare(recorded, replayed(_dead_letter(contracts), FP).verdict) is Match.CHANGED
    legacy = [(k, b"SYNTACTIC_PARSE_FAIL" if k == "toolsentry.error.class" else v) for k, v in old]
    _, recorded = recorded_dead_letter(legacy)
    assert recorded.verdict.taxonomy == "UNKNOWN_ERROR"
    assert compare(recorded, again.verdict) is Match.SAME


def test_a_dead_letter_is_decided_again_at_the_time_it_was_written(
    contracts: ContractSet,
) -> None:
    d = _summarise(contracts)
    answers = Answers()
    _, recorded = recorded_dead_letter(dlq_headers(unencodable(d, ValueError("big"))))
    assert recorded.decided_ms is None  # the headers do not say; the record's time does
    answers.dead_letters[("tool.proposals", 3, 42)] = dataclasses.replace(
        recorded, decided_ms=NOW_MS + 60_000
    )
    assert answers.decided_at(d.source) == NOW_MS + 60_000


# --- offset ranges ----------------------------------------------------------------------------


def test_an_offset_range_is_reported_as_the_offsets_and_its_records_times(
    contracts: ContractSet,
) -> None:
    report = _report()
    report.offsets = OffsetRange("tool.proposals", 3, 40, 44)
    report.since_ms, report.until_ms = NOW_MS, NOW_MS + 1000
    assert report.by_offsets
    doc = json.loads(json.dumps(report.as_dict()))
    assert doc["range"] == {
        "since": "2023-11-14T22:13:20.000Z",
        "until": "2023-11-14T22:13:21.000Z",
        "since_ms": NOW_MS,
        "until_ms": NOW_MS + 1000,
        "by_offsets": True,
        "topic": "tool.proposals",
        "partition": 3,
        "from_offset": 40,
        "to_offset": 44,
    }
    first = next(iter(render(doc)))
    assert str(first).startswith(
        "replay tool.proposals/3 offsets 40..44 (records 2023-11-14T22:13:20.000Z .. "
    )
    report.since_ms = report.until_ms = None
    assert str(next(iter(render(report.as_dict())))).startswith(
        "replay tool.proposals/3 offsets 40..44 (no record): "
    )


def test_a_partition_alone_narrows_the_time_range() -> None:
    report = _report()
    report.offsets = OffsetRange("tool.proposals", 3)
    assert not report.by_offsets
    doc = report.as_dict()
    assert doc["range"]["partition"] == 3 and doc["range"]["from_offset"] is None
    assert str(next(iter(render(doc)))).startswith(
        "replay 1970-01-01T00:00:00.000Z .. now, tool.proposals/3: "
    )
    assert not _report().as_dict()["range"]["by_offsets"]
    assert _report().as_dict()["range"]["partition"] is None


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["--to-offset", "5"], "needs --from-offset"),
        (["--from-offset", "5"], "needs --partition"),
        (["--partition", "0", "--from-offset", "5", "--since", "1h"], "cannot be given with"),
        (["--partition", "0", "--from-offset", "5", "--until", "1h"], "cannot be given with"),
        (["--partition", "0", "--from-offset", "5", "--to-offset", "4"], "is before"),
        (["--partition", "-1"], "greater than or equal to 0"),
        (["--partition", "0", "--from-offset", "-3"], "greater than or equal to 0"),
    ],
)
def test_offset_options_that_contradict_each_other_are_refused_before_anything_is_read(
    args: list[str], says: str
) -> None:
    result = CliRunner().invoke(app, ["replay", *args], env={"COLUMNS": "200"})
    assert result.exit_code == 2, result.output
    assert says in result.output


@pytest.mark.parametrize("slack", ["inf", "Infinity", "1e400"])
def test_a_slack_of_no_finite_length_is_a_bad_option_not_a_crash(slack: str) -> None:
    """Not a traceback's exit status 1, which --fail-on-change gives a change."""
    result = CliRunner().invoke(app, ["replay", "--slack-s", slack], env={"COLUMNS": "200"})
    assert result.exit_code == 2, result.output
    assert "--slack-s" in result.output and "finite" in result.output


def test_a_topic_that_does_not_exist_fails_the_replay_whatever_else_it_says(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A replay that could not read its topics (a wrong prefix, a cluster that is not the
    one meant) finds nothing to change: exit status 0 would pass a --fail-on-change gate."""

    def nothing_there(settings: Settings, *args: Any, **kwargs: Any) -> Report:
        report: Report = args[2]
        report.missing += [settings.topics.proposals, settings.topics.dlq]
        return report

    monkeypatch.setattr("processor.replay.replay", nothing_there)
    for shown in ([], ["--json"]):
        result = CliRunner().invoke(
            app,
            ["replay", "--no-references", "--fail-on-change", "--contracts", str(CONTRACTS_DIR),
             *shown],
            env={"COLUMNS": "200"},
        )  # fmt: skip
        assert result.exit_code == 2, result.output
        assert "tool.proposals.dlq" in result.output


@pytest.mark.parametrize("option", ["--since", "--until"])
def test_a_range_that_starts_after_now_is_a_bad_option(option: str) -> None:
    """A mistyped date a month ahead holds no record: not a replay of nothing that passes."""
    ahead = (datetime.now(UTC) + timedelta(days=30)).strftime("%Y-%m-%dT%H:%M:%SZ")
    args = ["--since", ahead] if option == "--since" else ["--since", ahead, "--until", ahead]
    for command in (["replay"], ["trace", "prop-1"]):
        result = CliRunner().invoke(app, [*command, *args], env={"COLUMNS": "200"})
        assert result.exit_code == 2, result.output
        assert "--since" in result.output and "is after now" in result.output


class _Record:
    """A record as the reader yields it, as far as ``read_answers`` looks at one."""

    def __init__(self, topic: str, offset: int, value: bytes) -> None:
        self._topic, self._offset, self._value = topic, offset, value

    def topic(self) -> str:
        return self._topic

    def partition(self) -> int:
        return 0

    def offset(self) -> int:
        return self._offset

    def value(self) -> bytes:
        return self._value

    def headers(self) -> None:
        return None

    def timestamp(self) -> tuple[int, int]:
        return 1, NOW_MS


def test_a_ranges_answers_share_their_few_verdicts_and_contract_sets(
    contracts: ContractSet, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A day of answers is held at once, one per proposal: each holds what is its own (its
    id, its time), and shares the verdict and contract set that thousands repeat."""
    env = envelope("search_kb", arguments={"query": "return policy", "limit": 10})
    written = [encode_observation(decide_envelope(env, contracts, offset=n), FP) for n in range(3)]

    class Observations:
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            self.errors, self.missing, self.incomplete = 0, [], []

        def __iter__(self) -> Any:
            return iter(_Record("tool.observations", n, v) for n, v in enumerate(written))

    monkeypatch.setattr("processor.replay.RetainedReader", Observations)
    held = list(read_answers(_settings(), _report(), 0).observations.values())
    assert len(held) == 3 and held[0].verdict == held[2].verdict
    assert all(r.verdict is held[0].verdict for r in held)
    assert all(r.contract_set is held[0].contract_set for r in held)


class _CutShort:
    """A read of an offset range that gave up part way (the broker went quiet): its
    records so far, the partition it did not finish, and a consume error."""

    def __init__(self, settings: Settings, topics: list[str], offsets: OffsetRange) -> None:
        self.planned = [Reach(offsets.topic, offsets.partition, 40, 50, 40)]
        self.incomplete = [Reach(offsets.topic, offsets.partition, 40, 50, 43)]
        self.errors = 1

    def __iter__(self) -> Any:
        return iter(())


def test_an_offset_range_whose_times_were_read_in_part_says_so(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The first read of an offset range bounds when its answers were written; cut short,
    the answers of the records it did not reach may be missed, and the report says so."""
    monkeypatch.setattr("processor.replay.RetainedReader", _CutShort)
    report = Report(None, None, "", "", None, True, offsets=OffsetRange("tool.proposals", 3, 40))
    span_offsets(_settings(), report)
    assert report.offsets == OffsetRange("tool.proposals", 3, 40, 49)
    assert report.consume_errors == 1
    [cut] = report.incomplete
    assert cut.startswith("tool.proposals/3 at 43 of 50 while reading the records' times")


# --- hostile records on the answers' topics ------------------------------------------------


def _garbled(contracts: ContractSet, name: str, value: bytes) -> list[tuple[str, bytes]]:
    """The dead letter of a record the processor refused, one of its headers replaced."""
    _, _, headers = dlq_record(b"run-1", _dead_letter(contracts), 1_000_000)
    return [(k, value if k == f"toolsentry.{name}" else v) for k, v in headers if v is not None]


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("error.class", b"\x1b[31mSYNTACTIC_PARSE_FAIL"),
        ("error.class", b"syntactic_parse_fail"),
        ("error.gate", b"nonsense"),
        ("error.gate", b""),
        ("source.partition", b"-3"),
        ("source.partition", b" 3\n"),
        ("source.offset", b"+42"),
        ("source.offset", b"4_2"),
        ("source.offset", "\u0664\u0662".encode()),  # 42 in Arabic-Indic digits
        ("source.offset", b"\xff\xfe"),
    ],
)
def test_a_dead_letter_with_a_garbled_header_is_unreadable_never_compared(
    contracts: ContractSet, name: str, value: bytes
) -> None:
    """A class or gate no processor writes would read as a changed decision; a position
    written as no processor writes one could name some other record."""
    with pytest.raises(ValueError):
        recorded_dead_letter(_garbled(contracts, name, value))


def test_a_dead_letter_naming_two_positions_is_unreadable(contracts: ContractSet) -> None:
    _, _, headers = dlq_record(b"run-1", _dead_letter(contracts), 1_000_000)
    with pytest.raises(ValueError):
        recorded_dead_letter([*headers, ("toolsentry.source.offset", b"7")])
    with pytest.raises(ValueError):
        recorded_dead_letter([*headers, ("toolsentry.error.class", b"UNKNOWN_ERROR")])
    # The same header twice with the same value says one thing.
    position, _ = recorded_dead_letter([*headers, ("toolsentry.source.offset", b"42")])
    assert position == ("tool.proposals", 3, 42)


def test_an_observation_decided_by_no_gate_is_unreadable(contracts: ContractSet) -> None:
    datum = observation_record(_search(contracts), FP)
    datum["gate"] = "\x1b[2Jroute"
    obs = codec("observation").decode(codec("observation").encode(datum))
    with pytest.raises(ValueError):
        recorded_observation(obs)


def test_a_recorded_contract_set_is_shown_escaped(contracts: ContractSet) -> None:
    """The observation's contract set is free text, whoever wrote the record."""
    report = _report()
    d = _search(contracts)
    recorded = recorded_observation(
        codec("observation").decode(encode_observation(d, "\x1b]0;owned\x07"))
    )
    report.add(replayed(d, FP), recorded)
    out = io.StringIO()
    for part in render(report.as_dict()):
        Console(file=out, width=200, color_system=None).print(part)
    text = out.getvalue()
    assert "\x1b" not in text and "\\u001b]0;owned\\u0007 (1)" in text


def test_records_stamped_beyond_any_calendar_date_are_reported_not_raised() -> None:
    """A producer may stamp a record with any 64-bit time: an offset range's records'
    times bound the report's range, which is printed."""
    report = Report(2**62, 2**63 - 1, "contracts", FP, None, True)
    doc = report.as_dict()
    assert doc["range"]["since"] == f"{2**62} ms after the epoch"
    assert doc["range"]["since_ms"] == 2**62
    assert json.loads(json.dumps(doc)) == doc
    assert "ms after the epoch" in str(next(render(doc)))
