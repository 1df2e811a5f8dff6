"""Pure detectors for the policy gate: secrets in arguments, URLs and where they may go.

No I/O and no state beyond small caches: everything here runs on every
proposal, so the common case (a handful of short strings and numbers) is kept
to a few microseconds by cheap length checks before any regex runs.

Paths are slash-separated JSON paths, as in the schema gate (``items/0/sku``,
``order_id``); the root value itself is ``""``. A finding never carries the
secret: the ``kind`` is a fixed name and an object key that is itself a secret
appears in paths only as its first four characters and ``…``.
"""

from __future__ import annotations

import base64
import binascii
import math
import re
import unicodedata
import urllib.parse
from collections import Counter
from dataclasses import dataclass
from encodings import idna
from functools import lru_cache
from typing import Any, TypeAlias

__all__ = [
    "DomainEntry",
    "SecretFinding",
    "domain_entry",
    "egress_violation",
    "find_secrets",
    "find_urls",
]


@dataclass(frozen=True, slots=True)
class SecretFinding:
    """Where a secret was seen and what it looked like, never the secret itself."""

    path: str
    kind: str
    in_key: bool


# --- known formats ------------------------------------------------------------------------------

# Token formats: each is a whitespace-free run of at least 20 characters, so
# they are only looked for in whitespace-delimited tokens that long. Every
# alternative starts with a literal character (its "not after a letter or
# digit" check comes second) so that ``re`` can skip positions that cannot
# start one. Repetitions are possessive: a token of 64 KiB is scanned once, not
# once from every position where a prefix repeats (``ghp_ghp_ghp_…``).
_TOKEN_PATTERNS = (
    r"A(?<![A-Z0-9]A)(?:KIA|SIA)[A-Z0-9]{16}(?![A-Z0-9])",
    r"A(?<![A-Za-z0-9]A)Iza[0-9A-Za-z_-]{35}(?![0-9A-Za-z_-])",
    r"g(?<![A-Za-z0-9]g)h[pousr]_[A-Za-z0-9]{36,251}+(?![A-Za-z0-9])",
    r"g(?<![A-Za-z0-9]g)ithub_pat_[A-Za-z0-9_]{22,}+",
    r"g(?<![A-Za-z0-9]g)lpat-[A-Za-z0-9_-]{20,}+",
    r"x(?<![A-Za-z0-9]x)ox[abposr]-[A-Za-z0-9-]{15,}+",
    r"s(?<![A-Za-z0-9]s)k_(?:live|test)_[A-Za-z0-9]{16,}+",
    r"r(?<![A-Za-z0-9]r)k_(?:live|test)_[A-Za-z0-9]{16,}+",
    r"w(?<![A-Za-z0-9]w)hsec_[A-Za-z0-9+/=]{20,}+",
    r"n(?<![A-Za-z0-9]n)pm_[A-Za-z0-9]{36}(?![A-Za-z0-9])",
    r"s(?<![A-Za-z0-9]s)k-ant-[A-Za-z0-9_-]{20,}+",
    r"S(?<![A-Za-z0-9]S)G\.[A-Za-z0-9_-]{16,}+\.[A-Za-z0-9_-]{16,}+",
    r"y(?<![A-Za-z0-9]y)a29\.[0-9A-Za-z_-]{20,}+",
    r"h(?<![A-Za-z0-9]h)ooks\.slack\.com/(?:services|workflows|triggers)/[A-Za-z0-9/_-]{16,}+",
    r"d(?<![A-Za-z0-9]d)iscord(?:app)?\.com/api/webhooks/[0-9]{5,}+/[A-Za-z0-9_-]{16,}+",
)
_TOKEN_RE = re.compile("|".join(_TOKEN_PATTERNS))
_TOKEN_KINDS = (
    (("AKIA", "ASIA"), "aws_access_key_id"),
    (("AIza",), "google_api_key"),
    (("gh", "github_pat_"), "github_token"),
    (("glpat-",), "gitlab_token"),
    (("xox",), "slack_token"),
    (("sk_", "rk_"), "stripe_secret_key"),
    (("whsec_",), "stripe_webhook_secret"),
    (("npm_",), "npm_token"),
    (("sk-ant-",), "anthropic_api_key"),
    (("SG.",), "sendgrid_api_key"),
    (("ya29.",), "google_oauth_token"),
    (("hooks.slack.com",), "slack_webhook"),
    (("discord",), "discord_webhook"),
)
# Two formats are matched apart, each in one pass over a run, because a single
# regex would rescan the rest of a run from every place the prefix repeats in it
# (``sk-sk-sk-…``, ``eyJeyJ…``): quadratic in the token's length.
_OPENAI = re.compile(r"s(?<![A-Za-z0-9]s)k-(?!ant-)[A-Za-z0-9_-]{32,}+")
"""``sk-`` and 32 or more key characters; the digit it must hold is checked on the match."""
_JWT = re.compile(
    r"(?<![A-Za-z0-9_-])(?>[A-Za-z0-9_-]*?eyJ)[A-Za-z0-9_-]{8,}+\.eyJ[A-Za-z0-9_-]{8,}+\."
)
"""Header and payload, each base64url JSON (``eyJ``), from the first ``eyJ`` of a run: a
later one in the same run is followed by the same characters, fewer of them."""


def _token_kind(token: str) -> str:
    return next((kind for prefixes, kind in _TOKEN_KINDS if token.startswith(prefixes)), "token")


# Phrase formats: a keyword, then a value, possibly short and across whitespace.
# Each regex is matched only where its keyword occurs (found with ``str.find``
# in the lowercased text): an alternation searched over the whole text costs
# about 20 ns a character in Python's ``re``, a substring search a fraction.
_PEM = re.compile(r"-----BEGIN (?:[A-Z0-9]++ )*PRIVATE KEY(?: BLOCK)?-----")
_BEARER = re.compile(
    r"(?<![A-Za-z])(?i:bearer)\s+(?=[A-Za-z0-9._~+/-]*[0-9])[A-Za-z0-9._~+/-]{16,}"
)
_TOKEN_SCHEME = re.compile(
    r"(?<![A-Za-z])(?i:token)\s+(?=[A-Za-z0-9._~+/-]*[0-9])[A-Za-z0-9._~+/-]{20,}"
)
"""``Authorization: Token <key>``, the scheme some APIs use in place of Bearer."""
_BASIC = re.compile(r"(?<![A-Za-z])(?i:basic)\s+([A-Za-z0-9+/]{6,}+)={0,2}+(?![A-Za-z0-9+/=])")
_URL_CREDENTIALS = re.compile(r"://[^\s/?#@:]*+:([^\s/?#@]++)@")
_URL_USER_TOKEN = re.compile(r"://([A-Za-z0-9+/_-]{20,256}+)@")
"""A token as the whole userinfo (``https://<token>@github.com/org/repo.git``), the way
Git hosts take one; a user name (``git@``, ``jane.doe@``) does not look random."""
_ALWAYS_WORDS = ("bearer", "basic", "-----begin", "token")

