"""The contract linter: one broken fixture per rule, the shipped pack, and the CLI."""

from __future__ import annotations

import copy
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml
from typer.testing import CliRunner

from processor.cli import app
from processor.contracts.lint import RULES, Finding, lint, lint_folder
from tests.unit.helpers import CONTRACTS_DIR

SOURCE = "cancel_order/1.0.0.yaml"
BASE: dict[str, Any] = yaml.safe_load((CONTRACTS_DIR / SOURCE).read_text())
# A second tool sharing the "order" stem, so the sibling rule has something to ask for.
SIBLING: dict[str, Any] = yaml.safe_load((CONTRACTS_DIR / "lookup_order/1.0.0.yaml").read_text())
# The two-tool fixture set must be closed: its hints may only name its own tools.
SIBLING["affordance"]["input_schema"]["properties"]["customer_id"]["description"] = (
    "Customer id, format CUS-NNNNNN, e.g. CUS-004211. Obtain via lookup_order."
)


def findings_for(mutate: Callable[[dict[str, Any]], None]) -> list[Finding]:
    doc = copy.deepcopy(BASE)
    mutate(doc)
    return lint([(SOURCE, doc), ("lookup_order/1.0.0.yaml", copy.deepcopy(SIBLING))])


def only(findings: list[Finding], rule: str) -> list[tuple[str, str]]:
    return [(f.severity, f.path) for f in findings if f.rule == rule and f.file == SOURCE]


def props(doc: dict[str, Any]) -> dict[str, Any]:
    properties: dict[str, Any] = doc["affordance"]["input_schema"]["properties"]
    return properties


def test_the_base_fixture_is_clean() -> None:
    assert findings_for(lambda doc: None) == []


def test_open_object_at_the_root() -> None:
    def mutate(doc: dict[str, Any]) -> None:
        del doc["affordance"]["input_schema"]["additionalProperties"]

    assert only(findings_for(mutate), "open-object") == [("error", "/affordance/input_schema")]


def test_open_object_nested_in_items_and_defs() -> None:
    def mutate(doc: dict[str, Any]) -> None:
        props(doc)["lines"] = {
            "type": "array",
            "items": {"type": "object", "properties": {"sku": {"$ref": "#/$defs/sku"}}},
        }
        doc["affordance"]["input_schema"]["$defs"] = {
            "sku": {"type": "object", "unevaluatedProperties": False},
            "open": {"properties": {"x": {"type": "integer"}}},
        }

    assert only(findings_for(mutate), "open-object") == [
        ("error", "/affordance/input_schema/$defs/open"),
        ("error", "/affordance/input_schema/properties/lines/items"),
    ]


def test_free_text_reason_code_is_an_error() -> None:
    def mutate(doc: dict[str, Any]) -> None:
        del props(doc)["reason_code"]["enum"]

    assert only(findings_for(mutate), "free-text-enum") == [
        ("error", "/affordance/input_schema/properties/reason_code")
    ]


def test_free_text_priority_is_a_warning() -> None:
    def mutate(doc: dict[str, Any]) -> None:
        props(doc)["ticket_priority"] = {"type": "string", "description": "How urgent."}

    assert only(findings_for(mutate), "free-text-enum") == [
        ("warning", "/affordance/input_schema/properties/ticket_priority")
    ]


def test_generic_id() -> None:
    def mutate(doc: dict[str, Any]) -> None:
        props(doc)["Id"] = {"type": "string", "pattern": "^[0-9]+$"}

    assert only(findings_for(mutate), "generic-id") == [
        ("error", "/affordance/input_schema/properties/Id")
    ]


def test_id_without_pattern() -> None:
    def mutate(doc: dict[str, Any]) -> None:
        del props(doc)["order_id"]["pattern"]

    assert only(findings_for(mutate), "id-without-pattern") == [
        ("error", "/affordance/input_schema/properties/order_id")
    ]


def test_required_id_without_obtain_hint_is_an_error() -> None:
    def mutate(doc: dict[str, Any]) -> None:
        props(doc)["order_id"]["description"] = "Work order id, e.g. WO-12345-A."

    assert only(findings_for(mutate), "id-without-obtain-hint") == [
        ("error", "/affordance/input_schema/properties/order_id/description")
    ]


