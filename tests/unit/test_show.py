"""Showing one contract to a person: the facts a reviewer needs are on screen."""

from __future__ import annotations

import pytest
from rich.console import Console
from typer.testing import CliRunner

from processor.cli import app
from processor.contracts.registry import ContractSet
from processor.contracts.show import UnknownContract, find_contract, render_contract
from tests.unit.helpers import CONTRACTS_DIR


def rendered(contracts: ContractSet, spec: str) -> str:
    console = Console(width=200, record=True, color_system=None)
    console.print(render_contract(find_contract(contracts, spec)))
    return console.export_text()


def test_cancel_order_shows_pattern_hint_and_risk(contracts: ContractSet) -> None:
    text = rendered(contracts, "cancel_order")
    assert "cancel_order 1.0.0" in text
    assert "pattern ^WO-[0-9]{5}-[A-Z]$" in text  # not eaten as rich markup
    assert "lookup_order" in text.split("order_id", 1)[1].splitlines()[0]  # obtain-via column
    assert "HIGH_RISK_EXTERNAL" in text
    assert "irreversible_pivot" in text
    for fact in ("orders:write", "6000 ms", "30 per 60 s", "Idempotency-Key", "confidential"):
        assert fact in text, fact


def test_a_version_can_be_named(contracts: ContractSet) -> None:
    oldest = contracts.versions("charge_customer_card_v2")[-1]
    text = rendered(contracts, f"charge_customer_card_v2@{oldest.version}")
    assert oldest.lifecycle.status in text
    assert f"charge_customer_card_v2 {oldest.version}" in text


def test_unknown_tool_suggests_close_matches(contracts: ContractSet) -> None:
    with pytest.raises(UnknownContract) as caught:
        find_contract(contracts, "cancel_ordr")
    assert "cancel_order" in caught.value.suggestions


def test_unknown_version_lists_the_versions(contracts: ContractSet) -> None:
    with pytest.raises(UnknownContract) as caught:
        find_contract(contracts, "cancel_order@9.9.9")
    assert caught.value.suggestions == ["cancel_order@1.0.0"]


def test_cli_shows_a_contract() -> None:
    result = CliRunner().invoke(
        app, ["contracts", "show", "cancel_order", str(CONTRACTS_DIR)], env={"COLUMNS": "200"}
    )
    assert result.exit_code == 0, result.output
    assert "^WO-[0-9]{5}-[A-Z]$" in result.stdout
    assert "HIGH_RISK_EXTERNAL" in result.stdout


def test_cli_unknown_tool_exits_1_with_close_matches() -> None:
    result = CliRunner().invoke(app, ["contracts", "show", "cancel_ordr", str(CONTRACTS_DIR)])
    assert result.exit_code == 1
    assert "did you mean" in result.stderr
    assert "cancel_order" in result.stderr
