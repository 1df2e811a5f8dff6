"""The processor's own tokens for the compensating calls it proposes: signed with its
delegation key, in the original caller's name, good for one idempotency key only, and
never a caller's token kept at rest. Pure: keys in a temp dir, no broker, no Redis."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import jwt
import orjson
import pytest

from processor.config import IdentitySettings
from processor.contracts.registry import ContractSet
from processor.gates.identity import identify
from processor.gates.parse import Limits, parse_proposal
from processor.identity import (
    DELEGATION_ISSUER,
    Delegator,
    KeyError_,
    TokenIssuer,
    Verifier,
    generate_ed25519_jwk,
    grant_of,
)
from processor.keys import init_keys
from processor.model import FieldError, Principal, Proposal, Rejection, TaxonomyClass
from processor.results import (
    compensation_key,
    compensation_plan,
    compensation_proposal,
    compensation_proposal_id,
    settle_item,
    unsigned_compensation,
    wants_compensation,
)
from tests.unit.helpers import envelope, record
from tests.unit.test_results import KEY, _charge_result

TENANT = "tenant-1"
COMP_KEY = compensation_key(KEY)
COMP_ID = compensation_proposal_id(KEY)
BINDING = (COMP_KEY, COMP_ID, "run-1")


@pytest.fixture
def keys(tmp_path: Path) -> Any:
    return init_keys(tmp_path / "keys")


@pytest.fixture
def verifier(keys: Any) -> Verifier:
    return Verifier.from_settings(
        IdentitySettings(jwks_file=keys.jwks, delegation_key_file=keys.delegation)
    )


def _caller(keys: Any, **kw: Any) -> str:
    issuer = TokenIssuer.from_jwk_file(keys.issuer)
    return issuer.mint(TENANT, "user-7", "agent-3", ["orders:refund", "orders:read"], **kw)


def _proposal(key: str | None, token: str, **fields: Any) -> Proposal:
    env = envelope("refund_order", **{"principal_token": token, "proposal_id": COMP_ID, **fields})
    if key:
        env["idempotency_key"] = key
    parsed = parse_proposal(record(orjson.dumps(env)), Limits())
    assert isinstance(parsed, tuple) and parsed[1] is None, parsed
    return parsed[0]


def _grant(verifier: Verifier, keys: Any) -> str:
    principal = verifier.verify(_caller(keys))
    assert isinstance(principal, Principal), principal
    return grant_of(principal)


def test_a_delegation_token_acts_for_the_caller_under_one_key(
    verifier: Verifier, keys: Any
) -> None:
    assert verifier.delegator is not None
    token = verifier.delegator.mint(TENANT, _grant(verifier, keys), *BINDING)
    assert token is not None
    claims = jwt.decode(token, options={"verify_signature": False})
    assert claims["act"] == {"sub": DELEGATION_ISSUER} and claims["iss"] == DELEGATION_ISSUER
    assert (claims["idempotency_key"], claims["proposal_id"], claims["run_id"]) == BINDING
    assert claims["exp"] - claims["iat"] == 900

    got = verifier.verify(token)
    assert isinstance(got, Principal), got
    assert (got.tenant_id, got.user_id, got.agent_id) == (TENANT, "user-7", "agent-3")
    assert got.scopes == {"orders:refund", "orders:read"}
    assert got.delegated_for == BINDING

    assert identify(_proposal(COMP_KEY, token), verifier, time.time()) == got
    elsewhere = [
        _proposal("k-something-else", token),
        _proposal(None, token),
        _proposal(COMP_KEY, token, proposal_id="p-other"),
        _proposal(COMP_KEY, token, run_id="run-other"),
        _proposal(COMP_KEY, token, tenant_id="tenant-2"),
    ]
    for p in elsewhere:
        refused = identify(p, verifier, time.time())
        assert isinstance(refused, Rejection)
        assert refused.taxonomy is TaxonomyClass.PERMISSION_DENIED
        assert [e.code for e in refused.errors] == ["delegation_misused"]


def test_a_grant_is_claims_not_a_credential(verifier: Verifier, keys: Any) -> None:
    token = _caller(keys)
    grant = _grant(verifier, keys)
    assert token not in grant and "." not in grant.replace("orders:", "")
    assert orjson.loads(grant) == {
        "sub": "user-7", "agent_id": "agent-3", "scope": "orders:read orders:refund",
        "clearance": "internal",
    }  # fmt: skip
    development = Verifier(IdentitySettings(mode="development"), {})
    assert grant_of(development.development_principal(TENANT)) == ""


def test_an_expired_delegation_token_says_so(verifier: Verifier, keys: Any) -> None:
    assert verifier.delegator is not None
    old = time.time() - 7200
    token = verifier.delegator.mint(TENANT, _grant(verifier, keys), *BINDING, now=old)
    assert token is not None
    for _ in range(2):  # first verified, then from the cache
        got = verifier.verify(token)
        assert isinstance(got, FieldError) and got.code == "delegation_expired"
    fresh = verifier.delegator.mint(TENANT, _grant(verifier, keys), *BINDING)
    assert isinstance(verifier.verify(fresh), Principal)
    assert isinstance(verifier.verify(fresh, now=time.time() + 3600), FieldError)
    # Expired, it is the processor's failed compensation only on its own proposal: copied
    # onto another (a key, a tenant anyone can name), it is misused.
    now = time.time()
    own = identify(_proposal(COMP_KEY, token), verifier, now)
    assert isinstance(own, Rejection) and [e.code for e in own.errors] == ["delegation_expired"]
    for p in (_proposal("compensate:k-other", token), _proposal(COMP_KEY, token, tenant_id="t2")):
        moved = identify(p, verifier, now)
        assert isinstance(moved, Rejection)
        assert [e.code for e in moved.errors] == ["delegation_misused"]


def test_the_delegation_key_signs_only_delegation_tokens(verifier: Verifier, keys: Any) -> None:
    """Signed with the delegation key but without its claims: refused. An issuer's token
    that copies the claims is an ordinary principal, good for nothing more."""
    assert verifier.delegator is not None
    raw = verifier.delegator.issuer
    bare = raw.mint(TENANT, "user-7", "agent-3", ["orders:refund"])
    binding = dict(zip(("idempotency_key", "proposal_id", "run_id"), BINDING, strict=True))
    no_act = raw.mint(TENANT, "u", "a", iss=DELEGATION_ISSUER, **binding)
    no_key = raw.mint(TENANT, "u", "a", iss=DELEGATION_ISSUER, act={"sub": DELEGATION_ISSUER})
    no_run = raw.mint(TENANT, "u", "a", iss=DELEGATION_ISSUER, act={"sub": DELEGATION_ISSUER},
                      idempotency_key=COMP_KEY, proposal_id=COMP_ID)  # fmt: skip
    wrong_act = raw.mint(TENANT, "u", "a", iss=DELEGATION_ISSUER, act={"sub": "x"}, **binding)
    for token in (bare, no_act, no_key, no_run, wrong_act):
        got = verifier.verify(token)
        assert isinstance(got, FieldError), token
        assert got.code in ("token_claims_invalid", "token_wrong_audience"), got
    copied = _caller(keys, act={"sub": DELEGATION_ISSUER}, **binding)
    got = verifier.verify(copied)
    assert isinstance(got, Principal) and got.delegated_for is None
    forged = TokenIssuer(raw.kid, "EdDSA", TokenIssuer.from_jwk_file(keys.issuer).private_key)
    token = forged.mint(TENANT, "u", "a", iss=DELEGATION_ISSUER,
                        act={"sub": DELEGATION_ISSUER}, **binding)  # fmt: skip
    got = verifier.verify(token)
    assert isinstance(got, FieldError) and got.code == "token_signature_invalid"


def test_a_delegation_key_must_not_be_a_trusted_issuer(keys: Any, tmp_path: Path) -> None:
    with pytest.raises(KeyError_, match="also a trusted issuer"):
        Verifier.from_settings(
            IdentitySettings(jwks_file=keys.jwks, delegation_key_file=keys.issuer)
        )
    public_only = tmp_path / "public.jwk"
    doc = orjson.loads(keys.delegation.read_bytes())
    del doc["d"]
    public_only.write_bytes(orjson.dumps(doc))
    with pytest.raises(KeyError_):
        Delegator.from_settings(IdentitySettings(delegation_key_file=public_only))


def test_a_compensation_is_signed_or_escalates(
    contracts: ContractSet, verifier: Verifier, keys: Any
) -> None:
    item = _charge_result(contracts)
    comp = wants_compensation(item, contracts)
    assert comp is not None
    grant = _grant(verifier, keys)

    signed = compensation_proposal(item, comp, grant, verifier)
    assert signed is not None
    token = orjson.loads(signed)["principal_token"]
    principal = verifier.verify(token)
    assert isinstance(principal, Principal)
    assert principal.delegated_for == (comp.key, COMP_ID, "run-1")

    unsigned = Verifier.from_settings(IdentitySettings(jwks_file=keys.jwks))
    assert unsigned.delegator is None
    for who, what in ((unsigned, grant), (verifier, ""), (verifier, "eyJ.old.token")):
        assert compensation_proposal(item, comp, what, who) is None
    d = unsigned_compensation(item.decision, unsigned)
    assert d.rejection is not None
    assert d.rejection.taxonomy is TaxonomyClass.COMPENSATION_FAILED
    assert [e.code for e in d.rejection.errors][-1] == "compensation_unsigned"
    assert d.rejection.allowed_tools == ("handoff_to_human",)


def test_a_failure_after_committed_steps_is_told_to_admission_so_without_a_delegation_key(
    contracts: ContractSet, keys: Any
) -> None:
    """With no delegation key the compensation plan escalates the decision before the
    result goes to admission (COMPENSATION_FAILED): it still failed after a committed step.
    Admission must be told so (an earlier attempt's such failure settles or is held, not
    superseded), and it carries no "nothing committed" answer."""
    unsigned = Verifier.from_settings(IdentitySettings(jwks_file=keys.jwks))
    item = _charge_result(contracts)
    assert compensation_plan(item, contracts, unsigned) == (None, None)
    assert item.decision.rejection is not None
    assert item.decision.rejection.taxonomy is TaxonomyClass.COMPENSATION_FAILED
    settled = settle_item(item, "r/0/1", None)[1]
    assert settled["committed"] is True and settled["cached_held"] == ""


def test_a_rotated_delegation_key_still_verifies_what_it_signed(keys: Any, tmp_path: Path) -> None:
    before = Verifier.from_settings(
        IdentitySettings(jwks_file=keys.jwks, delegation_key_file=keys.delegation)
    )
    assert before.delegator is not None
    token = before.delegator.mint(TENANT, _grant(before, keys), *BINDING)
    assert token is not None

    new_key = tmp_path / "delegation-2.jwk"
    new_key.write_bytes(orjson.dumps(generate_ed25519_jwk("toolsentry-delegation-2")[0]))
    rotated = IdentitySettings(jwks_file=keys.jwks, delegation_key_file=new_key)
    after = Verifier.from_settings(rotated)
    got = after.verify(token)
    assert isinstance(got, FieldError) and got.code == "token_unknown_key"
    keeping = Verifier.from_settings(
        rotated.model_copy(update={"delegation_trusted_key_files": (keys.delegation,)})
    )
    got = keeping.verify(token)
    assert isinstance(got, Principal) and got.delegated_for == BINDING
    assert keeping.delegator is not None and keeping.delegator.kid == "toolsentry-delegation-2"
    with pytest.raises(KeyError_, match="also a trusted issuer"):
        Verifier.from_settings(
            rotated.model_copy(update={"delegation_trusted_key_files": (keys.issuer,)})
        )
    # Listing the signing key again is harmless; another key under its kid is refused.
    again = rotated.model_copy(update={"delegation_trusted_key_files": (new_key,)})
    assert Verifier.from_settings(again).delegator is not None
    impostor = tmp_path / "impostor.jwk"
    impostor.write_bytes(orjson.dumps(generate_ed25519_jwk("toolsentry-delegation-2")[1]))
    with pytest.raises(KeyError_, match="names two keys"):
        Verifier.from_settings(
            rotated.model_copy(update={"delegation_trusted_key_files": (impostor,)})
        )
    # Every key init writes a delegation key with a kid of its own.
    other = init_keys(tmp_path / "other-keys").delegation
    kids = {orjson.loads(p.read_bytes())["kid"] for p in (keys.delegation, other)}
    assert len(kids) == 2 and all(k.startswith("toolsentry-delegation-") for k in kids)


def test_a_scope_list_entry_must_be_one_scope(verifier: Verifier, keys: Any) -> None:
    """A grant keeps scopes space-separated: an entry with a space in it would become two
    real scopes in a delegation token, so such a token is refused to begin with."""
    issuer = TokenIssuer.from_jwk_file(keys.issuer)
    bad = issuer.mint(TENANT, "u", "a", scope=["orders:read orders:refund"])
    got = verifier.verify(bad)
    assert isinstance(got, FieldError) and got.code == "token_claims_invalid"
    good = verifier.verify(issuer.mint(TENANT, "u", "a", scope=["orders:read", "orders:refund"]))
    assert isinstance(good, Principal) and good.scopes == {"orders:read", "orders:refund"}


@pytest.mark.parametrize("exp", [float("nan"), float("inf")])
def test_a_delegation_token_whose_expiry_is_not_a_number_is_refused(
    verifier: Verifier, exp: float
) -> None:
    """Its expiry is checked by the processor, not PyJWT: NaN would compare false with
    every clock and never expire."""
    assert verifier.delegator is not None
    issuer = verifier.delegator.issuer
    key, pid, run = BINDING
    token = issuer.mint(TENANT, "user-7", "agent-3", ["orders:refund"], "internal",
                        exp=exp, iss=DELEGATION_ISSUER, act={"sub": DELEGATION_ISSUER},
                        idempotency_key=key, proposal_id=pid, run_id=run)  # fmt: skip
    got = verifier.verify(token)
    assert isinstance(got, FieldError) and got.code == "token_claims_invalid", got
