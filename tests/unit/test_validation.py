"""JSON Schema 2020-12 validation: the official test suite, fast vs reference, ECMA-262.

The suite lives outside the repository, at ``$TOOLSENTRY_JSON_SCHEMA_SUITE`` or
``~/.cache/toolsentry/json-schema-test-suite``; ``scripts/bootstrap.sh --test``
fetches it. When it is missing these tests fail, they never skip.
"""

from __future__ import annotations

import http.server
import json
import os
import re
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any, ClassVar

import pytest
import referencing.jsonschema
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from referencing import Registry

from processor.contracts.registry import Contract, load_contracts
from processor.contracts.validation import (
    ASSERTED_FORMATS,
    FORMAT_CHECKER,
    ArgumentValidator,
    NotCompilable,
    ReferenceValidator,
    SchemaRecursion,
    check_schema,
    compile_errors,
    compile_fast,
    ecma_search,
    is_multiple_of,
)
from tests.unit.helpers import CONTRACTS_DIR

SUITE = Path(
    os.environ.get("TOOLSENTRY_JSON_SCHEMA_SUITE")
    or Path.home() / ".cache" / "toolsentry" / "json-schema-test-suite"
)
TESTS = SUITE / "tests" / "draft2020-12"
REMOTES = SUITE / "remotes"
MISSING = (
    f"the JSON-Schema-Test-Suite is not at {SUITE}: run scripts/bootstrap.sh --test "
    "(or point TOOLSENTRY_JSON_SCHEMA_SUITE at a checkout)"
)

# --- known differences, each with its reason --------------------------------------------------

UNASSERTED_FORMATS = frozenset(
    {
        "duration",
        "idn-email",
        "idn-hostname",
        "iri",
        "iri-reference",
        "json-pointer",
        "relative-json-pointer",
        "uri-reference",
        "uri-template",
    }
)
"""Formats the processor leaves as annotations (2020-12's default): contracts do not use them."""

NOT_A_FORMAT_FILE = frozenset({"unknown", "ecmascript-regex"})
"""optional/format files that test no particular format of their own name."""

DRAFT7_DEPENDENCIES = (
    "`dependencies` is the draft-7 keyword; 2020-12 split it into dependentRequired and "
    "dependentSchemas, so a 2020-12 validator ignores it"
)
VOCABULARIES = (
    "$vocabulary is not supported: a custom metaschema without the validation vocabulary "
    "still gets validation keywords applied"
)
KNOWN_GROUPS = {
    (
        "vocabulary.json",
        "schema that uses custom metaschema with with no validation vocabulary",
    ): VOCABULARIES,
}


@dataclass(frozen=True)
class Group:
    file: str
    description: str
    schema: Any
    tests: tuple[dict[str, Any], ...]

    @property
    def optional(self) -> bool:
        return self.file.startswith("optional/")

    @property
    def expects_invalid(self) -> bool:
        return any(not t["valid"] for t in self.tests)


def known_difference(g: Group) -> str | None:
    """Why the reference validator disagrees with the suite on this group, or None."""
    if (g.file, g.description) in KNOWN_GROUPS:
        return KNOWN_GROUPS[(g.file, g.description)]
    # Ignoring a keyword or a format only ever wrongly accepts: the groups that
    # expect some instance to be invalid are exactly the ones that fail.
    if g.file == "optional/dependencies-compatibility.json" and g.expects_invalid:
        return DRAFT7_DEPENDENCIES
    fmt = g.schema.get("format") if isinstance(g.schema, dict) else None
    if g.file.startswith("optional/format/") and fmt in UNASSERTED_FORMATS and g.expects_invalid:
        return f"format {fmt!r} is not in ASSERTED_FORMATS, so it stays an annotation"
    return None


def load_groups() -> list[Group]:
    groups = []
    for path in sorted(TESTS.rglob("*.json")):
        rel = path.relative_to(TESTS).as_posix()
        for raw in json.loads(path.read_text(encoding="utf-8")):
            groups.append(Group(rel, raw["description"], raw["schema"], tuple(raw["tests"])))
    return groups


GROUPS = load_groups() if TESTS.is_dir() else []


def params(with_known_differences: bool) -> list[Any]:
    if not GROUPS:
        return [pytest.param(None, id="suite-missing")]
    out = []
    seen: dict[str, int] = {}
    for g in GROUPS:
        base = f"{g.file}::{g.description}"
        seen[base] = seen.get(base, 0) + 1
        ident = base if seen[base] == 1 else f"{base}#{seen[base]}"
        reason = known_difference(g) if with_known_differences else None
        marks = [pytest.mark.xfail(reason=reason, strict=True)] if reason else []
        out.append(pytest.param(g, id=ident, marks=marks))
    return out


@cache
def remotes() -> Registry:
    """The suite's remotes/ folder, served as http://localhost:1234/ (as the suite expects)."""
    pairs = []
    for path in sorted(REMOTES.rglob("*.json")):
        rel = path.relative_to(REMOTES).as_posix()
        contents = json.loads(path.read_text(encoding="utf-8"))
        # Remotes of other drafts without $schema would be read as 2020-12 wrongly.
        if (
            "$schema" not in contents
            and rel.startswith("draft")
            and not rel.startswith("draft2020-12/")
        ):
            continue
        pairs.append((f"http://localhost:1234/{rel}", contents))
    return Registry().with_contents(pairs, default_specification=referencing.jsonschema.DRAFT202012)


