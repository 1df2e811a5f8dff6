"""The approvers file and the checks on one approval that need no Redis: who may approve
what, and that nobody approves a call made under one of their own ids."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import orjson
import pytest
from cryptography.hazmat.primitives.asymmetric import ed25519
from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

from processor import b64url
from processor.approval_flow import ApprovalInput, parse_approval_record, revoked_votes
from processor.approvals import (
    Approver,
    ApproverError,
    Binding,
    VerifiedApproval,
    iso,
    load_approvers,
    sign_approval,
    signing_bytes,
    verify_approval,
)
from processor.codec.records import ID_MAX_CHARS
from processor.model import FieldError, Principal, SideEffectClass, SourceRecord
from processor.policy import PolicyError, load_policy, parse_policy
from tests.unit.helpers import APPROVER_KEYS

KEY = ed25519.Ed25519PrivateKey.generate()
PUBLIC = b64url.encode(KEY.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw))


def _binding(requester: Principal) -> Binding:
    """The call under test, proposed by ``requester``."""
    return Binding("acme", "trace-1", "cancel_order", "1.0.0", "sha256:ab",
                   SideEffectClass.HIGH_RISK_EXTERNAL, requester.user_id,
                   requester.agent_id)  # fmt: skip


def _file(tmp_path: Path, extra: str = "") -> Path:
    path = tmp_path / "approvers.yaml"
    path.write_text(
        "approvers:\n"
        f"  - id: ops-1\n    public_key: {PUBLIC}\n    classes: [HIGH_RISK_EXTERNAL]\n{extra}"
    )
    return path


def _requester(user: str, agent: str = "agent-1") -> Principal:
    return Principal("acme", user, agent, frozenset(), "internal")


def _signed(to: Principal, now: int) -> dict[str, Any]:
    """ops-1's approval of the call under test, as proposed by ``to``."""
    return sign_approval(KEY, approver_id="ops-1", tenant_id="acme", trace_id="trace-1",
                         tool_name="cancel_order", tool_version="1.0.0",
                         payload_hash="sha256:ab", requested_by_user=to.user_id,
                         requested_by_agent=to.agent_id, now_ms=now)  # fmt: skip


def _verify(
    tmp_path: Path, requester: Principal, extra: str = "", signed_for: Principal | None = None
) -> VerifiedApproval | FieldError:
    """``requester`` presents an approval signed for the call ``signed_for`` (by default,
    the requester's own) proposed."""
    now = int(time.time() * 1000)
    approval = _signed(signed_for or requester, now)
    return verify_approval(approval, load_approvers(_file(tmp_path, extra)), _binding(requester),
                           requester, now)  # fmt: skip


@pytest.mark.parametrize(
    ("user", "agent", "own"),
    [
        ("u-7731", "agent-1", True),  # the approver's user id, listed as a subject
        ("u-1", "bot-ops-1", True),  # an agent acting for them
        ("ops-1", "agent-1", True),  # the approver id itself
        ("u-1", "agent-1", False),
    ],
)
def test_nobody_approves_a_call_made_under_one_of_their_ids(
    tmp_path: Path, user: str, agent: str, own: bool
) -> None:
    got = _verify(tmp_path, _requester(user, agent), "    subjects: [u-7731, bot-ops-1]\n")
    if own:
        assert isinstance(got, FieldError) and got.code == "self_approval"
    else:
        assert isinstance(got, VerifiedApproval) and got.approver_id == "ops-1"


@pytest.mark.parametrize(
    ("user", "agent"),
    [("u-2", "agent-1"), ("u-1", "agent-2"), ("u-2", "agent-2")],
)
def test_an_approval_given_for_one_requester_does_not_pass_for_another(
    tmp_path: Path, user: str, agent: str
) -> None:
    """Another agent (or user) of the tenant that copies a call's trace and arguments, and
    attaches the approval given for it, gets nothing: the approval names its requester."""
    got = _verify(tmp_path, _requester(user, agent), signed_for=_requester("u-1", "agent-1"))
    assert isinstance(got, FieldError) and got.code == "approval_requester_mismatch"
    assert got.message == f"the approval is bound to another {'user' if user != 'u-1' else 'agent'}"
    own = _verify(tmp_path, _requester("u-1", "agent-1"))
    assert isinstance(own, VerifiedApproval)


