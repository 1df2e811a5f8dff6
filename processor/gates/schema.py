"""Gate 3, schema: the arguments against the contract's JSON Schema 2020-12.

Every violation is reported, field by field, with a hint the model can act
on, and classified:

* ``STRUCTURAL_VIOLATION`` — missing or unknown fields, the wrong shape;
* ``TYPE_MISMATCH`` — a value of the wrong JSON type (``"10"`` for ``10``);
* ``OUT_OF_BOUNDS`` — enum, const, pattern, format, range, length, size.

The observation's class is the first of those three that occurs, in that
order, as in the taxonomy's gate order.
"""

from __future__ import annotations

import ast
import contextlib
import difflib
import re
from typing import Any

import jsonschema._utils as _jsu
import orjson
from jsonschema import ValidationError

from processor.contracts.registry import Contract
from processor.model import FieldError, Gate, Rejection, TaxonomyClass

_STRUCTURAL = frozenset(
    {
        "required", "additionalProperties", "unevaluatedProperties", "propertyNames",
        "dependentRequired", "dependentSchemas", "minProperties", "maxProperties",
        "anyOf", "oneOf", "allOf", "not", "if", "then", "else", "false",
    }
)  # fmt: skip
_ORDER = (
    TaxonomyClass.STRUCTURAL_VIOLATION,
    TaxonomyClass.TYPE_MISMATCH,
    TaxonomyClass.OUT_OF_BOUNDS,
)
_OBTAIN_VIA = re.compile(r"[Oo]btain(?:ed)? (?:it )?(?:via|from|with) ([a-z][a-z0-9_]*)")
_EXAMPLE_IN_TEXT = re.compile(r"e\.g\.,? ([^\s,;]+?)\.?(?:\s|$)|Example: ([^\s,;]+?)\.?(?:\s|$)")
_JSON_TYPES = {
    bool: "boolean", int: "integer", float: "number", str: "string",
    list: "array", dict: "object", type(None): "null",
}  # fmt: skip
_NUMERIC = re.compile(r"^-?(0|[1-9][0-9]*)(\.[0-9]+)?([eE][+-]?[0-9]+)?$")
_MAX_ERRORS = 20


def json_type(value: Any) -> str:
    return _JSON_TYPES.get(type(value), type(value).__name__)


_ECHO = 64
"""The most of one value or field name of the arguments a hint quotes back: a hint made
mostly of the model's own text would fill next_action, which observations clip, and the
instructions after it (the other fields, calling the tool again) would be cut off."""


def _segment(name: Any) -> str:
    """One step of a field's path, escaped as in a JSON pointer (RFC 6901): a field
    called ``a/b`` is ``a~1b``, so that it cannot read as the field ``b`` inside ``a``.
    A name longer than ``_ECHO`` is clipped."""
    text = str(name)
    if len(text) > _ECHO:
        text = text[: _ECHO - 3] + "..."
    return text.replace("~", "~0").replace("/", "~1")


def field_path(parts: Any) -> str | None:
    """A field's path as observations name it: JSON-pointer segments, no leading ``/``
    (None for the arguments themselves)."""
    return "/".join(_segment(p) for p in parts) or None


def _child(where: str | None, name: Any) -> str:
    """The path of the field ``name`` inside the object at ``where``."""
    return f"{where}/{_segment(name)}" if where else _segment(name)


def _short(value: Any, limit: int = 60) -> str:
    """The value as JSON text (``true``, not Python's ``True``), cut to ``limit``."""
    try:
        text = orjson.dumps(value).decode()
    except TypeError:
        text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _obtain_via(schema: Any) -> str | None:
    if isinstance(schema, dict):
        m = _OBTAIN_VIA.search(str(schema.get("description", "")))
        if m:
            return m.group(1)
    return None


def _example(schema: Any) -> str | None:
    if not isinstance(schema, dict):
        return None
    examples = schema.get("examples")
    if isinstance(examples, list) and examples:
        return str(examples[0])
    m = _EXAMPLE_IN_TEXT.search(str(schema.get("description", "")))
    return (m.group(1) or m.group(2)) if m else None