def require(group: Group | None) -> Group:
    if group is None:
        pytest.fail(MISSING)
    return group


def reference(schema: Any, formats: bool) -> Any:
    if formats:
        return ReferenceValidator(schema, registry=remotes(), format_checker=FORMAT_CHECKER)
    return ReferenceValidator(schema, registry=remotes())


def test_suite_is_present() -> None:
    assert TESTS.is_dir(), MISSING
    assert (TESTS / "optional" / "ecmascript-regex.json").is_file(), MISSING
    assert (TESTS / "optional" / "non-bmp-regex.json").is_file(), MISSING
    assert (TESTS / "optional" / "format" / "regex.json").is_file(), MISSING
    assert len(GROUPS) > 400


def test_known_format_differences_are_exactly_the_unasserted_formats() -> None:
    assert TESTS.is_dir(), MISSING
    files = {p.stem for p in (TESTS / "optional" / "format").glob("*.json")}
    assert UNASSERTED_FORMATS.isdisjoint(ASSERTED_FORMATS)
    assert files - NOT_A_FORMAT_FILE == UNASSERTED_FORMATS | ASSERTED_FORMATS


# --- (a) the reference validator against the suite --------------------------------------------


@pytest.mark.parametrize("group", params(with_known_differences=True))
def test_reference_validator_passes_the_suite(group: Group | None) -> None:
    """Required tests without format assertion (an annotation); optional ones with it."""
    g = require(group)
    validator = reference(g.schema, formats=g.optional)
    wrong = [
        (t["description"], t["valid"])
        for t in g.tests
        if validator.is_valid(t["data"]) is not t["valid"]
    ]
    assert wrong == []


# --- (b) the fast validator against the reference ---------------------------------------------


@pytest.mark.parametrize("group", params(with_known_differences=False))
def test_fast_validator_agrees_with_the_reference(group: Group | None) -> None:
    """Wherever the schema compiles, fast == reference-with-asserted-formats, case by case.

    Both assert the same formats, so this holds on format.json too; against the suite's
    own verdicts it is checked everywhere but format.json's annotation cases (where the
    suite expects formats not to be asserted) and the known differences."""
    g = require(group)
    try:
        fast = compile_fast(g.schema)
    except NotCompilable:
        return
    validator = reference(g.schema, formats=True)
    disagree = [
        (t["description"], fast(t["data"]))
        for t in g.tests
        if fast(t["data"]) is not validator.is_valid(t["data"])
    ]
    assert disagree == []
    if g.file != "format.json" and known_difference(g) is None:
        wrong = [
            (t["description"], t["valid"]) for t in g.tests if fast(t["data"]) is not t["valid"]
        ]
        assert wrong == []


def test_fast_validator_compiles_a_good_share_of_the_suite() -> None:
    assert GROUPS, MISSING
    compiled = 0
    for g in GROUPS:
        try:
            compile_fast(g.schema)
        except NotCompilable:
            continue
        compiled += 1
    assert compiled > 150


@pytest.mark.parametrize(
    "schema",
    [
        {"$ref": "https://example.com/schemas/x.json"},
        {"$ref": "#/$defs/missing", "$defs": {"x": {}}},
        {"patternProperties": {"a": {}}},
        {"prefixItems": [{}]},
        {"enum": [1, "a"]},
        {"const": 1},
        {"properties": {"a": {"dependentRequired": {}}}},
        {"anyOf": [{"unevaluatedProperties": False}]},
        [],
    ],
)
def test_schemas_outside_the_fast_subset_are_not_compiled(schema: Any) -> None:
    with pytest.raises(NotCompilable):
        compile_fast(schema)


def test_local_refs_compile_recursively() -> None:
    kids = {"type": "array", "items": {"$ref": "#/$defs/node"}}
    node = {"type": "object", "additionalProperties": False,
            "properties": {"v": {"type": "integer"}, "kids": kids}}  # fmt: skip
    tree = {"$defs": {"node": node}, "$ref": "#/$defs/node"}
    check = compile_fast(tree)
    assert check({"v": 1, "kids": [{"v": 2, "kids": [{"v": 3}]}]})
    assert not check({"v": 1, "kids": [{"v": 2, "kids": [{"v": "3"}]}]})
    assert not check({"v": 1, "kids": [{"x": 1}]})


# --- (b') the compiled errors against the reference's ---------------------------------------


def error_signature(errors: Any) -> list[tuple[Any, ...]]:
    """Everything the schema gate reads off an error (and the rest of it), comparable."""
    return [
        (
            e.validator,
            repr(e.validator_value),
            repr(e.instance),
            list(e.absolute_path),
            list(e.absolute_schema_path),
            e.message,
            repr(e.schema),
            error_signature(e.context),
        )
        for e in errors
    ]


@pytest.mark.parametrize("group", params(with_known_differences=False))
def test_compiled_errors_are_the_references_errors(group: Group | None) -> None:
    """Wherever the schema compiles, every instance's errors are the reference's: same
    keywords, values, paths, messages, contexts, in the same order."""
    g = require(group)
    try:
        explain = compile_errors(g.schema)
    except NotCompilable:
        return
    validator = reference(g.schema, formats=True)
    for t in g.tests:
        expected = error_signature(validator.iter_errors(t["data"]))
        assert error_signature(explain(t["data"])) == expected, t["description"]


