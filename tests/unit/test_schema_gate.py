"""Gate 3, schema, through ``pipeline.decide``: classification, field errors, hints, routing."""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import orjson
import pytest
import yaml

from processor.contracts.registry import Contract, ContractSet, load_contracts
from processor.gates.schema import check_arguments
from processor.model import (
    Decision,
    FieldError,
    Gate,
    Outcome,
    Rejection,
    SideEffectClass,
    TaxonomyClass,
)
from tests.unit.helpers import (
    CONTRACTS_DIR,
    NOW_MS,
    VALID_ARGUMENTS,
    decide_arguments,
    decide_envelope,
    envelope,
)

CANCEL_FIELDS = "order_id, reason_code, confirm"


def cancel(**changes: Any) -> dict[str, Any]:
    args = dict(VALID_ARGUMENTS["cancel_order"])
    args.update(changes)
    return args


def rejected(
    contracts: ContractSet, tool: str, arguments: dict[str, Any], taxonomy: TaxonomyClass
) -> Decision:
    d = decide_arguments(contracts, tool, arguments)
    assert d.outcome is Outcome.REJECTED, d
    assert d.gate is Gate.SCHEMA
    assert d.rejection is not None
    assert d.rejection.taxonomy is taxonomy, d.rejection
    assert d.call is None
    assert d.contract_name == tool
    assert d.contract_version == "1.0.0"
    return d


def errors(d: Decision) -> tuple[FieldError, ...]:
    assert d.rejection is not None
    return d.rejection.errors


def routed(contracts: ContractSet, tool: str, arguments: dict[str, Any], **fields: Any) -> Decision:
    """Through every gate: routed, or (for a tool that needs approval) parked at the last."""
    d = decide_arguments(contracts, tool, arguments, **fields)
    if d.outcome is Outcome.PARKED:
        assert d.gate is Gate.CONFIRMATION and d.approval_request is not None
        assert d.taxonomy is TaxonomyClass.CONFIRMATION_MISSING
    else:
        assert d.outcome is Outcome.ROUTED, d.rejection
        assert d.gate is Gate.ROUTE
        assert d.rejection is None
        assert d.taxonomy is TaxonomyClass.SUCCESS
    assert d.call is not None
    return d


# --- the seed cases ---------------------------------------------------------------------------


@pytest.mark.parametrize("order_id", ["ORD-12345", "WO-12345", "WO-12345-a", "WO-12345-A\n"])
def test_invented_order_id_is_out_of_bounds(order_id: str, contracts: ContractSet) -> None:
    d = rejected(contracts, "cancel_order", cancel(order_id=order_id), TaxonomyClass.OUT_OF_BOUNDS)
    (err,) = errors(d)
    assert err.field == "order_id"
    assert err.code == "pattern_mismatch"
    assert err.expected == "^WO-[0-9]{5}-[A-Z]$"
    assert err.actual == orjson.dumps(order_id).decode()
    assert err.hint is not None
    assert "lookup_order" in err.hint
    assert "WO-12345-A" in err.hint
    assert d.rejection is not None
    action = d.rejection.next_action
    assert "lookup_order" in action
    assert "WO-12345-A" in action
    assert action.endswith("then call cancel_order again.")


def test_string_limit_is_a_type_mismatch(contracts: ContractSet) -> None:
    d = rejected(
        contracts,
        "search_kb",
        {"query": "return policy", "limit": "10"},
        TaxonomyClass.TYPE_MISMATCH,
    )
    (err,) = errors(d)
    assert (err.field, err.code, err.expected, err.actual) == (
        "limit",
        "type_mismatch",
        "integer",
        "string",
    )
    assert d.rejection is not None
    assert 'emit 10 not "10"' in d.rejection.next_action


def test_unknown_field_is_structural(contracts: ContractSet) -> None:
    d = rejected(
        contracts,
        "cancel_order",
        cancel(notify_customer=True),
        TaxonomyClass.STRUCTURAL_VIOLATION,
    )
    (err,) = errors(d)
    assert (err.field, err.code) == ("notify_customer", "unknown_field")
    assert err.message == "notify_customer is not a field of cancel_order"
    assert err.hint == f"remove notify_customer; accepted fields: {CANCEL_FIELDS}"


