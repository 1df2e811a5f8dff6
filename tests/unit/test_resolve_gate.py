"""Gate 2, tool resolution: names, look-alikes, active tools, versions and lifecycles."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
import yaml

from processor.contracts.registry import Contract, ContractSet, load_contracts
from processor.gates.resolve import resolve_tool
from processor.identity import DEVELOPMENT_WARNING
from processor.model import Decision, Gate, Outcome, Proposal, Rejection, TaxonomyClass
from tests.unit.helpers import CONTRACTS_DIR, NOW_MS, decide_envelope, envelope

ALL_TOOLS = load_contracts(CONTRACTS_DIR).callable_names


def _write_version(
    directory: Path,
    version: str,
    status: str,
    sunset_date: str | None = None,
    replacement: str | None = None,
) -> None:
    doc = yaml.safe_load((CONTRACTS_DIR / "cancel_order" / "1.0.0.yaml").read_text())
    doc["identity"]["version"] = version
    doc["identity"]["lifecycle"] = {
        "status": status,
        "sunset_date": sunset_date,
        "replacement": replacement,
    }
    (directory / "cancel_order" / f"{version}.yaml").write_text(yaml.safe_dump(doc))


@pytest.fixture(scope="module")
def versioned(tmp_path_factory: pytest.TempPathFactory) -> ContractSet:
    """The shipped contracts plus more cancel_order versions in every lifecycle state."""
    directory = tmp_path_factory.mktemp("contracts")
    shutil.copytree(CONTRACTS_DIR, directory, dirs_exist_ok=True)
    _write_version(directory, "0.9.0", "sunsetted", "2026-01-01", "cancel_order@1.0.0")
    _write_version(directory, "0.10.0", "deprecated", "2027-06-30", "cancel_order@1.1.0")
    _write_version(directory, "1.1.0", "active")
    _write_version(directory, "2.0.0", "deprecated", None, None)
    return load_contracts(directory)


def proposal(name: str | None, version: str | None = None, **fields: Any) -> Proposal:
    return Proposal("prop-1", "run-1", "tenant-1", None, name, version, {}, **fields)


def refused(p: Proposal, contracts: ContractSet) -> Rejection:
    result = resolve_tool(p, contracts, NOW_MS)  # before every sunset date written here
    assert isinstance(result, Rejection), result
    assert result.taxonomy is TaxonomyClass.STRUCTURAL_VIOLATION
    assert result.gate is Gate.RESOLVE
    assert len(result.errors) == 1
    assert result.errors[0].field == "tool/name"
    return result


def resolved(p: Proposal, contracts: ContractSet) -> Contract:
    result = resolve_tool(p, contracts, NOW_MS)  # before every sunset date written here
    assert isinstance(result, Contract), result
    return result


def test_versions_are_sorted_newest_first_numerically(versioned: ContractSet) -> None:
    assert [c.version for c in versioned.versions("cancel_order")] == [
        "2.0.0",
        "1.1.0",
        "1.0.0",
        "0.10.0",
        "0.9.0",
    ]


def test_known_tool_resolves(contracts: ContractSet) -> None:
    c = resolved(proposal("lookup_order"), contracts)
    assert (c.name, c.version) == ("lookup_order", "1.0.0")


def test_unknown_tool_suggests_the_close_name_and_lists_the_tools(contracts: ContractSet) -> None:
    r = refused(proposal("cancel_ordr"), contracts)
    assert r.errors[0].code == "unknown_tool"
    assert r.errors[0].message == "there is no tool named 'cancel_ordr'"
    assert r.allowed_tools == ALL_TOOLS
    assert r.next_action == (
        "did you mean cancel_order? Call one of the available tools: " + ", ".join(ALL_TOOLS) + "."
    )


def test_a_credential_named_as_the_tool_is_not_quoted_back(contracts: ContractSet) -> None:
    r = refused(proposal("sk_live_4eC39HqLyjWDarjtT1zdp7dc"), contracts)
    assert r.errors[0].message == "there is no tool named 'sk_l…'"


def test_unrelated_unknown_tool_has_no_suggestion(contracts: ContractSet) -> None:
    r = refused(proposal("delete_everything"), contracts)
    assert r.errors[0].code == "unknown_tool"
    assert "did you mean" not in r.next_action
    assert r.next_action == "Call one of the available tools: " + ", ".join(ALL_TOOLS) + "."


def test_lookalike_unicode_name_is_unknown(contracts: ContractSet) -> None:
    lookalike = "c\u0430ncel_order"  # Cyrillic small a
    assert lookalike != "cancel_order"
    r = refused(proposal(lookalike), contracts)
    assert r.errors[0].code == "unknown_tool"
    assert repr(lookalike) in r.errors[0].message
    assert r.allowed_tools == ALL_TOOLS


@pytest.mark.parametrize("name", ["Cancel_Order", "cancel_order ", "cancel_order\u200b", ""])
def test_names_are_compared_exactly(name: str, contracts: ContractSet) -> None:
    assert refused(proposal(name), contracts).errors[0].code == "unknown_tool"


def test_missing_tool_name_is_unknown(contracts: ContractSet) -> None:
    assert refused(proposal(None), contracts).errors[0].code == "unknown_tool"


def test_tool_outside_active_tools(contracts: ContractSet) -> None:
    p = proposal("cancel_order", active_tools=("lookup_order", "search_kb", "not_a_tool"))
    r = refused(p, contracts)
    assert r.errors[0].code == "tool_not_active"
    assert r.allowed_tools == ("lookup_order", "search_kb")
    assert r.next_action == (
        "cancel_order is not available at this step; call one of: lookup_order, search_kb."
    )


def test_unknown_tool_lists_only_the_active_tools(contracts: ContractSet) -> None:
    r = refused(proposal("cancel_ordr", active_tools=("lookup_order",)), contracts)
    assert r.errors[0].code == "unknown_tool"
    assert r.allowed_tools == ("lookup_order",)
    assert "did you mean" not in r.next_action


def test_tool_inside_active_tools_resolves(contracts: ContractSet) -> None:
    c = resolved(proposal("cancel_order", active_tools=("cancel_order",)), contracts)
    assert (c.name, c.version) == ("cancel_order", "1.0.0")


def test_unknown_version(versioned: ContractSet) -> None:
    r = refused(proposal("cancel_order", "3.0.0"), versioned)
    assert r.errors[0].code == "unknown_version"
    assert r.errors[0].message == (
        "cancel_order has no version 3.0.0 (known: 2.0.0, 1.1.0, 1.0.0, 0.10.0, 0.9.0)"
    )
    assert r.next_action == (
        "Propose cancel_order without a version, or with one of: "
        "2.0.0, 1.1.0, 1.0.0, 0.10.0, 0.9.0."
    )


def test_sunsetted_version_is_refused_with_its_replacement(versioned: ContractSet) -> None:
    r = refused(proposal("cancel_order", "0.9.0"), versioned)
    assert r.errors[0].code == "tool_sunsetted"
    assert r.errors[0].message == "cancel_order@0.9.0 was sunsetted on 2026-01-01"
    assert r.next_action == "cancel_order@0.9.0 no longer runs. Call cancel_order@1.0.0 instead."
    assert "cancel_order" in r.allowed_tools


def test_exact_versions_resolve(versioned: ContractSet) -> None:
    for version in ("2.0.0", "1.1.0", "1.0.0", "0.10.0"):
        c = resolved(proposal("cancel_order", version), versioned)
        assert c.version == version


def test_deprecated_version_resolves(versioned: ContractSet) -> None:
    c = resolved(proposal("cancel_order", "0.10.0"), versioned)
    assert c.version == "0.10.0"
    assert c.lifecycle.status == "deprecated"
    assert c.lifecycle.replacement == "cancel_order@1.1.0"


def test_newest_active_version_is_chosen_without_a_version(versioned: ContractSet) -> None:
    # 2.0.0 is newer but deprecated; 1.1.0 is the newest active one.
    assert resolved(proposal("cancel_order"), versioned).version == "1.1.0"
    p = proposal("cancel_order", active_tools=("cancel_order",))
    assert resolved(p, versioned).version == "1.1.0"


def test_deprecated_is_chosen_when_no_version_is_active(tmp_path: Path) -> None:
    (tmp_path / "cancel_order").mkdir()
    _write_version(tmp_path, "1.0.0", "sunsetted", "2026-01-01", None)
    _write_version(tmp_path, "1.1.0", "deprecated", "2027-01-01", None)
    contracts = load_contracts(tmp_path)
    assert resolved(proposal("cancel_order"), contracts).version == "1.1.0"


def test_fully_sunsetted_tool_is_refused_and_not_callable(tmp_path: Path) -> None:
    (tmp_path / "cancel_order").mkdir()
    shutil.copytree(CONTRACTS_DIR / "lookup_order", tmp_path / "lookup_order")
    _write_version(tmp_path, "1.0.0", "sunsetted", None, None)
    contracts = load_contracts(tmp_path)
    assert contracts.callable_names == ("lookup_order",)
    r = refused(proposal("cancel_order"), contracts)
    assert r.errors[0].code == "tool_sunsetted"
    assert r.errors[0].message == "cancel_order@1.0.0 was sunsetted"
    assert r.next_action == (
        "cancel_order@1.0.0 no longer runs. Pick another tool from the allowed list."
    )
    assert r.allowed_tools == ("lookup_order",)


def _lifecycle(d: Decision) -> tuple[str, ...]:
    """The decision's warnings, less the one every development-mode answer carries."""
    return tuple(w for w in d.warnings if w != DEVELOPMENT_WARNING)


