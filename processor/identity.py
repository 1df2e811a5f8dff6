"""Who is asking: principals from signed tokens, and nothing else.

A proposal's ``tenant_id`` and any other identity field in the envelope are
claims. The principal (tenant, user, agent, scopes, clearance) is read only
from a JWT the proposal carries, verified with a key the operator configured
(a JWKS document or single key files). Each key is pinned to one algorithm:
EdDSA for Ed25519, ES256 for P-256, HS256 for shared secrets. A token whose
header asks for another algorithm, or for ``none``, is refused before any
cryptography runs, which closes the algorithm-confusion attacks (an HMAC
"signed" with a public key, an unsigned token).

Verification costs tens of microseconds for the asymmetric algorithms, and an
agent run sends many proposals under one token, so verified tokens are
cached by their exact bytes; the time claims are checked again on every use.

Compensating calls are the one kind of proposal the processor writes itself, and it
signs them with a key of its own (``Delegator``): the original caller's claims, an
``act`` claim naming the processor, and the one proposal the token is good for. So no
caller's token is kept at rest, and a compensation runs even after the caller's own
token expired.
"""

from __future__ import annotations

import binascii
import logging
import math
import time
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jwt
import orjson
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec, ed25519

from processor import b64url
from processor.config import IdentitySettings
from processor.model import CLEARANCE_LEVELS, FieldError, Principal

logger = logging.getLogger(__name__)

ALGORITHMS = ("EdDSA", "ES256", "HS256")
MAX_HEADER_CHARS = 1024
"""A compact JWS header (base64url) longer than this is refused unread."""
DEVELOPMENT_WARNING = (
    "identity NOT verified: the processor runs in development mode and trusts the "
    "envelope's tenant_id"
)
_MAX_CACHE = 8192
DELEGATION_ISSUER = "toolsentry"
"""``iss`` and ``act.sub`` of the tokens the processor signs for the calls it proposes."""
DELEGATION_BINDING = ("idempotency_key", "proposal_id", "run_id")
"""The claims binding a delegation token to the one proposal it was signed for."""


class KeyError_(ValueError):
    """A key file cannot be used."""


@dataclass(frozen=True, slots=True)
class VerificationKey:
    kid: str
    alg: str
    key: Any


def _alg_for(jwk: dict[str, Any]) -> str:
    kty, crv = str(jwk.get("kty")), jwk.get("crv")
    inferred: dict[tuple[str, Any], str] = {
        ("OKP", "Ed25519"): "EdDSA",
        ("EC", "P-256"): "ES256",
        ("oct", None): "HS256",
    }
    alg = inferred.get((kty, crv))
    if alg is None:
        raise KeyError_(f"key {jwk.get('kid')!r}: unsupported key type {kty}/{crv}")
    if "alg" in jwk and jwk["alg"] != alg:
        raise KeyError_(f"key {jwk.get('kid')!r}: alg {jwk['alg']} does not fit a {kty} key")
    return alg


def _from_jwk(jwk: dict[str, Any], where: str) -> VerificationKey:
    kid = jwk.get("kid")
    if not isinstance(kid, str) or not kid:
        raise KeyError_(f"{where}: every key needs a kid")
    alg = _alg_for(jwk)
    if jwk.get("d") is not None and alg != "HS256":
        raise KeyError_(f"{where}: key {kid!r} is a private key; configure its public half")
    try:
        key = jwt.PyJWK(jwk, algorithm=alg).key
    except jwt.PyJWKError as exc:
        raise KeyError_(f"{where}: key {kid!r}: {exc}") from exc
    return VerificationKey(kid, alg, key)


def _from_pem(path: Path) -> VerificationKey:
    key = serialization.load_pem_public_key(path.read_bytes())
    if isinstance(key, ed25519.Ed25519PublicKey):
        alg = "EdDSA"
    elif isinstance(key, ec.EllipticCurvePublicKey) and key.curve.name == "secp256r1":
        alg = "ES256"
    else:
        raise KeyError_(f"{path}: only Ed25519 and P-256 public keys are accepted")
    return VerificationKey(path.stem, alg, key)


