"""Key material for a development or test deployment, generated in one step.

``toolsentry keys init DIR`` writes what a laptop stack, the demo and the
integration tests need to run with identity verification switched *on*:

- ``issuer.jwk``: the private Ed25519 key a stand-in identity provider signs
  principal tokens with, and ``jwks.json``, its public half for the processor;
- one Ed25519 key per approver (``approver-<id>.jwk``) and ``approvers.yaml``
  listing their public keys and the classes each may approve;
- ``delegation.jwk``: the processor's own private key, which signs the compensating
  calls it proposes in a caller's name.

Production deployments bring their own identity provider's JWKS and their
approvers' public keys; nothing here is meant for them.
"""

from __future__ import annotations

import json
import os
import secrets
from dataclasses import dataclass
from pathlib import Path

from processor.identity import generate_ed25519_jwk
from processor.model import SideEffectClass

DEFAULT_APPROVERS = ("ops-1", "ops-2")
DELEGATION_KID = "toolsentry-delegation"
"""The prefix of a delegation key's kid; each key gets a suffix of its own (rotation)."""
APPROVAL_CLASSES = (
    SideEffectClass.MEDIUM_RISK_WRITE,
    SideEffectClass.HIGH_RISK_EXTERNAL,
    SideEffectClass.CRITICAL_MUTATION,
)


@dataclass(frozen=True, slots=True)
class KeyBundle:
    directory: Path
    issuer: Path
    jwks: Path
    approvers: Path
    delegation: Path

    def approver_key(self, approver_id: str) -> Path:
        return self.directory / f"approver-{approver_id}.jwk"


def _write_private(path: Path, doc: dict[str, str]) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump(doc, f)


def new_delegation_key(path: Path) -> str:
    """Write a new private delegation key (Ed25519 JWK) with a kid of its own; its kid."""
    kid = f"{DELEGATION_KID}-{secrets.token_hex(4)}"
    _write_private(Path(path), generate_ed25519_jwk(kid)[0])
    return kid


def init_keys(
    directory: Path,
    approvers: tuple[str, ...] | dict[str, tuple[SideEffectClass, ...]] = DEFAULT_APPROVERS,
    issuer_kid: str = "dev-issuer",
) -> KeyBundle:
    """Create (or reuse, when already there) the issuer and approver keys in ``directory``."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    bundle = KeyBundle(
        directory,
        directory / "issuer.jwk",
        directory / "jwks.json",
        directory / "approvers.yaml",
        directory / "delegation.jwk",
    )
    if not bundle.issuer.exists():
        private, public = generate_ed25519_jwk(issuer_kid)
        _write_private(bundle.issuer, private)
        bundle.jwks.write_text(json.dumps({"keys": [public]}, indent=2) + "\n")
    if not bundle.delegation.exists():
        new_delegation_key(bundle.delegation)
    classes = (
        approvers if isinstance(approvers, dict) else dict.fromkeys(approvers, APPROVAL_CLASSES)
    )
    lines = ["approvers:"]
    for approver_id, allowed in classes.items():
        path = bundle.approver_key(approver_id)
        if path.exists():
            public_x = json.loads(path.read_text())["x"]
        else:
            private, public = generate_ed25519_jwk(approver_id)
            _write_private(path, private)
            public_x = public["x"]
        lines += [
            f"  - id: {json.dumps(approver_id)}",
            f"    public_key: {public_x}",
            f"    classes: [{', '.join(c.value for c in allowed)}]",
        ]
    bundle.approvers.write_text("\n".join(lines) + "\n")
    return bundle
