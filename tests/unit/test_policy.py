"""Reading the policy: a misspelt or misshapen section is refused, never read as the
defaults (which allow every class)."""

from __future__ import annotations

from typing import Any

import pytest

from processor.model import SideEffectClass
from processor.policy import PolicyError, parse_policy


def test_tenant_entries_egress_and_secrets_are_read() -> None:
    policy = parse_policy({
        "tenants": {
            "*": {"allowed_classes": ["READ_ONLY"]},
            "acme": {"allowed_classes": ["READ_ONLY", "LOW_RISK_INTERNAL"],
                     "allowed_domains": ["Docs.Example.com."]},
        },
        "egress": {"allowed_domains": ["status.example.com"], "internal_domains": None},
        "secrets": {"enabled": False},
    })  # fmt: skip
    assert policy.for_tenant("other").allowed_classes == {SideEffectClass.READ_ONLY}
    acme = policy.for_tenant("acme")
    assert acme.allowed_classes == {SideEffectClass.READ_ONLY, SideEffectClass.LOW_RISK_INTERNAL}
    assert acme.allowed_domains == ("docs.example.com",)
    assert policy.allowed_domains == ("status.example.com",) and policy.internal_domains == ()
    assert policy.secrets_enabled is False
    assert parse_policy({"tenants": None, "egress": None, "secrets": None}) == parse_policy({})


@pytest.mark.parametrize(
    ("doc", "where"),
    [
        ({"tenants": {"*": {"allowed-classes": ["READ_ONLY"]}}}, r"tenants\.\*"),
        ({"tenants": {"acme": {"allowedClasses": ["READ_ONLY"]}}}, "tenants.acme"),
        ({"tenants": {"acme": {"allowed_class": ["READ_ONLY"]}}}, "tenants.acme"),
        ({"egress": {"allowed_domain": ["docs.example.com"]}}, "egress"),
        ({"secrets": {"enable": False}}, "secrets"),
    ],
)
def test_a_misspelt_key_is_refused(doc: dict[str, Any], where: str) -> None:
    with pytest.raises(PolicyError, match=f"{where}: unknown keys"):
        parse_policy(doc)


@pytest.mark.parametrize(
    "doc",
    [
        {"secrets": True},
        {"secrets": False},
        {"egress": ["docs.example.com"]},
        {"tenants": ["acme"]},
        {"tenants": {"acme": ["READ_ONLY"]}},
        {"tenants": {"acme": None}},
        {"budgets": ["steps"]},
        {"budgets": {"classes": ["read"]}},
        {"secrets": {"enabled": None}},  # `enabled:` with nothing after it
        {"secrets": {"enabled": "no"}},
        {"secrets": {"enabled": 0}},
    ],
)
def test_a_section_not_a_mapping_or_a_switch_not_a_bool_is_refused(doc: dict[str, Any]) -> None:
    with pytest.raises(PolicyError):
        parse_policy(doc)
