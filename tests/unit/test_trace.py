"""``trace``'s pure parts: records read back, linked into one proposal's life or laid out
as a run's proposals, summed up.

Every record is made by the processor's own encoders from a real decision, so a change
to what the processor writes shows up here.
"""

from __future__ import annotations

import dataclasses
import io
from collections import Counter
from typing import Any

import orjson
import pytest
from confluent_kafka import KafkaError, KafkaException, Message
from rich.console import Console
from typer.testing import CliRunner

from processor.app import max_output_bytes
from processor.approvals import iso
from processor.cli import app
from processor.codec.avro import codec
from processor.codec.records import (
    dlq_headers,
    dlq_record,
    encode_approval_request,
    encode_approved_call,
    encode_observation,
    encode_result,
    observation_record,
    position_id,
)
from processor.config import Settings, Topics
from processor.contracts.registry import ContractSet
from processor.model import Decision, Outcome
from processor.pipeline import decide
from processor.results import compensation_key, compensation_proposal_id
from processor.trace import (
    COMPENSATION_ID_PREFIX,
    Entry,
    Raw,
    Reading,
    RunView,
    assemble,
    assemble_run,
    collect,
    collect_run,
    raw,
    render,
    render_run,
    run_roles,
    sight,
    topic_roles,
)
from tests.unit.helpers import NOW_MS, PARTITION, decide_envelope, envelope, gates, printed, record

T = Topics()
ROLES = topic_roles(T)
PID = "prop-traced"
KEY = "k-traced"
EXEC = T.execution("READ_ONLY")
READING = Reading(topics=list(ROLES), since_ms=NOW_MS - 60_000, until_ms=None)


def _raw(topic: str, offset: int, time_ms: int, value: bytes | None, **headers: bytes) -> Raw:
    return Raw(topic, 0, offset, time_ms, value, headers)


def _proposal(pid: str = PID, tool: str = "lookup_order", **fields: Any) -> dict[str, Any]:
    return envelope(tool, **{"proposal_id": pid, "idempotency_key": KEY, **fields})


def _decided(env: dict[str, Any], contracts: ContractSet, now_ms: int = NOW_MS) -> Decision:
    return decide_envelope(env, contracts, now_ms=now_ms)


def _result(pid: str = PID, attempt: int = 1, **fields: Any) -> bytes:
    datum: dict[str, Any] = {
        "result_id": f"res-{pid}", "call_id": pid, "proposal_id": pid, "run_id": "run-1",
        "tenant_id": "tenant-1", "trace_id": "0af7651916cd43dd8448eb211c80319c",
        "tool_name": "lookup_order", "tool_version": "1.0.0", "side_effect_class": "READ_ONLY",
        "idempotency_key": KEY, "payload_hash": "sha256:00", "attempt": attempt,
        "outcome": "SUCCEEDED", "retryable": False, "error_code": None, "error_message": None,
        "taxonomy_class": None, "committed_steps": [], "data": '{"match_count": 1}',
        "compensation_arguments": None, "started_at": NOW_MS + 10, "finished_at": NOW_MS + 20,
        "executor_id": "exec-1", "contract_set": None,
    }  # fmt: skip
    datum.update(fields)
    return encode_result(datum)


def _final(d: Decision, decided_at: int, **changes: Any) -> bytes:
    """The observation the processor writes when the call's result comes back: its decision
    time is the result's ``finished_at``."""
    datum = observation_record(d, None)
    datum["decision"], datum["gate"] = "COMPLETED", "result"
    datum["result_payload"]["data"] = '{"match_count": 1}'
    datum["execution_metadata"]["timestamp"] = decided_at
    datum.update(changes)
    return codec("observation").encode(datum)


def _routed_life(contracts: ContractSet) -> list[Raw]:
    """A routed lookup, run and completed, its records stamped as the processor stamps them:
    the call before the observation of the decision that wrote it, and the final
    observation with the time the executor finished, before the result was written."""
    d = _decided(_proposal(), contracts)
    return [
        _raw(T.proposals, 7, NOW_MS - 5, orjson.dumps(_proposal())),
        _raw(T.observations, 3, NOW_MS + 2, encode_observation(d, None)),
        _raw(EXEC, 4, NOW_MS + 1, encode_approved_call(d, None)),
        _raw(T.results, 9, NOW_MS + 30, _result()),
        _raw(T.observations, 8, NOW_MS + 41, _final(d, NOW_MS + 20)),
    ]


def _trace(
    raws: list[Raw], reading: Reading = READING
) -> tuple[list[Entry], list[str], Counter[str]]:
    bad: Counter[str] = Counter()
    t = assemble(PID, collect(PID, raws, ROLES, bad), reading)
    return t.entries, t.warnings, bad


