"""Gate 1, parse: strict JSON, the envelope, arguments vs arguments_raw, dead letters."""

from __future__ import annotations

import hashlib
import json
from typing import Any

import orjson
import pytest

from processor.contracts.validation import reference_validator
from processor.gates.parse import (
    COMPENSATION_PREFIX,
    MAX_APPROVALS,
    DeadLetter,
    Limits,
    _depth,
    parse_proposal,
    strict_loads,
)
from processor.model import FieldError, Gate, Proposal, Rejection, TaxonomyClass
from tests.unit.helpers import LIMITS, OFFSET, PARTITION, SCHEMAS_DIR, TOPIC, envelope, record

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
TRACEPARENT = f"00-{TRACE_ID}-00f067aa0ba902b7-01"
DERIVED_ID = f"unidentified:{TOPIC}:{PARTITION}:{OFFSET}"


def parsed(
    value: bytes, limits: Limits = LIMITS
) -> tuple[Proposal, Rejection | None, tuple[str, ...]]:
    result = parse_proposal(record(value), limits)
    assert not isinstance(result, DeadLetter), result
    return result


def rejected(value: bytes, limits: Limits = LIMITS) -> tuple[Proposal, Rejection]:
    proposal, rejection, _ = parsed(value, limits)
    assert rejection is not None
    assert rejection.taxonomy is TaxonomyClass.SYNTACTIC_PARSE_FAIL
    assert rejection.gate is Gate.PARSE
    return proposal, rejection


def dead(value: bytes | None, limits: Limits = LIMITS) -> DeadLetter:
    result = parse_proposal(record(value), limits)
    assert isinstance(result, DeadLetter), result
    return result


def with_raw(raw: str, **fields: Any) -> bytes:
    """An otherwise valid envelope carrying ``raw`` as arguments_raw."""
    env = envelope(**fields)
    del env["arguments"]
    env["arguments_raw"] = raw
    return orjson.dumps(env)


def only_error(rejection: Rejection) -> FieldError:
    assert len(rejection.errors) == 1, rejection.errors
    return rejection.errors[0]


# --- the happy path ---------------------------------------------------------------------------


def test_valid_envelope_parses_every_field() -> None:
    env = envelope(
        tool="cancel_order",
        created_at="2026-11-22T10:00:00Z",
        workflow_id="wf-1",
        step=3,
        principal_token="tok",
        idempotency_key="ik-1",
        logical_operation_id="op-1",
        approvals=[{"approval_id": "a-1"}],
        active_tools=["cancel_order", "lookup_order"],
        traceparent=TRACEPARENT,
    )
    env["tool"] = {"name": "cancel_order", "version": "1.0.0"}
    proposal, rejection, warnings = parsed(orjson.dumps(env))
    assert rejection is None
    assert warnings == ()
    assert proposal.proposal_id == "prop-1"
    assert proposal.run_id == "run-1"
    assert proposal.tenant_id == "tenant-1"
    assert proposal.tool_name == "cancel_order"
    assert proposal.tool_version == "1.0.0"
    assert proposal.arguments == {
        "order_id": "WO-12345-A",
        "reason_code": "customer_request",
        "confirm": True,
    }
    assert proposal.created_at == "2026-11-22T10:00:00Z"
    assert proposal.workflow_id == "wf-1"
    assert proposal.step == 3
    assert proposal.principal_token == "tok"
    assert proposal.idempotency_key == "ik-1"
    assert proposal.logical_operation_id == "op-1"
    assert proposal.approvals == ({"approval_id": "a-1"},)
    assert proposal.active_tools == ("cancel_order", "lookup_order")
    assert proposal.traceparent == TRACEPARENT
    assert proposal.trace_id == TRACE_ID


