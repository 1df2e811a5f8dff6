"""Hostile proposal records for the fuzz tests: one set of builders, two drivers.

Every builder takes a ``random.Random`` and returns a ``Case``: the record's bytes
(or ``None``, a tombstone), its Kafka key, the mutation's name and what the
processor must decide for it. The unit tests drive the builders with
hypothesis's ``st.randoms()`` (so a failure shrinks); the integration test drives
them with a seeded ``random.Random`` (so its corpus is reproducible).

Where a record still carries a parseable ``proposal_id`` it is ``fz-<marker>``
(``ok-<marker>`` for the valid proposals mixed in), so it can be traced.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import orjson
from hypothesis import strategies as st

from processor.gates.parse import Limits
from processor.model import Decision, Outcome

TOOLS = ("lookup_order", "search_kb", "cancel_order", "create_ticket", "refund_order")
TENANTS = ("t-acme", "t-globex", "t-initech")
STRING_FIELDS = {  # envelope field -> its length limit
    "proposal_id": 256, "tenant_id": 256, "run_id": 256, "workflow_id": 256,
    "idempotency_key": 256, "logical_operation_id": 256, "created_at": 64,
    "principal_token": 16_384, "traceparent": 128,
}  # fmt: skip
REQUIRED = ("proposal_id", "tenant_id", "tool")
BAD_UTF8 = (
    b"\xff\xfe", b"\xed\xa0\x80", b"\xed\xbf\xbf", b"\xc0\xaf", b"\xc1\xbf", b"\x80",
    b"\xbf\x80", b"\xe2\x82", b"\xf0\x9f\x98", b"\xf4\x90\x80\x80", b"\xf8\x88\x80\x80\x80",
    b"\xfe", b"\xe0\x80\xaf",
)  # fmt: skip
LONE_SURROGATES = (
    "\\ud800", "\\udc00", "\\udbff", "\\udfff", "\\ud800\\u0041", "\\ud800\\ud800",
    "x\\ud83d", "\\ude00x",
)  # fmt: skip
NAN_LITERALS = ("NaN", "Infinity", "-Infinity", "-NaN", "+Infinity", "nan", "inf")
LOOKALIKES = (
    "c\u0430ncel_order", "lookup_ord\u0435r", "\u0455earch_kb", "refund_\u043erder",
    "\uff4c\uff4f\uff4f\uff4b\uff55\uff50_order", "lookup_order\u200b", "\u200blookup_order",
    "lookup_order ", " lookup_order", "Lookup_Order", "LOOKUP_ORDER", "lookup-order",
    "lookup_orders", "lookup_order\x00", "search_kb\u0301", "refund_order\ufeff",
    "cancel\u2010order", "create_tick\u0435t", "cre\u0430te_ticket", "lookup_order\n",
    "lookup_order@1.0.0", "__proto__", "constructor", "../../etc/passwd",
    "lookup_order; DROP TABLE tools", "\U0001f600", "\u202elookup_order", "search_kb\t",
)  # fmt: skip
WORDS = (
    "return", "damaged", "item", "policy", "refund", "delivery", "late", "how", "do", "I",
    "Rückgabe", "café", "ordre", "配送", "返品", "\U0001f4e6", "שלום", "naïve", "x" * 30,
)  # fmt: skip
ALPHABET = "abcXYZ019 _-.:/\\\"'{}[],\t\n\x00\x01\x7f\u00e9\u200b\u2028\u4e2d\U0001f600"


# -- expectations ----------------------------------------------------------------------------


@dataclass(frozen=True)
class Verdict:
    """What the processor decided for one record, from a ``Decision`` or from its output."""

    outcome: str
    gate: str | None = None
    taxonomy: str | None = None
    dlq_reason: str | None = None
    errors: tuple[tuple[str | None, str], ...] = ()

    @classmethod
    def of(cls, d: Decision) -> Verdict:
        if d.outcome is Outcome.DEAD_LETTER:
            return cls(d.outcome.value, d.gate.value, None, d.dlq_reason)
        errs = tuple((e.field, e.code) for e in d.rejection.errors) if d.rejection else ()
        return cls(d.outcome.value, d.gate.value, d.taxonomy.value, None, errs)

    @classmethod
    def of_observation(cls, obs: dict[str, Any]) -> Verdict:
        errs = tuple((e["field"], e["code"]) for e in obs["result_payload"]["errors"])
        outcome = {"PENDING_APPROVAL": Outcome.PARKED.value}.get(obs["decision"], obs["decision"])
        return cls(outcome, obs["gate"], obs["status"]["taxonomy_class"], None, errs)

    def key(self) -> tuple[Any, ...]:
        """What two deciders must agree on (the gate of a dead letter is internal detail)."""
        return (self.outcome, self.taxonomy, self.dlq_reason, self.errors)


ANY = frozenset(o.value for o in Outcome)
SCHEMA_CLASSES = frozenset({"STRUCTURAL_VIOLATION", "TYPE_MISMATCH", "OUT_OF_BOUNDS"})


@dataclass(frozen=True)
class Expect:
    """The decision a case must get (checked after the tombstone and size rules)."""

    outcomes: frozenset[str] = ANY
    dlq_reasons: frozenset[str] | None = None
    gate: str | None = None
    taxonomies: frozenset[str] | None = None
    error_fields: frozenset[str] = frozenset()  # every one must carry an error
    error_codes: frozenset[str] | None = None  # some error must carry one of these

    def problems(self, v: Verdict) -> list[str]:
        out = []
        if v.outcome not in self.outcomes:
            out.append(f"outcome {v.outcome}, expected one of {sorted(self.outcomes)}")
        elif v.outcome == "DEAD_LETTER":
            if self.dlq_reasons is not None and v.dlq_reason not in self.dlq_reasons:
                out.append(f"dlq reason {v.dlq_reason}, expected {sorted(self.dlq_reasons)}")
        elif v.outcome == "REJECTED":
            if self.gate is not None and v.gate != self.gate:
                out.append(f"gate {v.gate}, expected {self.gate}")
            if self.taxonomies is not None and v.taxonomy not in self.taxonomies:
                out.append(f"taxonomy {v.taxonomy}, expected {sorted(self.taxonomies)}")
            fields = {f for f, _ in v.errors}
            if not self.error_fields <= fields:
                out.append(
                    f"errors on {sorted(map(str, fields))}, expected {sorted(self.error_fields)}"
                )
            if self.error_codes is not None and not {c for _, c in v.errors} & self.error_codes:
                out.append(
                    f"error codes {[c for _, c in v.errors]}, expected {sorted(self.error_codes)}"
                )
        return out


def dlq(*reasons: str) -> Expect:
    return Expect(frozenset({"DEAD_LETTER"}), frozenset(reasons) if reasons else None)


def parse_fail(*fields: str, codes: Iterable[str] | None = None) -> Expect:
    return Expect(frozenset({"REJECTED"}), None, "parse", frozenset({"SYNTACTIC_PARSE_FAIL"}),
                  frozenset(fields), frozenset(codes) if codes is not None else None)  # fmt: skip


def strict_fail(*codes: str) -> Expect:
    """Refused by the strict parser: answered with SYNTACTIC_PARSE_FAIL when the run
    and proposal can still be told apart, else dead-lettered, for one of ``codes``."""
    return Expect(frozenset({"REJECTED", "DEAD_LETTER"}), frozenset(codes), "parse",
                  frozenset({"SYNTACTIC_PARSE_FAIL"}), frozenset(), frozenset(codes))  # fmt: skip


ROUTED = Expect(frozenset({"ROUTED", "PARKED"}))
"""Through every gate: routed, or parked at the confirmation gate when the tool needs an
approval (the ids it names exist in the reference data the tests provide)."""
NOT_ROUTED = Expect(frozenset({"REJECTED", "DEAD_LETTER"}))
UNKNOWN_TOOL = Expect(frozenset({"REJECTED"}), None, "resolve",
                      frozenset({"STRUCTURAL_VIOLATION"}), frozenset({"tool/name"}),
                      frozenset({"unknown_tool"}))  # fmt: skip


def schema_fail(taxonomy: str) -> Expect:
    return Expect(frozenset({"REJECTED"}), None, "schema", frozenset({taxonomy}))


@dataclass(frozen=True)
class Case:
    kind: str
    value: bytes | None
    key: bytes | None
    expect: Expect
    marker: int = 0
    valid: bool = False  # a well-formed proposal: must be ROUTED
    note: str = field(default="", compare=False)

    def expected(self, limits: Limits) -> Expect:
        if self.value is None:
            return dlq("empty")
        if len(self.value) > limits.max_record_bytes:
            return dlq("too_large")
        return self.expect

    def problems(self, v: Verdict, limits: Limits) -> list[str]:
        return [f"{self.kind}: {p}" for p in self.expected(limits).problems(v)]

    def __repr__(self) -> str:
        """Short: hypothesis prints the case that fails, and a value may be megabytes."""
        value = "None" if self.value is None else f"<{len(self.value)} bytes> {self.value[:300]!r}"
        return (f"Case(kind={self.kind!r}, marker={self.marker}, note={self.note!r}, "
                f"key={self.key!r}, value={value})")  # fmt: skip


# -- valid material --------------------------------------------------------------------------


def _order_id(r: random.Random) -> str:
    return f"WO-{r.randrange(100_000):05d}-{r.choice('ABCDEFGHIJKLMNOPQRSTUVWXYZ')}"


def _customer_id(r: random.Random) -> str:
    return f"CUS-{r.randrange(1_000_000):06d}"


def _date(r: random.Random) -> str:
    return f"{r.randrange(2000, 2100)}-{r.randrange(1, 13):02d}-{r.randrange(1, 29):02d}"


def _sentence(r: random.Random, lo: int, hi: int) -> str:
    words: list[str] = []
    while len(" ".join(words)) < lo:
        words.append(r.choice(WORDS))
    return " ".join(words)[:hi]


def valid_arguments(r: random.Random, tool: str) -> dict[str, Any]:
    if tool == "lookup_order":
        shape = r.randrange(3)
        args: dict[str, Any] = (
            {"order_id": _order_id(r)} if shape == 0
            else {"customer_id": _customer_id(r)} if shape == 1
            else {"date_from": _date(r), "date_to": _date(r)}
        )  # fmt: skip
        if r.random() < 0.5:
            args["limit"] = r.randint(1, 50)
        return args
    if tool == "search_kb":
        args = {"query": _sentence(r, 3, 200)}
        if r.random() < 0.5:
            args["locale"] = r.choice(["en-GB", "en-US", "de-DE", "fr-FR", "es-ES"])
        if r.random() < 0.5:
            args["limit"] = r.randint(1, 100)
        return args
    if tool == "cancel_order":
        return {"order_id": _order_id(r), "confirm": True, "reason_code": r.choice(
            ["customer_request", "duplicate_order", "fraud_suspected", "out_of_stock",
             "address_invalid"])}  # fmt: skip
    if tool == "create_ticket":
        args = {"customer_id": _customer_id(r),
                "category": r.choice(["delivery", "billing", "product_defect", "account", "other"]),
                "priority": r.choice(["low", "normal", "high", "urgent"]),
                "summary": _sentence(r, 10, 240)}  # fmt: skip
        if r.random() < 0.5:
            args["order_id"] = _order_id(r)
        if r.random() < 0.5:
            args["tags"] = r.sample(
                ["vip", "damaged", "re-open", "eu", "x1", "urgent-call"], r.randint(0, 5)
            )
        return args
    assert tool == "refund_order"
    return {"order_id": _order_id(r), "amount": r.randint(1, 1_000_000) / 100,
            "currency": r.choice(["USD", "EUR", "GBP"]),
            "reason_code": r.choice(["damaged", "not_delivered", "late_delivery", "wrong_item",
                                     "goodwill_on_order"])}  # fmt: skip


def envelope(r: random.Random, marker: int, *, prefix: str = "fz", tool: str | None = None,
             raw: bool | None = None) -> dict[str, Any]:  # fmt: skip
    """A well-formed proposal envelope (the processor must route it)."""
    tool = tool or r.choice(TOOLS)
    args = valid_arguments(r, tool)
    env: dict[str, Any] = {
        "proposal_id": f"{prefix}-{marker}",
        "run_id": f"run-{marker % 113}",
        "tenant_id": r.choice(TENANTS),
        "tool": {"name": tool, "version": "1.0.0"} if r.random() < 0.3 else {"name": tool},
    }
    if raw if raw is not None else r.random() < 0.3:
        env["arguments_raw"] = json.dumps(args, ensure_ascii=r.random() < 0.5)
    else:
        env["arguments"] = args
    optional: dict[str, Callable[[], Any]] = {
        "created_at": lambda: f"{_date(r)}T10:00:00.000Z",
        "workflow_id": lambda: f"wf-{r.randrange(1000)}",
        "step": lambda: r.randint(0, 1_000_000),
        "traceparent": lambda: f"00-{r.getrandbits(128):032x}-{r.getrandbits(64):016x}-01",
        "active_tools": lambda: [tool, *r.sample(TOOLS, r.randint(0, 3))],
        "idempotency_key": lambda: f"ik-{marker}",
        "logical_operation_id": lambda: f"op-{r.randrange(100)}",
        "approvals": lambda: [],
        "principal_token": lambda: "tok." + "a" * r.randint(1, 64),
    }
    for name, make in optional.items():
        if r.random() < 0.25:
            env[name] = make()
    return env


def dumps(r: random.Random, value: Any) -> bytes:
    """JSON text as different producers write it (NaN floats become NaN literals)."""
    style = r.randrange(4)
    if style == 0:
        try:
            return orjson.dumps(value)
        except (TypeError, orjson.JSONEncodeError):
            pass
    if style == 2:
        return json.dumps(value, indent=r.choice([1, 2, 4]), ensure_ascii=False).encode()
    if style == 3:
        return json.dumps(value, separators=(",", ":"), sort_keys=True).encode()
    return json.dumps(value, ensure_ascii=r.random() < 0.5).encode()


def run_key(r: random.Random, env: Any) -> bytes | None:
    """Keys as producers send them: mostly the run id, some none, some junk."""
    x = r.random()
    if x < 0.1:
        return None
    if x < 0.2:
        return bytes(r.getrandbits(8) for _ in range(r.randint(0, 40)))
    run = env.get("run_id") if isinstance(env, dict) else None
    if isinstance(run, str) and len(run) <= 256:
        return run.encode("utf-8", "surrogatepass")
    return b"run-x"


# -- hostile material ------------------------------------------------------------------------


def huge_size(r: random.Random, max_bytes: int) -> int:
    """Mostly tens of kilobytes, rarely up to ``max_bytes``."""
    if r.random() < 0.1:
        return r.randint(max_bytes // 2, max_bytes)
    return r.randint(20_000, min(200_000, max_bytes))


def huge_string(r: random.Random, n: int) -> str:
    chunk = "".join(r.choice(ALPHABET) for _ in range(r.randint(1, 8)))
    return (chunk * (n // len(chunk) + 1))[:n]


def junk(r: random.Random, depth: int = 0) -> Any:
    """Any JSON value, biased to the awkward ones."""
    k = r.randrange(13 if depth < 3 else 9)
    if k == 0:
        return None
    if k == 1:
        return r.random() < 0.5
    if k == 2:
        return r.choice([0, -1, 1, 2**31, -(2**63), 2**64, 10**30, -(10**300)])
    if k == 3:
        return r.choice([0.5, -0.0, 1e308, 5e-324, 1.0, -1.5e-300, 123456789.123456789])
    if k == 4:
        return ""
    if k == 5:
        return "".join(r.choice(ALPHABET) for _ in range(r.randint(1, 20)))
    if k == 6:
        return huge_string(r, r.randint(257, 5_000))
    if k == 7:
        return r.choice(LOOKALIKES)
    if k == 8:
        return [[[[[]]]]] if r.random() < 0.5 else {"a": {"b": {"c": {}}}}
    if k in (9, 10):
        return [junk(r, depth + 1) for _ in range(r.randint(0, 4))]
    return {junk_key(r): junk(r, depth + 1) for _ in range(r.randint(0, 4))}


def junk_key(r: random.Random) -> str:
    return r.choice(["", "a", "run_id", "tool", "name", "\x00", "\u200b", "é", "__proto__",
                     "".join(r.choice(ALPHABET) for _ in range(r.randint(1, 10)))])  # fmt: skip


def bad_value_for(r: random.Random, name: str) -> Any:
    """A value that is never valid for envelope field ``name`` (never null for optionals)."""
    if name in STRING_FIELDS:
        limit = STRING_FIELDS[name]
        makers: list[Callable[[], Any]] = [
            lambda: r.choice([0, 1.5, True, False, [], ["x"], {}, {"id": "x"}, -1, 10**30]),
            lambda: "",
            lambda: r.choice(["a\nb", "\x00", "tab\there", "\u200b", "x\u2028y", "\x7f", "a\rb"]),
            lambda: "y" * (limit + r.randint(1, 3_000)),
        ]  # fmt: skip
        return r.choice(makers)()
    if name == "tool":
        return r.choice([None, "lookup_order", ["lookup_order"], 7, True,
                         {"name": "lookup_order", "extra": 1}])  # fmt: skip
    if name == "tool.name":
        return r.choice([None, 7, 1.5, True, [], {}, ["lookup_order"], "", "n" * 129])
    if name == "tool.version":
        return r.choice([1, 1.0, True, [], {}, "", "v" * 65, ["1.0.0"]])
    if name == "tool.extra":
        return junk(r)
    if name == "arguments":
        return r.choice([None, [], "{}", '{"order_id": "WO-12345-A"}', 1, True, [{}]])
    if name == "arguments_raw":
        return r.choice([None, {}, {"order_id": "WO-12345-A"}, [], 1, False])
    if name == "step":
        return r.choice([-1, 1_000_001, 1.0, 0.5, True, "1", [1], {}, 10**30, -(2**63)])
    if name == "active_tools":
        return r.choice(["lookup_order", 1, {}, True, [1], ["lookup_order", None], [[]]])
    assert name == "approvals"
    return r.choice(["x", 1, {}, True, 1.5])


def field_error_name(name: str) -> str:
    return {"tool.name": "tool/name", "tool.version": "tool/version", "tool.extra": "tool"}.get(
        name, name
    )


def set_field(env: dict[str, Any], name: str, value: Any) -> None:
    if name.startswith("tool."):
        sub = name.split(".", 1)[1]
        tool = env["tool"] if isinstance(env.get("tool"), dict) else {"name": "lookup_order"}
        tool[sub] = value
        env["tool"] = tool
    else:
        env[name] = value


def bad_arguments_raw(r: random.Random, args: dict[str, Any]) -> tuple[str, str]:
    """(kind, text): model output that is not one strict JSON object."""
    text = json.dumps(args, ensure_ascii=r.random() < 0.5)
    k = r.randrange(17)
    if k == 0:
        return "truncated", text[: r.randrange(len(text))]
    if k == 1:
        return "python_repr", repr(args)
    if k == 2:
        return "single_quoted", text.replace('"', "'")
    if k == 3:
        if r.random() < 0.5:
            return "trailing_comma", text[:-1] + ",}"
        return "trailing_comma", '{"tags": ["a",],' + text[1:]
    if k == 4:
        lit = r.choice(NAN_LITERALS)
        key = r.choice(list(args))
        return "nan", json.dumps({**args, key: "@@"}).replace('"@@"', lit)
    if k == 5:
        key = r.choice(list(args))
        return "duplicate_key", "{" + json.dumps(key) + ":" + json.dumps(junk(r)) + "," + text[1:]
    if k == 6:
        key = r.choice(list(args))
        esc = r.choice(LONE_SURROGATES)
        return "lone_surrogate", json.dumps({**args, key: "@@"}).replace('"@@"', f'"{esc}"')
    if k == 7:
        d = r.randint(33, 5_000)
        if r.random() < 0.5:
            return "deep", '{"a":' * d + "1" + "}" * d
        return "deep", "[" * d + "]" * d
    if k == 8:
        return "markdown", f"```json\n{text}\n```"
    if k == 9:
        return "comment", text[:-1] + " // the model's note\n}"
    if k == 10:
        return "not_object", r.choice(
            ["[]", "null", '"x"', "42", "true", f"[{text}]", json.dumps(text)]
        )
    if k == 11:
        return "unquoted_keys", "{" + ", ".join(
            f"{k}: {json.dumps(v)}" for k, v in args.items()
        ) + "}"
    if k == 12:
        return "trailing_text", text + r.choice([" and then", "}", ",", text, "\x00"])
    if k == 13:
        return "control_char", text[:-1] + ', "x": "a' + r.choice("\n\t\x00\x1f") + 'b"}'
    if k == 14:
        return "bad_escape", text[:-1] + r.choice(
            [', "x": "\\x41"}', ', "x": "\\u12"}', ', "x": "\\q"}']
        )
    if k == 15:
        return "empty", r.choice(["", " ", "\n\t", "\ufeff" + text])
    return "huge", '{"query": "' + "q" * (65_537 + r.randrange(50_000)) + '"}'


def _nested(r: random.Random, d: int) -> str:
    return "[" * d + "]" * d if r.random() < 0.5 else '{"a":' * d + "1" + "}" * d


# -- the builders ----------------------------------------------------------------------------

Builder = Callable[[random.Random, int, int], Case]


def b_valid(r: random.Random, m: int, max_bytes: int) -> Case:
    env = envelope(r, m, prefix="ok")
    return Case("valid", dumps(r, env), run_key(r, env), ROUTED, m, valid=True)


def b_valid_edge(r: random.Random, m: int, max_bytes: int) -> Case:
    """Well-formed but unusual: escapes, whitespace, 10.0 for an integer, unknown fields."""
    env = envelope(r, m, tool=r.choice(["lookup_order", "search_kb"]), raw=False)
    args = env["arguments"]
    k = r.randrange(5)
    if k == 0 and "limit" in args:
        text = dumps(r, env).replace(
            f'"limit": {args["limit"]}'.encode(), f'"limit": {args["limit"]}.0'.encode()
        )
    elif k == 1:
        env["x-unknown"] = junk(r)
        text = dumps(r, env)
    elif k == 2:
        text = b" \n\t\r" + json.dumps(env, ensure_ascii=True, indent=3).encode() + b" \n"
    elif k == 3:
        text = json.dumps(env, ensure_ascii=True).encode().replace(b'"run_id"', b'"run\\u005fid"')
    else:
        env["approvals"] = [junk(r) for _ in range(r.randint(0, 3))]
        text = dumps(r, env)
    return Case("valid_edge", text, run_key(r, env), ROUTED, m)


def b_schema_invalid(r: random.Random, m: int, max_bytes: int) -> Case:
    tool = r.choice(TOOLS)
    env = envelope(r, m, tool=tool)
    args = valid_arguments(r, tool)
    typed: dict[str, tuple[str, Any]] = {
        "lookup_order": ("limit", r.choice(["10", True, 1.5, [], None, {}])),
        "search_kb": ("query", r.choice([5, None, [], ["q", "r"], True])),
        "cancel_order": ("confirm", r.choice(["true", 1, None, []])),
        "create_ticket": ("summary", r.choice([12345678901, None, {}, ["a" * 20]])),
        "refund_order": ("amount", r.choice(["19.99", None, True, [19.99], {"v": 1}])),
    }
    bounds: dict[str, tuple[str, Any]] = {
        "lookup_order": ("limit", r.choice([0, 51, -1, 10**6, 10**30])),
        "search_kb": ("query", r.choice(["ab", "", "q" * 201])),
        "cancel_order": ("reason_code", r.choice(["because", "CUSTOMER_REQUEST", ""])),
        "create_ticket": ("priority", r.choice(["asap", "Low", ""])),
        "refund_order": ("amount", r.choice([0, -5, 10_000.01, 19.999, 1e308, 5e-324])),
    }
    k = r.randrange(4)
    if k == 0:
        name, value = typed[tool]
        args[name] = value
        expect = schema_fail("TYPE_MISMATCH")
    elif k == 1:
        name, value = bounds[tool]
        if tool == "lookup_order":
            args.setdefault("order_id", _order_id(r))
        args[name] = value
        expect = schema_fail("OUT_OF_BOUNDS")
    elif k == 2:
        args[r.choice(["note", "orderId", "order_id ", "\u200b", "", "confirm_"])] = junk(r)
        expect = schema_fail("STRUCTURAL_VIOLATION")
    else:
        required = {
            "lookup_order": ["order_id", "customer_id", "date_from", "date_to"],
            "search_kb": ["query"],
            "cancel_order": ["order_id", "reason_code", "confirm"],
            "create_ticket": ["customer_id", "category", "priority", "summary"],
            "refund_order": ["order_id", "amount", "currency", "reason_code"],
        }[tool]
        gone = (
            required if tool == "lookup_order" else r.sample(required, r.randint(1, len(required)))
        )
        for key in gone:
            args.pop(key, None)
        expect = schema_fail("STRUCTURAL_VIOLATION")
    env.pop("arguments", None)
    env.pop("arguments_raw", None)
    if r.random() < 0.3:
        env["arguments_raw"] = json.dumps(args)
    else:
        env["arguments"] = args
    return Case("schema_invalid", dumps(r, env), run_key(r, env), expect, m)


def b_wrong_type(r: random.Random, m: int, max_bytes: int) -> Case:
    env = envelope(r, m)
    names = [*STRING_FIELDS, "tool", "tool.name", "tool.version", "tool.extra", "arguments",
             "arguments_raw", "step", "active_tools", "approvals"]  # fmt: skip
    touched = r.sample(names, r.randint(1, 3))
    if "tool" in touched:
        touched = [n for n in touched if not n.startswith("tool.")]
    if "arguments" in touched and "arguments_raw" in touched:
        touched.remove(r.choice(["arguments", "arguments_raw"]))
    for name in touched:
        if name in ("arguments", "arguments_raw"):
            env.pop("arguments", None)
            env.pop("arguments_raw", None)
        set_field(env, name, bad_value_for(r, name))
    if "run_id" in touched:
        expect = dlq("no_run_id")
    else:
        expect = parse_fail(*{field_error_name(n) for n in touched})
    return Case("wrong_type", dumps(r, env), run_key(r, env), expect, m, note=",".join(touched))


def b_missing(r: random.Random, m: int, max_bytes: int) -> Case:
    env = envelope(r, m)
    gone = r.sample([*REQUIRED, "run_id", "args"], r.randint(1, 3))
    for name in gone:
        if name == "args":
            env.pop("arguments", None)
            env.pop("arguments_raw", None)
        else:
            env.pop(name)
    if "run_id" in gone:
        expect = dlq("no_run_id")
    else:
        expect = parse_fail(*("arguments" if n == "args" else n for n in gone))
    return Case("missing", dumps(r, env), run_key(r, env), expect, m)


def b_both_arguments(r: random.Random, m: int, max_bytes: int) -> Case:
    env = envelope(r, m, raw=False)
    env["arguments_raw"] = json.dumps(env["arguments"]) if r.random() < 0.5 else junk(r)
    return Case("both_arguments", dumps(r, env), run_key(r, env),
                parse_fail("arguments", codes=["ambiguous"]), m)  # fmt: skip


def b_bad_raw(r: random.Random, m: int, max_bytes: int) -> Case:
    env = envelope(r, m, raw=True)
    tool = env["tool"]["name"]
    sub, text = bad_arguments_raw(r, valid_arguments(r, tool))
    env["arguments_raw"] = text
    codes = {"huge": ["too_large"], "truncated": ["truncated"], "duplicate_key": ["duplicate_key"]}
    return Case("bad_raw", dumps(r, env), run_key(r, env),
                parse_fail("arguments_raw", codes=codes.get(sub)), m, note=sub)  # fmt: skip


def b_lookalike_tool(r: random.Random, m: int, max_bytes: int) -> Case:
    env = envelope(r, m)
    if r.random() < 0.8:
        name = r.choice(LOOKALIKES)
    else:
        name = "".join(r.choice(ALPHABET) for _ in range(r.randint(1, 40))) or "?"
    env["tool"]["name"] = name
    if r.random() < 0.5:
        env.pop("active_tools", None)
    expect = UNKNOWN_TOOL if name not in TOOLS else ROUTED
    return Case("lookalike_tool", dumps(r, env), run_key(r, env), expect, m, note=name)


def b_duplicate_key(r: random.Random, m: int, max_bytes: int) -> Case:
    env = envelope(r, m, raw=False)
    where = r.randrange(3)
    if where == 0:  # top level: the ambiguity attack
        key = r.choice(["run_id", "tenant_id", "proposal_id", "tool", "arguments"])
        dup = r.choice([env[key], junk(r), "t-evil"])
        text = json.dumps(env).encode()
        text = b"{" + json.dumps(key).encode() + b":" + json.dumps(dup).encode() + b"," + text[1:]
        if r.random() < 0.5:  # the duplicate last instead of first
            text = (
                json.dumps(env).encode()[:-1]
                + b","
                + json.dumps(key).encode()
                + b":"
                + (json.dumps(dup).encode() + b"}")
            )
    else:
        args = env.pop("arguments")
        inner = json.dumps(args).encode()
        k = r.choice(list(args))
        if where == 1:
            nested = b'{"' + k.encode() + b'":' + json.dumps(junk(r)).encode() + b"," + inner[1:]
            text = json.dumps(env).encode()[:-1] + b', "arguments": ' + nested + b"}"
        else:
            env.pop("tool")
            text = json.dumps(env).encode()[:-1] + (
                b', "arguments": ' + inner + b', "tool": {"name": "lookup_order", "name": "x"}}'
            )
    # Duplicates among the envelope's own keys leave the identity ambiguous: DLQ.
    expect = dlq("duplicate_key") if where == 0 else strict_fail("duplicate_key")
    return Case("duplicate_key", text, run_key(r, env), expect, m)


def b_nan(r: random.Random, m: int, max_bytes: int) -> Case:
    env = envelope(r, m, raw=False)
    lit = r.choice(NAN_LITERALS).encode()
    place = r.randrange(4)
    if place == 0:
        env[r.choice(["run_id", "step", "proposal_id", "x"])] = "@@"
    elif place == 1:
        env["arguments"][r.choice(list(env["arguments"]))] = "@@"
    elif place == 2:
        env["arguments"]["nested"] = {"v": ["@@"]}
    else:
        env["tool"]["version"] = "@@"
    text = json.dumps(env).encode().replace(b'"@@"', lit)
    return Case("nan", text, run_key(r, env), strict_fail("invalid_json"), m, note=lit.decode())


def b_truncated(r: random.Random, m: int, max_bytes: int) -> Case:
    env = envelope(r, m)
    text = dumps(r, env)
    return Case("truncated", text[: r.randrange(len(text))], run_key(r, env),
                dlq("truncated", "invalid_json"), m)  # fmt: skip


def _is_utf8(text: bytes) -> bool:
    try:
        text.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


def b_invalid_utf8(r: random.Random, m: int, max_bytes: int) -> Case:
    env = envelope(r, m)
    text = dumps(r, env)
    for _ in range(r.randint(1, 3)):
        bad = r.choice(BAD_UTF8)
        if r.random() < 0.7:  # inside a string, where a lenient parser would take it
            quotes = [i for i in range(len(text)) if text[i] == 0x22]
            i = r.choice(quotes) + 1
        else:
            i = r.randrange(len(text) + 1)
        text = text[:i] + bad + text[i:]
    if _is_utf8(text):
        # Insertions can complete each other: b"\x80" inserted inside b"\xf0\x9f\x98" makes
        # U+1F018, or after it U+1F600. The record is then valid UTF-8, and often valid
        # JSON that rightly passes. A byte UTF-8 never uses keeps it what the case says.
        text = text[:i] + b"\xff" + text[i:]
    return Case("invalid_utf8", text, run_key(r, env), dlq("invalid_json", "truncated"), m)


def b_lone_surrogate(r: random.Random, m: int, max_bytes: int) -> Case:
    env = envelope(r, m, raw=False)
    place = r.randrange(6)
    if place < 3:
        env[["proposal_id", "tenant_id", "run_id"][place]] = "@@"
    elif place == 3:
        env["tool"]["name"] = "@@"
    elif place == 4:
        env["arguments"][r.choice(list(env["arguments"]))] = "@@"
    else:
        env["@@"] = 1  # a key
    esc = r.choice(LONE_SURROGATES).encode()
    text = json.dumps(env).encode().replace(b'"@@"', b'"' + esc + b'"')
    return Case("lone_surrogate", text, run_key(r, env), strict_fail("invalid_json"), m)


def b_flip(r: random.Random, m: int, max_bytes: int) -> Case:
    env = envelope(r, m)
    text = bytearray(dumps(r, env))
    for _ in range(r.randint(1, 6)):
        op = r.randrange(4)
        i = r.randrange(len(text)) if text else 0
        if op == 0 and text:
            text[i] ^= 1 << r.randrange(8)
        elif op == 1:
            text[i:i] = bytes([r.getrandbits(8)])
        elif op == 2 and text:
            del text[i : i + r.randint(1, 8)]
        else:
            text[i:i] = r.choice([b"{", b"}", b"[", b'"', b",", b":", b"\\", b"\x00", b"null"])
    return Case("flip", bytes(text), run_key(r, env), Expect(), m)


def b_deep(r: random.Random, m: int, max_bytes: int) -> Case:
    d = r.randint(10, 5_000)
    env = envelope(r, m, raw=False)
    place = r.randrange(5)
    if place == 0:
        return Case("deep", _nested(r, d).encode(), run_key(r, env), dlq(), m, note=f"top {d}")
    if place == 1:
        env["arguments"] = "@@"
        expect = NOT_ROUTED
    elif place == 2:
        env["arguments"][r.choice(list(env["arguments"]))] = "@@"
        expect = NOT_ROUTED
    elif place == 3:
        env.pop("arguments")
        env["arguments_raw"] = _nested(r, d)
        # (32 levels are within the limit: an object that deep reaches the schema gate)
        expect = NOT_ROUTED if d <= 32 else parse_fail("arguments_raw")
        return Case("deep", dumps(r, env), run_key(r, env), expect, m, note=f"raw {d}")
    else:
        env[r.choice(["approvals", "x-extra", "tool"])] = "@@"
        expect = Expect()
    text = json.dumps(env).encode().replace(b'"@@"', _nested(r, d).encode())
    if d > 40:
        expect = strict_fail("too_deep")
    return Case("deep", text, run_key(r, env), expect, m, note=f"{place} {d}")


def b_huge(r: random.Random, m: int, max_bytes: int) -> Case:
    n = huge_size(r, max_bytes)
    place = r.randrange(9)
    while True:
        case = _huge(r, m, n, place)
        assert case.value is not None
        if len(case.value) <= max_bytes:
            return case
        n = n * max_bytes // len(case.value) - 2_000


def _huge(r: random.Random, m: int, n: int, place: int) -> Case:
    env = envelope(r, m, tool="search_kb", raw=False)
    if place == 0:
        env["arguments"]["query"] = huge_string(r, n)
        expect = parse_fail("arguments", codes=["too_large"]) if n > 70_000 else NOT_ROUTED
    elif place == 1:
        env.pop("arguments")
        env["arguments_raw"] = json.dumps({"query": huge_string(r, n)})
        expect = parse_fail("arguments_raw", codes=["too_large"]) if n > 70_000 else NOT_ROUTED
    elif place == 2:  # big, valid apart from its size, and ignored
        env[r.choice(["x-debug", "note"])] = huge_string(r, n)
        expect = ROUTED
    elif place == 3:  # an ignored field with a big name: the name is echoed in a warning
        env["x-" + huge_string(r, n)] = 1
        expect = ROUTED
    elif place == 4:
        env["tool"]["name"] = huge_string(r, n)
        expect = parse_fail("tool/name")
    elif place == 5:
        env["run_id"] = huge_string(r, n)
        expect = dlq("no_run_id")
    elif place == 6:
        env["arguments"] = {f"k{i}": i for i in range(n // 12)}
        expect = parse_fail("arguments", codes=["too_large"]) if n > 90_000 else NOT_ROUTED
    elif place == 7:  # each approval costs a signature check: more than a few are refused unread
        env["approvals"] = [{"id": i} for i in range(n // 12)]
        expect = parse_fail("approvals", codes=["invalid_value"])
    else:  # integers beyond 64 bits, which orjson reads as floats and cannot write
        env["arguments"]["limit"] = [10**30] * (n // 32)
        expect = parse_fail("arguments", codes=["too_large"]) if n > 70_000 else NOT_ROUTED
    return Case("huge", dumps(r, env), run_key(r, env), expect, m, note=f"{place} {n}")


def b_wrong_top_type(r: random.Random, m: int, max_bytes: int) -> Case:
    env = envelope(r, m)
    value = r.choice([[env], [], "proposal", 42, -0.5, None, True, json.dumps(env), junk(r)])
    if isinstance(value, dict):
        value = [value]
    return Case("wrong_top_type", dumps(r, value), run_key(r, env), dlq("not_object"), m)


def b_run_id(r: random.Random, m: int, max_bytes: int) -> Case:
    env = envelope(r, m)
    if r.random() < 0.2:
        del env["run_id"]
    else:
        env["run_id"] = r.choice(["", "\n", "a\tb", "\x00", "\u200b", "r" * 257, 0, 1.5, [],
                                  {}, None, True, ["run-1"], {"id": "run-1"}])  # fmt: skip
    return Case("run_id", dumps(r, env), run_key(r, env), dlq("no_run_id"), m)


def b_garbage(r: random.Random, m: int, max_bytes: int) -> Case:
    k = r.randrange(8)
    key = bytes(r.getrandbits(8) for _ in range(r.randint(0, 8))) if r.random() < 0.5 else None
    if k == 0:
        return Case("garbage", None, key, dlq("empty"), m)
    if k == 1:
        return Case("garbage", b"", key, dlq("truncated", "invalid_json"), m)
    if k == 2:
        value = bytes(r.getrandbits(8) for _ in range(r.randint(1, 64)))
        return Case("garbage", value, key, dlq(), m)
    if k == 3:
        value = json.dumps(envelope(r, m)).encode(r.choice(["utf-16", "utf-16-le", "utf-32"]))
        return Case("garbage", value, key, dlq(), m)
    if k == 4:
        return Case("garbage", b"{}", key, dlq("no_run_id"), m)
    if k == 5:
        value = r.choice([b" ", b"\n", b"{", b"}", b"[", b'"', b"\x00" * 10, b"nul", b"tru"])
        return Case("garbage", value, key, dlq(), m)
    if k == 6:
        value = b"\xef\xbb\xbf" + json.dumps(envelope(r, m)).encode()  # a BOM is not JSON
        return Case("garbage", value, key, dlq(), m)
    value = json.dumps(envelope(r, m)).encode() * 2  # two documents back to back
    return Case("garbage", value, key, dlq("invalid_json"), m)


BUILDERS: dict[str, Builder] = {
    "valid_edge": b_valid_edge, "schema_invalid": b_schema_invalid, "wrong_type": b_wrong_type,
    "missing": b_missing, "both_arguments": b_both_arguments, "bad_raw": b_bad_raw,
    "lookalike_tool": b_lookalike_tool, "duplicate_key": b_duplicate_key, "nan": b_nan,
    "truncated": b_truncated, "invalid_utf8": b_invalid_utf8, "lone_surrogate": b_lone_surrogate,
    "flip": b_flip, "deep": b_deep, "huge": b_huge, "wrong_top_type": b_wrong_top_type,
    "run_id": b_run_id, "garbage": b_garbage,
}  # fmt: skip
# How often each kind is drawn in a corpus; huge records are kept few.
WEIGHTS = {name: 1.0 for name in BUILDERS} | {"huge": 0.12, "flip": 2.0, "bad_raw": 2.0,
                                               "wrong_type": 2.0}  # fmt: skip


def build(kind: str, r: random.Random, marker: int, max_bytes: int = 2_100_000) -> Case:
    if kind == "valid":
        return b_valid(r, marker, max_bytes)
    return BUILDERS[kind](r, marker, max_bytes)


def corpus(seed: int, hostile: int, valid: int, max_bytes: int = 2_100_000) -> list[Case]:
    """``hostile`` malformed records and ``valid`` proposals, interleaved, reproducibly."""
    r = random.Random(seed)
    kinds = list(BUILDERS)
    weights = [WEIGHTS[k] for k in kinds]
    cases = [build(r.choices(kinds, weights)[0], r, i, max_bytes) for i in range(hostile)]
    cases += [b_valid(r, hostile + i, max_bytes) for i in range(valid)]
    r.shuffle(cases)
    return cases


# -- hypothesis strategies -------------------------------------------------------------------


def cases(
    max_bytes: int = 2_100_000, kinds: Iterable[str] | None = None
) -> st.SearchStrategy[Case]:
    """A hostile case of any kind; hypothesis drives (and shrinks) the random choices."""
    names = sorted(kinds) if kinds is not None else ["valid", *BUILDERS]
    return st.builds(
        lambda kind, r, marker: build(kind, r, marker, max_bytes),
        st.sampled_from(names),
        st.randoms(use_true_random=False),
        st.integers(0, 10**9),
    )


_scalars = (
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=30)
)  # fmt: skip
json_values = st.recursive(
    _scalars, lambda kids: st.lists(kids, max_size=4) | st.dictionaries(st.text(max_size=8), kids,
                                                                        max_size=4),
    max_leaves=12,
)  # fmt: skip
field_values = json_values | st.sampled_from(LOOKALIKES) | st.sampled_from(TOOLS) | st.just("ok")


@st.composite
def arbitrary_envelopes(draw: st.DrawFn) -> tuple[dict[str, Any], bytes]:
    """Envelopes whose every field may be any JSON value (or absent)."""
    env: dict[str, Any] = {}
    names = [*STRING_FIELDS, "tool", "arguments", "arguments_raw", "step", "active_tools",
             "approvals", "extra"]  # fmt: skip
    for name in names:
        if draw(st.booleans()):
            if name == "tool":
                env[name] = draw(st.fixed_dictionaries(
                    {}, optional={"name": field_values, "version": field_values,
                                  "x": json_values}) | json_values)  # fmt: skip
            elif name == "arguments":
                env[name] = draw(st.dictionaries(st.sampled_from(
                    ["order_id", "query", "limit", "amount", "confirm", "x", ""]), field_values,
                    max_size=5) | json_values)  # fmt: skip
            else:
                env[name] = draw(field_values)
    if draw(st.booleans()):
        env["run_id"] = "run-h"
    text = json.dumps(env, ensure_ascii=draw(st.booleans())).encode("utf-8", "surrogatepass")
    return env, text
