"""Showing one contract to a person: what the tool does, how risky it is, what it needs.

This module owns picking a contract by ``TOOL[@VERSION]`` and rendering it with
rich for a tool owner or reviewer. It reads the whole contract, both faces;
unlike the export it is for people, so the system-facing sections are the point.
Every value from a contract is rendered as plain ``Text``: patterns such as
``[A-Z]`` would otherwise be read as rich markup.
"""

from __future__ import annotations

import difflib
import json
from typing import Any

from rich.console import Console, Group, RenderableType
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from processor.contracts.export import callable_versions
from processor.contracts.lint import OBTAIN_HINT
from processor.contracts.registry import Contract, ContractSet


class UnknownContract(LookupError):
    """No contract matches ``TOOL[@VERSION]``; ``suggestions`` lists what does exist."""

    def __init__(self, message: str, suggestions: list[str]) -> None:
        super().__init__(message)
        self.suggestions = suggestions


def find_contract(contracts: ContractSet, spec: str) -> Contract:
    """The contract named by ``TOOL`` (the callable version) or ``TOOL@VERSION``."""
    name, _, version = spec.partition("@")
    versions = contracts.versions(name)
    if not versions:
        close = difflib.get_close_matches(name, contracts.names, n=5, cutoff=0.5)
        raise UnknownContract(f"no tool named {name!r}", close)
    if version:
        for c in versions:
            if c.version == version:
                return c
        raise UnknownContract(
            f"{name} has no version {version}", [f"{name}@{c.version}" for c in versions]
        )
    chosen = {c.name: c for c in callable_versions(contracts)}
    # A fully sunsetted tool is still worth showing: its newest version explains why.
    return chosen.get(name, versions[0])


def _yes_no(value: Any) -> str:
    return "yes" if value is True else "no" if value is False else "-"


def _facts(title: str, rows: list[tuple[str, str]]) -> Table:
    table = Table(title=title, title_justify="left", show_header=False, box=None, padding=(0, 2))
    table.add_column(style="bold")
    table.add_column()
    for label, value in rows:
        table.add_row(Text(label), Text(value))
    return table


def _types(schema: dict[str, Any]) -> str:
    declared = schema.get("type")
    if isinstance(declared, list):
        return " | ".join(str(t) for t in declared)
    if declared is not None:
        return str(declared)
    if "enum" in schema or "const" in schema:
        return "enum"
    if "$ref" in schema:
        return str(schema["$ref"]).rsplit("/", 1)[-1]
    return "any"


def _range(schema: dict[str, Any]) -> str | None:
    low = schema.get("minimum")
    low_x = schema.get("exclusiveMinimum")
    high = schema.get("maximum")
    high_x = schema.get("exclusiveMaximum")
    left = f"{low} ≤ " if low is not None else f"{low_x} < " if low_x is not None else ""
    right = f" ≤ {high}" if high is not None else f" < {high_x}" if high_x is not None else ""
    return f"{left}x{right}" if left or right else None


def constraint_summary(schema: dict[str, Any]) -> str:
    """Pattern, closed set, range, length and format of one argument, in one line each."""
    parts: list[str] = []
    if "pattern" in schema:
        parts.append(f"pattern {schema['pattern']}")
    if "const" in schema:
        parts.append(f"must be {json.dumps(schema['const'])}")
    if "enum" in schema:
        parts.append("one of " + ", ".join(str(v) for v in schema["enum"]))
    bounds = _range(schema)
    if bounds:
        parts.append(bounds)
    if "multipleOf" in schema:
        parts.append(f"multiple of {schema['multipleOf']}")
    if "minLength" in schema or "maxLength" in schema:
        parts.append(f"length {schema.get('minLength', 0)}..{schema.get('maxLength', '')}")
    if "minItems" in schema or "maxItems" in schema:
        parts.append(f"items {schema.get('minItems', 0)}..{schema.get('maxItems', '')}")
    if schema.get("uniqueItems") is True:
        parts.append("unique items")
    if "format" in schema:
        parts.append(f"format {schema['format']}")
    items = schema.get("items")
    if isinstance(items, dict):
        inner = constraint_summary(items)
        if inner:
            parts.append(f"each item: {inner}")
    return "\n".join(parts)


def obtain_via(schema: dict[str, Any], reference_tool: str | None) -> str:
    """Where the model gets a real value: the description's hint, else the semantic reference."""
    description = schema.get("description")
    if isinstance(description, str):
        hint = OBTAIN_HINT.search(description)
        if hint:
            return hint.group(0).split()[-1]
    return reference_tool or ""


def _arguments(contract: Contract) -> Table:
    schema = contract.input_schema
    required = set(schema.get("required", []))
    references = {
        r["argument"]: r["lookup_tool"]
        for r in contract.raw.get("semantics", {}).get("references", [])
    }
    table = Table("argument", "type", "required", "constraints", "obtain via", title="Arguments")
    for name, sub in schema.get("properties", {}).items():
        table.add_row(
            Text(name, style="bold"),
            Text(_types(sub)),
            Text(_yes_no(name in required)),
            Text(constraint_summary(sub)),
            Text(obtain_via(sub, references.get(name))),
        )
    return table


