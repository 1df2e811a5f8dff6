"""Executors against the real broker: approved calls on tool.exec.* in, results on
tool.results out (read_committed), with the input offsets in the same transaction."""

from __future__ import annotations

import hashlib
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson
import pytest
from confluent_kafka import ConsumerGroupTopicPartitions, Producer, TopicPartition
from confluent_kafka.admin import AdminClient
from prometheus_client import CollectorRegistry

from processor import executor as executor_module
from processor.app import producer_config
from processor.codec.avro import SCHEMAS_DIR, AvroCodec, codec, known_headers
from processor.codec.records import decode_approved_call, decode_result
from processor.config import Settings
from processor.executor import Call, Executor, Failed, Handler, ReferenceUpdate, Succeeded
from processor.support_executor import SupportStore
from tests.integration.harness import ROOT, isolated, read_all, settings_env

pytestmark = pytest.mark.integration

TENANT = "acme"


def approved_call(
    tool: str,
    arguments: dict[str, Any],
    side_effect_class: str = "READ_ONLY",
    deadline_in_ms: int = 60_000,
    idempotency_key: str | None = None,
) -> dict[str, Any]:
    """An ApprovedCall datum as the processor writes it (``approved_call_record``)."""
    now = int(time.time() * 1000)
    canonical = orjson.dumps(arguments, option=orjson.OPT_SORT_KEYS)
    return {
        "call_id": uuid.uuid4().hex,
        "proposal_id": uuid.uuid4().hex,
        "run_id": f"run-{uuid.uuid4().hex[:8]}",
        "tenant_id": TENANT,
        "trace_id": uuid.uuid4().hex,
        "traceparent": None,
        "tool_name": tool,
        "tool_version": "1.0.0",
        "side_effect_class": side_effect_class,
        "arguments": canonical.decode(),
        "payload_hash": "sha256:" + hashlib.sha256(canonical).hexdigest(),
        "idempotency_key": idempotency_key or uuid.uuid4().hex,
        "deadline": now + deadline_in_ms,
        "created_at": now,
        "attempt": 1,
        "approval_ids": [],
        "contract_set": "cs-test",
    }


def produce(settings: Settings, records: list[tuple[str, bytes | None, bytes]]) -> None:
    """(topic, key, value) records, acknowledged by the broker before returning."""
    producer = Producer(settings.client_config(**{"enable.idempotence": True}))
    for topic, key, value in records:
        producer.produce(topic, value, key)
    assert producer.flush(30) == 0


def send_calls(settings: Settings, calls: list[dict[str, Any]]) -> None:
    produce(
        settings,
        [
            (
                settings.topics.execution(c["side_effect_class"]),
                c["run_id"].encode(),
                codec("approved_call").encode(c),
            )
            for c in calls
        ],
    )


def drain(executor: Executor, records: int, timeout: float = 60) -> None:
    """run_once until ``records`` input records are committed (the first polls also wait
    for the group to assign the partitions)."""
    done, deadline = 0, time.monotonic() + timeout
    while done < records:
        assert time.monotonic() < deadline, f"only {done} of {records} records committed"
        done += executor.run_once(0.5)


def results(settings: Settings, expect: int) -> dict[str, dict[str, Any]]:
    """The committed results by call_id (a duplicate call_id would fail the count)."""
    messages = read_all(settings, settings.topics.results, expect=expect, idle=1.0)
    decoded = [(m.key(), decode_result(m.value())) for m in messages]
    for key, r in decoded:
        assert key == r["run_id"].encode()
    out = {r["call_id"]: r for _, r in decoded}
    assert len(decoded) == len(out) == expect, [r["call_id"] for _, r in decoded]
    return out


def executor(settings: Settings, handlers: dict[str, Handler], **kw: Any) -> Executor:
    name = uuid.uuid4().hex[:8]
    fast = settings.model_copy(
        update={"consumer": {"session.timeout.ms": 6000, "heartbeat.interval.ms": 500}}
    )
    kw.setdefault("group_id", f"executor-{name}")
    kw.setdefault("executor_id", name)
    return Executor(fast, handlers, **kw)