def test_optional_id_without_obtain_hint_is_a_warning() -> None:
    def mutate(doc: dict[str, Any]) -> None:
        props(doc)["invoice_number"] = {"type": "string", "pattern": "^INV-[0-9]{6}$"}

    assert only(findings_for(mutate), "id-without-obtain-hint") == [
        ("warning", "/affordance/input_schema/properties/invoice_number/description")
    ]


def test_no_negative_guidance() -> None:
    def mutate(doc: dict[str, Any]) -> None:
        doc["affordance"]["model_description"] = "Cancel a work order found with lookup_order."

    assert only(findings_for(mutate), "no-negative-guidance") == [
        ("warning", "/affordance/model_description")
    ]


def test_no_sibling_named() -> None:
    def mutate(doc: dict[str, Any]) -> None:
        doc["affordance"]["model_description"] = "Cancel a work order. Never guess its id."

    assert only(findings_for(mutate), "no-sibling-named") == [
        ("warning", "/affordance/model_description")
    ]


def test_a_tool_without_look_alikes_need_not_name_one() -> None:
    doc = copy.deepcopy(BASE)
    doc["identity"]["name"] = "archive_mail"
    doc["affordance"]["model_description"] = "Archive a mail thread. Never for deletion."
    doc["affordance"]["forbidden_use_cases"] = []
    assert [f for f in lint([(SOURCE, doc), ("x.yaml", SIBLING)]) if f.file == SOURCE] == []


@pytest.mark.parametrize("field", ["required", "payload_hash_required"])
def test_mutation_without_idempotency(field: str) -> None:
    def mutate(doc: dict[str, Any]) -> None:
        doc["idempotency"][field] = False

    assert only(findings_for(mutate), "mutation-without-idempotency") == [
        ("error", f"/idempotency/{field}")
    ]


def test_unconfirmed_high_risk() -> None:
    def mutate(doc: dict[str, Any]) -> None:
        doc["transactional"]["confirmation_required"] = False

    assert only(findings_for(mutate), "unconfirmed-high-risk") == [
        ("error", "/transactional/confirmation_required")
    ]


def test_timeout_over_a_minute() -> None:
    def mutate(doc: dict[str, Any]) -> None:
        doc["runtime"]["timeout_ms"] = 120_000

    assert only(findings_for(mutate), "missing-timeout") == [("error", "/runtime/timeout_ms")]


def test_missing_timeout_is_reported_by_rule_and_meta_schema() -> None:
    def mutate(doc: dict[str, Any]) -> None:
        del doc["runtime"]["timeout_ms"]

    findings = findings_for(mutate)
    assert only(findings, "missing-timeout") == [("error", "/runtime/timeout_ms")]
    assert only(findings, "meta-schema") == [("error", "/runtime")]


@pytest.mark.parametrize("name", ["api_key", "password", "cardNumber", "pan", "reset_token"])
def test_secret_parameter(name: str) -> None:
    def mutate(doc: dict[str, Any]) -> None:
        props(doc)[name] = {"type": "string", "enum": ["x"]}

    assert only(findings_for(mutate), "secret-parameter") == [
        ("error", f"/affordance/input_schema/properties/{name}")
    ]


@pytest.mark.parametrize("name", ["company", "max_tokens", "expand"])
def test_secret_parameter_matches_whole_words(name: str) -> None:
    def mutate(doc: dict[str, Any]) -> None:
        props(doc)[name] = {"type": "string", "enum": ["x"]}

    assert only(findings_for(mutate), "secret-parameter") == []


def test_examples_without_an_invalid_one() -> None:
    def mutate(doc: dict[str, Any]) -> None:
        doc["affordance"]["examples"] = doc["affordance"]["examples"][:1]

    assert only(findings_for(mutate), "examples") == [("warning", "/affordance/examples")]