@pytest.mark.parametrize("field", ["idempotency_key", "logical_operation_id"])
def test_a_key_is_at_most_256_characters_and_a_compensations_has_room_for_its_prefix(
    field: str,
) -> None:
    longest = "k" * 256
    proposal, rejection, _ = parsed(orjson.dumps(envelope(**{field: longest})))
    assert rejection is None and getattr(proposal, field) == longest
    _, rejection = rejected(orjson.dumps(envelope(**{field: longest + "k"})))
    assert only_error(rejection).field == field
    compensation = COMPENSATION_PREFIX + longest
    proposal, rejection, _ = parsed(orjson.dumps(envelope(**{field: compensation})))
    assert rejection is None and getattr(proposal, field) == compensation
    _, rejection = rejected(orjson.dumps(envelope(**{field: compensation + "k"})))
    assert only_error(rejection).field == field


def test_the_published_schema_takes_the_keys_the_gate_takes() -> None:
    """schemas/proposal.schema.json is what other languages build proposals from: it
    agrees with the gate on a key's length, a compensation's prefix included."""
    schema = orjson.loads((SCHEMAS_DIR / "proposal.schema.json").read_bytes())
    validator = reference_validator(schema)
    longest = "k" * 256
    for key in (longest, longest + "k", COMPENSATION_PREFIX + longest,
                COMPENSATION_PREFIX + longest + "k"):  # fmt: skip
        env = envelope(idempotency_key=key, logical_operation_id=key)
        _, rejection, _ = parsed(orjson.dumps(env))
        assert validator.is_valid(env) is (rejection is None), len(key)


def test_arguments_raw_is_parsed_into_arguments() -> None:
    proposal, rejection, _ = parsed(with_raw('{"order_id":"WO-12345-A","confirm":true}'))
    assert rejection is None
    assert proposal.arguments == {"order_id": "WO-12345-A", "confirm": True}


def test_empty_record_value_is_a_dead_letter() -> None:
    assert dead(None).reason == "empty"


# --- arguments vs arguments_raw ---------------------------------------------------------------


def test_both_arguments_and_arguments_raw_is_ambiguous() -> None:
    env = envelope(arguments_raw='{"order_id":"WO-12345-A"}')
    proposal, rejection = rejected(orjson.dumps(env))
    err = only_error(rejection)
    assert (err.field, err.code) == ("arguments", "ambiguous")
    assert proposal.arguments is None
    assert "arguments" in rejection.next_action
    assert "envelope is malformed" in rejection.next_action


def test_neither_arguments_nor_arguments_raw_is_missing() -> None:
    env = envelope()
    del env["arguments"]
    proposal, rejection = rejected(orjson.dumps(env))
    err = only_error(rejection)
    assert (err.field, err.code) == ("arguments", "missing_field")
    assert proposal.arguments is None


def test_arguments_must_be_an_object() -> None:
    _, rejection = rejected(orjson.dumps(envelope(arguments=["WO-12345-A"])))
    err = only_error(rejection)
    assert (err.field, err.code, err.expected, err.actual) == (
        "arguments",
        "invalid_value",
        "object",
        "list",
    )


def test_arguments_raw_must_be_a_string() -> None:
    env = envelope()
    del env["arguments"]
    env["arguments_raw"] = {"order_id": "WO-12345-A"}
    _, rejection = rejected(orjson.dumps(env))
    err = only_error(rejection)
    assert (err.field, err.code, err.actual) == ("arguments_raw", "invalid_value", "dict")


def test_arguments_raw_must_hold_one_object() -> None:
    _, rejection = rejected(with_raw("[1, 2]"))
    err = only_error(rejection)
    assert (err.field, err.code, err.expected) == ("arguments_raw", "invalid_value", "object")


@pytest.mark.parametrize(
    "raw",
    ['{"order_id":"WO-12', '{"order_id":"WO-12345-A",', '{"order_id":', "{", "", "   "],
)
def test_truncated_arguments_raw(raw: str) -> None:
    proposal, rejection = rejected(with_raw(raw))
    err = only_error(rejection)
    assert (err.field, err.code) == ("arguments_raw", "truncated")
    assert "cut off" in rejection.next_action
    assert proposal.arguments is None


