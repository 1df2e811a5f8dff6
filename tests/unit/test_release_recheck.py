"""A parked call released by its approvers is checked again against the world: the gates
that depend on reference data, policy and the contract's lifecycle run once more, so an
approval given for the world as it was does not run a call the world no longer allows."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import orjson
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from processor.approval_flow import parked_entry, recheck_release, refused_release, release_keys
from processor.config import IdentitySettings
from processor.contracts.registry import ContractSet
from processor.gates.semantic import RefEntry
from processor.identity import VerificationKey, Verifier
from processor.model import Gate, Outcome, SideEffectClass, SourceRecord, TaxonomyClass
from processor.pipeline import Gates
from processor.policy import Policy, TenantPolicy
from tests.unit.helpers import (
    LIMITS,
    NOW_MS,
    decide_envelope,
    envelope,
    existing_references,
    gates,
)


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


def _trusting(contracts: ContractSet, *kids: str) -> Gates:
    """Gates that verify tokens, with issuer keys of these ids."""
    keys = {k: VerificationKey(k, "EdDSA", Ed25519PrivateKey.generate().public_key()) for k in kids}
    return Gates(contracts, LIMITS, Verifier(IdentitySettings(), keys))


def test_a_call_whose_token_key_was_withdrawn_while_it_waited_does_not_run(
    contracts: ContractSet,
) -> None:
    """Parked under a token verified with issuer-1's key, released after the operator
    took that key out (it leaked, or was rotated out): refused as its token would be."""
    env = envelope("cancel_order")
    d = decide_envelope(env, contracts)
    assert d.outcome is Outcome.PARKED and d.principal is not None
    d.principal = replace(d.principal, verified=True, key_id="issuer-1")
    entry, answers = parked_entry(d), existing_references(env, contracts)
    assert recheck_release(entry, _trusting(contracts, "issuer-1", "issuer-2"), answers,
                           NOW_MS) is None  # fmt: skip
    refusal = recheck_release(entry, _trusting(contracts, "issuer-2"), answers, NOW_MS)
    assert refusal is not None and refusal.taxonomy is TaxonomyClass.PERMISSION_DENIED
    assert refusal.gate is Gate.IDENTITY
    assert [e.code for e in refusal.errors] == ["token_unknown_key"]
    src = SourceRecord("tool.approvals", 0, 7, b"run-1", b"{}", NOW_MS)
    told = refused_release(src, entry, refusal, NOW_MS).rejection
    assert told is not None and "identity is no longer proven" in told.next_action
    # Parked by an earlier version (no key kept), or in development mode: nothing to check.
    old = {k: v for k, v in entry.items() if k != "key_id"}
    assert recheck_release(old, _trusting(contracts, "issuer-2"), answers, NOW_MS) is None
    assert recheck_release(entry, gates(contracts), answers, NOW_MS) is None