class Scenario:
    """One executor run over a mix of calls; each test below checks one of them."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.seen: list[str] = []
        self.ok = approved_call("lookup_order", {"order_id": "WO-12345-A"})
        self.late = approved_call("lookup_order", {"order_id": "WO-24680-B"}, deadline_in_ms=-1)
        self.boom = approved_call(
            "search_kb", {"query": "card 4242 4242 4242 4242"}, "MEDIUM_RISK_WRITE"
        )
        self.partial = approved_call(
            "refund_order", {"order_id": "WO-12345-A", "amount": 5}, "CRITICAL_MUTATION"
        )
        self.unknown = approved_call("archive_user", {"user_id": "U-1"}, "HIGH_RISK_EXTERNAL")
        # Behind the undecodable records in the same partition (same key).
        self.after_garbage = {
            **approved_call("lookup_order", {"order_id": "WO-55555-B"}),
            "run_id": "run-garbage",
        }

    def handlers(self) -> dict[str, Handler]:
        def lookup(call: Call) -> Succeeded:
            self.seen.append(call.call_id)
            ref = ReferenceUpdate("order", call.arguments["order_id"], "seen", "CUS-1")
            return Succeeded({"order_id": call.arguments["order_id"]}, (ref,))

        def search(call: Call) -> Succeeded:
            raise RuntimeError(f"cannot search for {call.arguments['query']}")

        def refund(call: Call) -> Failed:
            return Failed(
                "failed_after_commit",
                "refund issued, then the ledger call failed",
                taxonomy_class="COMPENSATION_REQUIRED",
                committed_steps=("refund_issued", "ledger_reserved"),
                compensation_arguments={"refund_id": "RF-1", "amount": 5},
            )

        return {"lookup_order": lookup, "search_kb": search, "refund_order": refund}

    def run(self) -> dict[str, dict[str, Any]]:
        s = self.settings
        calls = [self.ok, self.late, self.boom, self.partial, self.unknown]
        send_calls(s, calls)
        corrupt = codec("approved_call").header + b"\xff\xff\xff"
        read_only = s.topics.execution("READ_ONLY")
        garbage = [(read_only, b"run-garbage", b"not avro"), (read_only, b"run-garbage", corrupt)]
        produce(s, garbage)
        send_calls(s, [self.after_garbage])
        self.garbage = [value for _, _, value in garbage]
        registry = CollectorRegistry()
        ex = executor(s, self.handlers(), metrics_registry=registry)
        try:
            drain(ex, len(calls) + 3)
            assert ex.undecodable == 2
            assert registry.get_sample_value("toolsentry_executor_undecodable_total") == 2
            committed = {"result": "committed"}
            assert registry.get_sample_value("toolsentry_executor_transactions_total", committed)
        finally:
            ex.close()
        return results(s, len(calls) + 1)


@pytest.fixture(scope="module")
def scenario(stack_settings: Settings) -> Iterator[tuple[Scenario, dict[str, dict[str, Any]]]]:
    sc = Scenario(isolated(stack_settings, f"exec-{uuid.uuid4().hex[:6]}"))
    yield sc, sc.run()


def test_a_success_carries_the_data_and_the_call(scenario: Any) -> None:
    sc, out = scenario
    r = out[sc.ok["call_id"]]
    assert r["outcome"] == "SUCCEEDED" and r["retryable"] is False
    assert orjson.loads(r["data"]) == {"order_id": "WO-12345-A"}
    assert r["result_id"] == hashlib.sha256(f"{sc.ok['call_id']}/1".encode()).hexdigest()[:32]
    for field in ("proposal_id", "run_id", "tenant_id", "trace_id", "tool_name",
                  "tool_version", "side_effect_class", "idempotency_key", "payload_hash",
                  "attempt", "contract_set"):  # fmt: skip
        assert r[field] == sc.ok[field], field
    assert r["error_code"] is r["taxonomy_class"] is r["compensation_arguments"] is None
    assert r["committed_steps"] == []
    assert sc.ok["created_at"] <= r["started_at"] <= r["finished_at"] <= time.time() * 1000


def test_the_success_s_reference_update_is_published(scenario: Any) -> None:
    sc, _ = scenario
    refs = {
        m.key(): orjson.loads(m.value())
        for m in read_all(sc.settings, sc.settings.topics.reference, idle=1.0)
    }
    assert refs[b"acme/order/WO-12345-A"] == {"state": "seen", "owner": "CUS-1"}


def test_a_call_past_its_deadline_times_out_without_running(scenario: Any) -> None:
    sc, out = scenario
    r = out[sc.late["call_id"]]
    assert (r["outcome"], r["error_code"], r["taxonomy_class"]) == (
        "TIMED_OUT",
        "deadline_exceeded",
        "TIMEOUT",
    )
    assert r["retryable"] is True and r["data"] is None
    assert sc.late["call_id"] not in sc.seen
    assert sc.ok["call_id"] in sc.seen


def test_a_handler_exception_fails_closed_without_quoting_arguments(scenario: Any) -> None:
    sc, out = scenario
    r = out[sc.boom["call_id"]]
    assert (r["outcome"], r["error_code"], r["taxonomy_class"], r["retryable"]) == (
        "FAILED",
        "handler_error",
        "UNKNOWN_ERROR",
        False,
    )
    assert r["error_message"] == "RuntimeError"


def test_committed_steps_and_compensation_arguments_round_trip(scenario: Any) -> None:
    sc, out = scenario
    r = out[sc.partial["call_id"]]
    assert r["outcome"] == "FAILED"
    assert r["committed_steps"] == ["refund_issued", "ledger_reserved"]
    assert orjson.loads(r["compensation_arguments"]) == {"refund_id": "RF-1", "amount": 5}
    assert r["taxonomy_class"] == "COMPENSATION_REQUIRED"


def test_a_tool_without_a_handler_fails_closed(scenario: Any) -> None:
    sc, out = scenario
    r = out[sc.unknown["call_id"]]
    assert (r["outcome"], r["error_code"], r["retryable"]) == ("FAILED", "no_handler", False)


def test_undecodable_records_are_dead_lettered_and_the_executor_goes_on(scenario: Any) -> None:
    sc, out = scenario
    assert out[sc.after_garbage["call_id"]]["outcome"] == "SUCCEEDED"
    assert sc.after_garbage["call_id"] in sc.seen
    dead = read_all(sc.settings, sc.settings.topics.call_dlq, expect=2, idle=1.0)
    assert [m.value() for m in dead] == sc.garbage
    source = sc.settings.topics.execution("READ_ONLY").encode()
    for m in dead:
        headers = dict(m.headers() or [])
        assert m.key() == b"run-garbage"
        assert headers["toolsentry.error.reason"] == b"approved_call_invalid"
        assert headers["toolsentry.source.topic"] == source


def test_a_call_that_cannot_be_handed_to_a_handler_is_answered_and_dead_lettered(
    stack_settings: Settings,
) -> None:
    """A call record that decodes but cannot be run (its arguments are not a JSON object,
    or not JSON at all: another producer wrote it, or a processor of another version) still
    names its call. Dead-lettered only, its agent would hear nothing until the call's
    deadline and grace passed; it is also answered on tool.results, in the same
    transaction, as a failure that does not claim the tool ran. A record that names no
    call (no idempotency key) is only dead-lettered."""
    s = isolated(stack_settings, f"exec-unrunnable-{uuid.uuid4().hex[:6]}")
    run = {"run_id": "run-unrunnable"}  # one partition, in this order
    listed = {**approved_call("lookup_order", {}), **run, "arguments": '["WO-12345-A"]'}
    broken = {**approved_call("lookup_order", {}), **run, "arguments": '{"order_id": WO-1'}
    nameless = {**approved_call("lookup_order", {}), **run, "arguments": "7",
                "idempotency_key": ""}  # fmt: skip
    after = {**approved_call("lookup_order", {"order_id": "WO-55555-B"}), **run}
    send_calls(s, [listed, broken, nameless, after])
    sc = Scenario(s)
    ex = executor(s, sc.handlers())
    try:
        drain(ex, 4)
        assert ex.undecodable == 3
    finally:
        ex.close()
    assert sc.seen == [after["call_id"]]  # the handler never saw the unreadable ones
    out = results(s, 3)
    assert out[after["call_id"]]["outcome"] == "SUCCEEDED"
    for call in (listed, broken):
        r = out[call["call_id"]]
        assert (r["outcome"], r["error_code"], r["taxonomy_class"]) == (
            "FAILED",
            "approved_call_invalid",
            "UNKNOWN_ERROR",
        )
        assert r["result_id"] == hashlib.sha256(f"{call['call_id']}/1".encode()).hexdigest()[:32]
        for field in ("proposal_id", "run_id", "tenant_id", "trace_id", "tool_name",
                      "tool_version", "side_effect_class", "idempotency_key", "payload_hash",
                      "attempt", "contract_set"):  # fmt: skip
            assert r[field] == call[field], field
        assert r["committed_steps"] == [] and r["data"] is r["compensation_arguments"] is None
        assert "not run" in r["error_message"] and "WO-" not in r["error_message"]
    dead = read_all(s, s.topics.call_dlq, expect=3, idle=1.0)
    assert [decode_approved_call(m.value())["call_id"] for m in dead] == [
        listed["call_id"], broken["call_id"], nameless["call_id"],
    ]  # fmt: skip
    for m in dead:
        assert dict(m.headers() or [])["toolsentry.error.reason"] == b"approved_call_invalid"


def _newer_codec() -> AvroCodec:
    """The approved-call schema as a newer processor might write it: a field more."""
    schema = orjson.loads((SCHEMAS_DIR / "approved_call.avsc").read_bytes())
    schema["fields"].append({"name": "priority", "type": "int", "default": 0})
    return AvroCodec(schema)


def committed_offsets(settings: Settings, group: str, topic: str) -> dict[int, int]:
    admin = AdminClient(settings.client_config())
    partitions = admin.list_topics(topic, timeout=10).topics[topic].partitions
    parts = [TopicPartition(topic, p) for p in partitions]
    [offsets] = admin.list_consumer_group_offsets(
        [ConsumerGroupTopicPartitions(group, parts)]
    ).values()
    return {tp.partition: tp.offset for tp in offsets.result(10).topic_partitions if tp.offset >= 0}


def test_a_call_of_a_newer_schema_waits_for_an_executor_that_knows_it(
    stack_settings: Settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A rolling upgrade: the processor writes a schema this executor does not know. The
    call is neither run, skipped nor dead-lettered; its partition stops at it (what comes
    after it waits too), and the upgraded executor that takes the partition over runs both."""
    s = isolated(stack_settings, f"exec-newer-{uuid.uuid4().hex[:6]}")
    newer = _newer_codec()
    run = {"run_id": "run-upgrade"}  # one key: one partition, in this order
    before, held, after = (
        {**approved_call("lookup_order", {"order_id": f"WO-1234{i}-A"}), **run} for i in range(3)
    )
    topic = s.topics.execution("READ_ONLY")
    produce(s, [(topic, b"run-upgrade", codec("approved_call").encode(before)),
                (topic, b"run-upgrade", newer.encode_checked({**held, "priority": 1})),
                (topic, b"run-upgrade", codec("approved_call").encode(after))])  # fmt: skip
    sc = Scenario(s)
    registry = CollectorRegistry()
    group = f"executor-{uuid.uuid4().hex[:8]}"
    old = executor(s, sc.handlers(), group_id=group, metrics_registry=registry)
    try:
        drain(old, 1)
        deadline = time.monotonic() + 3
        while time.monotonic() < deadline:
            assert old.run_once(0.3) == 0
    finally:
        old.close()
    assert sc.seen == [before["call_id"]]
    assert registry.get_sample_value("toolsentry_executor_unknown_schema_total", {}) >= 1
    assert list(committed_offsets(s, group, topic).values()) == [1]  # at the held call
    assert read_all(s, s.topics.call_dlq, idle=1.0) == []

    # The upgraded executor knows the schema (a stand-in: this one is taught it).
    def decode(value: bytes) -> dict[str, Any]:
        if value[:10] != newer.header:
            return decode_approved_call(value)
        datum = newer.decode(value)
        datum.pop("priority")
        return decode_approved_call(codec("approved_call").encode_checked(datum))

    monkeypatch.setattr(executor_module, "known_headers", lambda: known_headers() | {newer.header})
    monkeypatch.setattr(executor_module, "decode_approved_call", decode)
    upgraded = executor(s, sc.handlers(), group_id=group)
    try:
        drain(upgraded, 2)
    finally:
        upgraded.close()
    assert sc.seen == [before["call_id"], held["call_id"], after["call_id"]]
    assert set(results(s, 3)) == {before["call_id"], held["call_id"], after["call_id"]}


