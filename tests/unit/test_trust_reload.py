"""Rotating keys, approvers and policy under a running processor: all or nothing, between
batches, the old set kept when the new one is unusable. No broker is touched: a Processor
only connects when it runs."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from prometheus_client import CollectorRegistry

from processor.app import Processor
from processor.config import IdentitySettings, Settings
from processor.identity import TokenIssuer
from processor.keys import init_keys
from processor.metrics import Metrics
from processor.model import FieldError, Principal
from tests.unit.helpers import CONTRACTS_DIR, ROOT


def _processor(tmp_path: Path) -> tuple[Processor, Path]:
    keys = init_keys(tmp_path / "keys")
    policy = tmp_path / "policy.yaml"
    shutil.copy(ROOT / "policy" / "policy.yaml", policy)
    settings = Settings(
        contracts_dir=CONTRACTS_DIR,
        identity=IdentitySettings(jwks_file=keys.jwks),
        approvers_file=keys.approvers,
        policy_file=policy,
        contracts_poll_s=0.0,
        metrics_port=0,
    )
    return Processor(settings, metrics=Metrics(CollectorRegistry())), tmp_path / "keys"


def _touch_later(path: Path) -> None:
    st = path.stat()
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))


def test_a_rotated_issuer_key_is_taken_between_batches(tmp_path: Path) -> None:
    proc, keys = _processor(tmp_path)
    old = TokenIssuer.from_jwk_file(keys / "issuer.jwk").mint("acme", "u", "a", ["kb:read"])
    assert isinstance(proc.gates.verifier.verify(old), Principal)
    assert proc.reload_trust() is False  # nothing changed

    rotated = init_keys(tmp_path / "rotated")
    shutil.copy(rotated.jwks, keys / "jwks.json")
    _touch_later(keys / "jwks.json")
    assert proc.reload_trust() is True
    new = TokenIssuer.from_jwk_file(rotated.issuer).mint("acme", "u", "a", ["kb:read"])
    assert isinstance(proc.gates.verifier.verify(new), Principal)
    refused = proc.gates.verifier.verify(old)
    assert isinstance(refused, FieldError) and refused.code == "token_signature_invalid"


def test_an_unusable_file_keeps_the_old_keys_policy_and_approvers(tmp_path: Path) -> None:
    proc, keys = _processor(tmp_path)
    before = proc.gates
    (keys / "approvers.yaml").write_text("approvers: [{id: x, public_key: not-base64!}]\n")
    _touch_later(keys / "approvers.yaml")
    assert proc.reload_trust() is False
    assert proc.gates is before
    assert set(proc.gates.approvers) == {"ops-1", "ops-2"}

    (tmp_path / "policy.yaml").write_text("tenants: {acme: {allowed_classes: [READ_ONLY]}}\n")
    (keys / "approvers.yaml").unlink()
    init_keys(keys)  # writes approvers.yaml again, as it was
    assert proc.reload_trust(force=True) is True
    assert proc.gates is not before
    assert [c.value for c in proc.gates.policy.for_tenant("acme").allowed_classes] == ["READ_ONLY"]