# ``name=value`` and ``name: value`` (also ``"name": "value"``) where the name ends in a
# credential's name, its words joined or not (``db_password``, ``API-KEY``, ``apikey``).
# One regex per first word, searched in the lowercased text when that word is in it (a
# literal start lets ``re`` skip ahead about as fast as ``str.find``). The value is read
# in a look-ahead, so that an assignment inside a value is matched too, and every part
# is bounded or possessive, so that a text of one name repeated is read once. Group 1 is
# the ``=``, if that is the separator, group 2 the value; the rules on the value are
# :func:`_assigned`'s, but the digit most values need is looked for here already, so
# that ``pwd:pwd:pwd:…`` is turned down without a call per occurrence.
_VALUE = r"(?=\s{0,32}+[\"']?(<[^<>\n]{1,64}>|\{\{[^{}\n]{1,64}\}\}|<?[^\s;&,'\"<>]{0,64}))"
"""A bracketed value whole (``<your password>``, ``{{ secrets.DB }}``), else up to
whitespace or a delimiter."""
_DIGIT_AHEAD = r"(?=[^0-9]{0,104}+[0-9])"
"""A digit close enough after the separator to be in the value: at most 32 spaces, a
quote and 68 characters of a value come first."""
_SEPARATORS = {
    "password_assignment": r"[_.-]*+[\"']?\s{0,32}+(?:(=)|:" + _DIGIT_AHEAD + ")",
    "credential_assignment": r"[_.-]*+[\"']?\s{0,32}+(?:(=)|:)" + _DIGIT_AHEAD,
}
_ASSIGNMENTS = tuple(
    (word, kind, re.compile(name + _SEPARATORS[kind] + _VALUE))
    for word, kind, name in (
        ("pass", "password_assignment", r"pass[_.-]*+(?:word|wd|wort|phrase)"),
        ("pwd", "password_assignment", r"pwd"),
        ("kennwort", "password_assignment", r"kennwort"),
        ("contrase", "password_assignment", r"contrase(?:ñ|n)a"),
        ("api", "credential_assignment", r"api[_.-]*+key"),
        ("secret", "credential_assignment", r"secret(?:[_.-]*+(?:access[_.-]*+)?key)?"),
        ("access", "credential_assignment", r"access[_.-]*+token"),
        ("refresh", "credential_assignment", r"refresh[_.-]*+token"),
        ("auth", "credential_assignment", r"auth[_.-]*+token"),
    )
)
_MIN_SCAN = 8
"""No format can match fewer characters (``pwd=abcd``), so shorter strings are skipped."""

# --- entropy --------------------------------------------------------------------------------------

_MIN_TOKEN = 20
_MAX_TOKEN = 256
_ENTROPY_MARGIN = 0.6
_MAX_MEAN_PART = 3.5
_RUN = re.compile(
    r"(?<![A-Za-z0-9+/_.@%&?#\\$~!*|^-])(?!//)[A-Za-z0-9+/_-]{20,}+={0,2}+"
    r"(?![@%&#\\$~*|^=]|[.!?][^\s])"
)
_PARTS = re.compile(r"[A-Z]?[a-z]+|[A-Z]+(?![a-z])|[0-9]+")
_HEX = frozenset("0123456789abcdefABCDEF-")
_DIGITS = frozenset("0123456789")
_PUBLISHABLE = ("pk_live_", "pk_test_")


def _entropy_threshold(n: int) -> float:
    """The least entropy, in bits per symbol, a random token of ``n`` characters shows.

    A string of ``n`` characters drawn uniformly from the 62 base62 symbols has
    on average ``D(n) = 62 * (1 - (61/62)**n)`` distinct symbols, so its Shannon
    entropy sits just under ``log2(D(n))`` (4.25 bits at 24 characters, 5.16 at 64).
    The threshold is that figure less 0.6 bits: calibrated by simulation so that
    fewer than 0.2% of random base62 or base64url tokens of 24 characters or more
    fall below it, while snake_case, camelCase and word-like identifiers (whose
    letters repeat: ``customer_satisfaction_survey_2024`` has 4.03 bits against
    a threshold of 4.09), digit-heavy ids and IBANs (under 3.4 bits) and hex (at
    most 4 bits, under the threshold from 36 characters) stay below it.
    """
    distinct = 62 * (1 - (61 / 62) ** n)
    return math.log2(distinct) - _ENTROPY_MARGIN


_THRESHOLDS = tuple(_entropy_threshold(n) if n else 0.0 for n in range(_MAX_TOKEN + 1))


def _shannon(text: str) -> float:
    n = len(text)
    return -sum(c / n * math.log2(c / n) for c in Counter(text).values())


def _random_looking(run: str) -> bool:
    """True when ``run`` reads as a random token rather than an identifier or a digest.

    Three filters, then two measurements. Filters: pure hex (git SHAs, digests,
    UUIDs in any case, with or without dashes, with or without ``0x``) is never
    a secret on its own; Stripe publishable keys (``pk_live_``, ``pk_test_``) are
    meant to be public; and a token needs letters plus either digits or both
    cases, which rules out plain long words. Measurements: Shannon entropy at
    least :func:`_entropy_threshold`, and a mean "word" length of at most 3.5
    characters, where words are camelCase/snake_case parts and digit runs.
    Identifiers are built from real words (``IBANValidationServiceImplV2`` has
    parts of 4.5 characters on average) while random base62 changes case or
    class every two characters or so; entropy alone cannot tell them apart.

    Base64 of ordinary data (``aGVsbG8gd29ybGQgMjAyNA==``) and base64 digests
    look random by construction and are flagged: an opaque blob in a tool
    argument deserves a look anyway.
    """
    body = run.rstrip("=")
    if body[:2] in ("0x", "0X"):
        body = body[2:]
    n = len(body)
    if n < _MIN_TOKEN or body.startswith(_PUBLISHABLE):
        return False
    chars = set(body)
    if chars <= _HEX:
        return False
    has_digit = not chars.isdisjoint(_DIGITS)
    if not has_digit and (body.islower() or body.isupper() or not any(c.isalpha() for c in body)):
        return False
    if has_digit and not any(c.isalpha() for c in chars):
        return False
    sample = body[:_MAX_TOKEN]
    if _shannon(sample) < _THRESHOLDS[len(sample)]:
        return False
    parts = _PARTS.findall(sample)
    return sum(map(len, parts)) / len(parts) <= _MAX_MEAN_PART