# -- the support executor: a redelivered call is not applied twice ---------------------------


def refunded_cents(store: SupportStore) -> int:
    order = store.order(TENANT, "WO-24680-B")
    assert order is not None
    return int(order["refunded_cents"])


class Crash(BaseException):
    """Stands in for the process dying after the tool ran and before the commit."""


def crash_after(handler: Handler, ran: list[str]) -> Handler:
    """Runs the tool, then crashes the first time only."""

    def run(call: Call) -> Succeeded | Failed:
        answer = handler(call)
        ran.append(call.call_id)
        if len(ran) == 1:
            raise Crash
        return answer

    return run


def refund_then_crash(
    s: Settings, store: SupportStore, deadline_in_ms: int = 60_000
) -> tuple[dict[str, Any], list[str], dict[str, Handler], str]:
    """A refund whose executor dies after the refund and before its commit: nothing is
    published, no offset committed. Returns the call, the calls its handler ran, the
    handlers and the executor's name (its group and id)."""
    args = {"order_id": "WO-24680-B", "amount": 19.99, "currency": "USD", "reason_code": "damaged"}
    call = approved_call("refund_order", args, "CRITICAL_MUTATION", deadline_in_ms=deadline_in_ms)
    send_calls(s, [call])
    ran: list[str] = []
    handlers = {**store.handlers(), "refund_order": crash_after(store.refund_order, ran)}
    name = uuid.uuid4().hex[:8]
    first = executor(s, handlers, group_id=f"executor-{name}", executor_id=name)
    with pytest.raises(Crash):
        drain(first, 1)
    first.close()
    return call, ran, handlers, name


