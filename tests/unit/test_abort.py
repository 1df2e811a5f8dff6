"""Aborting a batch's transaction, with stand-ins for the clients: a failed transaction that
cannot even be aborted (librdkafka refuses the abort while a timed-out commit is still in
progress; its integration is the broker-outage suite), and a transaction opened for a batch
that then could not be decided (its integration is the Redis-outage suite)."""

from __future__ import annotations

import threading
import time
from collections import Counter
from types import SimpleNamespace
from typing import Any

import pytest
import redis
from confluent_kafka import KafkaError, KafkaException, TopicPartition
from prometheus_client import CollectorRegistry

from processor.app import DependencyDown, Fenced, Processor
from processor.config import Topics
from processor.metrics import Metrics


class _Producer:
    def __init__(self, refuse: bool) -> None:
        self.refuse = refuse
        self.aborts = 0

    def abort_transaction(self, timeout: float) -> None:
        self.aborts += 1
        if self.refuse:
            raise KafkaException(KafkaError(KafkaError._CONFLICT, "commit in progress"))


def _abort(producer: _Producer) -> Any:
    owner = SimpleNamespace(metrics=Metrics(CollectorRegistry()))
    failed = KafkaException(KafkaError(KafkaError._TIMED_OUT, "commit timed out", retriable=True))
    return Processor._abort(owner, producer, failed)  # type: ignore[arg-type]


def test_a_transaction_that_aborts_is_rewound_with_the_same_clients() -> None:
    producer = _Producer(refuse=False)
    assert isinstance(_abort(producer), KafkaException) and producer.aborts == 1


def test_a_transaction_that_cannot_be_aborted_rebuilds_the_clients() -> None:
    """Kept, the producer would refuse every later begin_transaction, and the loop would
    abort and rewind for ever."""
    producer = _Producer(refuse=True)
    outcome = _abort(producer)
    assert isinstance(outcome, Fenced) and "could not be aborted" in str(outcome)


class _Record:
    """A consumed record, as far as the loop looks at one before deciding it."""

    def __init__(self, offset: int) -> None:
        self._offset = offset

    def error(self) -> None:
        return None

    def topic(self) -> str:
        return "tool.proposals"

    def partition(self) -> int:
        return 0

    def offset(self) -> int:
        return self._offset


