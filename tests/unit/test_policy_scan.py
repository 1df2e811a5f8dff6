"""The policy gate's detectors: secrets in arguments, URLs in arguments, egress by policy.

Test secrets are assembled from pieces so that this file holds nothing a secret
scanner would mistake for a live credential; every value is an obvious fake.
"""

from __future__ import annotations

import base64
import gc
import random
import string
import tracemalloc
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from processor.gates.policy_scan import (
    SecretFinding,
    egress_violation,
    find_secrets,
    find_urls,
    quotable,
)

# -- fixtures: fake secrets, one per known format --------------------------------------------------

FAKE: dict[str, str] = {
    "aws_access_key_id": "AKIA" + "IOSFODNN7" + "EXAMPLE",
    "aws_session_key_id": "ASIA" + "Z" * 16,
    "github_token": "ghp_" + "Fake0" * 7 + "X",
    "github_pat": "github_" + "pat_" + "11FAKE0000" + "_" + "fake" * 14,
    "gitlab_token": "glpat-" + "FakeFake" + "1234" + "5678" + "90ab",
    "slack_token": "xox" + "b-" + "1234567890-" + "0987654321-" + "FakeFakeFake",
    "stripe_secret_key": "sk_" + "live_" + "FAKE" * 6,
    "stripe_test_key": "sk_" + "test_" + "fake" * 6,
    "stripe_restricted_key": "rk_" + "live_" + "Fake" * 6,
    "google_api_key": "AIza" + "Fake0" * 7,
    "openai_api_key": "sk-" + "proj-" + "Fake1" * 8,
    "anthropic_api_key": "sk-" + "ant-" + "api03-" + "Fake1" * 8,
    "jwt": "eyJ" + "hbGciOiJIUzI1NiJ9" + "." + "eyJ" + "zdWIiOiJmYWtlIn0" + "." + "ZmFrZXNpZw",
    "private_key": "-----BEGIN " + "RSA PRIVATE KEY-----\nMIIEfake\n-----END RSA PRIVATE KEY-----",
    "openssh_key": "-----BEGIN " + "OPENSSH PRIVATE KEY-----",
    "bearer_token": "Authorization: Bearer " + "fake" + "1234" * 5,
    "basic_auth": "Basic " + base64.b64encode(b"alice:" + b"wonderland").decode(),
    "url_credentials": "postgres://app:" + "n0t-real" + "@db.internal:5432/orders",
    "connection_string": "Server=db;Database=orders;User Id=app;Password=" + "Tr0ub4dor" + ";",
    "password_assignment": "login failed for user=bob pwd=" + "hunter22" + " at 10:02",
    "credential_assignment": "curl -H 'x' https://api.example.com?api_key=" + "fake" + "12345678",
    "sendgrid_api_key": "SG"
    + ".FakeFakeFake1234567890"
    + ".FakeFakeFakeFake1234567890abcdefghijklmnopq",
    "google_oauth_token": "ya29" + ".a0AfH6SMBFakeFakeFake1234567890",
    "slack_webhook": "https://hooks.slack.com/" + "services/T00000000/B00000000/" + "Fake" * 6,
    "discord_webhook": "https://discord.com/api/" + "webhooks/123456789012345678/" + "Fake_1" * 6,
    "token_header": "Authorization: Token " + "9f86d081884c7d659a2f" + "eaa0c55ad015a3bf4f1b",
}
EXPECTED_KIND = {
    "aws_session_key_id": "aws_access_key_id",
    "github_pat": "github_token",
    "stripe_test_key": "stripe_secret_key",
    "stripe_restricted_key": "stripe_secret_key",
    "openssh_key": "private_key",
    "connection_string": "password_assignment",
}


def kinds(value: Any) -> list[str]:
    return [f.kind for f in find_secrets(value)]


def assert_never_echoed(found: list[SecretFinding], secret: str) -> None:
    """Neither a path nor a kind may carry the secret, nor any 12 characters of it."""
    for f in found:
        for i in range(max(1, len(secret) - 11)):
            piece = secret[i : i + 12]
            assert piece not in f.path, (f, piece)
            assert piece not in f.kind, (f, piece)


# -- known formats ---------------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(FAKE))
def test_each_known_format_is_found_in_a_value(name: str) -> None:
    kind = EXPECTED_KIND.get(name, name)
    assert find_secrets({"note": FAKE[name]}) == [SecretFinding("note", kind, False)]


@pytest.mark.parametrize("name", sorted(FAKE))
def test_each_known_format_is_found_inside_prose(name: str) -> None:
    text = f"Hi, here is what you asked for: {FAKE[name]} (please keep it safe)"
    assert EXPECTED_KIND.get(name, name) in kinds({"body": text})


def test_a_root_string_has_the_empty_path() -> None:
    assert find_secrets(FAKE["aws_access_key_id"]) == [
        SecretFinding("", "aws_access_key_id", False)
    ]


def test_token_formats_need_a_boundary_and_their_full_length() -> None:
    assert kinds({"v": "AKIA" + "Z" * 15}) == []
    assert kinds({"v": "XAKIA" + "Z" * 16}) == []
    assert kinds({"v": "ghp_" + "a" * 35}) == []
    assert kinds({"v": "sk-" + "short1"}) == []


def test_stripe_publishable_keys_are_not_secrets() -> None:
    assert kinds({"v": "pk_" + "live_" + "51H7dKzLmN0pQrStUvWxYz2AbCdEf"}) == []
    assert kinds({"v": "pk_" + "test_" + "51H7dKzLmN0pQrStUvWxYz2AbCdEf"}) == []


def test_basic_needs_base64_of_user_colon_password() -> None:
    assert kinds({"v": "Basic understanding of the product is enough"}) == []
    assert kinds({"v": "Basic " + base64.b64encode(b"no colon here").decode()}) == []


def test_placeholders_are_not_secrets() -> None:
    for value in (
        "password=${DB_PASSWORD}",
        "password=****",
        "PASSWORD = <redacted>",
        "postgres://app:${DB_PASSWORD}@db:5432/orders",
        "https://user:****@host.example.com/",
        "password=$DB_PASSWORD",
        "password=%DB_PASSWORD%",
        "password={db_password}",
        "password={{ secrets.DB_PASSWORD }}",
        "password=<your password>",
        "Password: <YOUR_PASSWORD>",
        "api_key=<API key from the console>",
    ):
        assert kinds({"v": value}) == [], value
    for value in ("${DB_PASSWORD}", "$DB_PASSWORD", "<your password>", "********", "{{ pw }}"):
        assert find_secrets({"password": value}) == [], value


