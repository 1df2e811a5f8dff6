"""Contract rules over arguments the engine cannot evaluate faithfully or quickly: refused
with a typed answer before any rule runs, never let through, never a crash."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest
import yaml

from processor.contracts.registry import Contract, load_contracts
from processor.gates.semantic import RULE_COST_LIMIT, check_semantics, context_size
from processor.model import Outcome, Principal, Proposal, TaxonomyClass
from processor.pipeline import Gates, decide
from tests.unit.helpers import CONTRACTS_DIR, LIMITS, NOW_MS, envelope, record

PRINCIPAL = Principal("t1", "u1", "a1", frozenset(), "internal")


def _contract(tmp_path: Path, *expressions: str) -> Contract:
    """lookup_order with an open list argument ``l`` and the given rules."""
    doc: dict[str, Any] = yaml.safe_load((CONTRACTS_DIR / "lookup_order/1.0.0.yaml").read_text())
    schema = doc["affordance"]["input_schema"]
    schema["properties"]["l"] = {"type": "array"}
    schema["properties"]["n"] = {"type": "integer"}
    doc["semantics"] = {
        "rules": [
            {"id": f"r{i}", "expression": e, "message": "m", "next_action": "n"}
            for i, e in enumerate(expressions)
        ]
    }
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(doc))
    return load_contracts(tmp_path).versions("lookup_order")[0]


def _proposal(**arguments: Any) -> Proposal:
    return Proposal("p1", "r1", "t1", None, "lookup_order", "1.0.0", arguments)


def test_a_rule_too_costly_for_the_arguments_fails_closed_without_running(
    tmp_path: Path,
) -> None:
    contract = _contract(tmp_path, "args.l.all(x, args.l.all(y, x >= 0 && y >= 0))")
    started = time.perf_counter()
    refusal = check_semantics(_proposal(l=list(range(2000))), contract, PRINCIPAL, [])
    assert time.perf_counter() - started < 0.5  # evaluated, this takes about 1 s
    assert refusal is not None and refusal.taxonomy is TaxonomyClass.OUT_OF_BOUNDS
    [error] = refusal.errors
    assert (error.code, error.expected) == ("rule_cost_exceeded", "r0")
    assert "too large" in refusal.next_action


def test_a_list_producing_map_is_bounded_more_tightly_than_a_single_comprehension(
    tmp_path: Path,
) -> None:
    contract = _contract(tmp_path, "args.l.map(x, args.l).size() >= 0", "args.l.all(x, x >= 0)")
    big = check_semantics(_proposal(l=list(range(300))), contract, PRINCIPAL, [])
    assert big is not None and [e.expected for e in big.errors] == ["r0"]
    assert check_semantics(_proposal(l=list(range(50))), contract, PRINCIPAL, []) is None


def test_the_same_rule_runs_over_small_arguments(tmp_path: Path) -> None:
    contract = _contract(tmp_path, "args.l.all(x, args.l.all(y, x >= 0 && y >= 0))")
    assert check_semantics(_proposal(l=list(range(100))), contract, PRINCIPAL, []) is None
    refusal = check_semantics(_proposal(l=[1, -1]), contract, PRINCIPAL, [])
    assert refusal is not None and refusal.taxonomy is TaxonomyClass.SEMANTIC_INVALIDITY


def test_a_rule_without_comprehensions_is_never_limited(tmp_path: Path) -> None:
    contract = _contract(tmp_path, "size(args.l) > 0")
    assert check_semantics(_proposal(l=list(range(30_000))), contract, PRINCIPAL, []) is None


def test_an_integer_beyond_int64_fails_closed_instead_of_turning_into_a_float(
    tmp_path: Path,
) -> None:
    # 2**64 + 1 reached the rule as the double 2**64: its verdict was about another number.
    contract = _contract(
        tmp_path, "args.n != 18446744073709551616.0", "!has(args.l) || size(args.l) >= 0"
    )
    for n in (2**64 + 1, 2**63, -(2**63) - 1):
        refusal = check_semantics(_proposal(n=n), contract, PRINCIPAL, [])
        assert refusal is not None and refusal.taxonomy is TaxonomyClass.OUT_OF_BOUNDS, n
        [error] = refusal.errors
        assert (error.field, error.code) == ("n", "integer_overflow")
    deep = check_semantics(_proposal(l=[{"a/b": [2**70]}]), contract, PRINCIPAL, [])
    assert deep is not None and deep.errors[0].field == "l/0/a~1b/0"
    assert check_semantics(_proposal(n=2**63 - 1), contract, PRINCIPAL, []) is None


def test_an_integer_beyond_int64_that_no_rule_reads_is_no_reason_to_refuse(
    tmp_path: Path,
) -> None:
    """Before, any such integer refused the call, wherever it was. And one beyond the
    double range fails the engine's conversion of the whole context: it is not given to
    the engine, nor is the proposal's own value changed."""
    contract = _contract(tmp_path, "args.n > 0", "args.l.all(x, x > 0)")
    wide = {"big": 2**70, "huge": -(10**400), "meta": {"k": [10**400], "j": 1}, "n": 1, "l": [1]}
    assert check_semantics(_proposal(**wide), contract, PRINCIPAL, []) is None
    refusal = check_semantics(_proposal(**{**wide, "n": -1}), contract, PRINCIPAL, [])
    assert refusal is not None and refusal.taxonomy is TaxonomyClass.SEMANTIC_INVALIDITY
    assert [e.expected for e in refusal.errors] == ["r0"]
    assert wide["huge"] == -(10**400) and wide["meta"] == {"k": [10**400], "j": 1}
    read = check_semantics(_proposal(**{**wide, "l": [1, 10**400]}), contract, PRINCIPAL, [])
    assert read is not None and read.taxonomy is TaxonomyClass.OUT_OF_BOUNDS
    assert (read.errors[0].field, read.errors[0].code) == ("l/1", "integer_overflow")


