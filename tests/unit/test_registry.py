"""Loading contracts: the shipped set, and all-or-nothing refusal with file and JSON path."""

from __future__ import annotations

import copy
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import orjson
import pytest
import yaml

from processor.contracts.registry import ContractError, Problem, cost_exponent, load_contracts
from processor.model import SideEffectClass
from tests.unit.helpers import CONTRACTS_DIR

BASE: dict[str, Any] = yaml.safe_load((CONTRACTS_DIR / "cancel_order" / "1.0.0.yaml").read_text())


def folder_with(
    tmp_path: Path, change: Callable[[dict[str, Any]], None], name: str = "bad.yaml"
) -> Path:
    """A folder holding one good contract (lookup_order) and a changed cancel_order."""
    shutil.copy(CONTRACTS_DIR / "lookup_order" / "1.0.0.yaml", tmp_path / "good.yaml")
    doc = copy.deepcopy(BASE)
    change(doc)
    (tmp_path / name).write_text(yaml.safe_dump(doc))
    return tmp_path


def refused(directory: Path) -> list[Problem]:
    with pytest.raises(ContractError) as info:
        load_contracts(directory)
    problems = info.value.problems
    assert problems
    for p in problems:
        assert str(p) in str(info.value)
    return problems


def only(problems: list[Problem]) -> Problem:
    assert len(problems) == 1, problems
    return problems[0]


# --- the shipped contracts --------------------------------------------------------------------


def test_shipped_contracts_load() -> None:
    cs = load_contracts(CONTRACTS_DIR)
    files = sorted(CONTRACTS_DIR.rglob("*.yaml"))
    assert len(cs) == len(files)
    assert {"cancel_order", "create_ticket", "lookup_order", "refund_order", "search_kb"} <= set(
        cs.names
    )
    assert set(cs.callable_names) <= set(cs.names)
    cancel = cs.versions("cancel_order")[0]
    assert cancel.version == "1.0.0"
    assert cancel.side_effect_class is SideEffectClass.HIGH_RISK_EXTERNAL
    assert cancel.timeout_ms == 6000
    assert cancel.confirmation_required is True
    assert cancel.post_action_verification_required is True
    assert cancel.argument_names == ("order_id", "reason_code", "confirm")
    assert cancel.source == "cancel_order/1.0.0.yaml"
    assert cancel.validator.fast is not None
    assert cs.versions("nope") == ()


def test_fingerprint_is_stable_across_loads(tmp_path: Path) -> None:
    a = load_contracts(CONTRACTS_DIR)
    b = load_contracts(CONTRACTS_DIR)
    assert a.fingerprint == b.fingerprint
    assert a.fingerprint.startswith("sha256:")
    assert len(a.fingerprint) == len("sha256:") + 16
    copied = tmp_path / "copy"
    shutil.copytree(CONTRACTS_DIR, copied)
    assert load_contracts(copied).fingerprint == a.fingerprint


def test_fingerprint_changes_with_the_contracts(tmp_path: Path) -> None:
    shutil.copytree(CONTRACTS_DIR, tmp_path, dirs_exist_ok=True)
    before = load_contracts(tmp_path).fingerprint
    path = tmp_path / "search_kb" / "1.0.0.yaml"
    doc = yaml.safe_load(path.read_text())
    doc["runtime"]["timeout_ms"] = 9000
    path.write_text(yaml.safe_dump(doc))
    assert load_contracts(tmp_path).fingerprint != before


def test_json_contracts_load(tmp_path: Path) -> None:
    (tmp_path / "cancel_order.json").write_bytes(orjson.dumps(BASE))
    cs = load_contracts(tmp_path)
    assert cs.names == ("cancel_order",)


def test_ecma_only_pattern_is_accepted(tmp_path: Path) -> None:
    def ecma(doc: dict[str, Any]) -> None:
        doc["affordance"]["input_schema"]["properties"]["order_id"]["pattern"] = (
            r"^WO-(?<n>\p{Nd}{5})-[A-Z]$"
        )

    cs = load_contracts(folder_with(tmp_path, ecma))
    assert cs.names == ("cancel_order", "lookup_order")
    validator = cs.versions("cancel_order")[0].validator
    assert validator.is_valid(
        {"order_id": "WO-12345-A", "reason_code": "out_of_stock", "confirm": True}
    )


