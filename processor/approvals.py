"""Approvals: who may approve what, and the signed decision that says they did.

An approval is a small JSON object signed with the approver's Ed25519 key
(the seed's approval token plus a signature). It binds one decision to one
payload hash, tool version, trace, tenant and requester (the user and agent
the call is proposed under), and carries an expiry; the processor refuses one
that is expired, bound to anything else, signed by a key it does not know,
from an approver not allowed for the call's risk class, or from the principal
that proposed the call. Bound to its requester, an approval attached to a
proposal cannot be lifted by another agent of the tenant that copies the
trace and the arguments. Use-once is enforced in Redis
(``processor.state.approvals``), because it is the only check that needs
memory.

The same object travels two ways: on ``tool.approvals`` (an operator's answer
to a confirmation packet, naming its ``request_id``) or attached to a
resubmitted proposal.
"""

from __future__ import annotations

import binascii
import hashlib
import uuid
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import orjson
import yaml_rs
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ed25519

from processor import b64url
from processor.codec.records import ID_MAX_CHARS
from processor.model import FieldError, Principal, SideEffectClass
from processor.policy import MAX_APPROVAL_LIFETIME_S

APPROVED, REJECTED = "approved", "rejected"
APPROVAL_CLOCK_SKEW_MS = 60_000
"""How far in the future ``approved_at`` may lie (the approver's clock against ours)."""

_SIGNED_FIELDS = (
    "approval_id",
    "request_id",
    "tenant_id",
    "trace_id",
    "tool_name",
    "tool_version",
    "payload_hash",
    "requested_by_user",
    "requested_by_agent",
    "approver_id",
    "decision",
    "approved_at",
    "expires_at",
    "approval_scope",
    "reason",
)


class ApproverError(ValueError):
    """The approvers file is unusable."""


@dataclass(frozen=True, slots=True)
class Approver:
    approver_id: str
    public_key: ed25519.Ed25519PublicKey
    classes: frozenset[SideEffectClass]
    tenants: frozenset[str]
    subjects: frozenset[str] = frozenset()
    """The user and agent ids this person proposes calls under, when they differ from the
    approver id: nobody may approve a call made under any of them."""

    def is_requester(self, requester: Principal) -> bool:
        names = {self.approver_id, *self.subjects}
        return requester.user_id in names or requester.agent_id in names

    def may_approve(self, cls: SideEffectClass, tenant_id: str) -> bool:
        return cls in self.classes and ("*" in self.tenants or tenant_id in self.tenants)

    @property
    def key_print(self) -> str:
        """The public key, as a vote records it: a vote cast with a key the approvers file
        has since replaced stops counting (see approval_flow.revoked_votes)."""
        return b64url.encode(self.public_key.public_bytes_raw())


def load_approvers(path: Path | None) -> dict[str, Approver]:
    if path is None:
        return {}
    path = Path(path)
    try:
        doc = yaml_rs.loads(path.read_text(), parse_datetime=False)
    except Exception as exc:
        raise ApproverError(f"{path}: cannot be read: {exc}") from exc
    entries = doc.get("approvers") if isinstance(doc, dict) else None
    if not isinstance(entries, list):
        raise ApproverError(f"{path}: expected a mapping with an 'approvers' list")
    out: dict[str, Approver] = {}
    for i, e in enumerate(entries):
        where = f"{path}: approvers[{i}]"
        if not isinstance(e, dict) or not isinstance(e.get("id"), str):
            raise ApproverError(f"{where}: needs an id")
        # Lists, not anything iterable: "tenants: acme*" read letter by letter would hold
        # "*", and its approver could approve the calls of every tenant.
        for name in ("classes", "tenants"):
            if name in e and not isinstance(e[name], list):
                raise ApproverError(f"{where}: {name} must be a list")
        try:
            raw = b64url.decode(str(e["public_key"]))
            key = ed25519.Ed25519PublicKey.from_public_bytes(raw)
            classes = frozenset(SideEffectClass(c) for c in e.get("classes", []))
        except (KeyError, ValueError, binascii.Error) as exc:
            raise ApproverError(f"{where}: {exc}") from exc
        tenants = frozenset(str(t) for t in e.get("tenants", ["*"]))
        subjects = e.get("subjects", [])
        if not isinstance(subjects, list) or not all(isinstance(x, str) for x in subjects):
            raise ApproverError(f"{where}: subjects must be a list of user or agent ids")
        if e["id"] in out:
            raise ApproverError(f"{where}: approver {e['id']!r} is listed twice")
        # Two ids with one key would let that key's holder count as the two distinct
        # approvers a critical call needs.
        for other in out.values():
            if other.public_key.public_bytes_raw() == key.public_bytes_raw():
                raise ApproverError(
                    f"{where}: approver {e['id']!r} has the same public key as "
                    f"{other.approver_id!r}: each approver needs a key of their own"
                )
        out[e["id"]] = Approver(e["id"], key, classes, tenants, frozenset(subjects))
    return out