@pytest.mark.parametrize(
    "raw",
    [
        '{"order_id":"WO-12345-A",}',
        "{'order_id':'WO-12345-A'}",
        "{order_id:1}",
        '{"a":1} trailing',
        '{"a":01}',
        # Complete, then a character that is whitespace to Python but not to JSON: not cut off.
        '{"a":1}\u00a0',
        '{"a":1}\u2028',
        '{"a":1}\u3000',
        '{"a":1}\x0c',
    ],
)
def test_invalid_json_in_arguments_raw(raw: str) -> None:
    _, rejection = rejected(with_raw(raw))
    err = only_error(rejection)
    assert (err.field, err.code) == ("arguments_raw", "invalid_json")
    assert "one valid JSON object" in rejection.next_action


def test_arguments_raw_too_large() -> None:
    _, rejection = rejected(with_raw('{"q":"' + "x" * 40 + '"}'), Limits(max_arguments_bytes=20))
    err = only_error(rejection)
    assert (err.field, err.code) == ("arguments_raw", "too_large")


def test_arguments_object_too_large() -> None:
    env = envelope(arguments={"q": "x" * 200})
    _, rejection = rejected(orjson.dumps(env), Limits(max_arguments_bytes=100))
    err = only_error(rejection)
    assert (err.field, err.code) == ("arguments", "too_large")


# --- strict JSON ------------------------------------------------------------------------------


@pytest.mark.parametrize("number", ["NaN", "Infinity", "-Infinity", "1e999", "-1e999"])
def test_non_finite_numbers_refused_in_arguments_raw(number: str) -> None:
    _, rejection = rejected(with_raw('{"amount":' + number + "}"))
    assert only_error(rejection).code == "invalid_json"


@pytest.mark.parametrize("number", [b"NaN", b"Infinity", b"-Infinity", b"1e999"])
def test_non_finite_numbers_refused_by_strict_loads(number: bytes) -> None:
    with pytest.raises(ValueError):
        strict_loads(b'{"amount":' + number + b"}", 32)


def test_non_finite_number_with_a_readable_run_is_answered_as_a_parse_failure() -> None:
    value = b'{"proposal_id":"p-7","run_id":"run-1","arguments":{"amount":NaN}}'
    proposal, rejection = rejected(value)
    assert (proposal.proposal_id, proposal.run_id) == ("p-7", "run-1")
    assert proposal.arguments is None
    first = rejection.errors[0]
    assert (first.field, first.code) == (None, "invalid_json")
    assert "not strict JSON" in rejection.next_action


def test_non_finite_run_id_is_a_dead_letter() -> None:
    assert dead(b'{"run_id":NaN,"arguments":{}}').reason == "invalid_json"


def test_duplicate_key_in_envelope_is_a_dead_letter() -> None:
    letter = dead(b'{"run_id":"run-1","run_id":"run-2"}')
    assert letter.reason == "duplicate_key"
    assert "'run_id'" in letter.detail


def test_duplicate_key_in_envelope_is_a_dead_letter_even_with_a_run_id() -> None:
    # The duplicate check runs on the whole envelope before run_id is read, so a
    # duplicated tenant_id cannot be answered on the run's observations.
    value = (
        b'{"proposal_id":"p","run_id":"run-1","tenant_id":"a","tenant_id":"b",'
        b'"tool":{"name":"cancel_order"},"arguments":{}}'
    )
    letter = dead(value)
    assert letter.reason == "duplicate_key"
    assert "'tenant_id'" in letter.detail


def test_duplicate_key_inside_arguments_object_is_answered_as_a_parse_failure() -> None:
    value = b'{"run_id":"run-1","arguments":{"order_id":"WO-1","order_id":"WO-2"}}'
    proposal, rejection = rejected(value)
    assert proposal.arguments is None
    first = rejection.errors[0]
    assert first.code == "duplicate_key" and "'order_id'" in first.message


def test_duplicate_key_in_arguments_raw_is_a_parse_failure() -> None:
    proposal, rejection = rejected(with_raw('{"order_id":"WO-12345-A","order_id":"WO-99999-Z"}'))
    err = only_error(rejection)
    assert (err.field, err.code) == ("arguments_raw", "duplicate_key")
    assert "'order_id'" in err.message
    assert rejection.next_action.startswith("Emit each argument once")
    assert proposal.arguments is None


