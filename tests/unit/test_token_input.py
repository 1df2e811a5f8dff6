"""Hostile principal tokens get a typed refusal, never an exception."""

from __future__ import annotations

import pytest

from processor import b64url
from processor.config import IdentitySettings
from processor.identity import MAX_HEADER_CHARS, Verifier
from processor.model import FieldError


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
