"""A record that trips a defect in a batch's own steps (admission, results, approvals): the
consumer goes on, that record is answered as an internal error with nothing routed, and
every other record of its batch as it would have been, exactly once.

The defect is the fault hook ``TOOLSENTRY_FAULT_POISON``: the processor raises, after the
batch's Redis effects, when a record of the batch carries the marker.
"""

from __future__ import annotations

import contextlib
import hashlib
import uuid
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest
from confluent_kafka import Producer

from processor.approval_flow import publish_approvals
from processor.client import ToolsentryClient
from processor.codec.avro import codec
from processor.codec.records import encode_result
from processor.config import Settings
from processor.reference_data import publish_references, wait_until_loaded
from processor.stack.local import free_ports
from processor.state.admission import AdmissionStore
from processor.state.approvals import ApprovalStore
from processor.state.connection import connect
from tests.integration.harness import (
    ProcessorProcess,
    approval,
    existing,
    isolated,
    metric_total,
    read_all,
    token,
)

pytestmark = pytest.mark.integration

MARKER = "poison-7c1e"
POISONED = 7


def _result(tenant: str, message: str) -> bytes:
    """An executor's result for a call nobody routed."""
    return encode_result(
        {
            "result_id": uuid.uuid4().hex, "call_id": "call-x", "proposal_id": "call-x",
            "run_id": "run-x", "tenant_id": tenant, "trace_id": "0af7651916cd43dd8448eb211c80319c",
            "tool_name": "search_kb", "tool_version": "1.0.0", "side_effect_class": "READ_ONLY",
            "idempotency_key": "k-x", "payload_hash": "sha256:00", "attempt": 1,
            "outcome": "FAILED", "retryable": False, "error_code": "boom",
            "error_message": message, "taxonomy_class": None,
            "committed_steps": [], "data": None, "compensation_arguments": None,
            "started_at": 1, "finished_at": 2, "executor_id": "exec-x", "contract_set": "x",
        }
    )  # fmt: skip


@contextlib.contextmanager
def _processor(
    stack_settings: Settings, tmp_path: Path, name: str, **faults: str
) -> Iterator[tuple[Settings, int, ProcessorProcess, ToolsentryClient]]:
    """A processor with these fault hooks on topics of its own, its metrics port, and a
    client of tenant acme."""
    settings = isolated(stack_settings, f"defects-{uuid.uuid4().hex[:6]}")
    (port,) = free_ports(1)
    proc = ProcessorProcess(settings, name, tmp_path, TOOLSENTRY_METRICS_PORT=str(port), **faults)
    proc.start().wait_ready()
    client = ToolsentryClient(settings, "acme", principal_token=token(settings, "acme"))
    try:
        yield settings, port, proc, client
    finally:
        client.close()
        proc.terminate()