def test_every_missing_field_is_reported_once(contracts: ContractSet) -> None:
    d = rejected(contracts, "cancel_order", {}, TaxonomyClass.STRUCTURAL_VIOLATION)
    assert [(e.field, e.code, e.expected) for e in errors(d)] == [
        ("order_id", "missing_field", "string"),
        ("reason_code", "missing_field", "string"),
        ("confirm", "missing_field", "boolean"),
    ]
    hints = [e.hint for e in errors(d)]
    assert hints[0] == "add order_id (obtain it via lookup_order; never invent it)"
    assert hints[1] is not None and hints[1].startswith("add reason_code (one of: customer_request")
    assert hints[2] == "add confirm"


def test_some_missing_fields(contracts: ContractSet) -> None:
    args = {"customer_id": "CUS-004211", "category": "delivery"}
    d = rejected(contracts, "create_ticket", args, TaxonomyClass.STRUCTURAL_VIOLATION)
    assert [(e.field, e.code) for e in errors(d)] == [
        ("priority", "missing_field"),
        ("summary", "missing_field"),
    ]


def test_enum_typo_is_out_of_bounds_with_a_suggestion(contracts: ContractSet) -> None:
    d = rejected(
        contracts,
        "cancel_order",
        cancel(reason_code="customer_requst"),
        TaxonomyClass.OUT_OF_BOUNDS,
    )
    (err,) = errors(d)
    assert (err.field, err.code, err.actual) == ("reason_code", "not_in_enum", '"customer_requst"')
    assert err.hint is not None
    assert err.hint.endswith("(did you mean customer_request?)")


def test_enum_far_off_has_no_suggestion(contracts: ContractSet) -> None:
    d = rejected(contracts, "cancel_order", cancel(reason_code="zzz"), TaxonomyClass.OUT_OF_BOUNDS)
    (err,) = errors(d)
    assert err.code == "not_in_enum"
    assert err.hint is not None
    assert "did you mean" not in err.hint


# --- classification priority ------------------------------------------------------------------


def test_structural_beats_type_beats_bounds(contracts: ContractSet) -> None:
    args = {"order_id": 5, "reason_code": "customer_requst", "notify": 1}
    d = rejected(contracts, "cancel_order", args, TaxonomyClass.STRUCTURAL_VIOLATION)
    assert sorted((e.field, e.code) for e in errors(d)) == [
        ("confirm", "missing_field"),
        ("notify", "unknown_field"),
        ("order_id", "type_mismatch"),
        ("reason_code", "not_in_enum"),
    ]


def test_type_beats_bounds(contracts: ContractSet) -> None:
    args = cancel(order_id=5, reason_code="customer_requst")
    d = rejected(contracts, "cancel_order", args, TaxonomyClass.TYPE_MISMATCH)
    assert sorted((e.field, e.code) for e in errors(d)) == [
        ("order_id", "type_mismatch"),
        ("reason_code", "not_in_enum"),
    ]


def test_bounds_alone(contracts: ContractSet) -> None:
    args = cancel(order_id="ORD-1", reason_code="customer_requst")
    d = rejected(contracts, "cancel_order", args, TaxonomyClass.OUT_OF_BOUNDS)
    assert sorted((e.field, e.code) for e in errors(d)) == [
        ("order_id", "pattern_mismatch"),
        ("reason_code", "not_in_enum"),
    ]


def test_lookups_come_first_in_next_action(contracts: ContractSet) -> None:
    args = cancel(order_id="ORD-1", reason_code="customer_requst")
    d = rejected(contracts, "cancel_order", args, TaxonomyClass.OUT_OF_BOUNDS)
    assert d.rejection is not None
    assert d.rejection.next_action.startswith(
        "order_id must look like WO-12345-A; call lookup_order"
    )


# --- other keywords ---------------------------------------------------------------------------


def test_lookup_order_needs_one_alternative(contracts: ContractSet) -> None:
    d = rejected(contracts, "lookup_order", {"limit": 5}, TaxonomyClass.STRUCTURAL_VIOLATION)
    (err,) = errors(d)
    assert err.field is None
    assert err.code == "missing_alternative"
    assert err.hint == "provide order_id or customer_id or date_from and date_to"


