"""Exported tool definitions: provider shapes, OpenAI strict mode, no system-facing leaks."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import mcp.types
import pytest
from jsonschema import Draft202012Validator
from typer.testing import CliRunner

from processor.cli import app
from processor.contracts.export import (
    OPENAI_STRICT_FORMATS,
    OPENAI_STRICT_KEYWORDS,
    anthropic_tool,
    callable_versions,
    export_tools,
    from_openai_arguments,
    openai_strict_schema,
)
from processor.contracts.registry import ContractSet
from processor.contracts.validation import reference_validator
from tests.unit.helpers import CONTRACTS_DIR, VALID_ARGUMENTS

SYSTEM_SECTIONS = (
    "runtime",
    "security",
    "transactional",
    "idempotency",
    "observability",
    "error_contract",
    "semantics",
)
SYSTEM_WORDS = (
    "timeout_ms",
    "required_scopes",
    "side_effect_class",
    "error_contract",
    "payload_hash_required",
    "secrets_boundary",
    "egress_policy",
    "trace_attributes",
    "allowed_states",
    "lookup_tool",
)


def openai_tools(contracts: ContractSet) -> list[dict[str, Any]]:
    exported = export_tools(contracts, "openai")
    assert isinstance(exported, list)
    return exported


def subschemas(schema: dict[str, Any], where: str) -> Iterator[tuple[str, dict[str, Any]]]:
    """Every schema in an exported OpenAI schema (only the keywords strict mode allows)."""
    yield where, schema
    for name, sub in schema.get("properties", {}).items():
        yield from subschemas(sub, f"{where}/properties/{name}")
    for name, sub in schema.get("$defs", {}).items():
        yield from subschemas(sub, f"{where}/$defs/{name}")
    if isinstance(schema.get("items"), dict):
        yield from subschemas(schema["items"], f"{where}/items")
    for i, sub in enumerate(schema.get("anyOf", [])):
        yield from subschemas(sub, f"{where}/anyOf/{i}")


def assert_strict(parameters: dict[str, Any], tool: str) -> None:
    assert parameters["type"] == "object", tool
    for keyword in ("anyOf", "oneOf", "allOf", "not", "enum"):
        assert keyword not in parameters, f"{tool}: top-level {keyword}"
    for where, schema in subschemas(parameters, tool):
        unsupported = set(schema) - OPENAI_STRICT_KEYWORDS
        assert not unsupported, f"{where}: {unsupported}"
        if "format" in schema:
            assert schema["format"] in OPENAI_STRICT_FORMATS, where
        declared = schema.get("type")
        types = declared if isinstance(declared, list) else [declared]
        if "object" in types:
            assert schema["additionalProperties"] is False, where
            assert schema["required"] == list(schema["properties"]), where


def test_every_openai_schema_meets_strict_mode(contracts: ContractSet) -> None:
    tools = openai_tools(contracts)
    assert {t["function"]["name"] for t in tools} == set(contracts.callable_names)
    for tool in tools:
        function = tool["function"]
        assert tool["type"] == "function"
        assert set(function) == {"name", "description", "strict", "parameters"}
        assert function["strict"] is True
        assert function["description"]
        assert_strict(function["parameters"], function["name"])


def test_strict_rewrite_of_a_nested_schema() -> None:
    schema = {
        "type": "object",
        "additionalProperties": False,
        "required": ["lines"],
        "properties": {
            "lines": {
                "type": "array",
                "uniqueItems": True,
                "items": {
                    "type": "object",
                    "required": ["sku"],
                    "properties": {
                        "sku": {"type": "string", "minLength": 3, "x-owner": "catalog"},
                        "gift": {"type": "boolean", "const": True},
                        "note": {"type": "string", "format": "uri", "$comment": "why"},
                    },
                },
            },
            "channel": {"enum": ["email", "sms"]},
        },
    }
    out = openai_strict_schema(schema)
    assert_strict(out, "fixture")
    line = out["properties"]["lines"]["items"]
    assert line["properties"]["gift"] == {"type": ["boolean", "null"], "enum": [True, None]}
    assert line["properties"]["sku"] == {"type": "string", "description": "At least 3 characters."}
    assert line["properties"]["note"]["description"] == "Format: uri."
    assert out["properties"]["channel"] == {"enum": ["email", "sms", None]}
    assert out["properties"]["lines"]["description"] == "No duplicate items."


def test_optional_arguments_become_nullable_and_the_anyof_becomes_words(
    contracts: ContractSet,
) -> None:
    lookup = next(t for t in openai_tools(contracts) if t["function"]["name"] == "lookup_order")
    function = lookup["function"]
    assert function["parameters"]["properties"]["limit"]["type"] == ["integer", "null"]
    assert "Give order_id, or customer_id, or date_from and date_to." in function["description"]


def test_a_strict_call_validates_against_the_contract_once_nulls_are_dropped(
    contracts: ContractSet,
) -> None:
    contract = contracts.versions("lookup_order")[0]
    strict_call = {
        "order_id": "WO-12345-A",
        "customer_id": None,
        "date_from": None,
        "date_to": None,
        "limit": None,
    }
    parameters = openai_tools(contracts)
    schema = next(t for t in parameters if t["function"]["name"] == "lookup_order")
    assert Draft202012Validator(schema["function"]["parameters"]).is_valid(strict_call)
    assert not contract.validator.reference.is_valid(strict_call)
    assert contract.validator.reference.is_valid(from_openai_arguments(strict_call, contract))


def test_the_known_good_arguments_pass_the_exported_schemas(contracts: ContractSet) -> None:
    tools = export_tools(contracts, "anthropic")
    assert isinstance(tools, list)
    by_name = {t["name"]: t["input_schema"] for t in tools}
    for name, arguments in VALID_ARGUMENTS.items():
        # The project's validator: exact multipleOf, ECMA patterns, checked formats.
        assert reference_validator(by_name[name]).is_valid(arguments), name


def test_anthropic_shape(contracts: ContractSet) -> None:
    tools = export_tools(contracts, "anthropic")
    assert isinstance(tools, list) and tools
    for tool in tools:
        assert set(tool) == {"name", "description", "input_schema"}
        schema = tool["input_schema"]
        assert schema["type"] == "object"
        # Anthropic refuses anyOf/oneOf/allOf at the top of input_schema.
        assert not {"anyOf", "oneOf", "allOf"} & set(schema), tool["name"]
        Draft202012Validator.check_schema(schema)


def test_anthropic_keeps_the_contract_schema_otherwise(contracts: ContractSet) -> None:
    contract = contracts.versions("cancel_order")[0]
    assert anthropic_tool(contract)["input_schema"] == contract.input_schema


def test_mcp_entries_are_valid_mcp_tools(contracts: ContractSet) -> None:
    exported = export_tools(contracts, "mcp")
    assert isinstance(exported, dict) and set(exported) == {"tools"}
    result = mcp.types.ListToolsResult.model_validate(exported)
    assert len(result.tools) == len(contracts.callable_names)
    for entry in exported["tools"]:
        tool = mcp.types.Tool.model_validate(entry)
        # Nothing was silently ignored: the model round-trips to the same entry.
        assert tool.model_dump(by_alias=True, exclude_none=True) == entry
        assert entry["inputSchema"]["type"] == "object"


def test_mcp_annotations_follow_the_risk_class(contracts: ContractSet) -> None:
    exported = export_tools(contracts, "mcp")
    assert isinstance(exported, dict)
    tools = {t["name"]: t for t in exported["tools"]}
    assert tools["lookup_order"]["annotations"]["readOnlyHint"] is True
    assert tools["refund_order"]["annotations"] == {
        "readOnlyHint": False,
        "destructiveHint": True,
        "idempotentHint": False,
    }
    assert tools["cancel_order"]["annotations"]["destructiveHint"] is True


@pytest.mark.parametrize("target", ["openai", "anthropic", "mcp"])
def test_no_system_facing_section_is_exported(contracts: ContractSet, target: str) -> None:
    exported = export_tools(contracts, target)  # type: ignore[arg-type]
    text = json.dumps(exported)
    for word in SYSTEM_WORDS:
        assert word not in text, f"{target} export leaks {word}"

    def keys(value: Any) -> Iterator[str]:
        if isinstance(value, dict):
            for k, v in value.items():
                yield k
                yield from keys(v)
        elif isinstance(value, list):
            for v in value:
                yield from keys(v)

    leaked = set(keys(exported)) & set(SYSTEM_SECTIONS)
    assert not leaked, f"{target} export has keys {leaked}"


def test_sunsetted_versions_are_not_exported(contracts: ContractSet) -> None:
    sunsetted = [
        c
        for n in contracts.names
        for c in contracts.versions(n)
        if c.lifecycle.status == "sunsetted"
    ]
    assert sunsetted, "the pack should ship a sunsetted version to test against"
    chosen = callable_versions(contracts)
    assert not {(c.name, c.version) for c in chosen} & {(c.name, c.version) for c in sunsetted}
    for c in chosen:
        versions = contracts.versions(c.name)  # newest first
        active = [v for v in versions if v.lifecycle.status == "active"]
        deprecated = [v for v in versions if v.lifecycle.status == "deprecated"]
        assert c is (active[0] if active else deprecated[0])


def test_cli_writes_the_export(tmp_path: Path) -> None:
    out = tmp_path / "tools.json"
    result = CliRunner().invoke(
        app, ["contracts", "export", "--format", "mcp", str(CONTRACTS_DIR), "--output", str(out)]
    )
    assert result.exit_code == 0, result.output
    assert "cancel_order" in {t["name"] for t in json.loads(out.read_text())["tools"]}


def test_cli_refuses_an_unknown_format() -> None:
    result = CliRunner().invoke(app, ["contracts", "export", "--format", "gemini"])
    assert result.exit_code == 2
