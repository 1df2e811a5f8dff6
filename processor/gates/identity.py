"""Gate: identity and scope. ``PERMISSION_DENIED``, fail closed.

Runs right after the schema gate, before anything that reads reference data:
a caller whose identity is not proven learns nothing about which ids exist.
"""

from __future__ import annotations

from processor.contracts.registry import Contract
from processor.identity import Verifier
from processor.model import FieldError, Gate, Principal, Proposal, Rejection, TaxonomyClass

_TOKEN_ACTION = (
    "The call's identity could not be verified ({reason}); nothing ran. The model cannot "
    "repair this: the runtime must obtain a fresh principal token and propose again."
)


def _deny(error: FieldError, next_action: str) -> Rejection:
    return Rejection(TaxonomyClass.PERMISSION_DENIED, Gate.IDENTITY, (error,), next_action)


def verified_principal(p: Proposal, verifier: Verifier, now_s: float) -> Principal | None:
    """The proposal's principal when its token verifies for its tenant, else None.

    For proposals refused before the identity gate: their run's budgets count them,
    but only under a tenant their token proves."""
    if verifier.development:
        return verifier.development_principal(p.tenant_id)
    verified = verifier.verify(p.principal_token, now_s)
    if isinstance(verified, FieldError) or verified.tenant_id != p.tenant_id:
        return None
    return verified


def check_identity(
    p: Proposal, contract: Contract, verifier: Verifier, now_s: float
) -> Principal | Rejection:
    if verifier.development:
        principal = verifier.development_principal(p.tenant_id)
    else:
        verified = verifier.verify(p.principal_token, now_s)
        if isinstance(verified, FieldError):
            return _deny(verified, _TOKEN_ACTION.format(reason=verified.message))
        principal = verified
    if p.tenant_id != principal.tenant_id:
        return _deny(
            FieldError(
                "tenant_id",
                "the proposal's tenant is not the tenant of its principal token",
                "tenant_mismatch",
                expected=principal.tenant_id,
                actual=p.tenant_id,
            ),
            "Do not retry: a proposal may only act for the tenant its token names.",
        )
    if "*" not in principal.scopes:
        missing = [s for s in contract.required_scopes if s not in principal.scopes]
        if missing:
            return _deny(
                FieldError(
                    "principal_token",
                    f"{contract.name} needs scope(s) {', '.join(missing)}",
                    "scope_missing",
                    expected=" ".join(contract.required_scopes),
                    actual=" ".join(sorted(principal.scopes)),
                ),
                f"This agent may not call {contract.name} (missing {', '.join(missing)}). "
                "Do not retry; tell the user this action is not available here, or call "
                "handoff_to_human.",
            )
    return principal
