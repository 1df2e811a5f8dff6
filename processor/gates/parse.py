"""Gate 1, parse: bytes to a typed proposal, or a typed refusal.

Three outcomes:

* a ``Proposal`` whose envelope and arguments parsed;
* a ``Proposal`` plus a ``SYNTACTIC_PARSE_FAIL`` rejection, when the record
  can be tied to a run (it names a ``run_id``) but the envelope or the
  arguments are broken: truncated model JSON, NaN, duplicate keys, wrong
  envelope types, too deep, too large;
* a ``DeadLetter`` when the record cannot be tied to a run at all.

JSON is strict: RFC 8259 only, UTF-8 only, no NaN/Infinity, no duplicate
keys anywhere (two ``tenant_id`` keys are an ambiguity attack: parsers that
keep the first and parsers that keep the last would disagree).
"""

from __future__ import annotations

import hashlib
import heapq
import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeGuard

import orjson

from processor.gates.policy_scan import quotable
from processor.model import FieldError, Gate, Proposal, Rejection, SourceRecord, TaxonomyClass

_TRACEPARENT = re.compile(r"^00-([0-9a-f]{32})-([0-9a-f]{16})-[0-9a-f]{2}$")
_ID_MAX = 256
COMPENSATION_PREFIX = "compensate:"
"""Idempotency keys of the compensating calls the processor proposes (see results.py):
the prefix on the key of the call they undo."""
_KEY_MAX = _ID_MAX + len(COMPENSATION_PREFIX)
"""A compensation's key (and logical operation) at most: the prefix on an agent's key of
the longest length taken."""
MAX_APPROVALS = 8
"""Approvals one proposal may carry: a critical call needs two distinct approvers."""


@dataclass(frozen=True, slots=True)
class Limits:
    max_record_bytes: int = 1_048_576
    max_arguments_bytes: int = 65_536
    max_depth: int = 32


@dataclass(frozen=True, slots=True)
class DeadLetter:
    """A record that cannot be answered on ``tool.observations``."""

    reason: str
    detail: str


class _Duplicate(ValueError):
    pass


class _TooDeep(ValueError):
    pass


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    d = dict(pairs)
    if len(d) != len(pairs):
        seen: set[str] = set()
        dup = next(k for k, _ in pairs if k in seen or seen.add(k))  # type: ignore[func-returns-value]
        raise _Duplicate(f"duplicate key {_quoted(dup)!r}")
    return d


_NAME_SHOWN = 64
"""The most of a name (a key, a field) a refusal or a warning quotes back: a record near
the size limit with one huge name must not make an observation too large to produce (the
batch would retry for ever)."""


def _quoted(name: str) -> str:
    """``name`` as an answer may quote it: cut at ``_NAME_SHOWN`` characters, and redacted
    when what is shown looks like a credential (parse answers before the credential scan).
    Only what is shown is scanned: a megabyte-long name costs no more than a short one."""
    if len(name) <= _NAME_SHOWN:
        return quotable(name)
    return quotable(name[: _NAME_SHOWN - 3]) + "..."


def _first_names(names: set[str], count: int = 10) -> list[str]:
    """The first ``count`` of ``names`` in order, quoted (a record may carry thousands)."""
    return [_quoted(n) for n in heapq.nsmallest(count, names)]


def _depth(node: Any) -> int:
    """How many objects and arrays a parsed value nests, one inside another (``[[1]]``:
    2; a scalar: 0), level by level, without recursion (the input may be hostile): a
    megabyte of ``[],`` is a third of a million values, each touched once. Each level
    takes a bracket, so a text of at most n brackets nests at most n: the callers count
    brackets first and walk only past that."""
    depth = 0
    level = [node] if type(node) is dict or type(node) is list else []
    while level:
        depth += 1
        below: list[Any] = []
        for item in level:
            below.extend(
                v
                for v in (item.values() if type(item) is dict else item)
                if type(v) is dict or type(v) is list
            )
        level = below
    return depth


def nests_deeper(value: Any, limit: int, brackets: int) -> bool:
    """Whether ``value`` nests more than ``limit`` levels (see ``_depth``); ``brackets``,
    how many its text holds, bounds the depth, so the walk runs only past the limit."""
    return brackets > limit and _depth(value) > limit


