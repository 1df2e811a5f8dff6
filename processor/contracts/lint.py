"""Linting tool contracts: the design lessons the meta-schema cannot express.

The registry refuses a contract that is *malformed*; this module owns the rules
for contracts that are well-formed but *badly designed*: open object shapes,
free text where a closed set belongs, ids the model can invent, descriptions
that never say when not to call the tool, mutations without idempotency, and
secrets the model would have to carry. Each rule is one small function over
one raw contract document and yields findings with a JSON pointer into it.

Lint works on raw documents, not on a loaded ``ContractSet``, so it can judge
a folder the registry would refuse and report every finding at once. It never
raises on a malformed document: what it cannot read becomes an ``unreadable``
finding.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Literal

import orjson
from jsonschema import Draft202012Validator

from processor.codec.avro import SCHEMAS_DIR
from processor.contracts.registry import contract_files, read_contract_file
from processor.contracts.validation import FORMAT_CHECKER, slow_pattern

Severity = Literal["error", "warning"]
Document = tuple[str, Any]
"""A contract's source path and its parsed (possibly malformed) document."""

MAX_TIMEOUT_MS = 60_000

INPUT_SCHEMA = ("affordance", "input_schema")

# Names that denote a closed set of values; free text there gets normalised
# downstream, or worse, improvised by the model ("customer changed their mind").
CLOSED_SET_NAMES = (
    "reason_code",
    "reason",
    "status",
    "severity",
    "priority",
    "category",
    "type",
    "kind",
    "mode",
    "channel",
    "currency",
    "locale",
    "language",
)
# Audit and money depend on these being exact, so free text is an error.
CLOSED_SET_ERRORS = frozenset({"reason", "reason_code", "currency"})

GENERIC_ID_NAMES = frozenset({"id", "ID", "Id"})
ID_SUFFIXES = ("_id", "_number")
OBTAIN_HINT = re.compile(r"[Oo]btain(?:ed)? (?:it )?(?:via|from|with) [a-z_]+")

# Matched on whole snake_case words so "company" or "span" do not trip "pan",
# and "max_tokens" (a budget, not a credential) does not trip "token".
SECRET_NAME = re.compile(
    r"(?:^|_)(?:password|passwd|secrets?|token|api_?key|private_?key|credentials?"
    r"|card_number|pan|cvv|ssn)(?:_|$)"
)

# Case-insensitive phrases, plus a shouted NOT (lowercase "not" is too common to count).
NEGATIVE_GUIDANCE = re.compile(r"(?i:not for|do not use|don't use|\bnever\b)|\bNOT\b")

# Keywords whose value is one subschema, a list of them, or a name -> subschema map.
SUBSCHEMA_KEYWORDS = (
    "items",
    "additionalItems",
    "contains",
    "not",
    "if",
    "then",
    "else",
    "propertyNames",
    "unevaluatedItems",
)
SUBSCHEMA_LIST_KEYWORDS = ("prefixItems", "anyOf", "oneOf", "allOf")
SUBSCHEMA_MAP_KEYWORDS = ("properties", "$defs", "definitions", "patternProperties")


@dataclass(frozen=True, slots=True)
class Finding:
    """One rule broken at one place in one contract file."""

    rule: str
    severity: Severity
    file: str
    path: str
    message: str

    def __str__(self) -> str:
        return f"{self.file}:{self.path}: {self.severity} {self.rule}: {self.message}"

    def to_dict(self) -> dict[str, str]:
        return asdict(self)


@dataclass(frozen=True, slots=True)
class Issue:
    """What a rule reports before the linter attaches the file."""

    severity: Severity
    path: str
    message: str


@dataclass(frozen=True, slots=True)
class Property:
    """One named argument somewhere in an input schema."""

    name: str
    schema: dict[str, Any]
    pointer: str
    required: bool


Rule = Callable[[dict[str, Any], tuple[str, ...]], Iterable[Issue]]
"""A rule sees one document and every tool name in the set."""


def pointer(*parts: object) -> str:
    """RFC 6901 pointer from path parts (``~`` and ``/`` escaped)."""
    escaped = (str(p).replace("~", "~0").replace("/", "~1") for p in parts)
    return "/" + "/".join(escaped)


