"""Records on the processor's and the executors' inputs that name a real call but could
not have been written for it: every one is answered or dead-lettered, and none stops its
consumer.

A result or an approved call naming ids longer than any the processor writes: its answer
is keyed by the run it names and carries its other ids, and would not fit under the
broker's message size limit; the transaction carrying it could never commit, and its
batch would come back for ever. A result of an attempt its call was never routed as
would otherwise be taken for an earlier attempt's, counted and dropped unseen.
"""

from __future__ import annotations

import hashlib
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import orjson
import pytest
from confluent_kafka import Producer
from prometheus_client import CollectorRegistry
from typer.testing import CliRunner

from processor.approval_flow import EXPIRY_CHECK
from processor.cli import app
from processor.client import ToolsentryClient
from processor.codec.avro import codec
from processor.codec.records import decode_approved_call, encode_result
from processor.config import Settings
from processor.executor import Call, Succeeded
from processor.metrics import Metrics
from processor.reference_data import publish_references, wait_until_loaded
from processor.state.approvals import ApprovalStore
from processor.state.connection import connect
from processor.state.references import ReferenceLoader, ReferenceStore
from tests.integration.harness import (
    ProcessorProcess,
    approval,
    existing,
    isolated,
    read_all,
    result_for,
    settings_env,
    token,
)
from tests.integration.test_executor import approved_call, drain, executor, results
from tests.integration.test_pipeline_e2e import CANCEL

pytestmark = pytest.mark.integration

TENANT = "acme-hostile"
HUGE = 520_000
"""Characters of an oversized id: a record holding it once fits a message; an answer keyed
by it and holding it again does not."""


@dataclass
class Bench:
    settings: Settings
    proc: ProcessorProcess
    client: ToolsentryClient

    def routed_call(self, run: str) -> dict[str, Any]:
        """A search routed for ``run``: its approved call, as its executor reads it."""
        pid = self.client.propose("search_kb", {"query": "returns", "limit": 3}, run_id=run)
        assert self.client.wait(pid, 60)["decision"] == "ROUTED"
        topic = self.settings.topics.execution("READ_ONLY")
        calls = [decode_approved_call(m.value()) for m in read_all(self.settings, topic, idle=1)]
        [call] = [c for c in calls if c["proposal_id"] == pid]
        return call

    def publish(self, key: bytes, results: list[dict[str, Any]]) -> list[bytes]:
        """``results`` on tool.results, in order on one partition; their values."""
        values = [encode_result(r) for r in results]
        self.produce(self.settings.topics.results, key, values)
        return values

    def produce(self, topic: str, key: bytes, values: list[bytes | None]) -> None:
        """Raw ``values`` on ``topic``, in order on one partition."""
        producer = Producer(self.settings.client_config(**{"enable.idempotence": True}))
        for value in values:
            producer.produce(topic, value, key)
        assert producer.flush(30) == 0

    def dead_letters(self, values: list[bytes | None]) -> list[tuple[bytes, bytes]]:
        """(reason, detail) of each of ``values``' dead letters, in order, once all are in (a
        dead letter whose value was cut is known by the digest of the value it cut)."""
        cut = {hashlib.sha256(v).hexdigest().encode(): v for v in values if v is not None}
        deadline = time.monotonic() + 60
        while True:
            dead = read_all(self.settings, self.settings.topics.dlq, idle=1)
            mine = {}
            for m in dead:
                headers = dict(m.headers() or [])
                value = cut.get(headers.get("toolsentry.value.sha256", b""), m.value())
                if value in values:
                    mine[value] = headers
            if len(mine) == len(values):
                return [
                    (mine[v]["toolsentry.error.reason"], mine[v]["toolsentry.error.detail"])
                    for v in values
                ]
            got = [h["toolsentry.error.reason"] for h in mine.values()]
            assert time.monotonic() < deadline, got

    def finals(self, pid: str) -> list[str]:
        """The final observations committed for ``pid``, once its result's is in."""
        assert self.client.wait_result(pid, 60)["decision"] in ("COMPLETED", "FAILED")
        topic = self.settings.topics.observations
        obs = [
            codec("observation").decode(m.value()) for m in read_all(self.settings, topic, idle=1)
        ]
        ends = ("COMPLETED", "FAILED")
        return [o["decision"] for o in obs if o["proposal_id"] == pid and o["decision"] in ends]