def load_keys(settings: IdentitySettings) -> dict[str, VerificationKey]:
    keys: list[VerificationKey] = []
    if settings.jwks_file is not None:
        doc = orjson.loads(Path(settings.jwks_file).read_bytes())
        if not isinstance(doc, dict) or not isinstance(doc.get("keys"), list):
            raise KeyError_(f"{settings.jwks_file}: not a JWKS document (no keys list)")
        keys.extend(_from_jwk(k, str(settings.jwks_file)) for k in doc["keys"])
    for path in settings.key_files:
        path = Path(path)
        raw = path.read_bytes()
        if raw.lstrip().startswith(b"{"):
            keys.append(_from_jwk(orjson.loads(raw), str(path)))
        else:
            keys.append(_from_pem(path))
    by_kid: dict[str, VerificationKey] = {}
    for k in keys:
        if k.kid in by_kid:
            raise KeyError_(f"key id {k.kid!r} is configured twice")
        by_kid[k.kid] = k
    return by_kid


def _refuse(code: str, message: str) -> FieldError:
    return FieldError("principal_token", message, code)


@dataclass(frozen=True, slots=True)
class _Cached:
    principal: Principal
    exp: float
    nbf: float


_WARNED: set[str] = set()


def _warned_once(what: str) -> bool:
    """True when ``what`` was warned about before in this process (and now it has been)."""
    seen = what in _WARNED
    _WARNED.add(what)
    return seen