def test_a_completed_call_reads_as_its_life_in_the_order_it_happened(
    contracts: ContractSet,
) -> None:
    life = _routed_life(contracts)
    other = _decided(_proposal("prop-other"), contracts)
    noise = [
        _raw(T.proposals, 8, NOW_MS - 4, orjson.dumps(_proposal("prop-other"))),
        _raw(T.observations, 5, NOW_MS + 3, encode_observation(other, None)),
        _raw(T.results, 10, NOW_MS + 31, _result("prop-other")),
    ]
    entries, warnings, bad = _trace([*reversed(life), *noise])
    assert [(e.kind, e.gist.get("decision")) for e in entries] == [
        ("proposal", None),
        ("observation", "ROUTED"),
        ("call", None),
        ("result", None),
        ("observation", "COMPLETED"),
    ]
    assert [e.offset for e in entries] == [7, 3, 4, 9, 8]
    assert warnings == [] and not bad


def test_each_kind_shows_what_an_analyst_looks_for(contracts: ContractSet) -> None:
    entries, _, _ = _trace(_routed_life(contracts))
    proposal, routed, call, result, final = (e.gist_text() for e in entries)
    assert proposal == f"tool=lookup_order@newest run=run-1 tenant=tenant-1 key={KEY}"
    assert routed.startswith("decision=ROUTED class=SUCCESS gate=route next=The call was accepted")
    version = contracts.versions("lookup_order")[0].version
    assert call == f"tool=lookup_order@{version} class=READ_ONLY attempt=1 key={KEY}"
    assert result == "outcome=SUCCEEDED attempt=1 executor=exec-1"
    assert final == 'decision=COMPLETED class=SUCCESS gate=result data={"match_count": 1}'
    failed = sight(
        "results",
        _raw(
            T.results,
            1,
            NOW_MS,
            _result(
                outcome="FAILED",
                error_code="receipt_failed",
                committed_steps=["card_charged", "mailed"],
            ),
        ),
    )
    assert failed is not None
    assert failed.gist_text().startswith(
        "outcome=FAILED error=receipt_failed committed=card_charged,mailed"
    )


def test_long_free_text_is_clipped_in_the_gist(contracts: ContractSet) -> None:
    d = _decided(_proposal(), contracts)
    long = _final(d, NOW_MS, next_action="x" * 5000)
    datum = observation_record(d, None)
    datum["next_action"] = "y" * 5000
    e = sight("observations", _raw(T.observations, 1, NOW_MS, codec("observation").encode(datum)))
    assert (
        e is not None and len(str(e.gist["next"])) == 160 and str(e.gist["next"]).endswith("\u2026")
    )
    assert sight("observations", _raw(T.observations, 2, NOW_MS, long)) is not None


def test_a_rejected_proposal_is_its_proposal_and_one_rejection(contracts: ContractSet) -> None:
    env = _proposal(arguments={"not": "an order"})
    d = _decided(env, contracts)
    entries, warnings, _ = _trace(
        [
            _raw(T.proposals, 1, NOW_MS - 5, orjson.dumps(env)),
            _raw(T.observations, 1, NOW_MS, encode_observation(d, None)),
        ]
    )
    assert [e.kind for e in entries] == ["proposal", "observation"]
    assert entries[1].gist["decision"] == "REJECTED"
    assert (
        entries[1].gist["class"] == "STRUCTURAL_VIOLATION" and entries[1].gist["gate"] == "schema"
    )
    assert warnings == []


def test_what_names_the_proposal_but_cannot_be_read_is_counted_never_raised(
    contracts: ContractSet,
) -> None:
    d = _decided(_proposal(), contracts)
    observation = encode_observation(d, None)
    named = PID.encode()
    garbage = [
        _raw(T.proposals, 1, NOW_MS, b"\xff\xfe not json " + named),
        _raw(T.proposals, 2, NOW_MS, b'{"tool": {"name": "lookup_order"}, "note": "%s"}' % named),
        _raw(T.observations, 3, NOW_MS, observation[:-7]),  # cut short
        _raw(T.observations, 4, NOW_MS, encode_approved_call(d, None)),  # another schema
        _raw(EXEC, 6, NOW_MS, b"\xc3\x01" + b"\x00" * 8 + b"junk " + named),
        _raw(T.results, 7, NOW_MS, observation),
        _raw(T.approval_requests, 8, NOW_MS, b'["%s"]' % named),
        _raw(T.approvals, 9, NOW_MS, b'["request_id"]'),  # approvals are always read
        _raw(T.dlq, 10, NOW_MS, b"\x00\x01 garbage that names nobody"),
    ]
    elsewhere = [  # cannot be about it: not decoded, not counted
        _raw(T.observations, 5, NOW_MS, None),
        _raw(T.observations, 12, NOW_MS, b"\xc3\x01 another proposal's garbage"),
        _raw(T.proposals, 13, NOW_MS, b"\xff\xfe not json, no id"),
    ]
    every = [*garbage, *elsewhere, _raw(T.observations, 11, NOW_MS, observation)]
    entries, warnings, bad = _trace(every)
    assert [e.offset for e in entries] == [11]
    assert bad == {
        T.proposals: 1,  # the one without an id is another proposal: read, dropped
        T.observations: 2,
        EXEC: 1,
        T.results: 1,
        T.approval_requests: 1,
        T.approvals: 1,
    }
    reading = Reading(list(ROLES), None, None, undecodable=dict(bad))
    _, warnings, _ = _trace([_raw(T.observations, 11, NOW_MS, observation)], reading)
    assert any(w.startswith("7 record(s) that may name it could not be decoded") for w in warnings)