# --- all or nothing ---------------------------------------------------------------------------


def test_missing_owner(tmp_path: Path) -> None:
    p = only(refused(folder_with(tmp_path, lambda d: d["identity"].pop("owner"))))
    assert (p.file, p.path) == ("bad.yaml", "/identity")
    assert "'owner' is a required property" in p.reason


def test_wrong_side_effect_class(tmp_path: Path) -> None:
    def risky(doc: dict[str, Any]) -> None:
        doc["transactional"]["side_effect_class"] = "RISKY"

    p = only(refused(folder_with(tmp_path, risky)))
    assert (p.file, p.path) == ("bad.yaml", "/transactional/side_effect_class")
    assert "'RISKY' is not one of" in p.reason


def test_every_problem_of_a_file_is_listed(tmp_path: Path) -> None:
    def two(doc: dict[str, Any]) -> None:
        doc["identity"].pop("owner")
        doc["runtime"]["timeout_ms"] = "soon"

    problems = refused(folder_with(tmp_path, two))
    assert sorted((p.file, p.path) for p in problems) == [
        ("bad.yaml", "/identity"),
        ("bad.yaml", "/runtime/timeout_ms"),
    ]


def test_lookalike_tool_name_cannot_register(tmp_path: Path) -> None:
    def lookalike(doc: dict[str, Any]) -> None:
        doc["identity"]["name"] = "c\u0430ncel_order"

    p = only(refused(folder_with(tmp_path, lookalike)))
    assert (p.file, p.path) == ("bad.yaml", "/identity/name")


@pytest.mark.parametrize(
    ("change", "path"),
    [
        ({"type": 12}, "/affordance/input_schema/type"),
        ({"minLength": "x"}, "/affordance/input_schema/minLength"),
        (
            {"properties": {"order_id": {"type": "text"}}},
            "/affordance/input_schema/properties/order_id/type",
        ),
        ({"required": "order_id"}, "/affordance/input_schema/required"),
    ],
)
def test_invalid_input_schema(change: dict[str, Any], path: str, tmp_path: Path) -> None:
    def bad(doc: dict[str, Any]) -> None:
        doc["affordance"]["input_schema"].update(change)

    p = only(refused(folder_with(tmp_path, bad)))
    assert p.file == "bad.yaml"
    assert p.path == path
    assert p.path.startswith("/affordance/input_schema")
    assert p.reason.startswith("not a valid 2020-12 schema")


def test_non_object_input_schema(tmp_path: Path) -> None:
    def array(doc: dict[str, Any]) -> None:
        doc["affordance"]["input_schema"]["type"] = "array"

    p = only(refused(folder_with(tmp_path, array)))
    assert (p.path, p.reason) == ("/affordance/input_schema/type", "arguments must be an object")


def test_non_ecma_pattern(tmp_path: Path) -> None:
    def python_regex(doc: dict[str, Any]) -> None:
        doc["affordance"]["input_schema"]["properties"]["order_id"]["pattern"] = "(?P<x>WO)"

    p = only(refused(folder_with(tmp_path, python_regex)))
    assert p.file == "bad.yaml"
    assert p.path.startswith("/affordance/input_schema")
    assert "#/properties/order_id/pattern" in p.reason
    assert "is not an ECMA-262 regex" in p.reason


def test_a_pattern_with_exponential_backtracking_is_refused(tmp_path: Path) -> None:
    """A model's near-miss argument would hold the partition for seconds per call."""

    def slow(doc: dict[str, Any]) -> None:
        doc["affordance"]["input_schema"]["properties"]["order_id"]["pattern"] = "^(x+x+)+y$"

    p = only(refused(folder_with(tmp_path, slow)))
    assert (p.file, p.path) == ("bad.yaml", "/affordance/input_schema")
    assert p.reason.startswith("#/properties/order_id/pattern: '^(x+x+)+y$' can match 'xxx'")
    assert "exponentially many ways" in p.reason


