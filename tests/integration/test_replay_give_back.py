"""A call admitted in a batch whose transaction then aborted never ran. Decided again as a
proposal that asks nothing of admission (its token no longer verifies: the trust keys were
rotated meanwhile), it gives back what it took, through the processor's own paths against
a real redis-server and a real Redis Cluster: in the processor that admitted it, and in
one that takes its partition over after a crash, which learns where such calls wait from
the replay markers above the partition's committed offset. And end to end on the real
broker: a processor killed between Redis and its commit, the next one started with the
keys rotated."""

from __future__ import annotations

import shutil
import time
import uuid
from pathlib import Path
from typing import Any

import orjson
import pytest

from processor.app import Processor
from processor.client import ToolsentryClient
from processor.config import IdentitySettings, Settings
from processor.identity import TokenIssuer
from processor.keys import init_keys
from processor.model import Decision, Gate, Outcome
from processor.state.admission import AdmissionStore
from processor.state.connection import connect, tenant_tag
from tests.integration.harness import ProcessorProcess, isolated, read_all, token
from tests.integration.test_admission import call
from tests.unit.helpers import Consumed, envelope, keyed_processor

pytestmark = pytest.mark.integration

TENANT = "acme"
TOPIC = "tool.proposals"


def _processor(
    tmp_path: Path, redis_url: str, namespace: str, **settings: Any
) -> tuple[Processor, Path]:
    return keyed_processor(tmp_path, redis_url=redis_url, redis_namespace=namespace, **settings)


def _ticket(keys: Path, key: str, run: str, tenant: str = TENANT) -> Consumed:
    """A ticket proposed with a token of the issuer ``keys`` holds now."""
    token = TokenIssuer.from_jwk_file(keys / "issuer.jwk").mint(tenant, "u-1", "agent-1",
                                                                 ["tickets:write"])  # fmt: skip
    env = envelope("create_ticket", tenant_id=tenant, run_id=run, idempotency_key=key,
                   proposal_id=f"p-{key}", principal_token=token)  # fmt: skip
    return Consumed(TOPIC, 7, orjson.dumps(env))


def _rotate(p: Processor, keys: Path, tmp_path: Path) -> None:
    """The issuer's key replaced: tokens it signed before no longer verify."""
    shutil.copy(init_keys(tmp_path / "rotated").jwks, keys / "jwks.json")
    assert p.reload_trust(force=True)


def _decided(p: Processor, m: Consumed) -> Decision:
    [d] = p.decide_batch([m])  # type: ignore[list-item]
    return d


def _refused_for_its_token(d: Decision) -> None:
    assert d.outcome is Outcome.REJECTED and d.rejection is not None
    assert d.rejection.gate is Gate.IDENTITY
    assert [e.code for e in d.rejection.errors] == ["token_signature_invalid"]


@pytest.mark.parametrize("where", ["same_processor", "after_a_crash"])
def test_a_call_whose_token_no_longer_verifies_on_replay_gives_back_what_it_took(
    tmp_path: Path, redis_backend: str, where: str
) -> None:
    """Admitted (its key PENDING, its run's write budget charged), its transaction aborted;
    the keys are rotated before the replay, which refuses the proposal at identity. Its key
    becomes retryable and its budget comes back. ``after_a_crash``: the processor that
    admitted it died before its commit; the next one is assigned the partition, whose
    committed offset is below the call's, and replays it."""
    namespace = f"give-back-{uuid.uuid4().hex[:8]}"
    first, keys = _processor(tmp_path / "first", redis_backend, namespace)
    key, run = f"k-{uuid.uuid4().hex}", f"run-{uuid.uuid4().hex[:8]}"
    m = _ticket(keys, key, run)
    assert _decided(first, m).outcome is Outcome.ROUTED
    store = first.admission
    assert store.record(TENANT, key)["state"] == "PENDING"
    assert store.run_counters(TENANT, run)["class:write"] == 1.0

    if where == "same_processor":
        again = first
        _rotate(again, keys, tmp_path / "first")
    else:
        again, _ = _processor(tmp_path / "next", redis_backend, namespace)
        assert again.admission.forget_committed({(TOPIC, 0): 3}) == 0  # (its assignment)
        assert again.admission.call_waiting_at(f"{TOPIC}/0/1") is None
    assert again.admission.call_waiting_at(f"{TOPIC}/0/7") == tenant_tag(TENANT)

    _refused_for_its_token(_decided(again, m))
    record = store.record(TENANT, key)
    assert record["state"] == "FAILED_RETRYABLE", record
    assert store.run_counters(TENANT, run).get("class:write", 0.0) == 0.0
    _refused_for_its_token(_decided(again, m))  # its batch aborted again: given back once
    assert store.run_counters(TENANT, run).get("class:write", 0.0) == 0.0