class Verifier:
    """Turns a token into a ``Principal`` or a typed refusal."""

    def __init__(
        self,
        settings: IdentitySettings,
        keys: dict[str, VerificationKey],
        delegator: Delegator | None = None,
        delegation_keys: dict[str, VerificationKey] | None = None,
    ) -> None:
        self.settings = settings
        self.keys = keys
        self.delegator = delegator
        """The processor's own signing key, for the compensating calls it proposes."""
        self.delegation_keys: dict[str, VerificationKey] = dict(delegation_keys or {})
        """What verifies delegation tokens: the delegator's public key and those rotated out."""
        if delegator is not None:
            self.delegation_keys[delegator.kid] = delegator.public
        self.development = settings.mode == "development"
        self._cache: OrderedDict[str, _Cached] = OrderedDict()

    @classmethod
    def from_settings(cls, settings: IdentitySettings) -> Verifier:
        keys = load_keys(settings)
        delegator = Delegator.from_settings(settings)
        trusted = {k.kid: k for k in map(_delegation_public, settings.delegation_trusted_key_files)}
        for kid in [*trusted, *([delegator.kid] if delegator else [])]:
            if kid in keys:
                raise KeyError_(f"the delegation key id {kid!r} is also a trusted issuer's key id")
        # The same kid for two keys: the signing key's would shadow the other, and what the
        # other signed would no longer verify. (The signing key listed again is fine.)
        same_kid = trusted.get(delegator.kid) if delegator is not None else None
        if (
            delegator is not None
            and same_kid is not None
            and _raw(same_kid) != _raw(delegator.public)
        ):
            raise KeyError_(
                f"the delegation key id {delegator.kid!r} names two keys; give each "
                "delegation key a kid of its own"
            )
        if settings.mode == "development":
            logger.warning("*** %s ***", DEVELOPMENT_WARNING)
        elif not keys:
            logger.warning("no identity keys configured: every proposal will be refused")
        if delegator is None and settings.mode == "verify" and not _warned_once("delegation"):
            # (once per process: the keys are read again at every reload)
            logger.warning(
                "no identity.delegation_key_file: calls that need compensating cannot be "
                "compensated (COMPENSATION_FAILED)"
            )
        return cls(settings, keys, delegator, trusted)

    def development_principal(self, tenant_id: str | None) -> Principal:
        return Principal(
            tenant_id=tenant_id or "",
            user_id="development-user",
            agent_id="development-agent",
            scopes=frozenset({"*"}),
            clearance=CLEARANCE_LEVELS[-1],
            verified=False,
        )

    def verify(self, token: str | None, now: float | None = None) -> Principal | FieldError:
        if now is None:
            now = time.time()
        if token is None:
            return _refuse(
                "token_missing", "the proposal carries no principal_token; identity is required"
            )
        hit = self._cache.get(token)
        if hit is None:
            result = self._verify(token, now)
            if isinstance(result, FieldError):
                return result
            hit = self._cache[token] = result
            if len(self._cache) > _MAX_CACHE:
                self._cache.popitem(last=False)
        leeway = self.settings.leeway_s
        if now > hit.exp + leeway:
            return _expired(hit.principal.delegated_for is not None)
        if now < hit.nbf - leeway:
            return _refuse("token_not_yet_valid", "the principal token is not valid yet")
        return hit.principal

    def delegation_of(self, token: str | None) -> Principal | None:
        """The principal a delegation token (verified, possibly expired since) acts as."""
        hit = self._cache.get(token) if token is not None else None
        if hit is None or hit.principal.delegated_for is None:
            return None
        return hit.principal

    def _verify(self, token: str, now: float) -> _Cached | FieldError:
        parts = token.split(".")
        if len(parts) != 3:
            return _refuse("token_malformed", "the principal token is not a compact JWS")
        # A JOSE header is a few dozen bytes: a long one is refused before it is parsed
        # (deep nesting would otherwise exhaust the parser's stack, here or in PyJWT's).
        if len(parts[0]) > MAX_HEADER_CHARS:
            return _refuse("token_malformed", "the principal token's header is too long")
        try:
            header = orjson.loads(b64url.decode(parts[0]))
        except (ValueError, binascii.Error):
            return _refuse("token_malformed", "the principal token's header is not JSON")
        if not isinstance(header, dict):
            return _refuse("token_malformed", "the principal token's header is not an object")
        alg = header.get("alg")
        if not isinstance(alg, str) or alg not in ALGORITHMS:
            return _refuse("token_alg_refused", f"token algorithm {alg!r} is not accepted")
        kid = header.get("kid")
        if not isinstance(kid, str):
            return _refuse("token_unknown_key", f"no configured key has id {kid!r}")
        delegated = kid in self.delegation_keys
        key = (self.delegation_keys if delegated else self.keys).get(kid)
        if key is None:
            return _refuse("token_unknown_key", f"no configured key has id {kid!r}")
        if key.alg != alg:
            return _refuse("token_alg_refused", f"key {kid!r} verifies {key.alg} tokens, not {alg}")
        required = ["exp", "iat", "aud", "sub"]
        if delegated:
            required += ["iss", "act", *DELEGATION_BINDING]
        try:
            claims = jwt.decode(
                token,
                key.key,
                algorithms=[key.alg],
                audience=self.settings.audience,
                issuer=DELEGATION_ISSUER if delegated else self.settings.issuer,
                leeway=self.settings.leeway_s,
                # Expiry, not-before and issued-at are checked by verify(), against the
                # clock it is given, on first use as on every use after (PyJWT reads the
                # wall clock), and once a delegation token's binding is known: an expired
                # one is still told apart from one sent for another call (gates.identity).
                options={
                    "require": required,
                    "verify_exp": False,
                    "verify_nbf": False,
                    "verify_iat": False,
                },
            )
        except jwt.ImmatureSignatureError:
            return _refuse("token_not_yet_valid", "the principal token is not valid yet")
        except (jwt.InvalidAudienceError, jwt.InvalidIssuerError):
            return _refuse(
                "token_wrong_audience", "the principal token was issued for another audience"
            )
        except jwt.InvalidSignatureError:
            return _refuse("token_signature_invalid", "the principal token's signature is wrong")
        except jwt.MissingRequiredClaimError as exc:
            return _refuse("token_claims_invalid", f"the principal token lacks {exc.claim}")
        except jwt.InvalidTokenError as exc:
            return _refuse("token_malformed", f"the principal token is unreadable: {exc}")
        if not delegated:
            return _principal(claims, kid)
        bound = tuple(claims[c] for c in DELEGATION_BINDING)
        if claims["act"] != {"sub": DELEGATION_ISSUER} or not all(
            isinstance(b, str) for b in bound
        ):
            return _refuse("token_claims_invalid", "a delegation token needs its act and binding")
        return _principal(claims, kid, bound)