def _type_hint(field: str, expected: Any, value: Any) -> str:
    names = expected if isinstance(expected, list) else [expected]
    if isinstance(value, str) and len(value) <= _ECHO:
        v = value.strip()
        if ("integer" in names and re.fullmatch(r"-?(0|[1-9][0-9]*)", v)) or (
            "number" in names and _NUMERIC.match(v)
        ):
            return f'{field} must be a number: emit {v} not "{value}"'
        if "boolean" in names and v.lower() in ("true", "false"):
            return f'{field} must be a boolean: emit {v.lower()} not "{value}"'
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    if "string" in names and number and len(text := str(value)) <= _ECHO:
        return f'{field} must be a string: emit "{text}" not {text}'
    return f"{field} must be {' or '.join(names)}, not {json_type(value)}"


def _branch_requirements(branches: Any) -> list[str] | None:
    """For anyOf/oneOf of pure ``required`` branches, the alternatives in words."""
    if not isinstance(branches, list):
        return None
    out = []
    for b in branches:
        if not isinstance(b, dict) or set(b) != {"required"}:
            return None
        out.append(" and ".join(b["required"]))
    return out


def _extras(e: ValidationError, schema: dict[str, Any]) -> list[str]:
    """The fields an additionalProperties or unevaluatedProperties error is about: not
    every field outside ``properties`` (one matching patternProperties, or evaluated by an
    allOf branch, is allowed)."""
    if e.validator == "additionalProperties":
        return [str(k) for k in _jsu.find_additional_properties(e.instance, schema)]
    # unevaluatedProperties: which fields were evaluated depends on every applicator
    # around it; the library names the rest in its message, as reprs.
    m = re.search(
        r"\((.*) (?:was|were) (?:unexpected|unevaluated and invalid)\)$", e.message, re.DOTALL
    )
    if m:
        with contextlib.suppress(ValueError, SyntaxError):
            found = ast.literal_eval(f"({m.group(1)},)")
            return [str(k) for k in found]
    declared = schema.get("properties", {})
    return [str(k) for k in e.instance if k not in declared]


_NAMED = frozenset({"properties", "patternProperties", "$defs", "definitions", "dependentSchemas"})
"""Keywords followed, in a schema path, by a name (a property may be called anything)."""


def _under_property_names(schema_path: Any) -> bool:
    """Whether an error comes from a propertyNames keyword (not a property so named)."""
    path = list(schema_path)
    i = 0
    while i < len(path):
        if path[i] == "propertyNames":
            return True
        i += 2 if path[i] in _NAMED else 1
    return False