@pytest.mark.parametrize(
    "text",
    [
        "password=$" + "uperS3cret",
        "password=*" + "Secr3tPw",
        "Password: <" + "Summer2024!>",
        "Password: <" + "Summer2024>",
        "password: %" + "Summer2024",
        "password=${" + "DB_PASSWORD:-Summer2024}",
        "api_key=<" + "fake12345678>",
    ],
)
def test_a_value_that_only_starts_like_a_template_is_a_value(text: str) -> None:
    """Only whole template forms are placeholders: ``$NAME`` in upper case, ``${name}``,
    ``{name}``, ``{{ name }}``, ``%NAME%``, ``<words>`` (letters, no digits or symbols)
    and masks like ``****``."""
    assert kinds({"v": text}) in (["password_assignment"], ["credential_assignment"])


@pytest.mark.parametrize(
    "text",
    [
        "password:\u00a0Summer2024!",  # a non-breaking space, as text copied from HTML has
        "mot de passe\u00a0: password\u00a0: Summer2024!",
        "password:\nSummer2024!",  # the value on the next line, as in a pasted login block
        "password:\r\n\tSummer2024!",
        "password\u3000=\u3000hunter22",  # ideographic spaces
        "".join(chr(ord(c) + 0xFEE0) for c in "password=") + "hunter22",  # fullwidth
        "pass\u200bword=hunter22",
        "api\u00adkey=fake12345678",
        "contraseña=hunter22",
        "Contraseña: Summer2024!",
    ],
)
def test_an_assignment_is_found_across_unicode_spaces_newlines_and_invisible_characters(
    text: str,
) -> None:
    assert kinds({"v": text}) in (["password_assignment"], ["credential_assignment"])


@pytest.mark.parametrize(
    "invisible",
    ["\u200b", "\u200c", "\u200d", "\u00ad", "\u2060", "\ufeff", "\u180e", "\u2062",
     "\U000e0041", "\u034f", "\ufe0f", "\ufe00", "\u3164", "\uffa0", "\u115f", "\u17b4",
     "\u180b", "\U000e0100"],
)  # fmt: skip
def test_an_invisible_character_inside_a_token_does_not_hide_it(invisible: str) -> None:
    """Zero-width spaces and joiners, soft hyphens, word joiners and BOMs (Unicode
    category Cf), and the other default-ignorable code points (variation selectors, the
    combining grapheme joiner, Hangul fillers), render as nothing, so the token still
    reads, and pastes, as the key; a credential-named key is still one."""
    aws = FAKE["aws_access_key_id"]
    github = FAKE["github_token"]
    assert kinds({"v": aws[:4] + invisible + aws[4:]}) == ["aws_access_key_id"]
    assert kinds({"v": f"key {github[:10]}{invisible}{github[10:]} here"}) == ["github_token"]
    assert kinds({(aws[:4] + invisible + aws[4:]): 1}) == ["aws_access_key_id"]
    assert kinds({"v": f"pass{invisible}word=hunter22"}) == ["password_assignment"]
    assert kinds({f"pass{invisible}word": "hunter22"}) == ["credential_field"]


def test_password_after_a_colon_needs_a_digit() -> None:
    assert kinds({"v": "Password: reset it from the account page"}) == []
    assert kinds({"v": "Password: Summer2024!"}) == ["password_assignment"]
    assert kinds({"v": '{"db_password": "s3cretvalue"}'}) == ["password_assignment"]


def test_several_formats_in_one_string_are_each_reported_once() -> None:
    text = f"{FAKE['aws_access_key_id']} {FAKE['aws_access_key_id']} {FAKE['github_token']}"
    assert sorted(kinds({"v": text})) == ["aws_access_key_id", "github_token"]


# -- credential-named keys -------------------------------------------------------------------------


@pytest.mark.parametrize(
    "key",
    ["password", "Password", "passwd", "secret", "client_secret", "Client-Secret", "api_key",
     "apiKey", "API-KEY", "x-api-key", "access_token", "refreshToken", "private_key",
     "authorization", "db_password", "AWS_SECRET_ACCESS_KEY", "pass", "passcode", "token",
     "api_token", "id_token", "github_api_token"],
)  # fmt: skip
def test_a_credential_named_key_makes_its_string_a_finding(key: str) -> None:
    assert find_secrets({"auth": {key: "hunter2"}}) == [
        SecretFinding(f"auth/{key}", "credential_field", False)
    ]


def test_a_name_quoted_back_is_redacted_when_it_is_a_credential() -> None:
    assert quotable("sk_live_4eC39HqLyjWDarjtT1zdp7dc") == "sk_l…"
    for name in ("cancel_order", "order_id", "lookup_ordr"):
        assert quotable(name) == name


@pytest.mark.parametrize(
    "arguments",
    [
        {"password": ""},
        {"password": "****"},
        {"password": "<redacted>"},
        {"password": 1234},
        {"password": None},
        {"password_hint": "the name of your first pet"},
        {"secret_question": "first school"},
        {"token_count": "1200"},
        {"next_page_token": "page-2"},
        {"pwd": "/home/deploy"},
    ],
)
def test_keys_that_do_not_name_a_credential_or_values_without_one(arguments: Any) -> None:
    assert find_secrets(arguments) == []


def test_a_value_nested_under_a_credential_key_is_a_credential() -> None:
    """A list, an object or a float under ``password`` holds the password as well."""
    assert find_secrets({"password": ["hunter2hunter2"]}) == [
        SecretFinding("password/0", "credential_field", False)
    ]
    assert find_secrets({"auth": {"password": {"value": "hunter2hunter2"}}}) == [
        SecretFinding("auth/password/value", "credential_field", False)
    ]
    assert find_secrets({"api_key": [[{"v": 20241122093011}]]}) == [
        SecretFinding("api_key/0/0/v", "credential_field", False)
    ]
    assert find_secrets({"password": 12345678.0}) == [
        SecretFinding("password", "credential_field", False)
    ]
    assert find_secrets({"secret": [12345678.5, 1.5, 1234, True, None, "", "****"]}) == [
        SecretFinding("secret/0", "credential_field", False)
    ]
    assert find_secrets({"password_hint": ["the name of your first pet", 1.5e9]}) == []