def _get(doc: Any, *keys: str) -> Any:
    """The value at ``keys`` or None; never raises on a malformed document."""
    for key in keys:
        if not isinstance(doc, dict):
            return None
        doc = doc.get(key)
    return doc


def _types(schema: dict[str, Any]) -> set[str]:
    declared = schema.get("type")
    if isinstance(declared, str):
        return {declared}
    if isinstance(declared, list):
        return {t for t in declared if isinstance(t, str)}
    return set()


def _is_object_schema(schema: dict[str, Any]) -> bool:
    return "object" in _types(schema) or isinstance(schema.get("properties"), dict)


def _subschemas(schema: dict[str, Any], where: tuple[str, ...]) -> Iterator[tuple[Any, ...]]:
    """Every direct subschema with its path parts."""
    for key in SUBSCHEMA_KEYWORDS:
        if isinstance(schema.get(key), dict):
            yield (*where, key), schema[key]
    if isinstance(schema.get("additionalProperties"), dict):
        yield (*where, "additionalProperties"), schema["additionalProperties"]
    for key in SUBSCHEMA_LIST_KEYWORDS:
        branches = schema.get(key)
        if isinstance(branches, list):
            for i, branch in enumerate(branches):
                if isinstance(branch, dict):
                    yield (*where, key, str(i)), branch
    for key in SUBSCHEMA_MAP_KEYWORDS:
        members = schema.get(key)
        if isinstance(members, dict):
            for name, member in members.items():
                if isinstance(member, dict):
                    yield (*where, key, str(name)), member


def walk_schemas(
    schema: Any, where: tuple[str, ...] = INPUT_SCHEMA
) -> Iterator[tuple[tuple[str, ...], dict[str, Any]]]:
    """The schema and every schema nested in it, depth first."""
    if not isinstance(schema, dict):
        return
    yield where, schema
    for sub_where, sub in _subschemas(schema, where):
        yield from walk_schemas(sub, sub_where)


def walk_properties(doc: dict[str, Any]) -> Iterator[Property]:
    """Every named argument in the input schema, nested ones included."""
    for where, schema in walk_schemas(_get(doc, *INPUT_SCHEMA)):
        props = schema.get("properties")
        if not isinstance(props, dict):
            continue
        required = schema.get("required")
        required_names = set(required) if isinstance(required, list) else set()
        for name, sub in props.items():
            if isinstance(sub, dict):
                yield Property(
                    str(name), sub, pointer(*where, "properties", name), name in required_names
                )


def _has_closed_values(schema: dict[str, Any]) -> bool:
    return any(k in schema for k in ("enum", "const", "pattern"))


# -- rules -------------------------------------------------------------------------------------


def open_object(doc: dict[str, Any], _tools: tuple[str, ...]) -> Iterator[Issue]:
    """An object without ``additionalProperties: false`` lets the model invent arguments."""
    for where, schema in walk_schemas(_get(doc, *INPUT_SCHEMA)):
        if not _is_object_schema(schema):
            continue
        if schema.get("additionalProperties") is False:
            continue
        if schema.get("unevaluatedProperties") is False:
            continue
        yield Issue(
            "error",
            pointer(*where),
            "object schema is open: add additionalProperties: false so invented "
            "arguments are refused",
        )


def _closed_set_word(name: str) -> str | None:
    lowered = name.lower()
    for word in CLOSED_SET_NAMES:
        if lowered == word or lowered.endswith("_" + word):
            return word
    return None


def free_text_enum(doc: dict[str, Any], _tools: tuple[str, ...]) -> Iterator[Issue]:
    """A closed-set name typed as free text invites improvised values."""
    for prop in walk_properties(doc):
        word = _closed_set_word(prop.name)
        if word is None or "string" not in _types(prop.schema):
            continue
        if _has_closed_values(prop.schema):
            continue
        severity: Severity = "error" if word in CLOSED_SET_ERRORS else "warning"
        yield Issue(
            severity,
            prop.pointer,
            f"'{prop.name}' names a closed set but accepts any string: add an enum "
            "(or const/pattern)",
        )


