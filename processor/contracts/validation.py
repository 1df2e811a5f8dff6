"""JSON Schema 2020-12 validation of tool arguments, with ECMA-262 patterns.

Two validators share one meaning:

* the *reference* validator is python-jsonschema's ``Draft202012Validator``
  with the regex-bearing keywords (``pattern``, ``patternProperties``, the
  ``additionalProperties``/``unevaluatedProperties`` bookkeeping and
  ``format: regex``) run by ``regress``, an ECMA-262 engine. JSON Schema
  requires ECMA-262 semantics; Python's ``re`` differs (``\\d`` matches
  Arabic-Indic digits, ``$`` matches before a trailing newline, no ``\\p{…}``).
  ``multipleOf`` uses exact decimal arithmetic, because JSON numbers are
  decimal and ``19.99`` *is* a multiple of ``0.01``.
* the *fast* validator compiles the subset of keywords tool contracts use into
  closures that only answer "valid or not" in about a microsecond. A schema
  with any keyword outside that subset is not compiled, and the reference
  answers instead. The two are held equal by a differential test over the
  official test suite and generated instances.

The schema gate asks the fast validator first. Only invalid arguments have their
violations listed, each with its path, by the fast subset's *error compiler*
(``compile_errors``): python-jsonschema's keyword functions mirrored for that
subset, walking only the subschemas the fast validator says fail. Its errors are
the reference's, field for field and in the same order (a differential test over
the suite and generated instances), at about 60% of the cost; schemas outside the
subset get the reference's own walk.
"""

from __future__ import annotations

import datetime as dt
import ipaddress
import operator
import re
import uuid
from collections.abc import Callable, Iterator, Mapping, Sized
from fractions import Fraction
from functools import lru_cache
from typing import Any, Literal, NoReturn
from urllib.parse import unquote

import jsonschema._keywords as _jsk
import jsonschema._utils as _jsu
import jsonschema_specifications
import regress
from jsonschema import Draft202012Validator, FormatChecker, SchemaError, ValidationError, validators
from jsonschema.exceptions import best_match
from referencing import Registry
from referencing._core import Resolver
from referencing.exceptions import Unresolvable
from referencing.jsonschema import DRAFT202012

from processor.contracts import backtracking

Check = Callable[[Any], bool]


@lru_cache(maxsize=4096)
def ecma_regex(pattern: str) -> Any:
    """Compile an ECMA-262 pattern in unicode mode (code points, ``\\p{…}``)."""
    return regress.Regex(pattern, "u")


def ecma_search(pattern: str, text: str) -> bool:
    """Whether ``pattern`` is found in ``text``. A text longer than the pattern may be
    searched in within the step budget (``backtracking.longest_text``) is taken as found,
    unsearched: a contract that carries the pattern bounds every text that reaches it
    below that length (``check_schema``), so the schema holding it fails on the length
    whatever the answer, and the length is what is reported."""
    longest = backtracking.longest_text(pattern)
    if longest is not None and len(text) > longest:
        return True
    return ecma_regex(pattern).find(text) is not None


class _EcmaRe:
    """Stands in for ``re`` inside jsonschema's keyword helpers.

    python-jsonschema calls ``re.search`` for ``patternProperties`` and for the
    property bookkeeping of ``additionalProperties``/``unevaluatedProperties``.
    Routing those calls here keeps one regex dialect across every keyword
    without copying the library's keyword implementations.
    """

    @staticmethod
    def search(pattern: str, text: str) -> bool:
        return ecma_search(pattern, text)


_jsk.re = _EcmaRe()
_jsu.re = _EcmaRe()


def _json_key(v: Any) -> Any:
    """A hashable stand-in equal for equal JSON values: 1 and 1.0 alike, true and 1 not,
    objects whatever their key order."""
    t = type(v)
    if t is str:
        return (3, v)
    if t is bool:
        return (1, v)
    if t is int or t is float:
        return (2, v)  # Python compares ints and floats exactly, and hashes them alike
    if t is list:
        return (4, tuple(_json_key(i) for i in v))
    if t is dict:
        return (5, frozenset((k, _json_key(i)) for k, i in v.items()))
    return (0, v)


def all_unique(items: Any) -> bool:
    """``uniqueItems`` in linear time. jsonschema's own helper falls back to comparing
    every pair when its items do not sort (a contract's 6,000-item list took tens of
    seconds), and its sort puts [1] and [true] side by side, so that [[1], [true], [1]]
    passed as unique."""
    seen: set[Any] = set()
    for i in items:
        key = _json_key(i)
        if key in seen:
            return False
        seen.add(key)
    return True


_jsk.uniq = all_unique  # the library's uniqueItems keyword, for the reference validator


def _exact(x: float | int) -> Fraction | None:
    """The decimal number the JSON text spelled (``repr`` of a float round-trips it)."""
    try:
        return Fraction(repr(x)) if isinstance(x, float) else Fraction(x)
    except (ValueError, OverflowError):  # inf or nan: never produced by a JSON parse
        return None


def is_multiple_of(value: int | float, divisor: int | float) -> bool:
    """Exact ``multipleOf`` over decimals: 19.99 is a multiple of 0.01, 1e308 of 0.5."""
    a, b = _exact(value), _exact(divisor)
    if a is None or b is None or b == 0:
        return False
    return (a % b) == 0


def _multiple_of(
    validator: Any, divisor: Any, instance: Any, schema: Any
) -> Iterator[ValidationError]:
    if validator.is_type(instance, "number") and not is_multiple_of(instance, divisor):
        yield ValidationError(f"{instance!r} is not a multiple of {divisor}")


def _pattern(validator: Any, patrn: str, instance: Any, schema: Any) -> Iterator[ValidationError]:
    if validator.is_type(instance, "string") and not ecma_search(patrn, instance):
        yield ValidationError(f"{instance!r} does not match {patrn!r}")


# --- formats -------------------------------------------------------------------------------

FORMAT_CHECKER = FormatChecker(formats=())