def test_every_rule_has_a_failing_fixture() -> None:
    tested = {
        "open-object",
        "free-text-enum",
        "generic-id",
        "id-without-pattern",
        "id-without-obtain-hint",
        "no-negative-guidance",
        "no-sibling-named",
        "mutation-without-idempotency",
        "unconfirmed-high-risk",
        "missing-timeout",
        "secret-parameter",
        "unknown-tool-named",
        "examples",
        "backtracking-pattern",
    }
    assert set(RULES) == tested


@pytest.mark.parametrize(
    "doc",
    [
        None,
        [1, 2],
        {"affordance": "text"},
        {"affordance": {"input_schema": {"properties": ["not", "a", "map"]}}},
        {"runtime": {"timeout_ms": "soon"}, "transactional": {"side_effect_class": 7}},
    ],
)
def test_malformed_documents_never_crash(doc: Any) -> None:
    findings = lint([("bad.yaml", doc)])
    assert findings
    assert all(f.severity in ("error", "warning") for f in findings)


def test_a_file_that_does_not_parse_is_unreadable(tmp_path: Path) -> None:
    (tmp_path / "broken.yaml").write_text("identity: [unclosed\n")
    assert [(f.rule, f.severity, f.file) for f in lint_folder(tmp_path)] == [
        ("unreadable", "error", "broken.yaml")
    ]


def test_the_shipped_pack_lints_clean() -> None:
    findings = lint_folder(CONTRACTS_DIR)
    assert findings == [], "\n".join(str(f) for f in findings)


# -- CLI ---------------------------------------------------------------------------------------


def write_pack(directory: Path, docs: dict[str, dict[str, Any]]) -> Path:
    for rel, doc in docs.items():
        path = directory / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(yaml.safe_dump(doc))
    return directory


def test_cli_json_lists_findings_and_exits_1_on_error(tmp_path: Path) -> None:
    doc = copy.deepcopy(BASE)
    doc["transactional"]["confirmation_required"] = False
    pack = write_pack(tmp_path, {SOURCE: doc, "lookup_order/1.0.0.yaml": SIBLING})
    result = CliRunner().invoke(app, ["contracts", "lint", str(pack), "--format", "json"])
    assert result.exit_code == 1
    listed = json.loads(result.stdout)
    assert listed == [
        {
            "rule": "unconfirmed-high-risk",
            "severity": "error",
            "file": SOURCE,
            "path": "/transactional/confirmation_required",
            "message": "HIGH_RISK_EXTERNAL tool must require confirmation",
        }
    ]
    assert "1 error(s), 0 warning(s)" in result.stderr


def test_cli_warnings_alone_exit_0(tmp_path: Path) -> None:
    doc = copy.deepcopy(BASE)
    doc["affordance"]["examples"] = doc["affordance"]["examples"][:1]
    pack = write_pack(tmp_path, {SOURCE: doc, "lookup_order/1.0.0.yaml": SIBLING})
    result = CliRunner().invoke(app, ["contracts", "lint", str(pack)])
    assert result.exit_code == 0
    assert f"{SOURCE}:/affordance/examples: warning examples:" in result.stdout
    assert "0 error(s), 1 warning(s)" in result.stdout


def test_cli_clean_pack_exits_0(tmp_path: Path) -> None:
    pack = write_pack(tmp_path, {SOURCE: BASE, "lookup_order/1.0.0.yaml": SIBLING})
    result = CliRunner().invoke(app, ["contracts", "lint", str(pack), "--format", "json"])
    assert result.exit_code == 0
    assert json.loads(result.stdout) == []


def test_hints_lookups_and_compensations_must_name_tools_of_the_set() -> None:
    doc = copy.deepcopy(BASE)
    doc["affordance"]["input_schema"]["properties"]["order_id"]["description"] = (
        "Work order id. Obtain via find_work_order or from the customer."
    )
    doc["semantics"] = {"references": [{"argument": "order_id", "entity": "order",
                                        "allowed_states": ["received"],
                                        "lookup_tool": "order_finder_v9"}]}  # fmt: skip
    doc["transactional"]["compensation_tool"] = "uncancel_order"
    lookup = yaml.safe_load((CONTRACTS_DIR / "lookup_order" / "1.0.0.yaml").read_text())
    findings = [
        f
        for f in lint([("bad.yaml", doc), ("lookup.yaml", lookup)])
        if f.rule == "unknown-tool-named" and f.file == "bad.yaml"
    ]
    assert {(f.path, f.severity) for f in findings} == {
        ("/affordance/input_schema/properties/order_id/description", "error"),
        ("/semantics/references/0/lookup_tool", "error"),
        ("/transactional/compensation_tool", "error"),
    }