@pytest.fixture
def support(stack_settings: Settings, tmp_path: Path) -> Iterator[tuple[Settings, SupportStore]]:
    s = isolated(stack_settings, f"exec-support-{uuid.uuid4().hex[:6]}")
    store = SupportStore(tmp_path / "support.db")
    store.seed([(f"{TENANT}/order/WO-24680-B", {"state": "delivered", "owner": "CUS-004211"})])
    yield s, store
    store.close()


def test_a_redelivered_refund_is_applied_once(
    support: tuple[Settings, SupportStore],
) -> None:
    s, store = support
    call, ran, handlers, name = refund_then_crash(s, store)
    assert read_all(s, s.topics.results, idle=1.0) == []
    assert refunded_cents(store) == 1999

    # The same instance restarts: the call is delivered again and its handler runs again.
    second = executor(s, handlers, group_id=f"executor-{name}", executor_id=name)
    try:
        drain(second, 1)
    finally:
        second.close()
    assert ran == [call["call_id"]] * 2
    r = results(s, 1)[call["call_id"]]
    assert r["outcome"] == "SUCCEEDED"
    assert orjson.loads(r["data"])["status"] == "settled"
    assert refunded_cents(store) == 1999
    assert store.db.execute("SELECT count(*) FROM refunds").fetchone()[0] == 1
    refs = {m.key(): m.value() for m in read_all(s, s.topics.reference, idle=1.0)}
    assert orjson.loads(refs[b"acme/order/WO-24680-B"])["attributes"]["refunded_amount"] == 19.99


