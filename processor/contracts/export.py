"""Exporting tool definitions for model providers: the model-facing affordance only.

A contract has two faces (seed 001): the affordance the model reads (name,
description, argument schema) and the system-facing contract the processor
enforces (runtime, security, transactional, idempotency, observability,
error_contract, semantics). This module owns turning the first into the tool
definitions OpenAI, Anthropic and MCP clients expect, and guarantees the second
never leaks into a prompt.

Provider schemas are advisory. Strict modes accept only a subset of JSON
Schema, so an export may be looser than the contract (a dropped ``maxLength``,
``oneOf`` relaxed to ``anyOf``); that is safe because the processor validates
every proposal against the full contract schema anyway. Where a dropped
constraint matters to the model, it is put into words in the description.

Only callable versions are exported: per tool the newest active version, or
the newest deprecated one if none is active; sunsetted versions never.
"""

from __future__ import annotations

import copy
from typing import Any, Literal

from processor.contracts.registry import Contract, ContractSet

Target = Literal["openai", "anthropic", "mcp"]
TARGETS: tuple[Target, ...] = ("openai", "anthropic", "mcp")

# The documented Structured Outputs subset (OpenAI "Supported schemas"): these
# keywords are kept, everything else is dropped or rewritten.
OPENAI_STRICT_KEYWORDS = frozenset(
    {
        "type",
        "properties",
        "required",
        "additionalProperties",
        "enum",
        "items",
        "anyOf",
        "description",
        "pattern",
        "format",
        "minimum",
        "maximum",
        "exclusiveMinimum",
        "exclusiveMaximum",
        "multipleOf",
        "minItems",
        "maxItems",
        "$ref",
        "$defs",
    }
)
OPENAI_STRICT_FORMATS = frozenset(
    {"date-time", "time", "date", "duration", "email", "hostname", "ipv4", "ipv6", "uuid"}
)
COMBINATORS = ("anyOf", "oneOf", "allOf")

# Keywords whose value is one subschema, a list of them, or a name -> subschema map;
# everything else is a keyword value and is copied as is (a property may be called "examples").
_ONE = ("items", "additionalItems", "contains", "not", "if", "then", "else", "propertyNames")
_MANY = ("prefixItems", "anyOf", "oneOf", "allOf")
_MAP = ("properties", "$defs", "definitions", "patternProperties", "dependentSchemas")


def callable_versions(contracts: ContractSet) -> list[Contract]:
    """Per tool, the version a model may call: newest active, else newest deprecated."""
    chosen: list[Contract] = []
    for name in contracts.names:
        versions = contracts.versions(name)  # newest first
        for status in ("active", "deprecated"):
            match = next((c for c in versions if c.lifecycle.status == status), None)
            if match is not None:
                chosen.append(match)
                break
    return chosen


# -- schema cleaning ---------------------------------------------------------------------------


def strip_annotations(schema: Any) -> Any:
    """The schema without ``$comment`` and ``x-*`` extensions: notes for people, not models."""
    if not isinstance(schema, dict):
        return schema
    out: dict[str, Any] = {}
    for key, value in schema.items():
        if key == "$comment" or key.startswith("x-"):
            continue
        if key in _ONE or (key == "additionalProperties" and isinstance(value, dict)):
            out[key] = strip_annotations(value)
        elif key in _MANY and isinstance(value, list):
            out[key] = [strip_annotations(v) for v in value]
        elif key in _MAP and isinstance(value, dict):
            out[key] = {n: strip_annotations(v) for n, v in value.items()}
        else:
            out[key] = copy.deepcopy(value)
    return out


def _requirement_branch(branch: Any) -> list[str] | None:
    """The names a ``{required: [...]}`` branch asks for, or None for any other branch."""
    if not isinstance(branch, dict) or set(branch) - {"required", "description"}:
        return None
    names = branch.get("required")
    if not isinstance(names, list) or not names:
        return None
    return [str(n) for n in names]


def _say_requirement(keyword: str, branches: list[list[str]]) -> str:
    options = [" and ".join(names) for names in branches]
    if keyword == "allOf":
        return f"Give {' and '.join(options)}."
    if keyword == "oneOf":
        return f"Give exactly one of: {', or '.join(options)}."
    return f"Give {', or '.join(options)}."