def _expired(delegated: bool) -> FieldError:
    if delegated:
        return _refuse("delegation_expired", "the compensating call's token has expired")
    return _refuse("token_expired", "the principal token has expired")


def _principal(
    claims: dict[str, Any], kid: str, delegated_for: tuple[str, ...] | None = None
) -> _Cached | FieldError:
    tenant, agent, user = claims.get("tenant_id"), claims.get("agent_id"), claims.get("sub")
    for name, value in (("tenant_id", tenant), ("agent_id", agent), ("sub", user)):
        if not isinstance(value, str) or not value:
            return _refuse("token_claims_invalid", f"the principal token has no {name}")
    scope = claims.get("scope", "")
    if isinstance(scope, str):
        # Separated by spaces only (RFC 6749 §3.3), and holding no other whitespace: a tab
        # or a no-break space read as a separator too would grant "orders:write" to a token
        # its issuer signed with the one scope "orders:read\u00a0orders:write".
        names = [s for s in scope.split(" ") if s]
        usable = names == scope.split()
    else:
        names = scope
        usable = isinstance(scope, list) and all(
            isinstance(s, str) and s.split() == [s] for s in scope
        )
    if not usable:
        return _refuse(
            "token_claims_invalid",
            "scope must be a space-separated string, or a list of scopes, with no other whitespace",
        )
    scopes = frozenset(names)
    clearance = claims.get("clearance", CLEARANCE_LEVELS[0])
    if clearance not in CLEARANCE_LEVELS:
        return _refuse("token_claims_invalid", f"unknown clearance {clearance!r}")
    exp, iat, nbf = claims["exp"], claims["iat"], claims.get("nbf", 0)
    if not all(_is_time(t) for t in (exp, iat, nbf)):
        return _refuse("token_claims_invalid", "exp, iat and nbf must be numbers")
    principal = Principal(
        tenant_id=str(tenant),
        user_id=str(user),
        agent_id=str(agent),
        scopes=scopes,
        clearance=str(clearance),
        key_id=kid,
        delegated_for=delegated_for,
    )
    # A token is not valid before it was issued either (as PyJWT would say, on its clock).
    return _Cached(principal, float(exp), float(max(nbf, iat)))


def _is_time(t: object) -> bool:
    """A finite number of seconds that a float holds exactly enough: an integer past 2**53
    would overflow ``float`` (10**400 raised), and NaN compares false with every clock."""
    if type(t) is int:
        return abs(t) <= 2**53
    return type(t) is float and math.isfinite(t)


# -- issuing (clients, tests, the demo) ---------------------------------------------------


class TokenIssuer:
    """Mints principal tokens with a private key: what an identity provider does."""

    def __init__(self, kid: str, alg: str, private_key: Any, audience: str = "toolsentry") -> None:
        self.kid, self.alg, self.private_key, self.audience = kid, alg, private_key, audience

    @classmethod
    def from_jwk_file(cls, path: Path, audience: str = "toolsentry") -> TokenIssuer:
        jwk = orjson.loads(Path(path).read_bytes())
        alg = _alg_for(jwk)
        return cls(jwk["kid"], alg, jwt.PyJWK(jwk, algorithm=alg).key, audience)

    def mint(
        self,
        tenant_id: str,
        user_id: str,
        agent_id: str,
        scopes: list[str] | tuple[str, ...] = (),
        clearance: str = "internal",
        ttl_s: int = 3600,
        now: float | None = None,
        **extra: Any,
    ) -> str:
        now = time.time() if now is None else now
        claims = {
            "sub": user_id,
            "tenant_id": tenant_id,
            "agent_id": agent_id,
            "scope": " ".join(scopes),
            "clearance": clearance,
            "aud": self.audience,
            "iat": int(now),
            "exp": int(now + ttl_s),
            **extra,
        }
        return jwt.encode(claims, self.private_key, algorithm=self.alg, headers={"kid": self.kid})


def _raw(key: VerificationKey) -> bytes:
    raw: bytes = key.key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    return raw