def test_a_false_subschema_refuses_the_value_at_its_own_path() -> None:
    """python-jsonschema's own ``descend`` yields a false subschema's error before adding
    the path and schema path it descended by: ``b`` was refused at ``a``, and the property
    at the top at no path."""
    schema = {"properties": {"a": {"properties": {"b": False}}, "c": False}}
    instance = {"a": {"b": 1}, "c": 2}
    for errors in (
        ReferenceValidator(schema).iter_errors(instance),
        compile_errors(schema)(instance),
    ):
        found = [(list(e.absolute_path), list(e.absolute_schema_path)) for e in errors]
        assert found == [(["a", "b"], ["properties", "a", "properties", "b"]),
                         (["c"], ["properties", "c"])]  # fmt: skip


def test_compiled_errors_cover_what_the_fast_validator_covers() -> None:
    assert GROUPS, MISSING
    for g in GROUPS:
        try:
            compile_fast(g.schema)
        except NotCompilable:
            continue
        compile_errors(g.schema)  # never NotCompilable where the fast validator compiles


@pytest.mark.parametrize(
    ("schema", "instance"),
    [
        ({"anyOf": [{"required": ["a"]}, {"required": ["b"]}]}, {}),
        ({"oneOf": [{"type": "string"}, {"minLength": 2}, {"maxLength": 5}]}, "abc"),
        ({"oneOf": [{"type": "integer"}, {"type": "string"}]}, None),
        ({"not": {"type": "string"}}, "x"),
        ({"additionalProperties": False, "properties": {"a": {}}}, {"b": 1, "c": 2, "a": 3}),
        ({"additionalProperties": {"type": "integer"}}, {"b": "1", "c": "2", "d": 3}),
        ({"propertyNames": {"pattern": "^[a-z]+$"}}, {"A": 1, "b": 2, "C": 3}),
        ({"items": False}, [1]),
        ({"items": False}, [1, 2]),
        ({"items": {"type": "integer"}, "uniqueItems": True}, [1, "2", 1, True]),
        ({"$defs": {"n": {"type": "integer", "minimum": 3}}, "allOf": [{"$ref": "#/$defs/n"}]}, 2),
        ({"type": ["integer", "null"], "exclusiveMaximum": 3, "multipleOf": 0.5}, 3.25),
        ({"minProperties": 2, "maxProperties": 0}, {"a": 1}),
        ({"minItems": 1, "maxItems": 0, "minLength": 1}, []),
        ({"const": True, "enum": ["a"]}, 1),
        ({"format": "date", "maxLength": 0}, "2026-02-30"),
        (False, {"a": 1}),
        ({"properties": {"a": False}}, {"a": 1}),
        ({"properties": {"a": {"properties": {"b": False}}}, "items": False}, {"a": {"b": 1}}),
        ({"items": {"properties": {"b": False}}}, [{}, {"b": 1}]),
    ],
)
def test_compiled_errors_on_each_keyword(schema: Any, instance: Any) -> None:
    expected = error_signature(ReferenceValidator(schema, format_checker=FORMAT_CHECKER)
                               .iter_errors(instance))  # fmt: skip
    assert expected, "each case is invalid"
    assert error_signature(compile_errors(schema)(instance)) == expected


# --- (c) fast == reference on the contracts, over generated instances -------------------------

NEAR_MISSES = [
    "WO-12345-A",
    "WO-1234-A",
    "WO-123456-A",
    "wo-12345-a",
    "WO-12345-a",
    "WO-12345-A\n",
    "\nWO-12345-A",
    " WO-12345-A",
    "WO-12345-AB",
    "WO-\u0661\u0662\u0663\u0664\u0665-A",
    "WO-\uff11\uff12\uff13\uff14\uff15-A",
    "ORD-12345",
    "CUS-004211",
    "CUS-00421",
    "CUS-004211\n",
    "CUS-\u0660\u0660\u0664\u0662\u0661\u0661",
    "2026-11-22",
    "2026-02-29",
    "2024-02-29",
    "2026-13-01",
    "2026-11-22\n",
    "2026-1-22",
    "\u0662026-11-22",
    "2026-11-22T10:00:00Z",
    "\u0660",
    "10",
    "true",
    "",
    "ab",
    "abc",
    "a-b",
    "A-B",
    "Bad Tag",
    "x" * 33,
    "x" * 200,
    "x" * 201,
    "x" * 240,
    "x" * 241,
]
SPECIAL_NUMBERS = [
    0, 1, -1, 3, 10, 50, 51, 100, 101, 10000, 10001, 2**64,
    0.0, -0.0, 0.01, 0.1, 0.3, 1.0, 10.0, 10.5, 19.99, 19.999, 9999.99, 10000.0, 10000.01,
    1e308, 1e-7,
]  # fmt: skip
SCALARS = st.one_of(
    st.sampled_from([*NEAR_MISSES, *SPECIAL_NUMBERS, True, False, None]),
    st.integers(),
    st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=8),
)
VALUES = st.one_of(
    SCALARS,
    st.lists(SCALARS, max_size=6),
    st.dictionaries(st.sampled_from(["a", "order_id"]), SCALARS, max_size=2),
)


