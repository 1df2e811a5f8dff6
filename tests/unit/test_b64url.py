"""base64url as JOSE and the approval signatures use it: one spelling per value."""

from __future__ import annotations

import binascii
import os

import pytest

from processor import b64url


def test_what_is_encoded_decodes_padded_or_not() -> None:
    for n in range(70):
        raw = os.urandom(n)
        text = b64url.encode(raw)
        assert b64url.decode(text) == raw
        assert b64url.decode(text + "=" * (-len(text) % 4)) == raw


@pytest.mark.parametrize("text", ["AA!!AA", "AA  AA", "+vv8", "/vv8", "YWJ", "A"])
def test_any_other_spelling_is_refused(text: str) -> None:
    with pytest.raises((ValueError, binascii.Error)):
        b64url.decode(text)