def test_a_pattern_with_polynomial_backtracking_needs_a_small_enough_max_length(
    tmp_path: Path,
) -> None:
    """'\\s*,\\s*$' takes 1.5 s on 16,000 spaces and an x: the search retries at each
    start. Arguments may be 64 KB, so the contract must say how long the text can be."""

    def unbounded(doc: dict[str, Any]) -> None:
        doc["affordance"]["input_schema"]["properties"]["order_id"]["pattern"] = r"\s*,\s*$"

    for name in ("none", "long", "short"):
        (tmp_path / name).mkdir()
    p = only(refused(folder_with(tmp_path / "none", unbounded)))
    assert (p.file, p.path) == ("bad.yaml", "/affordance/input_schema")
    assert p.reason.startswith("#/properties/order_id/pattern: '\\\\s*,\\\\s*$' can take")
    assert "n^2" in p.reason and "maxLength of at most 1000 (it has none" in p.reason

    def too_long(doc: dict[str, Any]) -> None:
        unbounded(doc)
        doc["affordance"]["input_schema"]["properties"]["order_id"]["maxLength"] = 4096

    p = only(refused(folder_with(tmp_path / "long", too_long)))
    assert "maxLength of at most 1000 (it has 4096)" in p.reason

    def bounded(doc: dict[str, Any]) -> None:
        unbounded(doc)
        doc["affordance"]["input_schema"]["properties"]["order_id"]["maxLength"] = 64
        doc["affordance"]["examples"][0]["arguments"]["order_id"] = "WO-12345-A ,"

    cs = load_contracts(folder_with(tmp_path / "short", bounded))
    assert "cancel_order" in cs.names


def test_an_input_schema_that_loops_is_refused_not_a_crash(tmp_path: Path) -> None:
    """Before, load_contracts checked the examples against it and died of RecursionError."""

    def loop(doc: dict[str, Any]) -> None:
        doc["affordance"]["input_schema"]["allOf"] = [{"$ref": "#"}]

    p = only(refused(folder_with(tmp_path, loop)))
    assert p.path == "/affordance/input_schema"
    assert "#/allOf/0/$ref: a $ref cycle" in p.reason


@pytest.mark.parametrize(
    "loop",
    [
        {"$anchor": "t", "allOf": [{"$ref": "#t"}]},
        {"allOf": [{"$ref": ""}]},
        {"$id": "https://example.com/s", "allOf": [{"$ref": "https://example.com/s"}]},
        {"allOf": [{"$dynamicRef": "#"}]},
        {"$defs": {"x": {"$id": "urn:x"}}, "allOf": [{"$ref": "#"}]},
        {"properties": {"order_id": {"$anchor": "q", "not": {"$ref": "#q"}}}},
    ],
)
def test_a_loop_through_a_reference_the_checks_cannot_follow_is_refused(
    loop: dict[str, Any], tmp_path: Path
) -> None:
    """Anchors, URIs, $dynamicRef, a document with a nested resource: validating a few
    values when the contract loads finds the loop, instead of the first call."""

    def bad(doc: dict[str, Any]) -> None:
        doc["affordance"]["input_schema"] = {"type": "object", **loop}
        doc["affordance"]["examples"] = []

    p = only(refused(folder_with(tmp_path, bad)))
    assert p.path == "/affordance/input_schema"
    assert "recursed without end" in p.reason


@pytest.mark.parametrize(
    ("output_schema", "path", "reason"),
    [
        ({"type": "objekt"}, "/affordance/output_schema/type", "not a valid 2020-12 schema"),
        (
            {"properties": {"id": {"pattern": "(?P<x>a)"}}},
            "/affordance/output_schema",
            "is not an ECMA-262 regex",
        ),
        ({"$ref": "#/$defs/gone"}, "/affordance/output_schema", "does not resolve"),
        ({"not": {"$ref": "#"}}, "/affordance/output_schema", "a $ref cycle"),
    ],
)
def test_an_output_schema_that_would_fail_on_a_result_is_refused_when_loaded(
    output_schema: dict[str, Any], path: str, reason: str, tmp_path: Path
) -> None:
    """Before, it loaded, and the first result of the tool failed its whole batch."""

    def bad(doc: dict[str, Any]) -> None:
        doc["affordance"]["output_schema"] = output_schema

    p = only(refused(folder_with(tmp_path, bad)))
    assert p.path == path
    assert reason in p.reason