def test_a_proposal_written_with_json_escapes_is_still_found(contracts: ContractSet) -> None:
    """JSON may spell an id with escapes, so its bytes need not hold the id: a proposal
    with a backslash anywhere is decoded whatever it holds."""
    escaped = orjson.dumps(_proposal()).replace(b'"prop-traced"', b'"prop\\u002dtraced"')
    assert PID.encode() not in escaped
    entries, _, bad = _trace([_raw(T.proposals, 1, NOW_MS, escaped)])
    assert [e.kind for e in entries] == ["proposal"] and bad == {}


def test_the_compensation_the_processor_proposed_is_followed_one_level(
    contracts: ContractSet,
) -> None:
    comp_id = compensation_proposal_id(KEY)
    assert comp_id.startswith(COMPENSATION_ID_PREFIX)
    comp_env = _proposal(comp_id, idempotency_key=compensation_key(KEY))
    comp = _decided(comp_env, contracts, NOW_MS + 45)
    stranger = compensation_proposal_id("someone-else")
    raws = [
        *_routed_life(contracts),
        _raw(T.proposals, 20, NOW_MS + 42, orjson.dumps(comp_env)),
        _raw(T.observations, 21, NOW_MS + 50, encode_observation(comp, None)),
        _raw(T.proposals, 22, NOW_MS + 43, orjson.dumps(_proposal(stranger))),
    ]
    entries, _, _ = _trace(raws)
    followed = [(e.kind, e.proposal_id) for e in entries if e.compensation]
    assert followed == [("proposal", comp_id), ("observation", comp_id)]
    assert entries[-1].what == "compensation observation"
    assert all(e.proposal_id != stranger for e in entries)


def test_a_key_borrowed_from_another_call_does_not_bring_its_compensation(
    contracts: ContractSet,
) -> None:
    """A rejected proposal's observation repeats the key its agent sent, which may be
    another call's: that call's compensation is not this proposal's."""
    comp_id = compensation_proposal_id(KEY)
    comp_env = _proposal(comp_id, idempotency_key=compensation_key(KEY))
    refused = _decided(_proposal(arguments={"not": "an order"}), contracts)
    entries, _, _ = _trace(
        [
            _raw(
                T.proposals, 1, NOW_MS - 5, orjson.dumps(_proposal(arguments={"not": "an order"}))
            ),
            _raw(T.observations, 2, NOW_MS, encode_observation(refused, None)),
            _raw(T.proposals, 3, NOW_MS + 40, orjson.dumps(comp_env)),
        ]
    )
    assert [e.kind for e in entries] == ["proposal", "observation"]
    assert not any(e.compensation for e in entries)


def test_approvals_and_dead_letters_join_by_the_request_they_answer(
    contracts: ContractSet,
) -> None:
    env = _proposal(tool="cancel_order")
    d = _decided(env, contracts)
    assert d.approval_request is not None
    rid = d.approval_request["request_id"]
    vote = {"request_id": rid, "approver_id": "ops-1", "decision": "approved", "tenant_id": "t"}
    undecided = d.source
    dead = dlq_headers(d)
    raws = [
        _raw(T.proposals, 1, NOW_MS - 5, orjson.dumps(env)),
        _raw(T.observations, 2, NOW_MS + 1, encode_observation(d, None)),
        _raw(T.approval_requests, 3, NOW_MS + 1, encode_approval_request(d, None)),
        _raw(T.approvals, 4, NOW_MS + 100, orjson.dumps(vote)),
        _raw(T.approvals, 5, NOW_MS + 101, orjson.dumps({**vote, "request_id": "req_other"})),
        _raw(
            T.approvals,
            6,
            NOW_MS + 102,
            orjson.dumps({"type": "expiry_check", "tenant_id": "t", "request_id": rid}),
        ),
        _raw(
            T.dlq,
            7,
            NOW_MS + 103,
            orjson.dumps({**vote, "approver_id": "nobody"}),
            **{k: v for k, v in dead if isinstance(v, bytes)},
        ),
    ]
    entries, warnings, _ = _trace(raws)
    assert [e.kind for e in entries] == [
        "proposal",
        "observation",
        "approval request",
        "approval",
        "approval",
        "dead letter",
    ]
    assert entries[1].gist["decision"] == "PENDING_APPROVAL"
    assert entries[3].gist_text() == f"approver=ops-1 decision=approved request={rid}"
    assert entries[4].gist_text() == f"check=expiry request={rid}"
    assert entries[5].gist["reason"] == "unknown"
    assert (
        entries[5].gist["source"] == f"{undecided.topic}/{undecided.partition}/{undecided.offset}"
    )
    assert warnings == []