class _Clients:
    """The consumer and the transactional producer, recording what the loop asked."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    def consumer_group_metadata(self) -> object:
        return object()

    def committed(self, partitions: list[TopicPartition], timeout: float) -> list[TopicPartition]:
        return [TopicPartition(tp.topic, tp.partition, 5) for tp in partitions]

    def begin_transaction(self) -> None:
        self.calls.append("begin")

    def send_offsets_to_transaction(self, offsets: Any, group: Any, timeout: float) -> None:
        self.calls.append(f"offsets {[(tp.partition, tp.offset) for tp in offsets]}")

    def abort_transaction(self, timeout: float) -> None:
        self.calls.append("abort")

    def produce(self, *args: Any, **kwargs: Any) -> None:
        self.calls.append("produce")

    def commit_transaction(self, timeout: float) -> None:
        self.calls.append("commit")


class _Loop(Processor):
    """The loop's batch step alone: deciding fails as ``failure`` says, or, without one,
    takes ``deciding_s`` and decides nothing to write."""

    def __init__(self, failure: BaseException | None, deciding_s: float = 0.0) -> None:
        self.failure = failure
        self.deciding_s = deciding_s
        self.metrics = Metrics(CollectorRegistry())
        self.settings = SimpleNamespace(  # type: ignore[assignment]
            batch_max_records=100, transaction_timeout_ms=15000, topics=Topics()
        )
        self._rebalanced = False
        self._inflight = None
        self._redis_backoff = 0.0
        self._early_limit_s = 5.0
        self._stop = threading.Event()
        self._events = Counter()
        self._admitted = []
        self.admission = SimpleNamespace(take_redeliveries=list)  # type: ignore[assignment]
        self._unread = None
        self._committed_at = {}
        self.rewound: list[int] = []
        self.waited = False
        self.decided = 0

    def decide_batch(self, records: list[Any]) -> list[Any]:
        self.decided += 1
        if self.failure is not None:
            raise self.failure
        time.sleep(self.deciding_s)
        return []

    def encode_batch(self, records: list[Any], decisions: list[Any]) -> list[Any]:
        return []

    def _settle_inflight(self, consumer: Any, after: list[Any] | None = None) -> bool:
        batch, self._inflight = self._inflight, None
        return batch is None or batch.outcome.result(10) is None

    def _rewind(self, consumer: Any, records: list[Any]) -> None:
        self.rewound = [m.offset() for m in records]

    def _wait_for_redis(self, consumer: Any, records: list[Any], exc: Any) -> None:
        self.waited = True
        self._rewind(consumer, records)


def test_a_batch_keeping_up_sends_its_offsets_while_deciding_and_aborts_if_redis_fails() -> None:
    """A batch smaller than the maximum opens its transaction and sends its offsets before
    it is decided; when Redis then fails, that transaction is aborted before the batch is
    rewound: nothing of it commits, and the offsets sent go with the abort."""
    clients = _Clients()
    loop = _Loop(DependencyDown("redis: connection refused"))
    loop._process_batch(clients, clients, [_Record(7), _Record(8)])  # type: ignore[arg-type]
    assert clients.calls == ["begin", "offsets [(0, 9)]", "abort"]
    assert loop.waited and loop.rewound == [7, 8]
    assert loop._inflight is None


def test_a_defect_while_deciding_aborts_the_transaction_opened_for_the_batch() -> None:
    clients = _Clients()
    loop = _Loop(RuntimeError("a defect"))
    with pytest.raises(RuntimeError, match="a defect"):
        loop._process_batch(clients, clients, [_Record(3)])  # type: ignore[arg-type]
    assert clients.calls == ["begin", "offsets [(0, 4)]", "abort"]


def test_a_batch_decided_slowly_drops_its_early_transaction_and_commits_in_a_new_one() -> None:
    """Deciding counts against the transaction's timeout once the transaction is open: a
    batch that took longer than the loop allows is carried by a fresh transaction, which
    the broker will not time out under it."""
    clients = _Clients()
    registry = CollectorRegistry()
    loop = _Loop(None, deciding_s=0.05)
    loop.metrics = Metrics(registry)
    loop._early_limit_s = 0.01
    loop._process_batch(clients, clients, [_Record(5)])  # type: ignore[arg-type]
    assert clients.calls == [
        "begin", "offsets [(0, 6)]", "abort",  # opened early, then dropped
        "begin", "offsets [(0, 6)]", "commit",
    ]  # fmt: skip
    assert registry.get_sample_value("toolsentry_transactions_total", {"result": "abandoned"}) == 1


def test_no_transaction_is_opened_early_while_redis_is_waited_out() -> None:
    clients = _Clients()
    loop = _Loop(DependencyDown("redis: connection refused"))
    loop._redis_backoff = 0.4  # the previous batch met Redis down
    loop._process_batch(clients, clients, [_Record(1)])  # type: ignore[arg-type]
    assert clients.calls == []
    assert loop.waited and loop.rewound == [1]


def test_stuck_producers_are_let_go_once_their_call_returns_and_too_many_stop_the_process() -> None:
    """A producer given up inside librdkafka is kept only while its call may still be
    inside it; more than MAX_STUCK_PRODUCERS at once and the processor exits for a
    clean restart instead of accumulating librdkafka's threads."""
    from concurrent.futures import Future

    from processor.app import MAX_STUCK_PRODUCERS, StuckForGood

    owner = SimpleNamespace(metrics=Metrics(CollectorRegistry()), _stuck_producers=[])
    returned: Future[None] = Future()
    returned.set_result(None)
    assert isinstance(Processor._stuck(owner, object(), returned, "commit", 45), Fenced)  # type: ignore[arg-type]
    hanging = [Future() for _ in range(MAX_STUCK_PRODUCERS)]
    for call in hanging:
        assert isinstance(Processor._stuck(owner, object(), call, "commit", 45), Fenced)  # type: ignore[arg-type]
    # The one whose call returned was let go: exactly the maximum is held.
    assert len(owner._stuck_producers) == MAX_STUCK_PRODUCERS
    with pytest.raises(StuckForGood, match=f"{MAX_STUCK_PRODUCERS + 1} Kafka producers"):
        Processor._stuck(owner, object(), Future(), "send_offsets_to_transaction", 45)  # type: ignore[arg-type]


def test_a_revoke_touches_only_the_proposals_lag_series_and_never_raises() -> None:
    """tool.approvals[0] revoked after tool.proposals[0] removed the series "0" a second
    time (prometheus-client 0.20 and 0.21 raise KeyError for that, out of the rebalance
    callback, and the processor stopped); it also wiped the proposals' series."""
    metrics = Metrics(CollectorRegistry())
    metrics.consumer_lag.labels("0").set(5)
    metrics.consumer_lag.labels("1").set(7)
    owner = SimpleNamespace(
        metrics=metrics,
        settings=SimpleNamespace(topics=SimpleNamespace(proposals="tool.proposals")),
        _rebalanced=False,
        _assigned={("tool.proposals", 0), ("tool.approvals", 1), ("tool.results", 1)},
        _committed_at={},
        _settle_inflight=lambda consumer: True,
        _count_assigned=lambda: None,
    )
    revoked = [
        TopicPartition(topic, partition)
        for topic, partition in [("tool.approvals", 1), ("tool.results", 1),
                                 ("tool.proposals", 0), ("tool.proposals", 3)]
    ]  # fmt: skip
    Processor._on_revoke(owner, None, revoked)  # type: ignore[arg-type]
    series = {s.labels["partition"]: s.value for s in metrics.consumer_lag.collect()[0].samples}
    assert series == {"1": 7}


