"""``trace``'s pure parts: records read back, linked into one proposal's life, summed up.

Every record is made by the processor's own encoders from a real decision, so a change
to what the processor writes shows up here.
"""

from __future__ import annotations

import io
from collections import Counter
from typing import Any

import orjson
import pytest
from confluent_kafka import KafkaError, KafkaException
from rich.console import Console
from typer.testing import CliRunner

from processor.cli import app
from processor.codec.avro import codec
from processor.codec.records import (
    dlq_headers,
    encode_approval_request,
    encode_approved_call,
    encode_observation,
    encode_result,
    observation_record,
)
from processor.config import Topics
from processor.contracts.registry import ContractSet
from processor.model import Decision
from processor.results import compensation_key, compensation_proposal_id
from processor.trace import (
    COMPENSATION_ID_PREFIX,
    Entry,
    Raw,
    Reading,
    assemble,
    collect,
    render,
    sight,
    topic_roles,
)
from tests.unit.helpers import NOW_MS, decide_envelope, envelope

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
        T.proposals: 2,
        T.observations: 2,
        EXEC: 1,
        T.results: 1,
        T.approval_requests: 1,
        T.approvals: 1,
    }
    reading = Reading(list(ROLES), None, None, undecodable=dict(bad))
    _, warnings, _ = _trace([_raw(T.observations, 11, NOW_MS, observation)], reading)
    assert any(w.startswith("8 record(s) that may name it could not be decoded") for w in warnings)


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