def test_lookup_order_half_a_date_range_is_not_an_alternative(contracts: ContractSet) -> None:
    d = rejected(
        contracts, "lookup_order", {"date_from": "2026-11-16"}, TaxonomyClass.STRUCTURAL_VIOLATION
    )
    assert [e.code for e in errors(d)] == ["missing_alternative"]


def test_lookup_order_date_range_routes(contracts: ContractSet) -> None:
    args = {"date_from": "2026-11-16", "date_to": "2026-11-22"}
    d = routed(contracts, "lookup_order", args)
    assert d.side_effect_class is SideEffectClass.READ_ONLY


@pytest.mark.parametrize("date", ["2026-02-30", "2026-1-01", "\u0662026-01-01", "26-01-01"])
def test_bad_date_is_out_of_bounds(date: str, contracts: ContractSet) -> None:
    args = {"date_from": "2026-01-01", "date_to": date}
    d = rejected(contracts, "lookup_order", args, TaxonomyClass.OUT_OF_BOUNDS)
    (err,) = errors(d)
    assert (err.field, err.code, err.expected) == ("date_to", "bad_format", "date")


def test_refund_amount_with_cents_is_a_multiple_of_a_cent(contracts: ContractSet) -> None:
    d = routed(contracts, "refund_order", VALID_ARGUMENTS["refund_order"])
    assert d.side_effect_class is SideEffectClass.CRITICAL_MUTATION
    assert d.post_action_verification is True


def test_refund_amount_with_fractions_of_a_cent(contracts: ContractSet) -> None:
    args = dict(VALID_ARGUMENTS["refund_order"], amount=19.999)
    d = rejected(contracts, "refund_order", args, TaxonomyClass.OUT_OF_BOUNDS)
    (err,) = errors(d)
    assert (err.field, err.code, err.expected) == ("amount", "not_multiple", "a multiple of 0.01")


@pytest.mark.parametrize(("amount", "code"), [(-5, "below_minimum"), (0, "below_minimum")])
def test_refund_amount_must_be_positive(amount: int, code: str, contracts: ContractSet) -> None:
    args = dict(VALID_ARGUMENTS["refund_order"], amount=amount)
    d = rejected(contracts, "refund_order", args, TaxonomyClass.OUT_OF_BOUNDS)
    (err,) = errors(d)
    assert (err.field, err.code, err.hint) == ("amount", code, "amount must be greater than 0")


def test_refund_amount_maximum(contracts: ContractSet) -> None:
    args = dict(VALID_ARGUMENTS["refund_order"], amount=10000.01)
    d = rejected(contracts, "refund_order", args, TaxonomyClass.OUT_OF_BOUNDS)
    (err,) = errors(d)
    assert (err.field, err.code, err.hint) == (
        "amount",
        "above_maximum",
        "amount must be at most 10000",
    )
    routed(contracts, "refund_order", dict(VALID_ARGUMENTS["refund_order"], amount=10000))


def test_boolean_where_string_expected(contracts: ContractSet) -> None:
    d = rejected(contracts, "cancel_order", cancel(order_id=True), TaxonomyClass.TYPE_MISMATCH)
    (err,) = errors(d)
    assert (err.field, err.code, err.expected, err.actual) == (
        "order_id",
        "type_mismatch",
        "string",
        "boolean",
    )
    assert err.hint == "order_id must be string, not boolean"


def test_number_where_string_expected(contracts: ContractSet) -> None:
    d = rejected(contracts, "search_kb", {"query": 123}, TaxonomyClass.TYPE_MISMATCH)
    (err,) = errors(d)
    assert err.hint == 'query must be a string: emit "123" not 123'


def test_string_true_where_boolean_expected(contracts: ContractSet) -> None:
    d = rejected(contracts, "cancel_order", cancel(confirm="true"), TaxonomyClass.TYPE_MISMATCH)
    by_code = {e.code: e for e in errors(d)}
    assert by_code["type_mismatch"].field == "confirm"
    assert by_code["type_mismatch"].hint == 'confirm must be a boolean: emit true not "true"'
    # The const hint names the JSON literal, not Python's True.
    assert by_code["const_mismatch"].hint == "confirm must be exactly true"
    assert d.rejection is not None
    assert 'emit true not "true"' in d.rejection.next_action