def _delegation_public(path: Path) -> VerificationKey:
    """A delegation key rotated out (its JWK, private or public): verification only."""
    try:
        jwk = orjson.loads(Path(path).read_bytes())
        key = jwt.PyJWK(jwk, algorithm="EdDSA").key
    except (OSError, ValueError, KeyError, jwt.PyJWKError) as exc:
        raise KeyError_(f"{path}: not an Ed25519 JWK: {exc}") from exc
    if isinstance(key, ed25519.Ed25519PrivateKey):
        key = key.public_key()
    if not isinstance(key, ed25519.Ed25519PublicKey) or not isinstance(jwk.get("kid"), str):
        raise KeyError_(f"{path}: a delegation key is an Ed25519 JWK with a kid")
    return VerificationKey(jwk["kid"], "EdDSA", key)


def grant_of(principal: Principal) -> str:
    """What a compensating call needs, later, to act in ``principal``'s name: its claims,
    which are no credential (its token is not kept). Empty when it was not verified."""
    if not principal.verified:
        return ""
    claims = {
        "sub": principal.user_id,
        "agent_id": principal.agent_id,
        "scope": " ".join(sorted(principal.scopes)),
        "clearance": principal.clearance,
    }
    return orjson.dumps(claims).decode()


class Delegator:
    """The processor's signing key for the calls it proposes itself (compensations).

    A token it mints carries the original caller's claims (``grant_of``), ``act``
    naming the processor, and the one proposal it is good for (its idempotency key,
    proposal id and run: ``DELEGATION_BINDING``); the identity gate refuses it on any
    other, and admission admits a compensation key only with the tool and payload the
    original's record names."""

    def __init__(self, issuer: TokenIssuer, ttl_s: int) -> None:
        self.issuer, self.ttl_s = issuer, ttl_s
        self.kid = issuer.kid
        public = issuer.private_key.public_key()
        self.public = VerificationKey(issuer.kid, issuer.alg, public)

    @classmethod
    def from_settings(cls, settings: IdentitySettings) -> Delegator | None:
        if settings.delegation_key_file is None:
            return None
        path = Path(settings.delegation_key_file)
        try:
            issuer = TokenIssuer.from_jwk_file(path, settings.audience)
        except (OSError, ValueError, KeyError, jwt.PyJWKError) as exc:
            raise KeyError_(f"{path}: not a private JWK: {exc}") from exc
        if not isinstance(issuer.private_key, ed25519.Ed25519PrivateKey):
            raise KeyError_(f"{path}: the delegation key must be a private Ed25519 key")
        return cls(issuer, settings.delegation_ttl_s)

    def mint(
        self,
        tenant_id: str,
        grant: str,
        idempotency_key: str,
        proposal_id: str,
        run_id: str,
        now: float | None = None,
    ) -> str | None:
        """A token for that one proposal; None when ``grant`` is unreadable."""
        try:
            claims = orjson.loads(grant)
        except orjson.JSONDecodeError:
            return None
        fields = ("sub", "agent_id", "scope", "clearance")
        if not isinstance(claims, dict) or not all(isinstance(claims.get(f), str) for f in fields):
            return None
        return self.issuer.mint(
            tenant_id,
            claims["sub"],
            claims["agent_id"],
            claims["scope"].split(),
            claims["clearance"],
            ttl_s=self.ttl_s,
            now=now,
            iss=DELEGATION_ISSUER,
            act={"sub": DELEGATION_ISSUER},
            idempotency_key=idempotency_key,
            proposal_id=proposal_id,
            run_id=run_id,
        )


def generate_ed25519_jwk(kid: str) -> tuple[dict[str, str], dict[str, str]]:
    """A new Ed25519 key as (private JWK, public JWK)."""
    private = ed25519.Ed25519PrivateKey.generate()
    raw_private = private.private_bytes(
        serialization.Encoding.Raw, serialization.PrivateFormat.Raw, serialization.NoEncryption()
    )
    raw_public = private.public_key().public_bytes(
        serialization.Encoding.Raw, serialization.PublicFormat.Raw
    )
    public = {
        "kty": "OKP",
        "crv": "Ed25519",
        "kid": kid,
        "alg": "EdDSA",
        "x": b64url.encode(raw_public),
    }
    return {**public, "d": b64url.encode(raw_private)}, public