def test_pipeline_warns_about_a_deprecated_version(versioned: ContractSet) -> None:
    env = envelope("cancel_order")
    env["tool"] = {"name": "cancel_order", "version": "0.10.0"}
    d = decide_envelope(env, versioned, 0)
    assert d.outcome is Outcome.PARKED  # through every gate; cancel_order needs approval
    assert d.contract_version == "0.10.0"
    assert _lifecycle(d) == (
        "cancel_order@0.10.0 is deprecated and will be sunsetted on 2027-06-30; "
        "move to cancel_order@1.1.0",
    )


def test_pipeline_rejects_a_sunsetted_version(versioned: ContractSet) -> None:
    env = envelope("cancel_order")
    env["tool"] = {"name": "cancel_order", "version": "0.9.0"}
    d = decide_envelope(env, versioned, 0)
    assert d.outcome is Outcome.REJECTED
    assert d.gate is Gate.RESOLVE
    assert d.taxonomy is TaxonomyClass.STRUCTURAL_VIOLATION
    assert d.call is None
    assert d.contract_name is None


def test_pipeline_warning_without_sunset_date_or_replacement(versioned: ContractSet) -> None:
    env = envelope("cancel_order")
    env["tool"] = {"name": "cancel_order", "version": "2.0.0"}
    d = decide_envelope(env, versioned, 0)
    assert d.outcome is Outcome.PARKED  # through every gate; cancel_order needs approval
    assert _lifecycle(d) == ("cancel_order@2.0.0 is deprecated and will be sunsetted",)