def test_false_where_const_true(contracts: ContractSet) -> None:
    d = rejected(contracts, "cancel_order", cancel(confirm=False), TaxonomyClass.OUT_OF_BOUNDS)
    (err,) = errors(d)
    assert (err.field, err.code, err.expected, err.actual) == (
        "confirm",
        "const_mismatch",
        "true",
        "false",
    )


def test_integral_float_is_an_integer(contracts: ContractSet) -> None:
    # JSON Schema: 10.0 is an integer (a number with a zero fractional part).
    d = routed(contracts, "search_kb", {"query": "return policy", "limit": 10.0})
    assert d.call is not None
    assert d.call.canonical_arguments == '{"limit":10.0,"query":"return policy"}'


def test_fractional_float_is_not_an_integer(contracts: ContractSet) -> None:
    d = rejected(
        contracts,
        "search_kb",
        {"query": "return policy", "limit": 10.5},
        TaxonomyClass.TYPE_MISMATCH,
    )
    (err,) = errors(d)
    assert (err.field, err.expected, err.actual) == ("limit", "integer", "number")


@pytest.mark.parametrize(("query", "code"), [("ab", "too_short"), ("x" * 201, "too_long")])
def test_string_lengths(query: str, code: str, contracts: ContractSet) -> None:
    d = rejected(contracts, "search_kb", {"query": query}, TaxonomyClass.OUT_OF_BOUNDS)
    (err,) = errors(d)
    assert (err.field, err.code) == ("query", code)


def test_array_items_are_checked_by_path(contracts: ContractSet) -> None:
    args = dict(VALID_ARGUMENTS["create_ticket"], tags=["ok-tag", "Bad Tag"])
    d = rejected(contracts, "create_ticket", args, TaxonomyClass.OUT_OF_BOUNDS)
    (err,) = errors(d)
    assert (err.field, err.code) == ("tags/1", "pattern_mismatch")


def test_duplicate_array_items(contracts: ContractSet) -> None:
    args = dict(VALID_ARGUMENTS["create_ticket"], tags=["a-b", "a-b"])
    d = rejected(contracts, "create_ticket", args, TaxonomyClass.OUT_OF_BOUNDS)
    (err,) = errors(d)
    assert (err.field, err.code) == ("tags", "duplicate_items")


@pytest.mark.parametrize("tool", sorted(VALID_ARGUMENTS))
def test_every_contract_routes_its_valid_arguments(tool: str, contracts: ContractSet) -> None:
    d = routed(contracts, tool, VALID_ARGUMENTS[tool])
    assert d.contract_name == tool
    assert d.call is not None
    assert d.call.tool_name == tool
    assert d.call.side_effect_class is contracts.versions(tool)[0].side_effect_class


# --- routed decisions -------------------------------------------------------------------------


def test_approved_call_fields(contracts: ContractSet) -> None:
    args = {"reason_code": "customer_request", "confirm": True, "order_id": "WO-12345-A"}
    d = routed(contracts, "cancel_order", args)
    call = d.call
    assert call is not None
    canonical = '{"confirm":true,"order_id":"WO-12345-A","reason_code":"customer_request"}'
    assert call.canonical_arguments == canonical
    assert call.payload_hash == "sha256:" + hashlib.sha256(canonical.encode()).hexdigest()
    assert call.call_id == "prop-1"
    assert (call.tool_name, call.tool_version) == ("cancel_order", "1.0.0")
    assert call.side_effect_class is SideEffectClass.HIGH_RISK_EXTERNAL
    assert call.deadline_ms == NOW_MS + 6000
    assert call.attempt == 1
    assert call.idempotency_key.startswith("ik:")
    assert len(call.idempotency_key) == 3 + 64
    assert d.decided_at_ms == NOW_MS
    assert d.post_action_verification is True