def weighted(*choices: tuple[int, st.SearchStrategy[Any]]) -> st.SearchStrategy[Any]:
    """Pick a strategy by weight (one_of would flatten nested one_ofs into equal branches)."""
    pool = [strategy for weight, strategy in choices for _ in range(weight)]
    return st.sampled_from(pool).flatmap(lambda strategy: strategy)


EXTRA_KEYS = ["notify_customer", "ORDER_ID", "order_id ", "limit\u200b", ""]
DROP = object()


def _interesting(schema: dict[str, Any]) -> list[Any]:
    """Values at and around the boundaries a property schema draws."""
    out: list[Any] = []
    out += schema.get("enum", [])
    out += [v[:-1] + v[-1].swapcase() for v in schema.get("enum", []) if v]
    out += schema.get("examples", [])
    if "const" in schema:
        out.append(schema["const"])
    for key in ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"):
        if key in schema:
            n = schema[key]
            out += [n, n - 1, n + 1, n - 0.01, n + 0.01, float(n)]
    for key in ("minLength", "maxLength"):
        if key in schema:
            n = schema[key]
            out += ["y" * max(n - 1, 0), "y" * n, "y" * (n + 1)]
    items = schema.get("items")
    if isinstance(items, dict):
        out += [["a-b"], ["a-b", "a-b"], ["a-b", "Bad Tag"], ["ab", "cd", "ef", "gh", "ij", "kl"]]
    return out


def _apply(base: dict[str, Any], changes: list[tuple[str, Any]]) -> dict[str, Any]:
    out = dict(base)
    for key, value in changes:
        if value is DROP:
            out.pop(key, None)
        else:
            out[key] = value
    return out


def instances(contract: Contract) -> st.SearchStrategy[Any]:
    """Mutations of the contract's own examples: a few fields set, dropped or added.

    Starting from the examples keeps a good share of instances valid, so both
    answers of the validators are exercised; any JSON value at the top level too."""
    props: dict[str, Any] = contract.input_schema.get("properties", {})
    examples = contract.raw["affordance"]["examples"]
    bases = [dict(ex["arguments"]) for ex in examples] + [{}]
    good = [ex["arguments"] for ex in examples if ex.get("valid", True)]

    def value(key: str, sub: dict[str, Any]) -> st.SearchStrategy[Any]:
        valid = [*sub.get("enum", []), *(g[key] for g in good if key in g)]
        near = [*_interesting(sub), DROP]
        return weighted(
            (2, st.sampled_from(valid or near)), (1, st.sampled_from(near)), (1, VALUES)
        )

    pairs = [st.tuples(st.just(k), value(k, sub)) for k, sub in props.items()]
    pairs.append(st.tuples(st.sampled_from(EXTRA_KEYS), VALUES))
    objects = st.builds(_apply, st.sampled_from(bases), st.lists(st.one_of(pairs), max_size=3))
    return weighted((4, objects), (1, VALUES))


CONTRACTS = load_contracts(CONTRACTS_DIR)
CONTRACT_LIST = [c for name in CONTRACTS.names for c in CONTRACTS.versions(name)]


@pytest.mark.parametrize("contract", CONTRACT_LIST, ids=lambda c: f"{c.name}@{c.version}")
def test_contract_schemas_compile_to_the_fast_subset(contract: Contract) -> None:
    assert contract.validator.fast is not None


@pytest.mark.parametrize("contract", CONTRACT_LIST, ids=lambda c: f"{c.name}@{c.version}")
def test_fast_equals_reference_on_generated_arguments(contract: Contract) -> None:
    validator: ArgumentValidator = contract.validator
    fast = validator.fast
    assert fast is not None
    seen = {True: 0, False: 0}

    @settings(
        max_examples=2000,
        deadline=None,
        database=None,
        suppress_health_check=[HealthCheck.too_slow],
    )
    @given(instances(contract))
    def check(x: Any) -> None:
        expected = bool(validator.reference.is_valid(x))
        assert fast(x) is expected, x
        seen[expected] += 1

    check()
    # Both answers were exercised, many times over.
    assert seen[True] >= 100, seen
    assert seen[False] >= 500, seen


@pytest.mark.parametrize("contract", CONTRACT_LIST, ids=lambda c: f"{c.name}@{c.version}")
def test_compiled_errors_equal_the_references_on_generated_arguments(contract: Contract) -> None:
    validator: ArgumentValidator = contract.validator
    explain = validator.explain
    assert explain is not None
    invalid = 0

    @settings(
        max_examples=400,
        deadline=None,
        database=None,
        suppress_health_check=[HealthCheck.too_slow],
    )
    @given(instances(contract))
    def check(x: Any) -> None:
        nonlocal invalid
        expected = error_signature(validator.reference.iter_errors(x))
        assert error_signature(explain(x)) == expected, x
        invalid += bool(expected)

    check()
    assert invalid >= 100, invalid


# --- (d) ECMA-262 specifics -------------------------------------------------------------------


def test_digit_class_is_ascii_only() -> None:
    assert ecma_search(r"^\d$", "5") is True
    assert ecma_search(r"^\d$", "\u0660") is False
    assert compile_fast({"type": "string", "pattern": r"^\d$"})("\u0660") is False
    assert ReferenceValidator({"pattern": r"^\d$"}).is_valid("\u0660") is False


