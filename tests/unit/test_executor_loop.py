"""The executor's batch step with stand-ins for its clients: a batch read while its
partitions moved is not run, a commit is retried only within the transaction's own
timeout, a record that is not an approved call is dead-lettered in the batch's
transaction, and a call of a schema the executor does not know holds its partition (the
integration of all of these is tests/integration/test_executor.py)."""

from __future__ import annotations

import time
from typing import Any

import orjson
import pytest
from confluent_kafka import KafkaError, KafkaException, TopicPartition
from prometheus_client import CollectorRegistry

from processor import executor as executor_module
from processor.codec.avro import AvroCodec, codec
from processor.codec.records import (
    ID_MAX_CHARS,
    decode_approved_call,
    decode_result,
    encode_approved_call,
)
from processor.config import Settings
from processor.contracts.registry import ContractSet
from processor.executor import Call, Executor, Succeeded
from processor.model import Outcome
from tests.unit.helpers import SCHEMAS_DIR, Consumed, decide_envelope, envelope


class _Consumer:
    """Hands out one batch; ``moved`` runs inside poll(), as a rebalance callback would."""

    def __init__(self, records: list[Consumed], moved: Any = None) -> None:
        self.records, self.moved = records, moved
        self.seeks: list[tuple[str, int, int]] = []
        self.paused: set[tuple[str, int]] = set()

    def poll(self, timeout: float) -> Consumed | None:
        if self.moved is not None:
            self.moved()
        return self.records[0] if self.records else None

    def consume(self, n: int, timeout: float) -> list[Consumed]:
        return self.records[1:]

    def seek(self, tp: TopicPartition) -> None:
        self.seeks.append((tp.topic, tp.partition, tp.offset))

    def pause(self, partitions: list[TopicPartition]) -> None:
        self.paused |= {(tp.topic, tp.partition) for tp in partitions}

    def resume(self, partitions: list[TopicPartition]) -> None:
        self.paused -= {(tp.topic, tp.partition) for tp in partitions}

    def consumer_group_metadata(self) -> object:
        return object()


class _Producer:
    """Records the transactional calls; commit fails as ``commits`` says, in turn."""

    def __init__(self, commits: list[KafkaError | None] | None = None) -> None:
        self.commits = list(commits or [])
        self.calls: list[str] = []
        self.produced: list[dict[str, Any]] = []
        self.offsets: list[tuple[str, int, int]] = []

    def begin_transaction(self) -> None:
        self.calls.append("begin")

    def send_offsets_to_transaction(self, offsets: Any, group: Any, timeout: float) -> None:
        self.calls.append("offsets")
        self.offsets += [(tp.topic, tp.partition, tp.offset) for tp in offsets]

    def produce(self, topic: str, **kwargs: Any) -> None:
        self.calls.append("produce")
        self.produced.append({"topic": topic, **kwargs})

    def commit_transaction(self, timeout: float) -> None:
        self.calls.append("commit")
        failure = self.commits.pop(0) if self.commits else None
        if failure is not None:
            raise KafkaException(failure)

    def abort_transaction(self, timeout: float) -> None:
        self.calls.append("abort")


def _rig(now_ms: int, **kw: Any) -> tuple[Executor, _Producer, _Consumer, str]:
    """An executor with no records yet, its clock stopped at ``now_ms``, and its topic."""
    producer, consumer = _Producer(), _Consumer([])
    executor = _executor(consumer, producer, **kw)
    executor.clock = lambda: now_ms / 1000
    return executor, producer, consumer, executor.topics[0]


def _executor(
    consumer: _Consumer,
    producer: _Producer,
    timeout_ms: int = 60_000,
    ran: list[Call] | None = None,
    registry: CollectorRegistry | None = None,
) -> Executor:
    def lookup(call: Call) -> Succeeded:
        if ran is not None:
            ran.append(call)
        return Succeeded({"state": "processing"})

    executor = Executor(
        Settings(transaction_timeout_ms=timeout_ms),
        {"lookup_order": lookup},
        ["READ_ONLY"],
        metrics_registry=registry,
    )
    executor._consumer, executor._producer = consumer, producer  # type: ignore[assignment]
    executor._assigned = {(executor.topics[0], 0), (executor.topics[0], 1)}
    return executor