def test_canonical_arguments_are_sorted_and_compact_at_every_level(contracts: ContractSet) -> None:
    args = {
        "summary": "Parcel arrived crushed; customer wants a replacement.",
        "priority": "normal",
        "tags": ["z-tag", "a-tag"],
        "customer_id": "CUS-004211",
        "category": "delivery",
    }
    d = routed(contracts, "create_ticket", args)
    assert d.call is not None
    assert d.call.canonical_arguments == (
        '{"category":"delivery","customer_id":"CUS-004211","priority":"normal",'
        '"summary":"Parcel arrived crushed; customer wants a replacement.",'
        '"tags":["z-tag","a-tag"]}'
    )
    assert d.call.deadline_ms == NOW_MS + 5000


def test_non_ascii_arguments_are_hashed_as_utf8(contracts: ContractSet) -> None:
    d = routed(contracts, "search_kb", {"query": "Rückgabe \u00e9t\u00e9"})
    assert d.call is not None
    assert d.call.canonical_arguments == '{"query":"Rückgabe \u00e9t\u00e9"}'
    expected = hashlib.sha256('{"query":"Rückgabe \u00e9t\u00e9"}'.encode()).hexdigest()
    assert d.call.payload_hash == "sha256:" + expected


def test_idempotency_key_is_deterministic(contracts: ContractSet) -> None:
    args = VALID_ARGUMENTS["cancel_order"]
    first = routed(contracts, "cancel_order", args)
    # Same run, same arguments in another key order, another proposal id and offset.
    reordered = dict(reversed(list(args.items())))
    env = envelope("cancel_order", arguments=reordered, proposal_id="prop-2")
    second = decide_envelope(env, contracts, now_ms=NOW_MS + 99, offset=43)
    assert first.call is not None and second.call is not None
    assert second.call.idempotency_key == first.call.idempotency_key
    assert second.call.payload_hash == first.call.payload_hash


def test_idempotency_key_changes_with_the_arguments(contracts: ContractSet) -> None:
    a = routed(contracts, "cancel_order", VALID_ARGUMENTS["cancel_order"])
    b = routed(contracts, "cancel_order", cancel(order_id="WO-12345-B"))
    assert a.call is not None and b.call is not None
    assert a.call.payload_hash != b.call.payload_hash
    assert a.call.idempotency_key != b.call.idempotency_key


@pytest.mark.parametrize(
    "field",
    [
        {"run_id": "run-2"},
        {"tenant_id": "tenant-2"},
        {"workflow_id": "wf"},
        {"logical_operation_id": "op"},
    ],
)
def test_idempotency_key_binds_the_run_and_operation(
    field: dict[str, str], contracts: ContractSet
) -> None:
    a = routed(contracts, "cancel_order", VALID_ARGUMENTS["cancel_order"])
    b = routed(contracts, "cancel_order", VALID_ARGUMENTS["cancel_order"], **field)
    assert a.call is not None and b.call is not None
    assert a.call.payload_hash == b.call.payload_hash
    assert a.call.idempotency_key != b.call.idempotency_key


def test_explicit_idempotency_key_is_respected(contracts: ContractSet) -> None:
    d = routed(
        contracts, "cancel_order", VALID_ARGUMENTS["cancel_order"], idempotency_key="my-key-1"
    )
    assert d.call is not None
    assert d.call.idempotency_key == "my-key-1"


def test_deadline_follows_the_clock_and_the_contract_timeout(contracts: ContractSet) -> None:
    for tool, timeout_ms in [("lookup_order", 4000), ("refund_order", 8000), ("search_kb", 8000)]:
        env = envelope(tool)
        d = decide_envelope(env, contracts, now_ms=123_456)
        assert d.call is not None
        assert d.call.deadline_ms == 123_456 + timeout_ms
        assert contracts.versions(tool)[0].timeout_ms == timeout_ms


def _with_schema(tmp_path: Path, schema: dict[str, Any]) -> Contract:
    """search_kb with another input schema (its examples dropped)."""
    doc = yaml.safe_load((CONTRACTS_DIR / "search_kb" / "1.0.0.yaml").read_text())
    doc["affordance"]["input_schema"] = schema
    doc["affordance"]["examples"] = []
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(doc))
    [contract] = load_contracts(tmp_path).versions("search_kb")
    return contract