class _Store:
    def __init__(self) -> None:
        self.postponed = 0

    def forget_ended(self, now_ms: int) -> int:
        return 0

    def due(self, now_ms: int) -> list[tuple[str, str]]:
        return [("acme", "req-1")]

    def postpone(self, due: list[tuple[str, str]], until_ms: int) -> None:
        self.postponed += 1


class _SweepProducer:
    def __init__(self, failure: Exception | None) -> None:
        self.failure = failure

    def produce(self, *args: Any) -> None:
        if self.failure is not None:
            raise self.failure

    def flush(self, timeout: float) -> int:
        return 0


@pytest.mark.parametrize(
    ("failure", "replaced"),
    [
        (KafkaException(KafkaError(KafkaError._FATAL, "sequence gap", fatal=True)), True),
        (KafkaException(KafkaError(KafkaError._TRANSPORT, "broker down")), False),
        (RuntimeError("a defect"), False),
    ],
)
def test_the_expiry_sweeper_outlives_its_failures_and_replaces_a_failed_producer(
    failure: Exception, replaced: bool
) -> None:
    """A producer that failed for good refuses every record: kept, no parked call would be
    answered as expired again. Nothing the sweep raises ends the thread."""
    from processor.app import ExpirySweeper

    stop = threading.Event()
    store = _Store()
    made: list[_SweepProducer] = []

    def new_producer() -> _SweepProducer:
        made.append(_SweepProducer(failure if not made else None))
        return made[-1]

    sweeper = ExpirySweeper(
        SimpleNamespace(topics=SimpleNamespace(approvals="tool.approvals")),  # type: ignore[arg-type]
        store,  # type: ignore[arg-type]
        Metrics(CollectorRegistry()),
        stop,
        every_s=0.01,
    )
    sweeper.new_producer = new_producer  # type: ignore[method-assign]
    sweeper.start()
    deadline = time.monotonic() + (10 if replaced else 0.5)
    while store.postponed == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert sweeper.is_alive()  # nothing it met ended it
    stop.set()
    sweeper.join(5)
    assert len(made) == (2 if replaced else 1)
    assert (store.postponed > 0) is replaced


def test_no_batch_is_decided_before_the_replay_markers_of_its_partitions_are_read() -> None:
    """Assigned while Redis could not answer, the processor does not know where a crashed
    predecessor's calls wait for their replay (see AdmissionStore.forget_committed): a
    proposal decided again there may have to give its call back. So each batch is rewound
    and waited out until the markers are read, then decided."""
    down = redis.ConnectionError("connection refused")
    read: list[dict[tuple[str, int], int]] = []

    def forget_committed(committed: dict[tuple[str, int], int]) -> int:
        if down is not None:
            raise down
        read.append(committed)
        return 0

    clients = _Clients()
    loop = _Loop(None)
    loop.admission.forget_committed = forget_committed  # type: ignore[attr-defined]
    assigned = [TopicPartition("tool.proposals", 0)]
    loop._forget_committed(clients, assigned)  # type: ignore[arg-type]  # (the assignment)
    for _ in range(2):
        loop._process_batch(clients, clients, [_Record(5)])  # type: ignore[arg-type]
        assert (loop.decided, loop.waited, loop.rewound) == (0, True, [5])
    down = None
    loop.waited = False
    loop._process_batch(clients, clients, [_Record(5)])  # type: ignore[arg-type]
    assert (loop.decided, loop.waited) == (1, False)
    assert read == [{("tool.proposals", 0): 5}] and loop._unread is None
    assert clients.calls[-1] == "commit"


def test_a_batch_s_results_and_approvals_are_not_timed_as_proposals() -> None:
    """toolsentry_decision_seconds is the gates' time per proposal: the decisions of a
    batch's results and approval decisions, which pass no gate, are left out of it (one
    observed at 0 s per result would hide the proposals' latency), and still counted as
    records of the batch."""
    from processor.model import Decision, Gate, Outcome, SourceRecord

    topics = Topics()
    decisions = [
        Decision(SourceRecord(topic, 0, 1, None, b"{}", 0), Outcome.IGNORED, Gate.APPROVAL, None)
        for topic in (topics.proposals, topics.results, topics.approvals)
    ]
    decisions[0].latency_ms = 0.5
    settled: list[Any] = []

    class _Deciding(_Loop):
        def decide_batch(self, records: list[Any]) -> list[Any]:
            return decisions

        def _settle_inflight(self, consumer: Any, after: list[Any] | None = None) -> bool:
            settled.append(self._inflight)
            return super()._settle_inflight(consumer, after)

    clients = _Clients()
    loop = _Deciding(None)
    loop._process_batch(clients, clients, [_Record(5)])  # type: ignore[arg-type]
    [batch] = [b for b in settled if b is not None]
    assert batch.tally.latencies == [0.0005] and batch.tally.records == 3