def test_valid_example_that_fails_the_schema(tmp_path: Path) -> None:
    def bad(doc: dict[str, Any]) -> None:
        doc["affordance"]["examples"][0]["arguments"]["order_id"] = "ORD-1"

    p = only(refused(folder_with(tmp_path, bad)))
    assert (p.file, p.path, p.reason) == (
        "bad.yaml",
        "/affordance/examples/0",
        "example fails the input schema",
    )


def test_invalid_example_that_passes_the_schema(tmp_path: Path) -> None:
    def bad(doc: dict[str, Any]) -> None:
        doc["affordance"]["examples"][1]["arguments"]["order_id"] = "WO-12345-A"

    p = only(refused(folder_with(tmp_path, bad)))
    assert (p.file, p.path, p.reason) == (
        "bad.yaml",
        "/affordance/examples/1",
        "example passes the input schema",
    )


def test_duplicate_name_and_version(tmp_path: Path) -> None:
    def same(doc: dict[str, Any]) -> None:
        doc["identity"]["name"] = "lookup_order"

    p = only(refused(folder_with(tmp_path, same)))
    assert p.path == "/identity/version"
    assert p.reason == "lookup_order@1.0.0 also in bad.yaml"
    assert p.file == "good.yaml"


def test_same_name_other_version_is_fine(tmp_path: Path) -> None:
    def newer(doc: dict[str, Any]) -> None:
        doc["identity"]["version"] = "1.0.1"

    shutil.copytree(CONTRACTS_DIR / "cancel_order", tmp_path / "cancel_order")
    cs = load_contracts(folder_with(tmp_path, newer))
    assert [c.version for c in cs.versions("cancel_order")] == ["1.0.1", "1.0.0"]


def test_empty_folder(tmp_path: Path) -> None:
    p = only(refused(tmp_path))
    assert (p.path, p.reason) == ("/", "no contract files")


def test_missing_folder(tmp_path: Path) -> None:
    p = only(refused(tmp_path / "absent"))
    assert (p.path, p.reason) == ("/", "no such directory")


@pytest.mark.parametrize(
    ("text", "reason"),
    [
        ("identity: [1,\n", "cannot be parsed"),
        ("identity: {a: 1}\n  b: 2\n", "cannot be parsed"),
        ("- 1\n- 2\n", "[1, 2] is not of type 'object'"),
        ("", "None is not of type 'object'"),
    ],
)
def test_unparseable_or_non_mapping_yaml(text: str, reason: str, tmp_path: Path) -> None:
    shutil.copy(CONTRACTS_DIR / "lookup_order" / "1.0.0.yaml", tmp_path / "good.yaml")
    (tmp_path / "bad.yaml").write_text(text)
    p = only(refused(tmp_path))
    assert (p.file, p.path) == ("bad.yaml", "/")
    assert reason in p.reason


def test_a_json_contract_with_a_key_twice_is_refused(tmp_path: Path) -> None:
    """Before, the last of the two was loaded: a reviewer who read the first
    ``"confirmation_required": true`` got a contract that asks for no confirmation."""
    text = orjson.dumps(BASE).decode()
    assert '"confirmation_required":true' in text
    twice = text.replace(
        '"confirmation_required":true',
        '"confirmation_required":true,"confirmation_required":false',
    )
    (tmp_path / "cancel_order.json").write_text(twice)
    p = only(refused(tmp_path))
    assert (p.file, p.path) == ("cancel_order.json", "/")
    assert "duplicate key 'confirmation_required'" in p.reason


@pytest.mark.parametrize("value", [".nan", ".inf", "-.inf", "1e400"])
def test_a_number_json_cannot_hold_is_refused(value: str, tmp_path: Path) -> None:
    """Before, a cost of .nan loaded (NaN passes ``minimum: 0``) and reached the budget
    script as null."""
    shutil.copy(CONTRACTS_DIR / "lookup_order" / "1.0.0.yaml", tmp_path / "good.yaml")
    text = yaml.safe_dump(BASE)
    assert "cost_per_call: 0.0" in text
    (tmp_path / "bad.yaml").write_text(
        text.replace("cost_per_call: 0.0", f"cost_per_call: {value}")
    )
    p = only(refused(tmp_path))
    assert (p.file, p.path) == ("bad.yaml", "/")
    assert "/runtime/cost_profile/cost_per_call: " in p.reason
    assert "is not a JSON number" in p.reason