def generic_id(doc: dict[str, Any], _tools: tuple[str, ...]) -> Iterator[Issue]:
    """A bare ``id`` does not say which resource it names; the model will cross them."""
    for prop in walk_properties(doc):
        if prop.name in GENERIC_ID_NAMES:
            yield Issue(
                "error",
                prop.pointer,
                "argument named only 'id': name the resource (order_id, customer_id, ...)",
            )


def _is_identifier(name: str) -> bool:
    return name.lower().endswith(ID_SUFFIXES)


def id_without_pattern(doc: dict[str, Any], _tools: tuple[str, ...]) -> Iterator[Issue]:
    """An id without a pattern lets a plausible invented id (ORD-12345) through the schema."""
    for prop in walk_properties(doc):
        if not _is_identifier(prop.name) or "string" not in _types(prop.schema):
            continue
        if not _has_closed_values(prop.schema):
            yield Issue(
                "error",
                prop.pointer,
                f"identifier '{prop.name}' has no pattern: declare the id format",
            )


def id_without_obtain_hint(doc: dict[str, Any], _tools: tuple[str, ...]) -> Iterator[Issue]:
    """Telling the model where a real id comes from is what stops it inventing one."""
    for prop in walk_properties(doc):
        if not _is_identifier(prop.name):
            continue
        description = prop.schema.get("description")
        if isinstance(description, str) and OBTAIN_HINT.search(description):
            continue
        # A required id the model cannot source is the incident case: it will guess.
        severity: Severity = "error" if prop.required else "warning"
        yield Issue(
            severity,
            pointer(*prop.pointer.strip("/").split("/"), "description"),
            f"identifier '{prop.name}' does not say where to get it: add 'Obtain via <tool>.'",
        )


def no_negative_guidance(doc: dict[str, Any], _tools: tuple[str, ...]) -> Iterator[Issue]:
    """A description that never says when NOT to call the tool over-attracts the model."""
    description = _get(doc, "affordance", "model_description")
    if not isinstance(description, str) or not NEGATIVE_GUIDANCE.search(description):
        yield Issue(
            "warning",
            "/affordance/model_description",
            "does not say when not to use the tool ('Not for ...: use <sibling>')",
        )


def _siblings(doc: dict[str, Any], name: Any, tools: tuple[str, ...]) -> list[str]:
    """Tools the model could confuse with this one: a shared name word, or named as forbidden."""
    words = set(name.split("_")) if isinstance(name, str) else set()
    forbidden = _get(doc, "affordance", "forbidden_use_cases")
    forbidden_text = (
        " ".join(f for f in forbidden if isinstance(f, str)) if isinstance(forbidden, list) else ""
    )
    return [
        t
        for t in tools
        if t != name
        and (words & set(t.split("_")) or re.search(rf"\b{re.escape(t)}\b", forbidden_text))
    ]


def no_sibling_named(doc: dict[str, Any], tools: tuple[str, ...]) -> Iterator[Issue]:
    """A tool with a look-alike sibling must name another tool, or the model picks by guess."""
    name = _get(doc, "identity", "name")
    siblings = _siblings(doc, name, tools)
    if not siblings:
        return
    description = _get(doc, "affordance", "model_description")
    text = description if isinstance(description, str) else ""
    if not any(re.search(rf"\b{re.escape(t)}\b", text) for t in tools if t != name):
        yield Issue(
            "warning",
            "/affordance/model_description",
            f"names no other tool of the set although {', '.join(siblings)} could be "
            "confused with it: say which tool to use instead",
        )


def mutation_without_idempotency(doc: dict[str, Any], _tools: tuple[str, ...]) -> Iterator[Issue]:
    """A retried mutation without a key bound to its payload runs twice."""
    side_effect = _get(doc, "transactional", "side_effect_class")
    if side_effect is None or side_effect == "READ_ONLY":
        return
    for field in ("required", "payload_hash_required"):
        if _get(doc, "idempotency", field) is not True:
            yield Issue(
                "error",
                pointer("idempotency", field),
                f"{side_effect} tool must set idempotency.{field}: true",
            )