def lift_combinators(schema: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """Move an object's ``anyOf``/``oneOf``/``allOf`` out of the schema into sentences.

    Anthropic rejects these at the top of ``input_schema`` ("input_schema does not
    support oneOf, allOf, or anyOf at the top level"), OpenAI strict mode forbids a
    root ``anyOf``, and MCP clients pass schemas through to those APIs. Contracts use
    them to say which arguments go together (lookup_order: an order id, or a
    customer id, or a date range), so the requirement goes into the description
    instead; the processor still enforces the combinator from the contract.
    """
    out = dict(schema)
    sentences: list[str] = []
    for keyword in COMBINATORS:
        branches = out.pop(keyword, None)
        if branches is None:
            continue
        needs = [_requirement_branch(b) for b in branches] if isinstance(branches, list) else []
        if needs and all(n is not None for n in needs):
            sentences.append(_say_requirement(keyword, [n for n in needs if n is not None]))
        else:
            sentences.append("Some combinations of arguments are refused when the call is checked.")
    return out, sentences


# -- OpenAI strict mode ------------------------------------------------------------------------


def _is_object(schema: dict[str, Any]) -> bool:
    declared = schema.get("type")
    types = declared if isinstance(declared, list) else [declared]
    return "object" in types or "properties" in schema


def _nullable(schema: dict[str, Any]) -> dict[str, Any]:
    """An optional argument made required-but-nullable, as strict mode demands."""
    declared = schema.get("type")
    if "$ref" in schema or "anyOf" in schema or declared is None:
        if "enum" in schema and "$ref" not in schema and "anyOf" not in schema:
            enum = schema["enum"]
            return {**schema, "enum": enum if None in enum else [*enum, None]}
        return {"anyOf": [schema, {"type": "null"}]}
    types = declared if isinstance(declared, list) else [declared]
    out = {**schema, "type": types if "null" in types else [*types, "null"]}
    # An enum restricts the value even when the type allows null, so null joins the enum.
    if "enum" in out and None not in out["enum"]:
        out["enum"] = [*out["enum"], None]
    return out


def _dropped_in_words(schema: dict[str, Any]) -> list[str]:
    """Constraints strict mode cannot carry, said for the model."""
    notes: list[str] = []
    low, high = schema.get("minLength"), schema.get("maxLength")
    if low is not None and high is not None:
        notes.append(f"{low} to {high} characters.")
    elif low is not None:
        notes.append(f"At least {low} characters.")
    elif high is not None:
        notes.append(f"At most {high} characters.")
    if schema.get("uniqueItems") is True:
        notes.append("No duplicate items.")
    fmt = schema.get("format")
    if isinstance(fmt, str) and fmt not in OPENAI_STRICT_FORMATS:
        notes.append(f"Format: {fmt}.")
    return notes


def _with_notes(schema: dict[str, Any], notes: list[str]) -> dict[str, Any]:
    if not notes:
        return schema
    text = " ".join([schema.get("description", ""), *notes]).strip()
    return {**schema, "description": text}


def openai_strict_schema(schema: dict[str, Any]) -> dict[str, Any]:
    """One (sub)schema rewritten into the OpenAI strict-mode subset."""
    source = dict(schema)
    if "const" in source:
        source.setdefault("enum", [source["const"]])
        del source["const"]
    if "oneOf" in source:
        # Strict mode has no oneOf; anyOf is looser, the processor still enforces exactly one.
        source["anyOf"] = [*source.get("anyOf", []), *source.pop("oneOf")]
    notes = _dropped_in_words(source)
    if _is_object(source):
        source, sentences = lift_combinators(source)
        notes.extend(sentences)
    out: dict[str, Any] = {}
    for key, value in source.items():
        if key not in OPENAI_STRICT_KEYWORDS or key == "additionalProperties":
            continue
        if key == "format" and value not in OPENAI_STRICT_FORMATS:
            continue
        if key in ("properties", "$defs"):
            out[key] = {n: openai_strict_schema(v) for n, v in value.items()}
        elif key == "items" and isinstance(value, dict):
            out[key] = openai_strict_schema(value)
        elif key == "anyOf":
            out[key] = [openai_strict_schema(b) for b in value]
        else:
            out[key] = copy.deepcopy(value)
    if _is_object(source):
        out.setdefault("type", "object")
        properties: dict[str, Any] = out.setdefault("properties", {})
        required = set(source.get("required", []))
        for name in properties:
            if name not in required:
                properties[name] = _nullable(properties[name])
        out["required"] = list(properties)
        out["additionalProperties"] = False
    return _with_notes(out, notes)


def from_openai_arguments(arguments: dict[str, Any], contract: Contract) -> dict[str, Any]:
    """Arguments from a strict-mode call, with the nulls standing for omitted optionals removed.

    Strict mode makes the model send ``null`` for every optional argument it leaves
    out; the contract schema does not allow null there, so an adapter drops them
    before the proposal reaches the processor.
    """
    required = set(contract.input_schema.get("required", []))
    return {k: v for k, v in arguments.items() if v is not None or k in required}


# -- tool definitions --------------------------------------------------------------------------


def model_description(contract: Contract, extra: list[str] | None = None) -> str:
    """The affordance description plus what the exported schema could not carry."""
    parts = [str(contract.raw["affordance"]["model_description"]).strip(), *(extra or [])]
    lc = contract.lifecycle
    if lc.status == "deprecated":
        note = "Deprecated"
        if lc.sunset_date:
            note += f", removed on {lc.sunset_date}"
        replacement = (lc.replacement or "").split("@")[0]
        if replacement and replacement != contract.name:
            note += f"; prefer {replacement}"
        parts.append(note + ".")
    return " ".join(parts)


def _model_schema(contract: Contract) -> tuple[dict[str, Any], list[str]]:
    schema = strip_annotations(contract.input_schema)
    schema.pop("$schema", None)
    schema.pop("$id", None)
    return lift_combinators(schema)


def openai_tool(contract: Contract) -> dict[str, Any]:
    """A Chat Completions function tool in strict mode."""
    schema, sentences = _model_schema(contract)
    parameters = openai_strict_schema(schema)
    # The root's own description would duplicate the function description.
    parameters.pop("description", None)
    return {
        "type": "function",
        "function": {
            "name": contract.name,
            "description": model_description(contract, sentences),
            "strict": True,
            "parameters": parameters,
        },
    }


def anthropic_tool(contract: Contract) -> dict[str, Any]:
    """A Messages API tool definition."""
    schema, sentences = _model_schema(contract)
    return {
        "name": contract.name,
        "description": model_description(contract, sentences),
        "input_schema": schema,
    }


def mcp_tool(contract: Contract) -> dict[str, Any]:
    """An entry of an MCP ``tools/list`` result, with behaviour hints for the client."""
    schema, sentences = _model_schema(contract)
    side_effect = contract.side_effect_class.value
    semantics = contract.raw["transactional"].get("semantics")
    read_only = side_effect == "READ_ONLY"
    annotations: dict[str, Any] = {"readOnlyHint": read_only}
    if not read_only:
        # MCP defines these hints only for tools that change something.
        annotations["destructiveHint"] = (
            side_effect == "CRITICAL_MUTATION" or semantics == "irreversible_pivot"
        )
    annotations["idempotentHint"] = semantics in ("read_only", "idempotent_write")
    return {
        "name": contract.name,
        "title": contract.name.replace("_", " ").capitalize(),
        "description": model_description(contract, sentences),
        "inputSchema": schema,
        "annotations": annotations,
    }


def export_tools(contracts: ContractSet, target: Target) -> list[dict[str, Any]] | dict[str, Any]:
    """Every callable tool for ``target``: a list, or for MCP a ``tools/list`` result."""
    versions = callable_versions(contracts)
    if target == "openai":
        return [openai_tool(c) for c in versions]
    if target == "anthropic":
        return [anthropic_tool(c) for c in versions]
    if target == "mcp":
        return {"tools": [mcp_tool(c) for c in versions]}
    raise ValueError(f"unknown export target {target!r}; expected one of {', '.join(TARGETS)}")
