"""Gates on meaning: references, cross-field rules, tenancy of ids, entity state.

JSON Schema says ``WO-12345-A`` looks like an order id; only the reference
data says whether that order exists, belongs to this tenant and may still be
cancelled. The data comes from ``tool.reference`` (materialised in Redis,
fetched once per batch); these functions only read the fetched values, so
they stay pure.

Outcomes, in order:

- an id that exists nowhere: ``SEMANTIC_INVALIDITY``, and ``next_action``
  names the lookup tool: the model invented or misremembered it;
- a rule of the contract is false: ``SEMANTIC_INVALIDITY`` naming the rule;
- an id of another tenant: ``PERMISSION_DENIED``;
- an entity in a state the action does not allow: ``STALE_STATE``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from processor.contracts.registry import Contract, Reference
from processor.model import FieldError, Gate, Principal, Proposal, Rejection, TaxonomyClass

RefKey = tuple[str, str, str]
"""(tenant, entity, id): one entity in ``tool.reference``."""


@dataclass(frozen=True, slots=True)
class RefEntry:
    tenant_id: str
    state: str
    owner: str | None
    attributes: dict[str, Any]

    def as_cel(self) -> dict[str, Any]:
        return {
            "tenant_id": self.tenant_id,
            "state": self.state,
            "owner": self.owner or "",
            "attributes": self.attributes,
        }


FOREIGN = RefEntry("", "", None, {})
"""The lookup's answer for an id that exists, but only under other tenants."""

RefAnswers = Mapping[RefKey, RefEntry | None]


def reference_keys(p: Proposal, contract: Contract, tenant_id: str) -> list[RefKey]:
    out: list[RefKey] = []
    args = p.arguments
    for ref in contract.references:
        value = args.get(ref.argument) if isinstance(args, dict) else None
        if isinstance(value, str):
            out.append((tenant_id, ref.entity, value))
    return out


Resolved = list[tuple[Reference, str, RefEntry | None]]
"""Each reference the call makes: the contract's declaration, the id, the entity found."""


def resolve_references(
    p: Proposal, contract: Contract, tenant_id: str, answers: RefAnswers
) -> Resolved:
    out: Resolved = []
    args = p.arguments
    for ref in contract.references:
        value = args.get(ref.argument) if isinstance(args, dict) else None
        if isinstance(value, str):
            out.append((ref, value, answers.get((tenant_id, ref.entity, value))))
    return out


def _article(word: str) -> str:
    return "an" if word[:1] in "aeiou" else "a"


def check_semantics(
    p: Proposal, contract: Contract, principal: Principal, resolved: Resolved
) -> Rejection | None:
    unknown = [
        FieldError(
            ref.argument,
            f"no {ref.entity} {value!r} exists",
            "unknown_reference",
            hint=f"call {ref.lookup_tool}",
        )
        for ref, value, entry in resolved
        if entry is None
    ]
    if unknown:
        first = next(ref for ref, _, entry in resolved if entry is None)
        return Rejection(
            TaxonomyClass.SEMANTIC_INVALIDITY,
            Gate.SEMANTIC,
            tuple(unknown),
            f"{first.argument} names no existing {first.entity}: call {first.lookup_tool} to "
            f"get the {first.entity}'s id; never construct {_article(first.entity)} "
            f"{first.entity} id.",
        )
    if contract.rules:
        refs = {
            ref.argument: entry.as_cel()
            for ref, _, entry in resolved
            if entry is not None and entry is not FOREIGN
        }
        context = {"args": p.arguments, "principal": principal.as_cel(), "refs": refs}
        failed: list[tuple[str, str, str]] = []
        for rule in contract.rules:
            try:
                ok = rule.program.execute(context)
            except Exception:
                if len(refs) < len(resolved):
                    continue  # reads another tenant's entity: refused just below instead
                ok = False
            if ok is not True:
                failed.append((rule.rule_id, rule.message, rule.next_action))
        if failed:
            return Rejection(
                TaxonomyClass.SEMANTIC_INVALIDITY,
                Gate.SEMANTIC,
                tuple(
                    FieldError(None, f"rule {rid}: {message}", "rule_failed", expected=rid)
                    for rid, message, _ in failed
                ),
                failed[0][2],
            )
    foreign = [
        FieldError(
            ref.argument,
            f"{ref.entity} {value!r} does not belong to tenant {principal.tenant_id}",
            "cross_tenant_reference",
        )
        for ref, value, entry in resolved
        if entry is FOREIGN
    ]
    if foreign:
        return Rejection(
            TaxonomyClass.PERMISSION_DENIED,
            Gate.IDENTITY,
            tuple(foreign),
            "Do not retry: the call names another tenant's data. Use only ids returned by "
            "this tenant's lookups.",
        )
    return None


def check_state(contract: Contract, resolved: Resolved) -> Rejection | None:
    stale = [
        (ref, value, entry)
        for ref, value, entry in resolved
        if entry is not None and entry.state not in ref.allowed_states
    ]
    if not stale:
        return None
    ref, value, entry = stale[0]
    assert entry is not None
    return Rejection(
        TaxonomyClass.STALE_STATE,
        Gate.STATE,
        tuple(
            FieldError(
                r.argument,
                f"{r.entity} {v} is {e.state}; {contract.name} needs it "
                f"{' or '.join(r.allowed_states)}",
                "invalid_state",
                expected=", ".join(r.allowed_states),
                actual=e.state,
            )
            for r, v, e in stale
            if e is not None
        ),
        f"{ref.entity} {value} is already {entry.state}, so {contract.name} cannot run. Call "
        f"{ref.lookup_tool} to refresh what you know, then tell the user the {ref.entity}'s "
        "actual state instead of retrying.",
    )


def before_state(resolved: Resolved) -> str:
    """The referenced entities' current states, for a confirmation packet."""
    parts = [
        f"{ref.entity} {value} is {entry.state}"
        for ref, value, entry in resolved
        if entry is not None and entry is not FOREIGN
    ]
    return "; ".join(parts)