@pytest.fixture(scope="module")
def bench(stack_settings: Settings, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Bench]:
    settings = isolated(stack_settings, f"hostile-{uuid.uuid4().hex[:6]}")
    logs = tmp_path_factory.mktemp("hostile-logs")
    proc = ProcessorProcess(settings, "hostile-1", logs).start().wait_ready()
    client = ToolsentryClient(settings, TENANT, principal_token=token(settings, TENANT))
    try:
        yield Bench(settings, proc, client)
        assert proc.alive()
        assert "MSG_SIZE_TOO_LARGE" not in proc.log()
    finally:
        client.close()
        proc.terminate()


SEARCHED = '{"results": [], "match_count": 0, "next_action": null}'
"""What the call's executor elsewhere reports having read."""


def _result_for(call: dict[str, Any], **fields: Any) -> dict[str, Any]:
    return result_for(call, **{"data": SEARCHED, **fields})


def test_a_result_naming_an_oversized_run_is_dead_lettered_and_its_partition_goes_on(
    bench: Bench,
) -> None:
    """A result for a routed call's key under another call id (its key moved on, as far as
    Redis can tell) is answered to the run it names, which is far larger than any
    proposal's: refused before anything is settled, and the results behind it on its
    partition are decided."""
    call = bench.routed_call("run-oversized")
    other = f"call-{uuid.uuid4().hex}"
    oversized = _result_for(call, call_id=other, proposal_id=other, run_id="r" * HUGE)
    nobody = _result_for(call, idempotency_key=f"k-{uuid.uuid4().hex}")
    values = bench.publish(b"run-oversized", [oversized, nobody, _result_for(call)])
    reasons = bench.dead_letters(values[:2])
    assert [reason for reason, _ in reasons] == [b"result_invalid", b"result_unknown_call"]
    assert b"run_id is longer than 1024 characters" in reasons[0][1]
    assert bench.finals(call["proposal_id"]) == ["COMPLETED"]


def test_a_result_of_an_attempt_its_call_was_never_routed_as_is_dead_lettered(
    bench: Bench,
) -> None:
    """The record is at attempt 1: a result saying it is attempt 2 (or any later) was
    handed to no executor. It settles nothing and lands on the DLQ, instead of being
    dropped unseen as an earlier attempt's copy; the call's own result then settles it."""
    call = bench.routed_call("run-attempts")
    later = [_result_for(call, attempt=2), _result_for(call, attempt=2**31 - 1)]
    values = bench.publish(b"run-attempts", [*later, _result_for(call)])
    reasons = bench.dead_letters(values[:2])
    assert [reason for reason, _ in reasons] == [b"result_unrouted_attempt"] * 2
    assert bench.finals(call["proposal_id"]) == ["COMPLETED"]


def test_a_call_naming_an_oversized_run_is_dead_lettered_unrun_and_the_executor_goes_on(
    stack_settings: Settings,
) -> None:
    """An approved call whose run id is far larger than any the processor writes: its
    result, keyed by that run and naming it, could never be published. It is not run,
    it goes to the executors' DLQ, and the call behind it on its partition runs."""
    s = isolated(stack_settings, f"exec-hostile-{uuid.uuid4().hex[:6]}")
    huge = {**approved_call("lookup_order", {"order_id": "WO-12345-A"}), "run_id": "r" * HUGE}
    after = approved_call("lookup_order", {"order_id": "WO-55555-B"})
    producer = Producer(s.client_config(**{"enable.idempotence": True}))
    for call in (huge, after):  # one partition, in this order
        value = codec("approved_call").encode(call)
        producer.produce(s.topics.execution("READ_ONLY"), value, b"run-hostile")
    assert producer.flush(30) == 0
    seen: list[str] = []

    def lookup(call: Call) -> Succeeded:
        seen.append(call.call_id)
        return Succeeded({"orders": [], "match_count": 0, "next_action": None})

    ex = executor(s, {"lookup_order": lookup})
    try:
        drain(ex, 2)
    finally:
        ex.close()
    assert seen == [after["call_id"]]
    assert results(s, 1)[after["call_id"]]["outcome"] == "SUCCEEDED"
    [dead] = read_all(s, s.topics.call_dlq, expect=1, idle=1.0)
    assert dict(dead.headers() or [])["toolsentry.error.reason"] == b"approved_call_invalid"