def _high_entropy(token: str) -> bool:
    """Whether a whitespace-delimited ``token`` is, or holds, a random-looking run.

    Runs are maximal stretches of the base64/base64url alphabet bounded by the
    token's ends, quotes, brackets or ``: = , ;`` (``key="…"``, ``[…]``);
    runs glued to ``. @ % & ? #`` and the like are parts of host names, e-mail
    addresses, file names or URLs, and a run starting with ``//`` is a URL's
    authority, so none of those is judged.
    """
    return any(_random_looking(m.group()) for m in _RUN.finditer(token))


# --- scanning text and keys ---------------------------------------------------------------------

_PLACEHOLDER_WORDS = frozenset(
    {"redacted", "[redacted]", "<redacted>", "hidden", "masked", "none", "null", "n/a"}
)
_MASK_CHARS = frozenset("*•xX.-_ ")
_TEMPLATE = re.compile(
    r"\$\{[A-Za-z_][A-Za-z0-9_.]*\}"  # ${db_password}
    r"|\$[A-Z_][A-Z0-9_]*"  # $DB_PASSWORD
    r"|%[A-Z_][A-Z0-9_]*%"  # %DB_PASSWORD%
    r"|\{\{\s*[A-Za-z_.][A-Za-z0-9_.]*\s*\}\}"  # {{ secrets.DB_PASSWORD }}
    r"|\{[A-Za-z_][A-Za-z0-9_.]*\}"  # {db_password}
    r"|<[A-Za-z_][A-Za-z_. -]*>"  # <your password>
)
"""Template forms: a name in the syntax of a shell, a format string or a template engine.

Bare ``$NAME`` and ``%NAME%`` are upper case, as environment variables are written, so
that ``$uperS3cret`` is a value; ``<…>`` holds words only, so that ``<Summer2024!>``,
with its digits and symbols, is a value too.
"""


def _placeholder(value: str) -> bool:
    """Masked or templated values (``****``, ``${DB_PASSWORD}``, ``<redacted>``) hold no secret."""
    v = value.strip()
    if not v or set(v) <= _MASK_CHARS:
        return True
    return v.lower() in _PLACEHOLDER_WORDS or _TEMPLATE.fullmatch(v) is not None


def _basic_credentials(token: str) -> bool:
    """``Basic`` then base64 of ``user:password``; ``Basic understanding`` is prose."""
    try:
        text = base64.b64decode(token + "=" * (-len(token) % 4), validate=True).decode("utf-8")
    except (binascii.Error, ValueError):
        return False
    return ":" in text and text.isprintable()


def _assigned(text: str, m: re.Match[str], password: bool) -> bool:
    """Whether the value of the assignment ``m`` (a match in ``text`` lowercased, see
    ``_ASSIGNMENTS``) is a credential.

    Passwords count from four characters after ``=`` (``pwd=abcd``); after a
    colon, which prose uses too (``password: reset it``), from six characters
    with a digit. Other credentials (``api_key``, ``client-secret``) need eight
    characters with a digit. Placeholders (``${X}``, ``****``) never count, nor
    does a comparison (``password == input``).
    """
    value = m.group(2)
    if len(value) < 4 or value[0] == "=":
        return False
    if (not password or m.group(1) is None) and (
        len(value) < (6 if password else 8) or not _has_digit(value)
    ):
        return False
    return not _placeholder(text[m.start(2) : m.end(2)])


def _has_digit(text: str) -> bool:
    return not _DIGITS.isdisjoint(text)


def _phrase_at(text: str, at: int, word: str) -> str | None:
    if word == "bearer":
        return "bearer_token" if _BEARER.match(text, at) else None
    if word == "basic":
        m = _BASIC.match(text, at)
        return "basic_auth" if m and _basic_credentials(m.group(1)) else None
    if word == "-----begin":
        return "private_key" if _PEM.match(text, at) else None
    if word == "token":
        return "token_header" if _TOKEN_SCHEME.match(text, at) else None
    m = _URL_CREDENTIALS.match(text, at)
    if m is not None:
        return None if _placeholder(m.group(1)) else "url_credentials"
    m = _URL_USER_TOKEN.match(text, at)
    return "url_credentials" if m and _random_looking(m.group(1)) else None


def _phrases(text: str) -> list[str]:
    """Kinds of the phrase formats in ``text``, found keyword by keyword."""
    kinds: list[str] = []
    low = text.lower()
    assigns = "=" in low or ":" in low
    at_sign = "@" in low
    if not (
        assigns or at_sign or "bearer" in low or "basic" in low or "-----" in low or "token" in low
    ):
        return kinds
    if len(low) != len(text):
        low = "".join(c if len(c.lower()) != 1 else c.lower() for c in text)
    words = (*_ALWAYS_WORDS, "://") if at_sign else _ALWAYS_WORDS
    for word in words:
        at = low.find(word)
        while at >= 0:
            kind = _phrase_at(text, at, word)
            if kind is not None and kind not in kinds:
                kinds.append(kind)
            at = low.find(word, at + len(word))
    if assigns:
        for word, kind, assignment in _ASSIGNMENTS:
            password = kind == "password_assignment"
            if (
                kind not in kinds
                and word in low
                and any(_assigned(text, m, password) for m in assignment.finditer(low))
            ):
                kinds.append(kind)
    return kinds


def _folded(text: str) -> str:
    """``text`` as the detectors read it: NFKC, without the characters that render as
    nothing.

    Text copied from a web page, a mail or a chat carries non-breaking and
    ideographic spaces, fullwidth letters, soft hyphens and zero-width spaces or
    joiners; a key with a zero-width space after ``AKIA`` is still the key. NFKC
    turns the spaces into spaces and fullwidth letters into ASCII; format
    characters (category Cf) are dropped, and so is every other default-ignorable
    code point (variation selectors, the combining grapheme joiner, Hangul fillers:
    printable, yet shown as nothing). The copy is for detection only.
    """
    if text.isascii():
        return text
    text = unicodedata.normalize("NFKC", text)
    if text.isprintable() and _IGNORABLE.search(text) is None:
        return text
    return "".join(
        c
        for c in text
        if c.isascii() or (unicodedata.category(c) != "Cf" and _IGNORABLE.match(c) is None)
    )