def _json_size(value: Any) -> int:
    """Bytes of ``value`` as compact JSON. orjson writes no integer beyond 64 bits, which
    the exact parser keeps whole: a value holding one is measured by the standard library."""
    try:
        return len(orjson.dumps(value))
    except orjson.JSONEncodeError:
        return len(json.dumps(value, separators=(",", ":"), ensure_ascii=False).encode())


def strict_loads(text: bytes | str, max_depth: int, brackets: int | None = None) -> Any:
    """Parse strict JSON; raise ``ValueError`` with a reason a model can act on.

    orjson does the parse (it refuses NaN, invalid UTF-8 and lone surrogates)
    but keeps the last of duplicate keys. When re-serialising the value gives
    back the input byte for byte, the input cannot have held a duplicate; any
    other input (whitespace, escapes, reformatted numbers) is parsed again by
    the exact, slower parser that refuses duplicates. Compact JSON, which
    agent runtimes produce, takes the fast path.
    """
    try:
        value = orjson.loads(text)
    except orjson.JSONDecodeError as exc:
        # orjson stops at its own recursion limit (1024); that is nesting, not bad syntax.
        if "depth limit" in exc.msg or "recursion limit" in exc.msg:
            raise _TooDeep(f"nested more than {max_depth} levels deep") from exc
        raise
    raw = text if isinstance(text, bytes) else text.encode("utf-8", "surrogatepass")
    # Each level of nesting needs a bracket, so few brackets bound the depth cheaply.
    if brackets is None:
        brackets = raw.count(b"{") + raw.count(b"[")
    if brackets > max_depth:
        depth = _depth(value)
        if depth > max_depth:
            raise _TooDeep(f"nested {depth} levels deep; at most {max_depth} are accepted")
    if not _writes_back(value, raw):
        # The exact parser's value is kept: orjson reads integers beyond 64 bits as
        # floats, and such a float never re-serialises to the digits the text had,
        # so a big integer always lands here and reaches the executor unchanged.
        value = json.loads(raw, object_pairs_hook=_no_duplicates)
    return value


def _writes_back(value: Any, raw: bytes) -> bool:
    """Whether orjson writes ``value`` back as ``raw``, byte for byte. orjson writes at most
    254 levels of nesting (it reads 1024): a deeper value within a caller's ``max_depth``
    (a result's data may nest 256) is not written back, and is read again exactly."""
    try:
        return orjson.dumps(value) == raw
    except orjson.JSONEncodeError:
        return False


_RECOVERY_MAX_BRACKETS = 256


def lenient_loads(
    raw: bytes, object_pairs_hook: Callable[[list[tuple[str, Any]]], Any] | None = None
) -> Any:
    """What Python's parser reads of a text the strict parser refused (NaN, duplicate
    keys, nesting): ValueError when it cannot be read. Never one with more than
    ``_RECOVERY_MAX_BRACKETS`` brackets: the parser recurses, how deep it gets depends on
    the caller's stack, and replay must read the same way everywhere."""
    if raw.count(b"{") + raw.count(b"[") > _RECOVERY_MAX_BRACKETS:
        raise ValueError("nested too deeply to be read leniently")
    try:
        # Decoded here, not by json.loads: given bytes it would also accept UTF-16/32.
        return json.loads(raw.decode("utf-8"), object_pairs_hook=object_pairs_hook)
    except RecursionError as exc:
        raise ValueError("nested too deeply to be read leniently") from exc


