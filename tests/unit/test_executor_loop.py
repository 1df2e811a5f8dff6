"""The executor's batch step with stand-ins for its clients: a batch read while its
partitions moved is not run, and a commit is retried only within the transaction's own
timeout (the integration of both is tests/integration/test_executor.py)."""

from __future__ import annotations

import time
from typing import Any

import pytest
from confluent_kafka import KafkaError, KafkaException, TopicPartition

from processor.codec.records import encode_approved_call
from processor.config import Settings
from processor.contracts.registry import ContractSet
from processor.executor import Call, Executor, Succeeded
from processor.model import Outcome
from tests.unit.helpers import decide_envelope, envelope


class _Record:
    def __init__(self, topic: str, offset: int, value: bytes) -> None:
        self._topic, self._offset, self._value = topic, offset, value

    def error(self) -> None:
        return None

    def topic(self) -> str:
        return self._topic

    def partition(self) -> int:
        return 0

    def offset(self) -> int:
        return self._offset

    def key(self) -> bytes:
        return b"run-1"

    def value(self) -> bytes:
        return self._value


class _Consumer:
    """Hands out one batch; ``moved`` runs inside poll(), as a rebalance callback would."""

    def __init__(self, records: list[_Record], moved: Any = None) -> None:
        self.records, self.moved = records, moved
        self.seeks: list[tuple[str, int, int]] = []

    def poll(self, timeout: float) -> _Record | None:
        if self.moved is not None:
            self.moved()
        return self.records[0] if self.records else None

    def consume(self, n: int, timeout: float) -> list[_Record]:
        return self.records[1:]

    def seek(self, tp: TopicPartition) -> None:
        self.seeks.append((tp.topic, tp.partition, tp.offset))

    def consumer_group_metadata(self) -> object:
        return object()


class _Producer:
    """Records the transactional calls; commit fails as ``commits`` says, in turn."""

    def __init__(self, commits: list[KafkaError | None] | None = None) -> None:
        self.commits = list(commits or [])
        self.calls: list[str] = []

    def begin_transaction(self) -> None:
        self.calls.append("begin")

    def send_offsets_to_transaction(self, offsets: Any, group: Any, timeout: float) -> None:
        self.calls.append("offsets")

    def produce(self, *args: Any, **kwargs: Any) -> None:
        self.calls.append("produce")

    def commit_transaction(self, timeout: float) -> None:
        self.calls.append("commit")
        failure = self.commits.pop(0) if self.commits else None
        if failure is not None:
            raise KafkaException(failure)

    def abort_transaction(self, timeout: float) -> None:
        self.calls.append("abort")


def _executor(
    consumer: _Consumer,
    producer: _Producer,
    timeout_ms: int = 60_000,
    ran: list[Call] | None = None,
) -> Executor:
    def lookup(call: Call) -> Succeeded:
        if ran is not None:
            ran.append(call)
        return Succeeded({"state": "processing"})

    executor = Executor(
        Settings(transaction_timeout_ms=timeout_ms), {"lookup_order": lookup}, ["READ_ONLY"]
    )
    executor._consumer, executor._producer = consumer, producer  # type: ignore[assignment]
    executor._assigned = {(executor.topics[0], 0)}
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
    consumer.records = [_Record(executor.topics[0], 4, call), _Record(executor.topics[0], 5, call)]
    consumer.moved = lambda: setattr(executor, "_rebalanced", True)
    assert executor.run_once(0.1) == 0
    assert ran == [] and producer.calls == []  # nothing ran, was published or committed
    assert consumer.seeks == [(executor.topics[0], 0, 4)]
    consumer.moved = None
    assert executor.run_once(0.1) == 2  # read again under the new assignment: run
    assert [c.tool_name for c in ran] == ["lookup_order", "lookup_order"]
    assert producer.calls == ["begin", "offsets", "produce", "produce", "commit"]


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