def test_a_nan_bound_in_an_input_schema_is_refused(tmp_path: Path) -> None:
    """A maximum of NaN: the fast validator refuses every number, the reference none."""

    def bound(doc: dict[str, Any]) -> None:
        doc["affordance"]["input_schema"]["properties"]["order_id"]["maximum"] = float("nan")

    p = only(refused(folder_with(tmp_path, bound)))
    assert "/affordance/input_schema/properties/order_id/maximum: nan" in p.reason


def test_problems_in_several_files_are_all_listed(tmp_path: Path) -> None:
    folder_with(tmp_path, lambda d: d["identity"].pop("owner"), name="a.yaml")
    (tmp_path / "b.yaml").write_text("x: [")
    problems = refused(tmp_path)
    assert sorted((p.file, p.path) for p in problems) == [("a.yaml", "/identity"), ("b.yaml", "/")]


# --- semantics --------------------------------------------------------------------------------


def test_rules_compile_and_references_load() -> None:
    refund = load_contracts(CONTRACTS_DIR).versions("refund_order")[0]
    [rule] = refund.rules
    assert rule.rule_id == "refund_has_cents_only"
    assert rule.program.execute({"args": {"amount": 5.0}}) is True
    assert rule.program.execute({"args": {"amount": 50000.0}}) is False
    [ref] = refund.references
    assert (ref.argument, ref.entity, ref.lookup_tool) == ("order_id", "order", "lookup_order")
    assert ref.allowed_states == ("delivered", "cancelled")


def _with_semantics(section: dict[str, Any]) -> Callable[[dict[str, Any]], None]:
    def change(doc: dict[str, Any]) -> None:
        doc["semantics"] = section

    return change


@pytest.mark.parametrize(
    ("section", "path", "reason"),
    [
        ({"rules": [{"id": "r", "expression": "args.order_id ==", "message": "m",
                     "next_action": "n"}]},
         "/semantics/rules/0/expression", "CEL does not compile"),
        ({"rules": [{"id": "r", "expression": "user.admin == true", "message": "m",
                     "next_action": "n"}]}, "/semantics/rules/0/expression", "unknown variables"),
        ({"references": [{"argument": "invoice_id", "entity": "invoice",
                          "allowed_states": ["open"], "lookup_tool": "lookup_invoice"}]},
         "/semantics/references/0/argument", "not an argument"),
        ({"references": [{"argument": "order_id", "entity": "order",
                          "allowed_states": ["processing"], "lookup_tool": "lookup_order"},
                         {"argument": "order_id", "entity": "return",
                          "allowed_states": ["open"], "lookup_tool": "lookup_order"}]},
         "/semantics/references/1/argument", "has a reference already"),
        ({"rules": [{"id": "r", "expression": "true", "message": "m", "next_action": "n"},
                    {"id": "r", "expression": "true", "message": "m", "next_action": "n"}]},
         "/semantics/rules", "used twice"),
    ],
)  # fmt: skip
def test_bad_semantics_refuse_the_set(
    section: dict[str, Any], path: str, reason: str, tmp_path: Path
) -> None:
    problem = only(refused(folder_with(tmp_path, _with_semantics(section))))
    assert (problem.file, problem.path) == ("bad.yaml", path)
    assert reason in problem.reason


def test_comprehension_variables_are_not_unknown(tmp_path: Path) -> None:
    rule = {"id": "r", "expression": "[args.reason_code].all(x, x != 'fraud_suspected')",
            "message": "m", "next_action": "n"}  # fmt: skip
    load_contracts(folder_with(tmp_path, _with_semantics({"rules": [rule]})))


def _rule(expression: str) -> dict[str, Any]:
    return {"semantics": {"rules": [{"id": "r1", "expression": expression, "message": "m",
                                     "next_action": "n"}]}}  # fmt: skip