_DATE_RE = re.compile(r"^\d{4}-\d{2}-\d{2}\Z", re.ASCII)
_TIME_RE = re.compile(
    r"^(?P<h>\d{2}):(?P<m>\d{2}):(?P<s>\d{2})(?:\.\d+)?(?P<tz>[Zz]|[+-](?P<th>\d{2}):(?P<tm>\d{2}))\Z",
    re.ASCII,
)
_DOT_ATOM = re.compile(r"^[A-Za-z0-9!#$%&'*+/=?^_`{|}~-]+(?:\.[A-Za-z0-9!#$%&'*+/=?^_`{|}~-]+)*\Z")
_QUOTED_LOCAL = re.compile(r'^"(?:[^"\\\r\n]|\\.)*"\Z')
_URI_PLAIN = r"(?:[A-Za-z0-9\-._~!$&'()*+,;=]|%[0-9A-Fa-f]{2})"
"""Unreserved characters, sub-delims and escapes as %HH (RFC 3986, 2.1-2.3)."""
_URI_PCHAR = rf"(?:{_URI_PLAIN}|[:@])"
_URI_AUTHORITY = (
    rf"(?:(?:{_URI_PLAIN}|:)*@)?"  # userinfo
    r"(?:\[(?:[0-9A-Fa-f:.]+|[vV][0-9A-Fa-f]+\.[A-Za-z0-9\-._~!$&'()*+,;=:]+)\]"  # IP literal
    rf"|{_URI_PLAIN}*)"  # IPv4 address or registered name
    r"(?::[0-9]*)?"  # port
)
_URI_RE = re.compile(
    # RFC 3986, 3: scheme ":" hier-part ["?" query] ["#" fragment], where hier-part is
    # "//" authority and a path, or a path that does not start with "//". Brackets hold
    # only the host's IP literal; only the characters a URI may hold, one '#' at most.
    rf"^[A-Za-z][A-Za-z0-9+.-]*:"
    rf"(?://{_URI_AUTHORITY}(?:/{_URI_PCHAR}*)*|(?!//)(?:{_URI_PCHAR}|/)*)"
    rf"(?:\?(?:{_URI_PCHAR}|[/?])*)?(?:#(?:{_URI_PCHAR}|[/?])*)?\Z",
    re.ASCII,
)
_HOSTNAME_LABEL = re.compile(r"^(?!-)[A-Za-z0-9-]{1,63}(?<!-)\Z", re.ASCII)


def _is_date(value: object) -> bool:
    if not isinstance(value, str):
        return True
    if not _DATE_RE.match(value):
        return False
    try:
        dt.date.fromisoformat(value)
    except ValueError:
        return False
    return True


def _valid_time(value: str, date: dt.date | None = None) -> bool:
    m = _TIME_RE.match(value)
    if not m:
        return False
    h, mi, s = int(m["h"]), int(m["m"]), int(m["s"])
    if h > 23 or mi > 59 or s > 60:
        return False
    if m["th"] is not None and (int(m["th"]) > 23 or int(m["tm"]) > 59):
        return False
    if s == 60:
        # A leap second only exists at 23:59:60 UTC.
        offset = 0
        if m["th"] is not None:
            sign = -1 if value[m.start("tz")] == "-" else 1
            offset = sign * (int(m["th"]) * 60 + int(m["tm"]))
        utc_minutes = (h * 60 + mi - offset) % (24 * 60)
        if utc_minutes != 23 * 60 + 59:
            return False
    return True


def _is_time(value: object) -> bool:
    return not isinstance(value, str) or _valid_time(value)


def _is_date_time(value: object) -> bool:
    if not isinstance(value, str):
        return True
    date, sep, time = value.partition("T") if "T" in value else value.partition("t")
    return bool(sep) and _is_date(date) and _valid_time(time)


def _is_email(value: object) -> bool:
    """RFC 5321 mailbox: dot-atom or quoted local part; hostname or address literal."""
    if not isinstance(value, str):
        return True
    local, at, domain = value.rpartition("@")
    if not at or not local or not domain or not value.isascii():
        return False
    if not (_DOT_ATOM.match(local) or _QUOTED_LOCAL.match(local)):
        return False
    if domain.startswith("[") and domain.endswith("]"):
        literal = domain[1:-1]
        if literal.startswith("IPv6:"):
            return bool(_is_ipv6(literal[5:]))
        return bool(_is_ipv4(literal))
    return bool(_is_hostname(domain))


def _is_uri(value: object) -> bool:
    return not isinstance(value, str) or bool(_URI_RE.match(value))


def _is_uuid(value: object) -> bool:
    if not isinstance(value, str):
        return True
    if len(value) != 36 or value.count("-") != 4:
        return False
    try:
        uuid.UUID(value)
    except ValueError:
        return False
    return all(value[i] == "-" for i in (8, 13, 18, 23))


def _is_ipv4(value: object) -> bool:
    if not isinstance(value, str):
        return True
    try:
        ipaddress.IPv4Address(value)
    except ValueError:
        return False
    return value.isascii()


def _is_ipv6(value: object) -> bool:
    if not isinstance(value, str):
        return True
    if "%" in value or not value.isascii():
        return False
    try:
        ipaddress.IPv6Address(value)
    except ValueError:
        return False
    return True


def _is_hostname(value: object) -> bool:
    if not isinstance(value, str):
        return True
    if not value or len(value) > 253:
        return False
    return all(_HOSTNAME_LABEL.match(label) for label in value.split("."))


def _is_regex(value: object) -> bool:
    if not isinstance(value, str):
        return True
    try:
        ecma_regex(value)
    except Exception:
        return False
    return True


for _name, _check in {
    "date": _is_date,
    "time": _is_time,
    "date-time": _is_date_time,
    "email": _is_email,
    "uri": _is_uri,
    "uuid": _is_uuid,
    "ipv4": _is_ipv4,
    "ipv6": _is_ipv6,
    "hostname": _is_hostname,
    "regex": _is_regex,
}.items():
    FORMAT_CHECKER.checks(_name)(_check)

ASSERTED_FORMATS = frozenset(FORMAT_CHECKER.checkers)

ReferenceValidator = validators.extend(
    Draft202012Validator,
    validators={"pattern": _pattern, "multipleOf": _multiple_of},
)
_library_descend = ReferenceValidator.descend