def test_an_operator_reads_a_packet_s_control_characters_as_codes(
    stack_settings: Settings,
) -> None:
    """What ``approvals show`` prints comes from agents (arguments, ids) and
    from systems of record (the entities' states in the packet's before state). An escape
    sequence, a C1 control or a bidirectional override among them would reach the
    approver's terminal as it is: retitle or clear it, or reorder what the approver reads
    before approving. Each is shown as its code."""
    s = isolated(stack_settings, f"cli-hostile-{uuid.uuid4().hex[:6]}")
    hostile = "\x1b]0;approved\x07\x1b[2J\x9b31m\u202e"
    rid = f"req_{uuid.uuid4().hex[:24]}"
    now = int(time.time() * 1000)
    entry = {
        "request_id": rid, "proposal_id": f"p-{hostile}", "tenant_id": TENANT,
        "run_id": f"run-{hostile}", "trace_id": "0af7651916cd43dd8448eb211c80319c",
        "tool_name": "refund_order", "tool_version": "1.0.0",
        "side_effect_class": "CRITICAL_MUTATION", "action": "refund_order@1.0.0",
        "consequence": "refunds the customer",
        "arguments": orjson.dumps({"note": hostile, "amount": 10}).decode(),
        "before_state": f"order WO-12345-A is delivered{hostile}",
        "payload_hash": "sha256:00", "idempotency_key": f"k-{hostile}",
        "approvals_required": 2, "needed": 2, "requested_by_user": f"u-{hostile}",
        "requested_by_agent": "agent-1", "created_at": now, "expires_at": now + 600_000,
        "risk_reason": "CRITICAL_MUTATION calls need approval", "rejection_path": "declined",
    }  # fmt: skip
    op = {"op": "park", "rid": rid, "entry": entry, "pos": "t/0/1", "expires_at": now + 600_000,
          "needed": 2, "ttl": 600_000}  # fmt: skip
    ApprovalStore(connect(s.redis_url), s.redis_namespace).apply([(TENANT, op)])
    env = {**settings_env(s, "cli-hostile"), "COLUMNS": "400"}
    shown = CliRunner().invoke(app, ["approvals", "show", rid], env=env)
    assert shown.exit_code == 0, shown.output
    for raw in ("\x1b", "\x07", "\x9b", "\u202e"):
        assert raw not in shown.output, shown.output
    assert "delivered\\u001b]0;approved\\u0007" in shown.output
    assert "\\u202e" in shown.output and "\\u009b31m" in shown.output


def test_hostile_records_on_tool_approvals_are_dead_lettered_and_the_call_released_once(
    bench: Bench,
) -> None:
    """Ahead of its approver's good decision on the parked call's partition: records that
    are not JSON or not whole, that name no request or another tenant's, signed fields of
    the wrong type, an unknown decision, a withdrawal (a type this version does not know)
    carrying the approval's fields, and an approval whose id no released call could carry.
    Each lands on the DLQ with its reason and changes nothing; the good decision then
    releases the call, once, naming that approval alone.

    Read as a decision, the withdrawal released the call; and the oversized id was counted
    in Redis, which released the call and took its key's record over, but the call naming
    it could not be written: it went to the DLQ unrun, its proposal never answered, and
    the good decision found the request ended."""
    s = bench.settings
    publish_references(s, existing(TENANT, "cancel_order", CANCEL))
    wait_until_loaded(s)
    run = f"run-{uuid.uuid4().hex[:8]}"
    parked = bench.client.call("cancel_order", CANCEL, run_id=run, timeout=60)
    assert parked["decision"] == "PENDING_APPROVAL", parked["result_payload"]
    good = approval(s, "ops-1", parked)
    text = orjson.dumps(good)
    expiry = {"type": EXPIRY_CHECK, "tenant_id": TENANT, "request_id": "r" * HUGE}
    hostile: list[tuple[bytes | None, str]] = [
        (None, "approval_not_json"),  # a tombstone
        (text[:-20], "approval_not_json"),
        (text.replace(good["request_id"].encode(), b"req_\xff"), "approval_not_json"),
        (text.replace(b'"reason":null', b'"reason":NaN'), "approval_not_json"),
        (b"[" * 100_000, "approval_not_json"),
        (b"[" + text + b"]", "approval_not_object"),
        (orjson.dumps({**good, "request_id": 7}), "approval_without_request"),
        (orjson.dumps({**good, "reason": {"why": "ok"}}), "approval_signature_invalid"),
        (orjson.dumps({**good, "request_id": "req_" + "z" * HUGE}), "approval_unknown_request"),
        (orjson.dumps(approval(s, "ops-1", parked, tenant_id="globex")),
         "approval_unknown_request"),
        (orjson.dumps(approval(s, "ops-1", parked, decision="withdrawn")),
         "approval_signature_invalid"),
        (orjson.dumps({**good, "type": "withdrawal"}), "approval_unknown_type"),
        (orjson.dumps(approval(s, "ops-1", parked, approval_id="a" * 996_500)),
         "approval_signature_invalid"),
    ]  # fmt: skip
    values = [value for value, _ in hostile]
    bench.produce(s.topics.approvals, run.encode(), [*values, orjson.dumps(expiry), text])
    reasons = bench.dead_letters(values)
    assert [reason.decode() for reason, _ in reasons] == [reason for _, reason in hostile]
    final = bench.client.wait_final(parked["proposal_id"], 60)
    assert final["decision"] == "ROUTED", final["result_payload"]
    topic = s.topics.execution("HIGH_RISK_EXTERNAL")
    calls = [decode_approved_call(m.value()) for m in read_all(s, topic, idle=1)]
    [call] = [c for c in calls if c["proposal_id"] == parked["proposal_id"]]
    assert call["approval_ids"] == [good["approval_id"]]