def test_dollar_does_not_match_before_a_trailing_newline() -> None:
    assert ecma_search("^a$", "a") is True
    assert ecma_search("^a$", "a\n") is False
    assert compile_fast({"pattern": "^a$"})("a\n") is False
    assert ReferenceValidator({"pattern": "^a$"}).is_valid("a\n") is False


def test_unicode_property_escapes_are_supported() -> None:
    assert ecma_search(r"^\p{Lu}+$", "ÄB") is True
    assert ecma_search(r"^\p{Lu}+$", "äb") is False


def test_pattern_properties_use_ecma_regexes() -> None:
    schema = {"patternProperties": {r"^\d+$": {"type": "integer"}}, "additionalProperties": False}
    v = ReferenceValidator(schema)
    assert v.is_valid({"12": 1}) is True
    assert v.is_valid({"\u0661\u0662": 1}) is False


@pytest.mark.parametrize(
    ("value", "divisor", "expected"),
    [
        (19.99, 0.01, True),
        (1e308, 0.5, True),
        (0.3, 0.1, True),
        (10, 0.01, True),
        (19.999, 0.01, False),
        (7, 2, False),
        (0.0075, 0.0001, True),
        (1, 0, False),
    ],
)
def test_is_multiple_of_is_exact_over_decimals(
    value: float, divisor: float, expected: bool
) -> None:
    assert is_multiple_of(value, divisor) is expected


def test_reference_and_fast_multiple_of_agree_on_cents() -> None:
    schema = {"type": "number", "multipleOf": 0.01}
    assert ReferenceValidator(schema).is_valid(19.99) is True
    assert compile_fast(schema)(19.99) is True
    assert ReferenceValidator(schema).is_valid(19.999) is False
    assert compile_fast(schema)(19.999) is False


@pytest.mark.parametrize("pattern", ["(?P<x>a)", "(?i)a", r"\Z", "a{,2}+(?#c)"])
def test_check_schema_rejects_non_ecma_patterns(pattern: str) -> None:
    with pytest.raises(ValueError, match="is not an ECMA-262 regex"):
        check_schema({"type": "string", "pattern": pattern})


def test_check_schema_rejects_non_ecma_pattern_properties() -> None:
    with pytest.raises(ValueError, match="patternProperties"):
        check_schema({"type": "object", "patternProperties": {"(?P<x>a)": {}}})


@pytest.mark.parametrize("pattern", [r"^(\w+\s?)*$", r"^(x+x+)+y$", r"^(a|a?)+$"])
def test_check_schema_refuses_a_pattern_with_exponential_backtracking(pattern: str) -> None:
    """regress has no step limit: each of these takes seconds on 24 characters that almost
    match, and twice that with each character more."""
    schema = {"type": "object", "properties": {"note": {"type": "string", "pattern": pattern}}}
    with pytest.raises(ValueError) as info:
        check_schema(schema)
    message = str(info.value)
    assert message.startswith(f"#/properties/note/pattern: {pattern!r} can match ")
    assert "in exponentially many ways" in message


def test_check_schema_refuses_a_pattern_property_with_exponential_backtracking() -> None:
    schema = {"type": "object", "patternProperties": {"^(a+)+$": {"type": "string"}}}
    with pytest.raises(ValueError, match=r"^#/patternProperties: '\^\(a\+\)\+\$' can match"):
        check_schema(schema)


@pytest.mark.parametrize(
    ("schema", "where", "expected"),
    [
        ({"type": "string", "pattern": r"^\d+\d+$"}, "#/pattern", "n^2"),
        ({"type": "string", "pattern": r"^\d+\d+$", "maxLength": 65536}, "#/pattern", "n^2"),
        ({"type": "string", "pattern": r"\s*,\s*$", "maxLength": 1001}, "#/pattern", "n^2"),
        ({"type": "string", "pattern": ".*a.*a.*$", "maxLength": 64}, "#/pattern", "n^4"),
        (
            {"type": "object", "patternProperties": {r"^\d+\d+$": {}}},
            "#/patternProperties",
            "propertyNames maxLength of at most 1000 (it has none",
        ),
        (
            {"type": "object", "propertyNames": {"pattern": r"\d+\d+!"}},
            "#/propertyNames/pattern",
            "maxLength of at most 100 (it has none",
        ),
        (  # a maxLength elsewhere does not bound the text this pattern is searched in
            {"type": "string", "maxLength": 10, "allOf": [{"pattern": r"^\d+\d+$"}]},
            "#/allOf/0/pattern",
            "n^2",
        ),
    ],
)
def test_check_schema_refuses_a_polynomial_pattern_its_schema_does_not_bound(
    schema: dict[str, Any], where: str, expected: str
) -> None:
    """^\\d+\\d+$ takes 0.9 s on 16,000 digits and a "!", and arguments may be 64 KB."""
    with pytest.raises(ValueError) as info:
        check_schema(schema)
    message = str(info.value)
    assert message.startswith(f"{where}: ")
    assert "steps on a text of" in message and expected in message