def _descend_with_paths(
    self: Any,
    instance: Any,
    schema: Any,
    path: Any = None,
    schema_path: Any = None,
    resolver: Any = None,
) -> Iterator[ValidationError]:
    """python-jsonschema's ``descend``, except that a false subschema's error gets the path
    of the value it refuses, as every other error does: the library yields that error
    before adding the path, so ``{"properties": {"legacy": false}}`` refused ``legacy``
    at the arguments' own path, and a forbidden field inside ``meta`` at ``meta``."""
    errors = _library_descend(self, instance, schema, path, schema_path, resolver)
    if schema is not False:
        yield from errors
        return
    for error in errors:
        if not error.path and not error.schema_path:  # (a later release may add them itself)
            if path is not None:
                error.path.appendleft(path)
            if schema_path is not None:
                error.schema_path.appendleft(schema_path)
        yield error


ReferenceValidator.descend = _descend_with_paths


_OFFLINE: Registry[Any] = Registry()
"""Where the reference validator looks up a ``$ref`` beyond the schema's own document: only
the JSON Schema specifications (python-jsonschema adds them), never the network. Without a
registry of its own, python-jsonschema fetches any other URI with ``urlopen``, on every
call that reaches it: a contract could make the processor request any address, and its
verdict would be whatever that address answered."""


def reference_validator(schema: Mapping[str, Any]) -> Any:
    """python-jsonschema 2020-12 with ECMA regexes, decimal multipleOf, asserted formats,
    and no schema fetched over the network."""
    return ReferenceValidator(schema, format_checker=FORMAT_CHECKER, registry=_OFFLINE)


_METASCHEMA = Draft202012Validator(Draft202012Validator.META_SCHEMA)
"""Built once: ``Draft202012Validator.check_schema`` builds a metaschema validator per call."""

_VOCABULARIES = ("core", "applicator", "unevaluated", "validation", "meta-data",
                 "format-annotation", "content")  # fmt: skip
_SCHEMA_MAPS = frozenset({"properties", "$defs", "patternProperties", "dependentSchemas"})


def _static(node: Any) -> Any:
    """A metaschema node with ``$dynamicRef: #meta`` as ``$ref: #`` and its ids dropped."""
    if isinstance(node, list):
        return [_static(n) for n in node]
    if not isinstance(node, dict):
        return node
    out: dict[str, Any] = {}
    for key, value in node.items():
        if key == "$dynamicRef" and value == "#meta":
            out["$ref"] = "#"
        elif key == "$ref" and isinstance(value, str) and value.startswith("meta/"):
            out["$ref"] = "#" + value.partition("#")[2]  # the vocabularies' $defs are merged
        elif key in ("$schema", "$id", "$vocabulary", "$dynamicAnchor"):
            continue
        elif key in _SCHEMA_MAPS and isinstance(value, dict):
            out[key] = {name: _static(sub) for name, sub in value.items()}
        else:
            out[key] = _static(value)
    return out


def static_metaschema() -> dict[str, Any]:
    """The 2020-12 metaschema as one document with static references.

    For the standard dialect every ``$dynamicRef: #meta`` lands on the
    metaschema itself, so the bundle validates exactly what the official one
    does (a differential test holds them equal) without dynamic-scope
    resolution, which is most of python-jsonschema's cost per contract.
    """
    registry = jsonschema_specifications.REGISTRY
    base = "https://json-schema.org/draft/2020-12/"
    root: dict[str, Any] = _static(registry.contents(base + "schema"))
    defs: dict[str, Any] = {}
    parts = []
    for vocabulary in _VOCABULARIES:
        part = _static(registry.contents(f"{base}meta/{vocabulary}"))
        defs.update(part.pop("$defs", {}))
        parts.append(part)
    root["allOf"] = parts
    root["$defs"] = defs
    return root


@lru_cache(maxsize=1)
def _metaschema_fast() -> Check:
    return compile_fast(static_metaschema(), assert_formats=False)


def check_schema(schema: Mapping[str, Any]) -> None:
    """Raise ``jsonschema.SchemaError`` if ``schema`` is not a valid 2020-12 schema,
    or ``ValueError`` if a pattern is not an ECMA-262 regex or can take too long on a
    text that almost matches (``slow_pattern``)."""
    # No format assertion against the metaschema: its ``format: regex`` would be
    # checked with Python's ``re``, which refuses ECMA-262 (``\\p{Lu}``, ``(?<name>…)``).
    # Patterns are checked as ECMA-262 regexes below instead.
    if not _metaschema_fast()(schema):
        error = best_match(_METASCHEMA.iter_errors(schema))
        if error is not None:
            raise SchemaError.create_from(error)
    found = list(_walk(schema, "#"))
    for where, key, value, holder in found:
        if key in ("pattern", "patternProperties"):
            try:
                ecma_regex(value)
            except Exception as exc:
                raise ValueError(f"{where}: {value!r} is not an ECMA-262 regex: {exc}") from exc
            slow = slow_pattern(holder, key, value)
            if slow is not None:  # the engine has no step limit: one near-miss stalls a partition
                raise ValueError(f"{where}: {value!r} {slow}")
    nested = any(key == "$id" for where, key, _, _ in found if where != "#/$id")
    if nested or any(key == "$dynamicRef" or not _pointer_ref(value)
                     for _, key, value, _ in found if key in ("$ref", "$dynamicRef")):  # fmt: skip
        root = jsonschema_specifications.REGISTRY.resolver_with_root(
            DRAFT202012.create_resource(schema)
        )
        for where, value in _unresolved(schema, "#", root):
            raise ValueError(
                f"{where}: {value!r} does not resolve to a schema here: a $ref names this "
                "document or the JSON Schema specification, and nothing is fetched"
            )
    if nested:
        return  # a nested resource: its refs resolve against it, which the reference does
    for where, key, value, _ in found:
        if key == "$ref" and not _resolves(schema, value):
            raise ValueError(f"{where}: {value!r} does not resolve to a schema here")
    cycle = _ref_cycle(schema)
    if cycle is not None:
        raise ValueError(
            f"{cycle}: a $ref cycle that never descends into the value (through properties, "
            "items and the like): validating anything against it recurses for ever"
        )