def test_a_record_that_trips_a_defect_is_answered_and_its_batch_goes_on(
    stack_settings: Settings, tmp_path: Path
) -> None:
    with _processor(stack_settings, tmp_path, "defects-1", TOOLSENTRY_FAULT_POISON=MARKER) as (
        settings, port, proc, client,
    ):  # fmt: skip
        # Sent back to back to an idle processor: they arrive in a batch or a few.
        queries = [f"return policy {i}" + (f" {MARKER}" * (i == POISONED)) for i in range(20)]
        pids = [
            client.propose("search_kb", {"query": q, "limit": 3}, run_id=f"run-defect-{i}")
            for i, q in enumerate(queries)
        ]
        answers = {pid: client.wait(pid, 60) for pid in pids}
        poisoned = answers[pids[POISONED]]
        assert (poisoned["decision"], poisoned["gate"]) == ("REJECTED", "internal")
        assert poisoned["status"]["taxonomy_class"] == "UNKNOWN_ERROR"
        assert [e["code"] for e in poisoned["result_payload"]["errors"]] == ["internal_error"]
        assert poisoned["allowed_tools"] == []
        others = [answers[p]["decision"] for i, p in enumerate(pids) if i != POISONED]
        assert others == ["ROUTED"] * 19

        # A result that trips it goes to the DLQ, with the reason; the results sent with it
        # (for calls nobody routed) are counted once each, though their batch was decided
        # more than once.
        producer = Producer({"bootstrap.servers": settings.bootstrap_servers})
        for i in range(6):
            text = f"message with {MARKER}" if i == 3 else f"message {i}"
            producer.produce(settings.topics.results, _result("acme", text), b"run-x")
        producer.flush(30)
        after = client.propose("search_kb", {"query": "after", "limit": 3}, run_id="run-after")
        assert client.wait(after, 60)["decision"] == "ROUTED"
        assert proc.alive(), proc.log()[-3000:]

        dead = [dict(m.headers() or []) for m in read_all(settings, settings.topics.dlq, idle=1.5)]
        reasons = Counter(h["toolsentry.error.reason"] for h in dead)
        assert reasons == {b"internal_error": 1, b"result_unknown_call": 5}
        assert {h["toolsentry.source.topic"] for h in dead} == {settings.topics.results.encode()}
        assert metric_total(port, "toolsentry_results_total") == 5
        seen = Counter(
            codec("observation").decode(m.value())["proposal_id"]
            for m in read_all(settings, settings.topics.observations, idle=1.5)
        )
        assert seen == Counter([*pids, after])
        routed = Counter(
            codec("approved_call").decode(m.value())["proposal_id"]
            for m in read_all(settings, settings.topics.execution("READ_ONLY"), idle=1.5)
        )
        assert routed == Counter([p for i, p in enumerate(pids) if i != POISONED] + [after])
        # One proposal and one result failed alone; the batches around them were halved
        # down to them, not decided a record at a time.
        assert metric_total(port, "toolsentry_internal_errors_total") == 2
        assert metric_total(port, "toolsentry_batch_splits_total") <= 2 * 5
        assert proc.log().count("could not be decided") == 2 + int(
            metric_total(port, "toolsentry_batch_splits_total")
        )


CHARGE = {
    "customer_id": "CUS-004211", "payment_method_id": "PM-7Q2K9X4M1A",
    "order_id": "WO-55601-A", "amount": 12.5, "currency": "USD", "reason_code": "balance_due",
}  # fmt: skip


def test_what_a_failed_record_left_in_redis_does_not_answer_it_again(
    stack_settings: Settings, tmp_path: Path
) -> None:
    """Admitted and parked, then failed alone: its key is free to retry (nothing ran), and
    its approval request, never sent, is forgotten: no expiry answers the proposal again."""
    with _processor(stack_settings, tmp_path, "defects-2", TOOLSENTRY_FAULT_POISON=MARKER) as (
        settings, _, proc, client,
    ):  # fmt: skip
        publish_references(settings, existing("acme", "charge_customer_card_v2", CHARGE))
        wait_until_loaded(settings)
        redis = connect(settings.redis_url)
        key = f"k-{uuid.uuid4().hex}"
        search = client.propose("search_kb", {"query": "refunds", "limit": 3},
                                run_id=f"run-{MARKER}-1", idempotency_key=key)  # fmt: skip
        charge = client.propose("charge_customer_card_v2", CHARGE, run_id=f"run-{MARKER}-2")
        for pid in (search, charge):
            answer = client.wait(pid, 60)
            assert (answer["decision"], answer["gate"]) == ("REJECTED", "internal"), answer
        assert AdmissionStore(redis, settings.redis_namespace).record("acme", key)["state"] == (
            "FAILED_RETRYABLE"
        )
        # Parked (the batch was decided whole first), then forgotten: nothing for the
        # expiry sweeper to find.
        assert ApprovalStore(redis, settings.redis_namespace).list_parked(True) == []
        base = f"{settings.redis_namespace}:{{acme}}"
        assert redis.zcard(f"{base}:parkexp") == 0 and redis.hlen(f"{base}:parked") == 0
        after = client.propose("search_kb", {"query": "after", "limit": 3}, run_id="run-after")
        assert client.wait(after, 60)["decision"] == "ROUTED"
        seen = Counter(
            codec("observation").decode(m.value())["proposal_id"]
            for m in read_all(settings, settings.topics.observations, idle=1.5)
        )
        assert seen == Counter([search, charge, after])
        assert proc.alive(), proc.log()[-3000:]