@pytest.mark.parametrize(("kind", "shown"), [("withdrawal", "withdrawal"), (7, "7")])
def test_an_approvals_record_of_an_unknown_type_is_not_shown_as_a_decision(
    contracts: ContractSet, kind: object, shown: str
) -> None:
    """The processor dead-letters it (approval_unknown_type) and counts nothing: shown as
    the approval whose fields it carries, it would read as an approver's decision."""
    d = _decided(_proposal(tool="cancel_order"), contracts)
    assert d.approval_request is not None
    rid = d.approval_request["request_id"]
    vote = {"request_id": rid, "approver_id": "ops-1", "decision": "approved", "tenant_id": "t"}
    entries, _, _ = _trace(
        [
            _raw(T.proposals, 1, NOW_MS - 5, orjson.dumps(_proposal(tool="cancel_order"))),
            _raw(T.approval_requests, 2, NOW_MS + 1, encode_approval_request(d, None)),
            _raw(T.approvals, 3, NOW_MS + 100, orjson.dumps({**vote, "type": kind})),
        ]
    )
    assert [e.kind for e in entries] == ["proposal", "approval request", "approval"]
    assert entries[2].gist_text() == f"type={shown} request={rid}"


def test_a_dead_lettered_proposal_is_found_by_the_id_it_names() -> None:
    env = _proposal(arguments="not an object")
    headers = {"toolsentry.error.reason": b"arguments_not_object"}
    e = sight("dead_letters", _raw(T.dlq, 1, NOW_MS, orjson.dumps(env), **headers))
    assert e is not None and e.proposal_id == PID and e.gist["reason"] == "arguments_not_object"
    entries, warnings, _ = _trace(
        [
            _raw(T.proposals, 0, NOW_MS - 1, orjson.dumps(env)),
            _raw(T.dlq, 1, NOW_MS, orjson.dumps(env), **headers),
        ]
    )
    assert [x.kind for x in entries] == ["proposal", "dead letter"]
    assert warnings == []  # a dead letter is its answer: no decision is missing


def test_a_dead_letter_that_keeps_too_little_to_name_the_proposal_is_found_by_its_position(
    contracts: ContractSet,
) -> None:
    """A record too big for the DLQ is kept cut short, which no JSON reader takes: its dead
    letter is found by the position its headers name, never read as "not decided yet"."""
    big = orjson.dumps(_proposal(note="x" * 600_000))
    twice = big[:-1] + b',"run_id":"run-1"}'  # a key given twice: dead-lettered at parse
    src = record(twice, topic=T.proposals, partition=0, offset=7)
    d = decide(src, gates(contracts), NOW_MS, {})
    assert d.outcome is Outcome.DEAD_LETTER
    _, kept, pairs = dlq_record(src.key, d, max_output_bytes(Settings()))
    assert kept is not None and len(kept) < len(twice)
    headers = {k: v for k, v in pairs if isinstance(v, bytes)}
    other = dlq_record(b"run-1", dataclasses.replace(d, source=record(b"{", offset=8)), 1 << 20)
    life = [
        _raw(T.proposals, 7, NOW_MS - 5, twice),
        _raw(T.dlq, 1, NOW_MS, kept, **headers),
        _raw(T.dlq, 2, NOW_MS, other[1], **{k: v for k, v in other[2] if isinstance(v, bytes)}),
    ]
    bad: Counter[str] = Counter()
    t = assemble(PID, collect(PID, life, ROLES, bad), READING)
    assert [(e.kind, e.position) for e in t.entries] == [
        ("proposal", f"{T.proposals}/0@7"),
        ("dead letter", f"{T.dlq}/0@1"),
    ]
    assert t.warnings == [] and not bad
    # Its dead letter is its final answer, not "none in range".
    assert t.final is not None and t.final.kind == "dead letter"
    assert "final answer: dead letter: reason=duplicate_key" in printed(render(t))


def test_the_summary_warns_where_the_life_is_not_whole(contracts: ContractSet) -> None:
    life = _routed_life(contracts)
    proposal, routed, call, _, _ = life
    again = _raw(T.proposals, 70, NOW_MS + 5, proposal.value)
    second = _raw(T.observations, 71, NOW_MS + 6, routed.value)
    reading = Reading(
        list(ROLES),
        None,
        None,
        incomplete=["tool.results/2 (at 5 of 9)"],
        missing=["tool.approvals"],
        errors=2,
    )
    _, warnings, _ = _trace([proposal, routed, call, again, second], reading)
    assert warnings[0] == "proposed 2 times under this id"
    assert warnings[1] == "2 decision observations, one expected"
    assert warnings[2].startswith(f"the call of attempt 1 ({EXEC}/0@4")
    assert warnings[2].endswith("has no result in range")
    assert warnings[3:] == [
        "partitions not read to their end: tool.results/2 (at 5 of 9)",
        "topics missing: tool.approvals",
        "2 error(s) while reading (see the log)",
    ]
    _, warnings, _ = _trace([routed])
    assert warnings == ["its proposal is not in the range: proposed before --since, or unreadable"]
    _, warnings, _ = _trace([proposal])
    assert warnings == ["no decision observation in range: not decided yet, or after --until"]