def unconfirmed_high_risk(doc: dict[str, Any], _tools: tuple[str, ...]) -> Iterator[Issue]:
    """External and critical actions need a person's explicit yes before they run."""
    side_effect = _get(doc, "transactional", "side_effect_class")
    if side_effect not in ("HIGH_RISK_EXTERNAL", "CRITICAL_MUTATION"):
        return
    if _get(doc, "transactional", "confirmation_required") is not True:
        yield Issue(
            "error",
            "/transactional/confirmation_required",
            f"{side_effect} tool must require confirmation",
        )


def missing_timeout(doc: dict[str, Any], _tools: tuple[str, ...]) -> Iterator[Issue]:
    """Without a bounded timeout one slow dependency holds the whole agent turn."""
    timeout = _get(doc, "runtime", "timeout_ms")
    if not isinstance(timeout, int) or isinstance(timeout, bool):
        yield Issue("error", "/runtime/timeout_ms", "no timeout: set runtime.timeout_ms")
    elif timeout > MAX_TIMEOUT_MS:
        yield Issue(
            "error",
            "/runtime/timeout_ms",
            f"timeout {timeout} ms exceeds {MAX_TIMEOUT_MS} ms",
        )


def secret_parameter(doc: dict[str, Any], _tools: tuple[str, ...]) -> Iterator[Issue]:
    """Secrets must be injected by the gateway, never carried through the model's context."""
    for prop in walk_properties(doc):
        snake = re.sub(r"(?<=[a-z0-9])(?=[A-Z])", "_", prop.name).lower()
        if SECRET_NAME.search(snake):
            yield Issue(
                "error",
                prop.pointer,
                f"'{prop.name}' looks like a secret: the gateway injects credentials, "
                "the model must not see them",
            )


def examples(doc: dict[str, Any], _tools: tuple[str, ...]) -> Iterator[Issue]:
    """A valid and an invalid example pin down the schema's boundary in CI."""
    listed = _get(doc, "affordance", "examples")
    entries = [e for e in listed if isinstance(e, dict)] if isinstance(listed, list) else []
    if not any(e.get("valid", True) is True for e in entries):
        yield Issue("warning", "/affordance/examples", "no valid example")
    if not any(e.get("valid") is False for e in entries):
        yield Issue(
            "warning",
            "/affordance/examples",
            "no invalid example (valid: false) the schema refuses",
        )


# "Obtain via lookup_order or from the customer": a second name counts only when it
# is snake_case, as tool names are and English words are not.
_TOOL_IN_HINT = re.compile(
    r"[Oo]btain(?:ed)? (?:it )?(?:via|from|with) ([a-z][a-z0-9_]*)(?: or ([a-z0-9]+_[a-z0-9_]+))?"
)


def unknown_tool_named(doc: dict[str, Any], tools: tuple[str, ...]) -> Iterator[Issue]:
    """A hint, lookup or compensation that names a tool the set lacks sends the model
    to call something that will be refused as unknown."""
    if len(tools) < 2:
        return  # a contract linted alone has no set to be checked against
    known = set(tools)
    for prop in walk_properties(doc):
        description = prop.schema.get("description")
        if not isinstance(description, str):
            continue
        for match in _TOOL_IN_HINT.finditer(description):
            for name in filter(None, match.groups()):
                # Tool names are snake_case; a plain word ("from the catalogue") is prose.
                if "_" in name and name not in known:
                    yield Issue(
                        "error",
                        pointer(*prop.pointer.strip("/").split("/"), "description"),
                        f"'{prop.name}' says to obtain it via {name}, which is not in the set",
                    )
    references = _get(doc, "semantics", "references")
    for i, ref in enumerate(references if isinstance(references, list) else []):
        name = ref.get("lookup_tool") if isinstance(ref, dict) else None
        if isinstance(name, str) and name not in known:
            yield Issue("error", pointer("semantics", "references", i, "lookup_tool"),
                        f"lookup tool {name} is not in the set")  # fmt: skip
    compensation = _get(doc, "transactional", "compensation_tool")
    if isinstance(compensation, str) and compensation not in known:
        yield Issue("error", pointer("transactional", "compensation_tool"),
                    f"compensation tool {compensation} is not in the set")  # fmt: skip