def test_a_known_format_under_a_credential_key_keeps_its_precise_kind() -> None:
    assert kinds({"Authorization": FAKE["bearer_token"].split(": ", 1)[1]}) == ["bearer_token"]


# -- walking: nesting, lists, keys, paths ----------------------------------------------------------


def test_nested_values_and_lists_are_found_with_their_paths() -> None:
    arguments = {
        "order_id": "WO-12345-A",
        "metadata": {"notes": f"token {FAKE['github_token']}", "tags": ["a", "b"]},
        "headers": [FAKE["bearer_token"], "Accept: application/json"],
        "items": [{"sku": "RED-SHIRT", "extra": [{"deep": FAKE["aws_access_key_id"]}]}],
    }
    assert sorted(find_secrets(arguments), key=lambda f: f.path) == [
        SecretFinding("headers/0", "bearer_token", False),
        SecretFinding("items/0/extra/0/deep", "aws_access_key_id", False),
        SecretFinding("metadata/notes", "github_token", False),
    ]


def test_a_secret_object_key_is_found_and_truncated_in_the_path() -> None:
    secret = FAKE["github_token"]
    found = find_secrets({"metadata": {secret: "x"}})
    assert found == [SecretFinding("metadata/ghp_…", "github_token", True)]


def test_paths_under_a_secret_key_use_the_truncated_key() -> None:
    secret = FAKE["stripe_secret_key"]
    found = find_secrets({secret: {"db": FAKE["url_credentials"]}})
    assert sorted(found, key=lambda f: f.in_key) == [
        SecretFinding("sk_l…/db", "url_credentials", False),
        SecretFinding("sk_l…", "stripe_secret_key", True),
    ]


@pytest.mark.parametrize("name", sorted(FAKE))
def test_no_secret_is_ever_echoed_in_a_path_or_a_kind(name: str) -> None:
    secret = FAKE[name]
    found = find_secrets({"metadata": {secret: "x", "inner": {secret: {"k": secret}}}, secret: 1})
    assert found
    assert any(f.in_key for f in found)
    assert_never_echoed(found, secret)
    assert_never_echoed(found, secret.lower())


def test_limit_stops_the_walk() -> None:
    arguments = {f"k{i}": FAKE["aws_access_key_id"] for i in range(50)}
    assert len(find_secrets(arguments)) == 8
    assert len(find_secrets(arguments, limit=3)) == 3
    assert find_secrets(arguments, limit=0) == []


def test_very_deep_nesting_does_not_recurse() -> None:
    deep: Any = FAKE["aws_access_key_id"]
    for i in range(50_000):
        deep = [deep] if i % 2 else {"k": deep}
    found = find_secrets(deep)
    assert [f.kind for f in found] == ["aws_access_key_id"]
    assert found[0].path.count("/") == 49_999
    assert find_urls(deep) == []


def test_non_json_leaves_and_keys_are_tolerated() -> None:
    value = {1: FAKE["aws_access_key_id"], "t": (FAKE["jwt"],), "o": object(), "b": b"x"}
    assert sorted(kinds(value)) == ["aws_access_key_id", "jwt"]


# -- no false positives on ordinary values ---------------------------------------------------------

BENIGN = [
    # English
    "Customer asked to cancel before shipping",
    "The package arrived damaged; the customer wants a replacement, not a refund.",
    "Please reset your password using the link we sent; it expires in 24 hours.",
    "Your password: must be at least 12 characters and include a number.",
    "The bearer of this voucher may return the item within 30 days.",
    "Basic understanding of German is required for this role.",
    "Rotate the api_key before the audit on 2024-12-01, then update the runbook.",
    "Meeting notes: discussed Q3 roadmap, token budget and key risks for 2025.",
    "Hi team, order WO-12345-A shipped on 2024-11-22 via UPS 1Z999AA10123456784.",
    # German
    "Sehr geehrte Damen und Herren, die Lieferung zu ORD-12345 ist beschädigt angekommen.",
    "Bitte setzen Sie Ihr Passwort zurück: der Link ist 24 Stunden gültig.",
    "Rindfleischetikettierungsüberwachungsaufgabenübertragungsgesetz wurde 2013 aufgehoben.",
    "Die Kundenzufriedenheitsumfrage2024 ergab 87 Prozent Zustimmung.",
    # Japanese
    "ご注文番号WO-12345-Aの商品が破損して届きました。交換をお願いします。",
    "パスワードを再設定するには、メールのリンクをクリックしてください。",
    "2024年11月22日に発送しました。追跡番号は1Z999AA10123456784です。",
    # Spanish, French
    "Hola, el pedido INV-2024-000123 llegó incompleto; falta una pieza.",
    "Por favor, cambie su contraseña cada 90 días según la política de seguridad.",
    "La reunión se movió al jueves 28 de noviembre a las 10:30 en la sala B.",
    "Merci de confirmer la livraison avant vendredi, référence CUS-004211.",
    # ids
    "WO-12345-A", "ORD-12345", "cust_9921_beta", "INV-2024-000123", "CUS-004211",
    "PM-7Q2K9X4M1A", "TCK-0042117", "USR-00418822", "acc_0012345678", "INV-20261104217",
    "ORD-2024-11-000123-REFUND-PARTIAL-2", "SKU-RED-SHIRT-XL-2024-SPRING",
    # IBANs, tracking numbers, phone numbers, amounts
    "DE89370400440532013000", "GB29NWBK60161331926819", "FR1420041010050500013M02606",
    "1Z999AA10123456784", "9400111899223856925520", "+49 30 1234567", "EUR 1.234,56",
    # dates and times
    "2024-11-22", "2024-11-22T10:00:00Z", "2024-11-22T10:00:00.123456+01:00",
    "22.11.2024", "November 22, 2024", "20241122T100000Z", "2024-W47",
    # hex digests and ids
    "da39a3ee5e6b4b0d3255bfef95601890afd80709",
    "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855",
    "sha256:e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855",
    "E3B0C44298FC1C149AFBF4C8996FB92427AE41E4649B934CA495991B7852B855",
    "d41d8cd98f00b204e9800998ecf8427e",
    "0x742d35Cc6634C0532925a3b844Bc454e4438f44e",
    # UUIDs
    "4b9f0d1e-5c1a-4d0e-9a51-0b5e6f3c2d10",
    "4B9F0D1E-5C1A-4D0E-9A51-0B5E6F3C2D10",
    "4b9f0d1e5c1a4d0e9a510b5e6f3c2d10",
    "{4b9f0d1e-5c1a-4d0e-9a51-0b5e6f3c2d10}",
    "urn:uuid:4b9f0d1e-5c1a-4d0e-9a51-0b5e6f3c2d10",
    # e-mail, URLs without credentials, file paths
    "jane.doe+billing@example.org",
    "https://help.example.com/returns",
    "https://help.example.com/returns?lang=de&ref=email_campaign_2024#section-3",
    "https://drive.example.com/file/d/1AbCdEfGhIjKlMnOpQrStUvWxYz012345/view",
    "http://localhost:8080/api/v2/customers/CUS004211/orders",
    "/var/log/nginx/access.log.2024-11-22.gz",
    "/home/deploy/releases/20241122100000/current",
    "C:\\Users\\jane\\Documents\\Q3_report_final_v2.xlsx",
    "src/components/CustomerSatisfactionSurvey2024.tsx",
    "app/controllers/api/v2/OrdersController",
    "s3://acme-invoices-eu-west-1/2024/11/INV-2024-000123.pdf",
    # long identifiers
    "customer_satisfaction_survey_2024",
    "getCustomerSatisfactionSurveyResults2024",
    "IBANValidationServiceImplV2",
    "ProjectAlphaQ3Roadmap2024Draft",
    "XMLHttpRequestEventTarget",
    "quarterly_revenue_report_q3_2024_final",
    "shipment_tracking_number_1Z999AA10123456784",
    "SELECT_customer_id_FROM_orders_2024",
    "v2_3_14_release_candidate_build_20241122",
    "user_id_7f3a2b_session_42_retry_3",
    "AbstractSingletonProxyFactoryBean",
    "HTMLParagraphElementPrototype2",
    "ip-10-0-12-34.eu-west-1.compute.internal",
    "arn:aws:iam::123456789012:role/ServiceRole",
    "projects/my-project-123/locations/us-central1/functions/handler",
    "order_payment", "replacement_item", "customer_request",
]  # fmt: skip