@pytest.mark.parametrize(
    "raw",
    [
        '{"a":1,"\\u0061":2}',
        '{"\\u0061":1,"a":2}',
        '{"a":1,"\\u0061":1}',
        '{"x":[{"c":1,"\\u0063":2}]}',
        '{"x":{"y":{"k":1,"k":2}}}',
    ],
)
def test_duplicate_keys_behind_escapes_or_nested_are_caught(raw: str) -> None:
    _, rejection = rejected(with_raw(raw))
    assert only_error(rejection).code == "duplicate_key"


def test_escaped_duplicate_run_id_in_envelope_is_a_dead_letter() -> None:
    assert dead(b'{"run_id":"run-1","\\u0072un_id":"run-2"}').reason == "duplicate_key"


def test_escaped_duplicate_raises_in_strict_loads() -> None:
    with pytest.raises(ValueError, match="duplicate key 'a'"):
        strict_loads(b'{"a":1,"\\u0061":2}', 32)


def test_a_duplicated_key_that_is_a_credential_is_not_quoted_back() -> None:
    key = "sk_live_4eC39HqLyjWDarjtT1zdp7dc"
    with pytest.raises(ValueError, match="duplicate key 'sk_l…'"):
        strict_loads(f'{{"{key}":1,"{key}":2}}'.encode(), 32)


def test_whitespace_formatted_json_takes_the_slow_path_and_parses() -> None:
    text = b'{\n  "a" : [ 1 , 2.5 ],\n  "b" : { "c" : "d\\u00e9" } ,"e":null }  '
    assert strict_loads(text, 32) == {"a": [1, 2.5], "b": {"c": "d\u00e9"}, "e": None}
    proposal, rejection, _ = parsed(with_raw('{ "order_id" : "WO-12345-A" ,\n "confirm" : true }'))
    assert rejection is None
    assert proposal.arguments == {"order_id": "WO-12345-A", "confirm": True}


def test_whitespace_formatted_envelope_parses() -> None:
    value = orjson.dumps(envelope(), option=orjson.OPT_INDENT_2)
    proposal, rejection, _ = parsed(value)
    assert rejection is None
    assert proposal.run_id == "run-1"
    assert proposal.arguments["order_id"] == "WO-12345-A"


def test_whitespace_does_not_hide_duplicates() -> None:
    with pytest.raises(ValueError, match="duplicate key 'k'"):
        strict_loads(b'{ "k" : 1 ,\n "k" : 1 }', 32)


# --- depth ------------------------------------------------------------------------------------


def test_depth_at_the_limit_is_accepted() -> None:
    assert strict_loads(b"[" * 32 + b"]" * 32, 32) == _nested_list(32)


def test_depth_over_the_limit_is_refused() -> None:
    with pytest.raises(ValueError, match="33 levels"):
        strict_loads(b"[" * 33 + b"]" * 33, 32)


def test_the_depth_limit_does_not_hang_on_other_brackets_in_the_text() -> None:
    """33 arrays around a number are refused and 32 accepted, whatever else the text holds:
    a scalar in the deepest array counted as a level of its own, 32 arrays around one were
    refused when the text held one more bracket elsewhere and accepted when it did not."""
    deep = b"[" * 32 + b"1" + b"]" * 32
    assert strict_loads(deep, 32) is not None
    assert strict_loads(b"[" + deep + b",[]]", 33) is not None
    assert strict_loads(b'{"x":' + deep + b',"y":[]}', 33) is not None
    with pytest.raises(ValueError, match="33 levels"):
        strict_loads(b"[" * 33 + b"1" + b"]" * 33, 32)
    deepest = '{"a":' + "[" * 31 + "1" + "]" * 31  # (32 levels: the object and 31 arrays)
    for raw in (deepest + "}", deepest + ',"b":[]}'):
        _, rejection, _ = parsed(with_raw(raw))
        assert rejection is None, rejection
    _, rejection = rejected(with_raw(deepest.replace("[", "[[", 1).replace("]", "]]", 1) + "}"))
    assert (only_error(rejection).field, only_error(rejection).code) == (
        "arguments_raw",
        "too_deep",
    )


