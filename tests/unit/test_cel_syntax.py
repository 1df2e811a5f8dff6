"""A rule's text read again: the names it binds and uses, and what of its variables it can
read. The engine lists every name a rule uses; this parse must see each of them."""

from __future__ import annotations

from typing import Any

import pytest
import yaml

from processor.contracts.cel_engine import compile_expression
from processor.contracts.cel_syntax import Unanalysable, names, parse, reads
from tests.unit.helpers import CONTRACTS_DIR

VARIABLES = frozenset({"args", "principal", "refs"})


@pytest.mark.parametrize(
    ("expression", "paths"),
    [
        ("args.a.b == 1", [("args", "a", "b")]),
        ("args . a\n. b == 1 // a comment: args.c", [("args", "a", "b")]),
        ("args['a-b'].c == 1 && args[r'd'] == 2 && args[\"\"] == 3",
         [("args", ""), ("args", "a-b", "c"), ("args", "d")]),
        # What cannot be followed by name reads the whole value it is taken from.
        ("args['\\x61'] == 1", [("args",)]),
        ("args[b'a'] == 1", [("args",)]),
        ("args.l[0] == 1 && args.m[args.k].x == 1",
         [("args", "k"), ("args", "l"), ("args", "m")]),
        ("size(args.l) > 0 && args.l.all(x, x.y > args.z)",
         [("args", "l"), ("args", "z")]),
        ("dyn(args).n == 1", [("args",)]),
        ("{'k': args}.k.n == 1 && [refs][0].o.p == 1", [("args",), ("refs",)]),
        ("'n' in args", [("args",)]),
        ("has(args.a.b) && principal.tenant_id == refs.order_id.tenant_id",
         [("args", "a", "b"), ("principal", "tenant_id"), ("refs", "order_id", "tenant_id")]),
        ("(args).n == 1 ? args.m : -args.o", [("args", "m"), ("args", "n"), ("args", "o")]),
        ("args.s == 'args.t' && args.u == '''args.v'''", [("args", "s"), ("args", "u")]),
        ("[1, 2].all(x, x > 0)", []),
    ],
)  # fmt: skip
def test_what_a_rule_reads(expression: str, paths: list[tuple[str, ...]]) -> None:
    compile_expression(expression)  # the engine's syntax, not only this parser's
    assert list(reads(parse(expression), VARIABLES)) == paths


def test_names_bound_and_free() -> None:
    tree = parse("args.l.all(x, x.all(y, y > x)) && args.m.map(z, z > 0, z).size() > 0 && w")
    used = names(tree)
    assert used.free == {"args", "w"}
    assert sorted((v, sorted(around)) for v, around in used.bindings) == [
        ("x", []), ("y", ["x"]), ("z", [])
    ]  # fmt: skip
    # With another number of arguments, all and map are methods, not macros.
    assert names(parse("[1].all(x, true, false) && [1].map(y)")).free == {"x", "y"}


@pytest.mark.parametrize(
    "expression",
    [
        "google.protobuf.Int64Value{value: 1} != null",  # compiles, and fails at run time
        "args.a == 1 ~ 2",
        "args.a ==",
        "(" * 2000 + "1" + ")" * 2000,
    ],
)
def test_what_cannot_be_read_is_unanalysable(expression: str) -> None:
    with pytest.raises(Unanalysable):
        parse(expression)


def _contract_rules() -> list[str]:
    out = []
    for path in sorted(CONTRACTS_DIR.rglob("*.yaml")):
        doc: Any = yaml.safe_load(path.read_text())
        out += [r["expression"] for r in doc.get("semantics", {}).get("rules", [])]
    return out


@pytest.mark.parametrize(
    "expression",
    [
        *_contract_rules(),
        "[1].exists_one(x, x > 0) && [1].existsOne(y, y > 0) && [1].filter(z, z > 0) == [1]",
        "0x1Fu == 31u && .5 == 0.5 && 1e3 == 1000.0 && b'\\x00' != b'' && r'\\' == '\\\\'",
        '"""a"b""" != \'\' && {\'a\': 1,}.a == 1 && [1, 2,].size() == 2',
        "!!!true && - - 1 == 1 && 1 in [1] && 7 % 4 * 2 / 1 - 1 + 0 == 5",
        " && ".join(["true"] * 2000),
        "!" * 2000 + "true",
        "(" * 90 + "1" + ")" * 90 + " == 1",
    ],
)
def test_the_parse_sees_every_name_the_engine_does(expression: str) -> None:
    program = compile_expression(expression)
    used = names(parse(expression))
    assert set(program.variables()) <= used.free | {v for v, _ in used.bindings}