def slow_pattern(schema: Mapping[str, Any], keyword: str, pattern: str) -> str | None:
    """Why ``pattern``, the ``pattern`` of this schema object or a key of its
    ``patternProperties``, can take too long on a text that almost matches, or None.
    regress has no step limit, so a pattern may not take exponential time, nor more than
    ``backtracking.STEP_BUDGET`` steps on the longest text this schema object lets reach
    it: its ``maxLength``, or for property names that of its ``propertyNames``."""
    why = backtracking.explain(pattern)
    if why is not None:
        return why
    if keyword == "pattern":
        longest, bound = schema.get("maxLength"), "maxLength"
    else:
        names = schema.get("propertyNames")
        longest = names.get("maxLength") if isinstance(names, dict) else None
        bound = "propertyNames maxLength"
    if isinstance(longest, float) and longest.is_integer():
        longest = int(longest)  # 2020-12 counts 5.0 an integer
    return backtracking.explain_length(pattern, longest if type(longest) is int else None, bound)


_SCHEMA_MAPS = frozenset({"properties", "$defs", "definitions", "dependentSchemas"})
"""Keywords whose value maps names to schemas: a property may be called "default"."""


def _walk(node: Any, where: str) -> Iterator[tuple[str, str, Any, Any]]:
    """(where, keyword, value, the schema object holding it) of every pattern, $ref,
    $dynamicRef and $id in a schema: a pattern property's regex too (as the keyword
    ``patternProperties``), and nothing inside enum, const, examples or default values."""
    if isinstance(node, dict):
        for key, value in node.items():
            if key in ("pattern", "$ref", "$dynamicRef", "$id") and isinstance(value, str):
                yield f"{where}/{key}", key, value, node
            elif key == "patternProperties" and isinstance(value, dict):
                for p, sub in value.items():
                    yield f"{where}/patternProperties", "patternProperties", p, node
                    yield from _walk(sub, f"{where}/patternProperties/{p}")
            elif key in _SCHEMA_MAPS and isinstance(value, dict):
                for name, sub in value.items():
                    yield from _walk(sub, f"{where}/{key}/{name}")
            elif key not in ("enum", "const", "examples", "default"):
                yield from _walk(value, f"{where}/{key}")
    elif isinstance(node, list):
        for i, item in enumerate(node):
            yield from _walk(item, f"{where}/{i}")


def _unresolved(node: Any, where: str, resolver: Resolver[Any]) -> Iterator[tuple[str, str]]:
    """(where, value) of every $ref and $dynamicRef that names nothing in the document (or
    in the specifications), each resolved against the base URI its enclosing $ids give it,
    as the reference validator resolves it. The walk is ``_walk``'s."""
    if isinstance(node, dict):
        if isinstance(node.get("$id"), str) and where != "#":
            resolver = resolver.in_subresource(DRAFT202012.create_resource(node))
        for key, value in node.items():
            if key in ("$ref", "$dynamicRef") and isinstance(value, str):
                try:
                    resolver.lookup(value)
                except Unresolvable:
                    yield f"{where}/{key}", value
            elif key == "patternProperties" and isinstance(value, dict):
                for p, sub in value.items():
                    yield from _unresolved(sub, f"{where}/patternProperties/{p}", resolver)
            elif key in _SCHEMA_MAPS and isinstance(value, dict):
                for name, sub in value.items():
                    yield from _unresolved(sub, f"{where}/{key}/{name}", resolver)
            elif key not in ("enum", "const", "examples", "default"):
                yield from _unresolved(value, f"{where}/{key}", resolver)
    elif isinstance(node, list):
        for i, item in enumerate(node):
            yield from _unresolved(item, f"{where}/{i}", resolver)


_IN_PLACE = ("not", "if", "then", "else")
_IN_PLACE_LISTS = ("allOf", "anyOf", "oneOf")
_DESCENDING = ("additionalProperties", "items", "contains", "propertyNames",
               "unevaluatedItems", "unevaluatedProperties")  # fmt: skip
_DESCENDING_MAPS = ("properties", "patternProperties", "$defs", "definitions")


def _ref_cycle(root: Any) -> str | None:
    """Where a chain of local $refs and in-place applicators (allOf, not, if, ...) comes
    back to a schema it started from without descending into a property or an item: a
    validator following it never ends, whatever the value. Recursion through properties
    or items is fine (the value is finite). None: no such cycle."""
    where: dict[int, str] = {}  # schema object -> its JSON pointer
    same_value: dict[int, list[tuple[int, str]]] = {}  # -> (schema, via) on the same value
    stack: list[tuple[Any, str]] = [(root, "#")]
    while stack:
        node, at = stack.pop()
        if not isinstance(node, dict) or id(node) in where:
            continue
        where[id(node)] = at
        edges = same_value.setdefault(id(node), [])
        ref = node.get("$ref")
        if isinstance(ref, str) and (ref == "#" or ref.startswith("#/")):
            try:
                target = pointer_target(root, ref)
            except LookupError:
                target = None
            if isinstance(target, dict):
                edges.append((id(target), f"{at}/$ref"))
                stack.append((target, ref))
        for key, value in node.items():
            escaped = key.replace("~", "~0").replace("/", "~1")
            if key in ("then", "else") and "if" not in node:
                stack.append((value, f"{at}/{escaped}"))  # never applied without an if
            elif key in _IN_PLACE and isinstance(value, dict):
                edges.append((id(value), f"{at}/{escaped}"))
                stack.append((value, f"{at}/{escaped}"))
            elif key in _IN_PLACE_LISTS and isinstance(value, list):
                for i, sub in enumerate(value):
                    if isinstance(sub, dict):
                        edges.append((id(sub), f"{at}/{escaped}/{i}"))
                        stack.append((sub, f"{at}/{escaped}/{i}"))
            elif key == "dependentSchemas" and isinstance(value, dict):
                for name, sub in value.items():
                    if isinstance(sub, dict):
                        part = f"{at}/{escaped}/{name.replace('~', '~0').replace('/', '~1')}"
                        edges.append((id(sub), part))
                        stack.append((sub, part))
            elif key in _DESCENDING:
                stack.append((value, f"{at}/{escaped}"))
            elif key == "prefixItems" and isinstance(value, list):
                stack.extend((sub, f"{at}/{escaped}/{i}") for i, sub in enumerate(value))
            elif key in _DESCENDING_MAPS and isinstance(value, dict):
                stack.extend(
                    (sub, f"{at}/{escaped}/{name.replace('~', '~0').replace('/', '~1')}")
                    for name, sub in value.items()
                )
    # Depth-first over the same-value edges, iteratively: a back edge closes a cycle.
    state: dict[int, int] = {}  # 1: on the current path, 2: done
    for start in same_value:
        if start in state:
            continue
        state[start] = 1
        path = [(start, iter(same_value[start]))]
        while path:
            node_id, pending = path[-1]
            step = next(pending, None)
            if step is None:
                state[node_id] = 2
                path.pop()
                continue
            child, via = step
            if state.get(child) == 1:
                return via
            if child not in state:
                state[child] = 1
                path.append((child, iter(same_value.get(child, ()))))
    return None