def _describe(e: ValidationError, contract: Contract) -> list[tuple[TaxonomyClass, FieldError]]:
    # A false schema's error has no keyword; under propertyNames, the error is about a
    # field's name (its instance), not a value.
    kw = "false" if e.validator is None else str(e.validator)
    if _under_property_names(e.relative_schema_path):
        kw = "propertyNames"
    where = field_path(e.absolute_path)
    name = where or "the arguments"
    schema = e.schema if isinstance(e.schema, dict) else {}
    cls = (
        TaxonomyClass.STRUCTURAL_VIOLATION
        if kw in _STRUCTURAL
        else TaxonomyClass.TYPE_MISMATCH
        if kw == "type"
        else TaxonomyClass.OUT_OF_BOUNDS
    )
    if kw == "required":
        present = e.instance if isinstance(e.instance, dict) else {}
        out = []
        for missing in [r for r in e.validator_value if r not in present]:
            sub = schema.get("properties", {}).get(missing, {})
            full = _child(where, missing)
            hint = f"add {full}"
            if isinstance(sub, dict) and "enum" in sub:
                hint += f" (one of: {', '.join(map(str, sub['enum']))})"
            elif via := _obtain_via(sub):
                hint += f" (obtain it via {via}; never invent it)"
            out.append(
                (
                    cls,
                    FieldError(
                        full, f"{full} is required", "missing_field", json_type_of(sub), None, hint
                    ),
                )
            )
        return out
    if kw == "false":
        return [(cls, _forbidden(e, where))]
    if kw == "propertyNames":
        field = _child(where, e.instance)
        hint = f"{field} is not an allowed field name: remove or rename it"
        return [(cls, FieldError(field, hint, "bad_field_name", None, None, hint))]
    if kw in ("additionalProperties", "unevaluatedProperties") and isinstance(e.instance, dict):
        allowed = list(schema.get("properties", {}))
        out = []
        for extra in _extras(e, schema):
            full = _child(where, extra)
            accepted = f"accepted fields: {', '.join(allowed)}" if allowed else "no other fields"
            hint = f"remove {full}; {accepted}"
            out.append(
                (
                    cls,
                    FieldError(
                        full,
                        f"{full} is not a field of {contract.name}",
                        "unknown_field",
                        None,
                        None,
                        hint,
                    ),
                )
            )
        return out
    if kw in ("anyOf", "oneOf"):
        alts = _branch_requirements(e.validator_value)
        if alts:
            hint = f"provide {' or '.join(alts)}"
            return [
                (
                    cls,
                    FieldError(
                        where,
                        f"{name} needs one of: {'; '.join(alts)}",
                        "missing_alternative",
                        None,
                        None,
                        hint,
                    ),
                )
            ]
        if e.context:
            best = max(e.context, key=lambda c: len(list(c.absolute_path)))
            return _describe(best, contract)
    if kw == "type":
        hint = _type_hint(name, e.validator_value, e.instance)
        expected = (
            e.validator_value if isinstance(e.validator_value, str) else "|".join(e.validator_value)
        )
        return [
            (cls, FieldError(where, hint, "type_mismatch", expected, json_type(e.instance), hint))
        ]
    if kw == "enum":
        values = [str(v) for v in e.validator_value]
        close = difflib.get_close_matches(str(e.instance), values, n=1, cutoff=0.6)
        hint = f"{name} must be one of: {', '.join(values)}"
        if close:
            hint += f" (did you mean {close[0]}?)"
        return [
            (
                cls,
                FieldError(
                    where,
                    f"{_short(e.instance)} is not an allowed value",
                    "not_in_enum",
                    ", ".join(values),
                    _short(e.instance),
                    hint,
                ),
            )
        ]
    if kw == "const":
        want = _short(e.validator_value)
        return [
            (
                cls,
                FieldError(
                    where,
                    f"{name} must be {want}",
                    "const_mismatch",
                    want,
                    _short(e.instance),
                    f"{name} must be exactly {want}",
                ),
            )
        ]
    if kw == "pattern":
        example = _example(schema)
        via = _obtain_via(schema)
        hint = (
            f"{name} must look like {example}"
            if example
            else f"{name} must match {e.validator_value}"
        )
        if via:
            hint += f"; call {via} to get it and never construct one"
        return [
            (
                cls,
                FieldError(
                    where,
                    f"{_short(e.instance)} does not match {e.validator_value}",
                    "pattern_mismatch",
                    str(e.validator_value),
                    _short(e.instance),
                    hint,
                ),
            )
        ]
    bounds = {
        "minimum": ("at least", "below_minimum"),
        "maximum": ("at most", "above_maximum"),
        "exclusiveMinimum": ("greater than", "below_minimum"),
        "exclusiveMaximum": ("less than", "above_maximum"),
        "minLength": ("at least {} characters long", "too_short"),
        "maxLength": ("at most {} characters long", "too_long"),
        "minItems": ("at least {} items", "too_few_items"),
        "maxItems": ("at most {} items", "too_many_items"),
        "multipleOf": ("a multiple of", "not_multiple"),
    }
    if kw in bounds:
        words, code = bounds[kw]
        rule = words.format(e.validator_value) if "{}" in words else f"{words} {e.validator_value}"
        hint = f"{name} must be {rule}"
        return [(cls, FieldError(where, hint, code, rule, _short(e.instance), hint))]
    if kw == "format":
        example = _example(schema) or {
            "date": "2026-11-22",
            "date-time": "2026-11-22T10:00:00Z",
            "email": "name@example.com",
            "uuid": "4b9f0d1e-5c1a-4d0e-9a51-0b5e6f3c2d10",
        }.get(str(e.validator_value))
        hint = f"{name} must be a {e.validator_value}" + (f" like {example}" if example else "")
        return [
            (
                cls,
                FieldError(
                    where,
                    f"{_short(e.instance)} is not a {e.validator_value}",
                    "bad_format",
                    str(e.validator_value),
                    _short(e.instance),
                    hint,
                ),
            )
        ]
    if kw == "items" and e.validator_value is False:
        most = len(schema.get("prefixItems", []))
        rule = f"at most {most} items"
        hint = f"{name} must have {rule}" if most else f"{name} must be an empty list"
        return [(cls, FieldError(where, hint, "too_many_items", rule, _short(e.instance), hint))]
    if kw == "uniqueItems":
        hint = f"{name} must not repeat items"
        return [(cls, FieldError(where, hint, "duplicate_items", None, None, hint))]
    return [
        (cls, FieldError(where, e.message[:300], kw, None, None, f"fix {name}: {e.message[:120]}"))
    ]


