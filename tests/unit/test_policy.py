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


def test_egress_entries_are_normalised_and_may_name_a_port() -> None:
    policy = parse_policy({
        "egress": {"allowed_domains": ["*.Docs.Example.com.", "status.example.com:08443",
                                       "bücher.de", "shop.example.co.uk"],
                   "internal_domains": ["orders.corp.internal:8080", "corp.internal"]},
    })  # fmt: skip
    assert policy.allowed_domains == (
        "docs.example.com", "status.example.com:8443", "xn--bcher-kva.de", "shop.example.co.uk"
    )  # fmt: skip
    assert policy.internal_domains == ("orders.corp.internal:8080", "corp.internal")


@pytest.mark.parametrize(
    ("entry", "why"),
    [
        ("com", "single label"),
        ("*.com", "single label"),
        ("internal", "single label"),
        ("co.uk", "public suffix"),
        ("*.com.au", "public suffix"),
        ("gov.br", "public suffix"),
        ("github.io", "public suffix"),
        ("herokuapp.com", "public suffix"),
        ("https://docs.example.com", "not a host name"),
        ("docs.example.com/path", "not a host name"),
        ("user@docs.example.com", "not a host name"),
        ("[::1]", "not a host name"),
        ("docs.example.com:0", "bad port"),
        ("docs.example.com:65536", "bad port"),
        ("docs.example.com:ssh", "bad port"),
        ("docs.example.com:", "bad port"),
        ("10.0.0.1", "IP address"),
        ("exa_mple.com", "not a valid host name"),
        ("docs..example.com", "not a valid host name"),
        ("*", "not a valid host name"),
        ("ex\u0430mple.com", "not a valid host name"),
        ("", "empty"),
        (".", "empty"),
        (None, "not a string"),
        (443, "not a string"),
    ],
)
@pytest.mark.parametrize("where", ["egress.allowed_domains", "egress.internal_domains",
                                   "tenants.acme.allowed_domains"])  # fmt: skip
def test_an_egress_entry_that_is_no_host_of_ours_is_refused_by_name(
    entry: Any, why: str, where: str
) -> None:
    """``com`` (or ``co.uk``, ``github.io``) would allow every stranger's host under it;
    an entry egress cannot read would otherwise be dropped without a word."""
    section, *rest = where.split(".")
    doc: dict[str, Any] = {section: {}}
    node = doc[section]
    for name in rest[:-1]:
        node = node.setdefault(name, {})
    node[rest[-1]] = ["docs.example.com", entry]
    with pytest.raises(PolicyError) as info:
        parse_policy(doc)
    message = str(info.value)
    assert f"{where}: entry {entry!r} " in message and why in message, message


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