@pytest.mark.parametrize(
    "expression",
    [
        "size(args.meta) >= 0",  # a function of the value
        "args.meta.all(k, k != '')",  # a comprehension over it
        "args.meta[args.key] != 0",  # a dynamic index into it
        "size(args) > 0",  # the arguments whole
        "dyn(args).n == 1",  # the arguments through a function
        "'n' in args",
        "has(args.meta.k.x)",  # a value inside it, reached through it
        "args.meta.k == [1]",
        "args['meta'].k == [1]",
    ],
)
def test_every_integer_a_rule_can_read_counts(expression: str, tmp_path: Path) -> None:
    contract = _contract(tmp_path, expression)
    refusal = check_semantics(_proposal(meta={"k": 2**64}, n=1), contract, PRINCIPAL, [])
    assert refusal is not None and refusal.taxonomy is TaxonomyClass.OUT_OF_BOUNDS, expression
    assert (refusal.errors[0].field, refusal.errors[0].code) == ("meta/k", "integer_overflow")


def test_integer_overflow_inside_a_rule_fails_the_call(tmp_path: Path) -> None:
    contract = _contract(tmp_path, "args.n * 2 > 0", "0 - args.n > 0")
    refusal = check_semantics(_proposal(n=-(2**63)), contract, PRINCIPAL, [])
    assert refusal is not None and refusal.taxonomy is TaxonomyClass.SEMANTIC_INVALIDITY
    assert [e.expected for e in refusal.errors] == ["r0", "r1"]


def test_context_size_counts_values_and_long_strings_and_survives_deep_nesting() -> None:
    assert context_size({"a": [1, 2], "s": "x" * 32}) == (1 + 1 + 2 + 1 + 2, None, [])
    deep: Any = 1
    for _ in range(50_000):
        deep = [deep]
    assert context_size(deep)[0] == 50_001
    assert RULE_COST_LIMIT > 0


@pytest.mark.parametrize(
    ("arguments", "field"),
    [({"limit": 2**64}, "limit"), ({"limit": 5, "x": [{"y": -(2**63) - 1}]}, "x/0/y")],
)
def test_an_integer_a_call_cannot_carry_is_out_of_bounds_not_an_internal_error(
    tmp_path: Path, arguments: dict[str, Any], field: str
) -> None:
    """A contract that bounds no integer (no maximum, and here any extra field) lets one
    through that neither the payload hash nor the approved call can hold: the decision
    failed as an internal error (UNKNOWN_ERROR, counted and alerted on as a defect),
    whatever rules the contract had. Such a number is refused, at its path."""
    doc = yaml.safe_load((CONTRACTS_DIR / "search_kb" / "1.0.0.yaml").read_text())
    schema = doc["affordance"]["input_schema"]
    del schema["properties"]["limit"]["maximum"], schema["additionalProperties"]
    (tmp_path / "search_kb.yaml").write_text(yaml.safe_dump(doc))
    contracts = load_contracts(tmp_path)
    env = envelope("search_kb")
    env["arguments"].update(arguments)
    d = decide(record(json.dumps(env).encode()), Gates.development(contracts, LIMITS), NOW_MS)
    assert d.outcome is Outcome.REJECTED and d.rejection is not None, d
    assert d.rejection.taxonomy is TaxonomyClass.OUT_OF_BOUNDS
    assert [(e.field, e.code) for e in d.rejection.errors] == [(field, "integer_overflow")]
    env["arguments"]["limit"] = 2**64 - 1  # (the widest a call carries)
    env["arguments"].pop("x", None)
    routed = decide(record(json.dumps(env).encode()), Gates.development(contracts, LIMITS), NOW_MS)
    assert routed.outcome is Outcome.ROUTED, routed.rejection
