"""Rotating keys, approvers and policy under a running processor: all or nothing, between
batches, once the files have settled, the old set kept when the new one is unusable. No
broker is touched: a Processor only connects when it runs. With ``contracts_poll_s`` 0,
each ``reload_trust()`` call is one poll."""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import pytest

from processor import app
from processor import policy as policy_module
from processor.app import Processor
from processor.contracts.registry import ContractSet
from processor.contracts.watch import StillChanging
from processor.identity import TokenIssuer
from processor.keys import init_keys
from processor.model import FieldError, Principal
from processor.pipeline import Gates
from tests.unit.helpers import keyed_processor


def _reloads(proc: Processor, result: str) -> float:
    """toolsentry_trust_reloads_total{result}."""
    [family] = proc.metrics.trust_reloads.collect()
    return sum(
        s.value
        for s in family.samples
        if s.name.endswith("_total") and s.labels["result"] == result
    )


def _touch_later(path: Path) -> None:
    st = path.stat()
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))


def test_a_rotated_issuer_key_is_taken_between_batches(tmp_path: Path) -> None:
    proc, keys = keyed_processor(tmp_path)
    old = TokenIssuer.from_jwk_file(keys / "issuer.jwk").mint("acme", "u", "a", ["kb:read"])
    assert isinstance(proc.gates.verifier.verify(old), Principal)
    assert proc.reload_trust() is False  # nothing changed

    rotated = init_keys(tmp_path / "rotated")
    shutil.copy(rotated.jwks, keys / "jwks.json")
    _touch_later(keys / "jwks.json")
    assert proc.reload_trust() is False  # changed since the last poll: settling
    assert proc.reload_trust() is True
    new = TokenIssuer.from_jwk_file(rotated.issuer).mint("acme", "u", "a", ["kb:read"])
    assert isinstance(proc.gates.verifier.verify(new), Principal)
    refused = proc.gates.verifier.verify(old)
    assert isinstance(refused, FieldError) and refused.code == "token_signature_invalid"


def test_an_unusable_file_keeps_the_old_keys_policy_and_approvers(tmp_path: Path) -> None:
    proc, keys = keyed_processor(tmp_path)
    before = proc.gates
    (keys / "approvers.yaml").write_text("approvers: [{id: x, public_key: not-base64!}]\n")
    _touch_later(keys / "approvers.yaml")
    assert proc.reload_trust() is False
    assert proc.reload_trust() is False
    assert proc.gates is before
    assert _reloads(proc, "refused") == 1
    assert set(proc.gates.approvers) == {"ops-1", "ops-2"}

    (tmp_path / "policy.yaml").write_text("tenants: {acme: {allowed_classes: [READ_ONLY]}}\n")
    (keys / "approvers.yaml").unlink()
    init_keys(keys)  # writes approvers.yaml again, as it was
    assert proc.reload_trust(force=True) is True
    assert proc.gates is not before
    assert [c.value for c in proc.gates.policy.for_tenant("acme").allowed_classes] == ["READ_ONLY"]


def _restricted(shipped: str) -> str:
    """The shipped policy with every tenant held to READ_ONLY."""
    start = shipped.index("allowed_classes: [READ_ONLY, EPHEMERAL_WRITE")
    end = shipped.index("]", start) + 1
    return shipped[:start] + "allowed_classes: [READ_ONLY]" + shipped[end:]


def _classes(proc: Processor, tenant: str) -> list[str]:
    return sorted(c.value for c in proc.gates.policy.for_tenant(tenant).allowed_classes)


def test_a_policy_caught_mid_write_is_taken_only_once_it_holds_still(tmp_path: Path) -> None:
    proc, _ = keyed_processor(tmp_path)
    policy = tmp_path / "policy.yaml"
    new = _restricted(policy.read_text())
    # Cut after "tenants:", the file still parses: every class for every tenant.
    policy.write_text(new[: new.index('  "*":')])
    assert proc.reload_trust() is False
    policy.write_text(new)
    assert proc.reload_trust() is False  # changed again since the last poll
    assert _classes(proc, "other") != ["READ_ONLY"]
    assert proc.reload_trust() is True
    assert _classes(proc, "other") == ["READ_ONLY"]
    assert proc.reload_trust() is False  # taken once