@pytest.mark.parametrize("recorded", [True, False])
def test_a_call_that_ran_and_comes_back_late_is_not_reported_unrun(
    support: tuple[Settings, SupportStore], recorded: bool
) -> None:
    """The refund ran, the process died before its result was published, and the
    restarted executor meets the call past its deadline: the store's answer is
    published, not TIMED_OUT ("nothing ran"). Without ``recorded`` the executor cannot
    know, which is why the reference executor passes it."""
    s, store = support
    call, ran, handlers, name = refund_then_crash(s, store, deadline_in_ms=3_000)
    later = time.time() + 60  # the restart came long after the call's deadline
    second = executor(
        s,
        handlers,
        group_id=f"executor-{name}",
        executor_id=name,
        clock=lambda: later,
        recorded=store.recorded if recorded else None,
    )
    try:
        drain(second, 1)
    finally:
        second.close()
    assert ran == [call["call_id"]]  # not run again either way
    r = results(s, 1)[call["call_id"]]
    if recorded:
        assert r["outcome"] == "SUCCEEDED"
        assert orjson.loads(r["data"])["status"] == "settled"
        refs = {m.key(): m.value() for m in read_all(s, s.topics.reference, idle=1.0)}
        assert b"acme/order/WO-24680-B" in refs
    else:
        assert r["outcome"] == "TIMED_OUT"
    assert refunded_cents(store) == 1999