CANCEL = {"order_id": "WO-12345-A", "reason_code": "customer_request", "confirm": True}


@pytest.mark.parametrize("decision", ["approved", "rejected"])
def test_an_approval_record_that_fails_alone_answers_its_parked_call_once(
    stack_settings: Settings, tmp_path: Path, decision: str
) -> None:
    """Parked; then its approver's decision (a release, or a rejection) failed alone on a
    defect after the batch's Redis effects. Its request has ended, so nothing else will
    answer the parked proposal: it is told of the internal error, once (it was left
    waiting for ever). Nothing is routed, and what parking took comes back. Released, its
    key is not left in flight as a routed call (a retry met IDEMPOTENCY_CONFLICT, and one
    after the deadline was charged again): proposed again, the call parks afresh."""
    with _processor(
        stack_settings, tmp_path, f"defects-{decision}", TOOLSENTRY_FAULT_POISON=MARKER
    ) as (settings, port, proc, client):
        publish_references(settings, existing("acme", "cancel_order", CANCEL))
        wait_until_loaded(settings)
        redis = connect(settings.redis_url)
        store = AdmissionStore(redis, settings.redis_namespace)
        key, run = f"k-{uuid.uuid4().hex}", f"run-{uuid.uuid4().hex[:8]}"
        pid = client.propose("cancel_order", CANCEL, run_id=run, idempotency_key=key)
        parked = client.wait(pid, 60)
        assert parked["decision"] == "PENDING_APPROVAL", parked["result_payload"]
        assert store.run_counters("acme", run) != {"steps": 1}  # (its budgets, taken)
        vote = approval(settings, "ops-1", parked, decision=decision, reason=f"ok {MARKER}")
        publish_approvals(settings, run, [vote])
        after = client.propose("search_kb", {"query": "after", "limit": 3}, run_id="run-after")

        final = client.wait_final(pid, 60)
        assert (final["decision"], final["gate"]) == ("REJECTED", "internal"), final
        assert final["status"]["taxonomy_class"] == "UNKNOWN_ERROR"
        assert [e["code"] for e in final["result_payload"]["errors"]] == ["internal_error"]
        assert client.wait(after, 60)["decision"] == "ROUTED"
        assert [o["decision"] for o in client.history(pid)] == ["PENDING_APPROVAL", "REJECTED"]
        routed = read_all(settings, settings.topics.execution("HIGH_RISK_EXTERNAL"), idle=1)
        assert routed == []
        assert read_all(settings, settings.topics.dlq, idle=1) == []
        assert metric_total(port, "toolsentry_internal_errors_total") == 1
        # Only the park's step stays: it was a proposal of its run.
        assert store.run_counters("acme", run) == {"steps": 1}
        # The request has ended as its approver decided; no expiry answers it again.
        entry = ApprovalStore(redis, settings.redis_namespace).find(parked["approval_request_id"])
        assert entry is not None and entry["state"] == {"approved": "released"}.get(
            decision, decision
        )
        assert redis.zcard(f"{settings.redis_namespace}:{{acme}}:parkexp") == 0
        record = store.record("acme", key)
        if decision == "approved":
            assert (record["state"], record["unrouted"]) == ("FAILED_RETRYABLE", "1"), record
            again = client.propose("cancel_order", CANCEL, run_id=run, idempotency_key=key)
            assert client.wait(again, 60)["decision"] == "PENDING_APPROVAL"
        else:  # (a declined call's record waits out its request, as always)
            assert (record["state"], record["awaiting"]) == ("PENDING", "0"), record
        assert proc.alive(), proc.log()[-3000:]