def test_a_batch_read_while_its_partitions_moved_is_rewound_not_run(
    contracts: ContractSet,
) -> None:
    """Records of a partition revoked inside poll() would run here and at its new owner."""
    d = decide_envelope(envelope("lookup_order", arguments={"order_id": "WO-12345-A"}), contracts)
    assert d.outcome is Outcome.ROUTED
    call = encode_approved_call(d, None)
    ran: list[Call] = []
    producer, consumer = _Producer(), _Consumer([])
    executor = _executor(consumer, producer, ran=ran)
    executor.clock = lambda: (d.decided_at_ms or 0) / 1000  # within the call's deadline
    consumer.records = [
        Consumed(executor.topics[0], 4, call),
        Consumed(executor.topics[0], 5, call),
    ]
    consumer.moved = lambda: setattr(executor, "_rebalanced", True)
    assert executor.run_once(0.1) == 0
    assert ran == [] and producer.calls == []  # nothing ran, was published or committed
    assert consumer.seeks == [(executor.topics[0], 0, 4)]
    consumer.moved = None
    assert executor.run_once(0.1) == 2  # read again under the new assignment: run
    assert [c.tool_name for c in ran] == ["lookup_order", "lookup_order"]
    assert producer.calls == ["begin", "offsets", "produce", "produce", "commit"]


def test_a_stop_starts_no_more_calls_and_commits_those_that_finished(
    contracts: ContractSet,
) -> None:
    """A SIGTERM while a batch runs: the call in hand finishes and is committed with the
    calls before it; the calls after it are neither run nor committed, but left to their
    partitions' next owner. Run, each would hold the shutdown for its handler's run time,
    past an orchestrator's grace period and its SIGKILL, which could land mid-call."""
    call, now_ms = _approved_call(contracts)
    executor, producer, consumer, topic = _rig(now_ms)
    ran: list[str] = []

    def lookup(c: Call) -> Succeeded:
        ran.append(c.call_id)
        if len(ran) == 2:
            executor.stop()  # the signal arrives while this call runs
        return Succeeded({"state": "processing"})

    executor.handlers["lookup_order"] = lookup
    batch = [(0, 4), (1, 20), (0, 5), (1, 21)]
    consumer.records = [
        Consumed(topic, offset, _call_id(call, f"c-{partition}-{offset}"), partition)
        for partition, offset in batch
    ]
    assert executor.run_once(0.1) == 2
    assert ran == ["c-0-4", "c-1-20"]
    assert producer.calls == ["begin", "offsets", "produce", "produce", "commit"]
    assert [decode_result(p["value"])["call_id"] for p in producer.produced] == ran
    # Each partition up to its last finished call: the next owner starts at the first left.
    assert producer.offsets == [(topic, 0, 5), (topic, 1, 21)]

    consumer.records = consumer.records[2:]
    assert executor.run_once(0.1) == 0  # stopped: nothing is started any more
    assert len(ran) == 2 and producer.calls.count("begin") == 1


