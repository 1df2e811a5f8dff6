"""Gate: identity and scope. ``PERMISSION_DENIED``, fail closed.

Decides right after the schema gate, before anything that reads reference data: a
caller whose identity is not proven learns nothing about which ids exist. ``identify``
verifies the token once per proposal, as soon as it parses; ``check_scopes`` then holds
it against the contract.
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


def _bound_to(principal: Principal | None, p: Proposal) -> bool:
    """Whether a delegation token's principal is that of this very proposal."""
    return (
        principal is not None
        and principal.tenant_id == p.tenant_id
        and principal.delegated_for == (p.idempotency_key, p.proposal_id, p.run_id)
    )


def _misused() -> Rejection:
    return _deny(
        FieldError(
            "principal_token", "the token was issued for another call", "delegation_misused"
        ),
        "Do not retry: a token the processor issued is good for its own call only.",
    )


def identify(p: Proposal, verifier: Verifier, now_s: float) -> Principal | Rejection:
    """Who is asking: the token's principal, which must be of the proposal's tenant.

    Worked out once per proposal, as soon as it parses: the identity gate uses it, and
    a proposal refused before that gate is still a step of its run, counted only under
    a tenant its token proves."""
    if verifier.development:
        principal = verifier.development_principal(p.tenant_id)
    else:
        verified = verifier.verify(p.principal_token, now_s)
        if isinstance(verified, FieldError):
            # An expired delegation token counts as the processor's own compensation
            # failing (see results.refused_compensation) only on the proposal it was
            # signed for: copied onto another, it is misused, expired or not.
            bound = verifier.delegation_of(p.principal_token)
            if verified.code == "delegation_expired" and not _bound_to(bound, p):
                return _misused()
            return _deny(verified, _TOKEN_ACTION.format(reason=verified.message))
        principal = verified
    if principal.delegated_for is not None and not _bound_to(principal, p):
        return _misused()
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
    return principal


def check_signing_key(key_id: str | None, verifier: Verifier) -> Rejection | None:
    """A parked call's principal again, when its approvers release it: the key its token
    was verified with must still be trusted. An operator who takes an issuer's key out of
    the keys files (it leaked, it was rotated out) revokes the calls parked under its
    tokens too; they would otherwise run on the approvers' word for an identity nothing
    proves any more. (``None``: parked by an earlier version, or a delegation token.)"""
    if key_id is None or verifier.development or key_id in verifier.keys:
        return None
    return _deny(
        FieldError(
            "principal_token",
            f"the key {key_id!r} the call's token was signed with is no longer trusted",
            "token_unknown_key",
        ),
        _TOKEN_ACTION.format(reason="its signing key was withdrawn while it waited"),
    )


def check_scopes(p: Proposal, contract: Contract, principal: Principal) -> Rejection | None:
    """The contract's ``required_scopes`` against the verified principal's. Only
    development mode's unverified principal holds every scope: a token's ``*`` is a
    scope like any other, named by no contract."""
    if not principal.verified and "*" in principal.scopes:
        return None
    missing = [s for s in contract.required_scopes if s not in principal.scopes]
    if not missing:
        return None
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