def _pointer_ref(ref: str) -> bool:
    """Whether a $ref is a JSON pointer into its own document (``#`` or ``#/...``)."""
    return ref == "#" or ref.startswith("#/")


def _resolves(root: Any, ref: str) -> bool:
    """Whether a JSON-pointer $ref (``#/...``) names a schema of this document. Other forms
    (``#anchor``, a URI the document or the reference validator knows) are left to the
    reference validator."""
    if not ref.startswith("#/"):
        return True
    try:
        return isinstance(pointer_target(root, ref), (dict, bool))
    except LookupError:
        return False


def pointer_target(root: Any, ref: str) -> Any:
    """What a local ``$ref`` (``#`` or ``#/...``) points at in ``root``; LookupError when
    nothing. The fragment is percent-decoded whole, then split (RFC 6901, section 6): a
    %2F is a separator like any '/'."""
    node = root
    for token in unquote(ref[2:]).split("/") if ref != "#" else []:
        token = token.replace("~1", "/").replace("~0", "~")
        try:
            node = node[int(token)] if isinstance(node, list) else node[token]
        except (KeyError, IndexError, ValueError, TypeError) as exc:
            raise LookupError(ref) from exc
    return node


# --- the fast subset --------------------------------------------------------------------------

_ANNOTATIONS = frozenset(
    {
        "$schema", "$id", "$comment", "title", "description", "default", "examples",
        "deprecated", "readOnly", "writeOnly", "contentMediaType", "contentEncoding",
    }
)  # fmt: skip


class NotCompilable(Exception):
    """The schema uses a keyword outside the fast subset; use the reference."""


def _is_integer(x: Any) -> bool:
    t = type(x)
    return t is int or (t is float and x.is_integer())


_TYPE_TESTS: dict[str, Check] = {
    "object": lambda x: type(x) is dict,
    "array": lambda x: type(x) is list,
    "string": lambda x: type(x) is str,
    "boolean": lambda x: type(x) is bool,
    "null": lambda x: x is None,
    "number": lambda x: type(x) is int or type(x) is float,
    "integer": _is_integer,
}


def compile_fast(schema: Any, *, assert_formats: bool = True) -> Check:
    """Compile ``schema`` into a validity test, or raise ``NotCompilable``.

    ``$ref`` is followed within the same document (``#`` and ``#/...``
    pointers, recursion included); any other reference is not compiled.
    """
    return _FastCompiler(schema, assert_formats).compile(schema)