def _forbidden(e: ValidationError, where: str | None) -> FieldError:
    """A value a false subschema refuses: a property or item at its own path (the
    validators give it one), a property whose presence ``dependentSchemas`` forbids, or
    the arguments as a whole (an ``allOf``, ``then`` or ``else`` branch that is false)."""
    keyword = list(e.relative_schema_path)[-2:]
    if keyword[:1] == ["dependentSchemas"]:
        where = _child(where, keyword[1])
    if where is None:
        hint = "the contract's schema refuses these arguments as a whole: compare them with it"
        return FieldError(None, "the arguments are not allowed", "forbidden_field", hint=hint)
    return FieldError(where, f"{where} is not allowed", "forbidden_field", hint=f"remove {where}")


def json_type_of(schema: Any) -> str | None:
    if isinstance(schema, dict) and isinstance(schema.get("type"), str):
        return str(schema["type"])
    return None


def check_arguments(arguments: dict[str, Any], contract: Contract) -> Rejection | None:
    """None when the arguments satisfy the contract's input schema."""
    if contract.validator.is_valid(arguments):
        return None
    found: list[tuple[TaxonomyClass, FieldError]] = []
    seen: set[FieldError] = set()
    for e in contract.validator.errors(arguments):
        # jsonschema yields one ``required`` error per missing property, and each is
        # described with every missing property: keep each field error once.
        for cls, fe in _describe(e, contract):
            if fe not in seen:
                seen.add(fe)
                found.append((cls, fe))
        if len(found) >= _MAX_ERRORS:
            break
    if not found:
        # The fast path and the reference disagree: refuse rather than guess.
        return Rejection(
            TaxonomyClass.UNKNOWN_ERROR,
            Gate.SCHEMA,
            (FieldError(None, "validators disagree on these arguments", "validator_disagreement"),),
            "This call cannot be checked; hand off to a human.",
        )
    taxonomy = next(c for c in _ORDER if any(cls is c for cls, _ in found))
    errors = tuple(fe for _, fe in found)
    return Rejection(taxonomy, Gate.SCHEMA, errors, _next_action(contract, errors))


def _next_action(contract: Contract, errors: tuple[FieldError, ...]) -> str:
    """One sentence: the lookups first (never guess ids), then the fixes."""
    hints = [e.hint for e in errors if e.hint]
    lookups = [h for h in hints if "never construct" in h or "never invent" in h]
    rest = [h for h in hints if h not in lookups]
    ordered = (lookups + rest)[:4]
    more = len(hints) - len(ordered)
    tail = f" (and {more} more)" if more > 0 else ""
    return f"{'; '.join(ordered)}{tail}; then call {contract.name} again."