def test_a_proposal_refused_for_its_token_where_no_call_waits_costs_redis_nothing(
    tmp_path: Path, redis_backend: str
) -> None:
    """Expired, forged, not a token, none: at positions where no call of this processor's
    or of a predecessor's waits for a replay, such proposals send admission nothing, so
    unverified traffic costs Redis no work and leaves no replay markers."""
    namespace = f"give-back-{uuid.uuid4().hex[:8]}"
    p, keys = _processor(tmp_path, redis_backend, namespace)
    issuer = TokenIssuer.from_jwk_file(keys / "issuer.jwk")
    expired = issuer.mint(TENANT, "u-1", "a-1", ["tickets:write"], ttl_s=60, now=time.time() - 600)
    good = issuer.mint(TENANT, "u-1", "a-1", ["tickets:write"])
    forged = good[:-4] + ("AAAA" if not good.endswith("AAAA") else "BBBB")
    tokens = {"token_expired": expired, "token_signature_invalid": forged,
              "token_malformed": "not-a-token", "token_missing": None}  # fmt: skip
    batch = []
    for offset, presented in enumerate(tokens.values(), start=20):
        env = envelope("create_ticket", tenant_id=TENANT, idempotency_key=uuid.uuid4().hex)
        if presented is not None:
            env["principal_token"] = presented
        batch.append(Consumed(TOPIC, offset, orjson.dumps(env)))
    decisions = p.decide_batch(batch)  # type: ignore[arg-type]
    for d in decisions:
        assert d.rejection is not None and d.rejection.gate is Gate.IDENTITY
    assert [d.rejection.errors[0].code for d in decisions if d.rejection] == list(tokens)
    assert p._admitted == []
    assert list(p.admission.client.scan_iter(match=f"{namespace}:*")) == []


def test_where_a_call_may_wait_for_its_replay_is_known_until_its_batch_commits(
    redis_backend: str,
) -> None:
    """The store notes each call it admits, and forgets it with the replay markers of the
    batch, once committed; a store taking partitions over notes the markers above their
    committed offsets, of those partitions only, for tenants whose tag is a digest too."""
    namespace = f"give-back-{uuid.uuid4().hex[:8]}"
    store = AdmissionStore(connect(redis_backend), namespace)
    odd = "odd}tenant"
    items = [call(pos=f"{TOPIC}/0/5"), call(pos=f"{TOPIC}/0/6", tenant=odd),
             call(pos=f"{TOPIC}/1/9")]  # fmt: skip
    assert [v["ok"] for v in store.apply(items)] == [True, True, True]
    assert store.call_waiting_at(f"{TOPIC}/0/5") == tenant_tag(TENANT)
    assert store.call_waiting_at(f"{TOPIC}/0/6") == tenant_tag(odd)
    assert store.call_waiting_at(f"{TOPIC}/0/4") is None

    taking_over = AdmissionStore(connect(redis_backend), namespace)
    assert taking_over.forget_committed({(TOPIC, 0): 6, ("tool.approvals", 0): -1001}) == 1
    assert taking_over.call_waiting_at(f"{TOPIC}/0/5") is None  # committed: gone
    assert taking_over.call_waiting_at(f"{TOPIC}/0/6") == tenant_tag(odd)
    assert taking_over.call_waiting_at(f"{TOPIC}/1/9") is None  # not assigned here

    store.forget(items[:1])  # its batch committed
    assert store.call_waiting_at(f"{TOPIC}/0/5") is None
    assert store.call_waiting_at(f"{TOPIC}/0/6") == tenant_tag(odd)