class _FastCompiler:
    def __init__(self, root: Any, assert_formats: bool) -> None:
        self.root = root
        self.assert_formats = assert_formats
        self.refs: dict[str, Check] = {}

    def compile(self, schema: Any) -> Check:
        if schema is True:
            return lambda x: True
        if schema is False:
            return lambda x: False
        if not isinstance(schema, dict):
            raise NotCompilable("schema is not an object")
        unknown = set(schema) - _FAST_KEYWORDS - _ANNOTATIONS
        if unknown:
            raise NotCompilable(f"keywords outside the fast subset: {sorted(unknown)}")
        if "$id" in schema and schema is not self.root:
            # A nested $id is a new base for the $refs under it: the reference resolves them.
            raise NotCompilable("a nested $id")
        checks: list[Check] = []
        if "$ref" in schema:
            checks.append(self.ref(schema["$ref"]))
        self.scalar(schema, checks)
        self.numeric(schema, checks)
        self.object(schema, checks)
        self.array(schema, checks)
        self.combinators(schema, checks)
        if not checks:
            return lambda x: True
        if len(checks) == 1:
            return checks[0]
        return lambda x: all(c(x) for c in checks)

    def ref(self, ref: Any) -> Check:
        if not isinstance(ref, str) or not (ref == "#" or ref.startswith("#/")):
            raise NotCompilable(f"$ref {ref!r} leaves the document")
        if ref not in self.refs:
            # A placeholder first, so a schema that refers to itself compiles.
            target: list[Check] = []
            self.refs[ref] = lambda x: target[0](x)
            target.append(self.compile(self.resolve(ref)))
        return self.refs[ref]

    def resolve(self, ref: str) -> Any:
        try:
            return pointer_target(self.root, ref)
        except LookupError as exc:
            raise NotCompilable(f"$ref {ref!r} does not resolve") from exc

    def scalar(self, schema: dict[str, Any], checks: list[Check]) -> None:
        if "type" in schema:
            names = schema["type"] if isinstance(schema["type"], list) else [schema["type"]]
            tests = [_TYPE_TESTS[n] for n in names]
            if len(tests) == 1:
                checks.append(tests[0])
            else:
                checks.append(lambda x: any(t(x) for t in tests))
        if "enum" in schema:
            values = schema["enum"]
            if not all(type(v) is str for v in values):
                raise NotCompilable("enum with non-string members")
            allowed = frozenset(values)
            checks.append(lambda x: type(x) is str and x in allowed)
        if "const" in schema:
            c = schema["const"]
            if type(c) not in (str, bool):
                raise NotCompilable("const other than a string or boolean")
            const_type = type(c)
            checks.append(lambda x: type(x) is const_type and x == c)
        if "pattern" in schema:
            rx = ecma_regex(schema["pattern"])
            longest = backtracking.longest_text(schema["pattern"])  # as in ecma_search
            if longest is None:
                checks.append(lambda x: type(x) is not str or rx.find(x) is not None)
            else:
                checks.append(
                    lambda x: type(x) is not str or len(x) > longest or rx.find(x) is not None
                )
        fmt_name = schema.get("format")
        if self.assert_formats and fmt_name in ASSERTED_FORMATS:
            fmt = FORMAT_CHECKER.checkers[fmt_name][0]
            checks.append(lambda x: type(x) is not str or bool(fmt(x)))
        if "minLength" in schema:
            min_len = schema["minLength"]
            checks.append(lambda x: type(x) is not str or len(x) >= min_len)
        if "maxLength" in schema:
            max_len = schema["maxLength"]
            checks.append(lambda x: type(x) is not str or len(x) <= max_len)

    def numeric(self, schema: dict[str, Any], checks: list[Check]) -> None:
        if "minimum" in schema:
            lo = schema["minimum"]
            checks.append(lambda x: not _is_number(x) or x >= lo)
        if "maximum" in schema:
            hi = schema["maximum"]
            checks.append(lambda x: not _is_number(x) or x <= hi)
        if "exclusiveMinimum" in schema:
            xlo = schema["exclusiveMinimum"]
            checks.append(lambda x: not _is_number(x) or x > xlo)
        if "exclusiveMaximum" in schema:
            xhi = schema["exclusiveMaximum"]
            checks.append(lambda x: not _is_number(x) or x < xhi)
        if "multipleOf" in schema:
            d = schema["multipleOf"]
            checks.append(lambda x: not _is_number(x) or is_multiple_of(x, d))

    def object(self, schema: dict[str, Any], checks: list[Check]) -> None:
        props = {k: self.compile(v) for k, v in schema.get("properties", {}).items()}
        required = tuple(schema.get("required", ()))
        additional = schema.get("additionalProperties", True)
        extra: Check | None = None if additional is True else self.compile(additional)
        names: Check | None = None
        if "propertyNames" in schema:
            names = self.compile(schema["propertyNames"])
        min_p = schema.get("minProperties")
        max_p = schema.get("maxProperties")
        if not (props or required or extra or names or min_p is not None or max_p is not None):
            return

        def check_object(x: Any) -> bool:
            if type(x) is not dict:
                return True
            for r in required:
                if r not in x:
                    return False
            if min_p is not None and len(x) < min_p:
                return False
            if max_p is not None and len(x) > max_p:
                return False
            for k, v in x.items():
                if names is not None and not names(k):
                    return False
                sub = props.get(k)
                if sub is not None:
                    if not sub(v):
                        return False
                elif extra is not None and not extra(v):
                    return False
            return True

        checks.append(check_object)

    def array(self, schema: dict[str, Any], checks: list[Check]) -> None:
        items = self.compile(schema["items"]) if "items" in schema else None
        min_i = schema.get("minItems")
        max_i = schema.get("maxItems")
        unique = bool(schema.get("uniqueItems", False))
        if items is None and min_i is None and max_i is None and not unique:
            return

        def check_array(x: Any) -> bool:
            if type(x) is not list:
                return True
            if min_i is not None and len(x) < min_i:
                return False
            if max_i is not None and len(x) > max_i:
                return False
            if items is not None and not all(items(i) for i in x):
                return False
            if unique:
                if all(type(i) is str for i in x):
                    return len(set(x)) == len(x)
                return all_unique(x)
            return True

        checks.append(check_array)

    def combinators(self, schema: dict[str, Any], checks: list[Check]) -> None:
        if "allOf" in schema:
            subs = [self.compile(s) for s in schema["allOf"]]
            checks.append(lambda x: all(s(x) for s in subs))
        if "anyOf" in schema:
            any_subs = [self.compile(s) for s in schema["anyOf"]]
            checks.append(lambda x: any(s(x) for s in any_subs))
        if "oneOf" in schema:
            one_subs = [self.compile(s) for s in schema["oneOf"]]
            checks.append(lambda x: sum(1 for s in one_subs if s(x)) == 1)
        if "not" in schema:
            neg = self.compile(schema["not"])
            checks.append(lambda x: not neg(x))


def _is_number(x: Any) -> bool:
    t = type(x)
    return t is int or t is float


_FAST_KEYWORDS = frozenset(
    {
        "type", "enum", "const", "pattern", "format", "minLength", "maxLength",
        "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf",
        "properties", "required", "additionalProperties", "minProperties", "maxProperties",
        "propertyNames", "items", "minItems", "maxItems", "uniqueItems",
        "allOf", "anyOf", "oneOf", "not", "$ref", "$defs",
    }
)  # fmt: skip


# --- the fast subset's errors ------------------------------------------------------------------

Errors = Callable[[Any], list[ValidationError]]
_TYPE_CHECKER = Draft202012Validator.TYPE_CHECKER


def _no_errors(x: Any) -> list[ValidationError]:
    return []


def compile_errors(schema: Any) -> Errors:
    """Compile ``schema`` into a function listing every violation, or raise
    ``NotCompilable``.

    The errors are the reference validator's own, field for field: the same keyword,
    value, instance, schema, paths, message and context, in the same order (a
    differential test holds them equal). Each subschema asks the fast validator first
    and walks only the parts that fail, where the reference walks every keyword of
    every subschema through its generic dispatch and reference resolution.
    """
    return _ErrorCompiler(schema).compile(schema)


def _error(message: str, **kw: Any) -> ValidationError:
    return ValidationError(message, **kw)


def _false_schema(x: Any) -> list[ValidationError]:
    return [
        _error(
            f"False schema does not allow {x!r}",
            validator=None,
            validator_value=None,
            instance=x,
            schema=False,
        )
    ]


def _descend(
    errors: Errors, x: Any, path: Any = None, schema_path: Any = None
) -> list[ValidationError]:
    found = errors(x)
    for e in found:
        if path is not None:
            e.path.appendleft(path)
        if schema_path is not None:
            e.schema_path.appendleft(schema_path)
    return found