def test_an_approval_signed_before_requesters_were_bound_is_refused_for_naming_none(
    tmp_path: Path,
) -> None:
    """An approval an earlier version signed (no requester fields) verifies, and is then
    refused with a reason that says to sign it again, not as a bad signature."""
    requester = _requester("u-1")
    now = int(time.time() * 1000)
    approval = _signed(_requester("u-1"), now)
    old = {k: v for k, v in approval.items() if not k.startswith("requested_by_")}
    old["signature"] = b64url.encode(KEY.sign(signing_bytes(old)))
    approvers = load_approvers(_file(tmp_path))
    got = verify_approval(old, approvers, _binding(requester), requester, now)
    assert isinstance(got, FieldError) and got.code == "approval_requester_mismatch"
    assert "names no requester" in got.message
    forged = {**old, "requested_by_user": "u-1", "requested_by_agent": "agent-1"}
    got = verify_approval(forged, approvers, _binding(requester), requester, now)
    assert isinstance(got, FieldError) and got.code == "approval_signature_invalid"


def test_subjects_must_be_a_list_of_ids(tmp_path: Path) -> None:
    with pytest.raises(ApproverError, match="subjects"):
        load_approvers(_file(tmp_path, "    subjects: u-7731\n"))


@pytest.mark.parametrize(
    "extra",
    [
        "    tenants: acme*\n",  # letter by letter, it would hold "*": every tenant
        "    tenants: acme\n",
        "    tenants:\n",
        "    classes: HIGH_RISK_EXTERNAL\n",
        "    classes: {HIGH_RISK_EXTERNAL: true}\n",
        "    classes:\n",
    ],
)
def test_tenants_and_classes_must_be_lists(tmp_path: Path, extra: str) -> None:
    path = _file(tmp_path).read_text().replace("    classes: [HIGH_RISK_EXTERNAL]\n", "")
    (tmp_path / "approvers.yaml").write_text(path + extra)
    with pytest.raises(ApproverError, match="must be a list"):
        load_approvers(tmp_path / "approvers.yaml")


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("reason", 123456789012345678901234567890),  # past 64 bits: the encoder refuses it
        ("reason", [[[[]]]]),
        ("approval_scope", {"single": True}),
        ("request_id", 7),
    ],
)
def test_a_signed_field_that_is_not_text_is_refused_before_anything_is_encoded(
    tmp_path: Path, field: str, value: object
) -> None:
    requester = _requester("u-1")
    now = int(time.time() * 1000)
    approval = _signed(_requester("u-1"), now)
    got = verify_approval({**approval, field: value}, load_approvers(_file(tmp_path)),
                          _binding(requester), requester, now)  # fmt: skip
    assert isinstance(got, FieldError) and got.code == "approval_signature_invalid"
    assert got.message == f"the approval's {field} is not text"


def test_an_expiry_must_name_its_utc_offset(tmp_path: Path) -> None:
    """A time with no offset would be read in the processor's own zone."""
    requester = _requester("u-1")
    now = int(time.time() * 1000)
    approval = _signed(_requester("u-1"), now)
    naive = {**approval, "expires_at": approval["expires_at"].removesuffix("Z")}
    naive["signature"] = b64url.encode(KEY.sign(signing_bytes(naive)))
    got = verify_approval(naive, load_approvers(_file(tmp_path)), _binding(requester),
                          requester, now)  # fmt: skip
    assert isinstance(got, FieldError) and got.code == "approval_signature_invalid"
    assert "RFC 3339" in got.message


def test_an_approval_id_longer_than_any_id_a_call_may_name_is_refused(tmp_path: Path) -> None:
    """Signed by its approver, and otherwise good: the call it would release names it, and
    would not fit a message. Refused before anything is spent; an id at the bound passes."""
    requester = _requester("u-1")
    now = int(time.time() * 1000)
    approvers = load_approvers(_file(tmp_path))
    for length, ok in ((ID_MAX_CHARS, True), (ID_MAX_CHARS + 1, False)):
        approval = {**_signed(requester, now), "approval_id": "a" * length}
        approval["signature"] = b64url.encode(KEY.sign(signing_bytes(approval)))
        got = verify_approval(approval, approvers, _binding(requester), requester, now)
        assert isinstance(got, VerifiedApproval) is ok, got
    assert isinstance(got, FieldError) and got.code == "approval_signature_invalid"
    assert got.message == f"the approval's approval_id is longer than {ID_MAX_CHARS} characters"


def test_one_key_cannot_be_two_approvers(tmp_path: Path) -> None:
    """Two ids with one key would let its holder be both approvers of a critical call."""
    twin = f"  - id: ops-2\n    public_key: {PUBLIC}\n    classes: [HIGH_RISK_EXTERNAL]\n"
    with pytest.raises(ApproverError, match="same public key"):
        load_approvers(_file(tmp_path, twin))


