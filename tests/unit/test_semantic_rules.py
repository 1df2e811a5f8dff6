"""Contract rules over arguments the engine cannot evaluate faithfully or quickly: refused
with a typed answer before any rule runs, never let through, never a crash."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import yaml

from processor.contracts.registry import Contract, load_contracts
from processor.gates.semantic import RULE_COST_LIMIT, check_semantics, context_size
from processor.model import Principal, Proposal, TaxonomyClass
from tests.unit.helpers import CONTRACTS_DIR

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
    contract = _contract(tmp_path, "args.n != 18446744073709551616.0")
    for n in (2**64 + 1, 2**63, -(2**63) - 1):
        refusal = check_semantics(_proposal(n=n), contract, PRINCIPAL, [])
        assert refusal is not None and refusal.taxonomy is TaxonomyClass.OUT_OF_BOUNDS, n
        [error] = refusal.errors
        assert (error.field, error.code) == ("n", "integer_overflow")
    deep = check_semantics(_proposal(l=[{"a/b": [2**70]}]), contract, PRINCIPAL, [])
    assert deep is not None and deep.errors[0].field == "l/0/a~1b/0"
    assert check_semantics(_proposal(n=2**63 - 1), contract, PRINCIPAL, []) is None


def test_integer_overflow_inside_a_rule_fails_the_call(tmp_path: Path) -> None:
    contract = _contract(tmp_path, "args.n * 2 > 0", "0 - args.n > 0")
    refusal = check_semantics(_proposal(n=-(2**63)), contract, PRINCIPAL, [])
    assert refusal is not None and refusal.taxonomy is TaxonomyClass.SEMANTIC_INVALIDITY
    assert [e.expected for e in refusal.errors] == ["r0", "r1"]


def test_context_size_counts_values_and_long_strings_and_survives_deep_nesting() -> None:
    assert context_size({"a": [1, 2], "s": "x" * 32}) == (1 + 1 + 2 + 1 + 2, None)
    deep: Any = 1
    for _ in range(50_000):
        deep = [deep]
    assert context_size(deep)[0] == 50_001
    assert RULE_COST_LIMIT > 0