def test_the_final_answer_is_the_last_observation_of_the_proposal_itself(
    contracts: ContractSet,
) -> None:
    bad: Counter[str] = Counter()
    t = assemble(PID, collect(PID, _routed_life(contracts), ROLES, bad), READING)
    assert t.found and t.final is not None and t.final.gist["decision"] == "COMPLETED"
    doc = t.as_json()
    assert doc["found"] is True and doc["final"]["offset"] == 8
    assert [e["kind"] for e in doc["entries"]][-1] == "observation"
    assert orjson.loads(orjson.dumps(doc)) == doc
    nothing = assemble(PID, [], READING)
    assert not nothing.found and nothing.final is None and nothing.warnings == []


def test_the_last_answer_is_the_last_written_though_stamped_earlier(
    contracts: ContractSet,
) -> None:
    """Processors stamp observations with their own clocks, which differ: the processor
    that decided the call ran ahead of the one that wrote its result's answer. A run's
    observations are all in its partition, whose order is the order they were written."""
    life = _routed_life(contracts)
    life[1] = dataclasses.replace(life[1], time_ms=NOW_MS + 60)  # the decision, offset 3
    bad: Counter[str] = Counter()
    t = assemble(PID, collect(PID, life, ROLES, bad), READING)
    assert t.final is not None and (t.final.offset, t.final.gist["decision"]) == (8, "COMPLETED")
    run = [dataclasses.replace(r, time_ms=NOW_MS + 60) if r.offset == 1 else r
           for r in _run_life(contracts)]  # fmt: skip
    view, _ = _run_view(run)
    assert _said(view.rows[0].last) == ("COMPLETED", "SUCCESS", "result")


def test_a_bad_time_is_refused_with_its_reason_before_anything_is_read() -> None:
    result = CliRunner().invoke(app, ["trace", PID, "--since", "yesterday"])
    assert result.exit_code == 2
    assert "is not a time" in result.output
    result = CliRunner().invoke(app, ["trace", PID, "--since", "1h", "--until", "2h"])
    assert result.exit_code == 2
    assert "is before --since" in result.output


def test_text_from_a_hostile_record_cannot_reach_the_terminal_or_stop_the_print() -> None:
    """A proposal under the traced id may be anyone's: an escape sequence in its tool name
    would drive the analyst's terminal, and a lone surrogate (which the lenient JSON
    reader lets in) cannot be written to a UTF-8 terminal at all."""
    env = _proposal(tool="x\x1b]0;owned\x07\x1b[2J")
    value = orjson.dumps(env).replace(b'"run-1"', b'"run\\ud800\\n1"')
    entries, _, bad = _trace([_raw(T.proposals, 1, NOW_MS, value)])
    assert bad == {} and [e.kind for e in entries] == ["proposal"]
    shown = entries[0].gist_text()
    assert "\x1b" not in shown and "\n" not in shown and "\\u001b" in shown
    assert "run=run\\ud800\\u000a1" in shown
    out = io.TextIOWrapper(io.BytesIO(), encoding="utf-8")
    console = Console(file=out, width=300, color_system=None)
    t = assemble(PID, entries, READING)
    for part in render(t):
        console.print(part)
    out.flush()
    printed = out.buffer.getvalue().decode()
    assert "\x1b" not in printed and "tool=x\\u001b]0;owned" in printed