_REQUESTER_FIELDS = ("requested_by_user", "requested_by_agent")


def signing_bytes(approval: dict[str, Any]) -> bytes:
    """The exact bytes an approver signs: the signed fields, canonical JSON. The requester
    fields are left out when the approval has none, as approvals signed before they were
    added were: such an approval still verifies, and is then refused for naming no
    requester, which says what to do about it."""
    signed = {
        k: approval.get(k) for k in _SIGNED_FIELDS if k not in _REQUESTER_FIELDS or k in approval
    }
    return orjson.dumps(signed, option=orjson.OPT_SORT_KEYS)


def iso(ms: int) -> str:
    return datetime.fromtimestamp(ms / 1000, UTC).strftime("%Y-%m-%dT%H:%M:%S.%f")[:-3] + "Z"


def shown_time(ms: int) -> str:
    """A record's time as a report shows it: ``iso``, or its epoch milliseconds when no
    calendar date holds it (a producer may stamp a record with any 64-bit time)."""
    try:
        return iso(ms)
    except (ValueError, OverflowError, OSError):
        return f"{ms} ms after the epoch"


def parse_iso_ms(text: str) -> int:
    """An RFC 3339 time in epoch ms. It must name its offset (``Z`` or ``+hh:mm``): a
    time without one would be read in whatever zone the processor runs in."""
    when = datetime.fromisoformat(text.replace("Z", "+00:00"))
    if when.tzinfo is None:
        raise ValueError(f"{text!r} names no UTC offset")
    return int(when.timestamp() * 1000)


def approval_id_for(request_id: str | None, approver_id: str, payload_hash: str) -> str:
    """One approver's answer to one parked request has one id, however often it is sent;
    an approval not tied to a request (attached to a resubmission) gets a fresh one."""
    if request_id is None:
        return "appr_" + uuid.uuid4().hex[:24]
    material = f"{request_id}/{approver_id}/{payload_hash}".encode()
    return "appr_" + hashlib.sha256(material).hexdigest()[:24]


def sign_approval(
    private_key: ed25519.Ed25519PrivateKey,
    *,
    approver_id: str,
    tenant_id: str,
    trace_id: str,
    tool_name: str,
    tool_version: str,
    payload_hash: str,
    requested_by_user: str,
    requested_by_agent: str,
    decision: str = APPROVED,
    request_id: str | None = None,
    now_ms: int,
    ttl_s: int = 600,
    reason: str | None = None,
    approval_id: str | None = None,
) -> dict[str, Any]:
    approval: dict[str, Any] = {
        "approval_id": approval_id or approval_id_for(request_id, approver_id, payload_hash),
        "request_id": request_id,
        "tenant_id": tenant_id,
        "trace_id": trace_id,
        "tool_name": tool_name,
        "tool_version": tool_version,
        "payload_hash": payload_hash,
        "requested_by_user": requested_by_user,
        "requested_by_agent": requested_by_agent,
        "approver_id": approver_id,
        "decision": decision,
        "approved_at": iso(now_ms),
        "expires_at": iso(now_ms + ttl_s * 1000),
        "approval_scope": "single_execution",
        "reason": reason,
    }
    approval["signature"] = b64url.encode(private_key.sign(signing_bytes(approval)))
    return approval