def test_the_benign_corpus_is_large_and_varied() -> None:
    assert len(BENIGN) >= 60
    assert len(set(BENIGN)) == len(BENIGN)


@pytest.mark.parametrize("text", BENIGN)
def test_no_false_positive_on_ordinary_values(text: str) -> None:
    assert find_secrets({"value": text}) == []
    assert find_secrets({text: "x"}) == []
    assert find_secrets([text, {"nested": [text]}]) == []


def test_no_false_positive_on_the_whole_corpus_as_one_text() -> None:
    assert find_secrets({"body": "\n".join(BENIGN)}) == []


# -- entropy ---------------------------------------------------------------------------------------

BASE62 = string.ascii_letters + string.digits
BASE64URL = BASE62 + "-_"


def test_random_tokens_of_24_characters_or_more_are_flagged() -> None:
    """At least 99% of 4,000 seeded random base62/base64url tokens of 24 to 64 characters."""
    rng = random.Random(20241122)
    tokens = [
        "".join(rng.choice(alphabet) for _ in range(rng.randint(24, 64)))
        for alphabet in (BASE62, BASE64URL)
        for _ in range(2_000)
    ]
    flagged = sum(1 for t in tokens if kinds({"v": t}) == ["high_entropy"])
    assert flagged / len(tokens) >= 0.99, flagged


def test_random_tokens_are_flagged_in_prose_in_quotes_and_after_a_colon() -> None:
    token = "q7Rz2LmX9vKd4TfW8nBc3HpY"
    for text in (
        f"use {token} to log in",
        f'{{"value": "{token}"}}',
        f"key:{token}",
        f"[{token}]",
        f"the token is {token}.",
    ):
        assert kinds({"v": text}) == ["high_entropy"], text


def test_tokens_glued_into_hosts_addresses_and_urls_are_not_judged() -> None:
    token = "q7Rz2LmX9vKd4TfW8nBc3HpY"
    for text in (f"{token}@example.com", f"files.example.com/{token}", f"https://x.io/{token}"):
        assert kinds({"v": text}) == [], text


def test_base64_of_ordinary_data_is_flagged() -> None:
    """Documented behaviour: an opaque base64 blob cannot be told from a key."""
    assert kinds({"v": base64.b64encode(b"the quick brown fox").decode()}) == ["high_entropy"]


# -- encoded secrets -------------------------------------------------------------------------------


def _b64(text: str) -> str:
    return base64.b64encode(text.encode()).decode()


def _percent(text: str) -> str:
    return "".join(f"%{b:02X}" for b in text.encode())


ENCODINGS = {
    "base64": _b64,
    "base64url": lambda t: base64.urlsafe_b64encode(t.encode()).decode().rstrip("="),
    "hex": lambda t: t.encode().hex(),
    "0x hex": lambda t: "0x" + t.encode().hex().upper(),
    "percent": _percent,
    "base64 of base64": lambda t: _b64(_b64(t)),
    "percent of base64": lambda t: _percent(_b64(t)),
    "data URL": lambda t: "data:text/plain;base64," + _b64(t),
    "URL path": lambda t: "https://files.example.com/v1/" + _b64(t) + "/raw",
    "JSON string": lambda t: '{"blob": "' + _b64(t) + '"}',
}


@pytest.mark.parametrize("encoding", sorted(ENCODINGS))
@pytest.mark.parametrize(
    "name", ["aws_access_key_id", "github_token", "private_key", "password_assignment"]
)
def test_an_encoded_secret_is_found_by_its_own_kind(encoding: str, name: str) -> None:
    """Encoding a key is the cheapest way past a scanner, and whatever receives the
    argument can decode it: base64, hex and percent-encoding are undone, twice at most."""
    kind = EXPECTED_KIND.get(name, name)
    assert kind in kinds({"v": ENCODINGS[encoding](FAKE[name])})