@pytest.mark.parametrize(
    ("expression", "reason"),
    [
        ("args.reason_code.lowerAscii() == 'fraud_suspected'", "no function lowerAscii"),
        ("max(1, 2) == 2", "no function max"),
        ("size(args.order_id) > 0 && args.order_id.trim() != ''", "no function trim"),
        # timestamp exists, but not for an int: the valid example reaches the call.
        ("timestamp(size(args.order_id)) != timestamp('2000-01-01T00:00:00Z')",
         "no timestamp for the arguments of valid example 0"),
        ("-size(args.order_id) < 0", "unary minus on a computed value"),
        ("type(order) == int", "unknown variables ['order']"),
        ("args.order_id.all(Item, Item != 'x') && Other", "unknown variables ['Other']"),
        # A macro's variable used outside it: before, this loaded and failed every call,
        # or, under ||, passed every call whose other side was true.
        ("[args.order_id].all(i, i != 'x') && i == 'y'",
         "macro variables ['i'] used outside the macro that binds them"),
        ("[args.order_id].all(i, i != 'x') || i == 'y'",
         "macro variables ['i'] used outside the macro that binds them"),
        ("i.all(i, i != 'x')", "macro variables ['i'] used outside"),
        # A macro's variable hiding another name: before, each loaded and checked something
        # else than it says.
        ("[args.order_id].exists(args, args.order_id == 'WO-12345-A')",
         "the macro variable 'args' hides args"),
        ("[args.order_id].all(principal, principal != '')", "the macro variable 'principal'"),
        ("[args.order_id].all(int, type(int) == int)", "the macro variable 'int' hides int"),
        ("[[args.order_id]].all(x, x.all(x, x != ''))",
         "the macro variable 'x' hides the variable of an enclosing macro"),
        ("[args.order_id].all(x, [1].map(y, [x].exists(x, x == y)).size() > 0)",
         "the macro variable 'x' hides the variable of an enclosing macro"),
        # Before, a macro's text inside a string literal was taken for a binding of zz.
        ("'.all(zz,' != args.order_id && zz == 1", "unknown variables ['zz']"),
        ("google.protobuf.Int64Value{value: 1} != null", "cannot analyse this expression"),
    ],
)  # fmt: skip
def test_rules_that_would_misbehave_on_every_call_are_refused_at_load(
    expression: str, reason: str, tmp_path: Path
) -> None:
    problem = only(refused(folder_with(tmp_path, lambda d: d.update(_rule(expression)))))
    assert (problem.file, problem.path) == ("bad.yaml", "/semantics/rules/0/expression")
    assert problem.reason.startswith("rule 'r1': ")
    assert reason in problem.reason


@pytest.mark.parametrize(
    "expression",
    [
        "type(args.order_id) == string && type(size(args.order_id)) == int",
        "[args.reason_code].all(Item, Item != 'fraud_suspected')",
        "[args.reason_code].exists( Code , Code.startsWith('customer'))",
        "timestamp('2024-01-01T00:00:00Z').getFullYear() == 2024",
        "size(args.order_id) > -1 && 0 - size(args.order_id) < 0",
        # One name for the variables of two macros side by side, or of the filter and the
        # body of one map, is no reuse.
        "[args.order_id].all(x, x != '') && [args.reason_code].exists(x, x != '')",
        "[args.order_id].map(x, x != '', x + '!').all(y, y.endsWith('!'))",
        "[args.order_id].all(x, [x].all(y, y == x)) && !args.order_id.startsWith('https://')",
    ],
)
def test_valid_cel_loads(expression: str, tmp_path: Path) -> None:
    cs = load_contracts(folder_with(tmp_path, lambda d: d.update(_rule(expression))))
    [rule] = cs.versions("cancel_order")[0].rules
    args = {"order_id": "WO-12345-A", "reason_code": "customer_request", "confirm": True}
    assert rule.program.execute({"args": args}) is True


@pytest.mark.parametrize(
    ("expression", "exponent"),
    [
        ("args.a > 1", 1),
        ("args.l.all(x, x > 0)", 2),
        ("args.l.all(x, x > 0) && args.m.exists(y, y > 0)", 3),
        ("args.l.all(x, args.l.all(y, x >= y))", 3),
        ("args.l.map(x, args.l).size() > 0", 3),
        ("args.l.filter(x, x > 0).all(y, y > 1)", 4),
    ],
)
def test_each_comprehension_raises_the_cost_exponent(expression: str, exponent: int) -> None:
    assert cost_exponent(expression) == exponent