def test_a_release_whose_outputs_cannot_be_encoded_gives_back_what_parking_took(
    stack_settings: Settings, tmp_path: Path
) -> None:
    """Parked, then released, and the release's outputs could not be encoded: its approval
    record goes to the DLQ, nothing is routed, and the call's key is not left in flight as
    a routed call, nor what parking took kept."""
    poisoned = {"TOOLSENTRY_FAULT_POISON_ENCODING": MARKER}
    with _processor(stack_settings, tmp_path, "defects-6", **poisoned) as (
        settings, _, proc, client,
    ):  # fmt: skip
        publish_references(settings, existing("acme", "cancel_order", CANCEL))
        wait_until_loaded(settings)
        store = AdmissionStore(connect(settings.redis_url), settings.redis_namespace)
        key, run = f"k-{uuid.uuid4().hex}", f"run-{uuid.uuid4().hex[:8]}"
        pid = client.propose("cancel_order", CANCEL, run_id=run, idempotency_key=key)
        parked = client.wait(pid, 60)
        assert parked["decision"] == "PENDING_APPROVAL", parked["result_payload"]
        publish_approvals(settings, run, [approval(settings, "ops-1", parked, reason=MARKER)])
        dead = read_all(settings, settings.topics.dlq, expect=1, idle=1)
        assert [dict(m.headers() or [])["toolsentry.error.reason"] for m in dead] == [
            b"encoding_failed"
        ]
        assert read_all(settings, settings.topics.execution("HIGH_RISK_EXTERNAL"), idle=1) == []
        record = store.record("acme", key)
        assert (record["state"], record["unrouted"]) == ("FAILED_RETRYABLE", "1"), record
        assert store.run_counters("acme", run) == {"steps": 1}
        assert proc.alive(), proc.log()[-3000:]


def test_a_record_whose_outputs_cannot_be_encoded_gives_back_what_it_took(
    stack_settings: Settings, tmp_path: Path
) -> None:
    """Decided and admitted, then its outputs could not be encoded: it goes to the DLQ,
    counts as an internal error, and its key is not left PENDING."""
    poisoned = {"TOOLSENTRY_FAULT_POISON_ENCODING": MARKER}
    with _processor(stack_settings, tmp_path, "defects-3", **poisoned) as (
        settings, port, proc, client,
    ):  # fmt: skip
        key = f"k-{uuid.uuid4().hex}"
        client.propose("search_kb", {"query": "refunds", "limit": 3},
                       run_id=f"run-{MARKER}-enc", idempotency_key=key)  # fmt: skip
        after = client.propose("search_kb", {"query": "after", "limit": 3}, run_id="run-after")
        assert client.wait(after, 60)["decision"] == "ROUTED"
        dead = [dict(m.headers() or []) for m in read_all(settings, settings.topics.dlq, idle=1.5)]
        assert [h["toolsentry.error.reason"] for h in dead] == [b"encoding_failed"]
        store = AdmissionStore(connect(settings.redis_url), settings.redis_namespace)
        assert store.record("acme", key)["state"] == "FAILED_RETRYABLE"
        assert metric_total(port, "toolsentry_internal_errors_total") == 1
        routed = read_all(settings, settings.topics.execution("READ_ONLY"), idle=1)
        assert [codec("approved_call").decode(m.value())["proposal_id"] for m in routed] == [after]
        assert proc.alive(), proc.log()[-3000:]