def sign_for_request(
    private_key: ed25519.Ed25519PrivateKey,
    approver_id: str,
    request: dict[str, Any],
    now_ms: int,
    decision: str = APPROVED,
    reason: str | None = None,
    **overrides: Any,
) -> dict[str, Any]:
    """An approver's signed answer to a confirmation packet (or a parked call's entry):
    bound to exactly the call the packet describes, unless ``overrides`` say otherwise."""
    fields: dict[str, Any] = {
        "tenant_id": request["tenant_id"],
        "trace_id": request["trace_id"],
        "tool_name": request["tool_name"],
        "tool_version": request["tool_version"],
        "payload_hash": request["payload_hash"],
        "requested_by_user": request["requested_by_user"],
        "requested_by_agent": request["requested_by_agent"],
        "request_id": request["request_id"],
        **overrides,
    }
    return sign_approval(
        private_key,
        approver_id=approver_id,
        now_ms=now_ms,
        decision=decision,
        reason=reason,
        **fields,
    )


def load_private_key(path: Path) -> ed25519.Ed25519PrivateKey:
    """An approver's key: a JWK with ``d`` or an unencrypted PEM."""
    raw = Path(path).read_bytes()
    if raw.lstrip().startswith(b"{"):
        jwk = orjson.loads(raw)
        return ed25519.Ed25519PrivateKey.from_private_bytes(b64url.decode(jwk["d"]))
    key = serialization.load_pem_private_key(raw, password=None)
    if not isinstance(key, ed25519.Ed25519PrivateKey):
        raise ApproverError(f"{path}: not an Ed25519 private key")
    return key


@dataclass(frozen=True, slots=True)
class Binding:
    """What an approval must be bound to: this call, exactly."""

    tenant_id: str
    trace_id: str
    tool_name: str
    tool_version: str
    payload_hash: str
    side_effect_class: SideEffectClass
    requested_by_user: str
    requested_by_agent: str


@dataclass(frozen=True, slots=True)
class VerifiedApproval:
    approval_id: str
    approver_id: str
    decision: str
    reason: str | None
    request_id: str | None
    expires_ms: int


def _no(code: str, message: str, index: int | None) -> FieldError:
    where = "approvals" if index is None else f"approvals/{index}"
    return FieldError(where, message, code)