@pytest.mark.parametrize("tenant", [TENANT, "odd}tenant"])
def test_a_call_whose_record_no_longer_reads_on_replay_gives_back_what_it_took(
    tmp_path: Path, redis_backend: str, tenant: str
) -> None:
    """Admitted, its transaction aborted, its processor gone; the next one runs with a
    smaller record limit, so the same bytes go to the dead-letter topic unread: no tenant,
    no run, no key. The call is withdrawn under the tenant whose marker waits at the
    position (a tag the store cannot turn back into an id, for ``odd}tenant``), its run
    taken from its idempotency record: the key becomes retryable and the budget comes
    back, once; and the position's marker goes with its batch."""
    namespace = f"give-back-{uuid.uuid4().hex[:8]}"
    first, keys = _processor(tmp_path / "first", redis_backend, namespace)
    key, run = f"k-{uuid.uuid4().hex}", f"run-{uuid.uuid4().hex[:8]}"
    m = _ticket(keys, key, run, tenant)
    assert _decided(first, m).outcome is Outcome.ROUTED
    store = first.admission
    assert store.record(tenant, key)["state"] == "PENDING"
    assert store.run_counters(tenant, run)["class:write"] == 1.0

    again, _ = _processor(tmp_path / "next", redis_backend, namespace, max_record_bytes=64)
    assert again.admission.forget_committed({(TOPIC, 0): 3}) == 0
    for _ in range(2):  # (its batch aborted again: given back once)
        d = _decided(again, m)
        assert (d.proposal, d.dlq_reason) == (None, "too_large"), d
        record = store.record(tenant, key)
        assert record["state"] == "FAILED_RETRYABLE", record
        assert store.run_counters(tenant, run).get("class:write", 0.0) == 0.0
    done = f"{namespace}:{tenant_tag(tenant)}:done"
    assert again.admission.client.hexists(done, f"{TOPIC}/0/7")
    again.admission.forget(again._admitted)  # its batch committed
    assert not again.admission.client.hexists(done, f"{TOPIC}/0/7")
    assert again.admission.call_waiting_at(f"{TOPIC}/0/7") is None


def test_a_processor_taking_over_after_a_crash_gives_back_a_call_it_refuses_on_replay(
    stack_settings: Settings, tmp_path: Path
) -> None:
    """Killed after Redis admitted a ticket, before its commit; the keys are rotated before
    the next processor starts. Assigned the partition, it reads the marker the call left
    above the committed offset, refuses the proposal at identity and withdraws the call:
    one observation, the refusal; nothing routed; the key retryable, the budget back."""
    settings = isolated(stack_settings, f"give-back-{uuid.uuid4().hex[:8]}")
    store = AdmissionStore(connect(settings.redis_url), settings.redis_namespace)
    client = ToolsentryClient(settings, TENANT, principal_token=token(settings, TENANT))
    dying = ProcessorProcess(settings, "give-back-1", tmp_path,
                             TOOLSENTRY_FAULT_POINT="after_redis")  # fmt: skip
    identity = settings.identity
    rotated = IdentitySettings(jwks_file=init_keys(tmp_path / "rotated").jwks,
                               delegation_key_file=identity.delegation_key_file)  # fmt: skip
    proc = ProcessorProcess(settings.model_copy(update={"identity": rotated}), "give-back-1",
                            tmp_path)  # fmt: skip
    try:
        key, run = f"k-{uuid.uuid4().hex}", f"run-{uuid.uuid4().hex[:8]}"
        args = envelope("create_ticket")["arguments"]
        pid = client.propose("create_ticket", args, idempotency_key=key, run_id=run)
        client.flush()
        dying.start().proc.wait(60)  # type: ignore[union-attr]
        assert "fault point after_redis" in dying.log(), dying.log()[-3000:]
        assert store.record(TENANT, key)["state"] == "PENDING"
        assert store.run_counters(TENANT, run)["class:write"] == 1.0

        proc.start().wait_ready()
        seen = client.wait(pid, 60)
        assert (seen["decision"], seen["gate"]) == ("REJECTED", "identity"), seen
        assert seen["status"]["taxonomy_class"] == "PERMISSION_DENIED"
        assert [e["code"] for e in seen["result_payload"]["errors"]] == ["token_signature_invalid"]
        assert proc.terminate() == 0
        assert [o["decision"] for o in client.history(pid)] == ["REJECTED"]
        assert read_all(settings, settings.topics.execution("MEDIUM_RISK_WRITE"), idle=1) == []
        record = store.record(TENANT, key)
        assert record["state"] == "FAILED_RETRYABLE", record
        assert store.run_counters(TENANT, run).get("class:write", 0.0) == 0.0
    finally:
        client.close()
        dying.kill()
        proc.kill()