def test_an_aborted_batch_is_answered_again_without_running_its_handlers(
    support: tuple[Settings, SupportStore],
) -> None:
    """The transaction of a batch whose handlers ran is aborted (another producer takes
    the executor's transactional id while the batch runs). The batch comes back; its
    handlers do not run again, and its answers are published as given, even though the
    call's deadline has passed by then."""
    s, store = support
    name = uuid.uuid4().hex[:8]
    call = approved_call("lookup_order", {"order_id": "WO-24680-B"}, deadline_in_ms=2_000)
    send_calls(s, [call])
    ran: list[str] = []
    usurpers: list[Producer] = []
    now = [time.time()]

    def lookup(c: Call) -> Succeeded | Failed:
        ran.append(c.call_id)
        if len(usurpers) == 0:
            usurper = Producer(producer_config(ex.settings))
            usurper.init_transactions(30)  # fences the executor's open transaction
            usurpers.append(usurper)
            now[0] += 60  # and by the time the batch comes back, its deadline passed
        return store.lookup_order(c)

    ex = executor(s, {"lookup_order": lookup}, group_id=f"executor-{name}", executor_id=name,
                  clock=lambda: now[0])  # fmt: skip
    try:
        drain(ex, 1)
    finally:
        ex.close()
        for usurper in usurpers:
            usurper.flush(5)
    assert ran == [call["call_id"]]
    r = results(s, 1)[call["call_id"]]
    assert r["outcome"] == "SUCCEEDED"
    assert orjson.loads(r["data"])["match_count"] == 1


