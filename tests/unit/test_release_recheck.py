"""A parked call released by its approvers is checked again against the world: the gates
that depend on reference data, policy and the contract's lifecycle run once more, so an
approval given for the world as it was does not run a call the world no longer allows."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import orjson

from processor.approval_flow import parked_entry, recheck_release, release_keys
from processor.contracts.registry import ContractSet
from processor.gates.semantic import RefEntry
from processor.model import Outcome, SideEffectClass, TaxonomyClass
from processor.policy import Policy, TenantPolicy
from tests.unit.helpers import NOW_MS, decide_envelope, envelope, existing_references, gates


def _parked(contracts: ContractSet) -> tuple[dict[str, Any], Any]:
    env = envelope("cancel_order")
    d = decide_envelope(env, contracts)
    assert d.outcome is Outcome.PARKED, d.rejection
    return parked_entry(d), existing_references(env, contracts)


def test_a_call_the_world_still_allows_is_released(contracts: ContractSet) -> None:
    entry, answers = _parked(contracts)
    g = gates(contracts)
    assert set(release_keys(entry, g, NOW_MS)) == set(answers)
    assert recheck_release(entry, g, answers, NOW_MS) is None


def test_an_order_that_moved_on_is_stale(contracts: ContractSet) -> None:
    entry, answers = _parked(contracts)
    shipped = {k: replace(v, state="shipped") for k, v in answers.items() if v is not None}
    refusal = recheck_release(entry, gates(contracts), shipped, NOW_MS)
    assert refusal is not None and refusal.taxonomy is TaxonomyClass.STALE_STATE


def test_an_order_that_is_gone_is_unknown(contracts: ContractSet) -> None:
    entry, answers = _parked(contracts)
    gone = dict.fromkeys(answers)
    refusal = recheck_release(entry, gates(contracts), gone, NOW_MS)
    assert refusal is not None and refusal.taxonomy is TaxonomyClass.SEMANTIC_INVALIDITY


def test_a_class_the_tenant_lost_meanwhile_is_refused(contracts: ContractSet) -> None:
    entry, answers = _parked(contracts)
    policy = Policy(tenants={"tenant-1": TenantPolicy(frozenset({SideEffectClass.READ_ONLY}))})
    refusal = recheck_release(entry, gates(contracts, policy=policy), answers, NOW_MS)
    assert refusal is not None and refusal.taxonomy is TaxonomyClass.POLICY_VIOLATION


def test_a_contract_version_no_longer_loaded_is_refused(contracts: ContractSet) -> None:
    entry, answers = _parked(contracts)
    refusal = recheck_release({**entry, "tool_version": "9.9.9"}, gates(contracts), answers,
                              NOW_MS)  # fmt: skip
    assert refusal is not None and refusal.gate.value == "resolve"


def test_an_entry_parked_by_an_earlier_version_is_still_checked(contracts: ContractSet) -> None:
    """Without the principal's scopes (not kept then), the references and policy still are."""
    entry, answers = _parked(contracts)
    old = {k: v for k, v in entry.items() if k not in ("scopes", "clearance")}
    assert recheck_release(old, gates(contracts), answers, NOW_MS) is None
    shipped = {k: RefEntry(v.tenant_id, "shipped", v.owner, {}) for k, v in answers.items() if v}
    refusal = recheck_release(old, gates(contracts), shipped, NOW_MS)
    assert refusal is not None and refusal.taxonomy is TaxonomyClass.STALE_STATE


def test_arguments_a_version_edited_in_place_no_longer_accepts_are_refused(
    contracts: ContractSet,
) -> None:
    """The version was reloaded under the same number with a stricter schema while the
    call waited (here: arguments it no longer accepts): refused as a fresh proposal's would
    be, before any rule reads them."""
    entry, answers = _parked(contracts)
    args = {**orjson.loads(entry["arguments"]), "reason_code": "no_longer_listed"}
    refusal = recheck_release({**entry, "arguments": orjson.dumps(args).decode()},
                              gates(contracts), answers, NOW_MS)  # fmt: skip
    assert refusal is not None and refusal.gate.value == "schema"
    assert refusal.taxonomy is TaxonomyClass.OUT_OF_BOUNDS