_IGNORABLE = re.compile(
    "[\u034f\u115f\u1160\u17b4\u17b5\u180b-\u180f\u3164\ufe00-\ufe0f\uffa0"
    "\ufff0-\ufff8\U000e0000-\U000e0fff]"
)
"""Unicode's Default_Ignorable_Code_Point characters outside category Cf (DerivedCoreProperties)."""


def _scan_text(text: str) -> list[str]:
    """The kinds of secret in ``text``, each once; ``high_entropy`` only when no other."""
    return _scan_folded(_folded(text))


def _scan_folded(text: str, depth: int = 0, entropy: bool = True) -> list[str]:
    """The kinds in folded ``text``; ``depth`` counts the decodings that led to it, and
    ``entropy`` False leaves ``high_entropy`` out."""
    kinds = _phrases(text)
    if len(text) < _MIN_ENCODED:
        return kinds  # (shorter than any token, or any encoding of one)
    tokens = [t for t in text.split() if len(t) >= _MIN_TOKEN] if len(text) >= _MIN_TOKEN else []
    for token in tokens:
        found = [_token_kind(m.group()) for m in _TOKEN_RE.finditer(token)]
        if "sk-" in token and any(_has_digit(m.group()) for m in _OPENAI.finditer(token)):
            found.append("openai_api_key")
        if "eyJ" in token and _JWT.search(token):
            found.append("jwt")
        kinds.extend(kind for kind in dict.fromkeys(found) if kind not in kinds)
    if "token_header" in kinds and len(kinds) > 1:
        kinds.remove("token_header")  # the token's own format says more
    if (
        not kinds
        and depth < _MAX_DECODINGS
        and ("%" in text or _ENCODED_HINT.search(text) is not None)
    ):
        kinds = _encoded_kinds(text, depth + 1)
    if not kinds and entropy and tokens and any(_high_entropy(token) for token in tokens):
        kinds.append("high_entropy")
    return kinds


# --- encoded text ---------------------------------------------------------------------------------

_MAX_DECODINGS = 2
"""Decodings stacked on one another that are undone (base64 of base64, a percent-encoded
base64 string); each shrinks the text, so the scan stays linear in its length."""
_MIN_ENCODED = 16
"""The shortest run decoded: base64 of twelve bytes (``pwd=hunter22``)."""
_ENCODED_RUN = re.compile(r"[A-Za-z0-9+/_-]{16,}+")
_ENCODED_HINT = re.compile(r"(?<![A-Za-z0-9+/_-])(?=[A-Za-z0-9+/_-]{16})[a-z_-]*+[A-Z0-9+/]")
"""A run of base64 or hex digits long enough to decode that is not all lower-case
letters, ``_`` and ``-``: base64 of ASCII text and hex both hold an upper-case letter, a
digit, ``+`` or ``/``, and an identifier or a reason code (``customer_request``) holds
none, so prose and ids cost one search and no decoding. (Tried at a run's start only,
with a bounded look-ahead and a possessive repeat: linear in the text.)"""
_PERCENT_ESCAPE = re.compile(r"%[0-9A-Fa-f]{2}")
_HEX_DIGITS = frozenset("0123456789abcdefABCDEF")
_BASE64URL = str.maketrans("-_", "+/")
_ASCII_LEAD = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdef")
"""The base64 digits whose value is below 32: the first of every four that encode ASCII
bytes is one (its byte's top bit is clear). The secrets looked for are ASCII, so a run
failing this is never decoded: a word or an id (``customer_request``) fails it at once."""
_LINE_BREAKS = str.maketrans("", "", "\t\n\r")


def _encoded_kinds(text: str, depth: int) -> list[str]:
    """The kinds of secret in what ``text`` holds percent-, base64- or hex-encoded.

    Encoding a key is the first thing tried to get it past a scanner, and a tool that
    forwards the argument forwards the key all the same. Base64 and hex runs are
    decoded only when they hold UTF-8 text, which a digest, an id or a word read as
    base64 almost never does, so ordinary values cost a regex pass and no scan. A
    base64 run inside a URL path (``/files/QUtJQ…``) is tried segment by segment too.
    Text that was only percent-encoded is not judged on entropy: decoding moves the
    boundaries the entropy check reads (``%2F`` to ``/``) in ordinary URLs.
    """
    kinds: list[str] = []
    if "%" in text and _PERCENT_ESCAPE.search(text) and (unquoted := _unquoted(text)):
        kinds.extend(_scan_folded(_folded(unquoted), depth, entropy=False))
    for m in _ENCODED_RUN.finditer(text):
        run = m.group()
        decoded = _decoded_run(run)
        if decoded is None and "/" in run:
            decoded = "\n".join(
                d for part in run.split("/") if (d := _decoded_run(part)) is not None
            )
        if decoded:
            kinds.extend(k for k in _scan_folded(_folded(decoded), depth) if k not in kinds)
    return kinds


def _unquoted(text: str) -> str | None:
    """``text`` percent-decoded, or None when the escapes do not spell UTF-8 text
    (``%DB_PASSWORD%`` is a template, not the byte 0xDB)."""
    try:
        return _printable(urllib.parse.unquote_to_bytes(text).decode("utf-8"))
    except UnicodeDecodeError:
        return None


def _printable(text: str) -> str | None:
    return text if text.translate(_LINE_BREAKS).isprintable() else None


def _decoded_run(run: str) -> str | None:
    """The text ``run`` spells in hex (``0x`` or not) or base64 (either alphabet), or None
    when it is neither or what it decodes to is not printable text (ASCII for base64)."""
    if len(run) < _MIN_ENCODED:
        return None
    hex_digits = run[2:] if run[:2] in ("0x", "0X") else run
    try:
        if len(hex_digits) % 2 == 0 and _HEX_DIGITS.issuperset(hex_digits):
            raw = bytes.fromhex(hex_digits)
        elif len(run) % 4 != 1 and _ASCII_LEAD.issuperset(run[::4]):
            raw = base64.b64decode(run.translate(_BASE64URL) + "=" * (-len(run) % 4), validate=True)
        else:
            return None
        return _printable(raw.decode("utf-8"))
    except (binascii.Error, ValueError):
        return None