class _ErrorCompiler:
    """Mirrors python-jsonschema's keyword functions for the fast subset."""

    def __init__(self, root: Any) -> None:
        self.root = root
        self.valid = _FastCompiler(root, assert_formats=True)
        self.refs: dict[str, Errors] = {}

    def compile(self, schema: Any) -> Errors:
        if schema is True:
            return _no_errors
        if schema is False:
            return _false_schema
        valid = self.valid.compile(schema)  # raises NotCompilable outside the subset
        keywords = [
            (k, v, make(self, v, schema))
            for k, v in schema.items()
            if (make := _ERROR_KEYWORDS.get(k)) is not None
        ]

        def errors(x: Any) -> list[ValidationError]:
            if valid(x):
                return []
            out: list[ValidationError] = []
            for k, v, check in keywords:
                for e in check(x):
                    e._set(
                        validator=k,
                        validator_value=v,
                        instance=x,
                        schema=schema,
                        type_checker=_TYPE_CHECKER,
                    )
                    if k != "$ref":
                        e.schema_path.appendleft(k)
                    out.append(e)
            return out

        return errors

    def ref(self, ref: str, schema: Any) -> Errors:
        if ref not in self.refs:
            target: list[Errors] = []
            self.refs[ref] = lambda x: target[0](x)
            target.append(self.compile(self.valid.resolve(ref)))
        return self.refs[ref]

    # One method per keyword: (value, the schema holding it) -> the keyword's check.

    def type(self, types: Any, schema: Any) -> Errors:
        names = types if isinstance(types, list) else [types]
        tests = [_TYPE_TESTS[n] for n in names]
        reprs = ", ".join(repr(n) for n in names)
        return lambda x: (
            [] if any(t(x) for t in tests) else [_error(f"{x!r} is not of type {reprs}")]
        )

    def enum(self, values: Any, schema: Any) -> Errors:
        allowed = frozenset(values)
        return lambda x: (
            [] if type(x) is str and x in allowed else [_error(f"{x!r} is not one of {values!r}")]
        )

    def const(self, c: Any, schema: Any) -> Errors:
        const_type = type(c)
        return lambda x: [] if type(x) is const_type and x == c else [_error(f"{c!r} was expected")]

    def pattern(self, patrn: str, schema: Any) -> Errors:
        rx = ecma_regex(patrn)
        longest = backtracking.longest_text(patrn)  # as in ecma_search
        if longest is None:
            return lambda x: (
                [_error(f"{x!r} does not match {patrn!r}")]
                if type(x) is str and rx.find(x) is None
                else []
            )
        return lambda x: (
            [_error(f"{x!r} does not match {patrn!r}")]
            if type(x) is str and len(x) <= longest and rx.find(x) is None
            else []
        )

    def format(self, name: Any, schema: Any) -> Errors:
        if name not in ASSERTED_FORMATS:
            return _no_errors
        fmt = FORMAT_CHECKER.checkers[name][0]
        return lambda x: (
            [_error(f"{x!r} is not a {name!r}")] if type(x) is str and not fmt(x) else []
        )

    def multipleOf(self, d: Any, schema: Any) -> Errors:
        return lambda x: (
            [_error(f"{x!r} is not a multiple of {d}")]
            if _is_number(x) and not is_multiple_of(x, d)
            else []
        )

    def required(self, names: Any, schema: Any) -> Errors:
        return lambda x: (
            [_error(f"{r!r} is a required property") for r in names if r not in x]
            if type(x) is dict
            else []
        )

    def properties(self, props: Any, schema: Any) -> Errors:
        subs = [(k, self.compile(v)) for k, v in props.items()]

        def check(x: Any) -> list[ValidationError]:
            if type(x) is not dict:
                return []
            out: list[ValidationError] = []
            for k, sub in subs:
                if k in x:
                    out += _descend(sub, x[k], path=k, schema_path=k)
            return out

        return check

    def additionalProperties(self, extra: Any, schema: Any) -> Errors:
        known = schema.get("properties", {})
        sub = self.compile(extra) if isinstance(extra, dict) else None

        def check(x: Any) -> list[ValidationError]:
            if type(x) is not dict:
                return []
            # Built as python-jsonschema builds it, so the set iterates in the same order.
            extras = set(k for k in x if k not in known)
            if sub is not None:
                out: list[ValidationError] = []
                for k in extras:
                    out += _descend(sub, x[k], path=k)
                return out
            if extra or not extras:
                return []
            names = sorted(extras, key=str)
            verb = "was" if len(names) == 1 else "were"
            listed = ", ".join(repr(k) for k in names)
            return [_error(f"Additional properties are not allowed ({listed} {verb} unexpected)")]

        return check

    def propertyNames(self, names: Any, schema: Any) -> Errors:
        sub = self.compile(names)

        def check(x: Any) -> list[ValidationError]:
            if type(x) is not dict:
                return []
            out: list[ValidationError] = []
            for k in x:
                out += sub(k)
            return out

        return check

    def items(self, items: Any, schema: Any) -> Errors:
        sub = self.compile(items)

        def check(x: Any) -> list[ValidationError]:
            if type(x) is not list or not x:
                return []
            if items is False:
                rest = x if len(x) != 1 else x[0]
                return [_error(f"Expected at most 0 items but found {len(x)} extra: {rest!r}")]
            out: list[ValidationError] = []
            for i, item in enumerate(x):
                out += _descend(sub, item, path=i)
            return out

        return check

    def uniqueItems(self, unique: Any, schema: Any) -> Errors:
        if not unique:
            return _no_errors
        return lambda x: (
            [_error(f"{x!r} has non-unique elements")]
            if type(x) is list and not all_unique(x)
            else []
        )

    def allOf(self, subschemas: Any, schema: Any) -> Errors:
        subs = [self.compile(s) for s in subschemas]

        def check(x: Any) -> list[ValidationError]:
            out: list[ValidationError] = []
            for i, sub in enumerate(subs):
                out += _descend(sub, x, schema_path=i)
            return out

        return check

    def anyOf(self, subschemas: Any, schema: Any) -> Errors:
        subs = [self.compile(s) for s in subschemas]

        def check(x: Any) -> list[ValidationError]:
            context: list[ValidationError] = []
            for i, sub in enumerate(subs):
                found = _descend(sub, x, schema_path=i)
                if not found:
                    return []
                context += found
            message = f"{x!r} is not valid under any of the given schemas"
            return [_error(message, context=context)]

        return check

    def oneOf(self, subschemas: Any, schema: Any) -> Errors:
        subs = [(self.compile(s), self.valid.compile(s), s) for s in subschemas]

        def check(x: Any) -> list[ValidationError]:
            context: list[ValidationError] = []
            for i, (sub, _, s) in enumerate(subs):
                found = _descend(sub, x, schema_path=i)
                if not found:
                    first = s
                    break
                context += found
            else:
                message = f"{x!r} is not valid under any of the given schemas"
                return [_error(message, context=context)]
            more = [each for _, ok, each in subs[i + 1 :] if ok(x)]
            if not more:
                return []
            reprs = ", ".join(repr(each) for each in [*more, first])
            return [_error(f"{x!r} is valid under each of {reprs}")]

        return check

    def not_(self, negated: Any, schema: Any) -> Errors:
        valid = self.valid.compile(negated)
        return lambda x: (
            [_error(f"{x!r} should not be valid under {negated!r}")] if valid(x) else []
        )