def _combinations(schema: dict[str, Any]) -> list[tuple[str, str]]:
    rows: list[tuple[str, str]] = []
    for keyword, label in (("anyOf", "at least one of"), ("oneOf", "exactly one of")):
        branches = schema.get(keyword)
        if isinstance(branches, list):
            options = [" + ".join(b.get("required", ["(other shape)"])) for b in branches]
            rows.append((label, " | ".join(options)))
    return rows


def _semantics(contract: Contract) -> list[RenderableType]:
    semantics = contract.raw.get("semantics", {})
    out: list[RenderableType] = []
    rules = semantics.get("rules", [])
    if rules:
        table = Table("rule", "allowed when", "message", "next action", title="Semantic rules")
        for r in rules:
            table.add_row(
                Text(r["id"]), Text(r["expression"]), Text(r["message"]), Text(r["next_action"])
            )
        out.append(table)
    references = semantics.get("references", [])
    if references:
        table = Table(
            "argument", "entity", "allowed states", "look up with", title="Referenced entities"
        )
        for ref in references:
            table.add_row(
                Text(ref["argument"]),
                Text(ref["entity"]),
                Text(", ".join(ref["allowed_states"])),
                Text(ref["lookup_tool"]),
            )
        out.append(table)
    return out


def render_contract(contract: Contract) -> RenderableType:
    """The whole contract for a person, most decision-relevant facts first."""
    raw = contract.raw
    identity, affordance = raw["identity"], raw["affordance"]
    runtime, security = raw["runtime"], raw["security"]
    tx, idem = raw["transactional"], raw["idempotency"]
    lc = contract.lifecycle
    rate, cost = runtime["rate_limits"], runtime["cost_profile"]

    what = Panel(
        Text(str(affordance["model_description"]).strip()),
        title=Text(f"{contract.name} {contract.version}", style="bold"),
        subtitle=Text(f"owner {identity['owner']} · {contract.source}"),
        title_align="left",
    )
    lifecycle = [("status", lc.status)]
    if lc.sunset_date:
        lifecycle.append(("sunset date", lc.sunset_date))
    if lc.replacement:
        lifecycle.append(("replacement", lc.replacement))
    risk = [
        ("side-effect class", tx["side_effect_class"]),
        ("confirmation required", _yes_no(tx["confirmation_required"])),
        ("semantics", tx["semantics"]),
        ("compensation tool", tx["compensation_tool"] or "none"),
        ("post-action verification", _yes_no(tx["post_action_verification_required"])),
    ]
    needs = [
        ("required scopes", ", ".join(security["required_scopes"]) or "none"),
        ("tenant scoped", _yes_no(security["tenant_scoped"])),
        ("data classification", security["data_classification"]),
        ("secrets boundary", security["secrets_boundary"]),
        ("egress", security["egress_policy"]),
    ]
    idempotency = "not supported"
    if idem["supported"]:
        idempotency = "required" if idem["required"] else "supported, optional"
        if idem["key_header"]:
            idempotency += f", key header {idem['key_header']}"
        if idem["ttl_seconds"]:
            idempotency += f", kept {idem['ttl_seconds']} s"
        if idem["payload_hash_required"]:
            idempotency += ", bound to the payload hash"
    limits = [
        ("timeout", f"{runtime['timeout_ms']} ms"),
        ("rate limit", f"{rate['max_requests']} per {rate['window_sec']} s"),
        ("cost", f"{cost['cost_per_call']} {cost['currency']} per {cost['cost_unit']}"),
        ("max retries", str(runtime["max_retries"])),
        ("sandbox isolated", _yes_no(runtime["sandbox_isolated"])),
        ("idempotency", idempotency),
    ]
    use = [("allowed", u) for u in affordance["allowed_use_cases"]]
    use += [("forbidden", u) for u in affordance["forbidden_use_cases"]]

    parts: list[RenderableType] = [
        what,
        _facts("Lifecycle", lifecycle),
        _facts("Risk", risk),
        _facts("Needs", needs),
        _facts("Limits", limits),
        _arguments(contract),
    ]
    combinations = _combinations(contract.input_schema)
    if combinations:
        parts.append(_facts("Argument combinations", combinations))
    if use:
        parts.append(_facts("Use cases", use))
    parts.extend(_semantics(contract))
    # A blank line between sections keeps the fact lists from running together.
    spaced: list[RenderableType] = []
    for part in parts:
        spaced.extend([part, Text("")])
    return Group(*spaced[:-1])


def show(contracts: ContractSet, spec: str, console: Console) -> Contract:
    """Find ``spec`` and print it; raises ``UnknownContract`` with close matches."""
    contract = find_contract(contracts, spec)
    console.print(render_contract(contract))
    return contract