def backtracking_pattern(doc: dict[str, Any], _tools: tuple[str, ...]) -> Iterator[Issue]:
    """A pattern a model's text can make the processor spend seconds on blocks the
    partition behind it: a pattern with exponential ambiguity, or one whose polynomial
    time the schema does not bound with a small enough maxLength, is an error (the
    registry refuses it too, with the same analysis)."""
    for where, schema in walk_schemas(_get(doc, *INPUT_SCHEMA)):
        found = []
        if isinstance(schema.get("pattern"), str):
            found.append(("pattern", schema["pattern"]))
        props = schema.get("patternProperties")
        for key in props if isinstance(props, dict) else ():
            found.append(("patternProperties", str(key)))
        for keyword, pattern in found:
            why = slow_pattern(schema, keyword, pattern)
            if why is not None:
                yield Issue("error", pointer(*where, keyword), f"{pattern} {why}")


RULES: dict[str, Rule] = {
    "backtracking-pattern": backtracking_pattern,
    "open-object": open_object,
    "free-text-enum": free_text_enum,
    "generic-id": generic_id,
    "id-without-pattern": id_without_pattern,
    "id-without-obtain-hint": id_without_obtain_hint,
    "no-negative-guidance": no_negative_guidance,
    "no-sibling-named": no_sibling_named,
    "mutation-without-idempotency": mutation_without_idempotency,
    "unconfirmed-high-risk": unconfirmed_high_risk,
    "missing-timeout": missing_timeout,
    "secret-parameter": secret_parameter,
    "examples": examples,
    "unknown-tool-named": unknown_tool_named,
}


# -- running -----------------------------------------------------------------------------------


def _meta_validator() -> Draft202012Validator:
    meta = orjson.loads((SCHEMAS_DIR / "tool-contract.schema.json").read_bytes())
    return Draft202012Validator(meta, format_checker=FORMAT_CHECKER)


def _tool_names(documents: list[Document]) -> tuple[str, ...]:
    names = {_get(doc, "identity", "name") for _, doc in documents}
    return tuple(sorted(n for n in names if isinstance(n, str)))


def lint(contracts: Iterable[Document]) -> list[Finding]:
    """Every finding over raw contract documents, sorted by file, path and rule."""
    documents = list(contracts)
    tools = _tool_names(documents)
    meta = _meta_validator()
    findings: list[Finding] = []
    for source, doc in documents:
        if not isinstance(doc, dict):
            findings.append(
                Finding("unreadable", "error", source, "/", "not a mapping of contract sections")
            )
            continue
        # The registry refuses these too; lint reports them so one run shows everything.
        findings.extend(
            Finding("meta-schema", "error", source, pointer(*e.absolute_path), e.message)
            for e in meta.iter_errors(doc)
        )
        for rule_id, rule in RULES.items():
            try:
                issues = list(rule(doc, tools))
            except Exception as exc:  # a malformed doc must not stop the run
                findings.append(
                    Finding("unreadable", "error", source, "/", f"{rule_id} could not run: {exc}")
                )
                continue
            findings.extend(Finding(rule_id, i.severity, source, i.path, i.message) for i in issues)
    return sorted(findings, key=lambda f: (f.file, f.path, f.rule, f.message))


def read_documents(directory: Path) -> tuple[list[Document], list[Finding]]:
    """Parse every contract file under ``directory``; a file that does not parse is a finding."""
    directory = Path(directory)
    if not directory.is_dir():
        return [], [Finding("unreadable", "error", str(directory), "/", "no such directory")]
    documents: list[Document] = []
    files, unlisted = contract_files(directory)
    findings = [Finding("unreadable", "error", p.file, p.path, p.reason) for p in unlisted]
    for path in files:
        rel = str(path.relative_to(directory))
        try:
            doc = read_contract_file(path)
        except Exception as exc:
            findings.append(Finding("unreadable", "error", rel, "/", f"cannot be parsed: {exc}"))
            continue
        documents.append((rel, doc))
    if not documents and not findings:
        findings.append(Finding("unreadable", "error", str(directory), "/", "no contract files"))
    return documents, findings


def lint_folder(directory: Path) -> list[Finding]:
    """Lint every contract file under ``directory``."""
    documents, findings = read_documents(directory)
    return sorted([*findings, *lint(documents)], key=lambda f: (f.file, f.path, f.rule, f.message))