def test_a_signature_has_one_spelling(tmp_path: Path) -> None:
    """A character outside base64url is refused, not dropped: the same signature with a
    stray character in it is another string, and not a valid signature."""
    requester = _requester("u-1")
    now = int(time.time() * 1000)
    approval = _signed(_requester("u-1"), now)
    approvers = load_approvers(_file(tmp_path))
    good = verify_approval(approval, approvers, _binding(requester), requester, now)
    assert isinstance(good, VerifiedApproval)
    sig = approval["signature"]
    for stray in ("!!!!", "    ", "\n\n\n\n", "...."):  # (whole quads: the padding holds)
        spelled = {**approval, "signature": sig[:10] + stray + sig[10:]}
        got = verify_approval(spelled, approvers, _binding(requester), requester, now)
        assert isinstance(got, FieldError) and got.code == "approval_signature_invalid", stray


def _resigned(approval: dict[str, Any], **fields: Any) -> dict[str, Any]:
    changed = {**approval, **fields}
    changed["signature"] = b64url.encode(KEY.sign(signing_bytes(changed)))
    return changed


@pytest.mark.parametrize(
    ("approved_offset_s", "lifetime_s", "limit_s", "code"),
    [
        (0, 86_400, 86_400, None),  # exactly the bound: good
        (0, 86_401, 86_400, "approval_lifetime_exceeded"),
        (0, 3_600, 600, "approval_lifetime_exceeded"),  # a stricter policy
        (-3_000, 3_600, 3_600, None),  # given 50 minutes ago, good for an hour
        (30, 600, 86_400, None),  # the approver's clock a little ahead
        (120, 600, 86_400, "approval_not_yet_valid"),  # dated two minutes from now
    ],
)
def test_an_approval_is_good_for_at_most_the_policy_s_lifetime(
    tmp_path: Path, approved_offset_s: int, lifetime_s: int, limit_s: int, code: str | None
) -> None:
    requester = _requester("u-1")
    now = int(time.time() * 1000)
    approved = now + approved_offset_s * 1000
    approval = _resigned(
        _signed(requester, now), approved_at=iso(approved),
        expires_at=iso(approved + lifetime_s * 1000),
    )  # fmt: skip
    got = verify_approval(approval, load_approvers(_file(tmp_path)), _binding(requester),
                          requester, now, max_lifetime_s=limit_s)  # fmt: skip
    if code is None:
        assert isinstance(got, VerifiedApproval), got
    else:
        assert isinstance(got, FieldError) and got.code == code, got


@pytest.mark.parametrize(
    ("approved_at", "expires_at", "code"),
    [
        ("0001-01-01T00:00:00Z", "9999-12-31T23:59:59Z", "approval_lifetime_exceeded"),
        ("9999-12-31T23:59:59-23:59", "9999-12-31T23:59:59-23:59", "approval_not_yet_valid"),
        ("0001-01-01T00:00:00+23:59", "0001-01-01T00:10:00+23:59", "approval_expired"),
        ("1969-12-31T23:50:00Z", "1969-12-31T23:59:59Z", "approval_expired"),  # negative
        ("2026-01-01T00:00:00Z", "+12026-01-01T00:00:00Z", "approval_signature_invalid"),
        ("2026-01-01T00:00:00Z", "2026-01-01T00:00:00+99:00", "approval_signature_invalid"),
    ],
)
def test_an_approval_dated_at_the_ends_of_the_calendar_is_refused(
    tmp_path: Path, approved_at: str, expires_at: str, code: str
) -> None:
    """Times a datetime holds only beyond its range once read in UTC, or does not hold at
    all, are a refusal with its code, not an error while the approval is checked."""
    requester = _requester("u-1")
    now = int(time.time() * 1000)
    approval = _resigned(_signed(requester, now), approved_at=approved_at, expires_at=expires_at)
    got = verify_approval(approval, load_approvers(_file(tmp_path)), _binding(requester),
                          requester, now)  # fmt: skip
    assert isinstance(got, FieldError) and got.code == code, got


@pytest.mark.parametrize("approved_at", [None, "", "yesterday", "2026-11-23T10:00:00"])
def test_an_approval_must_say_when_it_was_given(tmp_path: Path, approved_at: str | None) -> None:
    requester = _requester("u-1")
    now = int(time.time() * 1000)
    approval = _resigned(_signed(requester, now), approved_at=approved_at)
    got = verify_approval(approval, load_approvers(_file(tmp_path)), _binding(requester),
                          requester, now)  # fmt: skip
    assert isinstance(got, FieldError) and got.code == "approval_signature_invalid"


