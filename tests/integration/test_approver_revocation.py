"""An approver taken out of the approvers file stops counting on requests they voted on
already, through the processor's own path (``Processor._approval_op``, the approval
store's script) against a real redis-server and a real Redis Cluster."""

from __future__ import annotations

import time
import uuid
from pathlib import Path
from typing import Any

import pytest

from processor.app import Processor
from processor.approval_flow import ApprovalInput
from processor.approvals import load_private_key, sign_for_request
from processor.keys import init_keys
from processor.model import SourceRecord
from processor.state.approvals import OpResult
from tests.unit.helpers import keyed_processor

pytestmark = pytest.mark.integration

TENANT = "acme"
_offsets = iter(range(10**9))


def _processor(tmp_path: Path, redis_url: str) -> Processor:
    p, _ = keyed_processor(tmp_path, ("ops-1", "ops-2", "ops-3"), redis_url=redis_url,
                           redis_namespace=f"revoke-{uuid.uuid4().hex[:8]}")  # fmt: skip
    return p


def _park(p: Processor, now_ms: int) -> dict[str, Any]:
    """A critical mutation parked for two approvers, as the approval store keeps it."""
    rid = f"req_{uuid.uuid4().hex[:24]}"
    entry = {
        "tenant_id": TENANT, "request_id": rid, "proposal_id": f"p-{rid}", "run_id": "run-1",
        "trace_id": uuid.uuid4().hex, "traceparent": None, "tool_name": "transfer_funds",
        "tool_version": "1.0.0", "side_effect_class": "CRITICAL_MUTATION",
        "idempotency_key": f"ik-{rid}", "payload_hash": "sha256:" + "ab" * 32,
        "arguments": "{}", "requested_by_user": "user-1", "requested_by_agent": "agent-1",
        "expires_at": now_ms + 600_000, "timeout_ms": 8000, "needed": 2,
    }  # fmt: skip
    op = {"op": "park", "rid": rid, "entry": entry, "expires_at": entry["expires_at"]}
    assert p.approval_store.apply([(TENANT, op)]) == [OpResult("parked")]
    return entry


def _vote(p: Processor, entry: dict[str, Any], approver: str, now_ms: int) -> OpResult:
    """``approver``'s signed approval of ``entry``, decided as a record of tool.approvals."""
    [result] = _votes(p, entry, [(approver, {})], now_ms)
    return result


def _votes(
    p: Processor, entry: dict[str, Any], votes: list[tuple[str, dict[str, Any]]], now_ms: int
) -> list[OpResult]:
    """Each approver's signed approval of ``entry`` (with these fields changed), decided as
    records of tool.approvals in one batch."""
    keys = Path(str(p.settings.approvers_file)).parent
    entries = p.approval_store.entries([(TENANT, entry["request_id"])])
    ops = []
    for approver, changes in votes:
        signed = sign_for_request(load_private_key(keys / f"approver-{approver}.jwk"), approver,
                                  entry, now_ms, **changes)  # fmt: skip
        src = SourceRecord("tool.approvals", 0, next(_offsets), b"run-1", b"{}", now_ms)
        item = ApprovalInput(src, "decision", TENANT, entry["request_id"], signed)
        out: list[Any] = [None]
        op = p._approval_op(item, entries, out, 0, now_ms)
        assert op is not None, out[0]
        ops.append(op)
    return p.approval_store.apply(ops)


def test_a_vote_of_an_approver_removed_since_no_longer_counts(
    tmp_path: Path, redis_backend: str
) -> None:
    """ops-1 approves, then is taken out of the approvers file (a compromised key, say).
    ops-2's approval is then the only one that counts: the call waits for a second
    approver still trusted, and goes on ops-3's."""
    p = _processor(tmp_path, redis_backend)
    now = int(time.time() * 1000)
    entry = _park(p, now)
    assert _vote(p, entry, "ops-1", now).status == "pending"

    init_keys(tmp_path / "keys", approvers=("ops-2", "ops-3"))  # ops-1 removed
    assert p.reload_trust(force=True)
    assert "ops-1" not in p.gates.approvers

    second = _vote(p, entry, "ops-2", now + 1)
    assert second.status == "pending"
    assert [a["id"] for a in second.entry["approvers"]] == ["ops-2"]  # type: ignore[index]
    third = _vote(p, entry, "ops-3", now + 2)
    assert third.status == "released"
    assert [a["id"] for a in third.entry["approvers"]] == ["ops-2", "ops-3"]  # type: ignore[index]


def test_a_vote_cast_with_a_key_replaced_since_no_longer_counts(
    tmp_path: Path, redis_backend: str
) -> None:
    """ops-1 approves two calls, then ops-1's key is replaced in the approvers file (it
    leaked), the approver kept. What the old key cast stops counting: ops-2's vote alone
    does not release the first call. ops-1's vote with the new key, in one batch with
    ops-2's, counts on the second."""
    p = _processor(tmp_path, redis_backend)
    now = int(time.time() * 1000)
    first, second = _park(p, now), _park(p, now)
    assert _vote(p, first, "ops-1", now).status == "pending"
    assert _vote(p, second, "ops-1", now).status == "pending"

    keys = Path(str(p.settings.approvers_file)).parent
    (keys / "approver-ops-1.jwk").unlink()
    init_keys(keys, approvers=("ops-1", "ops-2", "ops-3"))  # ops-1 with a new key
    assert p.reload_trust(force=True)

    alone = _vote(p, first, "ops-2", now + 1)
    assert alone.status == "pending"
    assert [a["id"] for a in alone.entry["approvers"]] == ["ops-2"]  # type: ignore[index]
    # (under an approval id of its own: the old vote spent the one ops-1's answer gets)
    again, both = _votes(p, second, [("ops-1", {"approval_id": "appr-new-key"}), ("ops-2", {})],
                         now + 2)  # fmt: skip
    assert again.status == "pending"
    assert both.status == "released"
    counted = [(a["id"], a["approval_id"]) for a in both.entry["approvers"]]  # type: ignore[index]
    assert counted[0] == ("ops-1", "appr-new-key") and counted[1][0] == "ops-2"


def test_votes_of_approvers_still_trusted_count_as_before(
    tmp_path: Path, redis_backend: str
) -> None:
    p = _processor(tmp_path, redis_backend)
    now = int(time.time() * 1000)
    entry = _park(p, now)
    assert _vote(p, entry, "ops-1", now).status == "pending"
    assert p.reload_trust(force=True)  # re-read, unchanged
    assert _vote(p, entry, "ops-2", now + 1).status == "released"