def _identity_only(raw: bytes) -> dict[str, Any] | None:
    """Who sent a record the strict parser refused, or None if even that is unclear.

    Python's parser accepts NaN, deep nesting (to its recursion limit) and
    duplicate keys (the last wins): enough to learn which run and proposal to
    answer, never enough to decide on. A duplicate among the envelope's own
    keys makes the identity itself ambiguous, so that record stays unanswered.
    """
    top: list[list[tuple[str, Any]]] = [[]]

    def keep_last(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        top[0] = pairs  # the outermost object is the last one completed
        return dict(pairs)

    try:
        value = lenient_loads(raw, keep_last)
    except ValueError:
        return None
    keys = [k for k, _ in top[0]]
    if type(value) is not dict or len(set(keys)) != len(keys):
        return None
    return {k: value[k] for k in _IDENTITY_FIELDS if k in value}


def _json_error(exc: Exception, text: bytes | str) -> tuple[str, str]:
    """(code, message) for a parse failure; truncation is called out by name."""
    if isinstance(exc, _Duplicate):
        return "duplicate_key", str(exc)
    if isinstance(exc, _TooDeep):
        return "too_deep", str(exc)
    if isinstance(exc, json.JSONDecodeError):
        pos = exc.pos  # in characters, bytes or text alike
        chars = text.decode("utf-8", "replace") if isinstance(text, bytes) else text
        # JSON's own whitespace only: a complete value followed by a no-break space (which
        # str.rstrip would take away) is not cut off, and the model must be told so.
        if pos >= len(chars.rstrip(" \t\n\r")):
            return "truncated", f"the JSON ends before it is complete (at character {pos})"
        return "invalid_json", f"{exc.msg} at character {pos}"
    if isinstance(exc, RecursionError):
        return "too_deep", "nested too deeply"
    return "invalid_json", str(exc)


def _proposal_id(src: SourceRecord) -> str:
    return unidentified_id(src.topic, src.partition, src.offset)


def unidentified_id(topic: str, partition: int, offset: int) -> str:
    """Stable id for a proposal that did not carry a usable one: its record's position."""
    return f"unidentified:{topic}:{partition}:{offset}"


def trace_id_for(proposal_id: str, traceparent: str | None) -> str:
    if traceparent is not None:
        m = _TRACEPARENT.match(traceparent)
        if m:
            return m.group(1)
    return hashlib.sha256(proposal_id.encode()).hexdigest()[:32]


def _claimed_id(env: dict[str, Any], key: str, errors: list[FieldError]) -> str | None:
    """The envelope's id under ``key``, or None with the reason added to ``errors``."""
    value = env.get(key)
    if is_id(value):
        return value
    errors.append(
        _err(
            key,
            "missing_field" if value is None else "invalid_value",
            f"{key} must be a string of 1-256 printable characters",
            "string",
            value,
        )
    )
    return None


def _utf8(text: str) -> bool:
    """False for a string holding lone surrogates (only a lenient parse lets them in)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _key_limit(v: Any) -> int:
    """The longest key (or logical operation) taken: a compensation's is its call's with a
    prefix, so a call's key of the longest length still makes a compensation's."""
    return _KEY_MAX if type(v) is str and v.startswith(COMPENSATION_PREFIX) else _ID_MAX


def is_id(v: Any) -> TypeGuard[str]:
    """An id the processor uses as it is: 1-256 printable characters (no lone surrogates)."""
    return type(v) is str and 0 < len(v) <= _ID_MAX and v.isprintable()


def _err(
    field: str, code: str, message: str, expected: str | None = None, actual: Any = None
) -> FieldError:
    act = (
        None
        if actual is None
        else type(actual).__name__
        if not isinstance(actual, str)
        else "string"
    )
    return FieldError(field, message, code, expected, act)


_TOOL_FIELDS = frozenset({"name", "version"})
_IDENTITY_FIELDS = ("proposal_id", "run_id", "tenant_id", "tool", "created_at", "traceparent")
_ENVELOPE_FIELDS = frozenset(
    {
        "proposal_id", "created_at", "tenant_id", "run_id", "workflow_id", "step",
        "principal_token", "tool", "arguments", "arguments_raw", "idempotency_key",
        "logical_operation_id", "approvals", "active_tools", "traceparent",
    }
)  # fmt: skip


def parse_proposal(
    src: SourceRecord, limits: Limits
) -> tuple[Proposal, Rejection | None, tuple[str, ...]] | DeadLetter:
    """Parse one input record. Returns (proposal, rejection or None, warnings) or a DeadLetter."""
    value = src.value
    if value is None:
        return DeadLetter("empty", "the record has no value (a tombstone?)")
    if len(value) > limits.max_record_bytes:
        return DeadLetter("too_large", f"{len(value)} bytes; at most {limits.max_record_bytes}")
    strict_error: FieldError | None = None
    brackets = value.count(b"{") + value.count(b"[")
    try:
        env = strict_loads(value, limits.max_depth + 4, brackets)
    except Exception as exc:
        code, message = _json_error(exc, value)
        recovered = _identity_only(value)
        strict_detail = f"envelope is not strict JSON: {message}"
        if recovered is None:
            return DeadLetter(code, strict_detail)
        env = recovered
        strict_error = FieldError(None, f"the proposal is not strict JSON: {message}", code)
    if type(env) is not dict:
        return DeadLetter("not_object", "the envelope is not a JSON object")
    claimed_run = env.get("run_id")
    if not is_id(claimed_run):
        if strict_error is not None:
            return DeadLetter(strict_error.code, strict_detail)
        return DeadLetter("no_run_id", "the envelope has no usable run_id (1-256 printable chars)")
    run_id: str = claimed_run

    errors: list[FieldError] = [strict_error] if strict_error else []
    warnings: list[str] = []
    claimed_pid = _claimed_id(env, "proposal_id", errors)
    pid = claimed_pid if claimed_pid is not None else _proposal_id(src)
    tenant = _claimed_id(env, "tenant_id", errors)

    tool = env.get("tool")
    tool_name: str | None = None
    tool_version: str | None = None
    if type(tool) is dict:
        name, version = tool.get("name"), tool.get("version")
        if type(name) is str and 0 < len(name) <= 128 and _utf8(name):
            tool_name = name
        else:
            errors.append(
                _err(
                    "tool/name",
                    "missing_field" if name is None else "invalid_value",
                    "tool.name must be the name of a tool (a string)",
                    "string",
                    name,
                )
            )
        if version is not None:
            if type(version) is str and 0 < len(version) <= 64:
                tool_version = version
            else:
                errors.append(
                    _err(
                        "tool/version",
                        "invalid_value",
                        "tool.version must be a version string such as 1.0.0",
                        "string",
                        version,
                    )
                )
        if not tool.keys() <= _TOOL_FIELDS:
            extra = _first_names(tool.keys() - _TOOL_FIELDS)
            errors.append(
                _err(
                    "tool",
                    "unknown_field",
                    f"tool has unknown fields {extra}; only name and version",
                )
            )
    else:
        errors.append(
            _err(
                "tool",
                "missing_field" if tool is None else "invalid_value",
                'tool must be an object such as {"name": "lookup_order"}',
                "object",
                tool,
            )
        )

    arguments: Any = None
    raw_text: str | None = None
    has_args, has_raw = "arguments" in env, "arguments_raw" in env
    if strict_error is not None:
        pass  # the arguments were not read strictly; nothing of them is used
    elif has_args == has_raw:
        errors.append(
            _err(
                "arguments",
                "missing_field" if not has_args else "ambiguous",
                "give exactly one of arguments (an object) or arguments_raw (the model's text)",
            )
        )
    elif has_args:
        arguments = env["arguments"]
        if type(arguments) is not dict:
            errors.append(
                _err(
                    "arguments",
                    "invalid_value",
                    "arguments must be a JSON object",
                    "object",
                    arguments,
                )
            )
            arguments = None
        elif len(value) > limits.max_arguments_bytes and (
            _json_size(arguments) > limits.max_arguments_bytes
        ):
            errors.append(
                _err(
                    "arguments", "too_large", f"arguments exceed {limits.max_arguments_bytes} bytes"
                )
            )
            arguments = None
        elif nests_deeper(arguments, limits.max_depth, brackets):
            errors.append(
                _err(
                    "arguments",
                    "too_deep",
                    f"arguments nest deeper than {limits.max_depth} levels",
                )
            )
            arguments = None
    else:
        raw = env["arguments_raw"]
        raw_text = raw[: limits.max_arguments_bytes] if type(raw) is str else None
        if type(raw) is not str:
            errors.append(
                _err(
                    "arguments_raw",
                    "invalid_value",
                    "arguments_raw must be the model's text as a JSON string",
                    "string",
                    raw,
                )
            )
        elif len(raw) > limits.max_arguments_bytes:
            errors.append(
                _err(
                    "arguments_raw",
                    "too_large",
                    f"arguments_raw exceeds {limits.max_arguments_bytes} characters",
                )
            )
        else:
            try:
                arguments = strict_loads(raw.encode("utf-8"), limits.max_depth)
            except Exception as exc:
                code, message = _json_error(exc, raw)
                errors.append(FieldError("arguments_raw", message, code))
            else:
                if type(arguments) is not dict:
                    errors.append(
                        _err(
                            "arguments_raw",
                            "invalid_value",
                            "the arguments must be one JSON object",
                            "object",
                            arguments,
                        )
                    )
                    arguments = None

    def opt_str(key: str, limit: int = _ID_MAX) -> str | None:
        v = env.get(key)
        if v is None:
            return None
        if type(v) is str and 0 < len(v) <= limit and v.isprintable():
            return v
        errors.append(
            _err(
                key,
                "invalid_value",
                f"{key} must be a string of 1-{limit} printable characters",
                "string",
                v,
            )
        )
        return None

    workflow_id = opt_str("workflow_id")
    created_at = opt_str("created_at", 64)
    principal_token = opt_str("principal_token", 16_384)
    idempotency_key = opt_str("idempotency_key", _key_limit(env.get("idempotency_key")))
    logical_operation_id = opt_str(
        "logical_operation_id", _key_limit(env.get("logical_operation_id"))
    )
    traceparent = opt_str("traceparent", 128)
    trace = _TRACEPARENT.match(traceparent) if traceparent is not None else None
    if traceparent is not None and trace is None:
        warnings.append("traceparent is not W3C trace context; a trace id was derived instead")

    step = env.get("step")
    if step is not None and not (type(step) is int and 0 <= step <= 1_000_000):
        errors.append(
            _err("step", "invalid_value", "step must be a non-negative integer", "integer", step)
        )
        step = None

    active: tuple[str, ...] | None = None
    raw_active = env.get("active_tools")
    if raw_active is not None:
        if type(raw_active) is list and all(type(t) is str for t in raw_active):
            active = tuple(raw_active)
        else:
            errors.append(
                _err(
                    "active_tools",
                    "invalid_value",
                    "active_tools must be a list of tool names",
                    "array of strings",
                )
            )
    approvals = env.get("approvals")
    if approvals is not None and type(approvals) is not list:
        errors.append(
            _err("approvals", "invalid_value", "approvals must be a list", "array", approvals)
        )
        approvals = None
    elif approvals is not None and len(approvals) > MAX_APPROVALS:
        # Each one costs a signature verification: a proposal full of them is refused
        # before any is checked.
        errors.append(
            _err(
                "approvals",
                "invalid_value",
                f"at most {MAX_APPROVALS} approvals may be attached ({len(approvals)} were)",
                f"array of at most {MAX_APPROVALS}",
                approvals,
            )
        )
        approvals = None

    if not env.keys() <= _ENVELOPE_FIELDS:
        names = _first_names(env.keys() - _ENVELOPE_FIELDS)
        warnings.append(f"ignored unknown envelope fields: {', '.join(names)}")

    proposal = Proposal(
        proposal_id=pid,
        run_id=run_id,
        tenant_id=tenant,
        created_at=created_at,
        tool_name=tool_name,
        tool_version=tool_version,
        arguments=arguments,
        workflow_id=workflow_id,
        step=step,
        principal_token=principal_token,
        idempotency_key=idempotency_key,
        logical_operation_id=logical_operation_id,
        approvals=tuple(approvals or ()),
        active_tools=active,
        traceparent=traceparent,
        trace_id=trace.group(1) if trace is not None else trace_id_for(pid, None),
        arguments_text=raw_text if arguments is None else None,
    )
    if not errors:
        return proposal, None, tuple(warnings)
    return (
        proposal,
        Rejection(
            TaxonomyClass.SYNTACTIC_PARSE_FAIL,
            Gate.PARSE,
            tuple(errors),
            _parse_next_action(errors),
        ),
        tuple(warnings),
    )


def _parse_next_action(errors: list[FieldError]) -> str:
    first = errors[0]
    if first.field == "arguments_raw":
        if first.code == "truncated":
            return (
                "Your tool arguments were cut off before the JSON object closed; emit the "
                "complete arguments as one JSON object and propose the call again."
            )
        if first.code == "duplicate_key":
            return f"Emit each argument once ({first.message}) and propose the call again."
        return (
            "Emit the tool arguments as one valid JSON object (double-quoted keys, no "
            "trailing commas, no NaN) and propose the call again."
        )
    if first.field is None:
        return (
            f"The proposal is not strict JSON ({first.message}); send it again with every key "
            "once, no NaN or Infinity, and shallow nesting."
        )
    fields = ", ".join(sorted({e.field or "envelope" for e in errors}))
    return (
        f"The proposal envelope is malformed ({fields}); the agent runtime must fix the "
        "envelope before proposing again."
    )