def test_an_entity_whose_latest_record_cannot_be_read_is_forgotten(
    stack_settings: Settings,
) -> None:
    """Orders delivered, then each replaced by a record its system of record sent broken:
    empty, cut short, not UTF-8, NaN, no state, a state or an owner of the wrong type,
    nested deeper than can be kept. Each is refused and counted, and its order is forgotten as a
    tombstone would forget it: a refund checked against "delivered" would go through for
    an order since refunded. A near-1 MB readable record loads; records whose keys name
    no entity are refused and change nothing; the loader goes on.

    Kept as it was, the older state answered every lookup."""
    s = isolated(stack_settings, f"ref-hostile-{uuid.uuid4().hex[:6]}")
    unreadable = [
        b"",
        b'{"state": "refunded"',
        b'{"state": "refunded", "owner": "\xff"}',
        b'{"state": NaN}',
        b'{"state": ""}',
        b'{"state": 7}',
        b'{"state": "refunded", "owner": ["cust-1"]}',
        b'{"state": "refunded", "attributes": ' + b'{"a": ' * 300 + b"1" + b"}" * 301,
    ]
    ids = [f"WO-{n:05d}-H" for n in range(len(unreadable))]
    big = {"state": "refunded", "attributes": {"note": "n" * 990_000}}
    publish_references(s, [(f"{TENANT}/order/{i}", {"state": "delivered"}) for i in ids]
                       + [(f"{TENANT}/order/WO-99999-H", {"state": "delivered"})])  # fmt: skip
    producer = Producer(s.client_config(**{"partitioner": "murmur2_random"}))
    for i, value in zip(ids, unreadable, strict=True):
        producer.produce(s.topics.reference, value, f"{TENANT}/order/{i}".encode())
    # (a record with no key is refused by the broker: the topic is compacted)
    for key in (b"\xff/order/WO-99999-H", f"{TENANT}/order".encode()):
        producer.produce(s.topics.reference, b'{"state": "refunded"}', key)
    producer.produce(s.topics.reference, orjson.dumps(big), f"{TENANT}/order/WO-88888-H".encode())
    assert producer.flush(30) == 0
    redis = connect(s.redis_url)
    metrics = Metrics(CollectorRegistry())
    loader = ReferenceLoader(s, redis, metrics)
    loader.start()
    try:
        wait_until_loaded(s, timeout=60)
        store = ReferenceStore(redis, s.redis_namespace, s.reference_group_id, s.topics.reference)
        keys = [(TENANT, "order", i) for i in [*ids, "WO-99999-H", "WO-88888-H"]]
        found = store.lookup(keys)
        assert [found[k] for k in keys[: len(ids)]] == [None] * len(ids)
        assert [found[k].state for k in keys[len(ids) :]] == ["delivered", "refunded"]  # type: ignore[union-attr]
        refused = metrics.references.labels("refused")
        deadline = time.monotonic() + 10
        while refused._value.get() < len(unreadable) + 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert refused._value.get() == len(unreadable) + 2
        assert loader._thread.is_alive()
    finally:
        loader.stop()