_SENSITIVE_NAMES = frozenset(
    {
        "password", "passwd", "passphrase", "pass", "passcode", "token", "apitoken",
        "idtoken", "clienttoken", "secret", "clientsecret", "apikey", "apisecret",
        "accesstoken", "refreshtoken", "authtoken", "sessiontoken", "bearertoken", "privatekey",
        "secretkey", "secretaccesskey", "authorization", "proxyauthorization",
    }
)  # fmt: skip
_SENSITIVE_SUFFIXES = (
    "password", "passwd", "passphrase", "secret", "apikey", "apitoken", "accesstoken",
    "refreshtoken", "authtoken", "sessiontoken", "privatekey", "secretkey", "secretaccesskey",
)  # fmt: skip
_KEY_SEPARATORS = str.maketrans("", "", "_- .")
_SENSITIVE_CACHE: dict[str, bool] = {}
_SENSITIVE_CACHE_MAX = 4096
_SENSITIVE_CACHE_KEY = 64
"""Only keys this short are cached: field names are, and 4096 keys of 64 KiB would hold 256 MiB."""


def _sensitive_key(key: str) -> bool:
    """``password``, ``Client-Secret``, ``apiKey``, ``db_password``: a key naming a credential."""
    hit = _SENSITIVE_CACHE.get(key)
    if hit is None:
        norm = _folded(key).lower().translate(_KEY_SEPARATORS)
        hit = norm in _SENSITIVE_NAMES or norm.endswith(_SENSITIVE_SUFFIXES)
        if len(key) <= _SENSITIVE_CACHE_KEY:
            if len(_SENSITIVE_CACHE) >= _SENSITIVE_CACHE_MAX:
                _SENSITIVE_CACHE.clear()
            _SENSITIVE_CACHE[key] = hit
    return hit


def _redact(key: str) -> str:
    return key[:4] + "…"


def quotable(text: str) -> str:
    """``text`` as an observation may quote it back: redacted when it looks like a
    credential (gates that answer before the credential scan, such as parse and resolve,
    quote names back to the model)."""
    return _redact(text) if find_secrets(text, limit=1) else text


_Link: TypeAlias = "tuple[_Link, str] | None"
"""A path as a chain ``(parent, segment)``: built in O(1) per node, rendered only when needed."""


def _render(link: _Link) -> str:
    parts: list[str] = []
    while link is not None:
        link, segment = link
        parts.append(segment)
    parts.reverse()
    return "/".join(parts)


def _value_kinds(text: str, key: str | None, under_credential: bool) -> list[str]:
    """Kinds for a string value; ``credential_field`` when only a key gives it away: its
    own ``key``, or one it is nested under (``under_credential``)."""
    folded = _folded(text)
    kinds = _scan_folded(folded) if len(folded) >= _MIN_SCAN else []
    if (
        not kinds
        and (under_credential or (key is not None and _sensitive_key(key)))
        and not _placeholder(folded)
    ):
        kinds.append("credential_field")
    return kinds


def _credential_number(value: Any) -> bool:
    """{"password": 12345678}: under a credential-named key, a number of six digits or more
    is a credential too, as a string would be (a short one is left alone, as in prose)."""
    kind_of = type(value)
    return (kind_of is int or kind_of is float) and abs(value) >= 100_000


def find_secrets(value: Any, *, limit: int = 8) -> list[SecretFinding]:
    """Secrets in a JSON value: in string values and in object keys, at most ``limit``.

    Walks with an explicit stack, so any nesting depth is safe, and never raises
    on a JSON value (non-JSON leaves are ignored, non-string keys are read as
    ``str(key)``). A string under a credential-named key (``password``,
    ``api_key``, ...), however deeply (``{"password": ["…"]}``), that matches no
    known format is still reported, as ``credential_field``, unless it is empty
    or a placeholder like ``****``; so is a number there of six digits or more.
    Findings come out object by object: an object's own keys and strings
    before what is nested in it.
    """
    found: list[SecretFinding] = []
    if limit <= 0:
        return found
    if type(value) is str:
        return [SecretFinding("", kind, False) for kind in _value_kinds(value, None, False)][:limit]
    stack: list[tuple[Any, _Link, bool]] = [(value, None, False)]
    while stack:
        node, link, under = stack.pop()
        pending: list[tuple[Any, _Link, bool]] = []
        if type(node) is dict:
            for key, child in node.items():
                name = key if type(key) is str else str(key)
                segment = name
                if len(name) >= _MIN_SCAN and (key_kinds := _scan_text(name)):
                    segment = _redact(name)
                    where = _render((link, segment))
                    found.extend(SecretFinding(where, kind, True) for kind in key_kinds)
                    if len(found) >= limit:
                        return found[:limit]
                kind_of = type(child)
                if kind_of is str:
                    kinds = _value_kinds(child, name, under)
                elif kind_of is dict or kind_of is list or kind_of is tuple:
                    pending.append((child, (link, segment), under or _sensitive_key(name)))
                    continue
                elif _credential_number(child) and (under or _sensitive_key(name)):
                    kinds = ["credential_field"]
                else:
                    continue
                if kinds:
                    where = _render((link, segment))
                    found.extend(SecretFinding(where, kind, False) for kind in kinds)
                    if len(found) >= limit:
                        return found[:limit]
        elif type(node) is list or type(node) is tuple:
            for i, child in enumerate(node):
                kind_of = type(child)
                if kind_of is str:
                    kinds = _value_kinds(child, None, under)
                elif kind_of is dict or kind_of is list or kind_of is tuple:
                    pending.append((child, (link, str(i)), under))
                    continue
                elif under and _credential_number(child):
                    kinds = ["credential_field"]
                else:
                    continue
                if kinds:
                    where = _render((link, str(i)))
                    found.extend(SecretFinding(where, kind, False) for kind in kinds)
                    if len(found) >= limit:
                        return found[:limit]
        pending.reverse()
        stack.extend(pending)
    return found


# --- URLs -----------------------------------------------------------------------------------------