@pytest.mark.parametrize(
    "schema",
    [
        {"type": "string", "pattern": r"^\d+\d+$", "maxLength": 1000},
        {"type": "string", "pattern": r"\s*,\s*$", "maxLength": 200},
        {"type": "string", "pattern": ".*a.*a.*$", "maxLength": 31},
        {"type": "string", "pattern": r"^[a-z]+(-[a-z]+)*$"},  # linear: any length
        {
            "type": "object",
            "propertyNames": {"pattern": r"\d+\d+!", "maxLength": 64},
            "patternProperties": {r"^\d+\d+$": {}},
        },
    ],
)
def test_check_schema_accepts_a_polynomial_pattern_its_schema_bounds(
    schema: dict[str, Any],
) -> None:
    check_schema(schema)


def test_a_text_longer_than_its_pattern_may_be_searched_in_is_not_searched() -> None:
    """A contract bounds the text below what the pattern may be searched in, so only the
    length is wrong: all three validators report that, and none runs the quadratic search
    (which on 64 KB would take about 15 s)."""
    schema = {"type": "string", "pattern": r"^\d+\d+$", "maxLength": 1000}
    check_schema(schema)
    near_miss = "1" * 60_000 + "!"
    validator = ArgumentValidator(schema)
    assert validator.fast is not None and validator.is_valid(near_miss) is False
    assert [e.message for e in validator.errors(near_miss)] == [f"{near_miss!r} is too long"]
    reference = [e.message for e in validator.reference.iter_errors(near_miss)]
    assert reference == [f"{near_miss!r} is too long"]
    # Up to the limit the pattern is searched; past it the text counts as found.
    assert ecma_search(r"^\d+\d+$", "x" * 1000) is False
    assert ecma_search(r"^\d+\d+$", "x" * 1001) is True
    assert compile_fast({"pattern": r"^\d+\d+$"})("x" * 1001) is True
    assert compile_errors({"pattern": r"^\d+\d+$"})("x" * 1001) == []


def test_a_key_longer_than_its_pattern_may_be_searched_in_is_not_searched() -> None:
    schema = {
        "type": "object",
        "propertyNames": {"maxLength": 64},
        "patternProperties": {r"^\d+\d+$": {"type": "integer"}},
        "additionalProperties": False,
    }
    check_schema(schema)
    validator = ArgumentValidator(schema)
    assert validator.is_valid({"12": 1}) and not validator.is_valid({"1a": 1})
    key = "1" * 60_000 + "!"
    assert validator.is_valid({key: 1}) is False
    assert [e.message for e in validator.errors({key: 1})] == [f"{key!r} is too long"]


def test_check_schema_accepts_ecma_patterns() -> None:
    check_schema({"type": "string", "pattern": r"^(?<year>\d{4})-\p{Nd}$"})


def test_format_regex_is_ecma() -> None:
    v = ReferenceValidator({"format": "regex"}, format_checker=FORMAT_CHECKER)
    assert v.is_valid("^(?<x>a)$") is True
    assert v.is_valid("(?P<x>a)") is False
    assert v.is_valid("\\a") is False


def _both(schema: Any, instance: Any) -> tuple[bool, bool, list[str]]:
    fast = ArgumentValidator(schema)
    reference = ReferenceValidator(schema, format_checker=FORMAT_CHECKER)
    return (
        fast.is_valid(instance),
        reference.is_valid(instance),
        [e.message for e in fast.errors(instance)],
    )


def test_a_ref_under_a_nested_id_resolves_against_that_resource() -> None:
    """The nested $id is the base of the $ref beside it: #/$defs/x is the inner x, a
    string, not the root's integer."""
    schema = {
        "type": "object",
        "properties": {
            "p": {"$id": "http://a/sub", "$defs": {"x": {"type": "string"}}, "$ref": "#/$defs/x"}
        },
        "$defs": {"x": {"type": "integer"}},
    }
    assert _both(schema, {"p": 1})[:2] == (False, False)
    assert _both(schema, {"p": "s"})[:2] == (True, True)
    with pytest.raises(NotCompilable):
        compile_fast(schema)


def test_a_percent_encoded_slash_in_a_ref_separates_tokens() -> None:
    schema = {
        "type": "object",
        "properties": {"p": {"$ref": "#/$defs/a%2Fb"}},
        "$defs": {"a/b": {"type": "integer"}, "a": {"b": {"type": "string"}}},
    }
    assert _both(schema, {"p": 1})[:2] == (False, False)
    assert _both(schema, {"p": "s"})[:2] == (True, True)


@pytest.mark.parametrize(
    ("fmt", "value"),
    [
        ("date-time", "2020-01-01T10:00:00Z"),
        ("time", "10:00:00Z"),
        ("date", "2020-01-01"),
        ("email", "a@example.com"),
        ("email", '"a b"@example.com'),
        ("uri", "http://x"),
        ("hostname", "example.com"),
    ],
)
def test_asserted_formats_refuse_a_trailing_newline(fmt: str, value: str) -> None:
    schema = {"type": "string", "format": fmt}
    assert _both(schema, value)[:2] == (True, True)
    assert _both(schema, value + "\n")[:2] == (False, False)