def test_very_deep_nesting_is_refused_without_recursion_error() -> None:
    # RecursionError is not a ValueError: this fails if a recursive parser is reached.
    with pytest.raises(ValueError):
        strict_loads(b"[" * 50_000 + b"]" * 50_000, 32)
    with pytest.raises(ValueError):
        strict_loads(b'{"a":' * 5_000 + b"1" + b"}" * 5_000, 32)


@pytest.mark.parametrize("levels", [40, 2_000])
def test_deep_arguments_raw_is_too_deep(levels: int) -> None:
    _, rejection = rejected(with_raw("[" * levels + "]" * levels))
    err = only_error(rejection)
    assert (err.field, err.code) == ("arguments_raw", "too_deep")


def test_deep_arguments_object_is_too_deep() -> None:
    # 34 levels of arguments: the envelope (35) is within its own allowance of 32 + 4.
    env = envelope(arguments={"a": _nested_list(33)})
    _, rejection = rejected(orjson.dumps(env))
    err = only_error(rejection)
    assert (err.field, err.code) == ("arguments", "too_deep")


def test_very_deep_envelope_is_a_dead_letter() -> None:
    value = b'{"run_id":"run-1","x":' + b"[" * 3_000 + b"]" * 3_000 + b"}"
    assert dead(value).reason == "too_deep"


def _nested_list(levels: int) -> Any:
    value: Any = []
    for _ in range(levels - 1):
        value = [value]
    return value


# --- encoding ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "value",
    [
        b'{"run_id":"run-1","x":"\xff"}',
        b'{"run_id":"run-1","x":"\xc3"}',
        b'{"run_id":"run-1","x":"\xed\xa0\x80"}',
        b'\xef\xbb\xbf{"run_id":"run-1"}',
        b'\xff\xfe{\x00"\x00r\x00u\x00n\x00_\x00i\x00d\x00"\x00:\x001\x00}\x00',
        b'{"run_id":"\\ud800"}',
    ],
)
def test_invalid_utf8_and_unreadable_runs_are_dead_letters(value: bytes) -> None:
    assert dead(value).reason == "invalid_json"


@pytest.mark.parametrize("escape", [b"\\ud800", b"\\udc00\\ud800"])
def test_lone_surrogate_beside_a_readable_run_is_a_parse_failure(escape: bytes) -> None:
    proposal, rejection = rejected(b'{"run_id":"run-1","x":"' + escape + b'"}')
    assert proposal.run_id == "run-1"
    assert rejection.errors[0].code == "invalid_json"


def test_lone_surrogate_in_arguments_raw_is_a_parse_failure() -> None:
    _, rejection = rejected(with_raw('{"a":"\\ud800"}'))
    assert only_error(rejection).code == "invalid_json"


def test_surrogate_pair_is_accepted() -> None:
    proposal, rejection, _ = parsed(with_raw('{"a":"\\ud83d\\ude00"}'))
    assert rejection is None
    assert proposal.arguments == {"a": "\U0001f600"}


# --- the envelope -----------------------------------------------------------------------------


@pytest.mark.parametrize("value", [b"[1]", b'"run-1"', b"1", b"null", b"true"])
def test_non_object_envelope(value: bytes) -> None:
    assert dead(value).reason == "not_object"


@pytest.mark.parametrize(
    "run_id", [None, 5, "", "x" * 257, "run\n1", ["run-1"], {"id": "run-1"}, True]
)
def test_unusable_run_id(run_id: Any) -> None:
    env = envelope()
    if run_id is None:
        del env["run_id"]
    else:
        env["run_id"] = run_id
    letter = dead(orjson.dumps(env))
    assert letter.reason == "no_run_id"


def test_run_id_at_the_length_limit_is_accepted() -> None:
    proposal, rejection, _ = parsed(orjson.dumps(envelope(run_id="r" * 256)))
    assert rejection is None
    assert proposal.run_id == "r" * 256