_WS = "".join(map(chr, range(33))) + "\x7f\x85\xa0\u1680\u2000\u2001\u2002\u2003\u2004\u2005"
_WS += "\u2006\u2007\u2008\u2009\u200a\u200b\u2028\u2029\u202f\u205f\u3000\ufeff"
_URL_LIKE = re.compile(
    r"[A-Za-z][A-Za-z0-9+.-]*://\S*"
    r"|(?i:www)\.\S+"
    r"|(?i:javascript|vbscript|gopher):\S"
    r"|(?i:data):[^,\s]*,"
    r"|(?i:file):[/\\]"
    # http(s) with one slash, none, or backslashes: WHATWG parsers still connect to the
    # host (https:/evil.com, https:evil.com, https:\\evil.com)
    r"|(?i:https?|wss?|ftp):[/\\]*[^\s/\\]\S*"
    # scheme-relative: resolved against an http(s) base, it names the host to connect to
    # (urljoin("https://api.internal/", "//evil.com") is https://evil.com); \\host is SMB
    r"|[/\\]{2}[^\s/\\]\S*"
)
_DANGEROUS_PREFIX = re.compile(r"(?i:javascript|vbscript|gopher|data|file):")


def _url_like(text: str) -> str | None:
    """``text`` stripped when it is a URL as a whole, else None.

    Browsers drop control characters and spaces at the ends of a URL and tabs
    and newlines anywhere in it (``java\\tscript:``), so they are ignored when
    deciding; the returned text, stripped of whitespace only, keeps them for
    :func:`egress_violation` to refuse. A ``www.`` string with whitespace inside is
    prose that starts with an address, not a URL. A ``scheme://`` string followed by
    more text is checked whatever follows: an HTTP client handed all of it connects to
    the host it names (see below). The dangerous schemes only need to start the string.
    """
    t = text.strip()
    probe = t.strip(_WS)
    if len(probe) < 4:
        return None
    if not probe.isprintable():
        probe = probe.replace("\t", "").replace("\n", "").replace("\r", "")
    m = _URL_LIKE.match(probe)
    if m is None:
        return None
    if m.end() == len(probe) or _DANGEROUS_PREFIX.match(probe):
        return t
    token = m.group()
    if "://" not in token:
        return None  # www. followed by prose
    # A scheme://host string followed by more text. An HTTP client handed all of it
    # connects to the host its authority names (up to the first / ? or #), so that is
    # what is checked: the leading URL when the authority is whole before the first
    # whitespace ("https://host/path has the form" is prose after a URL on host), else
    # the whole string, whose whitespace is refused ("https://host\xa0@evil/").
    rest = probe[token.index("://") + 3 :]
    end = min((i for i in map(rest.find, "/?#") if i >= 0), default=len(rest))
    if len(token) - token.index("://") - 3 >= end and t.isprintable():
        return token
    return t


def find_urls(value: Any) -> list[tuple[str, str]]:
    """``(path, url)`` for every string value, and every object key, that is a URL as a whole.

    Accepted: ``scheme://...``, ``www....``, scheme-relative ``//host...`` (and
    ``\\\\host``), and ``javascript:``, ``vbscript:``, ``data:``, ``file:``, ``gopher:``
    URLs. A URL inside prose (``see https://x.io``) is not returned: free text is not an
    address a tool fetches.
    Keys are read as values are: a tool may take a map keyed by URL (``{"headers":
    {"https://evil.example/x": "1"}}``, a URL-to-label map) and send to its keys. A key
    URL comes before its value's and has the same path.
    Object keys that hold secrets are redacted in the paths as in
    :func:`find_secrets`, and the order is the same.
    """
    if type(value) is str:
        url = _url_like(value)
        return [] if url is None else [("", url)]
    found: list[tuple[str, str]] = []
    stack: list[tuple[Any, _Link]] = [(value, None)]
    while stack:
        node, link = stack.pop()
        pending: list[tuple[Any, _Link]] = []
        if type(node) is dict:
            items: Any = node.items()
        elif type(node) is list or type(node) is tuple:
            items = enumerate(node)
        else:
            continue
        for key, child in items:
            # Every URL form holds a colon, a slash or a backslash but ``www.``, whose
            # ``w.`` a dotted key name (``product.area``) rarely holds.
            if type(key) is str and (
                ":" in key or "/" in key or "\\" in key or "w." in key or "W." in key
            ):
                url = _url_like(key)
                if url is not None:
                    found.append((_render((link, _segment(key))), url))
            kind_of = type(child)
            if kind_of is str:
                if ":" in child or "." in child or "//" in child or "\\" in child:
                    url = _url_like(child)
                    if url is not None:
                        found.append((_render((link, _segment(key))), url))
            elif kind_of is dict or kind_of is list or kind_of is tuple:
                pending.append((child, (link, _segment(key))))
        pending.reverse()
        stack.extend(pending)
    return found


def _segment(key: Any) -> str:
    name = key if type(key) is str else str(key)
    if len(name) >= _MIN_SCAN and type(key) is str and _scan_text(name):
        return _redact(name)
    return name


# --- egress ---------------------------------------------------------------------------------------

_POLICIES = frozenset(
    {"none", "allowlisted_domains", "private_network_only", "unrestricted_with_approval"}
)
_SCHEME = re.compile(r"([A-Za-z][A-Za-z0-9+.-]*):")
_ASCII_CONTROL = re.compile(r"[\x00-\x1f\x7f]")
_WHITESPACE = re.compile(r"\s")
_AUTHORITY_END = re.compile(r"[/?#]")
_LABEL = r"[a-z0-9](?:[a-z0-9-]{0,61}[a-z0-9])?"
_HOST = re.compile(rf"{_LABEL}(?:\.{_LABEL})*")
_NUMERIC_LABEL = re.compile(r"[0-9]+|0x[0-9a-f]*")
_DOT_LOOKALIKES = frozenset("\u3002\uff0e\uff61")
_LOOPBACK = frozenset({"localhost", "localhost.localdomain", "ip6-localhost", "ip6-loopback"})
_METADATA = frozenset(
    {"metadata", "metadata.google.internal", "metadata.goog", "instance-data",
     "instance-data.ec2.internal", "metadata.azure.internal"}
)  # fmt: skip
_NON_PUBLIC_SUFFIXES = frozenset(
    {"local", "localdomain", "internal", "intranet", "lan", "home", "corp", "private",
     "home.arpa", "localhost", "test", "invalid", "example"}
)  # fmt: skip
_SHOW = 60
_MAX_HOST = 253
"""The longest a DNS name may be, dots included and the root's dot not."""
_DEFAULT_PORTS = {"http": 80, "https": 443}
_GENERIC_SECOND_LEVEL = frozenset(
    {"ac", "co", "com", "edu", "go", "gob", "gov", "govt", "ltd", "mil", "ne", "net", "nom",
     "or", "org", "plc", "sch"}
)  # fmt: skip
"""Second-level names under which country registries sell names (``co.uk``, ``com.au``,
``ac.jp``, ``gov.br``): such a name followed by a two-letter country code is a public
suffix, found without fetching the Public Suffix List."""
_SHARED_HOSTING_SUFFIXES = frozenset(
    {"github.io", "gitlab.io", "herokuapp.com", "appspot.com", "blogspot.com",
     "azurewebsites.net", "cloudapp.net", "cloudfront.net", "amazonaws.com",
     "s3.amazonaws.com", "firebaseapp.com", "web.app", "netlify.app", "vercel.app",
     "pages.dev", "workers.dev", "ngrok.io", "ngrok-free.app"}
)  # fmt: skip
"""Hosting platforms' shared domains: anyone gets a name under one in minutes, for free,
so allowing one of them allows every stranger's site on it."""