@pytest.mark.parametrize(
    ("instance", "unique"),
    [
        ([[1], [True], [1]], False),
        ([[0], [False], [0]], False),
        ([1, True], True),
        ([0, False], True),
        ([1, 1.0], False),
        ([{"a": 1, "b": 2}, {"b": 2, "a": 1.0}], False),
        ([{"a": [1]}, {"a": [True]}], True),
        ([None, "null", 0, False, [], {}], True),
        ([2**53 + 1, float(2**53)], True),
    ],
)
def test_unique_items_follows_json_equality(instance: list[Any], unique: bool) -> None:
    assert _both({"type": "array", "uniqueItems": True}, instance)[:2] == (unique, unique)


def test_a_long_list_of_unsortable_items_is_refused_by_its_cap() -> None:
    """A 6,000-item list of objects under a 10-item cap: refused, its one error listed, and
    a duplicate at its end found."""
    schema = {"type": "array", "maxItems": 10, "uniqueItems": True}
    big: list[Any] = [{"a": i} for i in range(6000)] + ["x"]
    fast, reference, messages = _both(schema, big)
    assert (fast, reference) == (False, False)
    assert len(messages) == 1 and "too long" in messages[0]
    assert _both({"uniqueItems": True}, [*big, {"a": 5999}])[:2] == (False, False)


@pytest.mark.parametrize(
    ("schema", "where"),
    [
        # A property may be called "default": its schema's pattern is still checked.
        (
            {"type": "object", "properties": {"default": {"type": "string", "pattern": "(?<x"}}},
            "#/properties/default",
        ),
        ({"type": "object", "properties": {"b": {"$ref": "#/$defs/missing"}}}, "#/properties/b"),
        (
            {"properties": {"b": {"$ref": "#/$defs/e/enum/0"}}, "$defs": {"e": {"enum": ["a"]}}},
            "#/properties/b",
        ),
    ],
)
def test_a_schema_that_would_fail_at_call_time_is_refused_when_loaded(
    schema: dict[str, Any], where: str
) -> None:
    with pytest.raises(ValueError, match=where):
        check_schema(schema)


@pytest.mark.parametrize(
    "schema",
    [
        {"properties": {"q": {"$ref": "#query"}}, "$defs": {"q": {"$anchor": "query"}}},
        {
            "$id": "https://example.com/s",
            "properties": {"q": {"$ref": "https://example.com/s#/$defs/q"}},
            "$defs": {"q": {"type": "string"}},
        },
        {"properties": {"q": {"$ref": "https://json-schema.org/draft/2020-12/schema"}}},
    ],
)
def test_refs_that_are_not_json_pointers_are_left_to_the_reference(schema: dict[str, Any]) -> None:
    check_schema(schema)


class _Schemas(http.server.BaseHTTPRequestHandler):
    """Serves one schema for any path, and counts the requests."""

    requests: ClassVar[list[str]] = []

    def do_GET(self) -> None:
        self.requests.append(self.path)
        body = b'{"type": "string"}'
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture
def schema_server() -> Iterator[str]:
    """A real HTTP server on a free local port, serving a schema that would let "x" pass."""
    _Schemas.requests = []
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Schemas)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


def test_a_remote_ref_is_never_fetched(schema_server: str) -> None:
    """Before, python-jsonschema fetched the URI with urlopen at load and on every call
    that reached it: a contract could make the processor request any address."""
    schema = {"type": "object", "properties": {"a": {"$ref": f"{schema_server}/s.json"}}}
    with pytest.raises(ValueError, match=r"#/properties/a/\$ref: .* does not resolve"):
        check_schema(schema)
    validator = ArgumentValidator(schema)
    for arguments in ({"a": "x"}, {"a": 1}):
        with pytest.raises(Exception, match="Unresolvable"):
            validator.is_valid(arguments)
        with pytest.raises(Exception, match="Unresolvable"):
            validator.errors(arguments)
    assert _Schemas.requests == []


@pytest.mark.parametrize(
    ("schema", "where"),
    [
        ({"$defs": {"x": {"$dynamicRef": "https://example.com/s#meta"}}}, "#/$defs/x/$dynamicRef"),
        # Relative to the document's $id: https://example.com/other.json, which it lacks.
        ({"$id": "https://example.com/root.json", "items": {"$ref": "other.json"}}, "#/items"),
        # A nested resource's refs resolve against its own $id.
        (
            {"$defs": {"n": {"$id": "urn:n", "properties": {"a": {"$ref": "#/$defs/gone"}}}}},
            "#/$defs/n/properties/a",
        ),
        ({"properties": {"enum": {"$ref": "#nowhere"}}}, "#/properties/enum"),
    ],
)
def test_a_ref_to_a_schema_the_document_lacks_is_refused_when_loaded(
    schema: dict[str, Any], where: str
) -> None:
    with pytest.raises(ValueError, match=f"{re.escape(where)}.* does not resolve"):
        check_schema(schema)


def test_refs_to_resources_the_document_declares_load() -> None:
    check_schema(
        {
            "$id": "https://example.com/root.json",
            "$defs": {"o": {"$id": "other.json", "$defs": {"s": {"type": "string"}}}},
            "properties": {
                "a": {"$ref": "other.json"},
                "b": {"$ref": "https://example.com/other.json#/$defs/s"},
            },
        }
    )


def test_an_id_is_not_read_as_a_pattern() -> None:
    """Before, every $id was compiled as a regex: "urn:example:orders(" was refused as
    "not an ECMA-262 regex"."""
    check_schema({"$defs": {"o": {"$id": "urn:example:orders(", "type": "string"}}})