def test_the_lifetime_bound_is_policy() -> None:
    assert parse_policy(None).approval_max_lifetime_s == 86_400
    doc = {"confirmation": {"max_approval_lifetime_seconds": 900}}
    assert parse_policy(doc).approval_max_lifetime_s == 900
    shipped = load_policy(Path(__file__).resolve().parents[2] / "policy" / "policy.yaml")
    assert shipped.approval_max_lifetime_s == 86_400


@pytest.mark.parametrize(
    "confirmation",
    [
        {"max_approval_lifetime_seconds": 0},
        {"max_approval_lifetime_seconds": True},
        {"ttl_seconds": "600"},
        {"max_approval_lifetime_second": 900},  # a misspelt key is not ignored
        ["classes"],
    ],
)
def test_unusable_confirmation_settings_are_refused(confirmation: Any) -> None:
    with pytest.raises(PolicyError, match="confirmation"):
        parse_policy({"confirmation": confirmation})


def test_revoked_votes_are_those_of_approvers_who_may_no_longer_approve_the_call() -> None:
    """Gone from the file, no longer allowed the class or the tenant, now one of the
    requester's own identities, or cast with a key the file has replaced since: each vote
    stops counting; a trusted approver's stays, and so does a vote that recorded no key."""
    key = APPROVER_KEYS["ops-1"].public_key()
    every = frozenset(SideEffectClass)
    approvers = {
        "kept": Approver("kept", key, every, frozenset({"acme"})),
        "narrowed": Approver(
            "narrowed", key, frozenset({SideEffectClass.READ_ONLY}), frozenset("*")
        ),
        "moved": Approver("moved", key, every, frozenset({"globex"})),
        "self": Approver("self", key, every, frozenset("*"), frozenset({"u-1"})),
        "rotated": Approver("rotated", key, every, frozenset("*")),
        "unrecorded": Approver("unrecorded", key, every, frozenset("*")),
    }
    old = b64url.encode(APPROVER_KEYS["ops-2"].public_key().public_bytes_raw())
    votes = [{"id": n, "approval_id": f"appr-{n}", "key": approvers["kept"].key_print}
             for n in ("kept", "gone", "narrowed", "moved", "self")]  # fmt: skip
    votes += [{"id": "rotated", "approval_id": "appr-rotated", "key": old},
              {"id": "unrecorded", "approval_id": "appr-unrecorded"}]  # fmt: skip
    entry = {
        "tenant_id": "acme", "side_effect_class": "CRITICAL_MUTATION",
        "requested_by_user": "u-1", "requested_by_agent": "a-1", "approvers": votes,
    }  # fmt: skip
    assert revoked_votes(entry, approvers) == [
        f"appr-{n}" for n in ("gone", "narrowed", "moved", "self", "rotated")
    ]
    assert revoked_votes({**entry, "approvers": []}, approvers) == []


def _record(value: bytes | None) -> SourceRecord:
    return SourceRecord("tool.approvals", 0, 1, b"run-1", value, 0)


@pytest.mark.parametrize("kind", ["withdrawal", "decision", "EXPIRY_CHECK", 7, ["expiry_check"]])
def test_a_record_of_a_type_this_version_does_not_know_is_not_read_as_a_decision(
    kind: object,
) -> None:
    """The type is not signed: a withdrawal carrying the approval's signed fields would
    otherwise count as the approval its sender meant to take back."""
    approval = {**_signed(_requester("u-1"), 0), "request_id": "req_1"}
    assert parse_approval_record(_record(orjson.dumps({**approval, "type": kind}))) == (
        "approval_unknown_type"
    )
    for plain in (approval, {**approval, "type": None}):
        read = parse_approval_record(_record(orjson.dumps(plain)))
        assert isinstance(read, ApprovalInput) and read.kind == "decision"


@pytest.mark.parametrize(
    ("value", "reason"),
    [
        (None, "approval_not_json"),  # a tombstone
        (b"", "approval_not_json"),
        (b'{"tenant_id": "acme", "request_id": "req_1"', "approval_not_json"),  # cut short
        (b'{"tenant_id": "acme", "request_id": "req_\xff"}', "approval_not_json"),  # not UTF-8
        (b'{"tenant_id": "acme", "request_id": NaN}', "approval_not_json"),
        (b"[" * 2000 + b"]" * 2000, "approval_not_json"),
        (b'["req_1"]', "approval_not_object"),
        (b'{"tenant_id": 7, "request_id": "req_1"}', "approval_without_request"),
        (b'{"tenant_id": "acme", "request_id": ""}', "approval_without_request"),
        (b'{"tenant_id": "acme", "request_id": {"id": "req_1"}}', "approval_without_request"),
    ],
)
def test_a_record_that_names_no_request_is_refused_with_its_reason(
    value: bytes | None, reason: str
) -> None:
    assert parse_approval_record(_record(value)) == reason