def test_missing_proposal_id_gets_a_derived_id_and_an_error() -> None:
    env = envelope()
    del env["proposal_id"]
    proposal, rejection = rejected(orjson.dumps(env))
    assert proposal.proposal_id == DERIVED_ID
    assert proposal.trace_id == hashlib.sha256(DERIVED_ID.encode()).hexdigest()[:32]
    err = only_error(rejection)
    assert (err.field, err.code, err.expected) == ("proposal_id", "missing_field", "string")
    assert "envelope is malformed (proposal_id)" in rejection.next_action


def test_non_string_proposal_id_gets_a_derived_id_and_an_error() -> None:
    proposal, rejection = rejected(orjson.dumps(envelope(proposal_id=7)))
    assert proposal.proposal_id == DERIVED_ID
    err = only_error(rejection)
    assert (err.field, err.code, err.actual) == ("proposal_id", "invalid_value", "int")


def test_missing_tenant_id() -> None:
    env = envelope()
    del env["tenant_id"]
    proposal, rejection = rejected(orjson.dumps(env))
    assert proposal.tenant_id is None
    assert proposal.proposal_id == "prop-1"
    err = only_error(rejection)
    assert (err.field, err.code) == ("tenant_id", "missing_field")


@pytest.mark.parametrize(
    ("tool", "field", "code", "actual"),
    [
        ("cancel_order", "tool", "invalid_value", "string"),
        (["cancel_order"], "tool", "invalid_value", "list"),
        ({"version": "1.0.0"}, "tool/name", "missing_field", None),
        ({"name": 5}, "tool/name", "invalid_value", "int"),
        ({"name": ""}, "tool/name", "invalid_value", "string"),
        ({"name": "cancel_order", "version": 1}, "tool/version", "invalid_value", "int"),
        ({"name": "cancel_order", "args": {}}, "tool", "unknown_field", None),
    ],
)
def test_tool_must_be_an_object_with_a_name(
    tool: Any, field: str, code: str, actual: str | None
) -> None:
    env = envelope()
    env["tool"] = tool
    _, rejection = rejected(orjson.dumps(env))
    err = only_error(rejection)
    assert (err.field, err.code, err.actual) == (field, code, actual)


def test_missing_tool() -> None:
    env = envelope()
    del env["tool"]
    proposal, rejection = rejected(orjson.dumps(env))
    err = only_error(rejection)
    assert (err.field, err.code, err.expected) == ("tool", "missing_field", "object")
    assert proposal.tool_name is None


def test_every_envelope_error_is_reported_at_once() -> None:
    value = b'{"run_id":"run-1","tool":"x","step":-1,"arguments":{}}'
    _, rejection = rejected(value)
    assert [(e.field, e.code) for e in rejection.errors] == [
        ("proposal_id", "missing_field"),
        ("tenant_id", "missing_field"),
        ("tool", "invalid_value"),
        ("step", "invalid_value"),
    ]


@pytest.mark.parametrize("step", [-1, True, 1.5, "3", 1_000_001])
def test_step_must_be_a_non_negative_integer(step: Any) -> None:
    proposal, rejection = rejected(orjson.dumps(envelope(step=step)))
    assert (only_error(rejection).field, only_error(rejection).code) == ("step", "invalid_value")
    assert proposal.step is None


@pytest.mark.parametrize("active", ["cancel_order", [1], [None]])
def test_active_tools_must_be_a_list_of_names(active: Any) -> None:
    proposal, rejection = rejected(orjson.dumps(envelope(active_tools=active)))
    assert (only_error(rejection).field, only_error(rejection).code) == (
        "active_tools",
        "invalid_value",
    )
    assert proposal.active_tools is None


def test_a_proposal_carries_at_most_a_few_approvals() -> None:
    """Each approval costs a signature check: a record full of them is refused unread."""
    one = {"approval_id": "a", "approver_id": "ops-1", "signature": "A" * 86}
    proposal, rejection = rejected(orjson.dumps(envelope(approvals=[one] * (MAX_APPROVALS + 1))))
    assert (only_error(rejection).field, only_error(rejection).code) == (
        "approvals",
        "invalid_value",
    )
    assert proposal.approvals == ()
    accepted, refusal, _ = parsed(orjson.dumps(envelope(approvals=[one] * MAX_APPROVALS)))
    assert refusal is None
    assert len(accepted.approvals) == MAX_APPROVALS