def _show(host: str) -> str:
    return host if len(host) <= _SHOW else host[: _SHOW - 1] + "…"


def _hidden_character(text: str) -> bool:
    """Control, format (zero-width, bidi override) and separator characters hide what a URL is."""
    if text.isascii():
        return _ASCII_CONTROL.search(text) is not None
    return any(unicodedata.category(c) in ("Cc", "Cf", "Zl", "Zp") for c in text)


def _confusable_scripts(label: str) -> set[str]:
    """Which of Latin, Cyrillic and Greek, whose letters look alike, ``label`` draws on."""
    found: set[str] = set()
    for c in label:
        if c.isalpha():
            script = unicodedata.name(c, "").partition(" ")[0]
            if script in ("LATIN", "CYRILLIC", "GREEK"):
                found.add(script)
    return found


def _ascii_host(host: str) -> str | None:
    """The host in lowercase ASCII (IDNA labels as ``xn--``), or None for a look-alike.

    A non-ASCII label must encode to an ``xn--`` label: one that nameprep folds
    into plain ASCII (fullwidth letters, a zero-width space inside a name,
    ``ß`` to ``ss``) is a host that reads as one name and may resolve as
    another, and so is refused rather than compared. So is a label mixing
    Latin, Cyrillic or Greek letters (``example`` spelt with a Cyrillic a): even
    where the punycode comparison would catch it, a person approving the call
    would read it as the real name. Whole-script look-alikes (an all-Cyrillic
    label) pass here and are compared as punycode.
    """
    host = host.lower()
    return host if host.isascii() else _unicode_host(host)


@lru_cache(maxsize=1024)
def _unicode_host(host: str) -> str | None:
    if not _DOT_LOOKALIKES.isdisjoint(host):
        return None
    labels: list[str] = []
    for label in host.split("."):
        if label.isascii():
            labels.append(label)
            continue
        if len(_confusable_scripts(label)) > 1:
            return None
        try:
            encoded = idna.ToASCII(label).decode("ascii")
        except UnicodeError:
            return None
        if not encoded.startswith("xn--"):
            return None
        labels.append(encoded)
    return ".".join(labels)


DomainEntry: TypeAlias = "tuple[str, int | None]"
"""An allow-list entry: a host (lowercase ASCII) and the one port it allows, or None for
the URL scheme's default port."""


def domain_entry(raw: object) -> DomainEntry:
    """An egress allow-list entry (``example.com``, ``*.example.com``, ``example.com:8443``)
    parsed, or ValueError saying why it cannot be one.

    An entry covers its host and every subdomain, on the default port of the URL's scheme
    or on the port it names, and only that one. Refused: what is not a host name (a URL,
    an IP address, characters outside a-z 0-9 . -, a look-alike), and names under which
    strangers get hosts of their own: a single label (``com``, ``*.com``, ``internal``),
    a country registry's public suffix (``co.uk``, ``com.au``: see
    ``_GENERIC_SECOND_LEVEL``) and a hosting platform's shared domain (``github.io``).
    """
    if type(raw) is not str:
        raise ValueError("is not a string")
    d = raw.strip().lower().removeprefix("*.").strip(".")
    if not d:
        raise ValueError("is empty")
    if any(c in d for c in "/?#@[]") or "://" in d:
        raise ValueError("is not a host name: write the host alone, with an optional :port")
    port: int | None = None
    if ":" in d:
        d, _, digits = d.rpartition(":")
        if not (digits.isascii() and digits.isdigit() and 0 < _port_number(digits) <= 65535):
            raise ValueError("has a bad port: expected host:port with a port of 1 to 65535")
        port = _port_number(digits)
        d = d.rstrip(".")
    host = _ascii_host(d) if 0 < len(d) <= _MAX_HOST else None
    if host is None or len(host) > _MAX_HOST or not _HOST.fullmatch(host):
        raise ValueError("is not a valid host name (a-z 0-9 - in dot-separated labels)")
    if _NUMERIC_LABEL.fullmatch(host.rsplit(".", 1)[-1]):
        raise ValueError("is an IP address; egress to IP address hosts is always refused")
    if "." not in host:
        raise ValueError(
            "is a single label: it would allow every host under a top-level domain; "
            "list your own domain (example.com)"
        )
    if host in _SHARED_HOSTING_SUFFIXES or _country_registry_suffix(host):
        raise ValueError(
            "is a public suffix: anyone can get a host under it; list your own domain "
            "under it instead"
        )
    return host, port


def _country_registry_suffix(host: str) -> bool:
    first, _, last = host.partition(".")
    return first in _GENERIC_SECOND_LEVEL and len(last) == 2 and last.isalpha()


@lru_cache(maxsize=256)
def _domains(domains: tuple[str, ...]) -> tuple[DomainEntry, ...]:
    """Configured entries parsed by :func:`domain_entry`; one it refuses is dropped.

    The policy loader refuses such entries already; dropping them here as well keeps a
    policy built some other way from allowing an empty name (every host), a top-level
    domain or a public suffix.
    """
    out: list[DomainEntry] = []
    for raw in domains:
        try:
            out.append(domain_entry(raw))
        except ValueError:
            continue
    return tuple(out)


def _listed_ports(host: str, entries: tuple[DomainEntry, ...]) -> list[int | None]:
    """The ports the entries covering ``host`` allow (None: the scheme's default); empty
    when no entry covers it."""
    return [port for d, port in entries if host == d or host.endswith("." + d)]


