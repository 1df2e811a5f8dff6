"""The scope check: only development mode's unverified principal holds every scope."""

from __future__ import annotations

import orjson

from processor.contracts.registry import ContractSet
from processor.gates.identity import check_scopes
from processor.gates.parse import Limits, parse_proposal
from processor.model import Principal, Proposal
from tests.unit.helpers import envelope, record


def _cancel() -> Proposal:
    parsed = parse_proposal(record(orjson.dumps(envelope("cancel_order"))), Limits())
    assert isinstance(parsed, tuple)
    return parsed[0]


def _principal(scopes: set[str], verified: bool = True) -> Principal:
    return Principal("acme", "u-1", "a-1", frozenset(scopes), "internal", verified=verified)


def test_a_token_claiming_every_scope_gets_none_of_them(contracts: ContractSet) -> None:
    contract = contracts.versions("cancel_order")[0]
    for scopes in ({"*"}, {"orders:read", "*"}):
        refusal = check_scopes(_cancel(), contract, _principal(scopes))
        assert refusal is not None, scopes
        assert [e.code for e in refusal.errors] == ["scope_missing"]


def test_the_contracts_scopes_pass_and_development_mode_holds_every_scope(
    contracts: ContractSet,
) -> None:
    contract = contracts.versions("cancel_order")[0]
    assert contract.required_scopes
    assert check_scopes(_cancel(), contract, _principal(set(contract.required_scopes))) is None
    assert check_scopes(_cancel(), contract, _principal({"*"}, verified=False)) is None