def test_a_parked_call_whose_outputs_fail_after_its_batch_was_split_keeps_no_request(
    stack_settings: Settings, tmp_path: Path
) -> None:
    """One batch, split by a defect in its second record; its first, a call parked for
    approval, then cannot be encoded. It goes to the DLQ, and its approval request goes
    with it (the split's halves keep what each parked): no expiry answers it later."""
    settings = isolated(stack_settings, f"defects-{uuid.uuid4().hex[:6]}")
    (port,) = free_ports(1)
    unencodable = "enc-5b2a"
    faults = {"TOOLSENTRY_FAULT_POISON": MARKER, "TOOLSENTRY_FAULT_POISON_ENCODING": unencodable}
    proc = ProcessorProcess(settings, "defects-5", tmp_path, TOOLSENTRY_METRICS_PORT=str(port),
                            **faults)  # fmt: skip
    proc.start().wait_ready()  # loads the references, then stops
    try:
        publish_references(settings, existing("acme", "charge_customer_card_v2", CHARGE))
        wait_until_loaded(settings)
    finally:
        proc.terminate()
    # Sent before the processor starts: one partition (one run), one batch, in this order;
    # and in one record batch (lingering until the flush), which the processor's consumer
    # hands over whole. Sent as two, the first may reach the processor alone on a loaded
    # machine: the defect is then a batch of one, never split (seen once in a full run).
    one_batch = settings.model_copy(update={"kafka": {**settings.kafka, "linger.ms": 5_000}})
    client = ToolsentryClient(one_batch, "acme", principal_token=token(settings, "acme"))
    charge = client.propose("charge_customer_card_v2", CHARGE, run_id="run-split",
                            idempotency_key=f"k-{unencodable}-{uuid.uuid4().hex}")  # fmt: skip
    search = client.propose("search_kb", {"query": "refunds", "limit": 3}, run_id="run-split",
                            idempotency_key=f"k-{MARKER}-{uuid.uuid4().hex}")  # fmt: skip
    client.flush(30)
    proc.start().wait_ready()
    try:
        answer = client.wait(search, 60)
        assert (answer["decision"], answer["gate"]) == ("REJECTED", "internal"), answer
        assert metric_total(port, "toolsentry_batch_splits_total") >= 1
        dead = read_all(settings, settings.topics.dlq, idle=1.5)
        assert [dict(m.headers() or [])["toolsentry.error.reason"] for m in dead] == [
            b"encoding_failed"
        ]
        redis = connect(settings.redis_url)
        assert ApprovalStore(redis, settings.redis_namespace).list_parked(True) == []
        base = f"{settings.redis_namespace}:{{acme}}"
        assert redis.zcard(f"{base}:parkexp") == 0 and redis.hlen(f"{base}:parked") == 0
        seen = [
            codec("observation").decode(m.value())["proposal_id"]
            for m in read_all(settings, settings.topics.observations, idle=1.5)
        ]
        assert seen == [search], (charge, seen)
        assert proc.alive(), proc.log()[-3000:]
    finally:
        client.close()
        proc.terminate()


def test_a_record_with_a_huge_key_is_a_dead_letter_that_fits(
    stack_settings: Settings, tmp_path: Path
) -> None:
    """A 600 KB key and a 600 KB value the broker took (a compressing producer): its dead
    letter keeps a cut copy of each, with sizes and digests, and fits under the broker's
    limit. A full copy would be refused, and its batch would abort and come back for ever,
    with the proposals behind it."""
    with _processor(stack_settings, tmp_path, "defects-4") as (settings, _, proc, client):
        key, value = b"k" * 600_000, b"{" + b"x" * 600_000
        producer = Producer(
            settings.client_config(**{"compression.type": "zstd", "message.max.bytes": 2_000_000})
        )
        producer.produce(settings.topics.proposals, value, key)
        assert producer.flush(30) == 0
        behind = [
            client.propose("search_kb", {"query": f"query {i}", "limit": 3}, run_id=f"run-{i}")
            for i in range(5)
        ]
        answers = [client.wait(pid, 60) for pid in behind]
        assert [o["decision"] for o in answers] == ["ROUTED"] * 5, answers[0]["result_payload"]
        [dead] = read_all(settings, settings.topics.dlq, idle=1.5)
        headers = dict(dead.headers() or [])
        assert headers["toolsentry.key.truncated_from"] == b"600000"
        assert headers["toolsentry.key.sha256"] == hashlib.sha256(key).hexdigest().encode()
        assert headers["toolsentry.value.truncated_from"] == b"600001"
        assert dead.key() == key[:1024] and value.startswith(dead.value())
        assert len(dead.key()) + len(dead.value()) < 1_000_000
        assert proc.alive(), proc.log()[-3000:]
