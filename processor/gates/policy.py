"""Gate: policy. ``POLICY_VIOLATION``, fail closed.

Reports every violation it finds in one answer: the side-effect classes the
tenant may use, the data classification against the principal's clearance,
and the egress policy for arguments that are URLs. Lifecycle policy
(deprecated versions warn, sunsetted ones are refused) is applied where the
version is resolved.

Secrets and credentials in the arguments (keys included) are the one policy
checked *early*, right after the tool is resolved and before the schema
gate: every later gate's answer may quote the arguments back (an unknown
field's name, a value that breaks a pattern), and a credential must never
travel on in an observation, however the call is otherwise wrong.
"""

from __future__ import annotations

from processor.contracts.registry import Contract
from processor.gates.policy_scan import egress_violation, find_secrets, find_urls
from processor.model import (
    CLEARANCE_LEVELS,
    FieldError,
    Gate,
    Principal,
    Proposal,
    Rejection,
    TaxonomyClass,
)
from processor.policy import Policy


def check_secrets(p: Proposal, policy: Policy) -> Rejection | None:
    if not policy.secrets_enabled:
        return None
    findings = find_secrets(p.arguments)
    if not findings:
        return None
    return Rejection(
        TaxonomyClass.POLICY_VIOLATION,
        Gate.POLICY,
        tuple(
            FieldError(
                f.path,
                f"the arguments carry a credential ({f.kind}, in a "
                f"{'key' if f.in_key else 'value'}); it is not repeated here",
                "secret_in_arguments",
            )
            for f in findings
        ),
        "Never put credentials in tool arguments: the platform injects them. Propose the "
        "call again without the secret, and do not repeat it to the user.",
    )


def check_policy(
    p: Proposal, contract: Contract, principal: Principal, policy: Policy
) -> Rejection | None:
    errors: list[FieldError] = []
    actions: list[str] = []
    tenant = policy.for_tenant(principal.tenant_id)
    cls = contract.side_effect_class
    if cls not in tenant.allowed_classes:
        errors.append(
            FieldError(
                None,
                f"tenant {principal.tenant_id} may not run {cls.value} tools",
                "class_not_allowed",
                expected=" ".join(sorted(c.value for c in tenant.allowed_classes)),
                actual=cls.value,
            )
        )
        actions.append(f"{contract.name} is not available to this tenant; call handoff_to_human.")
    needed = contract.data_classification
    if CLEARANCE_LEVELS.index(needed) > principal.clearance_rank:
        errors.append(
            FieldError(
                None,
                f"{contract.name} touches {needed} data; the principal is cleared for "
                f"{principal.clearance}",
                "clearance_insufficient",
                expected=needed,
                actual=principal.clearance,
            )
        )
        actions.append("This data is above the principal's clearance; call handoff_to_human.")
    domains = policy.allowed_domains + tenant.allowed_domains
    for path, url in find_urls(p.arguments):
        reason = egress_violation(url, contract.egress_policy, domains, policy.internal_domains)
        if reason is not None:
            errors.append(FieldError(path, f"egress refused: {reason}", "egress_denied"))
            actions.append(
                "Use a URL on an allowed domain"
                + (f" ({', '.join(domains)})" if domains else "")
                + ", or tell the user this address cannot be reached."
            )
    if not errors:
        return None
    return Rejection(
        TaxonomyClass.POLICY_VIOLATION, Gate.POLICY, tuple(errors), " ".join(dict.fromkeys(actions))
    )