def test_pipeline_active_version_has_no_warning(versioned: ContractSet) -> None:
    d = decide_envelope(envelope("cancel_order"), versioned, 0)
    assert d.outcome is Outcome.PARKED  # through every gate; cancel_order needs approval
    assert d.contract_version == "1.1.0"
    assert _lifecycle(d) == ()


def test_a_deprecated_version_is_sunsetted_from_its_sunset_date(contracts: ContractSet) -> None:
    """charge_customer_card_v2@2.0.0 is deprecated, to be sunsetted on 2027-03-31: pinned,
    it runs until that day and is refused from it on, its contract unedited."""
    pinned = proposal("charge_customer_card_v2", "2.0.0")
    before = resolve_tool(pinned, contracts, 1_806_451_199_000)  # 2027-03-30T23:59:59Z
    assert isinstance(before, Contract) and before.version == "2.0.0"
    for now_ms in (1_806_451_200_000, 1_830_000_000_000):  # 2027-03-31, 2027-12-28
        after = resolve_tool(pinned, contracts, now_ms)
        assert isinstance(after, Rejection)
        assert after.errors[0].code == "tool_sunsetted"
        assert "charge_customer_card_v2@2.1.0" in after.next_action
    latest = resolve_tool(proposal("charge_customer_card_v2"), contracts, 1_830_000_000_000)
    assert isinstance(latest, Contract) and latest.version == "2.1.0"


def test_a_version_that_is_a_credential_is_not_quoted_back(versioned: ContractSet) -> None:
    """The resolve gate answers before the credential scan: a version no contract has is
    the model's own text, redacted as the scan would."""
    r = refused(proposal("cancel_order", "AKIAIOSFODNN7EXAMPLE"), versioned)
    assert r.errors[0].code == "unknown_version"
    assert "AKIAIOSFODNN7EXAMPLE" not in r.errors[0].message
    assert "no version AKIA\u2026 (known:" in r.errors[0].message