Make = Callable[[_ErrorCompiler, Any, Any], Errors]


def _bound(violated: Callable[[Any, Any], bool], words: str) -> Make:
    """minimum, maximum and their exclusive forms, worded as the reference words them."""

    def make(compiler: _ErrorCompiler, limit: Any, schema: Any) -> Errors:
        return lambda x: (
            [_error(f"{x!r} {words} {limit!r}")] if _is_number(x) and violated(x, limit) else []
        )

    return make


def _size(of: type[Sized], at_least: bool, edge: str, words: str) -> Make:
    """The length and count bounds of strings, arrays and objects; ``edge`` is the
    reference's wording at a bound of 1 (``min*``) or 0 (``max*``)."""

    def make(compiler: _ErrorCompiler, n: int, schema: Any) -> Errors:
        word = edge if n == (1 if at_least else 0) else words
        if at_least:
            return lambda x: [_error(f"{x!r} {word}")] if isinstance(x, of) and len(x) < n else []
        return lambda x: [_error(f"{x!r} {word}")] if isinstance(x, of) and len(x) > n else []

    return make


_ERROR_KEYWORDS: dict[str, Make] = {
    **{
        k: getattr(_ErrorCompiler, k)
        for k in ("type", "enum", "const", "pattern", "format", "multipleOf", "required",
                  "properties", "additionalProperties", "propertyNames", "items",
                  "uniqueItems", "allOf", "anyOf", "oneOf")
    },
    "not": _ErrorCompiler.not_,
    "$ref": _ErrorCompiler.ref,
    "minimum": _bound(operator.lt, "is less than the minimum of"),
    "maximum": _bound(operator.gt, "is greater than the maximum of"),
    "exclusiveMinimum": _bound(operator.le, "is less than or equal to the minimum of"),
    "exclusiveMaximum": _bound(operator.ge, "is greater than or equal to the maximum of"),
    "minLength": _size(str, True, "should be non-empty", "is too short"),
    "maxLength": _size(str, False, "is expected to be empty", "is too long"),
    "minItems": _size(list, True, "should be non-empty", "is too short"),
    "maxItems": _size(list, False, "is expected to be empty", "is too long"),
    "minProperties": _size(dict, True, "should be non-empty", "does not have enough properties"),
    "maxProperties": _size(dict, False, "is expected to be empty", "has too many properties"),
}  # fmt: skip
assert _ERROR_KEYWORDS.keys() == _FAST_KEYWORDS - {"$defs"}


class ArgumentValidator:
    """A contract's compiled input schema: fast validity plus full error reporting.

    The error walk is compiled on first use: most contracts of a large registry never
    see invalid arguments, and compiling every one at load would double the load time."""

    __slots__ = ("_explain", "fast", "reference", "schema")

    def __init__(self, schema: Mapping[str, Any]) -> None:
        self.schema = schema
        self.reference = reference_validator(schema)
        try:
            self.fast: Check | None = compile_fast(schema)
        except NotCompilable:
            self.fast = None
        self._explain: Errors | Literal[False] | None = None  # None: not yet; False: cannot be

    @property
    def explain(self) -> Errors | None:
        """The compiled error walk, or None where the schema is outside the fast subset."""
        if self._explain is None:
            try:
                self._explain = compile_errors(self.schema) if self.fast is not None else False
            except NotCompilable:
                self._explain = False
        return self._explain if self._explain is not False else None

    def is_valid(self, instance: Any) -> bool:
        try:
            if self.fast is not None:
                return self.fast(instance)
            return bool(self.reference.is_valid(instance))
        except BaseException as exc:
            _reraise(exc)

    def reference_is_valid(self, instance: Any) -> bool:
        """The reference validator's verdict alone (contract examples are checked by it)."""
        try:
            return bool(self.reference.is_valid(instance))
        except BaseException as exc:
            _reraise(exc)

    def errors(self, instance: Any) -> list[ValidationError]:
        try:
            explain = self.explain
            if explain is not None:
                return explain(instance)
            return list(self.reference.iter_errors(instance))
        except BaseException as exc:
            _reraise(exc)


class SchemaRecursion(ValueError):
    """Validating against the schema recursed without end (a loop of references that
    never descends into the value): the call is answered as an internal error, and a
    contract found to do it when loaded is refused."""


def _reraise(exc: BaseException) -> NoReturn:
    """Raise ``exc`` again, as SchemaRecursion where it is the interpreter's recursion
    limit. Hit inside a Rust extension (rpds, which jsonschema's referencing uses), that
    limit surfaces as pyo3's PanicException, a BaseException that would pass every
    ``except Exception`` and stop the process, and the record would come back after the
    restart."""
    if isinstance(exc, RecursionError) or type(exc).__name__ == "PanicException":
        raise SchemaRecursion(f"the schema recursed without end: {exc!r}"[:300]) from exc
    raise exc
