"""Hostile principal tokens get a typed refusal, never an exception."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from processor import b64url
from processor.config import IdentitySettings
from processor.identity import MAX_HEADER_CHARS, TokenIssuer, Verifier
from processor.keys import init_keys
from processor.model import FieldError, Principal


@pytest.mark.parametrize(
    "header",
    [
        b"[" * 5000 + b"]" * 5000,  # deep enough to exhaust a recursive parser's stack
        b'{"alg":"EdDSA","kid":"k","x":"' + b"a" * 800 + b'"}',  # longer than any real one
        b'{"alg":"EdDSA"',  # truncated
        b"\xff\xfe",  # not UTF-8
    ],
)
def test_a_hostile_header_is_a_malformed_token(header: bytes) -> None:
    verdict = Verifier(IdentitySettings(), {}).verify(b64url.encode(header) + ".e30.c2ln")
    assert isinstance(verdict, FieldError)
    assert verdict.code == "token_malformed"


def test_a_header_of_ordinary_length_is_read() -> None:
    header = b'{"alg":"EdDSA","kid":"nobody"}'
    assert len(b64url.encode(header)) < MAX_HEADER_CHARS
    verdict = Verifier(IdentitySettings(), {}).verify(b64url.encode(header) + ".e30.c2ln")
    assert isinstance(verdict, FieldError)
    assert verdict.code == "token_unknown_key"


def _issuer_and_verifier(tmp_path: Path) -> tuple[TokenIssuer, Verifier]:
    keys = init_keys(tmp_path / "keys")
    verifier = Verifier.from_settings(IdentitySettings(jwks_file=keys.jwks, leeway_s=0))
    return TokenIssuer.from_jwk_file(keys.issuer), verifier


def test_a_token_s_expiry_is_read_on_the_clock_it_is_given_from_the_first_use(
    tmp_path: Path,
) -> None:
    """One clock for every use: the one the processor passes in, not the wall clock on
    a token's first use and the given one after."""
    issuer, verifier = _issuer_and_verifier(tmp_path)
    wall = time.time()
    token = issuer.mint("t-1", "u-1", "a-1", ["orders:read"], ttl_s=100, now=wall)
    late = verifier.verify(token, now=wall + 200)
    assert isinstance(late, FieldError) and late.code == "token_expired"
    old = issuer.mint("t-1", "u-1", "a-1", ["orders:read"], ttl_s=100, now=wall - 1000)
    assert isinstance(verifier.verify(old, now=wall - 950), Principal)
    assert isinstance(verifier.verify(old, now=wall), FieldError)


def test_a_token_is_not_valid_before_it_was_issued_on_the_clock_it_is_given(
    tmp_path: Path,
) -> None:
    """Issued-at is read on the given clock too (PyJWT read it on the wall clock, and
    only on first use): a token issued ahead of the wall clock is good at a given time
    inside its life, and not before its iat."""
    issuer, verifier = _issuer_and_verifier(tmp_path)
    wall = time.time()
    ahead = issuer.mint("t-1", "u-1", "a-1", ["orders:read"], ttl_s=100, now=wall + 500)
    assert isinstance(verifier.verify(ahead, now=wall + 550), Principal)
    early = verifier.verify(ahead, now=wall + 450)
    assert isinstance(early, FieldError) and early.code == "token_not_yet_valid"
    fresh = issuer.mint("t-1", "u-1", "a-2", ["orders:read"], ttl_s=100, now=wall + 500)
    first = verifier.verify(fresh, now=wall + 450)  # its first use, before its iat
    assert isinstance(first, FieldError) and first.code == "token_not_yet_valid"


@pytest.mark.parametrize(
    "claims",
    [
        {"exp": "tomorrow"},
        {"exp": True},
        {"nbf": float("nan")},
        {"exp": 10**400},  # float() of it overflows
        {"nbf": -(10**400)},
        {"iat": float("inf")},
        {"iat": "yesterday"},
    ],
)
def test_an_expiry_or_start_that_is_not_a_number_is_refused(
    tmp_path: Path, claims: dict[str, object]
) -> None:
    issuer, verifier = _issuer_and_verifier(tmp_path)
    token = issuer.mint("t-1", "u-1", "a-1", ["orders:read"], **claims)
    got = verifier.verify(token)
    assert isinstance(got, FieldError) and got.code == "token_claims_invalid", got


@pytest.mark.parametrize("separator", ["\u00a0", "\t", "\u2003", "\n"])
def test_scopes_are_separated_by_spaces_only(tmp_path: Path, separator: str) -> None:
    """A scope string with other whitespace in it is refused, not read as more scopes than
    its issuer named (RFC 6749 separates scopes with spaces, and a scope holds none)."""
    issuer, verifier = _issuer_and_verifier(tmp_path)
    token = issuer.mint("t-1", "u-1", "a-1", scope=f"orders:read{separator}orders:refund")
    got = verifier.verify(token)
    assert isinstance(got, FieldError) and got.code == "token_claims_invalid", got
    spaced = verifier.verify(issuer.mint("t-1", "u-1", "a-1", scope=" orders:read  orders:refund"))
    assert isinstance(spaced, Principal) and spaced.scopes == {"orders:read", "orders:refund"}