def test_unknown_envelope_fields_are_a_warning_not_an_error() -> None:
    proposal, rejection, warnings = parsed(orjson.dumps(envelope(zeta=1, alpha="x")))
    assert rejection is None
    assert warnings == ("ignored unknown envelope fields: alpha, zeta",)
    assert proposal.arguments is not None


def test_traceparent_gives_the_trace_id() -> None:
    proposal, rejection, warnings = parsed(orjson.dumps(envelope(traceparent=TRACEPARENT)))
    assert rejection is None
    assert warnings == ()
    assert proposal.trace_id == TRACE_ID
    assert proposal.traceparent == TRACEPARENT


@pytest.mark.parametrize(
    "traceparent",
    [
        "garbage",
        f"01-{TRACE_ID}-00f067aa0ba902b7-01",
        f"00-{TRACE_ID.upper()}-00f067aa0ba902b7-01",
        f"00-{TRACE_ID}-00f067aa0ba902b7",
    ],
)
def test_invalid_traceparent_gives_a_derived_trace_id_and_a_warning(traceparent: str) -> None:
    proposal, rejection, warnings = parsed(orjson.dumps(envelope(traceparent=traceparent)))
    assert rejection is None
    assert warnings == ("traceparent is not W3C trace context; a trace id was derived instead",)
    assert proposal.trace_id == hashlib.sha256(b"prop-1").hexdigest()[:32]
    assert proposal.trace_id != TRACE_ID


def test_too_large_record_is_a_dead_letter() -> None:
    value = orjson.dumps(envelope())
    letter = dead(value, Limits(max_record_bytes=len(value) - 1))
    assert letter.reason == "too_large"
    assert letter.detail == f"{len(value)} bytes; at most {len(value) - 1}"
    proposal, rejection, _ = parsed(value, Limits(max_record_bytes=len(value)))
    assert rejection is None
    assert proposal.run_id == "run-1"


@pytest.mark.parametrize("levels", [254, 255, 256])
def test_nesting_past_what_orjson_writes_is_read_within_the_limit(levels: int) -> None:
    """orjson reads 1024 levels but writes only 254: a value nested deeper, within the
    caller's limit, is read exactly (a repeated key in it still found), never a TypeError."""
    text = b'{"a":' * (levels - 1) + b"[1.5]" + b"}" * (levels - 1)
    value = strict_loads(text, 256)
    for _ in range(levels - 1):
        value = value["a"]
    assert value == [1.5]
    repeated = b'{"a":' * (levels - 2) + b'{"b":[],"b":[]}' + b"}" * (levels - 2)
    with pytest.raises(ValueError, match="duplicate key"):
        strict_loads(repeated, 256)


def test_integers_beyond_64_bits_keep_every_digit() -> None:
    big = 99999999999999999999999
    value = strict_loads(b'{"n":' + str(big).encode() + b',"m":[1.5]}', 32)
    assert value == {"n": big, "m": [1.5]}
    assert type(value["n"]) is int


@pytest.mark.parametrize("depth", [100, 300, 600, 990])
def test_deep_records_decide_the_same_whatever_the_callers_stack(depth: int) -> None:
    value = b'{"run_id":"run-1","x":' + b"[" * depth + b"]" * depth + b"}"

    def outcome() -> str:
        result = parse_proposal(record(value), LIMITS)
        return result.reason if isinstance(result, DeadLetter) else "answered"

    def nested(levels: int) -> str:
        return outcome() if levels == 0 else nested(levels - 1)

    shallow = outcome()
    assert nested(700) == shallow
    assert shallow == ("answered" if depth < 255 else "too_deep")