def test_a_broker_that_cannot_be_read_is_not_reported_as_not_found(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Exit status 1 says the range holds no record of it: a failed read is not that."""

    def unreachable(*args: object, **kwargs: object) -> None:
        raise KafkaException(KafkaError(KafkaError._TRANSPORT, "all brokers down"))

    monkeypatch.setattr("processor.trace.read_trace", unreachable)
    result = CliRunner().invoke(app, ["trace", PID, "--since", "1h"])
    assert result.exit_code == 2, result.output
    assert "trace failed" in result.output and "all brokers down" in result.output


# -- a run's view -------------------------------------------------------------------------

RUN = "run-7"
RUN_ROLES = run_roles(T)
RUN_READING = Reading(topics=list(RUN_ROLES), since_ms=NOW_MS - 60_000, until_ms=None)
TWICE = b'{"proposal_id": "prop-dead", "run_id": "run-7", "run_id": "run-7", "tool": {}}'
"""A proposal of the run that the processor dead-letters (a key given twice) but a reader
can still read."""


def _proposed(offset: int, time_ms: int, value: bytes) -> Raw:
    """A proposal record at the position ``decide_envelope`` says it was read from."""
    return Raw(T.proposals, PARTITION, offset, time_ms, value)


def _observed(offset: int, time_ms: int, value: bytes) -> Raw:
    return Raw(T.observations, 1, offset, time_ms, value)


def _dead_lettered(contracts: ContractSet, value: bytes, offset: int, time_ms: int) -> list[Raw]:
    """A proposal record and the dead letter the processor writes for it."""
    d = decide(record(value, offset=offset), gates(contracts), NOW_MS, {})
    assert d.outcome is Outcome.DEAD_LETTER
    _, kept, headers = dlq_record(b"k", d, 1_000_000)
    named = {k: v for k, v in headers if isinstance(v, bytes)}
    return [_proposed(offset, time_ms, value), Raw(T.dlq, 0, offset, time_ms + 1, kept, named)]


def _run_life(contracts: ContractSet) -> list[Raw]:
    """Three proposals of the run: a lookup routed and completed, one rejected and one
    dead-lettered; then the lookup sent again under its id, not decided yet."""
    looked = _proposal("prop-a", run_id=RUN)
    routed = decide_envelope(looked, contracts, offset=10)
    refused_env = _proposal("prop-b", run_id=RUN, arguments={"not": "an order"})
    refused = decide_envelope(refused_env, contracts, offset=11)
    completed = _final(routed, NOW_MS + 20, observation_id=position_id(T.results, 0, 9))
    return [
        _proposed(10, NOW_MS, orjson.dumps(looked)),
        _observed(1, NOW_MS + 2, encode_observation(routed, None)),
        _proposed(11, NOW_MS + 3, orjson.dumps(refused_env)),
        _observed(2, NOW_MS + 4, encode_observation(refused, None)),
        *_dead_lettered(contracts, TWICE, 12, NOW_MS + 5),
        _proposed(14, NOW_MS + 8, orjson.dumps(looked)),
        _observed(5, NOW_MS + 40, completed),
    ]


def _run_view(raws: list[Raw], reading: Reading = RUN_READING) -> tuple[RunView, Counter[str]]:
    bad: Counter[str] = Counter()
    return assemble_run(RUN, collect_run(RUN, raws, RUN_ROLES, bad), reading), bad


def _said(e: Entry | None) -> tuple[Any, ...] | None:
    return None if e is None else (e.gist["decision"], e.gist["class"], e.gist["gate"])


def test_a_run_reads_as_its_proposals_each_with_the_answer_to_its_own_record(
    contracts: ContractSet,
) -> None:
    neighbour = _proposal("prop-c", run_id=RUN + "7")  # holds the run's bytes: read, dropped
    decided = decide_envelope(neighbour, contracts, offset=13)
    noise = [
        _proposed(13, NOW_MS + 6, orjson.dumps(neighbour)),
        _observed(3, NOW_MS + 7, encode_observation(decided, None)),
    ]
    view, bad = _run_view([*reversed(_run_life(contracts)), *noise])
    assert [(r.proposal.proposal_id, r.proposal.offset) for r in view.rows] == [
        ("prop-a", 10),
        ("prop-b", 11),
        ("prop-dead", 12),
        ("prop-a", 14),
    ]
    assert [(_said(r.decision), _said(r.last)) for r in view.rows] == [
        (("ROUTED", "SUCCESS", "route"), ("COMPLETED", "SUCCESS", "result")),
        (("REJECTED", "STRUCTURAL_VIOLATION", "schema"),) * 2,
        (("DEAD_LETTER", "SYNTACTIC_PARSE_FAIL", "parse"),) * 2,
        # Sent again under its id: no answer to this record, though its id has one.
        (None, ("COMPLETED", "SUCCESS", "result")),
    ]
    assert view.rows[2].decision is not None
    assert view.rows[2].decision.gist["reason"] == "duplicate_key"
    assert view.rows[0].proposal.gist["tool"] == "lookup_order@newest"
    assert view.finals() == {"SUCCESS": 2, "STRUCTURAL_VIOLATION": 1, "SYNTACTIC_PARSE_FAIL": 1}
    assert view.warnings == [
        "1 proposal(s) with no decision in range: not decided yet, or after --until"
    ]
    assert bad == {}


def test_what_may_name_the_run_but_cannot_be_read_is_counted_never_raised(
    contracts: ContractSet,
) -> None:
    looked = decide_envelope(_proposal("prop-a", run_id=RUN), contracts, offset=10)
    observation = encode_observation(looked, None)
    cut = {"toolsentry.value.truncated_from": b"9999999"}
    garbage = [
        _proposed(1, NOW_MS, b'{"proposal_id": "prop-x", "run_id": "run-7", "arguments": {'),
        _proposed(3, NOW_MS, b'"\\u0072un-7"'),  # may spell it with escapes
        _observed(4, NOW_MS, observation[:-7]),  # cut short
        Raw(T.dlq, 0, 5, NOW_MS, b"run-7 and no headers"),
        Raw(T.dlq, 0, 6, NOW_MS, b"cut before the run", cut),  # and no source either
    ]
    elsewhere = [  # cannot name it: not decoded, not counted
        _proposed(7, NOW_MS, b"\xff\xfe not json"),
        _proposed(8, NOW_MS, None),
        _observed(9, NOW_MS, b"\xc3\x01 another run's garbage"),
        Raw(T.dlq, 0, 10, NOW_MS, b"another run's dead letter, no headers"),
    ]
    view, bad = _run_view([*garbage, *elsewhere])
    assert not view.found
    assert bad == {T.proposals: 2, T.observations: 1, T.dlq: 2}
    reading = Reading(list(RUN_ROLES), None, None, undecodable=dict(bad))
    view, _ = _run_view([], reading)
    assert view.warnings == [
        f"5 record(s) that may name the run could not be decoded ({T.proposals}: 2, "
        f"{T.observations}: 1, {T.dlq}: 2): they hold its id or JSON escapes, or are dead "
        "letters cut short"
    ]


def test_a_run_is_printed_as_a_table_a_summary_and_how_to_see_a_row_whole(
    contracts: ContractSet,
) -> None:
    hostile = _proposal("prop-\x1b[2J", tool="x\x1b]0;owned\x07", run_id=RUN)
    raws = [*_run_life(contracts), _proposed(20, NOW_MS + 50, orjson.dumps(hostile))]
    view, _ = _run_view(raws)
    out = io.TextIOWrapper(io.BytesIO(), encoding="utf-8")
    console = Console(file=out, width=400, color_system=None)
    for part in render_run(view):
        console.print(part)
    out.flush()
    printed = out.buffer.getvalue().decode()
    assert "\x1b" not in printed
    assert "prop-\\u001b[2J" in printed and "x\\u001b]0;owned\\u0007@newest" in printed
    lines = printed.splitlines()
    row = next(line for line in lines if "lookup_order@newest" in line)
    assert "decision=ROUTED class=SUCCESS gate=route " in row
    assert 'decision=COMPLETED class=SUCCESS gate=result data={"match_count": 1}' in row
    refused = next(line for line in lines if "prop-b" in line)
    assert refused.count("decision=REJECTED") == 2 and "next=" in refused
    summary = "summary: 5 proposal(s), by final class: SUCCESS 2, STRUCTURAL_VIOLATION 1, "
    assert any(line.startswith(summary) for line in lines)
    assert "warning: 2 proposal(s) with no decision in range" in printed
    assert lines[-1] == f"the whole life of one: toolsentry trace PROPOSAL_ID --run-id {RUN}"
    doc = view.as_json()
    assert orjson.loads(orjson.dumps(doc)) == doc
    assert [r["proposal_id"] for r in doc["rows"]][:3] == ["prop-a", "prop-b", "prop-dead"]
    assert doc["rows"][0]["last"]["gist"]["decision"] == "COMPLETED"
    assert doc["rows"][3]["decision"] is None
    assert doc["summary"]["proposals"] == 5 and doc["found"] is True


def test_a_run_with_no_proposal_in_range_says_what_was_searched() -> None:
    view, _ = _run_view([])
    assert not view.found and view.as_json()["rows"] == []
    shown = [str(part) for part in render_run(view)]
    assert shown == [
        f"not found: no proposal of run {RUN} in {iso(NOW_MS - 60_000)} .. now on "
        + ", ".join(RUN_ROLES)
    ]


def test_a_trace_needs_a_proposal_or_a_run(monkeypatch: pytest.MonkeyPatch) -> None:
    result = CliRunner().invoke(app, ["trace", "--since", "1h"])
    assert result.exit_code == 2 and "give a proposal id, or --run-id" in result.output

    def unreachable(*args: object, **kwargs: object) -> None:
        raise KafkaException(KafkaError(KafkaError._TRANSPORT, "all brokers down"))

    monkeypatch.setattr("processor.trace.read_run", unreachable)
    result = CliRunner().invoke(app, ["trace", "--run-id", RUN, "--since", "1h"])
    assert result.exit_code == 2, result.output
    assert "trace failed" in result.output and "all brokers down" in result.output


def test_an_id_that_is_not_utf8_is_a_bad_option_not_a_crash(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Bytes that are not UTF-8 reach argv as lone surrogates ($'run-\xff' in a shell).
    monkeypatch.setattr(
        "processor.trace.topics_partitions", lambda settings, topics: dict.fromkeys(topics, 3)
    )
    for args in (["--run-id", "run-\udcff"], ["prop-\udcff"], ["prop-a", "--run-id", "\udcff"]):
        result = CliRunner().invoke(app, ["trace", *args, "--since", "1h"])
        assert result.exit_code == 2, (args, result.exception)
        assert "is not UTF-8 text" in result.output


def test_a_proposal_of_the_run_without_an_id_is_a_row_answered_under_the_processors_id(
    contracts: ContractSet,
) -> None:
    nameless = {k: v for k, v in _proposal("x", run_id=RUN).items() if k != "proposal_id"}
    value = orjson.dumps(nameless)
    d = decide(record(value, offset=30), gates(contracts), NOW_MS, {})
    assert d.proposal is not None and d.proposal.run_id == RUN  # the processor answers it
    view, bad = _run_view(
        [_proposed(30, NOW_MS, value), _observed(1, NOW_MS + 1, encode_observation(d, None))]
    )
    assert bad == {}
    [row] = view.rows
    assert row.proposal.proposal_id == d.proposal.proposal_id
    assert _said(row.decision) == ("REJECTED", "SYNTACTIC_PARSE_FAIL", "parse")
    assert row.last is row.decision


def test_the_hint_quotes_a_run_id_a_shell_would_split(contracts: ContractSet) -> None:
    run = "run 7; rm"
    raws = [_proposed(1, NOW_MS, orjson.dumps(_proposal("prop-q", run_id=run)))]
    view = assemble_run(run, collect_run(run, raws, RUN_ROLES, Counter()), RUN_READING)
    assert [row.proposal.proposal_id for row in view.rows] == ["prop-q"]
    out = io.StringIO()
    for part in render_run(view):
        Console(file=out, width=400, color_system=None).print(part)
    assert out.getvalue().splitlines()[-1].endswith("--run-id 'run 7; rm'")


# -- hostile records ----------------------------------------------------------------------


def test_records_stamped_beyond_any_calendar_date_are_shown_not_raised(
    contracts: ContractSet,
) -> None:
    """A producer may stamp a record with any 64-bit time, and a range open at its end
    reads it: the table, the warnings and the JSON show its time in epoch milliseconds."""
    far = 2**62
    d = _decided(_proposal(), contracts)
    raws = [
        _raw(T.proposals, 1, far, orjson.dumps(_proposal())),
        _raw(T.observations, 2, NOW_MS, encode_observation(d, None)),
        _raw(EXEC, 3, far + 1, encode_approved_call(d, None)),  # no result: warned of
    ]
    t = assemble(PID, collect(PID, raws, ROLES, Counter()), READING)
    assert [e.kind for e in t.entries] == ["observation", "call", "proposal"]
    text = printed(render(t))
    assert f"{far} ms after the epoch" in text and "has no result in range" in text
    doc = t.as_json()
    assert doc["entries"][2]["time"] == f"{far} ms after the epoch"
    assert doc["entries"][2]["time_ms"] == far
    run_raws = [_proposed(10, far, orjson.dumps(_proposal("prop-a", run_id=RUN)))]
    view, _ = _run_view(run_raws)
    assert f"{far} ms after the epoch" in printed(render_run(view))
    assert view.as_json()["rows"][0]["time"] == f"{far} ms after the epoch"


def test_a_dead_letter_with_garbled_headers_answers_no_proposal_of_the_run(
    contracts: ContractSet,
) -> None:
    """Headers that name two positions, or a class and gate no processor writes, could
    tie the dead letter to a record it does not answer: it is counted, not linked."""
    proposal, dead = _dead_lettered(contracts, TWICE, 12, NOW_MS)
    given = list(dead.headers.items())
    twice = Message(
        topic=T.dlq, partition=0, offset=5, value=dead.value, timestamp=(1, NOW_MS + 1),
        headers=[*given, ("toolsentry.source.offset", b"13")],
    )  # fmt: skip
    assert "toolsentry.source.offset" not in raw(twice).headers
    garbled = {**dead.headers, "toolsentry.error.class": b"\x1b[2JSUCCESS"}
    records = [proposal, raw(twice), dataclasses.replace(dead, offset=6, headers=garbled)]
    view, bad = _run_view(records)
    assert bad == {T.dlq: 2}
    [row] = view.rows
    assert row.decision is None and row.last is None
    again = Message(
        topic=T.dlq, partition=0, offset=5, value=dead.value, timestamp=(1, NOW_MS + 1),
        headers=[*given, ("toolsentry.source.offset", b"12")],
    )  # fmt: skip
    view, bad = _run_view([proposal, raw(again)])  # the same value twice says one thing
    assert bad == {} and _said(view.rows[0].decision) == (
        "DEAD_LETTER", "SYNTACTIC_PARSE_FAIL", "parse")  # fmt: skip


def test_given_its_run_a_proposal_id_reused_by_another_run_is_not_its_life(
    contracts: ContractSet,
) -> None:
    """Proposals, results and approved calls of every run are read (the run's partition
    narrows the topics keyed by run only): another run's records under the same id are
    left out, not shown as its life, and their last answer is not its final one."""
    life = _routed_life(contracts)
    other_env = _proposal(run_id="run-other", arguments={"not": "an order"})
    other = _decided(other_env, contracts, NOW_MS + 100)
    assert other.proposal is not None and other.proposal.proposal_id == PID
    others = [
        _raw(T.proposals, 30, NOW_MS + 99, orjson.dumps(other_env)),
        _raw(T.observations, 31, NOW_MS + 100, encode_observation(other, None)),
        _raw(T.results, 32, NOW_MS + 101, _result(run_id="run-other", attempt=2)),
    ]
    t = assemble(PID, collect(PID, [*life, *others], ROLES, Counter(), "run-1"), READING)
    assert [e.offset for e in t.entries] == [7, 3, 4, 9, 8] and t.warnings == []
    assert t.final is not None and t.final.gist["decision"] == "COMPLETED"
    # Without its run, both are shown, and the analyst is told.
    t = assemble(PID, collect(PID, [*life, *others], ROLES, Counter()), READING)
    assert "proposed 2 times under this id" in t.warnings
    assert "the id is used by 2 runs (run-1, run-other): --run-id shows one run's" in t.warnings