def _fields(rejection: Rejection | None) -> list[tuple[str | None, str]]:
    assert rejection is not None
    return [(e.field, e.code) for e in rejection.errors]


def test_only_the_fields_no_keyword_allows_are_to_be_removed(tmp_path: Path) -> None:
    """a matches a patternProperties regex, b is evaluated by an allOf branch: neither is
    what the model is told to remove."""
    additional = _with_schema(tmp_path, {
        "type": "object", "properties": {"query": {"type": "string"}},
        "patternProperties": {"^x_": {"type": "string"}}, "additionalProperties": False,
    })  # fmt: skip
    got = check_arguments({"query": "q", "x_a": "1", "c": 1}, additional)
    assert _fields(got) == [("c", "unknown_field")]
    assert got is not None and "x_a" not in got.next_action
    unevaluated = _with_schema(tmp_path, {
        "type": "object", "allOf": [{"properties": {"b": {"type": "integer"}}}],
        "properties": {"query": {"type": "string"}}, "unevaluatedProperties": False,
    })  # fmt: skip
    got = check_arguments({"query": "q", "b": 2, "c": 1, "d": 2}, unevaluated)
    assert _fields(got) == [("c", "unknown_field"), ("d", "unknown_field")]
    assert got is not None and got.taxonomy is TaxonomyClass.STRUCTURAL_VIOLATION


def test_a_forbidden_field_and_a_bad_field_name_are_structural(tmp_path: Path) -> None:
    forbidden = _with_schema(tmp_path, {
        "type": "object", "properties": {"query": {"type": "string"}, "admin": False},
    })  # fmt: skip
    got = check_arguments({"query": "q", "admin": True}, forbidden)
    assert _fields(got) == [("admin", "forbidden_field")]
    assert got is not None and got.taxonomy is TaxonomyClass.STRUCTURAL_VIOLATION
    assert got.next_action == "remove admin; then call search_kb again."
    named = _with_schema(tmp_path, {
        "type": "object", "propertyNames": {"pattern": "^[a-z]+$"},
    })  # fmt: skip
    got = check_arguments({"query": "q", "Bad-Name": 1}, named)
    assert _fields(got) == [("Bad-Name", "bad_field_name")]
    assert got is not None and got.taxonomy is TaxonomyClass.STRUCTURAL_VIOLATION


def test_unevaluated_fields_failing_a_subschema_are_the_ones_named(tmp_path: Path) -> None:
    """unevaluatedProperties as a schema: only the field that fails it is named, never a
    declared one; and a property called propertyNames is a property like any other."""
    contract = _with_schema(tmp_path, {
        "type": "object", "properties": {"query": {"type": "string"}},
        "unevaluatedProperties": {"type": "string"},
    })  # fmt: skip
    got = check_arguments({"query": "q", "n": 1}, contract)
    assert _fields(got) == [("n", "unknown_field")]
    named = _with_schema(tmp_path, {
        "type": "object", "properties": {"propertyNames": {"type": "string"}},
    })  # fmt: skip
    got = check_arguments({"propertyNames": 5}, named)
    assert _fields(got) == [("propertyNames", "type_mismatch")]


def test_a_field_name_holding_a_slash_or_a_tilde_is_escaped_in_its_path(tmp_path: Path) -> None:
    """Before, the field "a/b" inside meta was reported as meta/a/b, the path of the field
    b inside meta's field a; each step is now escaped as in a JSON pointer."""
    contract = _with_schema(tmp_path, {
        "type": "object", "additionalProperties": False,
        "properties": {
            "query": {"type": "string"},
            "meta": {"type": "object", "additionalProperties": {"type": "string"},
                     "propertyNames": {"maxLength": 3}},
        },
    })  # fmt: skip
    got = check_arguments({"query": "q", "meta": {"a/b": 1, "x~1y": "z"}, "c/d": 1}, contract)
    assert sorted(_fields(got)) == [
        ("c~1d", "unknown_field"),
        ("meta/a~1b", "type_mismatch"),
        ("meta/x~01y", "bad_field_name"),
    ]
    assert got is not None and "remove c~1d" in got.next_action
    nested = check_arguments({"query": "q", "meta": {"a": {"b": 1}}}, contract)
    assert _fields(nested) == [("meta/a", "type_mismatch")]