_LOOPS = [
    ({"$ref": "#"}, "#/\\$ref"),
    ({"allOf": [{"$ref": "#"}]}, "#/allOf/0/\\$ref"),
    (
        {"$ref": "#/$defs/a", "$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}},
        "\\$ref",
    ),
    (
        {"$ref": "#/$defs/n", "$defs": {"n": {"anyOf": [{"type": "null"}, {"$ref": "#/$defs/n"}]}}},
        "anyOf/1/\\$ref",
    ),
    ({"if": {"$ref": "#"}}, "#/if/\\$ref"),
    ({"dependentSchemas": {"a/b": {"$ref": "#"}}}, "#/dependentSchemas/a~1b/\\$ref"),
    ({"not": {"not": {"$ref": "#/not"}}}, "#/not/not/\\$ref"),
]


@pytest.mark.parametrize(("schema", "where"), _LOOPS)
def test_a_ref_cycle_that_never_descends_into_the_value_is_refused(
    schema: dict[str, Any], where: str
) -> None:
    """Before, such a schema loaded, and every call against it ended in RecursionError."""
    with pytest.raises(SchemaRecursion):  # RecursionError, or pyo3's PanicException
        ArgumentValidator(schema).reference_is_valid({"a/b": 1})
    with pytest.raises(ValueError, match=f"{where}: a \\$ref cycle"):
        check_schema(schema)


@pytest.mark.parametrize(
    "schema",
    [
        {"type": "object", "properties": {"child": {"$ref": "#"}}},
        {"type": "array", "items": {"$ref": "#"}},
        {"prefixItems": [{"$ref": "#"}], "additionalProperties": {"$ref": "#"}},
        {
            "properties": {"tree": {"$ref": "#/$defs/node"}},
            "$defs": {
                "node": {
                    "anyOf": [
                        {"type": "null"},
                        {"type": "array", "items": {"$ref": "#/$defs/node"}},
                    ]
                }
            },
        },
        {
            "allOf": [{"$ref": "#/$defs/a"}],
            "$defs": {"a": {"allOf": [{"$ref": "#/$defs/b"}]}, "b": {}},
        },
        {"then": {"$ref": "#"}, "else": {"$ref": "#"}},  # never applied without an if
    ],
)
def test_recursion_through_properties_or_items_is_a_schema_like_any_other(
    schema: dict[str, Any],
) -> None:
    check_schema(schema)
    validator = ArgumentValidator(schema)
    for value in ({"child": {"child": {}}, "tree": [[None], None]}, [[[]], {}], None):
        assert validator.is_valid(value) == validator.reference.is_valid(value), value


def test_a_loop_no_check_can_see_is_a_value_error_not_a_crash() -> None:
    """A loop through an anchor, deep under a property: past the interpreter's recursion
    limit, rpds (under jsonschema's referencing) raises pyo3's PanicException, a
    BaseException that would pass the gates' ``except Exception`` and stop the processor.
    It is raised as SchemaRecursion, a ValueError: that call is an internal error."""
    schema = {
        "type": "object",
        "properties": {"a": {"properties": {"b": {"$anchor": "b", "not": {"$ref": "#b"}}}}},
    }
    validator = ArgumentValidator(schema)
    for _ in range(3):  # whichever of the two the limit surfaces as
        with pytest.raises(SchemaRecursion):
            validator.is_valid({"a": {"b": 1}})
        with pytest.raises(SchemaRecursion):
            validator.errors({"a": {"b": 1}})
    assert validator.is_valid({"a": {}}) is True


@pytest.mark.parametrize(
    ("value", "valid"),
    [
        ("https://docs.example.com/guide?x=1#part", True),
        ("http://[2001:db8::7]/c=GB?objectClass?one", True),
        ("mailto:John.Doe@example.com", True),
        ("http://-.~_!$&'()*+,;=:%40:80%2f::::::@example.com", True),
        ("https://docs.example.com/\u00fc", False),  # not ASCII: an IRI, not a URI
        ("https://ex\u00e4mple.com/", False),
        ("https://docs.example.com/\x01", False),
        ("https://docs.example.com/\x7f", False),
        ("https://docs.example.com/%zz", False),  # not an escape
        ("https://docs.example.com/a#b#c", False),  # one fragment at most
        ("https://docs.example.com/a#[b]", False),
        ("https://docs.example.com/a b", False),
        ("http://[v1.fe80::a+en1]/", True),  # IPvFuture
        ("http://user:pw@[::1]:8080/a?b=[", False),  # brackets hold the host only
        ("http://a/b[c]", False),
        ("http://a/?q=[1]", False),
        ("http://[::1", False),
        ("http://]]]/", False),
        ("a:[", False),
        ("http://a:b:c/", False),  # a port is digits
        ("http://a/b%", False),
        ("https://a/#", True),
        ("https://ex.com/a?#b?c/d", True),
        ("urn:isbn:0451450523", True),
        ("a:", True),
    ],
)
def test_a_uri_holds_only_what_rfc_3986_allows(value: str, valid: bool) -> None:
    validator = ArgumentValidator({"type": "string", "format": "uri"})
    assert validator.is_valid(value) is valid