def test_a_batch_that_has_run_for_batch_max_s_starts_no_more_calls(
    contracts: ContractSet, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Handlers slow enough that a batch would outlast the consumer's max.poll.interval.ms:
    the group would move its partitions and the whole batch would run again elsewhere, and
    again there. Once it has run for ``batch_max_s`` the batch starts no more calls; those
    that ran are committed, and the rest are read again, from their first, and run in the
    next batch, in order."""
    call, now_ms = _approved_call(contracts)
    registry = CollectorRegistry()
    executor, producer, consumer, topic = _rig(now_ms, registry=registry)
    executor.batch_max_s = 10.0
    clock = [1000.0]
    monkeypatch.setattr(executor_module.time, "monotonic", lambda: clock[0])
    ran: list[str] = []

    def lookup(c: Call) -> Succeeded:
        ran.append(c.call_id)
        clock[0] += 4.0  # each call takes 4 s
        return Succeeded({"state": "processing"})

    executor.handlers["lookup_order"] = lookup
    batch = [(0, 4), (1, 20), (0, 5), (1, 21), (0, 6)]
    consumer.records = [
        Consumed(topic, offset, _call_id(call, f"c-{partition}-{offset}"), partition)
        for partition, offset in batch
    ]
    assert executor.run_once(0.1) == 3  # 0 s, 4 s, 8 s in: started; 12 s in: not
    assert ran == ["c-0-4", "c-1-20", "c-0-5"]
    assert producer.offsets == [(topic, 0, 6), (topic, 1, 21)]
    assert consumer.seeks == [(topic, 1, 21), (topic, 0, 6)]  # the first left of each
    assert registry.get_sample_value("toolsentry_executor_batches_cut_total") == 1

    consumer.records = consumer.records[3:]
    assert executor.run_once(0.1) == 2
    assert ran[3:] == ["c-1-21", "c-0-6"]
    assert [decode_result(p["value"])["call_id"] for p in producer.produced] == ran


def test_a_batch_always_starts_one_call_and_by_default_ends_at_half_the_poll_interval(
    contracts: ContractSet, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A handler that alone outlasts ``batch_max_s`` still runs (and its partition moves
    on); the budget follows the consumer's max.poll.interval.ms, which the settings may
    name."""
    assert Executor(Settings(), {}, ["READ_ONLY"]).batch_max_s == 150.0
    named = Settings(consumer={"max.poll.interval.ms": 60_000})
    assert Executor(named, {}, ["READ_ONLY"]).batch_max_s == 30.0
    with pytest.raises(ValueError, match="batch_max_s"):
        Executor(Settings(), {}, ["READ_ONLY"], batch_max_s=-1.0)

    call, now_ms = _approved_call(contracts)
    ran: list[Call] = []
    executor, _, consumer, topic = _rig(now_ms, ran=ran)
    executor.batch_max_s = 0.0
    consumer.records = [Consumed(topic, 4, call), Consumed(topic, 5, call)]
    assert executor.run_once(0.1) == 1
    assert len(ran) == 1 and consumer.seeks == [(topic, 0, 5)]


def test_a_stop_asked_for_while_a_batch_is_read_runs_none_of_it(contracts: ContractSet) -> None:
    call, now_ms = _approved_call(contracts)
    ran: list[Call] = []
    executor, producer, consumer, topic = _rig(now_ms, ran=ran)
    consumer.records = [Consumed(topic, 4, call), Consumed(topic, 5, call)]
    consumer.moved = executor.stop  # inside poll(), as a signal would come
    assert executor.run_once(0.1) == 0
    assert ran == [] and producer.calls == []  # nothing run, published or committed


def _retriable() -> KafkaError:
    return KafkaError(KafkaError._TIMED_OUT, "commit timed out", retriable=True)


def test_a_commit_is_retried_while_librdkafka_calls_it_retriable() -> None:
    producer = _Producer([_retriable(), _retriable(), None])
    executor = _executor(_Consumer([]), producer)
    executor._commit(producer)  # type: ignore[arg-type]
    assert producer.calls == ["commit"] * 3


def test_a_commit_is_not_retried_past_the_transaction_timeout() -> None:
    """The coordinator aborts the transaction then: retrying longer only delays the
    rewind (and holds a stop or a rebalance)."""
    producer = _Producer([_retriable()] * 1000)
    executor = _executor(_Consumer([]), producer, timeout_ms=50)

    def slow_commit(timeout: float) -> None:
        time.sleep(0.01)
        _Producer.commit_transaction(producer, timeout)

    producer.commit_transaction = slow_commit  # type: ignore[method-assign]
    started = time.monotonic()
    with pytest.raises(KafkaException):
        executor._commit(producer)  # type: ignore[arg-type]
    assert time.monotonic() - started < 1.0
    assert 2 <= producer.calls.count("commit") <= 20


def test_a_commit_is_not_retried_once_a_stop_was_asked_for() -> None:
    producer = _Producer([_retriable()] * 10)
    executor = _executor(_Consumer([]), producer)
    executor.stop()
    with pytest.raises(KafkaException):
        executor._commit(producer)  # type: ignore[arg-type]
    assert producer.calls == ["commit"]


def test_a_commit_that_failed_for_good_is_not_retried() -> None:
    producer = _Producer([KafkaError(KafkaError._FENCED, "fenced", fatal=True), None])
    executor = _executor(_Consumer([]), producer)
    with pytest.raises(KafkaException):
        executor._commit(producer)  # type: ignore[arg-type]
    assert producer.calls == ["commit"]


def _approved_call(contracts: ContractSet) -> tuple[bytes, int]:
    """A routed lookup as the processor writes it, and a clock time within its deadline."""
    d = decide_envelope(envelope("lookup_order", arguments={"order_id": "WO-12345-A"}), contracts)
    assert d.outcome is Outcome.ROUTED
    return encode_approved_call(d, None), d.decided_at_ms or 0


def _newer_call(value: bytes) -> bytes:
    """The same call as a newer processor writes it: its schema has a field more."""
    schema = orjson.loads((SCHEMAS_DIR / "approved_call.avsc").read_bytes())
    schema["fields"].append({"name": "priority", "type": "int", "default": 0})
    return AvroCodec(schema).encode_checked({**decode_approved_call(value), "priority": 1})


def test_records_that_are_not_calls_are_dead_lettered_in_the_batch_s_transaction(
    contracts: ContractSet,
) -> None:
    """Skipped, a call its executor cannot read never gets an answer and nobody can tell:
    the DLQ keeps it with the reason, committed with the offsets, like the processor's."""
    call, now_ms = _approved_call(contracts)
    observation = codec("observation").header + b"\x00"  # another schema: never a call
    corrupt = codec("approved_call").header + b"\xff\xff\xff"
    registry = CollectorRegistry()
    executor, producer, consumer, topic = _rig(now_ms, registry=registry)
    values = [b"not avro", call, corrupt, observation]
    consumer.records = [Consumed(topic, 7 + i, v) for i, v in enumerate(values)]
    assert executor.run_once(0.1) == 4
    assert producer.calls == ["begin", "offsets", *["produce"] * 4, "commit"]
    assert producer.offsets == [(topic, 0, 11)]
    dead = [p for p in producer.produced if p["topic"] == executor.settings.topics.call_dlq]
    assert [p["value"] for p in dead] == [b"not avro", corrupt, observation]
    headers = [dict(p["headers"]) for p in dead]
    assert {h["toolsentry.error.reason"] for h in headers} == {b"approved_call_invalid"}
    assert [h["toolsentry.source.offset"] for h in headers] == [b"7", b"9", b"10"]
    assert headers[0]["toolsentry.source.topic"] == topic.encode()
    assert dead[0]["key"] == b"run-1"
    [result] = [p for p in producer.produced if p["topic"] == executor.settings.topics.results]
    assert decode_result(result["value"])["outcome"] == "SUCCEEDED"
    assert executor.undecodable == 3
    assert registry.get_sample_value("toolsentry_executor_undecodable_total") == 3
    assert consumer.paused == set() and consumer.seeks == []


def test_a_call_of_an_unknown_schema_holds_its_partition_and_nothing_after_it_runs(
    contracts: ContractSet,
) -> None:
    """A newer processor's call (a rolling upgrade changed the schema) is neither run nor
    skipped: the partition waits at it, so an executor that knows the schema runs it."""
    call, now_ms = _approved_call(contracts)
    registry = CollectorRegistry()
    ran: list[Call] = []
    executor, producer, consumer, topic = _rig(now_ms, ran=ran, registry=registry)
    consumer.records = [
        Consumed(topic, 4, call),
        Consumed(topic, 5, _newer_call(call)),
        Consumed(topic, 6, call),
        Consumed(topic, 20, call, partition=1),  # another partition carries on
    ]
    assert executor.run_once(0.1) == 2
    assert len(ran) == 2
    assert producer.offsets == [(topic, 0, 5), (topic, 1, 21)]  # not past the held call
    assert [p["topic"] for p in producer.produced] == [executor.settings.topics.results] * 2
    assert consumer.paused == {(topic, 0)} and consumer.seeks == [(topic, 0, 5)]
    assert registry.get_sample_value("toolsentry_executor_unknown_schema_total") == 1
    assert executor.undecodable == 0

    # Read again once the hold is over: still unknown here, held again, and counted.
    assert executor._held[(topic, 0)] > time.monotonic() + executor_module.HOLD_S - 1
    executor._held[(topic, 0)] = 0.0
    consumer.records = [Consumed(topic, 5, _newer_call(call)), Consumed(topic, 6, call)]
    assert executor.run_once(0.1) == 0
    assert len(ran) == 2 and producer.calls.count("commit") == 1
    assert consumer.paused == {(topic, 0)} and consumer.seeks[-1] == (topic, 0, 5)
    assert registry.get_sample_value("toolsentry_executor_unknown_schema_total") == 2


def test_a_held_partition_is_resumed_after_the_hold(contracts: ContractSet) -> None:
    call, now_ms = _approved_call(contracts)
    executor, producer, consumer, topic = _rig(now_ms)
    consumer.records = [Consumed(topic, 5, _newer_call(call))]
    assert executor.run_once(0.1) == 0
    assert consumer.paused == {(topic, 0)} and producer.calls == []
    consumer.records = []
    executor.run_once(0.1)
    assert consumer.paused == {(topic, 0)}  # not yet
    executor._held[(topic, 0)] = 0.0  # the hold is over
    executor.run_once(0.1)
    assert consumer.paused == set()
    executor._held[(topic, 0)] = 0.0
    executor._on_revoke(consumer, [TopicPartition(topic, 0)])  # type: ignore[arg-type]
    assert executor._held == {}  # its next owner reads it afresh


def _call_id(value: bytes, call_id: str) -> bytes:
    """The same call under another call id."""
    return codec("approved_call").encode({**decode_approved_call(value), "call_id": call_id})


def _unrunnable(value: bytes, **fields: Any) -> bytes:
    """The same call as another writer might put it: decodes, but cannot be run."""
    return codec("approved_call").encode({**decode_approved_call(value), **fields})


def test_a_call_that_cannot_be_run_is_answered_as_not_run_and_dead_lettered(
    contracts: ContractSet,
) -> None:
    """Dead-lettered only, its agent would hear nothing until the call's deadline and grace
    passed. It names its call, so that call is answered too, in the same transaction, as
    not run; a record that names no call (no idempotency key) is only dead-lettered."""
    call, now_ms = _approved_call(contracts)
    listed = _unrunnable(call, arguments='["WO-12345-A"]')
    broken = _unrunnable(call, call_id="c-broken", arguments='{"order_id": WO-1')
    nameless = _unrunnable(call, call_id="c-nameless", arguments="7", idempotency_key="")
    registry = CollectorRegistry()
    ran: list[Call] = []
    executor, producer, consumer, topic = _rig(now_ms, ran=ran, registry=registry)
    values = [listed, broken, nameless]
    consumer.records = [Consumed(topic, 3 + i, v) for i, v in enumerate(values)]
    assert executor.run_once(0.1) == 3
    assert ran == []
    assert producer.calls == ["begin", "offsets", *["produce"] * 5, "commit"]
    assert producer.offsets == [(topic, 0, 6)]
    dead = [p for p in producer.produced if p["topic"] == executor.settings.topics.call_dlq]
    assert [p["value"] for p in dead] == values
    answers = [
        decode_result(p["value"])
        for p in producer.produced
        if p["topic"] == executor.settings.topics.results
    ]
    original = decode_approved_call(call)
    assert [r["call_id"] for r in answers] == [original["call_id"], "c-broken"]
    for r in answers:
        assert (r["outcome"], r["error_code"], r["taxonomy_class"], r["retryable"]) == (
            "FAILED", "approved_call_invalid", "UNKNOWN_ERROR", False,
        )  # fmt: skip
        assert r["committed_steps"] == [] and r["data"] is None
        assert (r["idempotency_key"], r["attempt"]) == (original["idempotency_key"], 1)
        assert "WO-" not in r["error_message"]
    assert "not a JSON object" in answers[0]["error_message"]
    assert "not valid JSON" in answers[1]["error_message"]
    assert executor.undecodable == 3
    labels = {"tool": executor_module.UNREADABLE_TOOL, "outcome": "FAILED"}
    assert registry.get_sample_value("toolsentry_executor_results_total", labels) == 2


@pytest.mark.parametrize(
    "name",
    ["call_id", "run_id", "tenant_id", "trace_id", "tool_version", "payload_hash",
     "idempotency_key", "contract_set"],
)  # fmt: skip
def test_a_call_naming_an_id_longer_than_any_the_processor_writes_is_not_run(
    contracts: ContractSet, name: str
) -> None:
    """Its result, keyed by its run and naming its ids, could be too large to publish, and
    the batch would then never commit. Not run, not answered: dead-lettered; an id at the
    bound is a call like any other."""
    call, now_ms = _approved_call(contracts)
    fields = {name: "x" * (ID_MAX_CHARS + 1)}
    if name == "call_id":
        fields["proposal_id"] = fields[name]
    at_bound = _unrunnable(call, **{k: "y" * ID_MAX_CHARS for k in fields})
    ran: list[Call] = []
    executor, producer, consumer, topic = _rig(now_ms, ran=ran)
    consumer.records = [
        Consumed(topic, 3, _unrunnable(call, **fields)),
        Consumed(topic, 4, at_bound),
    ]
    assert executor.run_once(0.1) == 2
    assert len(ran) == 1 and getattr(ran[0], name) == "y" * ID_MAX_CHARS
    topics = [p["topic"] for p in producer.produced]
    assert topics == [executor.settings.topics.call_dlq, executor.settings.topics.results]
    assert executor.undecodable == 1


def test_the_answer_to_a_call_that_cannot_be_run_is_not_kept_for_a_redelivery(
    contracts: ContractSet,
) -> None:
    """An aborted batch's answers stand in for their calls when the batch comes back. The
    answer to an unreadable record is not kept: under the ids that record claims, it would
    stand in for the real call carrying the same ids, which would then never run."""
    call, now_ms = _approved_call(contracts)
    ran: list[Call] = []
    failed = KafkaError(KafkaError._TIMED_OUT, "commit failed", retriable=False)
    producer, consumer = _Producer([failed]), _Consumer([])
    executor = _executor(consumer, producer, ran=ran)
    executor.clock = lambda: now_ms / 1000
    topic = executor.topics[0]
    consumer.records = [Consumed(topic, 3, _unrunnable(call, arguments="[]"))]
    assert executor.run_once(0.1) == 0  # aborted and rewound
    assert executor._given_back == {}
    consumer.records = [Consumed(topic, 3, call)]
    assert executor.run_once(0.1) == 1
    assert len(ran) == 1
    [r] = [decode_result(p["value"]) for p in producer.produced[-1:]]
    assert r["outcome"] == "SUCCEEDED"


def test_calls_of_tools_without_a_handler_share_one_tool_label(contracts: ContractSet) -> None:
    """Whoever writes a call names its tool: a label per name would grow the executor's
    series without bound. A stream of calls of invented tools adds one series, and a
    tool the executor serves keeps its own."""
    call, now_ms = _approved_call(contracts)
    registry = CollectorRegistry()
    executor, producer, consumer, topic = _rig(now_ms, registry=registry)
    invented = [_unrunnable(call, call_id=f"c-{i}", tool_name=f"tool-{i}") for i in range(50)]
    consumer.records = [Consumed(topic, i, v) for i, v in enumerate([call, *invented])]
    assert executor.run_once(0.1) == 51
    answers = [decode_result(p["value"]) for p in producer.produced]
    assert [r["error_code"] for r in answers[1:]] == ["no_handler"] * 50
    [family] = [m for m in registry.collect() if m.name == "toolsentry_executor_results"]
    series = {
        (s.labels["tool"], s.labels["outcome"]): s.value
        for s in family.samples
        if s.name.endswith("_total")
    }
    assert series == {
        ("lookup_order", "SUCCEEDED"): 1,
        (executor_module.NO_HANDLER_TOOL, "FAILED"): 50,
    }


@pytest.mark.parametrize("stored", [{"succeeded": True}, "SUCCEEDED", 7])
def test_a_recorded_answer_that_is_not_an_answer_fails_closed(
    contracts: ContractSet, stored: object
) -> None:
    """``recorded`` is the handlers' code, as a handler is: what it returns is checked as a
    handler's answer is. Not an answer, it would stop the loop at every delivery of the
    batch; it is a handler error, and the batch commits."""
    call, _ = _approved_call(contracts)
    late_ms = decode_approved_call(call)["deadline"] + 1
    ran: list[Call] = []
    executor, producer, consumer, topic = _rig(late_ms, ran=ran)
    executor.recorded = lambda c: stored  # type: ignore[assignment,return-value]
    consumer.records = [Consumed(topic, 4, call)]
    assert executor.run_once(0.1) == 1
    assert ran == []
    [r] = [decode_result(p["value"]) for p in producer.produced]
    assert (r["outcome"], r["error_code"], r["taxonomy_class"]) == (
        "FAILED", "handler_error", "UNKNOWN_ERROR",
    )  # fmt: skip
    assert producer.calls[-1] == "commit"