def test_a_hint_quotes_back_at_most_a_little_of_the_arguments(tmp_path: Path) -> None:
    """Before, a 5,000-digit string where a number belongs, or a 5,000-character field
    name, was quoted back whole: next_action (clipped to 2,048 characters in the
    observation) ended inside the quote, without the other fixes or the call again."""
    contract = _with_schema(tmp_path, {
        "type": "object", "required": ["query"], "additionalProperties": False,
        "properties": {"query": {"type": "string"}, "n": {"type": "integer"},
                       "s": {"type": "string"}},
    })  # fmt: skip
    for arguments in ({"n": "1" * 5000}, {"s": 10**4000}, {"query": "q", "k" * 5000: 1}):
        got = check_arguments(arguments, contract)
        assert got is not None
        assert len(got.next_action) < 300, got.next_action
        assert got.next_action.endswith("then call search_kb again.")
        assert all(len(e.hint or "") < 300 and len(e.field or "") <= 64 for e in got.errors)
    got = check_arguments({"query": "q", "k" * 5000: 1}, contract)
    assert got is not None and "accepted fields: n, query, s" in got.next_action
    short = check_arguments({"query": "q", "n": "12"}, contract)
    assert short is not None and short.errors[0].hint == 'n must be a number: emit 12 not "12"'


@pytest.mark.parametrize(
    ("properties", "arguments", "field", "compiled"),
    [
        ({"legacy_field": False}, {"legacy_field": 1}, "legacy_field", True),
        ({"meta": {"type": "object", "properties": {"x": False}}}, {"meta": {"x": 1, "y": 2}},
         "meta/x", True),
        ({"m": {"type": "object", "additionalProperties": {"properties": {"k": False}}}},
         {"m": {"a/b": {"k": 1}}}, "m/a~1b/k", True),
        ({"pair": {"type": "array", "prefixItems": [{}, False]}}, {"pair": [1, 2]}, "pair/1",
         False),
        ({"m": {"type": "object", "patternProperties": {"^x_": False}}}, {"m": {"x_a": 1}},
         "m/x_a", False),
        ({"m": {"type": "object", "dependentSchemas": {"old": False}}}, {"m": {"old": 1}}, "m/old",
         False),
    ],
)  # fmt: skip
def test_a_value_a_false_schema_forbids_is_named_by_its_path(
    properties: dict[str, Any],
    arguments: dict[str, Any],
    field: str,
    compiled: bool,
    tmp_path: Path,
) -> None:
    """Before, python-jsonschema's error for a false subschema had no path of its own (and
    the compiled walk copied it): the forbidden field was named at its parent's path, so the
    model was told to remove the whole parent (``remove meta``), or at none. Each case runs
    through the compiled walk where the schema allows it, and through the reference's."""
    schema: dict[str, Any] = {"type": "object", "properties": {"query": {}, **properties}}
    walks = [(schema, compiled), ({**schema, "unevaluatedItems": True}, False)]
    for each, explained in walks:
        contract = _with_schema(tmp_path, each)
        assert (contract.validator.explain is not None) is explained
        got = check_arguments({"query": "q", **arguments}, contract)
        assert _fields(got) == [(field, "forbidden_field")]
        assert got is not None and got.taxonomy is TaxonomyClass.STRUCTURAL_VIOLATION
        assert got.next_action == f"remove {field}; then call search_kb again."


def test_items_false_says_how_many_items_are_allowed(tmp_path: Path) -> None:
    contract = _with_schema(tmp_path, {
        "type": "object",
        "properties": {"tags": {"type": "array", "items": False},
                       "pair": {"type": "array", "prefixItems": [{}, {}], "items": False}},
    })  # fmt: skip
    got = check_arguments({"tags": ["a"], "pair": [1, 2, 3]}, contract)
    assert sorted(_fields(got)) == [("pair", "too_many_items"), ("tags", "too_many_items")]
    assert got is not None and got.taxonomy is TaxonomyClass.OUT_OF_BOUNDS
    assert sorted(e.hint or "" for e in got.errors) == [
        "pair must have at most 2 items",
        "tags must be an empty list",
    ]