def test_a_stopped_executor_leaves_the_calls_it_had_not_started_to_the_next_one(
    stack_settings: Settings,
) -> None:
    """stop() (SIGTERM) while a batch runs: the call in hand finishes and is published with
    the one before it, the rest of the batch is not started, and the executor that takes
    the partition over runs those, in order: every call runs once, none is lost."""
    s = isolated(stack_settings, f"exec-stop-{uuid.uuid4().hex[:6]}")
    group = f"executor-{uuid.uuid4().hex[:8]}"
    run_id = f"run-{uuid.uuid4().hex[:8]}"  # one key: the calls share a partition
    calls = [
        {**approved_call("lookup_order", {"order_id": f"WO-1234{i}-A"}), "run_id": run_id}
        for i in range(6)
    ]
    send_calls(s, calls)
    ran: list[tuple[str, str]] = []

    def lookup(by: str) -> Handler:
        def handler(c: Call) -> Succeeded:
            ran.append((by, c.call_id))
            if len(ran) == 2:
                first.stop()  # the signal arrives while the second call runs
            return Succeeded({"order_id": c.arguments["order_id"]})

        return handler

    first = executor(s, {"lookup_order": lookup("first")}, group_id=group)
    thread = threading.Thread(target=first.run, name="first-executor")
    thread.start()
    thread.join(60)
    if thread.is_alive():
        first.stop()
        thread.join(30)
        pytest.fail("the first executor never ran two calls")
    ids = [c["call_id"] for c in calls]
    assert ran == [("first", i) for i in ids[:2]]
    second = executor(s, {"lookup_order": lookup("second")}, group_id=group)
    try:
        drain(second, len(calls) - 2)
    finally:
        second.close()
    assert ran[2:] == [("second", i) for i in ids[2:]]
    out = results(s, len(calls))
    assert {i: r["outcome"] for i, r in out.items()} == dict.fromkeys(ids, "SUCCEEDED")


def test_a_batch_cut_short_by_its_time_budget_leaves_the_rest_to_the_next_batch(
    stack_settings: Settings,
) -> None:
    """``batch_max_s=0``: each batch starts one call, commits it, and seeks back to the
    next, so slow handlers never keep a batch past the group's max.poll.interval.ms. On
    the real broker every call still runs once, in order, with one result each, and each
    has its own transaction."""
    s = isolated(stack_settings, f"exec-cut-{uuid.uuid4().hex[:6]}")
    run_id = f"run-{uuid.uuid4().hex[:8]}"  # one key: the calls share a partition
    calls = [
        {**approved_call("lookup_order", {"order_id": f"WO-1234{i}-A"}), "run_id": run_id}
        for i in range(5)
    ]
    send_calls(s, calls)
    ran: list[str] = []

    def lookup(c: Call) -> Succeeded:
        ran.append(c.call_id)
        return Succeeded({"order_id": c.arguments["order_id"]})

    registry = CollectorRegistry()
    ex = executor(s, {"lookup_order": lookup}, batch_max_s=0.0, metrics_registry=registry)
    try:
        drain(ex, len(calls))
    finally:
        ex.close()
    ids = [c["call_id"] for c in calls]
    assert ran == ids
    out = results(s, len(calls))
    assert {i: r["outcome"] for i, r in out.items()} == dict.fromkeys(ids, "SUCCEEDED")
    committed = {"result": "committed"}
    assert registry.get_sample_value("toolsentry_executor_transactions_total", committed) == 5
    assert registry.get_sample_value("toolsentry_executor_batches_cut_total") >= 1


def test_executors_for_different_classes_on_one_host_have_ids_of_their_own(
    stack_settings: Settings,
) -> None:
    reads = Executor(stack_settings, {}, classes=["read_only"])
    writes = Executor(stack_settings, {}, classes=["critical_mutation"])
    again = Executor(stack_settings, {}, classes=["READ_ONLY"])
    assert reads.executor_id != writes.executor_id
    assert reads.executor_id == again.executor_id
    assert reads.executor_id.startswith(stack_settings.instance_id)
    ids = {producer_config(e.settings)["transactional.id"] for e in (reads, writes)}
    assert len(ids) == 2