def test_encoded_ordinary_text_is_not_a_secret_of_a_known_kind() -> None:
    """Decoding finds only what is there: hex and percent-encoded prose stay clean."""
    text = "Customer asked to cancel before shipping, order WO-12345-A"
    assert kinds({"v": text.encode().hex()}) == []
    assert kinds({"v": _percent(text)}) == []
    assert kinds({"v": "password=%DB_PASSWORD%"}) == []
    assert kinds({"v": "https://x.io/search?q=reset%20my%20password%3F&page=2"}) == []


@pytest.mark.timeout(10, method="signal")
def test_encoded_text_is_scanned_in_linear_time() -> None:
    """Each decoding shrinks the text and at most two are undone: 64 KiB of nested
    base64, hex or percent escapes of a keyword repeated cost a few scans of it."""
    for prefix in ("password=", "sk-", "eyJ", "pwd:pwd:", "://a@", "AKIA"):
        text = prefix * (40_000 // len(prefix))
        for encode in ENCODINGS.values():
            find_secrets({"v": encode(text)[:65_536]})


def test_a_random_token_as_the_whole_userinfo_is_a_credential() -> None:
    """Git hosts take a token as the user name alone (``https://<token>@github.com``);
    a user name that reads as a name is not one."""
    token = "q7Rz2LmX9vKd4TfW8nBc3HpY"
    assert kinds({"v": f"https://{token}@github.com/org/repo.git"}) == ["url_credentials"]
    for text in ("https://git@github.com/org/repo.git", "ssh://customer_support_2024@x.io/"):
        assert kinds({"v": text}) == [], text


# -- cost ------------------------------------------------------------------------------------------

REPEATED = (
    # each token format's first characters
    "AKIA", "ASIA", "AIza", "ghp_", "github_pat_", "glpat-", "xoxb-", "sk_live_", "rk_live_",
    "whsec_", "npm_", "sk-ant-", "sk-", "eyJ", "SG.", "ya29.", "hooks.slack.com/services/",
    "discord.com/api/webhooks/12345/",
    # each phrase format's keyword, with its separator
    "Bearer ", "Basic ", "Token ", "-----BEGIN ", "://a:", "password=", "password:", "pwd:",
    "kennwort=", "contraseña=", "api_key=", "secret:", "access_token=", "key=", "pass_word=",
    # a run the entropy check reads
    "aZ3",
)  # fmt: skip


@pytest.mark.timeout(10, method="signal")
def test_a_repeated_prefix_is_scanned_in_linear_time() -> None:
    """64 KiB (the most a proposal's arguments may hold) of one prefix repeated, in a value
    and in a key. A pattern tried at every repetition that reads to the end of the run
    costs time quadratic in the length: over two minutes in all here (``sk-sk-sk-…``
    alone 20 s), where a linear scan takes well under a second. The time limit tells the
    two apart with a margin of more than ten either way, so it cannot flake."""
    for prefix in REPEATED:
        text = (prefix * (65_536 // len(prefix) + 1))[:65_536]
        find_secrets({text: text})


def test_long_keys_are_not_kept_after_the_scan() -> None:
    """Only short keys are remembered: 4096 distinct keys of 64 KiB would hold 256 MiB."""
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for i in range(64):
            find_secrets({f"{i:04d}" + "customer note " * 4_600: "ok"})
        gc.collect()
        kept = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert kept < 1_000_000  # the keys themselves come to 4 MB


# -- hypothesis: never raise -----------------------------------------------------------------------

FRAGMENTS = (
    "password=", "Password: ", "Bearer ", "Basic ", "://", "@", "-----BEGIN ", "eyJ", "AKIA",
    "ghp_", "sk-", "sk-ant-", "api_key=", "javascript:", "data:,", "www.", "http://", "https://",
    "\t", "\u0130", "0x", "[::1]", "xn--", "\u3002", "\u200b", "\u00a0", "\ufb03", "<", "${",
)  # fmt: skip
texts = st.text(max_size=60) | st.builds(
    lambda a, b, c: a + b + c, st.text(max_size=20), st.sampled_from(FRAGMENTS), st.text()
)
json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | texts,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(texts, inner, max_size=4),
    max_leaves=20,
)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(json_values, st.integers(0, 10))
def test_the_detectors_never_raise_on_any_json_value(value: Any, limit: int) -> None:
    found = find_secrets(value, limit=limit)
    assert len(found) <= limit
    assert all(isinstance(f, SecretFinding) for f in found)
    for path, url in find_urls(value):
        assert isinstance(path, str)
        for policy in ("allowlisted_domains", "private_network_only", "unrestricted_with_approval"):
            reason = egress_violation(url, policy, ("example.com",), ("corp.internal",))
            assert reason is None or isinstance(reason, str)


@settings(max_examples=400, deadline=None)
@given(texts)
def test_egress_never_raises_on_any_text(url: str) -> None:
    for policy in ("allowlisted_domains", "private_network_only", "unrestricted_with_approval"):
        reason = egress_violation(url, policy, ("example.com", "bücher.de"), ("corp.internal",))
        assert reason is None or isinstance(reason, str)


# -- URLs ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "url"),
    [
        ("https://help.example.com/returns", "https://help.example.com/returns"),
        ("  https://x.io/a?b=c \n", "https://x.io/a?b=c"),
        ("HTTP://X.IO", "HTTP://X.IO"),
        ("ftp://files.example.com/a", "ftp://files.example.com/a"),
        ("s3://bucket/key", "s3://bucket/key"),
        ("www.example.com/path", "www.example.com/path"),
        ("javascript:alert(1)", "javascript:alert(1)"),
        ("JavaScript:alert('a b')", "JavaScript:alert('a b')"),
        ("java\tscript:alert(1)", "java\tscript:alert(1)"),
        ("data:text/html;base64,PHNjcmlwdD4=", "data:text/html;base64,PHNjcmlwdD4="),
        ("file:///etc/passwd", "file:///etc/passwd"),
        ("gopher://evil.example:70/_x", "gopher://evil.example:70/_x"),
    ],
)
def test_a_string_that_is_a_url_is_returned(text: str, url: str) -> None:
    assert find_urls({"u": text}) == [("u", url)]


@pytest.mark.parametrize(
    "text",
    [
        "see https://help.example.com/returns for details",
        "www.example.com is down",
        "JavaScript: The Good Parts",
        "Data: see attached",
        "file: report.pdf",
        "mailto:jane@example.com",
        "10:30",
        "example.com",
        "a.b",
        "",
    ],
)
def test_prose_and_non_urls_are_not_returned(text: str) -> None:
    assert find_urls({"u": text}) == []


@pytest.mark.parametrize(
    "text",
    [
        "http://localhost:6379/\xa0x",
        "https://evil.example.net/a\u3000b",
        "http://169.254.169.254/\u2028latest/meta-data/",
        "https://docs.example.com\xa0@evil.com/",
        "https://docs.example.com has the form",
    ],
)
def test_a_string_that_starts_with_scheme_and_host_is_checked_whatever_follows(
    text: str,
) -> None:
    """An HTTP client handed it connects to the host its authority names (up to the
    first / ? #), whatever follows: unless that authority ends before the first space,
    the whole string is checked, and refused for its whitespace even on an allowed
    domain."""
    assert find_urls({"u": text}) == [("u", text)]
    assert egress_violation(text, "allowlisted_domains", ("example.com",), ()) is not None


@pytest.mark.parametrize(
    ("text", "url"),
    [
        ("https://help.example.com/returns is down", "https://help.example.com/returns"),
        ("https://evil.example.net/x has the form", "https://evil.example.net/x"),
    ],
)
def test_prose_after_a_whole_url_checks_that_url(text: str, url: str) -> None:
    assert find_urls({"u": text}) == [("u", url)]
    allowed = egress_violation(url, "allowlisted_domains", ("help.example.com",), ())
    assert (allowed is None) == url.startswith("https://help.")


def test_control_characters_around_a_url_do_not_hide_it() -> None:
    """Browsers strip them; the URL comes back with them, for egress to refuse."""
    found = find_urls({"u": "\x01javascript:alert(1)", "v": "\u200bhttps://x.io"})
    assert sorted(found) == [("u", "\x01javascript:alert(1)"), ("v", "\u200bhttps://x.io")]
    for _, url in found:
        assert egress_violation(url, "unrestricted_with_approval", (), ()) is not None


def test_urls_are_found_in_nested_values_with_their_paths() -> None:
    value = {
        "a": [{"u": "https://x.io"}, "plain", "www.y.io"],
        "n": 5,
        "b": {"c": {"d": "javascript:void(0)"}},
        FAKE["github_token"]: "https://z.io",
    }
    assert sorted(find_urls(value)) == [
        ("a/0/u", "https://x.io"),
        ("a/2", "www.y.io"),
        ("b/c/d", "javascript:void(0)"),
        ("ghp_…", "https://z.io"),
    ]
    assert find_urls("https://x.io") == [("", "https://x.io")]


def test_an_object_key_that_is_a_url_is_checked_like_a_value() -> None:
    """A tool taking a map may send to its keys: a header map, a URL-to-label map."""
    value = {
        "headers": {"https://evil.example/x": "1", "Accept": "text/html"},
        "targets": {"//evil.example/y": {"label": "https://docs.example.com/"}},
        "u": {"www.evil.example": "https://docs.example.com/"},
    }
    assert find_urls(value) == [
        ("headers/https://evil.example/x", "https://evil.example/x"),
        ("targets///evil.example/y", "//evil.example/y"),
        ("targets///evil.example/y/label", "https://docs.example.com/"),
        ("u/www.evil.example", "www.evil.example"),
        ("u/www.evil.example", "https://docs.example.com/"),
    ]
    reason = egress_violation("https://evil.example/x", "allowlisted_domains", ("example.com",), ())
    assert reason is not None


@pytest.mark.parametrize(
    "key",
    ["Content-Type", "product.area", "note: see below", "v1.2.3", "a\\b", "user@example.com",
     "Host", "https", "see https://evil.example/ for details"],
)  # fmt: skip
def test_an_object_key_that_is_not_a_url_is_not_returned(key: str) -> None:
    assert find_urls({"headers": {key: "1"}}) == []


# -- egress ----------------------------------------------------------------------------------------

ALLOWED = ("example.com", "localhost", "internal", "127.0.0.1")
INTERNAL = ("example.com", "corp.internal", "localhost", "internal")
POLICIES = ("allowlisted_domains", "private_network_only", "unrestricted_with_approval")

ALWAYS_REFUSED = [
    # schemes other than http(s)
    "ftp://example.com/a", "file:///etc/passwd", "javascript:alert(1)", "data:,hi",
    "gopher://example.com:70/", "ws://example.com/socket",
    # userinfo
    "https://good.example.com@evil.io/", "https://u:p@example.com/", "https://u@example.com/",
    "https://example.com%40evil.io@evil.io",
    # IP literals in any spelling
    "https://127.0.0.1/", "https://2130706433/", "https://0x7f.1/", "https://0177.0.0.1/",
    "https://0x7f000001/", "https://127.1/", "https://[::1]/", "https://[::ffff:127.0.0.1]/",
    "https://169.254.169.254/latest/meta-data/", "https://10.0.0.5:8443/",
    # localhost and metadata hosts
    "https://localhost/", "https://localhost:8080/x", "https://api.localhost/",
    "https://metadata.google.internal/computeMetadata/v1/", "https://metadata/",
    # characters outside [a-z0-9.-], look-alikes
    "https://exa_mple.com/", "https://ex%61mple.com/", "https://exa mple.com/",
    "https://\uff45\uff58\uff41\uff4d\uff50\uff4c\uff45.com/", "https://example\u3002com/", "https://exa\u200bmple.com/",
    # backslashes and control characters
    "https://example.com\\@evil.io/", "https:\\\\example.com", "https://example.com/a\\b",
    "https://exa\tmple.com/", "https://example.com/\x00", "https://example.com/\u202etxt",
    "https://example.com\n.evil.io/",
    # unparseable
    "https://", "https:///example.com", "https:/example.com", "https:example.com",
    "https://example.com:99999/", "https://example.com:abc/", "https://.example.com",
    "https://example..com", "//example.com/x", "www.example.com", "example.com", "", "   ",
]  # fmt: skip


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("url", ALWAYS_REFUSED)
def test_always_refused_whatever_the_policy(url: str, policy: str) -> None:
    reason = egress_violation(url, policy, ALLOWED, INTERNAL)
    assert reason is not None
    assert isinstance(reason, str)
    assert 0 < len(reason) < 200


def test_plain_http_is_refused_except_on_the_private_network() -> None:
    url = "http://orders.corp.internal/x"
    assert egress_violation(url, "private_network_only", (), INTERNAL) is None
    assert egress_violation(url, "allowlisted_domains", ("corp.internal",), ()) is not None
    assert egress_violation("http://example.org/", "unrestricted_with_approval", (), ()) is not None


def test_policy_none_refuses_every_url() -> None:
    assert egress_violation("https://example.com/", "none", ("example.com",), INTERNAL) is not None


def test_an_unknown_policy_is_refused() -> None:
    assert egress_violation("https://example.com/", "anything", ("example.com",), ()) is not None


@pytest.mark.parametrize(
    ("url", "allowed"),
    [
        ("https://example.com", True),
        ("https://example.com/path?q=1#f", True),
        ("https://api.example.com/v1", True),
        ("https://a.b.example.com:443/", True),
        ("https://a.b.example.com:8443/", False),
        ("HTTPS://EXAMPLE.COM./", True),
        ("https://evil-example.com/", False),
        ("https://notexample.com/", False),
        ("https://example.com.evil.io/", False),
        ("https://example.co/", False),
        ("https://com/", False),
        ("https://ex\u0430mple.com/", False),
        ("https://xn--exmple-4nf.com/", False),
    ],
)
def test_allowlisted_domains_match_on_a_label_boundary(url: str, allowed: bool) -> None:
    reason = egress_violation(url, "allowlisted_domains", ("example.com",), ())
    assert (reason is None) is allowed, reason


@pytest.mark.parametrize("policy", POLICIES)
def test_an_idn_look_alike_is_refused_under_every_policy(policy: str) -> None:
    url = "https://ex\u0430mple.com/login"
    reason = egress_violation(url, policy, ("example.com",), ("example.com",))
    assert reason is not None
    assert "look-alike" in reason


def test_a_whole_script_look_alike_is_compared_as_punycode() -> None:
    url = "https://\u0435\u0445\u0430\u0440\u0455.com/"
    reason = egress_violation(url, "allowlisted_domains", ("expss.com",), ())
    assert reason is not None
    assert "xn--" in reason


def test_a_genuine_idn_domain_matches_in_either_spelling() -> None:
    for allowed in (("bücher.de",), ("xn--bcher-kva.de",)):
        for url in ("https://bücher.de/", "https://shop.xn--bcher-kva.de/", "https://BÜCHER.de"):
            assert egress_violation(url, "allowlisted_domains", allowed, ()) is None, url


def test_allowlist_entries_are_normalised_and_empty_ones_match_nothing() -> None:
    policy = "allowlisted_domains"
    assert egress_violation("https://a.example.com/", policy, ("*.Example.COM.",), ()) is None
    assert egress_violation("https://example.com/", policy, ("", " ", "."), ()) is not None
    assert egress_violation("https://example.com/", policy, (), ()) is not None


@pytest.mark.parametrize(
    ("url", "entries", "allowed"),
    [
        ("https://docs.example.com:22/", ("example.com",), False),
        ("https://docs.example.com:6379/", ("example.com",), False),
        ("https://docs.example.com:80/", ("example.com",), False),
        ("https://docs.example.com:443/", ("example.com",), True),
        ("https://docs.example.com:0443/", ("example.com",), True),
        ("https://docs.example.com:/", ("example.com",), True),
        ("https://docs.example.com:8443/", ("example.com:8443",), True),
        ("https://a.docs.example.com:8443/", ("docs.example.com:8443",), True),
        ("https://docs.example.com/", ("example.com:8443",), False),
        ("https://docs.example.com:22/", ("example.com:8443",), False),
        ("https://docs.example.com:8443/", ("status.example.com:8443",), False),
        ("https://docs.example.com/", ("example.com", "example.com:8443"), True),
        ("https://docs.example.com:8443/", ("example.com", "example.com:8443"), True),
        ("https://docs.example.com/", ("example.com:443",), True),
    ],
)
def test_a_port_other_than_the_default_needs_an_entry_naming_it(
    url: str, entries: tuple[str, ...], allowed: bool
) -> None:
    """An HTTP client sent to port 22 or 6379 of an allowed host talks to SSH or Redis."""
    reason = egress_violation(url, "allowlisted_domains", entries, ())
    assert (reason is None) is allowed, reason
    if not allowed and "not an allowed domain" not in (reason or ""):
        assert reason is not None and reason.startswith("port ")


def test_a_refused_port_says_which_ports_the_host_allows() -> None:
    entries = ("example.com", "docs.example.com:8443")
    reason = egress_violation("https://docs.example.com:22/", "allowlisted_domains", entries, ())
    assert reason == "port 22 is not allowed on docs.example.com (allowed: 443, 8443)"


def test_a_public_host_is_reached_on_port_443_only() -> None:
    policy = "unrestricted_with_approval"
    assert egress_violation("https://example.org:443/x", policy, (), ()) is None
    for port in (22, 25, 80, 6379, 8443):
        reason = egress_violation(f"https://example.org:{port}/x", policy, (), ())
        assert reason is not None and reason.startswith(f"port {port} "), reason


@pytest.mark.parametrize(
    ("entry", "url"),
    [
        ("com", "https://evil.com/"),
        ("*.com", "https://evil.com/"),
        ("COM.", "https://evil.com/"),
        ("co.uk", "https://evil.co.uk/"),
        ("*.com.au", "https://evil.com.au/"),
        ("github.io", "https://evil.github.io/"),
        ("evil.com:0", "https://evil.com/"),
        ("https://evil.com", "https://evil.com/"),
    ],
)
def test_an_entry_covering_strangers_hosts_or_no_host_allows_nothing(entry: str, url: str) -> None:
    """The policy loader refuses these; egress drops them too, for a policy built otherwise."""
    for policy, allowed, internal in (
        ("allowlisted_domains", (entry,), ()),
        ("private_network_only", (), (entry,)),
    ):
        assert egress_violation(url, policy, allowed, internal) is not None, (policy, entry)


@pytest.mark.parametrize(
    ("url", "allowed"),
    [
        ("https://orders.corp.internal/v1", True),
        ("http://corp.internal:8080/", True),
        ("http://orders.corp.internal:8080/", True),
        ("http://corp.internal:6379/", False),
        ("https://corp.internal.evil.io/", False),
        ("https://evilcorp.internal/", False),
        ("https://example.org/", False),
    ],
)
def test_private_network_only_stays_within_the_internal_domains(url: str, allowed: bool) -> None:
    internal = ("corp.internal", "corp.internal:8080")
    reason = egress_violation(url, "private_network_only", (), internal)
    assert (reason is None) is allowed, reason


@pytest.mark.parametrize(
    ("url", "allowed"),
    [
        ("https://status.carrier.example/", False),
        ("https://status.carrier-example.io/track?id=1", True),
        ("https://xn--bcher-kva.de/", True),
        ("https://bücher.de/", True),
        ("https://\u043f\u0440\u0438\u043c\u0435\u0440.\u0440\u0444/", True),
        ("https://ex\u0430mple.com/", False),
        ("http://example.org/", False),
        ("https://orders.corp.internal/", False),
        ("https://intranet/", False),
        ("https://printer.local/", False),
        ("https://router.home.arpa/", False),
    ],
)
def test_unrestricted_with_approval_allows_public_https_hosts_only(url: str, allowed: bool) -> None:
    reason = egress_violation(url, "unrestricted_with_approval", (), ("corp.internal",))
    assert (reason is None) is allowed, reason


def test_a_port_too_long_to_be_a_number_is_refused_not_raised() -> None:
    """``int`` refuses strings of more than 4300 digits; such a port is simply bad."""
    for port in ("1" * 5_000, "9" * 6, "65536"):
        url = f"https://internal.example.com:{port}/"
        for policy in POLICIES:
            reason = egress_violation(url, policy, ("example.com",), ("internal.example.com",))
            assert reason == "malformed URL: bad port", (policy, reason)
    url = "https://internal.example.com:" + "0" * 5_000 + "443/"
    assert egress_violation(url, "private_network_only", (), ("internal.example.com",)) is None


@pytest.mark.timeout(10, method="signal")
def test_a_host_longer_than_dns_allows_is_refused_before_idna() -> None:
    """IDNA's nameprep costs microseconds a character: 64 distinct hosts of 64 KiB, one a
    proposal, took about half a second each before the length was checked first."""
    for i in range(64):
        url = f"https://{i}" + "\u00e9" * 65_000 + ".example.com/"
        reason = egress_violation(url, "allowlisted_domains", ("example.com",), ())
        assert reason is not None and "longer than 253" in reason


def test_odd_argument_types_are_refused_not_raised() -> None:
    """Callers are typed, but a list for a tuple or a missing value must not raise."""
    as_list: Any = ["example.com"]
    nothing: Any = None
    junk: Any = (None, 3)
    policy = "allowlisted_domains"
    assert egress_violation("https://a.example.com/", policy, as_list, as_list) is None
    assert egress_violation(nothing, policy, ("example.com",), ()) is not None
    assert egress_violation("https://example.com/", nothing, ("example.com",), ()) is not None
    assert egress_violation("https://example.com/", policy, junk, ()) is not None


def test_the_most_basic_problem_is_named_first() -> None:
    """Fixing the reason given must be worth a retry: not "use https" for a metadata host."""
    policy = "allowlisted_domains"
    assert "IP address" in str(egress_violation("http://169.254.169.254/", policy, (), ()))
    assert "localhost" in str(egress_violation("http://localhost/", policy, ("localhost",), ()))
    assert "allowed domain" in str(
        egress_violation("http://evil.io/", policy, ("example.com",), ())
    )
    assert "https" in str(egress_violation("http://example.com/", policy, ("example.com",), ()))


def test_reasons_never_echo_credentials() -> None:
    url = "https://admin:" + "n0t-real-pw" + "@example.com/"
    for policy in POLICIES:
        reason = egress_violation(url, policy, ("example.com",), ())
        assert reason is not None
        assert "n0t-real-pw" not in reason


@pytest.mark.parametrize(
    "text",
    [
        "the token expired yesterday, so we made a new one",
        "Token ring networks were common in 1985 and 1986",
        "a token of 12 characters",
    ],
)
def test_the_word_token_in_prose_is_not_a_credential(text: str) -> None:
    assert kinds({"note": text}) == []


def test_a_number_under_a_credential_key_is_a_credential() -> None:
    """{"password": 12345678}: the credential-named key gives a number of six digits or
    more away as it does a string; a count under another key does not."""
    assert find_secrets({"password": 12345678, "max_tokens": 409600, "limit": 10}) == [
        SecretFinding("password", "credential_field", False)
    ]
    assert kinds({"api_key": 20241122093011, "retries": True, "secret": 1.5}) == [
        "credential_field"
    ]


@pytest.mark.parametrize("url", ["https:/evil.com", "https:evil.com", "https:\\\\evil.com"])
def test_an_http_url_with_irregular_slashes_is_still_checked(url: str) -> None:
    """WHATWG parsers connect to evil.com for each of these: they are URLs to check, and
    the strict check refuses them."""
    assert find_urls({"callback": url}) == [("callback", url)]
    assert egress_violation(url, "allowlisted_domains", ("example.com",), ()) is not None
    assert find_urls({"note": "http: is the scheme, https: the safer one"}) == []


@pytest.mark.parametrize(
    "url", ["//evil.example/x", "//localhost/admin", "\\\\evil.example\\share", "/\\evil.example"]
)
def test_a_scheme_relative_url_is_checked(url: str) -> None:
    """Resolved against an executor's base URL, ``//host`` names the host it connects to
    (``urljoin("https://api.internal/", "//evil.example")``), and ``\\\\host`` is a share:
    both are handed to the egress check, which refuses them for their missing scheme."""
    assert find_urls({"callback": url}) == [("callback", url)]
    for policy in POLICIES:
        assert egress_violation(url, policy, ("evil.example",), ("evil.example",)) is not None
    for text in ("// a comment", "///", "/api/v1/orders", "a//b"):
        assert find_urls({"path": text}) == [], text