def test_integers_beyond_64_bits_in_a_large_record_are_measured_not_an_internal_error() -> None:
    """orjson writes no integer beyond 64 bits, and the exact parser keeps them whole: the
    size of the arguments of a record over the arguments limit is still measured, and
    they are answered as any arguments of that size are."""
    big = 10**30
    small = envelope(arguments={"order_id": "WO-12345-A", "n": big},
                     note="x" * LIMITS.max_arguments_bytes)  # fmt: skip
    proposal, rejection, _ = parsed(json.dumps(small).encode())
    assert rejection is None
    assert proposal.arguments["n"] == big
    large = envelope(arguments={"order_id": "WO-12345-A", "n": [big] * 3_000})
    _, rejection = rejected(json.dumps(large).encode())
    err = only_error(rejection)
    assert (err.field, err.code) == ("arguments", "too_large")


def test_a_strict_failure_that_leaves_no_run_is_worded_as_such() -> None:
    letter = dead(b'{"run_id":"","x":NaN}')
    assert letter.reason == "invalid_json"
    assert letter.detail.startswith("envelope is not strict JSON: "), letter.detail


@pytest.mark.parametrize(
    "name", ["AKIAIOSFODNN7EXAMPLE", "sk_live_4eC39HqLyjWDarjtT1zdp7dc", "password=hunter2"]
)
def test_field_names_that_are_credentials_are_not_quoted_back(name: str) -> None:
    """The parse gate answers before the credential scan: the names it quotes back (an
    unknown field of ``tool``, an ignored envelope field) are redacted as the scan would."""
    env = envelope()
    env["tool"] = {"name": "cancel_order", name: 1}
    _, rejection = rejected(orjson.dumps(env))
    assert name not in only_error(rejection).message
    assert name[:4] + "\u2026" in only_error(rejection).message
    _, refusal, warnings = parsed(orjson.dumps(envelope(**{name: 1})))
    assert refusal is None
    assert len(warnings) == 1 and name not in warnings[0] and name[:4] in warnings[0]


def test_a_tool_of_many_unknown_fields_is_answered_with_a_few_names() -> None:
    env = envelope()
    env["tool"] = {"name": "cancel_order", **{f"k{i:06d}": i for i in range(50_000)}}
    _, rejection = rejected(orjson.dumps(env))
    message = only_error(rejection).message
    assert "k000000" in message and "k000009" in message and "k000010" not in message
    assert len(message) < 1_000


@pytest.mark.parametrize(
    "value",
    [1, [], {}, [[]], [[], {}], {"a": [1, {"b": []}]}, [[[[[[[]]]]]]], [1, [2, [3]], {"x": {}}]],
)
def test_depth_counts_every_level_of_a_value(value: Any) -> None:
    """Objects and arrays, one inside another: a scalar is no level, so the bracket count
    the callers check first bounds the depth (n brackets, at most n levels)."""

    def reference(node: Any) -> int:
        if type(node) is not dict and type(node) is not list:
            return 0
        children = node.values() if type(node) is dict else node
        return 1 + max(map(reference, children), default=0)

    assert _depth(value) == reference(value)
    wide = [value, [value], {"k": [[value]]}, *([[]] * 1_000)]
    assert _depth(wide) == reference(wide)


def test_a_long_duplicated_key_is_quoted_in_part() -> None:
    key = "k" * 200_000
    with pytest.raises(ValueError, match=r"^duplicate key 'k{61}\.\.\.'$"):
        strict_loads(f'{{"{key}":1, "{key}":2}}'.encode(), 32)


def test_a_complete_envelope_with_trailing_junk_is_not_called_truncated() -> None:
    letter = dead(b'{"run_id":"","x":1}\x0b')
    assert letter.reason == "invalid_json"


@pytest.mark.parametrize(
    "value", ['{"run_id":"r","x":"\u00e9\u00e9\u00e9', '{"run_id":"r","x":"\u65e5\u672c", "y":']
)
def test_an_envelope_cut_after_characters_of_several_bytes_is_truncated(value: str) -> None:
    """The parser counts characters, not bytes: a record whose text is cut off is called
    truncated whatever its characters' width."""
    assert dead(value.encode()).reason == "truncated"
