"""Unpadded base64url (RFC 4648 §5), as JOSE and the approval signatures use it."""

from __future__ import annotations

import base64


def encode(raw: bytes) -> str:
    return base64.urlsafe_b64encode(raw).rstrip(b"=").decode()


def decode(text: str) -> bytes:
    """Padding is optional; a malformed string raises ``binascii.Error`` or ``ValueError``,
    a character outside the alphabet included (the lenient decoder drops those, which
    gives one value many spellings)."""
    raw = base64.b64decode(text + "=" * (-len(text) % 4), altchars=b"-_", validate=True)
    if encode(raw) != text.rstrip("="):  # '+', '/', or bits set past the last byte
        raise ValueError("not the canonical base64url spelling of its bytes")
    return raw