@pytest.mark.parametrize(
    ("pattern", "flagged"),
    [
        ("^W(O+)+-[0-9]{5}-[A-Z]$", True),
        ("^(WO+)+-[0-9]{5}-[A-Z]$", False),  # each round starts with a W: unambiguous
        ("^(?:[A-Z]*)*$", True),
        ("^WO-([0-9]{2,})+$", True),
        ("^WO-[0-9]{5}-[A-Z]$", False),
        ("^(?:[a-z0-9-]+\\.)+[a-z]{2,}$", False),  # a separator in the group: unambiguous
        ("^(ab|cd)+$", False),
        ("^(x{2})+$", False),
        ("^[(a+)]+$", False),  # a character class, not a group
        ("^(a|a)*$", True),  # alternatives that overlap, repeated
        ("^(?:WO|WOWO)+-$", True),
        ("^(\\w|\\d)+!$", True),
        ("^(.|\\s)*$", True),
        ("^([a-z]|[a-f0-9])+$", True),
        ("^(a|b)*$", False),
        ("^([a-z]|[0-9])+$", False),
        ("^(a|ab)*$", False),  # "ab" is no repetition of "a": one way to split
        ("^(?:WO|WORK)+$", False),
        ("^(\\w+\\s?)*$", True),  # an optional separator: the outer loop splits the run
        ("^(x+x+)+y$", True),
        ("^(a|a?)+$", True),
        ("^(.*a){12}$", True),
        ("^WO(?:-[0-9]+)*$", False),
        ("^\\d+\\d+$", True),  # quadratic, and no maxLength bounds the text
        ("^\\d+-\\d+$", False),  # the dash keeps the loops apart: linear
    ],
)
def test_a_pattern_with_nested_quantifiers_is_an_error(pattern: str, flagged: bool) -> None:
    """W(O+)+ against 'WOOOOOOOOOOOOOOOOOOOOOOOO!' backtracks for seconds: the consumer
    stops for that long on one proposal."""

    def mutate(doc: dict[str, Any]) -> None:
        props(doc)["order_id"]["pattern"] = pattern

    expected = [("error", "/affordance/input_schema/properties/order_id/pattern")]
    assert only(findings_for(mutate), "backtracking-pattern") == (expected if flagged else [])


def test_a_polynomial_pattern_needs_a_small_enough_max_length() -> None:
    """The registry refuses the same: a near-miss of 64 KB would take seconds."""

    def mutate(length: int | None, names: int | None) -> Callable[[dict[str, Any]], None]:
        def change(doc: dict[str, Any]) -> None:
            order_id = props(doc)["order_id"]
            order_id["pattern"] = "^\\d+\\d+$"
            if length is not None:
                order_id["maxLength"] = length
            doc["affordance"]["input_schema"]["patternProperties"] = {"\\s*,\\s*$": {}}
            if names is not None:
                doc["affordance"]["input_schema"]["propertyNames"] = {"maxLength": names}

        return change

    where = "/affordance/input_schema"
    flagged = [
        ("error", f"{where}/patternProperties"),
        ("error", f"{where}/properties/order_id/pattern"),
    ]
    assert sorted(only(findings_for(mutate(None, None)), "backtracking-pattern")) == flagged
    assert sorted(only(findings_for(mutate(5000, 5000)), "backtracking-pattern")) == flagged
    assert only(findings_for(mutate(1000, 64)), "backtracking-pattern") == []
    (finding,) = [f for f in findings_for(mutate(20, None)) if f.rule == "backtracking-pattern"]
    assert "propertyNames maxLength of at most 1000 (it has none" in finding.message