def test_a_result_too_large_for_the_broker_is_published_as_such(
    support: tuple[Settings, SupportStore],
) -> None:
    s, _ = support
    big = approved_call("search_kb", {"query": "everything"}, "READ_ONLY")
    send_calls(s, [big])
    ex = executor(s, {"search_kb": lambda c: Succeeded({"articles": "x" * 1_200_000})})
    try:
        drain(ex, 1)
    finally:
        ex.close()
    r = results(s, 1)[big["call_id"]]
    assert (r["outcome"], r["error_code"], r["taxonomy_class"]) == (
        "FAILED",
        "result_too_large",
        "OBSERVATION_NORMALIZATION_FAIL",
    )
    assert "the call ran" in r["error_message"] and r["data"] is None


def test_the_same_call_routed_twice_is_applied_once(
    support: tuple[Settings, SupportStore],
) -> None:
    s, store = support
    args = {"order_id": "WO-24680-B", "amount": 5, "currency": "USD", "reason_code": "damaged"}
    once = approved_call("refund_order", args, "CRITICAL_MUTATION")
    twice = {**once, "call_id": uuid.uuid4().hex}  # a second record, the same operation
    send_calls(s, [once, twice])
    ex = executor(s, store.handlers())
    try:
        drain(ex, 2)
    finally:
        ex.close()
    out = results(s, 2)
    assert out[once["call_id"]]["data"] == out[twice["call_id"]]["data"]
    assert refunded_cents(store) == 500


def test_a_cancel_that_failed_after_its_commit_publishes_the_cancelled_order(
    stack_settings: Settings, tmp_path: Path
) -> None:
    s = isolated(stack_settings, f"exec-partial-{uuid.uuid4().hex[:6]}")
    store = SupportStore(tmp_path / "support.db", fail_after_commit={"cancel_order"})
    store.seed([(f"{TENANT}/order/WO-12345-A", {"state": "processing", "owner": "CUS-004211"})])
    args = {"order_id": "WO-12345-A", "reason_code": "customer_request", "confirm": True}
    call = approved_call("cancel_order", args, "HIGH_RISK_EXTERNAL")
    send_calls(s, [call])
    ex = executor(s, store.handlers())
    try:
        drain(ex, 1)
    finally:
        ex.close()
        store.close()
    r = results(s, 1)[call["call_id"]]
    assert (r["outcome"], r["committed_steps"]) == ("FAILED", ["order_cancelled"])
    refs = {m.key(): m.value() for m in read_all(s, s.topics.reference, idle=1.0)}
    assert orjson.loads(refs[b"acme/order/WO-12345-A"])["state"] == "cancelled"


def test_the_cli_runs_the_support_executor_until_sigterm(
    stack_settings: Settings, tmp_path: Path
) -> None:
    s = isolated(stack_settings, f"exec-cli-{uuid.uuid4().hex[:6]}")
    name = uuid.uuid4().hex[:8]
    env = settings_env(s, name)
    db = tmp_path / "support.db"
    log_path = tmp_path / "executor.log"
    command = [sys.executable, "-m", "processor", "executor", "run", "--db", str(db),
               "--seed-demo", TENANT, "--classes", "high_risk_external,read_only",
               "--executor-id", name]  # fmt: skip
    with log_path.open("wb") as log:
        proc = subprocess.Popen(command, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        args = {"order_id": "WO-12345-A", "reason_code": "customer_request", "confirm": True}
        call = approved_call("cancel_order", args, "HIGH_RISK_EXTERNAL")
        send_calls(s, [call])
        r = results(s, 1)[call["call_id"]]
        assert r["outcome"] == "SUCCEEDED", r
        assert orjson.loads(r["data"]) == {"order_id": "WO-12345-A", "status": "cancelled"}
        refs = {m.key(): m.value() for m in read_all(s, s.topics.reference, idle=1.0)}
        assert orjson.loads(refs[b"acme/order/WO-12345-A"])["state"] == "cancelled"
    finally:
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(60)
    assert code == 0, log_path.read_text()