def verify_approval(
    approval: Any,
    approvers: dict[str, Approver],
    binding: Binding,
    requester: Principal | None,
    now_ms: int,
    index: int | None = None,
    max_lifetime_s: int = MAX_APPROVAL_LIFETIME_S,
) -> VerifiedApproval | FieldError:
    """Check everything about one approval except whether it was used before.

    ``max_lifetime_s`` bounds how long an approval may be good for, from ``approved_at``
    to ``expires_at`` (the policy's ``confirmation.max_approval_lifetime_seconds``): an
    approver's tool that signs approvals for a year, by a bug or a slip, does not put a
    year-long approval into circulation."""
    if not isinstance(approval, dict):
        return _no("approval_signature_invalid", "an approval must be an object", index)
    for name in ("approval_id", "approver_id", "decision", "expires_at", "signature"):
        if not isinstance(approval.get(name), str):
            return _no("approval_signature_invalid", f"the approval has no {name}", index)
    # Every signed field is text or null, as sign_approval writes them: anything else is
    # refused before its canonical bytes are built (a 65-bit integer or a value nested
    # past the encoder's depth limit would make that raise, on unsigned input).
    for name in _SIGNED_FIELDS:
        value = approval.get(name)
        if value is not None and type(value) is not str:
            return _no("approval_signature_invalid", f"the approval's {name} is not text", index)
    # The processor names an approval in the call it releases (approval_ids): an id far
    # longer than any approver's tool writes would make that call too large to publish,
    # after Redis had counted it released and the call's record had been taken over.
    if len(approval["approval_id"]) > ID_MAX_CHARS:
        return _no(
            "approval_signature_invalid",
            f"the approval's approval_id is longer than {ID_MAX_CHARS} characters",
            index,
        )
    approver = approvers.get(approval["approver_id"])
    if approver is None:
        return _no(
            "approver_unknown", f"{approval['approver_id']!r} is not a registered approver", index
        )
    try:
        approver.public_key.verify(b64url.decode(approval["signature"]), signing_bytes(approval))
    except (InvalidSignature, ValueError, binascii.Error):
        return _no("approval_signature_invalid", "the approval's signature does not verify", index)
    if approval["decision"] not in (APPROVED, REJECTED):
        return _no("approval_signature_invalid", "decision must be approved or rejected", index)
    if requester is not None and approver.is_requester(requester):
        return _no("self_approval", "nobody may approve their own call", index)
    if not approver.may_approve(binding.side_effect_class, binding.tenant_id):
        return _no(
            "approver_not_allowed",
            f"{approver.approver_id} may not approve {binding.side_effect_class.value} calls"
            f" of tenant {binding.tenant_id}",
            index,
        )
    if not all(isinstance(approval.get(k), str) for k in _REQUESTER_FIELDS):
        return _no(
            "approval_requester_mismatch",
            "the approval names no requester (signed by an earlier version): it must be "
            "signed again, for the requester its confirmation packet names",
            index,
        )
    checks = (
        ("tenant_id", binding.tenant_id, "approval_tenant_mismatch", "tenant id"),
        ("tool_name", binding.tool_name, "approval_tool_mismatch", "tool name"),
        ("tool_version", binding.tool_version, "approval_version_mismatch", "tool version"),
        ("payload_hash", binding.payload_hash, "approval_payload_mismatch", "payload hash"),
        ("trace_id", binding.trace_id, "approval_trace_mismatch", "trace id"),
        ("requested_by_user", binding.requested_by_user, "approval_requester_mismatch", "user"),
        ("requested_by_agent", binding.requested_by_agent, "approval_requester_mismatch", "agent"),
    )
    for name, expected, code, what in checks:
        if approval.get(name) != expected:
            return _no(code, f"the approval is bound to another {what}", index)
    try:
        expires = parse_iso_ms(approval["expires_at"])
        approved = parse_iso_ms(approval["approved_at"]) if approval.get("approved_at") else None
    except ValueError:
        return _no(
            "approval_signature_invalid",
            "approved_at and expires_at must be RFC 3339 times with a UTC offset",
            index,
        )
    if approved is None:
        return _no("approval_signature_invalid", "the approval has no approved_at", index)
    if approved > now_ms + APPROVAL_CLOCK_SKEW_MS:
        return _no(
            "approval_not_yet_valid", f"the approval is dated {approval['approved_at']}", index
        )
    if expires - approved > max_lifetime_s * 1000:
        return _no(
            "approval_lifetime_exceeded",
            f"the approval is good for longer than {max_lifetime_s} s after it was given: "
            "it must be signed again with an earlier expiry",
            index,
        )
    if now_ms > expires:
        return _no("approval_expired", f"the approval expired at {approval['expires_at']}", index)
    reason = approval.get("reason")
    return VerifiedApproval(
        approval["approval_id"],
        approver.approver_id,
        approval["decision"],
        reason if isinstance(reason, str) else None,
        approval.get("request_id") if isinstance(approval.get("request_id"), str) else None,
        expires,
    )