def test_files_changing_while_being_read_are_read_again(tmp_path: Path) -> None:
    proc, _ = keyed_processor(tmp_path)
    policy = tmp_path / "policy.yaml"
    shipped = policy.read_text()
    load = proc._load_trust
    writes = [_restricted(shipped)]

    def load_while_written(contracts: ContractSet) -> Gates:
        gates = load(contracts)
        if writes:
            policy.write_text(writes.pop())
        return gates

    proc._load_trust = load_while_written  # type: ignore[method-assign]
    policy.write_text(shipped + "\n")
    assert proc.reload_trust() is False
    assert proc.reload_trust() is False  # settled, but written again while read
    assert _reloads(proc, "refused") == 0 and _reloads(proc, "loaded") == 0
    assert proc.reload_trust() is True
    assert _classes(proc, "other") == ["READ_ONLY"]

    writes.append(shipped)
    assert proc.reload_trust(force=True) is False  # forced, yet written while read
    assert _reloads(proc, "refused") == 1
    assert _classes(proc, "other") == ["READ_ONLY"]
    assert proc.reload_trust() is True  # unchanged since the refused read
    assert _classes(proc, "other") != ["READ_ONLY"]


def test_a_policy_replaced_with_its_mtime_kept_is_noticed(tmp_path: Path) -> None:
    proc, _ = keyed_processor(tmp_path)
    policy = tmp_path / "policy.yaml"
    st = policy.stat()
    tmp = tmp_path / "policy.yaml.new"  # as cp -p, rsync -a or tar leave it
    tmp.write_text(_restricted(policy.read_text()))
    os.utime(tmp, ns=(st.st_atime_ns, st.st_mtime_ns))
    os.replace(tmp, policy)
    assert proc.reload_trust() is False
    assert proc.reload_trust() is True
    assert _classes(proc, "other") == ["READ_ONLY"]


def test_sighup_takes_a_revoked_key_out_at_once(tmp_path: Path) -> None:
    """An operator who removes a leaked key and sends SIGHUP must not wait for a poll, nor
    for the file to hold still: the next batch already refuses its tokens, cached ones too."""
    proc, keys = keyed_processor(tmp_path)
    proc.settings = proc.settings.model_copy(update={"contracts_poll_s": 3600.0})
    leaked = TokenIssuer.from_jwk_file(keys / "issuer.jwk").mint("acme", "u", "a", ["kb:read"])
    assert isinstance(proc.gates.verifier.verify(leaked), Principal)  # verified and cached

    (keys / "jwks.json").write_text('{"keys": []}\n')
    assert proc.reload_trust() is False  # not due for an hour
    proc.watcher.check(force=True)  # what the watcher does when SIGHUP wakes it
    assert proc.reload_trust() is True
    refused = proc.gates.verifier.verify(leaked)
    assert isinstance(refused, FieldError) and refused.code == "token_unknown_key"
    assert proc.reload_trust() is False  # one SIGHUP, one forced read


def test_a_processor_started_while_the_policy_is_written_takes_the_whole_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The first read of the trust files is held to what a reload is: the policy changed
    while it was read (the rest of a deploy's file landing) is read again, whole, not
    taken as the part that was there. (``contracts_poll_s`` 0: each poll one more read.)"""
    written: list[Path] = []
    read = app.load_policy

    def read_while_written(path: Path | None) -> Any:
        policy = read(path)
        if path is not None and not written:
            written.append(path)
            text = path.read_text().replace("ttl_seconds: 600", "ttl_seconds: 60", 1)
            assert text != path.read_text()
            path.write_text(text)
        return policy

    monkeypatch.setattr(app, "load_policy", read_while_written)
    proc, _ = keyed_processor(tmp_path)
    assert written and proc.gates.policy.approval_ttl_s == 60


def test_trust_files_still_changing_after_the_bound_refuse_the_start(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def read_while_written(path: Path | None) -> Any:
        assert path is not None
        with path.open("a") as f:  # changed by every read: it never holds still
            f.write("# still being written\n")
        return policy_module.load_policy(path)

    monkeypatch.setattr(app, "load_policy", read_while_written)
    with pytest.raises(StillChanging, match="did not hold still"):
        keyed_processor(tmp_path)