def _port_refused(port: int, default: int, host: str, ports: list[int | None]) -> str | None:
    """Why ``port`` may not be reached on ``host``, whose entries allow ``ports``; None
    when it may."""
    if port in ports or (port == default and None in ports):
        return None
    allowed = sorted({default if p is None else p for p in ports})
    return f"port {port} is not allowed on {_show(host)} (allowed: {', '.join(map(str, allowed))})"


def _show_entries(entries: tuple[DomainEntry, ...]) -> str:
    shown = [d if port is None else f"{d}:{port}" for d, port in entries[:3]]
    return ", ".join(shown) + (", ..." if len(entries) > 3 else "")


def _within(host: str, domains: tuple[str, ...]) -> bool:
    """``host`` is one of ``domains`` or a subdomain of one, on a label boundary."""
    return any(host == d or host.endswith("." + d) for d in domains)


def _port_number(digits: str) -> int:
    """The port ``digits`` name, or 65536 for one too long to be a port (leading zeros
    aside): ``int`` refuses strings of more than 4300 digits."""
    digits = digits.lstrip("0")
    return int(digits or "0") if len(digits) <= 5 else 65536


def _host_of(rest: str) -> tuple[str | None, int | None, str]:
    """The normalised host after ``scheme:`` and the port it names (None: none, or an
    empty one, which WHATWG reads as the default), or None and the reason it is refused."""
    if not rest.startswith("//") or rest.startswith("///"):
        return None, None, "malformed URL: expected scheme://host"
    authority = _AUTHORITY_END.split(rest[2:], maxsplit=1)[0]
    if "@" in authority:
        return None, None, "credentials (user@ or user:password@) are not allowed in a URL"
    if authority.startswith("["):
        return None, None, "IP address hosts are not allowed; use a domain name"
    host, colon, digits = authority.rpartition(":")
    port: int | None = None
    if not colon:
        host = authority
    elif digits:
        if not (digits.isascii() and digits.isdigit() and _port_number(digits) <= 65535):
            return None, None, "malformed URL: bad port"
        port = _port_number(digits)
    if host.endswith("."):
        host = host[:-1]
    if not host:
        return None, None, "malformed URL: no host"
    if len(host) > _MAX_HOST:
        # Refused before IDNA, whose nameprep costs about 6 µs a character: encoding never
        # shortens a name but for the invisible characters nameprep drops, which make a
        # look-alike anyway.
        return None, None, f"host {_show(host.lower())} is longer than {_MAX_HOST} characters"
    ascii_host = _ascii_host(host)
    if ascii_host is None:
        return None, None, "host uses look-alike Unicode characters"
    if len(ascii_host) > _MAX_HOST or not _HOST.fullmatch(ascii_host):
        return None, None, f"host {_show(ascii_host)} has characters outside a-z 0-9 . -"
    return ascii_host, port, ""


def egress_violation(
    url: str,
    egress_policy: str,
    allowed_domains: tuple[str, ...],
    internal_domains: tuple[str, ...],
) -> str | None:
    """None when the contract's egress policy lets a tool reach ``url``, else why not.

    Parsing is strict on purpose: the URL is refused whenever two common
    parsers could disagree about its host (backslashes, control or invisible
    characters, ``https:/host`` or ``https:///host``, userinfo, Unicode dots),
    because the host this check sees must be the host the tool connects to.
    IP literals in any spelling (``2130706433``, ``0x7f.1``, ``0177.0.0.1``,
    ``[::1]``) are recognised as WHATWG does: a host whose last label is a
    number. A URL without a scheme (``www.example.com``) is refused: how the
    executor would complete it, http or https, is unknown. The reason names the
    most basic problem first (an IP host before plain http), so that fixing
    what it says is worth a retry.

    Ports: a URL reaches the default port of its scheme (443 for https, 80 for http),
    written or not, unless the allow-list entry that covers its host names another
    (``docs.example.com:8443``), and then only that one. An HTTP client pointed at port
    22, 25 or 6379 of an allowed host talks to SSH, SMTP or Redis in HTTP's words, which
    some of them take; a tool whose policy is ``unrestricted_with_approval`` has no list
    to name a port in, and reaches port 443 only.
    """
    if type(egress_policy) is not str or egress_policy not in _POLICIES:
        return f"unknown egress policy {_show(str(egress_policy))}; refusing"
    if egress_policy == "none":
        return "this tool may not reach any URL (egress policy none)"
    if type(url) is not str:
        return "not a URL"
    u = url.strip()
    if not u:
        return "empty URL"
    if "\\" in u:
        return "backslash in URL"
    if _hidden_character(u):
        return "control or invisible character in URL"
    m = _SCHEME.match(u)
    if m is None or "." in m.group(1):
        return "URL has no scheme; write it in full as https://host/path"
    scheme = m.group(1).lower()
    if scheme not in ("http", "https"):
        return f"scheme {_show(scheme)}: is not allowed; only https"
    if _WHITESPACE.search(u):
        return "whitespace in URL"
    host, written_port, reason = _host_of(u[m.end() :])
    if host is None:
        return reason
    default = _DEFAULT_PORTS[scheme]
    port = default if written_port is None else written_port
    last = host.rsplit(".", 1)[-1]
    if _NUMERIC_LABEL.fullmatch(last):
        return "IP address hosts are not allowed; use a domain name"
    if host in _LOOPBACK or host.endswith(".localhost"):
        return "localhost is not allowed"
    if host in _METADATA or _within(host, ("metadata.google.internal",)):
        return "cloud metadata endpoints are not allowed"
    if egress_policy == "allowlisted_domains":
        allowed = _domains(tuple(allowed_domains))
        ports = _listed_ports(host, allowed)
        if not ports:
            listed = _show_entries(allowed) or "none configured"
            return f"host {_show(host)} is not an allowed domain ({listed})"
        refused = _port_refused(port, default, host, ports)
        if refused is not None:
            return refused
    elif egress_policy == "private_network_only":
        ports = _listed_ports(host, _domains(tuple(internal_domains)))
        if not ports:
            return f"host {_show(host)} is not on the private network"
        return _port_refused(port, default, host, ports)
    elif "." not in host or _listed_ports(host, _domains(tuple(internal_domains))):
        return f"host {_show(host)} is internal; this tool may reach public hosts only"
    elif last in _NON_PUBLIC_SUFFIXES or host.endswith(".home.arpa"):
        return f"host {_show(host)} is not a public host name"
    elif port != default:
        return f"port {port} is not allowed; this tool reaches public hosts on port {default} only"
    if scheme == "http":
        return "plain http is not allowed; use https"
    return None
